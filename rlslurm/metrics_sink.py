"""Where metric records go: a JSON Lines file always, TensorBoard when given a directory, and
Weights & Biases with --use-wandb (docs/wandb.md).

One process per role writes: the trainer's global rank 0 (RUN/metrics.jsonl, RUN/tb) and the
rollout driver (RUN/rollout_metrics.jsonl). The JSONL file is the record: it is written first and
its failure (a full disk) is the caller's error; TensorBoard and W&B are views of it. A W&B
failure (no network, a bad key) is logged once and turns that sink off; training goes on.

W&B: each role logs its own run, `<--wandb-run-id>-trainer` and `<--wandb-run-id>-rollout`, in
one group (--wandb-group, default the run name): two writers of one run need W&B's shared mode,
and offline they would overwrite each other; two runs of a group work offline as well. The W&B
step is the rollout id. W&B steps must grow within a run, and an offline run cannot be resumed on
the node (each attempt writes its own offline-run-* directory, uploadable as one run only when
their steps are disjoint), so each role keeps the highest step it gave W&B in
RUN/wandb/<role>.last_step and a later attempt skips the steps at or below it: the rollouts a
resumed trainer trains again after its checkpoint are in the JSONL file twice, in W&B once.
docs/wandb.md has the measurements and the flags.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlslurm.buffer.atomic import append_line, ensure_dir, read_bytes, write_bytes_atomic

if TYPE_CHECKING:
    from rlslurm.settings.config import RunConfig

log = logging.getLogger(__name__)

ROLES = ("trainer", "rollout")
# Record fields that describe the line rather than measure anything: not charted.
BOOKKEEPING = frozenset({"step", "attempt", "time", "kind"})


class Sink(Protocol):
    def log(self, record: dict[str, Any], *, step: int, rollout_id: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The chartable values of a record: finite numbers that are not bookkeeping."""
    return {k: v for k, v in record.items()
            if k not in BOOKKEEPING and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class JsonlSink:
    """One JSON line per record, appended whole or not at all (buffer/atomic.py `append_line`)."""

    def __init__(self, path: Path, what: Callable[[dict[str, Any]], str], *, sort_keys: bool = False):
        self.path, self.what, self.sort_keys = Path(path), what, sort_keys

    def log(self, record: dict[str, Any], *, step: int, rollout_id: int) -> None:
        ensure_dir(self.path.parent)
        line = json.dumps(record, sort_keys=self.sort_keys) + "\n"
        append_line(self.path, line.encode(), self.what(record))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars at the caller's step (the trainer's optimizer step; the rollout id for the driver)."""

    def __init__(self, writer: Any):
        self._tb = writer

    @classmethod
    def open(cls, tb_dir: Path) -> "TensorBoardSink | None":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional: the JSONL file is the record
            return None
        return cls(SummaryWriter(log_dir=str(tb_dir)))

    def log(self, record: dict[str, Any], *, step: int, rollout_id: int) -> None:
        for k, v in scalars(record).items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


def wandb_enabled(cfg: "RunConfig") -> bool:
    return cfg.run.use_wandb and cfg.run.wandb_mode != "disabled"


def wandb_state_dir(run_dir: Path) -> Path:
    """rlslurm's own W&B state (the step marks); W&B's files go to --wandb-dir, default the same."""
    return Path(run_dir) / "wandb"


class WandbSink:
    """The role's W&B run, resumed by id on every attempt; the W&B step is the rollout id."""

    def __init__(self, run: Any, mark: Path, attempt: int):
        self.run, self.mark, self.attempt = run, mark, attempt
        # steps an earlier attempt already gave W&B: logging them again would be refused online
        # and would overlap offline (see the module docstring)
        self.floor = _read_mark(mark)
        self.high = self.floor

    @classmethod
    def open(cls, cfg: "RunConfig", role: str, attempt: int) -> "WandbSink | None":
        assert role in ROLES, role
        r = cfg.run
        state = ensure_dir(wandb_state_dir(cfg.run_dir))
        files = ensure_dir(r.wandb_dir) if r.wandb_dir is not None else state
        run_id = f"{r.wandb_run_id}-{role}"
        try:
            import wandb

            settings = wandb.Settings(console="off",  # the attempt's logs already hold the output
                                      **({"base_url": r.wandb_host} if r.wandb_host else {}))
            run = wandb.init(id=run_id, resume="allow", project=r.wandb_project, entity=r.wandb_team,
                             group=r.wandb_group or r.run_name, name=f"{r.run_name}-{role}", job_type=role,
                             dir=str(files), mode=r.wandb_mode, config=cfg.model_dump(mode="json"),
                             settings=settings)
        except Exception as e:  # noqa: BLE001  W&B is a view: the JSONL file keeps every record
            log.error("W&B: could not start run %s (%s: %s); metrics still go to the JSONL file",
                      run_id, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        log.info("W&B: logging to run %s (%s mode) under %s", run_id, r.wandb_mode or "WANDB_MODE/online", files)
        return cls(run, state / f"{role}.last_step", attempt)

    def log(self, record: dict[str, Any], *, step: int, rollout_id: int) -> None:
        if rollout_id <= self.floor or rollout_id < self.high:
            return  # already in W&B (an earlier attempt, or a regenerated rollout)
        self.run.log({**scalars(record), "attempt": self.attempt}, step=rollout_id)
        if rollout_id > self.high:
            self.high = rollout_id
            write_bytes_atomic(self.mark, str(rollout_id).encode())

    def close(self) -> None:
        self.run.finish()


def _read_mark(mark: Path) -> int:
    raw = read_bytes(mark)
    try:
        return int(raw) if raw else -1
    except ValueError:  # written atomically by this module, so foreign: W&B then refuses repeats itself
        log.warning("W&B: %s is not a step number; ignoring it", mark)
        return -1


class MetricSinks:
    """The sinks of one role; the first (the JSONL file) raises, the others are switched off on error."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, record: dict[str, Any], *, step: int, rollout_id: int) -> None:
        self.sinks[0].log(record, step=step, rollout_id=rollout_id)
        for sink in list(self.sinks[1:]):
            try:
                sink.log(record, step=step, rollout_id=rollout_id)
            except Exception as e:  # noqa: BLE001  a view failing must not stop the run
                log.error("metrics: %s failed (%s: %s); it is switched off for this attempt",
                          type(sink).__name__, type(e).__name__, e)
                self.sinks.remove(sink)
                _close_quietly(sink)

    def close(self) -> None:
        for sink in self.sinks:
            _close_quietly(sink)

    def names(self) -> list[str]:
        return [type(s).__name__ for s in self.sinks]


def _close_quietly(sink: Sink) -> None:
    try:
        sink.close()
    except Exception as e:  # noqa: BLE001  closing a view at the end must not mask the run's outcome
        log.error("metrics: closing %s failed (%s: %s)", type(sink).__name__, type(e).__name__, e)


def open_sinks(role: str, jsonl: JsonlSink, *, tb_dir: Path | None = None, cfg: "RunConfig | None" = None,
               attempt: int = 0) -> MetricSinks:
    """The registry of one role's sinks: the JSONL file; TensorBoard if `tb_dir`; W&B if `cfg`
    has --use-wandb (and not --wandb-mode disabled)."""
    sinks: list[Sink] = [jsonl]
    if tb_dir is not None and (tb := TensorBoardSink.open(tb_dir)) is not None:
        sinks.append(tb)
    if cfg is not None and wandb_enabled(cfg) and (wb := WandbSink.open(cfg, role, attempt)) is not None:
        sinks.append(wb)
    return MetricSinks(sinks)
