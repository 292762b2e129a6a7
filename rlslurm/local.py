"""`rlslurm run`: the same two groups on one machine, without SLURM.

het-group 0 becomes `torchrun --standalone`-style on 127.0.0.1 (`rlslurm.trainer.main`), het-group 1
one `rlslurm.rollout.main` process tree; both read RUN/run.yaml exactly as in the SLURM job. This
process plays the batch script's part: one ledger line per attempt, per-attempt logs, FINISHED
or stop ends it, a failure ends it (run it again to resume: the run directory is the state); a user
error a role recorded ends it with that error's exit code and message (rlslurm/user_error.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from rlslurm import owned_role
from rlslurm.attempt import FINISHED, LOCAL, Attempt, begin, end as end_attempt, rollout_argv, trainer_argv
from rlslurm.buffer.atomic import PRIVATE_UMASK, open_log
from rlslurm.buffer.attempts import next_attempt
from rlslurm.buffer.control import Control
from rlslurm.buffer.rundir import RunDir
from rlslurm.console import make_console
from rlslurm.curve import plot_png, reward_curve, sparkline
from rlslurm.engines import procfs
from rlslurm.job.env import ATTEMPT_ENV
from rlslurm.net import rendezvous_port
from rlslurm.secret_env import read_secret_env
from rlslurm.settings.runfile import load_run_config
from rlslurm.slurm.status import phase_line, role_phases, weights_line
from rlslurm.step_line import MetricsTail, step_line
from rlslurm.user_error import USER_ERROR_EXIT_CODE, read_failure, read_user_error
from rlslurm.watchdog import CHECK_EVERY_S, silent_roles

FINISH_GRACE_S = 60
HUNG_STOP_GRACE_S = 15.0  # a role the watchdog found silent: TERM, then KILL
STOP_GRACE_S = 300.0  # the batch script gives the trainer --signal-grace-s (default 300) the same way


@dataclass
class LocalResult:
    returncode: int
    reason: str
    attempt: int


def _clean_env(attempt: int, rd: RunDir | None = None) -> dict[str, str]:
    """This environment without SLURM's variables, plus the run's --env values and its secrets
    (RUN/control/secret_env), as the batch script exports them under SLURM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    if rd is not None:
        env.update(load_run_config(rd.path).slurm.env)
        env.update(read_secret_env(rd.path))
    env[ATTEMPT_ENV] = str(attempt)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


LOCAL_ADDR = "127.0.0.1"
# return codes of a process ended by a signal sent to it (Popen's -N, or a shell's 128 + N): TERM, KILL, INT
_SIGNALLED = frozenset({-15, -9, -2, 143, 137, 130})
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b.*: ")


def last_error_line(log: Path, limit: int = 300) -> str | None:
    """The last line of a log that states an exception ("SomeError: why"), shortened to `limit`."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    line = next((l for l in reversed(lines) if _ERROR_LINE.match(l)), None)
    return None if line is None else (line if len(line) <= limit else line[:limit] + " ...")


def role_commands(rd: RunDir, trainer_procs: int, port: int,
                  stop_grace_s: float = STOP_GRACE_S) -> dict[str, list[str]]:
    """Both roles on this machine: what each node of the het job runs (rlslurm/attempt.py), as one node.
    torchrun gives the trainer's checkpoint on a TERM the same grace this process gives it."""
    return {"trainer": trainer_argv(rd.path, nnodes=1, node_rank=0, procs_per_node=trainer_procs,
                                    master_addr=LOCAL_ADDR, master_port=port, shutdown_timeout_s=int(stop_grace_s)),
            "rollout": rollout_argv(rd.path, trainer_addr=LOCAL_ADDR)}


def _tree(proc: subprocess.Popen) -> procfs.Pinned:
    """The role's live processes below its group leader, whatever session they are in (torchrun starts
    each worker in a session of its own, out of reach of a signal to the role's process group)."""
    return procfs.pin(procfs.descendants(proc.pid))


