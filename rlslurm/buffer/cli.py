"""`rlslurm buffer ls|show|export` - inspect a run's rollout buffer (read-only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlslurm.buffer.atomic import StorageError, write_bytes_atomic
from rlslurm.buffer.export import export_jsonl, sample_to_json
from rlslurm.buffer.manifest import CorruptRollout
from rlslurm.buffer.reader import RolloutReader
from rlslurm.buffer.rundir import RunDir
from rlslurm.cli_typer import App, Group
from rlslurm.console import make_console, print_table
from rlslurm.errors import ConfigError, UserError

app = App(cls=Group, help="Inspect the rollout buffer of a run directory.", no_args_is_help=True)

RunArg = typer.Argument(..., help="run directory")
KindOpt = typer.Option("train", "--kind", help="train or eval rollouts")


def _reader(run: Path, kind: str) -> RolloutReader:
    rd = RunDir(run)
    if not rd.is_run_dir():
        raise ConfigError(f"{run}: not an rlslurm run directory")
    if kind not in ("train", "eval"):
        raise ConfigError(f"--kind must be train or eval, got {kind!r}")
    return RolloutReader(rd, kind=kind, readonly=True)


def _fail(e: UserError) -> None:
    typer.echo(f"error: {e}", err=True)  # one line, no rich wrapping: paths stay greppable
    raise typer.Exit(1)


@app.command("ls")
def ls(run: Path = RunArg, kind: str = KindOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """List committed rollouts: samples, reward mean/std, truncation rate, weight versions, trained."""
    try:
        r = _reader(run, kind)
        last_trained = r.last_trained()
        rows = []
        for rid in r.committed_ids():
            try:
                m = r.manifest(rid)
            except CorruptRollout as e:
                rows.append({"rollout_id": rid, "error": str(e)})
                continue
            if m is None:
                continue
            rows.append(
                {
                    "rollout_id": rid,
                    "samples": m.stats.n_samples,
                    "groups": m.stats.n_groups,
                    "reward_mean": m.stats.reward_mean,
                    "reward_std": m.stats.reward_std,
                    "truncation_rate": m.stats.truncation_rate,
                    "response_tokens": m.stats.response_tokens,
                    "weight_versions": m.stats.weight_versions,
                    "trained": last_trained is not None and rid <= last_trained,
                    "committed_at": m.committed_at,
                }
            )
        for q in r.quarantined():
            rows.append({"rollout_id": q["rollout_id"], "quarantined": q["path"], "reason": q["reason"]})
    except (UserError, StorageError) as e:
        _fail(e)
    if as_json:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        return
    cells = []
    for row in rows:
        if "error" in row or "quarantined" in row:
            why = row.get("error") or "quarantined: " + row.get("reason", "")
            cells.append((str(row["rollout_id"]), Text(why, style="red"), *[""] * 6))
            continue
        cells.append((
            str(row["rollout_id"]),
            str(row["samples"]),
            f"{row['reward_mean']:.4f}",
            f"{row['reward_std']:.4f}",
            f"{row['truncation_rate']:.1%}",
            str(row["response_tokens"]),
            ",".join(map(str, row["weight_versions"])),
            "yes" if row["trained"] else "no",
        ))
    columns = ("id", "samples", "reward mean", "reward std", "truncated", "tokens", "weight versions", "trained")
    print_table(make_console(), columns, cells, title=f"{r.dir} ({len(rows)} rollouts)", right=columns)


@app.command("show")
def show(
    run: Path = RunArg,
    rollout_id: int = typer.Argument(..., help="rollout id"),
    kind: str = KindOpt,
    as_json: bool = typer.Option(False, "--json", help="one JSON object per sample, with tokens"),
    limit: int = typer.Option(50, "--limit", help="rows of the table (0 = all)"),
) -> None:
    """Show the samples of one rollout."""
    try:
        r = _reader(run, kind)
        try:
            rollout = r.read(rollout_id)
        except KeyError:
            raise ConfigError(f"{r.manifest_path(rollout_id)}: rollout {rollout_id} is not committed") from None
    except (UserError, StorageError) as e:
        _fail(e)
    if as_json:
        for s in rollout.samples:
            sys.stdout.write(json.dumps(sample_to_json(s, rollout_id=rollout_id)) + "\n")
        return
    t = Table(title=f"rollout {rollout_id}: {len(rollout)} samples, weight versions {rollout.meta.weight_versions}")
    for col in ("index", "group", "status", "prompt", "response", "trained tokens", "reward", "version", "label"):
        t.add_column(col, justify="right")
    samples = rollout.samples if limit <= 0 else rollout.samples[:limit]
    for s in samples:
        t.add_row(
            str(s.index),
            str(s.group_index),
            s.status.value,
            str(s.prompt_tokens.shape[0]),
            str(s.response_length),
            str(int(s.effective_loss_mask().sum())),
            f"{s.scalar_reward:.4f}",
            str(s.weight_version),
            "" if s.label is None else str(s.label)[:30],
        )
    Console(width=160, emoji=False).print(t)  # labels are user text: ":100:" stays text
    if limit > 0 and len(rollout) > limit:
        Console(emoji=False).print(f"... {len(rollout) - limit} more (--limit 0 for all)")


@app.command("export")
def export(
    run: Path = RunArg,
    rollout_id: int = typer.Argument(..., help="rollout id"),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl (one sample per line)"),
    kind: str = KindOpt,
    out: Path | None = typer.Option(None, "--out", "-o", help="file to write (default: stdout)"),
) -> None:
    """Export one rollout."""
    try:
        if fmt != "jsonl":
            raise ConfigError(f"--format {fmt!r} is not supported (supported: jsonl)")
        r = _reader(run, kind)
        try:
            data = export_jsonl(r.read(rollout_id))
        except KeyError:
            raise ConfigError(f"{r.manifest_path(rollout_id)}: rollout {rollout_id} is not committed") from None
        if out is None:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        else:
            write_bytes_atomic(out, data, mode=0o600)
    except (UserError, StorageError) as e:
        _fail(e)


if __name__ == "__main__":
    app()
