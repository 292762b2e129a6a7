"""Het-group 1 entry point, one process per rollout node:
`python -m rlslurm.rollout.main --run-dir RUN --trainer-addr ADDR`.

Start-up: read RUN/run.yaml and record this node's placement (node list, GPUs, trainer head).
Then run this node's SGLang servers (rollout/node.py); node 0 also runs the router and the
rollout driver (rollout/driver.py). With --debug-train-only no engine or router starts: node 0 runs
the driver alone, which builds the rollouts itself (SFT: rollout/sft.py). The process ends with 0 when the run is
FINISHED, a stop is requested, or a preempt request has been acknowledged by the trainer's checkpoint (the requeued
job starts it again); the engines and the router
are killed on every way out, SIGTERM from srun included.

Engines and the router bind this node's routable IP (`rlslurm.net.node_ip`);
RLSLURM_ROLLOUT_HOST overrides it (tests bind 127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlslurm import role_log
from rlslurm.buffer.control import Control, Requests
from rlslurm.buffer.rundir import RunDir
from rlslurm.gpus import visible_gpu_uuids
from rlslurm.heartbeat import Beat
from rlslurm.job.env import job_env
from rlslurm.job.report import write_env_report
from rlslurm.net import node_ip
from rlslurm.settings.layout import no_engines_reason
from rlslurm.settings.runfile import load_run_config
from rlslurm.stacks import check_run_role

log = logging.getLogger("rlslurm.rollout")

POLL_S = 1.0
# Rollout nodes > 0 look for the run's end (FINISHED, a stop or preempt and its ack) when node 0's
# router stops answering (node 0 closes it on every way out: rollout/node.py NODE0_SILENT_LOOK_S), and
# on their own only this often: a fallback for a node 0 that hangs with its router alive, which the batch
# script covers too (it TERMs the steps a minute after FINISHED or a stop; a TERM ends this process
# cleanly). Each look lists the run directory and control/ (6 metadata operations): every 30 s on 64
# rollout nodes was 13 operations a second, every second ~400 (docs/shared-fs-load.md). Node 0 looks
# every POLL_S: its driver must stop.
END_POLL_S = 600.0
# How long the run's end waits for the driver to stop by itself (abort + hand-back; the
# collector waits up to 60 s for aborted requests to come back).
DRIVER_STOP_S = 90.0
# How long node 0 waits for the other rollout nodes' engines before the first rollout.
ALL_NODES_WAIT_S = 600.0


@dataclass(frozen=True)
class Look:
    """One look for the run's end: FINISHED (a listing of the run directory) and the stop and preempt
    requests with their acks (one listing of control/, `Control.requests`)."""
    finished: bool
    requests: Requests
    at: float  # time.monotonic()

    @classmethod
    def take(cls, rd: RunDir, control: Control) -> "Look":
        finished = rd.is_finished()
        return cls(finished, Requests(None, None, None, None) if finished else control.requests(), time.monotonic())

    def end_reason(self) -> str | None:
        if self.finished:
            return "finished"
        # A stop, like a preempt, ends the engines only once the trainer is done with them (it saves,
        # acks and exits); if the trainer is gone instead, the batch script ends this step.
        # On USR1 the trainer finishes its step (and any weight sync into our engines), checkpoints and
        # acks; only then may the engines go, or the sync in flight would fail against dead peers.
        r = self.requests
        if r.stop is not None and r.stop_ack is not None:
            return "stop"
        if r.preempt is not None and r.preempt_ack is not None:
            return "preempt"
        return None

    def driver_should_stop(self) -> bool:
        """The driver stops at a preempt *request*, before the trainer's ack: the trainer needs no
        further rollout (it checkpoints at its next safe point), and a driver that stops early has
        its unfinished groups handed back and saved before the engines go."""
        return self.finished or self.requests.preempt is not None or self.requests.stop is not None


class SharedLook:
    """Node 0's looks, shared by its end loop (`until_end`, every POLL_S) and the driver's stop check
    (every driver.POLL_S, 0.5 s): a look younger than `max_age_s` answers both, so node 0 lists the run
    directory and control/ once a second, not three times (docs/shared-fs-load.md). The driver sees a
    stop up to max_age_s later than a look of its own would have."""

    def __init__(self, rd: RunDir, control: Control, *, max_age_s: float = POLL_S):
        self.rd, self.control, self.max_age_s = rd, control, max_age_s
        self._last: Look | None = None

    def __call__(self) -> Look:
        if self._last is None or time.monotonic() - self._last.at >= self.max_age_s:
            self._last = Look.take(self.rd, self.control)
        return self._last


def end_reason(rd: RunDir, control: Control) -> str | None:
    return Look.take(rd, control).end_reason()


def driver_should_stop(rd: RunDir, control: Control) -> bool:
    return Look.take(rd, control).driver_should_stop()


async def serve(node, rd: RunDir, control: Control, cfg, tokenizer) -> str:
    """Node 0 runs the driver; every node keeps heartbeats and control files current
    until the run ends."""
    driver_task = None
    look = SharedLook(rd, control)
    if node.node == 0:
        from rlslurm.rollout.driver import RolloutDriver

        await asyncio.to_thread(node.wait_for_all_nodes, timeout=ALL_NODES_WAIT_S,
                                cancel=lambda: look().driver_should_stop())

        driver = RolloutDriver(cfg, rd, router_url=node.router.url, engine_urls=node.engine_urls,
                               api_key=node.api_key, tokenizer=tokenizer, engine_restarts=node.restarts_total,
                               recovering=node.recovering)
        node.phase_of = lambda: driver.phase
        driver_task = asyncio.ensure_future(driver.run(lambda: look().driver_should_stop()))
    return await until_end(driver_task, node.housekeeping, look, end_poll_s=POLL_S if node.node == 0 else END_POLL_S)


async def until_end(driver_task: "asyncio.Future | None", tick, look: Callable[[], Look], *,
                    end_poll_s: float = POLL_S) -> str:
    """Call `tick` (heartbeats, engine housekeeping) every POLL_S until the run ends (looked for every
    `end_poll_s`, and at once when `tick` returns True: node 0's router went silent); a driver that
    ends first is logged (its error ends the process, non-zero exit), one still running when the run
    ends is given DRIVER_STOP_S to abort and save its hand-back (it saw the same stop)."""
    next_look = 0.0
    try:
        while True:
            urgent = tick()
            if driver_task is not None and driver_task.done():
                result = driver_task.result()  # a driver error ends the process (non-zero exit)
                log.info("rollout driver ended: %s at rollout %d", result.reason, result.next_rollout_id)
                driver_task = None
            reason = None
            if urgent or time.monotonic() >= next_look:
                next_look = time.monotonic() + end_poll_s
                reason = look().end_reason()
            if reason is not None:
                if driver_task is not None:
                    # it saw the same stop: let it abort and save its hand-back while the engines live
                    done, _ = await asyncio.wait({driver_task}, timeout=DRIVER_STOP_S)
                    if not done:
                        log.warning("rollout driver did not stop within %g s: cancelling it", DRIVER_STOP_S)
                    elif driver_task.exception() is not None:
                        log.error("rollout driver failed while the run ended (%s): %r", reason,
                                  driver_task.exception())
                    else:
                        log.info("rollout driver stopped: %s", driver_task.result().reason)
                return reason
            await asyncio.sleep(POLL_S)
    finally:
        if driver_task is not None and not driver_task.done():
            driver_task.cancel()
            await asyncio.gather(driver_task, return_exceptions=True)


def builds_rollouts(cfg, node: int) -> bool:
    """This node runs the engine-free driver of --debug-train-only (node 0; SFT: rollout/sft.py)."""
    return node == 0 and cfg.builds_without_engines


async def serve_without_engines(rd: RunDir, control: Control, cfg, tokenizer, role_rank: int) -> str:
    """--debug-train-only: the rollout driver with no router and no engines (its rollout function builds
    each rollout; the commit with the data cursor, the stop and the end of the data are the driver's
    as always), heartbeats, until the run ends."""
    from rlslurm.rollout.driver import RolloutDriver

    driver = RolloutDriver(cfg, rd, router_url=None, engine_urls=lambda: [], api_key=None, tokenizer=tokenizer)
    look = SharedLook(rd, control)
    task = asyncio.ensure_future(driver.run(lambda: look().driver_should_stop()))
    return await until_end(task, Beat(lambda: control.heartbeat("rollout", role_rank)), look)


def wait_for_end(rd: RunDir, control: Control, role_rank: int) -> str:
    beat = Beat(lambda: control.heartbeat("rollout", role_rank))
    while True:
        beat()
        reason = end_reason(rd, control)
        if reason is not None:
            return reason
        time.sleep(POLL_S)


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cfg.model.hf_checkpoint))


def _on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through RolloutNode.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlslurm.rollout.main")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--trainer-addr", required=True)
    a = p.parse_args(argv)
    role_log.configure("%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_run_config(a.run_dir)
    check_run_role("rollout", cfg)  # rlslurm/stacks.py
    rd = RunDir(a.run_dir)
    env = job_env()
    # the engines inherit it: their device numbers in NVML's (PCI) order, as engines.json names their
    # GPUs through nvidia-smi (rlslurm/gpus.py device_uuids; docs/gpu.md, "Which GPU")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    write_env_report(rd.path, "rollout", env.procid, {
        "gpu_uuids": visible_gpu_uuids() if cfg.run.device == "cuda" else [],
        "trainer_addr": a.trainer_addr,
        "run_name": cfg.run.run_name,
        "sglang_args": cfg.sglang_args,
        "prompt_data": str(cfg.data.prompt_data) if cfg.data.prompt_data else None,
        "user_env": {k: os.environ.get(k) for k in cfg.slurm.env},
        "secret_env_set": [k for k in cfg.slurm.secret_env if k in os.environ],  # names only: the file is 0640
    })
    control = Control(rd)
    if end_reason(rd, control) is not None:
        return 0
    skip = no_engines_reason(cfg)
    if skip is not None and builds_rollouts(cfg, env.procid):
        log.info("node %d: %s", env.procid, skip)
        reason = asyncio.run(serve_without_engines(rd, control, cfg, load_tokenizer(cfg), env.procid))
        log.info("node %d: run ends (%s)", env.procid, reason)
        return 0
    if skip is not None:
        log.warning("node %d: rollout engines not started: %s; waiting for the run to end", env.procid, skip)
        wait_for_end(rd, control, env.procid)
        return 0
    signal.signal(signal.SIGTERM, _on_term)

    from rlslurm.buffer.attempts import AttemptSuperseded
    from rlslurm.engines.supervisor import EngineFailure
    from rlslurm.rollout.node import RolloutNode

    host = os.environ.get("RLSLURM_ROLLOUT_HOST") or node_ip()
    node = RolloutNode(cfg, rd, node=env.procid, node_name=env.node, host=host, attempt=env.attempt)
    tokenizer_job = None
    if env.procid == 0:  # the driver's tokenizer loads while the engines start (seconds, every attempt)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        tokenizer_job = pool.submit(load_tokenizer, cfg)
        pool.shutdown(wait=False)
    try:
        t0 = time.monotonic()
        node.start(cancel=lambda: end_reason(rd, control) is not None)
        log.info("node %d: %s up in %.1f s", env.procid, node.describe(), time.monotonic() - t0)
        tokenizer = tokenizer_job.result() if tokenizer_job is not None else None
        try:
            reason = asyncio.run(serve(node, rd, control, cfg, tokenizer))
        except EngineFailure as e:  # a failure, not a user error: SLURM requeues within --max-failures
            log.error("node %d: %s", env.procid, e)
            return 1
        except AttemptSuperseded as e:
            log.error("node %d: %s; exiting", env.procid, e)
            return 1
        log.info("node %d: run ends (%s)", env.procid, reason)
        return 0
    finally:
        node.close()


if __name__ == "__main__":
    # A UserError ends the job without requeue (rlslurm/user_error.py).
    from rlslurm.exit_guard import skip_final_gc_at_exit
    from rlslurm.user_error import run_dir_arg, run_role

    skip_final_gc_at_exit()

    run_role("rollout", main, run_dir_arg)
