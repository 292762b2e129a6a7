"""`rlslurm` command line (Typer + Rich).

Run settings are flags named after config fields (`--rollout-batch-size 64`, see
`rlslurm flags`), plus `--sglang-*`, `--router-*` and `--megatron-*` passthrough; `--config run.yaml` loads a
YAML file first. Every user error prints one line and exits 2; no traceback.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import time
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.markup import escape
from rich.text import Text

from rlslurm.buffer.atomic import StorageError
from rlslurm.cli_typer import App, Group, RunFlagsCommand, model_names
from rlslurm.console import make_console, print_pairs, print_table
from rlslurm.errors import UserError

app = App(
    cls=Group,
    help="SLURM-native RL post-training (Megatron-core + SGLang) with torchrun and no Ray.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
)
out = make_console()
err = make_console(stderr=True)

# The ~166 run flags are not typer options (they are parsed by rlslurm/settings/flags.py from the config's
# fields), so a command's --help names only a few: this line points to the full list.
FLAGS_EPILOG = ("Every run setting is a flag (over 160, plus --sglang-*, --router-*, --megatron-* passthrough): "
                "`rlslurm flags` lists each with its section, type, default and description; "
                "`rlslurm flags KEYWORD` filters them (e.g. rlslurm flags sbatch).")


def _version(value: bool) -> None:
    if value:
        from rlslurm.doctor import version_lines

        # where it runs from (the job script bakes in the submitting interpreter, --python) and the
        # installed stack against the supported ones (rlslurm/stacks.py)
        print("\n".join(version_lines()))
        raise typer.Exit()


_VERSION_HELP = ("print rlslurm's version, where it is installed, its Python, the installed torch, megatron-core, "
                 "SGLang, ... and whether they are a supported stack")


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help=_VERSION_HELP)) -> None:
    """SLURM-native RL post-training (Megatron-core + SGLang) with torchrun and no Ray."""

_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


# The run options that `submit`, `render` and `run` name in their --help, in this order ahead of each
# command's own; every other run flag passes through to rlslurm/settings/flags.py (FLAGS_EPILOG).
RUN_OPTIONS: dict[str, tuple[Any, Any]] = {
    "model": (Optional[str], typer.Option(None, "--model", help="model config name (see `rlslurm models`) or a "
                                          "YAML path", autocompletion=model_names)),
    "nodes": (Optional[int], typer.Option(None, "--nodes", help="total nodes: trainer + rollout")),
    "prompt_data": (Optional[Path], typer.Option(None, "--prompt-data", help="prompts: a .jsonl or .parquet file, a "
                                                 "directory of them, or a `datasets` save_to_disk directory")),
    "run_name": (Optional[str], typer.Option(None, "--run-name", help="run name (default: rlslurm)")),
    "run_dir": (Optional[Path], typer.Option(None, "--run-dir", help="run directory on shared storage (default: "
                                             "./runs/<run-name>)")),
    "config": (Optional[Path], typer.Option(None, "--config", help="run YAML (sections or flat field names); flags "
                                            "override it")),
}


@dataclass
class RunOptions:
    """RUN_OPTIONS as given (None: not given, or not an option of the command)."""

    model: Optional[str] = None
    nodes: Optional[int] = None
    prompt_data: Optional[Path] = None
    run_name: Optional[str] = None
    run_dir: Optional[Path] = None
    config: Optional[Path] = None

    def argv(self, ctx: typer.Context) -> list[str]:
        """The options back into flag form (--config aside: it is a layer, not a flag), followed by every
        other flag as typed."""
        argv: list[str] = []
        for name, value in asdict(self).items():
            if value is not None and name != "config":
                argv += [f"--{name.replace('_', '-')}", str(value)]
        return argv + list(ctx.args)


def _run_options(*, without: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command `f(ctx, opts: RunOptions, <its own options>)` the shared RUN_OPTIONS (but those
    `without`) as Typer options ahead of its own, handed to it as one RunOptions."""
    shared = [name for name in RUN_OPTIONS if name not in without]

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(command)
        ctx_param, _opts, *own = inspect.signature(command).parameters.values()

        @functools.wraps(command)
        def with_run_options(ctx: typer.Context, **given: Any) -> Any:
            return command(ctx, RunOptions(**{name: given.pop(name) for name in shared}), **given)

        params = [ctx_param.replace(annotation=typer.Context)]
        params += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=RUN_OPTIONS[name][1],
                                     annotation=RUN_OPTIONS[name][0]) for name in shared]
        params += [p.replace(annotation=hints[p.name]) for p in own]
        with_run_options.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        with_run_options.__annotations__ = {p.name: p.annotation for p in params}
        return with_run_options

    return wrap


