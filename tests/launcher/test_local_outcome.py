"""`rlslurm run`'s closing line names the cause when the rollout fails on its own (rlslurm/local.py): the
last exception line of its log, not the preempt checkpoint the trainer then made when it was stopped
(an fp32 engine that died on an H100 was reported as "preempted")."""

from __future__ import annotations

from pathlib import Path

from rlslurm.local import last_error_line


def test_the_last_exception_line_of_the_log_is_the_cause(tmp_path: Path) -> None:
    log = tmp_path / "rollout-0.log"
    log.write_text("INFO engines starting\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "rlslurm.engines.engine.EngineStartError: engine-0-0 exited with code -9 before it became healthy; "
                   "log engine-0-0.log:\n[engine] RuntimeError: not this one (indented in the tail)\n"
                   "RuntimeError: rmsnorm failed to dispatch data type Float\nINFO closing\n")
    assert last_error_line(log) == "RuntimeError: rmsnorm failed to dispatch data type Float"
    log.write_text("ValueError: " + "x" * 400 + "\n")
    assert last_error_line(log, limit=20) == "ValueError: " + "x" * 8 + " ..."
    log.write_text("all fine\n")
    assert last_error_line(log) is None and last_error_line(tmp_path / "absent.log") is None