def _stop(proc: subprocess.Popen, grace: float = HUNG_STOP_GRACE_S) -> int:
    """TERM the role's process group; after `grace` seconds, KILL it and every process of its tree that
    is left. Returns its exit code once the whole tree is gone: a trainer worker that outlived a killed
    torchrun kept 33.7 GiB of the GPU after `rlslurm run` had returned (bench/results/gpu-lease-2026-12-07.md)."""
    # only while the leader lives: once reaped, its pid may be another process's
    tree = _tree(proc) if proc.poll() is None else {}
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or procfs.alive(tree)):
        if proc.poll() is None:
            tree |= _tree(proc)  # a process started since (the trainer's checkpoint writer)
        time.sleep(0.2)
    if proc.poll() is None:
        tree |= _tree(proc)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    procfs.signal_each(tree, signal.SIGKILL)
    proc.wait()
    procfs.wait_gone(tree, 30.0)
    return proc.returncode


def _status_table(rd: RunDir, num_rollout: int, t0: float, ended: str | None = None) -> Table:
    """The live table; `ended`: how the attempt ended, shown instead of what its processes last did."""
    pts = reward_curve(rd.path)
    t = Table(show_header=False, box=None)
    t.add_row("run", str(rd.path))
    t.add_row("elapsed", f"{time.time() - t0:5.0f} s")
    t.add_row("trained", f"{len(pts)}/{num_rollout} rollouts")
    if pts:
        t.add_row("reward", f"{pts[-1][1]:.3f}  {sparkline([p[1] for p in pts], 0.0, 1.0)}")
    wv = Control(rd).weight_version()
    t.add_row("weights", weights_line(wv.model_dump() if wv else None))
    if ended is not None:
        t.add_row("ended", Text(ended, style="green" if ended == FINISHED else "yellow"))
        return t
    for p in _main_phases(rd):
        t.add_row(f"{p['role']} {p['rank']}", Text(phase_line(p, live=True)))
    return t


def _main_phases(rd: RunDir) -> list[dict]:
    """The trainer's rank 0 and the first rollout node, from their heartbeats."""
    return [p for p in role_phases(Control(rd)) if p["phase"] and p["rank"] == 0]


class Notices:
    """What `rlslurm run` prints as lines of their own, with or without the live table: each step this
    attempt trains (the trainer's line, rlslurm/step_line.py), a version the disk fallback delivered
    (yellow: the transport failed), and every STALL_S without a trained rollout, what each role is doing
    (a run stuck in a failing sync is never silent)."""

    STALL_S = 120.0

    def __init__(self, rd: RunDir, console: Console, t0: float):
        self.rd, self.console = rd, console
        self.fallbacks = 0
        self.trained, self.progress_at, self.said_at = len(reward_curve(rd.path)), t0, t0
        self.steps = MetricsTail(rd.metrics, from_end=True)  # a resumed run's earlier steps were printed then

    def print_steps(self) -> None:
        for rec in self.steps.new():
            self.console.print(step_line(rec), markup=False, highlight=False)

    def check(self) -> None:
        self.print_steps()
        wv = Control(self.rd).weight_version()
        if wv is not None and wv.fallbacks > self.fallbacks:
            self.fallbacks = wv.fallbacks
            self.console.print(f"[yellow]weight sync fell back to disk[/] ({wv.fallbacks} version(s) this attempt): "
                               f"{escape(wv.last_fallback or '')[:300]}")
        now = time.time()
        trained = len(reward_curve(self.rd.path))
        if trained != self.trained:
            self.trained, self.progress_at = trained, now
        elif now - self.progress_at > self.STALL_S and now - self.said_at > self.STALL_S:
            self.said_at = now
            doing = "; ".join(f"{p['role']} {p['rank']}: {phase_line(p, live=True)}" for p in _main_phases(self.rd))
            self.console.print(f"no rollout trained for {now - self.progress_at:.0f} s: "
                               f"{escape(doing) or 'no heartbeat yet'}")


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(signal.Signals(signum).name)


def _wait_for_exit(procs: dict[str, subprocess.Popen], grace_s: float) -> None:
    """After a stop request: give the processes `grace_s` to checkpoint and exit on their own. Signalling
    them at once would also reach the helper processes megatron's checkpoint writer starts during the
    save (a TERM to the process group), and the save would fail. A second Ctrl-C / TERM cuts it short."""
    deadline = time.time() + grace_s
    try:
        while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            time.sleep(0.5)
    except (KeyboardInterrupt, _Terminated):
        pass