def _resolve(ctx: typer.Context, opts: RunOptions, strict: bool):
    from rlslurm.resolve import resolve

    res = resolve(opts.argv(ctx), opts.config, strict_inputs=strict)
    _print_notes(res)
    return res


def _print_notes(res) -> None:
    for w in res.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}")
    for n in res.notes:
        err.print(f"note: {escape(n)}", highlight=False)


@app.command(cls=RunFlagsCommand, context_settings=_PASSTHROUGH, epilog=FLAGS_EPILOG)
@_run_options()
def submit(
    ctx: typer.Context,
    opts: RunOptions,
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="print the rendered sbatch script; create and submit nothing"),
) -> None:
    """Validate, create the run directory and submit the heterogeneous job.

    Examples (models/<name>: `hf download <hub id> --local-dir models/<name>`):

      rlslurm submit --model glm4-9B --nodes 4 --prompt-data train.jsonl \\
          --hf-checkpoint models/GLM-4-9B-0414
      rlslurm submit --model qwen3-4B --nodes 2 --prompt-data dapo.jsonl \\
          --hf-checkpoint models/Qwen3-4B --partition gpu --time 2-00:00:00 \\
          --rollout-batch-size 64 --global-batch-size 512 \\
          --sglang-mem-fraction-static 0.7
      rlslurm submit --model glm4-9B --nodes 4 --prompt-data train.jsonl \\
          --hf-checkpoint models/GLM-4-9B-0414 --dry-run
    """
    res = _resolve(ctx, opts, not dry_run)
    _warn_node_local(res.cfg.run_dir)
    if dry_run:
        from rlslurm.slurm.render import render

        sys.stdout.write(render(res.cfg, res.cfg.run_dir.resolve()))
        return
    from rlslurm.slurm.submit import submit as do_submit

    sub = do_submit(res)
    out.print(f"submitted job [bold]{sub.job_id}[/] — run dir {sub.run_dir}")
    out.print(f"  follow: rlslurm status {sub.run_dir}   logs: rlslurm logs {sub.run_dir}")


def _warn_node_local(run_dir: Path) -> None:
    from rlslurm.preflight import node_local_run_dir

    if (why := node_local_run_dir(run_dir)) is not None:
        err.print(f"[yellow]warning:[/] {escape(why)}", highlight=False, soft_wrap=True)


DEMO_RUN_NAME = "demo"
DEMO_FLAGS = [
    "--model", "tiny-qwen3", "--run-name", DEMO_RUN_NAME, "--num-rollout", "24", "--custom-rm-path",
    "rlslurm.demo_task:reward", "--rollout-temperature", "1.0", "--num-epoch", "1000",
]
# The engines' dtype for the demo: float32 on CPU (the CPU tier's exact greedy checks); on GPUs the
# engines serve 16-bit (SGLang's CUDA kernels have no float32 rmsnorm: preflight.check_engine_dtype).
DEMO_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}


