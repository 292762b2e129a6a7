"""slime's data and eval semantics (issue 32 item 5): without --num-epoch the prompts cycle through
epochs (reshuffled per epoch), exactly once per epoch across a resume; eval samples at the rollout
temperature unless --eval-temperature is given; SFT has one sample per prompt by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from rlslurm.rollout.data import PromptSource
from rlslurm.rollout.driver import sampling_params
from rlslurm.settings.eval_config import eval_datasets
from tests.helpers.config_errors import one_line_naming
from tests.helpers.prompt_files import numbered_prompts


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return numbered_prompts(tmp_path / "p.jsonl", 10)


def test_without_num_epoch_the_run_cycles_and_says_how_many_epochs(prompts: Path) -> None:
    """slime's data source wraps to the next epoch; 10 prompts for 2 x 8 is 2 epochs, not a refusal."""
    base = ["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--rollout-batch-size", "8", "--num-rollout", "2"]
    res = resolve(base)
    assert res.cfg.data.num_epoch is None
    assert res.notes == ["--num-rollout 2 x --rollout-batch-size 8 = 16 prompts of --prompt-data's 10: 2 epochs or "
                         "more with filters, reshuffled each epoch (--rollout-shuffle); --num-epoch N caps it"]
    # a user-given --num-epoch caps the run as before
    one_line_naming(base + ["--num-epoch", "1"], f"{prompts} has 10 prompts x --num-epoch 1",
                    "needs at least 16", "pass --num-epoch 2")
    assert resolve(base + ["--num-epoch", "2"]).notes == []


def _served(src: PromptSource, n: int) -> list[tuple[int, int]]:
    return [(p.epoch, p.index) for p in src.take(n)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_uncapped_epochs_serve_each_prompt_once_per_epoch_and_resume_mid_epoch_2(prompts: Path,
                                                                                 shuffle: bool) -> None:
    """The order of epoch e is a function of (--rollout-seed, e) alone (PromptSource.epoch_order) and the
    cursor is (epoch, position): a requeue that resumes in the middle of epoch 2 serves exactly what a
    straight run serves, handed-back prompts first."""
    straight = PromptSource(prompts, seed=3, shuffle=shuffle, num_epochs=None)
    run = _served(straight, 45)
    for e in range(4):
        assert sorted(i for ep, i in run if ep == e) == list(range(10)), e   # once per epoch
    orders = [[i for ep, i in run if ep == e] for e in range(4)]
    assert (len({tuple(o) for o in orders}) > 1) == shuffle   # reshuffled per epoch only with --rollout-shuffle

    first = PromptSource(prompts, seed=3, shuffle=shuffle, num_epochs=None)
    head = _served(first, 23)                    # into epoch 2 (records 20..29)
    assert head[-1][0] == 2
    unfinished = first.take(2)                   # in flight when the job was preempted: handed back
    for p in unfinished:
        first.push_back(p)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSource(prompts, seed=3, shuffle=shuffle, num_epochs=None)
    resumed.load_state_dict(saved)
    assert head + _served(resumed, 45 - 23) == run


def test_uncapped_epochs_end_when_an_epoch_serves_nothing(tmp_path: Path) -> None:
    """Every record skipped (here malformed, with --no-data-strict): cycling would never serve one."""
    p = tmp_path / "bad.jsonl"
    p.write_text("{not json\n" * 5)
    src = PromptSource(p, strict=False, num_epochs=None)
    assert src.take(3) == [] and src.exhausted is False and src.epoch == 0


def test_eval_samples_at_the_rollout_temperature_unless_given(prompts: Path) -> None:
    base = ["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--rollout-temperature", "0.8",
            "--eval-prompt-data", "aime", str(prompts), "--eval-interval", "5"]
    cfg = resolve(base).cfg
    assert sampling_params(cfg, eval=True)["temperature"] == 0.8
    assert eval_datasets(cfg)[0].temperature == 0.8
    cfg = resolve(base + ["--eval-temperature", "0"]).cfg
    assert sampling_params(cfg, eval=True)["temperature"] == 0.0 and eval_datasets(cfg)[0].temperature == 0.0
    assert sampling_params(cfg)["temperature"] == 0.8


def test_sft_defaults_to_one_sample_per_prompt(tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    base = ["--model", "tiny-qwen3", "--prompt-data", str(data), "--input-key", "messages", "--debug-train-only",
            "--hf-checkpoint", str(tmp_path / "hf"),
            "--loss-type", "sft_loss", "--rollout-batch-size", "4", "--num-rollout", "2",
            "--num-steps-per-rollout", "1",
            "--micro-batch-size", "1"]
    cfg = resolve(base, strict_inputs=False).cfg
    assert cfg.rollout.n_samples_per_prompt == 1 and cfg.train.global_batch_size == 4
    cfg = resolve(base + ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"],
                  strict_inputs=False).cfg
    assert cfg.rollout.n_samples_per_prompt == 1
    # not SFT: the GRPO group of the model config (tiny-qwen3: 4) stays the default
    assert resolve(["--model", "tiny-qwen3", "--prompt-data", str(tmp_path / "none.jsonl")],
                   strict_inputs=False).cfg.rollout.n_samples_per_prompt == 4