def _outcome(rd: RunDir, control: Control, logs: Path, reason: str, first: str | None, codes: dict[str, int | None],
             interrupted_rc: int) -> tuple[int, str]:
    """The attempt's exit status and the one line the ledger keeps, from how the watch ended (`reason`:
    a --timeout, the watchdog or an interrupt said why; `first`: the role that ended first) and what the
    run directory and the roles' logs say."""
    rc = 1
    if rd.is_finished():
        rc, reason = 0, "finished"
    elif control.stop_requested() and not reason:
        rc, reason = 0, "stopped by request"
    elif interrupted_rc:
        ack = control.stop_ack()
        rc = interrupted_rc
        reason += (f"; the trainer checkpointed (iteration {ack.checkpoint_iteration}): run the same command again "
                   f"to continue" if ack else "; no checkpoint was acknowledged")
    elif (user_error := read_user_error(logs)) is not None:
        rc, reason = USER_ERROR_EXIT_CODE, user_error["reason"]  # as the batch script: final
    elif not reason and (failure := read_failure(logs)) is not None:  # the run dir's filesystem, say
        reason = (f"failed: {failure['reason']} ({first} ended first, trainer rc={codes['trainer']}, "
                  f"rollout rc={codes['rollout']})")
    elif not reason and first == "rollout" and codes["rollout"] not in _SIGNALLED:
        # the rollout failed on its own (an engine that never came up); stopping the trainer afterwards
        # left a preempt checkpoint, which is not the cause (the reason would read "preempted")
        cause = last_error_line(logs / "rollout-0.log")
        reason = f"failed: the rollout ended first (rc={codes['rollout']})" + (f": {cause}" if cause else "")
    elif not reason and (ack := control.preempt_ack()) is not None:
        # its process tree was signalled (kill, an OOM killer's TERM, a scheduler outside rlslurm)
        reason = (f"preempted: the trainer checkpointed (iteration {ack.checkpoint_iteration}) on a signal and "
                  f"exited; run the same command again to continue")
    elif not reason:
        reason = f"failed: {first} ended first (trainer rc={codes['trainer']}, rollout rc={codes['rollout']})"
    return rc, reason


def _print_rewards(rd: RunDir, console: Console) -> None:
    """The mean reward per rollout as a sparkline, and reward_curve.png in the run directory."""
    pts = reward_curve(rd.path)
    if pts:
        console.print(f"reward per rollout: {sparkline([p[1] for p in pts], 0.0, 1.0)}  "
                      f"first {pts[0][1]:.3f} -> last {pts[-1][1]:.3f}")
        png = plot_png(pts, rd.path / "reward_curve.png", f"{rd.path.name}: mean reward per rollout")
        if png:
            console.print(f"reward curve: {png}")


def end_live(live: Live) -> None:
    """Stop the live table, ending its last line: Rich breaks the line only on a terminal, and into a
    file the summary that follows ran on from the table's last row."""
    live.stop()
    if not live.console.is_terminal:
        live.console.line()


def _watch(rd: RunDir, control: Control, procs: dict[str, subprocess.Popen], live: Live | None, notices: Notices,
           console: Console, num_rollout: int, start: float, timeout_s: float | None, hang_timeout_s: float,
           stop_grace_s: float) -> tuple[str, str | None, int, dict[str, int | None]]:
    """Watch both roles until one ends, the run finishes, --timeout, the watchdog or an interrupt; then
    stop them. Returns (why the watch ended, if it says, the role that ended first, the interrupt's exit
    status or 0, each role's exit status)."""
    reason, first, interrupted_rc, hung = "", None, 0, []
    try:
        next_hang_check = start + CHECK_EVERY_S
        while all(p.poll() is None for p in procs.values()):
            notices.check()
            if timeout_s is not None and time.time() - start > timeout_s:
                control.request_stop(f"rlslurm run: --timeout {timeout_s:.0f}s reached")
                reason = f"timeout after {timeout_s:.0f}s"
                break
            if hang_timeout_s and time.time() >= next_hang_check:
                next_hang_check = time.time() + CHECK_EVERY_S
                hung = silent_roles(rd.control_dir / "heartbeats", hang_timeout_s, start)
                if hung:
                    reason = (f"failed: hung: {', '.join(hung)} silent for more than {hang_timeout_s:.0f}s, "
                              f"stopped by the watchdog")
                    break
            if live:
                live.update(_status_table(rd, num_rollout, start))
            time.sleep(1.0)
        first = next((n for n, p in procs.items() if p.poll() is not None), None)
        deadline = time.time() + FINISH_GRACE_S
        while rd.is_finished() and any(p.poll() is None for p in procs.values()) and time.time() < deadline:
            time.sleep(0.5)
        if reason and not hung:  # the --timeout stop: let both finish their checkpoint / hand-back first
            _wait_for_exit(procs, stop_grace_s)
    except (KeyboardInterrupt, _Terminated) as e:
        control.request_stop("rlslurm run: interrupted")
        reason, first = f"interrupted ({'Ctrl-C' if isinstance(e, KeyboardInterrupt) else e})", None
        interrupted_rc = 130 if isinstance(e, KeyboardInterrupt) else 143  # the shell's 128 + signal
        console.print(f"{reason}: the trainer checkpoints and both stop (up to {stop_grace_s:.0f} s; "
                      "interrupt again to stop them at once)")
        _wait_for_exit(procs, stop_grace_s)
    finally:
        # a role left running gets the stop grace to checkpoint (the trainer saves on TERM), a hung one not
        grace = HUNG_STOP_GRACE_S if hung else stop_grace_s
        codes = {n: _stop(p, grace) for n, p in procs.items()}
    return reason, first, interrupted_rc, codes