@app.command(cls=RunFlagsCommand, context_settings=_PASSTHROUGH, epilog=FLAGS_EPILOG)
@_run_options(without=("nodes",))  # one machine: the layout is the command's (below)
def run(
    ctx: typer.Context,
    opts: RunOptions,
    demo: bool = typer.Option(False, "--demo", help="the toy task: a random-init tiny model learns to answer "
                              "'say digits' / 'say letters' from reward alone"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="stop the run after this many seconds"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="live status display"),
) -> None:
    """Run both groups on this machine without SLURM (trainer under torchrun + the rollout process tree).

    Running it again on the same --run-dir resumes the run. Examples:\n
      rlslurm run --demo\n
      rlslurm run --model tiny-qwen3 --prompt-data prompts.jsonl --device cpu --num-rollout 10
    """
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.gpus import role_gpus
    from rlslurm.local import run_local
    from rlslurm.models.model_from_hf import run_model
    from rlslurm.resolve import Resolved
    from rlslurm.settings.config import run_dir_of
    from rlslurm.settings.runfile import load_run_config
    from rlslurm.slurm.submit import prepare_run_dir
    from rlslurm.watchdog import hang_timeout_s

    argv = opts.argv(ctx)
    rd_path = run_dir_of(opts.run_dir, opts.run_name or (DEMO_RUN_NAME if demo else None))
    if demo:
        from rlslurm.demo_task import make_prompts

        rd = RunDir.create(rd_path)
        if not rd.run_yaml.exists() and opts.prompt_data is None:
            argv = ["--prompt-data", str(make_prompts(rd.path / "prompts.jsonl"))] + argv
        argv = DEMO_FLAGS + ["--run-dir", str(rd_path)] + argv
    existing = RunDir(rd_path)
    if existing.run_yaml.exists():
        _refuse_live_job(existing.path)  # before its stop request is cleared
        cfg = load_run_config(existing.path)
        gpus = role_gpus(cfg)
        err.print(f"resuming {existing.path} (its run.yaml is used; flags given now are ignored)")
        _clear_stop(existing.path)
        res = Resolved(cfg, run_model(cfg.model.model, cfg.model.hf_checkpoint))
        prepare_run_dir(res, resume=True)
    else:
        from rlslurm.gpus import machine_gpu_flags
        from rlslurm.resolve import resolve
        from rlslurm.settings.flags import build_config, load_yaml_layer, parse_flags

        layers = [*([load_yaml_layer(opts.config)] if opts.config else []), parse_flags(argv)]
        probe = build_config([parse_flags(["--device", "cpu"]), *layers])  # `rlslurm run` runs on the CPU unless told
        colocate = probe.run.colocate
        # one machine: two "nodes" of one each (each group its own GPUs), or colocated on one
        machine = ["--nodes", "1"] if colocate else ["--nodes", "2", "--trainer-nodes", "1", "--rollout-nodes", "1"]
        machine += machine_gpu_flags(probe, layers)  # --device cuda: the GPUs this machine has
        if demo and not any(("rollout", "rollout_dtype") in layer.values for layer in layers):
            machine += ["--rollout-dtype", DEMO_DTYPE[probe.run.device]]
        res = resolve(["--device", "cpu", *machine] + argv, opts.config, strict_inputs=True)
        _print_notes(res)
        gpus = role_gpus(res.cfg, res.model)  # too few GPUs: refused before the run directory exists
        prepare_run_dir(res)
    cfg = load_run_config(res.cfg.run_dir)
    result = run_local(cfg.run_dir, trainer_procs=cfg.trainer_procs_per_node, num_rollout=cfg.rollout.num_rollout,
                       progress=progress, timeout_s=timeout, console=err, gpus=gpus,
                       stop_grace_s=cfg.slurm.signal_grace_s, hang_timeout_s=hang_timeout_s(cfg.train))
    raise typer.Exit(result.returncode)


def _refuse_live_job(run_dir: Path) -> None:
    """Two jobs must not share a run directory: refused while the run's SLURM job is pending, running or
    still ending (`rlslurm run` and `rlslurm resubmit` alike)."""
    from rlslurm.slurm.status import job_alive
    from rlslurm.slurm.submit import current_job_id

    job = current_job_id(run_dir)
    if job and (state := job_alive(job)):
        raise UserError(f"{run_dir}: its job {job} is still {state}; two jobs must not share a run directory "
                        f"(`rlslurm cancel {run_dir}` first, or let it end)")


def _clear_stop(run_dir: Path) -> None:
    """Continuing a run is the user's answer to their earlier `rlslurm stop` (or Ctrl-C / --timeout
    of `rlslurm run`): without clearing it, the new attempt would stop at once."""
    from rlslurm.buffer.control import Control

    if Control(run_dir).clear_stop():
        err.print(f"{run_dir}: cleared the earlier stop request")


