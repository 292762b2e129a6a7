"""A failure while the trainer builds its models or loads their weights (issue 48 item 3): deterministic ones end the
job once as a user error (user_error.json, exit code 3, no requeue), I/O ones stay attempt failures that are
requeued (rlslurm/trainer/build_errors.py, docs/user-errors.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# at import time: `conftest` in sys.modules is the last one pytest loaded (another directory's) by test time
from conftest import REPO, make_run, run_trainer

from rlslurm.errors import ConfigError, UserError
from rlslurm.trainer.build_errors import ModelBuildError, final_if_deterministic
from rlslurm.user_error import USER_ERROR_EXIT_CODE, USER_ERROR_FILE


def _raised(exc: BaseException) -> BaseException:
    with pytest.raises(BaseException) as e:
        with final_if_deterministic("building tiny-qwen3 and loading its weights"):
            raise exc
    return e.value


def test_a_deterministic_failure_becomes_one_line_naming_it_and_the_megatron_version() -> None:
    from importlib.metadata import version

    e = _raised(AssertionError("Experimental attention variant is not supported\n  with get_gpt_decoder_layer_specs"))
    assert isinstance(e, ModelBuildError) and isinstance(e, UserError) and isinstance(e.__cause__, AssertionError)
    assert str(e).startswith(f"building tiny-qwen3 and loading its weights failed on megatron-core "
                             f"{version('megatron-core')}: AssertionError: Experimental attention variant is not "
                             "supported with get_gpt_decoder_layer_specs (deterministic:")
    assert "\n" not in str(e)


def test_io_errors_stay_retryable_even_wrapped() -> None:
    """A file that could not be read this time may be read after a requeue: OSError as is, and megatron's
    CheckpointingException raised from a FileNotFoundError (dist_checkpointing/strategies/common.py)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    assert type(_raised(OSError(5, "Input/output error"))) is OSError
    try:
        try:
            raise FileNotFoundError(2, "No such file or directory", "ckpt/common.pt")
        except FileNotFoundError as inner:
            raise CheckpointingException("Object shard ckpt/common.pt not found") from inner
    except CheckpointingException as wrapped:
        assert _raised(wrapped) is wrapped
    # without an I/O cause, the same type is a checkpoint that does not fit the model: final
    assert isinstance(_raised(CheckpointingException("missing key decoder.layers.0.x")), ModelBuildError)


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                 ConfigError("--megatron-foo: not a field"), KeyboardInterrupt()])
def test_machine_failures_and_user_errors_pass_unchanged(exc: BaseException) -> None:
    assert _raised(exc) is exc


def test_torchs_gathered_checkpoint_failure_is_final_only_when_every_rank_is() -> None:
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def gathered(*excs: BaseException) -> CheckpointException:
        return CheckpointException("load", {r: (x, traceback.StackSummary()) for r, x in enumerate(excs)})

    missing = KeyError("decoder.layers.0.x from model not in state dict")
    e = _raised(gathered(missing, missing))
    assert isinstance(e, ModelBuildError) and "CheckpointException of 2 rank(s), the first: KeyError:" in str(e)
    io = gathered(missing, OSError(116, "Stale file handle"))
    assert _raised(io) is io


@pytest.mark.megatron
@pytest.mark.slow
def test_load_of_another_models_checkpoint_ends_the_job_once(tmp_path: Path) -> None:
    """--load of a dist checkpoint written for tiny-llama into a tiny-qwen3 run: megatron refuses its keys at load,
    every attempt the same. The trainer records it as a user error and exits 3 (the batch script then ends the job
    instead of requeueing it, tests/launcher/test_user_error.py); it used to exit 1, requeued --max-failures times."""
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(load_model_config("tiny-llama"), tmp_path / "hf-llama")
    conv = subprocess.run([sys.executable, "-m", "rlslurm.convert", "hf-to-mcore", "--model", "tiny-llama", "--hf",
                           str(hf), "--out", str(tmp_path / "mc-llama"), "--dtype", "fp32"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert conv.returncode == 0, conv.stderr[-3000:]
    run = make_run(tmp_path / "run", None)
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    cfg["model"]["load"] = str(tmp_path / "mc-llama")
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))

    p = run_trainer(run, check=False, timeout=300)
    assert p.returncode != 0
    records = list((run / "logs").rglob(USER_ERROR_FILE))
    assert len(records) == 1, p.stderr[-6000:]
    rec = json.loads(records[0].read_text())
    assert rec["role"] == "trainer" and rec["error"] == "ModelBuildError", rec
    assert rec["reason"].startswith("user error: building tiny-qwen3 and loading its weights failed on megatron-core ")
    # torch.distributed.checkpoint's gathered failure of the one rank: megatron's KeyError for a key of the model
    assert "CheckpointException of 1 rank(s), the first: KeyError:" in rec["reason"], rec["reason"]
    assert "q_layernorm.weight from model not in state dict" in rec["reason"], rec["reason"]
    assert f"exitcode  : {USER_ERROR_EXIT_CODE}" in p.stderr or f"exit code {USER_ERROR_EXIT_CODE}" in p.stderr, \
        p.stderr[-3000:]
