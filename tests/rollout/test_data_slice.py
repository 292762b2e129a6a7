"""slime's --prompt-data PATH@[START:END]: parsed, applied by PromptSource, kept by the cursor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.rollout.data import PromptSource
from rlslurm.rollout.prompt_records import validate_prompt_file
from rlslurm.settings.prompt_slice import PromptSpec, parse_prompt_spec


def write_qa(path: Path, n: int) -> Path:
    # a blank line in the middle: records are the non-empty lines, and the slice counts records
    lines = [json.dumps({"prompt": f"q{i}", "label": str(i)}) for i in range(n)]
    lines.insert(n // 2, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, n: int, row_group_size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(n)], "label": [str(i) for i in range(n)]}),
                   path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("spec,start,end", [
    ("d.jsonl", None, None), ("d.jsonl@[2:5]", 2, 5), ("d.jsonl@[:5]", None, 5), ("d.jsonl@[-3:]", -3, None),
    ("d.jsonl@[:]", None, None), ("/a/b@c.jsonl@[1:-1]", 1, -1),
])
def test_parse(spec: str, start: int | None, end: int | None) -> None:
    s = parse_prompt_spec(spec)
    assert (s.start, s.end) == (start, end) and s.path.name.endswith(".jsonl")


@pytest.mark.parametrize("spec", ["d.jsonl@[1:2:3]", "d.jsonl@[a:b]", "d.jsonl@[5]", "d.jsonl@[-:2]", "@[1:2]"])
def test_malformed_slice_is_one_line_naming_the_flag(spec: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_prompt_spec(spec, "--eval-prompt-data")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--eval-prompt-data {spec}:")


@pytest.mark.parametrize("start,end", [(2, 7), (None, 4), (-3, None), (1, -1), (-100, 3)])
def test_bounds_follow_python_slicing(start: int | None, end: int | None) -> None:
    lo, hi = PromptSpec(Path("x"), start, end).bounds(10)
    assert list(range(lo, hi)) == list(range(10))[start:end]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_source_serves_the_slice_every_epoch(tmp_path: Path, shuffle: bool) -> None:
    path = write_qa(tmp_path / "d.jsonl", 10)
    src = PromptSource(f"{path}@[3:8]", shuffle=shuffle, seed=5, num_epochs=2)
    assert src.num_records == 5 and src.file_records == 10
    served = src.take(100)
    for e in range(2):
        got = [p.index for p in served if p.epoch == e]
        assert sorted(got) == [3, 4, 5, 6, 7]
        assert got == (sorted(got) if not shuffle else got)
    # Prompt.index is the file's record number, so label and line match it
    assert all(p.label == str(p.index) for p in served)
    assert PromptSource(f"{path}@[-2:]", shuffle=False).take(9)[-1].prompt == "q9"


def test_an_unsliced_order_is_unchanged(tmp_path: Path) -> None:
    """A cursor saved before slicing existed must resume into the same order."""
    path = write_qa(tmp_path / "d.jsonl", 50)
    src = PromptSource(path, seed=9)
    assert list(src.epoch_order(0)) == list(np.random.default_rng([9, 0]).permutation(50))
    assert "slice" not in src.state_dict()


def test_parquet_slice_clips_row_groups(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", 53, 10)
    whole = PromptSource(path, seed=3)
    sliced = PromptSource(f"{path}@[15:42]", seed=3)
    order = [p.index for p in sliced.take(100)]
    assert sorted(order) == list(range(15, 42))
    # still two-level: the first prompts come from one row group
    assert len({i // 10 for i in order[:3]}) == 1
    assert list(whole.epoch_order(0)) != list(sliced.epoch_order(0))
    assert PromptSource(f"{path}@[:]", seed=3).epoch_order(0).tolist() == whole.epoch_order(0).tolist()


def test_resume_keeps_the_slice_position(tmp_path: Path) -> None:
    path = write_qa(tmp_path / "d.jsonl", 20)
    src = PromptSource(f"{path}@[5:15]", seed=1, num_epochs=2)
    first = src.take(7)
    state = json.loads(json.dumps(src.state_dict()))
    assert state["slice"] == [5, 15] and state["position"] == 7
    rest = src.take(100)
    resumed = PromptSource(f"{path}@[5:15]", seed=1, num_epochs=2)
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.take(100)] == [p.uid for p in rest]
    assert sorted(p.index for p in first + rest if p.epoch == 0) == list(range(5, 15))


@pytest.mark.parametrize("other", ["@[5:16]", "", "@[0:10]"])
def test_resume_into_another_slice_is_refused(tmp_path: Path, other: str) -> None:
    path = write_qa(tmp_path / "d.jsonl", 20)
    src = PromptSource(f"{path}@[5:15]", seed=1)
    src.take(3)
    state = src.state_dict()
    with pytest.raises(ConfigError, match=r"^--prompt-data .*: serves records \[\d+, \d+\) of the file but the "
                                          r"cursor was saved for records \[5, 15\)"):
        PromptSource(f"{path}{other}", seed=1).load_state_dict(state)


def test_an_unsliced_cursor_into_a_sliced_source_is_refused(tmp_path: Path) -> None:
    path = write_qa(tmp_path / "d.jsonl", 20)
    state = PromptSource(path, seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"cursor was saved for records \[0, 20\)"):
        PromptSource(f"{path}@[0:10]", seed=1).load_state_dict(state)


def test_empty_slice(tmp_path: Path) -> None:
    path = write_qa(tmp_path / "d.jsonl", 10)
    for bad in ("@[10:]", "@[4:2]", "@[-1:-1]"):
        with pytest.raises(ConfigError, match=r"^--prompt-data .*: the slice selects no records \(the file has 10;"):
            PromptSource(f"{path}{bad}")
        with pytest.raises(ConfigError, match=r"^--eval-prompt-data .*: the slice selects no records"):
            validate_prompt_file(f"{path}{bad}", flag="--eval-prompt-data")


def test_validate_reads_the_slice_not_the_head(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    good = [json.dumps({"prompt": f"q{i}", "label": "x"}) for i in range(30)]
    good[25] = json.dumps({"prompt": "q25"})  # no label, past the head the unsliced check reads
    path.write_text("\n".join(good) + "\n")
    assert validate_prompt_file(path) == 20
    assert validate_prompt_file(f"{path}@[:25]", n_lines=100) == 25
    with pytest.raises(DataError, match=r"d.jsonl:26: missing label key 'label'"):
        validate_prompt_file(f"{path}@[20:]")
    with pytest.raises(DataError, match=r"d.jsonlx: prompt file does not exist"):
        validate_prompt_file(f"{tmp_path / 'd.jsonl'}x@[0:1]")