@app.command()
def resubmit(
    run_dir: Path = typer.Argument(..., help="an existing run directory"),
    reset_failures: bool = typer.Option(False, "--reset-failures", help="give the run a new failure budget "
                                        "(--max-failures); without it, earlier failed attempts still count"),
) -> None:
    """Submit an existing run again (after its failure budget ran out or it was cancelled).

    It resumes from the run directory: checkpoints, buffer and data cursor. run.yaml is reused as is;
    attempt numbers continue after the run's last attempt.
    """
    from rlslurm.buffer.attempts import failures_counted
    from rlslurm.buffer.ledger import read_ledger
    from rlslurm.buffer.rundir import RunDir
    from rlslurm.models.model_from_hf import run_model
    from rlslurm.resolve import Resolved
    from rlslurm.settings.runfile import load_run_config
    from rlslurm.slurm.submit import submit as do_submit

    if RunDir(run_dir).is_finished():
        raise UserError(f"{run_dir}: the run is FINISHED; nothing to resubmit")
    cfg = load_run_config(run_dir)
    _refuse_live_job(run_dir)
    failed = failures_counted(read_ledger(run_dir))
    if not reset_failures and failed >= cfg.slurm.max_failures:
        err.print(f"[yellow]warning:[/] {failed} failed attempts since the last new checkpoint count against "
                  f"--max-failures {cfg.slurm.max_failures}: a failure before the next checkpoint ends the job; "
                  f"--reset-failures gives a new budget")
    _warn_node_local(cfg.run_dir)
    _clear_stop(run_dir)
    sub = do_submit(Resolved(cfg, run_model(cfg.model.model, cfg.model.hf_checkpoint)), resume=True,
                    reset_failures=reset_failures)
    out.print(f"submitted job [bold]{sub.job_id}[/] — run dir {sub.run_dir}")


@app.command(cls=RunFlagsCommand, context_settings=_PASSTHROUGH, epilog=FLAGS_EPILOG)
@_run_options()
def render(
    ctx: typer.Context,
    opts: RunOptions,
    resolved: bool = typer.Option(False, "--resolved", help="print the resolved run.yaml instead of the script"),
) -> None:
    """Print the sbatch script (or the resolved config) without validating input files.

    Example: rlslurm render --model qwen3-8B --nodes 4 --resolved
    """
    res = _resolve(ctx, opts, False)
    if resolved:
        from rlslurm.settings.runfile import dump_run_config

        sys.stdout.write(dump_run_config(res.cfg))
    else:
        from rlslurm.slurm.render import render as do_render

        sys.stdout.write(do_render(res.cfg, res.cfg.run_dir.resolve()))


def _run_dir_arg(run_dir: Path) -> Path:
    from rlslurm.buffer.rundir import RunDir

    if not RunDir(run_dir).is_run_dir():
        raise UserError(f"{run_dir}: not an rlslurm run directory")
    return run_dir


