"""A small Python handle on the real single-host SLURM test cluster (boot.sh / stop.sh).

Tests use it to submit scripts and watch jobs. It shells out to the real SLURM client
commands (sbatch, squeue, scontrol, scancel, sacct) with argv lists and timeouts, and it
does not import the rlslurm package: the harness must keep working while that changes.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOG_DIR = Path(os.environ.get("RLSLURM_CI_LOGS", "/var/log/rlslurm-ci"))  # boot.sh's knob of the same name
JOBCOMP_LOG = LOG_DIR / "jobcomp.log"

# States after which a job will not run again by itself. REQUEUED is missing on purpose:
# a requeued job goes back to PENDING.
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    }
)

# A field of `scontrol show job -o` starts with "Key=" (keys may hold '/', ':'
# e.g. "Socks/Node=", "NtasksPerN:B:S:C="); anything else continues the previous value.
_KEY = re.compile(r"^([A-Za-z][\w/:]*)=(.*)$", re.S)


class SlurmError(RuntimeError):
    """A SLURM client command failed or a job did not reach a state in time."""


class ClusterBootError(SlurmError):
    """boot.sh failed; the message carries its output (with the daemons' log tails)."""


def parse_kv_line(line: str) -> dict[str, str]:
    """Parse one `Key=Value Key=Value ...` record (scontrol -o, jobcomp/filetxt)."""
    out: dict[str, str] = {}
    last: str | None = None
    for tok in line.strip().split(" "):
        m = _KEY.match(tok)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last is not None:
            # A value with spaces (Command=, WorkDir=, Reason=...): glue it back.
            out[last] += " " + tok
    return out


def _base_state(state: str) -> str:
    # scontrol may print e.g. "CANCELLED by 0"; keep the state word only.
    return state.split()[0] if state else state


@dataclass
class SlurmCluster:
    """Boot, use and stop the test cluster. `env` overrides boot.sh knobs (RLSLURM_CI_*)."""

    env: Mapping[str, str] = field(default_factory=dict)
    # The process the cluster belongs to (the pytest session): boot.sh waits while another
    # live owner holds it, and stop.sh leaves another owner's cluster alone.
    owner_pid: int | None = None
    # An apt install on a fresh machine, plus boot.sh waiting (RLSLURM_CI_OWNER_WAIT, 600 s)
    # for another session on the same machine to finish.
    boot_timeout: float = 1200.0
    cmd_timeout: float = 30.0
    booted: bool = False

    # ---- lifecycle ----------------------------------------------------------------------
    def boot(self) -> str:
        """Run boot.sh (stops an earlier cluster of ours first). Returns its output."""
        proc = self._script("boot.sh", self.boot_timeout)
        if proc.returncode != 0:
            raise ClusterBootError(
                f"{HERE / 'boot.sh'} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        self.booted = True
        return proc.stdout

    def stop(self) -> str:
        """Run stop.sh: cancel every job, stop our daemons by pid file. Idempotent."""
        proc = self._script("stop.sh", 120.0)
        self.booted = False
        if proc.returncode != 0:
            raise SlurmError(f"{HERE / 'stop.sh'} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def _script(self, name: str, timeout: float) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env}
        if self.owner_pid is not None:
            env["RLSLURM_CI_OWNER_PID"] = str(self.owner_pid)
        try:
            return subprocess.run(
                ["bash", str(HERE / name)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterBootError(f"{HERE / name} did not finish within {timeout:.0f}s: "
                                   f"{e.stdout!r} {e.stderr!r}") from e

    # ---- raw commands -------------------------------------------------------------------
    def run(self, *argv: str, cwd: str | os.PathLike[str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one SLURM client command. check=True raises SlurmError naming the command."""
        try:
            proc = subprocess.run(
                list(argv),
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=self.cmd_timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise SlurmError(f"`{' '.join(argv)}` timed out after {self.cmd_timeout:.0f}s") from e
        if check and proc.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed (rc={proc.returncode}): "
                             f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    # ---- jobs ---------------------------------------------------------------------------
    def submit(self, script_path: str | os.PathLike[str], *sbatch_args: str,
               cwd: str | os.PathLike[str] | None = None) -> int:
        """sbatch --parsable; returns the job id (the leader id for a het job)."""
        script = Path(script_path)
        proc = self.run("sbatch", "--parsable", *sbatch_args, str(script), cwd=cwd or script.parent)
        first = proc.stdout.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmError(f"sbatch {script}: unexpected output {proc.stdout!r}")
        return int(first)

    def job_records(self, job_id: int) -> list[dict[str, str]]:
        """`scontrol show job -o ID`: one record per het component (one for a plain job).

        Empty once slurmctld has forgotten the job (MinJobAge after it ended)."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return []
            raise SlurmError(f"`scontrol show job -o {job_id}` failed: {proc.stderr.strip()}")
        return [parse_kv_line(ln) for ln in proc.stdout.splitlines() if ln.strip()]

    def job_info(self, job_id: int) -> dict:
        """The job's record as a dict of scontrol fields. For a het job this is the
        leader's record plus `het_components`: every component's record, by offset."""
        recs = self.job_records(job_id)
        if not recs:
            raise SlurmError(f"job {job_id} is unknown to slurmctld")
        comps = sorted((r for r in recs if "HetJobOffset" in r), key=lambda r: int(r["HetJobOffset"]))
        leader = next((r for r in recs if r.get("JobId") == str(job_id)), recs[0])
        info: dict = dict(leader)
        info["het_components"] = comps
        return info

    def state(self, job_id: int) -> str:
        return _base_state(self.job_info(job_id).get("JobState", ""))

    def wait_state(self, job_id: int, states: str | Iterable[str], timeout: float, poll: float = 0.25) -> dict:
        """Poll until the job (the leader, for a het job) is in one of `states`; returns job_info.

        For a het job, RUNNING also waits until every component runs, since components are
        started together and a test that sees one running expects the others."""
        want = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        last: dict | None = None
        while True:
            try:
                last = self.job_info(job_id)
            except SlurmError:
                last = None
            if last is not None:
                st = _base_state(last.get("JobState", ""))
                comps = last["het_components"]
                if st in want and (st != "RUNNING"
                                   or all(_base_state(c.get("JobState", "")) == "RUNNING" for c in comps)):
                    return last
            if time.monotonic() >= deadline:
                summary = (
                    {k: last.get(k) for k in ("JobState", "Reason", "Restarts", "NodeList")} if last else "unknown job"
                )
                raise SlurmError(f"job {job_id} not in {sorted(want)} after {timeout:.0f}s: {summary}")
            time.sleep(poll)

    def wait_finished(self, job_id: int, timeout: float) -> dict:
        """Wait for a terminal state (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...)."""
        return self.wait_state(job_id, TERMINAL_STATES, timeout)

    def in_queue(self, job_id: int) -> bool:
        """Is the job still pending/running/completing (what plain `squeue` lists)?"""
        proc = self.run("squeue", "-h", "-j", str(job_id), "-o", "%i", check=False)
        if proc.returncode != 0:
            # squeue errors out for ids slurmctld has already purged.
            return False
        return any(ln.strip() for ln in proc.stdout.splitlines())

    def wait_gone(self, job_id: int, timeout: float, poll: float = 0.25) -> None:
        """Wait until `squeue` no longer lists the job (it ended and left COMPLETING)."""
        deadline = time.monotonic() + timeout
        while self.in_queue(job_id):
            if time.monotonic() >= deadline:
                raise SlurmError(f"job {job_id} still in squeue after {timeout:.0f}s: {self._squeue_line(job_id)}")
            time.sleep(poll)

    def _squeue_line(self, job_id: int) -> str:
        return self.run("squeue", "-h", "-j", str(job_id), "-o", "%i %T %r", check=False).stdout.strip()

    def requeue(self, job_id: int) -> None:
        """`scontrol requeue` (a het job must be named by its leader id)."""
        self.run("scontrol", "requeue", str(job_id))

    def cancel(self, job_id: int) -> None:
        self.run("scancel", str(job_id))

    def cancel_all(self, timeout: float = 120.0) -> list[int]:
        """Cancel every job still in the queue and wait until they are gone; the ids cancelled."""
        ids = sorted({int(x.split("+")[0]) for x in self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()})
        for job in ids:
            self.run("scancel", str(job), check=False)
        for job in ids:
            self.wait_gone(job, timeout)
        return ids

    def signal_batch(self, job_id: int, signal: str = "USR1") -> None:
        """Send a signal to the batch shell only (`scancel --signal=SIG --batch`).
        Works for a het leader: the batch shell runs in component 0."""
        self.run("scancel", f"--signal={signal}", "--batch", str(job_id))

    # ---- history ------------------------------------------------------------------------
    def jobcomp_records(self, job_id: int | None = None) -> list[dict[str, str]]:
        """Lines of the jobcomp/filetxt log, one per finished or requeued run (a requeued run
        is logged with JobState=PENDING). `sacct -c` reads the same file."""
        try:
            text = JOBCOMP_LOG.read_text()
        except FileNotFoundError:
            return []
        recs = [parse_kv_line(ln) for ln in text.splitlines() if ln.strip()]
        if job_id is not None:
            recs = [r for r in recs if r.get("JobId") == str(job_id) or r.get("HetJobId") == str(job_id)]
        return recs
