"""--eval-config (slime's per-dataset eval YAML): formats, precedence, and one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.errors import DataError
from rlslurm.resolve import resolve
from rlslurm.rollout.driver import eval_sampling_params
from rlslurm.settings.eval_config import eval_datasets
from tests.helpers.config_errors import one_line_naming
from tests.helpers.prompt_files import ENOUGH, prompt_lines


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for name in ("p", "aime", "gpqa"):  # the training prompts last --num-rollout (resolve._check_prompt_supply)
        (d / f"{name}.jsonl").write_text(prompt_lines(*({"prompt": f"{name} {i}", "label": str(i), "q": "x", "a": "y"}
                                                        for i in range(6)), n=ENOUGH if name == "p" else 6))
    return d


def argv(data: Path, yaml_text: str, *more: str) -> list[str]:
    (data / "eval.yaml").write_text(yaml_text)
    return ["--model", "tiny-qwen3", "--prompt-data", str(data / "p.jsonl"), "--eval-config",
            str(data / "eval.yaml"), "--eval-temperature", "0.3", "--rollout-top-p", "0.9", *more]


SLIME_FORM = """\
eval:
  defaults:
    n_samples_per_eval_prompt: 4
    max_response_len: 64
  datasets:
    - name: aime
      path: aime.jsonl@[0:3]
      temperature: 0.6
      rm_type: exact
    - name: gpqa
      path: {gpqa}
      input_key: q
      label_key: a
      n_samples_per_eval_prompt: 1
"""


def test_slime_form_dataset_then_defaults_then_flags(data: Path) -> None:
    cfg = resolve(argv(data, SLIME_FORM.format(gpqa=data / "gpqa.jsonl"))).cfg
    aime, gpqa = eval_datasets(cfg)
    assert (aime.name, aime.path) == ("aime", f"{data / 'aime.jsonl'}@[0:3]")  # relative to the YAML file
    assert (aime.temperature, aime.n_samples_per_eval_prompt, aime.max_response_len, aime.top_p) == (0.6, 4, 64, 0.9)
    assert (aime.input_key, aime.rm_type) == ("prompt", "exact")
    assert (gpqa.temperature, gpqa.n_samples_per_eval_prompt, gpqa.input_key, gpqa.label_key) == (0.3, 1, "q", "a")
    sp = eval_sampling_params(cfg, aime)
    assert (sp["temperature"], sp["top_p"], sp["max_new_tokens"]) == (0.6, 0.9, 64)


def test_a_bare_mapping_of_datasets_by_name(data: Path) -> None:
    cfg = resolve(argv(data, "datasets:\n  aime:\n    path: aime.jsonl\n  gpqa: {path: gpqa.jsonl, top_k: 5}\n")).cfg
    got = eval_datasets(cfg)
    assert [d.name for d in got] == ["aime", "gpqa"] and got[1].top_k == 5 and got[0].top_k == -1


def test_without_the_config_the_pairs_are_the_datasets(data: Path) -> None:
    cfg = resolve(["--model", "tiny-qwen3", "--prompt-data", str(data / "p.jsonl"), "--eval-prompt-data",
                   "aime", str(data / "aime.jsonl"), "--n-samples-per-eval-prompt", "3"]).cfg
    (ds,) = eval_datasets(cfg)
    assert (ds.name, ds.path, ds.n_samples_per_eval_prompt, ds.rm_type) == ("aime", str(data / "aime.jsonl"), 3, None)


@pytest.mark.parametrize("text,names", [
    ("datasets:\n  - {name: aime, path: aime.jsonl, app_service: x}\n", ["datasets[aime]", "'app_service'"]),
    ("eval:\n  defaults: {repetition_penalty: 1.1}\n  datasets: [{name: a, path: aime.jsonl}]\n",
     ["defaults", "'repetition_penalty' is not read by rlslurm"]),
    ("datasets:\n  - {path: aime.jsonl}\n", ["datasets[0]", "needs a `name`"]),
    ("datasets:\n  - {name: a}\n", ["datasets[a]", "needs a `path`"]),
    ("datasets: []\n", ["no datasets"]),
    ("- a\n", ["the root must be a mapping"]),
    ("datasets:\n  - {name: a, path: aime.jsonl, temperature: hot}\n", ["temperature must be int or float"]),
    ("datasets:\n  - {name: a, path: aime.jsonl, top_k: 0}\n", ["top_k must be -1"]),
    ("datasets:\n  - {name: a, path: aime.jsonl, rm_type: remote}\n", ["rm_type 'remote' is not a rule"]),
    ("datasets:\n  - {name: a, path: aime.jsonl}\n  - {name: a, path: gpqa.jsonl}\n", ["['a'] given twice"]),
    ("datasets:\n  - {name: a, path: 'aime.jsonl@[9:]'}\n", ["the slice selects no records"]),
    ("datasets:\n  - {name: a, path: 'aime.jsonl@[1:2:3]'}\n", ["a slice is PATH@[START:END]"]),
    ("datasets: [\n", ["not valid YAML"]),
])
def test_refusals_name_the_file(data: Path, text: str, names: list[str]) -> None:
    one_line_naming(argv(data, text), "--eval-config", *names)


def test_a_dataset_key_is_checked_on_its_records(data: Path) -> None:
    with pytest.raises(DataError, match=r"aime.jsonl:1: missing input key 'nope' \(--input-key\)"):
        resolve(argv(data, "datasets:\n  - {name: a, path: aime.jsonl, input_key: nope}\n"))


def test_both_ways_at_once_is_refused(data: Path) -> None:
    one_line_naming(argv(data, "datasets: [{name: a, path: aime.jsonl}]\n", "--eval-prompt-data", "x",
                         str(data / "aime.jsonl")), "--eval-config and --eval-prompt-data both given")


def test_rm_type_needs_a_rule_reward(data: Path) -> None:
    text = "datasets: [{name: a, path: aime.jsonl, rm_type: exact}]\n"
    one_line_naming(argv(data, text, "--rm-type", "remote", "--rm-url", "http://x"),
                    "--eval-config", "rm_type 'exact' with --rm-type remote")


def test_a_missing_config_file(data: Path) -> None:
    one_line_naming(["--model", "tiny-qwen3", "--prompt-data", str(data / "p.jsonl"), "--eval-config",
                     str(data / "none.yaml")], "--eval-config", "none.yaml: not a file")