def run_local(run_dir: Path, *, trainer_procs: int, num_rollout: int, progress: bool = True,
              timeout_s: float | None = None, console: Console | None = None,
              gpus: tuple[list[str], list[str]] | None = None, stop_grace_s: float = STOP_GRACE_S,
              hang_timeout_s: float = 0.0) -> LocalResult:
    """`gpus`: (trainer's, rollout's) CUDA_VISIBLE_DEVICES (rlslurm/gpus.py `role_gpus`: none on --device cpu); None: as
    inherited. `stop_grace_s`: how long a stop (Ctrl-C, TERM, --timeout) waits for the trainer's checkpoint before the
    processes are signalled. `hang_timeout_s`: the watchdog's bound (rlslurm/watchdog.py); 0: off."""
    # SIGTERM/SIGHUP (a closed terminal, `kill`) must stop the children too: they run in their own
    # sessions so that a Ctrl-C reaches only this process, which then stops them in order.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_terminated)
    rd = RunDir(run_dir)
    console = console or make_console(stderr=True)
    attempt = next_attempt(rd)
    this = Attempt(attempt, LOCAL, int(time.time()), LOCAL, LOCAL)
    logs = rd.attempt_log_dir(attempt)
    if (why := begin(rd, this)) is not None:  # FINISHED, or a stop requested since `rlslurm run` began
        end_attempt(rd, this, 0, why)
        console.print(f"{rd.path}: {why}; nothing to do")
        return LocalResult(0, why, attempt)
    control = Control(rd)
    env = _clean_env(attempt, rd)
    trainer_env, rollout_env = env, env
    if gpus is not None:
        trainer_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[0])}
        rollout_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[1])}
    port = rendezvous_port(LOCAL_ADDR)  # the batch script's range: no engine takes it first
    start = time.time()
    cmds = role_commands(rd, trainer_procs, port, stop_grace_s)
    # umask: the batch script's `umask 077`, so what the children create (logs, checkpoints) is private
    with open_log(logs / "trainer-0.log") as tlog, open_log(logs / "rollout-0.log") as rlog:
        # owned: both end (TERM, then KILL after the stop grace) if this process is killed outright
        trainer = subprocess.Popen(owned_role.argv(cmds["trainer"], grace_s=stop_grace_s), env=trainer_env,
                                   stdout=tlog, stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK)
        rollout = subprocess.Popen(owned_role.argv(cmds["rollout"], grace_s=stop_grace_s), env=rollout_env,
                                   stdout=rlog, stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK)
        procs = {"trainer": trainer, "rollout": rollout}
        live = Live(_status_table(rd, num_rollout, start), console=console, refresh_per_second=1,
                    transient=False) if progress else None
        notices = Notices(rd, console, start)
        try:
            if live:
                live.start()
            reason, first, interrupted_rc, codes = _watch(rd, control, procs, live, notices, console, num_rollout,
                                                          start, timeout_s, hang_timeout_s, stop_grace_s)
            notices.print_steps()  # those trained since the last look
            rc, reason = _outcome(rd, control, logs, reason, first, codes, interrupted_rc)
            end_attempt(rd, this, rc, reason)
            if live:
                live.update(_status_table(rd, num_rollout, start, ended=reason))
        finally:
            if live:
                end_live(live)
    _print_rewards(rd, console)
    if rc:
        console.print(f"[red]{reason}[/]; logs: {logs}")
    return LocalResult(rc, reason, attempt)