@app.command()
def status(
    run_dir: Path = typer.Argument(..., help="run directory"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    follow: bool = typer.Option(False, "--follow", "-f", help="then print a line per training step as it is "
                                "trained, until no attempt of the run lives (Ctrl-C to stop)"),
) -> None:
    """Job state (scontrol/squeue/sacct), attempts from the ledger, progress from the run dir.

    Examples: rlslurm status runs/glm4-grpo --json | rlslurm status runs/glm4-grpo --follow
    """
    from rlslurm.slurm.status import pending_hint, phase_line, rollouts_line, run_status, state_row, weights_line

    if as_json and follow:
        raise UserError("--json prints one object and --follow a line per step: give one of them")
    st = run_status(_run_dir_arg(run_dir))
    if as_json:
        print(json.dumps(st.as_dict(), indent=2, default=str))
        return
    head: list[tuple[str, str | Text]] = [("run dir", str(st.run_dir)), (
        "job", f"{st.job_id or '-'}  {st.slurm.get('state')}  (from {st.slurm.get('source') or 'nowhere'})")]
    for c in st.slurm.get("components", []):
        # a --nodes 1 job is one group, no het components (docs/single-node.md)
        label = f"  het group {c['offset']}" if c.get("offset") is not None else "  one node, both groups"
        head.append((label, f"{c.get('id')} {c.get('state')} on {c.get('nodes')}"))
    head.append(state_row(st))
    head.append(("rollouts", rollouts_line(st)))
    if (hint := pending_hint(st.slurm)) is not None:
        head.append(("note", Text(hint, style="yellow")))
    head.append(("weights", weights_line(st.weights)))
    for p in sorted(st.phases, key=lambda p: (p["role"] != "trainer", p["role"], p["rank"])):
        if p["phase"] and (p["role"], p["rank"]) in (("trainer", 0), ("rollout", 0)):
            head.append((f"{p['role']} {p['rank']}", phase_line(p, st.live)))
    if st.reward_trend:
        from rlslurm.curve import sparkline

        vals = [v for _, v in st.reward_trend]
        head.append(("reward", f"{sparkline(vals)}  last {vals[-1]:.3f} (rollout {st.reward_trend[-1][0]}), "
                     f"min {min(vals):.3f} max {max(vals):.3f}"))
    if st.engines and all(e.get("gone") for e in st.engines):
        head.append(("engines", f"{len(st.engines)} gone with the attempt"))
    elif st.engines:
        healthy = sum(1 for e in st.engines if e.get("healthy"))
        waiting = sum(1 for e in st.engines if e.get("awaiting_weights"))
        head.append(("engines", f"{healthy}/{len(st.engines)} healthy, "
                     f"{sum(e.get('restarts', 0) for e in st.engines)} restarts"
                     + (f", {waiting} awaiting weights (not routed)" if waiting else "")))
    print_pairs(out, head)
    fmt = lambda ts: time.strftime("%m-%d %H:%M:%S", time.localtime(ts)) if ts and ts > 0 else "-"  # noqa: E731
    attempts: list[tuple[str | Text, ...]] = []
    rows = [(a.get("attempt", 0), 1, a) for a in st.attempts] + [(r.get("next_attempt", 0), 0, r) for r in st.resubmits]
    for _, _, a in sorted(rows, key=lambda r: r[:2]):
        if "event" in a:  # a resubmit: before the attempt it numbered
            attempts.append(("", "", fmt(a.get("at")), "", "", "resubmitted" + (", new failure budget"
                                                                                if a.get("reset_failures") else "")))
            continue
        attempts.append((str(a.get("attempt")), str(a.get("job_id")), fmt(a.get("start")), fmt(a.get("end")),
                         str(a.get("exit_code")), str(a.get("reason"))))
    if st.current_attempt:
        a = st.current_attempt
        attempts.append((str(a.get("attempt")), str(a.get("job_id")), fmt(a.get("start")), "-", "-",
                         Text("running", style="green")))
    if not out.is_terminal:
        out.file.write("\n")  # the attempts' rows after a blank line: two blocks a script can split
    print_table(out, ("attempt", "job", "start", "end", "exit", "reason"), attempts,
                title=f"attempts ({len(st.attempts) + (1 if st.current_attempt else 0)})")
    if st.user_error:  # on a line of its own: a table cell wraps; the message is the user's text
        ue = st.user_error
        where = ", ".join(f"{k} {ue[k]}" for k in ("attempt", "role", "host") if ue.get(k) is not None)
        out.print(f"{ue['reason']} ({where}); the job was not requeued: fix it, then rlslurm resubmit",
                  markup=False, highlight=False)
    if follow:
        from rlslurm.watch import follow as follow_steps

        out.print()
        follow_steps(run_dir, out)


@app.command()
def cancel(run_dir: Path = typer.Argument(..., help="run directory")) -> None:
    """Cancel the run's current job (`scancel`). The run dir stays; `rlslurm resubmit` continues it."""
    from rlslurm.slurm.submit import current_job_id

    job = current_job_id(_run_dir_arg(run_dir))
    if not job:
        raise UserError(f"{run_dir}: no job was submitted for this run")
    rc = subprocess.run(["scancel", job], capture_output=True, text=True, timeout=30)
    if rc.returncode != 0:
        raise UserError(f"scancel {job}: {rc.stderr.strip()}")
    out.print(f"cancelled job {job}")


@app.command()
def stop(
    run_dir: Path = typer.Argument(..., help="run directory"),
    reason: str = typer.Option("user request", "--reason"),
) -> None:
    """Ask the run to stop cleanly: processes exit at their next check and the job ends without requeue."""
    from rlslurm.buffer.control import Control

    Control(_run_dir_arg(run_dir)).request_stop(reason)
    out.print(f"stop requested for {run_dir}")


@app.command()
def logs(
    run_dir: Path = typer.Argument(..., help="run directory"),
    attempt: Optional[int] = typer.Option(None, "--attempt", help="attempt number (default: the latest)"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C to stop)"),
    lines: int = typer.Option(40, "--lines", "-n", help="lines of each log to show first"),
    raw: bool = typer.Option(False, "--raw", help="every line as written, the noise too (nanobind's leak report "
                             "at exit, HTTP access lines)"),
) -> None:
    """Show the logs of an attempt: every trainer and rollout node's, then the engines', the router's
    and the batch script's; without --raw, known noise is left out and counted (rlslurm/log_view.py).

    Example: rlslurm logs runs/glm4-grpo -f
    """
    from rlslurm import log_view
    from rlslurm.buffer.rundir import RunDir

    rd = RunDir(_run_dir_arg(run_dir))
    attempts = sorted(int(p.name.split("-")[-1]) for p in rd.logs_dir.glob("attempt-*"))
    if not attempts:
        raise UserError(f"{run_dir}: no attempt has started yet")
    n = attempts[-1] if attempt is None else attempt
    if n not in attempts:
        raise UserError(f"--attempt {n}: no such attempt (have {attempts})")

    def files() -> list[Path]:
        return _logs_in_reading_order(rd.attempt_log_dir(n)) + sorted(rd.logs_dir.glob("slurm-*.out"))

    if not files():
        raise UserError(f"attempt {n}: no log files yet")
    if raw:
        os.execvp("tail", ["tail", "-n", str(lines)] + (["-F"] if follow else []) + [str(f) for f in files()])
    log_view.show(files(), lines)
    if follow:
        log_view.follow(files)


def _logs_in_reading_order(attempt_dir: Path) -> list[Path]:
    """The trainer's logs (by rank), then the rollout nodes', then the rest (engines, router): a
    failure is read in the roles' logs first, and an engine's log is mostly its requests."""
    def key(p: Path) -> tuple[int, str, int]:
        role, _, rank = p.stem.partition("-")
        order = {"trainer": 0, "rollout": 1}.get(role, 2)
        return (order, p.name if order == 2 else role, int(rank) if order < 2 and rank.isdigit() else 0)

    return sorted(attempt_dir.glob("*.log"), key=key)


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="one JSON array of {name, hf_architecture, "
                                        "params, tiny}")) -> None:
    """List the model configs (architecture, size, default layout for 2 and 4 nodes) for --model.

    Into a pipe, plain tab-separated rows: rlslurm models | grep qwen3-4B
    """
    from rlslurm.settings.model_config import MODEL_CONFIG_DIR, available_models, load_model_config

    rows = [load_model_config(n) for n in available_models()]
    if as_json:
        print(json.dumps([{"name": m.name, "hf_architecture": m.hf_architecture, "params": m.num_params,
                           "tiny": m.tiny} for m in rows], indent=2))
        return
    cells = []
    for m in rows:
        a = m.arch
        size = f"{m.num_params / 1e9:.1f} B" if m.num_params > 1e8 else f"{m.num_params / 1e3:.0f} k"
        moe = f"{a.moe.num_experts}e top{a.moe.router_topk}" if a.moe else "-"

        def layout(n: int) -> str:
            d = m.defaults_for(n)
            if not d:
                return "-"
            return f"TP{d.get('tensor_model_parallel_size', 1)} eng{d.get('rollout_num_gpus_per_engine', 1)}"

        cells.append((m.name, m.hf_architecture, size, str(a.num_layers), str(a.hidden_size),
                      f"{a.num_attention_heads}/{a.num_query_groups}", moe, f"{layout(2)} / {layout(4)}"))
    print_table(out, ("name", "HF architecture", "params", "layers", "hidden", "heads/kv", "MoE",
                      "defaults @2 / @4 nodes"), cells, title=f"model configs ({MODEL_CONFIG_DIR}/*.yaml)")


