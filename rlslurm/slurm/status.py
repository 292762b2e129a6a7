"""Job state from SLURM plus the run's own record (ledger, buffer, control files).

Without a job to ask (a `rlslurm run`, or SLURM no longer knows it) the state comes from the run's
own record: FINISHED, RUNNING while a role's heartbeat is fresh, else how the last attempt ended.
Engines are healthy only while their node's heartbeat is fresh: engines.json keeps the last word
of a node that is gone. What each role does now (its heartbeat's phase) and how weights reached
the engines (control/weight_version.json: the transport, the fallbacks) say why a run is slow or
stalled: a disk fallback shows here, not only as a line in a log.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlslurm.buffer.attempts import is_event
from rlslurm.buffer.control import Control
from rlslurm.buffer.ledger import read_ledger
from rlslurm.buffer.rundir import RunDir
from rlslurm.curve import reward_curve
from rlslurm.slurm.submit import current_job_id
from rlslurm.user_error import REASON_PREFIX, read_user_error

if TYPE_CHECKING:
    from rich.text import Text

_TIMEOUT_S = 20
# A heartbeat older than this says its process is gone (trainer nodes and rollout nodes beat every
# 10 s and at each phase, rlslurm/heartbeat.py; a trainer inside a long step may be silent a while).
LIVE_S = 120.0


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def parse_scontrol_records(text: str) -> list[dict[str, str]]:
    """`scontrol show job -o` prints one line per record (one per het component)."""
    records = []
    for line in text.splitlines():
        rec: dict[str, str] = {}
        for tok in line.split():
            k, sep, v = tok.partition("=")
            if sep:
                rec[k] = v
        if rec:
            records.append(rec)
    return records


def slurm_state(job_id: str) -> dict[str, Any]:
    """State of the job and its het components: scontrol (live, and MinJobAge after the end),
    then squeue, then sacct (needs slurmdbd) — whichever answers."""
    text = _run(["scontrol", "show", "job", "-o", job_id])
    if text:
        recs = parse_scontrol_records(text)
        return {
            "source": "scontrol",
            "state": recs[0].get("JobState", "UNKNOWN"),
            "restarts": int(recs[0].get("Restarts", "0")),
            "reason": recs[0].get("Reason"),
            "components": [
                {"id": r.get("JobId"), "offset": r.get("HetJobOffset"), "state": r.get("JobState"),
                 "nodes": r.get("NodeList")}
                for r in recs
            ],
        }
    text = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if text and text.strip():
        return {"source": "squeue", "state": text.split()[0], "components": []}
    text = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    if text and text.strip():
        return {"source": "sacct", "state": text.split()[0], "components": []}
    return {"source": None, "state": "UNKNOWN", "components": []}


# States in which a job may still run its batch script (again), or its processes still write the run
# directory (COMPLETING: SLURM is still ending them, an epilog runs); a resubmit must wait for it to
# leave them.
_ALIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "CONFIGURING", "RESIZING",
          "SIGNALING", "STAGE_OUT", "COMPLETING"}


def job_alive(job_id: str) -> str | None:
    """The job's state if it (or one of its het components) is pending, running or still ending, else None
    (also when SLURM does not answer)."""
    st = slurm_state(job_id)
    for state in [st["state"], *(c.get("state") for c in st.get("components", []))]:
        if state in _ALIVE:
            return state
    return None


@dataclass
class RunStatus:
    run_dir: str
    job_id: str | None
    slurm: dict[str, Any]
    attempts: list[dict[str, Any]]
    current_attempt: dict[str, Any] | None
    finished: bool
    ended_early: str | None = None  # why a FINISHED run stopped before --num-rollout (the prompts ran out)
    rollouts_committed: int = 0  # in the buffer now: retention retires trained ones (docs/buffer-retention.md)
    last_trained_rollout: int | None = None  # the last rollout a checkpoint covers
    rollouts_trained: int = 0  # distinct rollout ids in metrics.jsonl
    rollouts_generated: int | None = None  # the newest committed id + 1 (retention always keeps the newest)
    num_rollout: int | None = None  # --num-rollout, from run.yaml
    # How the newest attempt ended (its ledger line), once no attempt lives; None while one does.
    ended: dict[str, Any] | None = None
    weight_version: int | None = None
    engines: list[dict[str, Any]] = field(default_factory=list)
    reward_trend: list[tuple[int, float]] = field(default_factory=list)  # (rollout id, mean reward), last 50
    resubmits: list[dict[str, Any]] = field(default_factory=list)  # `rlslurm resubmit` records of the ledger
    # The user error that ended the last attempt (rlslurm/user_error.py): its record, or None.
    user_error: dict[str, Any] | None = None
    # control/weight_version.json: version, transport, fallbacks (this attempt's), last_fallback
    weights: dict[str, Any] | None = None
    # each role's heartbeat: role, rank, phase, for_s (in that phase), age_s (of the heartbeat); only
    # while the attempt lives: after it, a heartbeat is what a process last did, not what it does
    phases: list[dict[str, Any]] = field(default_factory=list)
    live: bool = False  # some role's heartbeat is fresh (its process runs)
    attempt_lives: bool = False  # an attempt runs: SLURM says its job is alive, or (no job) `live`

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_status(run_dir: Path, *, query_slurm: bool = True) -> RunStatus:
    rd = RunDir(run_dir)
    job_id = current_job_id(rd.path)
    slurm = slurm_state(job_id) if (job_id and query_slurm) else {"source": None, "state": "UNKNOWN", "components": []}
    ledger = read_ledger(rd)
    attempts = [r for r in ledger if not is_event(r)]
    current = _current_attempt(rd, attempts)
    control = Control(rd, readonly=True)  # a look: a damaged record stays where it is
    wv = control.weight_version()
    try:
        from rlslurm.buffer.reader import RolloutReader

        reader = RolloutReader(rd, readonly=True)
        ids, last_trained = reader.committed_ids(), reader.last_trained()
    except Exception:  # a run dir from before the first commit must not break status
        ids, last_trained = [], None
    phases = role_phases(control)
    live = current is not None and any(p["age_s"] < LIVE_S for p in phases)
    finished = rd.is_finished()
    if slurm["source"] is None:  # nothing to ask: the run's own record
        # an attempt just begun has no heartbeat yet (its roles are importing)
        lives = live or (current is not None and time.time() - (current.get("start") or 0) < LIVE_S)
        slurm = {**slurm, "state": own_state(finished, lives, attempts), "source": "run directory"}
    else:
        lives = current is not None and slurm["state"] in _ALIVE
    curve = reward_curve(rd.path)
    last = max(attempts, key=lambda a: a.get("attempt", -1)) if attempts else None
    return RunStatus(
        run_dir=str(rd.path),
        job_id=job_id,
        slurm=slurm,
        attempts=attempts,
        current_attempt=current,
        finished=finished,
        ended_early=(rd.finished_info() or {}).get("ended_early") if finished else None,
        rollouts_committed=len(ids),
        last_trained_rollout=last_trained,
        rollouts_trained=len(curve),
        rollouts_generated=ids[-1] + 1 if ids else None,
        num_rollout=_num_rollout(rd),
        ended=None if lives or last is None else {k: last.get(k) for k in ("attempt", "job_id", "reason", "exit_code",
                                                                           "end")},
        weight_version=wv.version if wv else None,
        engines=[_engine(e.model_dump(), live, phases) for e in control.engines()],
        reward_trend=curve[-50:],
        resubmits=[r for r in ledger if is_event(r)],
        user_error=_last_user_error(rd, attempts),
        weights=wv.model_dump() if wv else None,
        phases=phases if lives else [],
        live=live,
        attempt_lives=lives,
    )


def _num_rollout(rd: RunDir) -> int | None:
    from rlslurm.settings.runfile import load_run_config

    try:
        return load_run_config(rd.path).rollout.num_rollout
    except Exception:  # status reports what it can read; run.yaml's own errors are submit's to name
        return None


def pending_hint(slurm: dict[str, Any]) -> str | None:
    """A requeued het job that SLURM leaves `PENDING (None)`: on a quiet cluster backfill may not look
    at it for minutes (docs/slurm-test-cluster.md); what starts it now."""
    if slurm.get("state") == "PENDING" and slurm.get("reason") in (None, "None") and slurm.get("restarts", 0) > 0:
        job = next((c["id"] for c in slurm.get("components", []) if c.get("offset") in (None, "0")), None)
        return (f"requeued and PENDING (None): on a quiet cluster SLURM may not start it for minutes; "
                f"`scontrol update jobid={job or '<job>'} StartTime=now` starts it now (docs/slurm-test-cluster.md)")
    return None


def role_phases(control: Control, now: float | None = None) -> list[dict[str, Any]]:
    """Each role process's heartbeat: what it does and for how long."""
    now = time.time() if now is None else now
    out = []
    for hb in control.heartbeats():
        out.append({"role": hb.role, "rank": hb.rank, "host": hb.host, "phase": hb.phase,
                    "for_s": None if hb.phase_since is None else max(0.0, now - hb.phase_since),
                    "age_s": max(0.0, now - hb.time)})
    return out


