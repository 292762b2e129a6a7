"""`--prompt-data DIR` (issue 33): a directory of .jsonl/.parquet shards, a `datasets` save_to_disk
directory, and a Hub dataset id refused with "download it first"."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.resolve import resolve
from rlslurm.rollout.data import PromptSource
from rlslurm.rollout.prompt_records import count_records, validate_prompt_file


def records(lo: int, hi: int) -> list[dict]:
    return [{"prompt": f"q{i}", "label": str(i)} for i in range(lo, hi)]


def write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def shard_dir(tmp_path: Path) -> Path:
    """Records 0-9 over three shards in name order: two JSON Lines files and a parquet file, plus what a
    downloaded dataset directory also holds (a README, metadata .json, a hidden file, a subdirectory)."""
    d = tmp_path / "shards"
    (d / "nested").mkdir(parents=True)
    write_jsonl(d / "part-0.jsonl", records(0, 4))
    pq.write_table(pa.Table.from_pylist(records(4, 7)), d / "part-1.parquet", row_group_size=2)
    write_jsonl(d / "part-2.jsonl", records(7, 10))
    (d / "README.md").write_text("# card\n")
    (d / "dataset_infos.json").write_text("{}")
    write_jsonl(d / ".part-3.jsonl", records(90, 91))
    write_jsonl(d / "nested" / "x.jsonl", records(99, 100))
    return d


def save_to_disk_dir(path: Path, shards: list[list[dict]]) -> Path:
    """The layout `datasets.Dataset.save_to_disk(path, num_shards=N)` writes (datasets 3.6.0, checked by
    hand): Arrow IPC stream files listed by state.json, beside dataset_info.json."""
    path.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards):
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(str(path / name), table.schema) as w:
            w.write_table(table)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_fingerprint": "f", "_split": None}))
    (path / "dataset_info.json").write_text("{}")
    return path


def served(src: PromptSource, n: int) -> list[str]:
    return [p.prompt for p in src.take(n)]


def test_a_directory_of_shards_is_one_sequence_of_records(tmp_path: Path) -> None:
    d = shard_dir(tmp_path)
    src = PromptSource(d, shuffle=False)
    assert src.num_records == 10
    assert served(src, 10) == [f"q{i}" for i in range(10)]
    assert src._records.where(5) == f"{d / 'part-1.parquet'}:row 2"
    assert src._records.where(8) == f"{d / 'part-2.jsonl'}:2"
    assert validate_prompt_file(d) == 10 and count_records(d) == 10
    assert count_records(f"{d}@[3:8]") == 5
    sliced = PromptSource(f"{d}@[3:8]", shuffle=False)
    assert served(sliced, 10) == ["q3", "q4", "q5", "q6", "q7"]


def test_the_cursor_resumes_over_shards_and_refuses_changed_shards(tmp_path: Path) -> None:
    d = shard_dir(tmp_path)
    src = PromptSource(d, seed=3)
    first = served(src, 4)
    state = json.loads(json.dumps(src.state_dict()))
    again = PromptSource(d, seed=3)
    again.load_state_dict(state)
    assert sorted(first + served(again, 10)) == sorted(f"q{i}" for i in range(10))
    write_jsonl(d / "part-2.jsonl", records(7, 11))  # a shard changed: the cursor is for other data
    with pytest.raises(DataError, match="not the one the run started with"):
        PromptSource(d, seed=3).load_state_dict(state)


def test_a_datasets_save_directory_is_read_in_its_files_order(tmp_path: Path) -> None:
    d = save_to_disk_dir(tmp_path / "saved", [records(5, 8), records(0, 2)])
    src = PromptSource(d, shuffle=False)
    assert served(src, 10) == ["q5", "q6", "q7", "q0", "q1"]
    assert src._records.where(3) == f"{d / 'data-00001-of-00002.arrow'}:row 1"
    assert validate_prompt_file(d) == 5 and count_records(d) == 5
    with pytest.raises(DataError, match=r"no column 'answer' for --label-key"):
        PromptSource(d, label_key="answer")


def test_directories_that_hold_no_prompts_say_what_to_pass(tmp_path: Path) -> None:
    dd = tmp_path / "dd"
    save_to_disk_dir(dd / "train", [records(0, 3)])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=rf"DatasetDict with splits train, test: pass one split's directory, "
                                        rf"e.g. --prompt-data {dd / 'train'}$"):
        validate_prompt_file(dd)
    hub = tmp_path / "hub"
    write_jsonl((hub / "data").mkdir(parents=True) or hub / "data" / "train.jsonl", records(0, 2))
    with pytest.raises(DataError, match=rf"no .jsonl or .parquet files in this directory .*data/ has some: "
                                        rf"--prompt-data {hub / 'data'}$"):
        PromptSource(hub)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .jsonl or .parquet files in this directory"):
        validate_prompt_file(tmp_path / "empty")


def test_a_hub_dataset_id_is_refused_with_download_it_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        resolve(["--model", "tiny-qwen3", "--device", "cpu", "--prompt-data", "zhuzilin/dapo-math-17k"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'zhuzilin/dapo-math-17k'}: prompt file does not exist; ")
    assert "'zhuzilin/dapo-math-17k' is a Hugging Face Hub dataset, download it first" in msg
    assert "hf download zhuzilin/dapo-math-17k --repo-type dataset" in msg
    # a missing file, or a missing name in a directory that exists, is not a Hub id
    with pytest.raises(DataError, match=r"prompt file does not exist$"):
        validate_prompt_file(tmp_path / "nope" / "train.jsonl")
    with pytest.raises(DataError, match=r"prompt file does not exist$"):
        validate_prompt_file(tmp_path / "missing")
    with pytest.raises(ConfigError, match="--prompt-data is required"):
        resolve(["--model", "tiny-qwen3", "--device", "cpu"])
