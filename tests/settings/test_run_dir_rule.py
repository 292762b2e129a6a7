"""One rule for a run's directory (rlslurm/settings/config.py `run_dir_of`): --run-dir, else
./runs/<run-name>, with `rlslurm`, the documented --run-name default; `rlslurm run --demo` names its
run `demo`. The config and both of `rlslurm run`'s paths (the demo's and a resume's) use it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlslurm import cli
from rlslurm.buffer.rundir import RunDir
from rlslurm.settings import runfile
from rlslurm.settings.config import DEFAULT_RUN_NAME, RunSection, run_dir_of
from rlslurm.settings.flags import Layer, build_config


def test_the_rule() -> None:
    assert run_dir_of(None) == Path("runs") / DEFAULT_RUN_NAME == Path("runs/rlslurm")
    assert run_dir_of(None, "grpo") == Path("runs/grpo")
    assert run_dir_of(Path("/gpfs/r"), "grpo") == Path("/gpfs/r")


def test_the_config_and_the_documented_defaults_follow_it() -> None:
    assert RunSection.model_fields["run_name"].default == DEFAULT_RUN_NAME
    assert "runs/<run-name>" in RunSection.model_fields["run_dir"].description
    assert f"(default: {DEFAULT_RUN_NAME})" in cli.RUN_OPTIONS["run_name"][1].help
    assert "runs/<run-name>" in cli.RUN_OPTIONS["run_dir"][1].help
    assert build_config([Layer()]).run_dir == Path("runs/rlslurm")
    named = Layer()
    named.set("run_name", "grpo", "test")
    assert build_config([named]).run_dir == Path("runs/grpo")


class _Resumed(Exception):
    pass


@pytest.mark.parametrize("args, expected", [
    ([], "runs/rlslurm"),
    (["--run-name", "x"], "runs/x"),
    (["--demo"], "runs/demo"),
    (["--demo", "--run-name", "x"], "runs/x"),
    (["--run-dir", "elsewhere"], "elsewhere"),
])
def test_rlslurm_run_resumes_the_run_dir_of_the_rule(args, expected, tmp_path, monkeypatch) -> None:
    """An existing run.yaml where the rule points is resumed (stopped here, before anything starts)."""
    monkeypatch.chdir(tmp_path)
    RunDir.create(tmp_path / expected).run_yaml.write_text("{}\n")

    def resumed(path):
        raise _Resumed(Path(path))

    monkeypatch.setattr(runfile, "load_run_config", resumed)
    r = CliRunner().invoke(cli.app, ["run", *args])
    assert isinstance(r.exception, _Resumed), (r.output, r.exception)
    assert r.exception.args[0] == Path(expected)


@pytest.mark.parametrize("run_dir",
                         ["/dev/shm/rlslurm-test-run", "/tmp/rlslurm-test-run", "/rlslurm-test-no-such-dir/run"])
def test_submit_warns_of_a_run_dir_no_other_node_sees(monkeypatch, run_dir: str) -> None:
    """A job's nodes coordinate only through the run directory, which submit writes on this node: one
    in memory or under a node's own /tmp splits the run (filesystem_of names the mount). Not for
    `rlslurm run`, whose groups share this machine (docs/shared-filesystem.md)."""
    from rlslurm.buffer.atomic import filesystem_of

    monkeypatch.delenv("TMPDIR", raising=False)
    said = {"/dev/shm/rlslurm-test-run": "is a tmpfs (each node's own memory, at /dev/shm)"
            if filesystem_of("/dev/shm") == ("/dev/shm", "tmpfs") else "is under /dev/shm, which is local to each node",
            "/tmp/rlslurm-test-run": "is under /tmp, which is local to each node"}.get(run_dir)
    res = CliRunner().invoke(cli.app, ["submit", "--model", "tiny-qwen3", "--nodes", "2", "--run-dir", run_dir,
                                       "--dry-run"])
    assert res.exit_code == 0, res.output
    warned = [l for l in res.stderr.splitlines() if l.startswith(f"warning: --run-dir {run_dir} ")]
    if said is None:  # under / (not created): a directory of its own, as a shared mount is
        assert not warned, res.stderr
    else:
        assert len(warned) == 1 and said in warned[0] and "docs/shared-filesystem.md" in warned[0], res.stderr
    assert not Path(run_dir).exists()  # a dry run creates nothing


def test_an_unusable_run_dir_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    """A --run-dir below a file, or one that cannot be made (under /proc), was a NotADirectoryError or
    FileNotFoundError traceback at submit and in status/stop/cancel/logs; now one line naming it, before
    anything is submitted where it can be told."""
    from rlslurm.errors import ConfigError
    from rlslurm.resolve import resolve
    from tests.helpers.config_errors import one_line_naming

    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_naming(argv + ["--run-dir", str(afile / "run")], f"--run-dir {afile}/run: {afile} is not a directory")
    one_line_naming(argv + ["--run-dir", str(afile)], f"--run-dir {afile}: exists and is not a directory")
    assert resolve(argv + ["--run-dir", str(tmp_path / "new" / "run")]).cfg.run_dir == tmp_path / "new" / "run"
    with pytest.raises(ConfigError, match=r"^run directory /proc/rlslurm-test-\d+: cannot make it: "):
        RunDir.create(f"/proc/rlslurm-test-{__import__('os').getpid()}")
    runner = CliRunner()
    for cmd in ("status", "stop", "cancel", "logs", "resubmit"):
        r = runner.invoke(cli.app, [cmd, str(afile / "run")])
        assert r.exit_code != 0 and isinstance(r.exception,
                                               (ConfigError, SystemExit, cli.UserError)), (cmd, r.exception)
        assert "not a run directory" in str(r.exception) or "not an rlslurm run directory" in str(r.exception), cmd