def own_state(finished: bool, live: bool, attempts: list[dict[str, Any]]) -> str:
    """The state of a run no scheduler knows of (a `rlslurm run`, or a job SLURM forgot)."""
    if finished:
        return "FINISHED"
    if live:
        return "RUNNING"
    if attempts:
        last = max(attempts, key=lambda a: a.get("attempt", -1))
        return f"ENDED ({last.get('reason') or 'exit ' + str(last.get('exit_code'))})"
    return "NOT STARTED"


def _engine(rec: dict[str, Any], live: bool, phases: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine of engines.json as it is now: the record holds only while the rollout group lives."""
    if live and any(p["role"] == "rollout" and p["age_s"] < LIVE_S for p in phases):
        return rec
    return {**rec, "healthy": False, "gone": True}


def _last_user_error(rd: RunDir, ended: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The record of the user error that ended the newest ended attempt, if one did."""
    if not ended:
        return None
    last = max(ended, key=lambda a: a.get("attempt", -1))
    reason = last.get("reason")
    if not isinstance(reason, str) or not reason.startswith(REASON_PREFIX):
        return None
    rec = read_user_error(rd.attempt_log_dir(int(last.get("attempt", 0))))
    return {**(rec or {}), "attempt": last.get("attempt"), "reason": reason}


def _current_attempt(rd: RunDir, ended: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest attempt directory that has no ledger line yet (the one running now)."""
    import json

    done = {a.get("attempt") for a in ended}
    dirs = sorted(
        (p for p in rd.logs_dir.glob("attempt-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    for d in reversed(dirs):
        n = int(d.name.split("-")[-1])
        if n in done:
            return None
        info = d / "attempt.json"
        if info.exists():
            try:
                return json.loads(info.read_text())
            except ValueError:
                return {"attempt": n}
        return {"attempt": n}
    return None


def weights_line(w: dict[str, Any] | None) -> "Text":
    """control/weight_version.json for people: the version, what delivered it, the fallbacks in yellow."""
    from rich.markup import escape
    from rich.text import Text

    if not w:
        return Text("v0 (none published)")
    line = f"v{w['version']}" + (f" via {escape(w['transport'])}" if w.get("transport") else "")
    if w.get("fallbacks"):
        line += (f"  [yellow]{w['fallbacks']} version(s) delivered by the disk fallback this attempt"
                 + (f" (last {escape(w['last_fallback'][:200])})" if w.get("last_fallback") else "") + "[/]")
    return Text.from_markup(line)


def phase_line(p: dict[str, Any], live: bool) -> str:
    """A role's heartbeat phase: what it does and for how long (or did, if its process is gone)."""
    took = f" for {p['for_s']:.0f} s" if p.get("for_s") is not None else ""
    if not live or p["age_s"] > LIVE_S:
        return f"{p['phase']} (its last heartbeat, {p['age_s']:.0f} s ago)"
    return f"{p['phase']}{took}"


def _when(ts: Any) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts)) if isinstance(ts, (int, float)) and ts > 0 else "-"