@app.command()
def flags(
    keyword: Optional[str] = typer.Argument(None, help="show only flags whose name or section contains it, or "
                                            "whose description has it as a word (e.g. lr, sbatch, wandb)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON array of {flag, section, type, default, "
                                 "description}"),
) -> None:
    """Every run flag: its config section, type, default and what it does.

    Each is also a key of a --config run YAML (its field name: --rollout-batch-size is rollout_batch_size).
    Passthrough families, not listed: --sglang-<flag> (every SGLang server), --router-<flag> (sglang-router),
    --megatron-<field> (a megatron-core config field).\n
    Examples: rlslurm flags | rlslurm flags lr | rlslurm flags --json | rlslurm flags | grep -i wandb
    """
    from rlslurm.settings.flags import flag_help

    found = flag_help(keyword)
    if not found:
        raise UserError(f"rlslurm flags {keyword}: no flag matches it (`rlslurm flags` lists all "
                        f"{len(flag_help())})")
    if as_json:
        print(json.dumps([{"flag": h.flag, "field": h.field, "section": h.section, "type": h.type,
                           "default": h.default, "description": h.description} for h in found],
                         indent=2, default=str))
        return
    print_table(out, ("flag", "section", "type", "default", "description"),
                [(h.flag, h.section, h.type, _shown_default(h.default), h.description) for h in found],
                title="run flags (also --config YAML keys); plus --sglang-*, --router-*, --megatron-* passthrough")


