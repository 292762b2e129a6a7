"""Examples that run as printed (issue 46): every `rlslurm submit` / `rlslurm render` example in a
command's --help and in the README's and docs' code blocks is run as a dry run, in a directory holding
the files it names, and must be accepted with no warning (the second example of `submit --help` was
refused: "batch identity violated: ... 512 must equal 256"). An example written with `...` stands for
flags left out and is not a command. Shell completion knows the run flags, a choice flag's values and
the model names.

The files: the demo's prompts (rlslurm/demo_task.py) for --prompt-data, and for --hf-checkpoint an HF
directory's shape made from the model config (tests/helpers/hf_shape.py), which is what submit reads of it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from rlslurm.cli import app
from rlslurm.demo_task import make_prompts
from tests.helpers.hf_shape import hf_shaped_dir

ROOT = Path(__file__).resolve().parents[2]
RUNS = ("rlslurm submit ", "rlslurm render ")
ENV = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
runner = CliRunner()


def _commands(lines: list[str]) -> list[str]:
    """The rlslurm submit/render commands among `lines`, `\\` continuations joined, `# comments` cut."""
    out, cur = [], None
    for line in lines:
        text = line.strip()
        if cur is not None:
            cur += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                out.append(cur)
                cur = None
        elif text.startswith(RUNS) and text.split()[2].startswith("-"):
            if text.endswith("\\"):
                cur = text.rstrip("\\").strip()
            else:
                out.append(text)
    return [re.sub(r"\s+#\s.*$", "", c) for c in out if "..." not in c]


def help_examples() -> list[tuple[str, str]]:
    found = []
    for command in ("submit", "render", "run"):
        res = runner.invoke(app, [command, "--help"], terminal_width=80)
        assert res.exit_code == 0, res.output
        found += [(f"rlslurm {command} --help", c) for c in _commands(res.output.splitlines())]
    return found


def doc_examples() -> list[tuple[str, str]]:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        code = [l for l in doc.read_text().splitlines() if l.startswith("    ")]  # indented code blocks
        found += [(str(doc.relative_to(ROOT)), c) for c in _commands(code)]
    return found


def dry_run(cmd: str, cwd: Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `cmd` as a dry run in `cwd`, with the files it names there."""
    argv = shlex.split(cmd)[1:]
    args = dict(zip(argv, argv[1:]))
    for flag in ("--prompt-data", "--hf-checkpoint"):
        if flag in args and Path(args[flag]).is_absolute():  # a user's path: the example cannot run as printed
            return 2, "", (f"{flag} {args[flag]} is an absolute path; "
                           "an example names one under the directory it runs in")
    if "--prompt-data" in args:
        (cwd / args["--prompt-data"]).parent.mkdir(parents=True, exist_ok=True)
        make_prompts(cwd / args["--prompt-data"])
    if "--hf-checkpoint" in args:
        hf_shaped_dir(cwd / args["--hf-checkpoint"], args["--model"])
    if argv[0] == "submit" and "--dry-run" not in argv:
        argv.append("--dry-run")
    old = Path.cwd()
    os.chdir(cwd)
    try:
        res = runner.invoke(app, argv)
    finally:
        os.chdir(old)
    return res.exit_code, res.stdout, res.stderr + (repr(res.exception) if res.exception else "")


def test_every_example_runs_as_printed(tmp_path: Path) -> None:
    helps, docs = help_examples(), doc_examples()
    # the extraction itself: the examples this test exists for are among those it runs
    assert sum(w == "rlslurm submit --help" for w, _ in helps) == 3, helps
    assert any("--global-batch-size 512 --sglang-mem-fraction-static 0.7" in c for _, c in helps), helps
    assert {w for w, _ in docs} >= {"README.md", "docs/single-node.md", "docs/colocate.md"}, docs
    failed = []
    for i, (where, cmd) in enumerate(helps + docs):
        rc, out, err = dry_run(cmd, tmp_path / str(i))
        # a warning about this machine is not the example's: a GPU package missing on the CPU test host,
        # the default run directory under pytest's temporary directory (/tmp: node-local)
        warned = [l for l in err.splitlines() if l.startswith("warning")
                  and "on this host" not in l and not l.startswith(f"warning: --run-dir {tmp_path}")]
        if rc != 0 or not out.startswith("#!/bin/bash") or warned:
            failed.append(f"{where}: {cmd}\n  exit {rc}: {err.strip()[-600:]}")
    assert not failed, "\n".join(failed)


def complete(line: str) -> list[str]:
    """What bash completion offers at the end of `line` (Typer's bash protocol, as the installed script asks)."""
    words = line.split(" ")
    env = {**ENV, "_RLSLURM_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1)}
    p = subprocess.run([sys.executable, "-m", "rlslurm"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    return p.stdout.split()


def test_completion_knows_run_flags_their_values_and_models() -> None:
    assert complete("rlslurm submit --rollout-batch") == ["--rollout-batch-size"]
    assert "--no-colocate" in complete("rlslurm run --no-col")
    assert "--sglang-mem-fraction-static" not in complete("rlslurm submit --sglang")  # passthrough: SGLang's own
    assert {"grpo", "gspo", "ppo"} <= set(complete("rlslurm render --advantage-estimator "))
    assert complete("rlslurm submit --model qwen3-4") == ["qwen3-4B"]
    assert "--follow" in complete("rlslurm status --fo")


def test_no_switch_shows_a_value_placeholder() -> None:
    """A switch takes no value: Typer showed `<bool>` after every one (--dry-run, --json, --help)."""
    import typer

    root = typer.main.get_command(app)
    helps = [[]] + [[name] for name in root.commands if name != "convert"]
    helps += [["buffer", sub] for sub in root.commands["buffer"].commands]
    helps += [["convert", "hf-to-mcore"], ["convert", "mcore-to-hf"]]
    for argv in helps:
        res = runner.invoke(app, [*argv, "--help"], terminal_width=200)
        assert res.exit_code == 0 and "--help" in res.output, (argv, res.output)
        assert "<bool>" not in res.output, (argv, res.output)
    assert "--no-progress" in runner.invoke(app, ["run", "--help"], terminal_width=200).output  # --x/--no-x stays
