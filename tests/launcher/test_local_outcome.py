"""How `rlslurm run` names an attempt's end (rlslurm/local.py `_outcome`): the order of the causes matters,
e.g. a rollout that failed on its own leaves a preempt checkpoint behind (the trainer is stopped after
it), which must not read "preempted"."""

from __future__ import annotations

from pathlib import Path

from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.local import _outcome

TRAINER_KILLED = {"trainer": -15, "rollout": 1}


def _run(tmp_path: Path, rollout_log: str = "") -> tuple[RunDir, Control, Path]:
    rd = RunDir.create(tmp_path / "run")
    logs = rd.attempt_log_dir(0)
    logs.mkdir(parents=True)
    (logs / "rollout-0.log").write_text(rollout_log)
    return rd, Control(rd), logs


def test_a_rollout_that_failed_first_is_the_cause_not_the_preempt_checkpoint_it_left(tmp_path: Path) -> None:
    rd, control, logs = _run(tmp_path, "starting\nRuntimeError: the engine did not come up in 600 s\nbye\n")
    control.ack_preempt(4)  # the trainer, stopped after the rollout ended, checkpointed on its signal
    rc, reason = _outcome(rd, control, logs, "", "rollout", TRAINER_KILLED, 0)
    assert (rc, reason) == (1, "failed: the rollout ended first (rc=1): RuntimeError: the engine did not come up "
                               "in 600 s")


def test_a_signalled_trainer_that_checkpointed_reads_preempted(tmp_path: Path) -> None:
    rd, control, logs = _run(tmp_path)
    control.ack_preempt(4)
    rc, reason = _outcome(rd, control, logs, "", "trainer", {"trainer": 0, "rollout": -15}, 0)
    assert rc == 1 and reason.startswith("preempted: the trainer checkpointed (iteration 4)"), reason


def test_an_interrupt_names_the_checkpoint_and_keeps_the_shells_status(tmp_path: Path) -> None:
    rd, control, logs = _run(tmp_path)
    control.request_stop("rlslurm run: interrupted")
    control.ack_stop(7)
    rc, reason = _outcome(rd, control, logs, "interrupted (Ctrl-C)", None, {"trainer": 0, "rollout": 0}, 130)
    assert rc == 130 and reason == ("interrupted (Ctrl-C); the trainer checkpointed (iteration 7): run the same "
                                    "command again to continue")


def test_finished_wins_and_a_plain_failure_names_both_exit_codes(tmp_path: Path) -> None:
    rd, control, logs = _run(tmp_path)
    assert _outcome(rd, control, logs, "", "trainer", {"trainer": 1, "rollout": -15}, 0) == (
        1, "failed: trainer ended first (trainer rc=1, rollout rc=-15)")
    rd.mark_finished({"rollouts": 1})
    assert _outcome(rd, control, logs, "", "trainer", {"trainer": 0, "rollout": -15}, 0) == (0, "finished")