def _shown_default(v: object) -> str:
    """A default as a user would type it: `-` for unset, lower-case booleans, lists space-separated."""
    if v is None or v == [] or v == {}:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="the same facts as one JSON object")) -> None:
    """Run on a node: the installed stack (as --version) and what the machine has: GPUs, CUDA,
    torch_memory_saver, transformer-engine. Exits 1 when the stack is not a supported one
    (docs/supported-stacks.md).
    """
    from rlslurm.doctor import doctor_facts, doctor_lines

    facts = doctor_facts()
    print(json.dumps(facts, indent=2) if as_json else "\n".join(doctor_lines(facts)))
    if not facts["stack"]["supported"]:
        raise typer.Exit(1)


@app.command("import-slime")
def import_slime(
    script: Path = typer.Argument(..., help="a slime launch script (run-*.sh); it is read, never run"),
    as_yaml: bool = typer.Option(False, "--yaml", help="print a run YAML for `rlslurm submit --config` instead"),
    var: list[str] = typer.Option([], "--var", metavar="NAME=VALUE",
                                  help="a variable's value where the script uses it and cannot know it (one it does "
                                       "not set, or sets from a command or inside an if); repeatable. Variables the "
                                       "script does not set also come from this command's environment"),
) -> None:
    """Print the `rlslurm submit` command of a slime launch script (its *_ARGS arrays and train.py line).

    Every slime flag it does not map is listed on stderr with the script's line and the reason
    (docs/slime-flags.md); a value it cannot know stays in the command as <unset:NAME>, which submit
    refuses until it is filled. Example: BASE_DIR=/data rlslurm import-slime scripts/run-qwen3-4B.sh > submit.sh
    """
    import os

    from rlslurm.slime_import import as_command, as_yaml as to_yaml, import_script, parse_vars

    imp = import_script(script, variables=parse_vars(var), environ=os.environ)
    sys.stdout.write(to_yaml(imp) if as_yaml else as_command(imp))
    for line in imp.report_lines():
        err.print(line, markup=False, highlight=False, soft_wrap=True)


def _mount_subapps() -> None:
    from rlslurm.buffer.cli import app as buffer_app

    app.add_typer(buffer_app, name="buffer", help="Inspect a run's rollout buffer (ls, show, export).")


@app.command(context_settings={**_PASSTHROUGH, "help_option_names": []}, add_help_option=False)
def convert(ctx: typer.Context) -> None:
    """HF <-> Megatron checkpoint conversion: `rlslurm convert hf-to-mcore|mcore-to-hf --help`.

    Here it runs in this process (use torchrun for TP/PP/EP > 1); with `--submit` it becomes a
    one-node SLURM job of TP x PP x EP processes (submitit), optionally with --partition,
    --account, --time MIN, --gpus-per-node, --cpus-per-task, --job-dir.
    """
    from rlslurm.slurm.convert_job import SUBMIT_HELP
    from rlslurm.stacks import check_convert_args

    args = list(ctx.args)
    # the job runs this interpreter (submitit), so its stack is checked here too (rlslurm/stacks.py)
    conversion = check_convert_args(args)
    if "--submit" in args and "--help" not in args:
        from rlslurm.slurm.convert_job import split_submit_args, submit as submit_conversion

        job = submit_conversion(split_submit_args([a for a in args if a != "--wait"]))
        out.print(f"submitted conversion job [bold]{job.job_id}[/]; logs in {job.paths.stdout.parent}")
        if "--wait" in args:
            rc = job.result()
            out.print(f"conversion job {job.job_id} finished with exit code {rc}")
            raise typer.Exit(rc)
        return
    from rlslurm.convert.cli import app as convert_app

    # the converter's own parser, with --submit and its SLURM flags added to every --help
    command = typer.main.get_command(convert_app)
    for c in [command, *getattr(command, "commands", {}).values()]:
        c.epilog = SUBMIT_HELP
    command(args=conversion, prog_name="rlslurm convert")


_mount_subapps()


def main() -> None:
    try:
        app(prog_name="rlslurm")  # also under `python -m rlslurm`: help and completion name the command
    except (UserError, StorageError) as e:  # StorageError: the run directory's filesystem, one line too
        # escaped: a message quoting user input ("'[full'") is not rich markup
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2 if isinstance(e, UserError) else 1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