def state_row(st: RunStatus) -> tuple[str, str]:
    """Where the run stands: running (which attempt, since when), finished, or how its last attempt
    ended (the ledger's reason: failed, preempted, stopped, interrupted), never a stale phase."""
    end = st.ended
    at = f"attempt {end.get('attempt')}, {_when(end.get('end'))}, exit {end.get('exit_code')}" if end else ""
    if st.finished:
        early = f", early: {st.ended_early}" if st.ended_early else ""
        return "finished", f"yes{early}" + (f" ({at})" if at else "")
    if st.attempt_lives and st.current_attempt:
        return "running", f"attempt {st.current_attempt.get('attempt')} since {_when(st.current_attempt.get('start'))}"
    if end:
        return "ended", f"{end.get('reason')} ({at})"
    return "finished", "no"


def rollouts_line(st: RunStatus) -> str:
    """Trained (of --num-rollout) and generated, and how many the buffer keeps: retention retires
    trained rollouts, so the buffer's count is not the run's."""
    trained = f"{st.rollouts_trained}/{st.num_rollout}" if st.num_rollout is not None else str(st.rollouts_trained)
    parts = [f"{trained} trained"]
    if st.last_trained_rollout is not None:
        parts[0] += f" ({st.last_trained_rollout + 1} in the last checkpoint)"
    if st.rollouts_generated is not None:
        parts.append(f"{st.rollouts_generated} generated ({st.rollouts_committed} kept in the buffer)")
    return ", ".join(parts)
