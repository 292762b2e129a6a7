"""PromptSource: streaming, shuffling, filters, strict/lenient errors and the resumable cursor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlslurm.errors import ConfigError, DataError
from rlslurm.rollout.data import (
    PartialSample,
    Prompt,
    PromptSource,
    load_custom_source,
)
from rlslurm.rollout.prompt_records import validate_prompt_file


def write_jsonl(path: Path, records: list, *, raw_lines: dict[int, str] | None = None) -> Path:
    """records -> one JSON line each; raw_lines[i] replaces line i (0-based) verbatim."""
    lines = [json.dumps(r) for r in records]
    for i, text in (raw_lines or {}).items():
        lines[i] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def qa(n: int) -> list[dict]:
    return [{"prompt": f"q{i}", "label": str(i), "meta": {"id": i}} for i in range(n)]


def tiny_tokenizer(tmp_path: Path, template: str | None = None):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rlslurm.tiny import tokenizer_json

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(tokenizer_json())),
        bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
    )
    tok.chat_template = template or (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    return tok


def labels(prompts: list[Prompt]) -> list[str]:
    return [p.label for p in prompts]


# --------------------------------------------------------------------------- order


def test_each_epoch_serves_every_record_once_in_a_seeded_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(50))
    src = PromptSource(path, seed=7, num_epochs=3)
    got = src.take(1000)
    assert len(got) == 150 and src.exhausted
    epochs = [[p.index for p in got if p.epoch == e] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(50))
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled per epoch
    assert epochs[0] != list(range(50))
    again = PromptSource(path, seed=7, num_epochs=3).take(1000)
    assert [p.uid for p in again] == [p.uid for p in got]
    other_seed = PromptSource(path, seed=8, num_epochs=1).take(50)
    assert [p.index for p in other_seed] != epochs[0]
    # record content travels with the index
    assert all(p.label == str(p.index) and p.prompt == f"q{p.index}" for p in got)


def test_no_shuffle_keeps_file_order_and_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "label": 1}\n\n   \n{"prompt": "b", "label": 2}\r\n{"prompt": "c", "label": 3}')
    src = PromptSource(path, shuffle=False)
    got = src.take(10)
    assert [p.prompt for p in got] == ["a", "b", "c"]
    assert [p.where for p in got] == [f"{path}:1", f"{path}:4", f"{path}:5"]
    assert src.counters["blank"] == 1  # the whitespace-only line; the empty one is not indexed


def test_byte_order_mark_and_bad_utf8(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": 1}\n{"prompt": "\xff", "label": 2}\n')
    src = PromptSource(path, shuffle=False)
    assert src.take(1)[0].prompt == "a"
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid UTF-8"):
        src.take(1)


def test_large_file_is_indexed_not_loaded(tmp_path):
    n = 20000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": "x" * (i % 97), "label": i}) + "\n")
    src = PromptSource(path, seed=1)
    # the source holds offsets, not records: ~16 bytes per record
    assert src._records.offsets.dtype == np.int64 and src._records.offsets.shape == (n,)
    seen = [p.label for p in src.take(n)]
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------- errors


def test_malformed_line_strict_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(5), raw_lines={3: '{"prompt": "q3", "label": '})
    src = PromptSource(path, shuffle=False)
    assert labels(src.take(3)) == ["0", "1", "2"]
    with pytest.raises(DataError) as e:
        src.take(1)
    assert e.value.where == f"{path}:4" and "invalid JSON" in str(e.value) and "--no-data-strict" in str(e.value)


def test_malformed_line_lenient_is_counted_and_skipped(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(6), raw_lines={1: "not json", 4: "[1, 2]"})
    src = PromptSource(path, shuffle=False, strict=False)
    assert labels(src.take(10)) == ["0", "2", "3", "5"]
    assert src.counters["malformed"] == 2 and src.metrics()["data/malformed"] == 2.0


def test_json_array_file_gets_a_hint(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(qa(2)))
    with pytest.raises(DataError, match="JSON array file is not JSON Lines"):
        PromptSource(path).take(1)


@pytest.mark.parametrize("strict", [True, False])
def test_missing_label_key_is_an_error_even_when_lenient(tmp_path, strict):
    recs = qa(4)
    del recs[2]["label"]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    src = PromptSource(path, shuffle=False, strict=strict)
    src.take(2)
    with pytest.raises(DataError) as e:
        src.take(1)
    assert e.value.where == f"{path}:3" and "'label'" in str(e.value) and "--label-key" in str(e.value)


def test_missing_input_key_and_bad_prompt_type(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "label": "1"}])
    with pytest.raises(DataError, match=r"d.jsonl:1: missing input key 'prompt'.*question"):
        PromptSource(path).take(1)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": 5, "label": "1"}])
    with pytest.raises(DataError, match=r"e.jsonl:1: 'prompt' must be a string"):
        PromptSource(path).take(1)
    path = write_jsonl(tmp_path / "f.jsonl", [{"prompt": [{"role": "user"}], "label": "1"}])
    with pytest.raises(DataError, match=r"f.jsonl:1: 'prompt' message 0 needs 'role' and 'content'"):
        PromptSource(path).take(1)


def test_bad_paths_and_flags(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        PromptSource(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported prompt file type '.csv'"):
        PromptSource(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no records"):
        PromptSource(tmp_path / "empty.jsonl")
    path = write_jsonl(tmp_path / "d.jsonl", qa(2))
    with pytest.raises(ConfigError, match="--apply-chat-template needs a tokenizer"):
        PromptSource(path, apply_chat_template=True)
    with pytest.raises(ConfigError, match="--max-prompt-len needs a tokenizer"):
        PromptSource(path, max_prompt_len=4)


# --------------------------------------------------------------------------- fields and tokenization


def test_metadata_tools_and_message_prompts(tmp_path):
    tools = [{"type": "function", "function": {"name": "add"}}]
    recs = [
        {"prompt": [{"role": "user", "content": "hi"}], "label": 3, "meta": {"k": 1}, "tools": tools},
        {"prompt": "plain", "label": "x", "meta": json.dumps({"k": 2}), "tools": json.dumps(tools)},
        {"prompt": "plain", "label": "x", "meta": [1]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    src = PromptSource(path, shuffle=False, metadata_key="meta", tool_key="tools")
    a, b = src.take(2)
    assert a.prompt == [{"role": "user", "content": "hi"}] and a.prompt_ids is None and a.label == 3
    assert a.metadata == {"k": 1} and a.tools == tools
    assert b.metadata == {"k": 2} and b.tools == tools
    with pytest.raises(DataError, match=r"d.jsonl:3: 'meta' must be a dict"):
        src.take(1)


def test_chat_template_kwargs_and_prompt_length_filter(tmp_path):
    tok = tiny_tokenizer(
        tmp_path,
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}{% if think %}the {% endif %}",
    )
    recs = [
        {"prompt": "a b", "label": "1"},  # "user : a b assistant : the" = 7 tokens
        {"prompt": "a b c d e f", "label": "2"},  # 11 tokens
        {"prompt": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
                    {"role": "user", "content": "e"}], "label": "3"},  # 13 tokens
    ]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    src = PromptSource(path, shuffle=False, tokenizer=tok, apply_chat_template=True,
                       chat_template_kwargs={"think": True}, max_prompt_len=10)
    got = src.take(5)
    assert len(got) == 1 and src.counters["filtered_long"] == 2
    p = got[0]
    assert p.prompt.split() == ["user", ":", "a", "b", "assistant", ":", "the"]
    assert p.prompt_ids == tok.convert_tokens_to_ids(p.prompt.split())
    assert p.messages == [{"role": "user", "content": "a b"}]
    # without the template a string prompt is tokenized as is; a message list cannot be measured
    src = PromptSource(path, shuffle=False, tokenizer=tok, max_prompt_len=3)
    assert [p.prompt for p in src.take(1)] == ["a b"]
    with pytest.raises(DataError, match="d.jsonl:3: prompt is a message list"):
        src.take(1)
    assert src.counters["filtered_long"] == 1


# --------------------------------------------------------------------------- parquet


def write_parquet(path: Path, n: int, row_group_size: int, *, with_label: bool = True) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"prompt": [f"q{i}" for i in range(n)], "other": list(range(n))}
    if with_label:
        cols["label"] = [str(i) for i in range(n)]
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return path


def test_parquet_streams_by_row_group_and_resumes(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", 103, 10)
    src = PromptSource(path, seed=3, num_epochs=2)
    assert src.num_records == 103 and len(src._records.group_sizes) == 11
    first = src.take(60)
    state = json.loads(json.dumps(src.state_dict()))
    rest = src.take(1000)
    resumed = PromptSource(path, seed=3, num_epochs=2)
    resumed.load_state_dict(state)
    assert [p.uid for p in resumed.take(1000)] == [p.uid for p in rest]
    everything = first + rest
    for e in range(2):
        assert sorted(p.index for p in everything if p.epoch == e) == list(range(103))
    assert all(p.label == str(p.index) and p.where.endswith(f":row {p.index + 1}") for p in everything)
    # two-level shuffle: the first 10 prompts of an epoch come from one row group
    assert len({p.index // 10 for p in first[:3]}) == 1


def test_parquet_missing_label_column(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", 5, 5, with_label=False)
    with pytest.raises(DataError, match=r"d.parquet: no column 'label' for --label-key \(columns: prompt, other\)"):
        PromptSource(path)
    assert PromptSource(path, label_key=None).take(1)[0].label is None


# --------------------------------------------------------------------------- cursor


def test_resume_from_cursor_skips_nothing_and_repeats_nothing(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(17))
    reference = [p.uid for p in PromptSource(path, seed=5, num_epochs=3).take(10_000)]
    # consume in uneven batches, "crash" after each commit, resume from the JSON cursor
    served: list[tuple[int, int]] = []
    state = None
    for batch in [4, 9, 13, 1, 8, 100]:
        src = PromptSource(path, seed=5, num_epochs=3)
        if state is not None:
            src.load_state_dict(state)
        served += [p.uid for p in src.take(batch)]
        state = json.loads(json.dumps(src.state_dict()))
    assert served == reference


def test_pushed_back_prompts_are_served_first_and_survive_restart(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(10))
    src = PromptSource(path, shuffle=False)
    a, b, c = src.take(3)
    partial = [PartialSample(output_ids=[5, 6], output_logprobs=[-0.5, -0.25], loss_mask=[1, 1], weight_version=3)]
    src.push_back(b, partial)
    src.push_back(c)
    state = json.loads(json.dumps(src.state_dict()))
    resumed = PromptSource(path, shuffle=False)
    resumed.load_state_dict(state)
    got = resumed.take(4)
    assert [p.label for p in got] == ["1", "2", "3", "4"]
    assert got[0].partial == partial and got[1].partial is None
    assert got[0].where == b.where and resumed.num_pending == 0
    with pytest.raises(DataError, match="3 logprobs"):
        PartialSample(output_ids=[1, 2], output_logprobs=[0.0, 0.0, 0.0], loss_mask=[1, 1], weight_version=0)


def test_custom_buffer_filter(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(10))

    def newest_first(pending, n):
        return list(reversed(pending))[:n]

    src = PromptSource(path, shuffle=False, buffer_filter=newest_first)
    for p in src.take(3):
        src.push_back(p)
    assert labels(src.take(2)) == ["2", "1"]
    assert labels(src.take(2)) == ["0", "3"]

    src = PromptSource(path, shuffle=False, buffer_filter=lambda pending, n: [Prompt(0, 0, "x", None)])
    src.push_back(src.take(1)[0])
    with pytest.raises(ConfigError, match="--buffer-filter-path must return distinct prompts"):
        src.take(1)


def test_cursor_refuses_another_file_or_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(10))
    src = PromptSource(path, seed=1)
    src.take(3)
    state = src.state_dict()
    with pytest.raises(ConfigError, match="--rollout-shuffle/--rollout-seed changed"):
        PromptSource(path, seed=2).load_state_dict(state)
    write_jsonl(path, qa(11))
    with pytest.raises(DataError, match="not the one the run started with"):
        PromptSource(path, seed=1).load_state_dict(state)


def test_strict_error_leaves_cursor_on_the_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(4), raw_lines={2: "{oops"})
    src = PromptSource(path, shuffle=False)
    src.take(2)
    with pytest.raises(DataError):
        src.take(2)
    assert src.state_dict()["position"] == 2


# --------------------------------------------------------------------------- validation and plugins


def test_validate_prompt_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qa(30))
    assert validate_prompt_file(path, "prompt", "label") == 20
    assert validate_prompt_file(path, "prompt", "label", n_lines=50) == 30
    with pytest.raises(DataError, match=r"d.jsonl:1: missing label key 'answer'"):
        validate_prompt_file(path, "prompt", "answer")
    bad = write_jsonl(tmp_path / "bad.jsonl", qa(5), raw_lines={3: "{"})
    with pytest.raises(DataError, match=r"bad.jsonl:4: invalid JSON line"):
        validate_prompt_file(bad, "prompt", "label")
    pq_path = write_parquet(tmp_path / "d.parquet", 5, 2)
    assert validate_prompt_file(pq_path, "prompt", "label") == 5
    with pytest.raises(DataError, match="no column 'answer'"):
        validate_prompt_file(pq_path, "prompt", "answer")
    with pytest.raises(DataError, match="does not exist"):
        validate_prompt_file(tmp_path / "missing.parquet", "prompt", "label")
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(qa(3), indent=1))
    with pytest.raises(DataError, match=r"arr.json:1: invalid JSON line.*JSON array file is not JSON Lines"):
        validate_prompt_file(arr, "prompt", "label")


def test_a_line_past_the_limit_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    # the limit is 64 MiB; a small one keeps the files small (the code reads it at call time)
    from rlslurm.rollout import prompt_records

    monkeypatch.setattr(prompt_records, "MAX_LINE_BYTES", 1000)
    fits = json.dumps({"prompt": "", "label": "0"})
    fits = json.dumps({"prompt": "x" * (1000 - len(fits)), "label": "0"})
    assert len(fits) == 1000
    long = json.dumps({"prompt": "x" * 1000, "label": "1"})
    path = tmp_path / "d.jsonl"
    path.write_text(f"{fits}\n{long}\n{fits}")
    assert validate_prompt_file(path, "prompt", "label", n_lines=1) == 1
    with pytest.raises(DataError, match=r"d.jsonl:2: line is longer than 1000 bytes \(JSON Lines: one prompt"):
        validate_prompt_file(path, "prompt", "label")
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([json.loads(long)] * 3))  # one line, no newline at the end
    with pytest.raises(DataError, match=r"arr.json:1: line is longer than 1000 bytes.*JSON array file is not"):
        validate_prompt_file(arr, "prompt", "label")
    # the job's reader refuses the same line (strict) or skips it as malformed (lenient)
    with pytest.raises(DataError, match=r"d.jsonl:2: line is longer than 1000 bytes"):
        PromptSource(path, shuffle=False).take(3)
    lenient = PromptSource(path, shuffle=False, strict=False)
    assert labels(lenient.take(3)) == ["0", "0"] and lenient.counters["malformed"] == 1


def test_load_custom_source_from_file(tmp_path):
    plugin = tmp_path / "my_source.py"
    plugin.write_text(
        "from rlslurm.rollout.data import Prompt\n"
        "class Counting:\n"
        "    def __init__(self, start=0):\n"
        "        self.i = start\n"
        "    def take(self, n):\n"
        "        out = [Prompt(self.i + k, 0, f'p{self.i + k}', None) for k in range(n)]\n"
        "        self.i += n\n"
        "        return out\n"
        "    def push_back(self, prompt, partial=None):\n"
        "        pass\n"
        "    def state_dict(self):\n"
        "        return {'i': self.i}\n"
        "    def load_state_dict(self, s):\n"
        "        self.i = s['i']\n"
        "class Broken:\n"
        "    def take(self, n):\n"
        "        return []\n"
    )
    src = load_custom_source(f"{plugin}:Counting", start=5)
    assert [p.prompt for p in src.take(2)] == ["p5", "p6"]
    with pytest.raises(ConfigError, match=r"--data-source-path .*Broken.* lacks push_back, state_dict, "
                                          r"load_state_dict"):
        load_custom_source(f"{plugin}:Broken")
    with pytest.raises(ConfigError, match=r"--data-source-path .*cannot construct it"):
        load_custom_source(f"{plugin}:Counting", nope=1)
