"""Metadata operations per second on the run directory, in steady state, on the SLURM test cluster
(issue 31, item 8); extrapolated to a 1,024-GPU job. Results: docs/shared-fs-load.md.

Submits the tiny GRPO run of tests/e2e/test_grpo_slurm.py (bench/slurm_run.py; this checkout's code
on PYTHONPATH) as a het job of --nodes N: N/2 trainer nodes of 2 gloo ranks, N/2 rollout nodes of one
SGLang CPU engine each, no checkpoint in the window (--save-interval past it). Once --warm rollouts are
trained it attaches one strace to every process of the job (fs_ops.TRACE; each strace follows what
its process forks later), counts for --window-s seconds, detaches, and stops the run.

Every process is put in a class that scales one way with the job: trainer rank 0 (one per job),
trainer ranks > 0 that are local rank 0 (one per trainer node), the other trainer ranks (one per rank),
torchrun (per trainer node), rollout node 0 (per job), other rollout nodes, their engines and router
(per rollout node), the batch script (per job). Two sources inside a class grow with the job on
their own: the batch script's watchdog stats each heartbeat file, and rollout node 0 reads each
node's engines record; they are scaled by the heartbeat files and the rollout nodes. Sources that
follow the rollouts (the buffer, metrics, weights, probes) are counted per trained rollout and
scaled by --rollout-period-s; the rest per second.

figure = extrapolated steady-state metadata ops/s of the whole run directory at --scale-nodes x
--scale-gpus (half trainer, half rollout nodes, one engine per GPU); reference = 50 ops/s (the issue's
bound: what a Lustre/GPFS admin tolerates); ratio = figure / reference (<= 1 meets it).

    flock /tmp/rlslurm-slurm.lock python3 bench/bench_fs_ops.py --nodes 2 [--no-boot]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fs_ops import TRACE, Counts, count, total  # noqa: E402
from bench.slurm_run import batch_log_tail, rlslurm, submit_tiny_grpo  # noqa: E402
from rlslurm.demo_task import make_prompts  # noqa: E402
from tests.slurm_cluster.cluster import SlurmCluster, SlurmError  # noqa: E402

REFERENCE = 50.0
PER_ROLLOUT = {"buffer", "metrics", "tb", "weights", "checkpoints", "control/weight_probe.jsonl",
               "control/deliveries.jsonl", "control/weight_version.json"}


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _ppid(pid: int) -> int:
    stat = _read(Path(f"/proc/{pid}/stat"))
    return int(stat.rsplit(")", 1)[1].split()[1]) if stat else 0


def job_processes(job: int | None, root: int | None = None) -> dict[int, dict]:
    """Every process of the job (its environment names the job), or every descendant of `root` and
    itself (`rlslurm run`), with its cmdline and parent."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        env = _environ(int(d.name))
        if job is not None and env.get("SLURM_JOB_ID") != str(job):
            continue
        cmd = _read(d / "cmdline").replace("\0", " ").strip()
        if not cmd or "strace" in cmd:
            continue
        out[int(d.name)] = {"cmd": cmd, "env": env, "ppid": _ppid(int(d.name))}
    if root is not None:
        def under(pid: int) -> bool:
            while pid > 1 and pid in out:
                if pid == root:
                    return True
                pid = out[pid]["ppid"]
            return False
        out = {pid: p for pid, p in out.items() if under(pid)}
    return out


def role_of(pid: int, procs: dict[int, dict]) -> tuple[str, str]:
    """(class, instance) of a process: its own role, else its nearest ancestor's."""
    p = procs[pid]
    cmd, env = p["cmd"], p["env"]
    if "rlslurm.trainer.main" in cmd:
        rank, local = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
        cls = "trainer rank 0" if rank == 0 else ("trainer local rank 0" if local == 0 else "trainer local rank>0")
        return cls, f"trainer-{rank}"
    if "torch.distributed.run" in cmd or "torchrun" in cmd:
        return "torchrun", f"torchrun-{env.get('SLURM_PROCID', '?')}"
    if "rlslurm.rollout.main" in cmd:
        node = int(env.get("SLURM_PROCID", 0))
        return ("rollout node 0" if node == 0 else "rollout node>0"), f"rollout-{node}"
    if "slurm_script" in cmd or "rlslurm.cli run" in cmd or "rlslurm run" in cmd:
        return "batch script", "batch"  # `rlslurm run` plays its part
    parent = p["ppid"]
    if parent in procs:
        cls, inst = role_of(parent, procs)
        if cls.startswith("rollout node"):
            return "engines+router", f"engines-{inst.split('-')[1]}"
        return cls, inst
    return "other", f"other-{pid}"


def attach(procs: dict[int, dict], out: Path) -> list[tuple[subprocess.Popen, int, Path]]:
    tracers = []
    for pid in sorted(procs):
        log = out / f"strace.{pid}"
        t = subprocess.Popen(["strace", "-f", "-qq", "-y", "-e", f"trace={TRACE}", "-o", str(log), "-p", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        tracers.append((t, pid, log))
    return tracers


def detach(tracers) -> None:
    for t, _, _ in tracers:
        if t.poll() is None:
            t.send_signal(signal.SIGINT)  # strace detaches and leaves the process running
    for t, _, _ in tracers:
        try:
            t.wait(timeout=30)
        except subprocess.TimeoutExpired:
            t.kill()


def trained(run_dir: Path) -> list[int]:
    ids = []
    for line in _read(run_dir / "metrics.jsonl").splitlines():
        try:
            rid = json.loads(line).get("rollout_id")
        except json.JSONDecodeError:
            continue
        if rid is not None and (not ids or ids[-1] != rid):
            ids.append(rid)
    return ids


def wait_trained(alive, run_dir: Path, n: int, timeout: float, tail) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(trained(run_dir)) >= n:
            return
        if not alive():
            raise RuntimeError(f"the run ended before {n} rollouts were trained\n{tail()}")
        time.sleep(2)
    raise RuntimeError(f"{n} rollouts not trained within {timeout:.0f}s\n{tail()}")


def start_local(run_dir: Path, prompts: Path, log: Path) -> subprocess.Popen:
    """`rlslurm run` of the same tiny GRPO run on this machine: one trainer node of 2 ranks, one
    rollout node of one engine; `rlslurm run` plays the batch script's part."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "rlslurm.cli", "run", "--model", "tiny-qwen3", "--prompt-data", str(prompts),
           "--run-dir", str(run_dir), "--no-progress", "--custom-rm-path", "rlslurm.demo_task:reward",
           "--num-rollout", "400", "--num-epoch", "100", "--rollout-dtype", "float32", "--weight-sync", "distributed",
           "--verify-weight-sync", "--no-use-distributed-optimizer", "--save-interval", "400",
           "--engine-health-interval-s", "2", "--trainer-procs-per-node", "2", "--engines-per-node", "1"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def measure(run_dir: Path, job: int | None, window_s: float, work: Path, root: int | None = None) -> dict:
    procs = job_processes(job, root)
    roles = {pid: role_of(pid, procs) for pid in procs}
    cwds = {}
    for pid in procs:
        try:
            cwds[pid] = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            cwds[pid] = None
    before = trained(run_dir)
    # the window runs from the first attach to the last detach: the processes run already, so the
    # start-up is behind it (each strace attaches within milliseconds)
    t0 = time.time()
    n0 = len(before)
    tracers = attach(procs, work)
    time.sleep(window_s)
    n1 = len(trained(run_dir))
    t1 = time.time()
    detach(tracers)
    per_class: dict[str, dict] = defaultdict(lambda: {"instances": set(), "counts": Counts()})
    for _, pid, log in tracers:
        if not log.exists():
            continue
        cls, inst = roles[pid]
        c = count(log, run_dir, cwds.get(pid))
        agg = per_class[cls]
        agg["instances"].add(inst)
        agg["counts"].by_class.update(c.by_class)
        agg["counts"].by_source.update(c.by_source)
        agg["counts"].paths.update(c.paths)
    hb_files = [n for n in os.listdir(run_dir / "control" / "heartbeats") if n.endswith(".json")]
    return {"window_s": round(t1 - t0, 2), "rollouts_in_window": n1 - n0, "trained_before": len(before),
            "heartbeat_files": sorted(hb_files),
            "processes": {str(p): [*roles[p], procs[p]["cmd"][:120]] for p in procs},
            "per_class": per_class}


def instances_at(cls: str, *, trainer_nodes: int, gpus: int, rollout_nodes: int) -> int:
    return {"trainer rank 0": 1, "trainer local rank 0": trainer_nodes - 1,
            "trainer local rank>0": trainer_nodes * (gpus - 1), "torchrun": trainer_nodes,
            "rollout node 0": 1, "rollout node>0": rollout_nodes - 1, "engines+router": rollout_nodes,
            "batch script": 1}.get(cls, 0)


def summarize(m: dict, *, nodes: int, scale_nodes: int, scale_gpus: int, rollout_period_s: float,
              meas_rollout_nodes: int) -> dict:
    """Per class: measured ops/s per instance (per-second sources) and ops per rollout (per-rollout
    sources); extrapolated to scale_nodes x scale_gpus."""
    tn, rn = scale_nodes // 2, scale_nodes - scale_nodes // 2
    hb_meas = len(m["heartbeat_files"])
    w, r = m["window_s"], max(m["rollouts_in_window"], 1)
    rows, total_scale = [], 0.0
    for cls, agg in sorted(m["per_class"].items()):
        k = len(agg["instances"])
        n_scale = instances_at(cls, trainer_nodes=tn, gpus=scale_gpus, rollout_nodes=rn)
        by_src: Counter = Counter()
        for (src, op), n in agg["counts"].by_source.items():
            if op != "fstat(fd)":
                by_src[src] += n
        for src, n in sorted(by_src.items()):
            per_rollout = src in PER_ROLLOUT
            rate = n / k / (r if per_rollout else w)  # per instance: ops per rollout, or per second
            grows = ""
            factor = n_scale
            if cls == "batch script" and src.startswith("control/heartbeats/") and src.endswith("<r>"):
                # the watchdog stats every heartbeat file: today's files at scale
                hb_scale = tn * scale_gpus + rn if hb_meas > meas_rollout_nodes + nodes // 2 else tn + rn
                factor, grows = hb_scale / max(hb_meas, 1), "heartbeat files"
            if cls == "rollout node 0" and "node<k>" in src:
                factor, grows = rn / meas_rollout_nodes, "rollout nodes"
            at_scale = rate * factor / (rollout_period_s if per_rollout else 1.0)
            total_scale += at_scale
            rows.append({"class": cls, "source": src, "measured_ops": n, "instances_measured": k,
                         "per_instance": round(rate, 3), "unit": "ops/rollout" if per_rollout else "ops/s",
                         "scales_with": grows or cls, "instances_at_scale": n_scale,
                         "ops_s_at_scale": round(at_scale, 2)})
    return {"rows": rows, "total_ops_s_at_scale": round(total_scale, 1), "measured_total_ops_s": round(
        sum(total(a["counts"]) for a in m["per_class"].values()) / w, 2)}


def resummarize(path: Path, *, scale_nodes: int, scale_gpus: int, rollout_period_s: float) -> None:
    """Recompute a result file's extrapolation from the counts it keeps (after a change of the model)."""
    d = json.loads(path.read_text())
    per_class = {}
    for cls, v in d["per_class"].items():
        c = Counts()
        c.by_class.update(v["by_class"])
        for key, n in v["by_source"].items():
            src, op = key.rsplit(" ", 1)
            c.by_source[(src, op)] += n
        per_class[cls] = {"instances": set(v["instances"]), "counts": c}
    m = {"window_s": d["window_s"], "rollouts_in_window": d["rollouts_in_window"],
         "heartbeat_files": d["heartbeat_files"], "per_class": per_class}
    s = summarize(m, nodes=d["nodes"], scale_nodes=scale_nodes, scale_gpus=scale_gpus,
                  rollout_period_s=rollout_period_s, meas_rollout_nodes=d["rollout_nodes"])
    d.update(rows=s["rows"], figure=s["total_ops_s_at_scale"], ratio=round(s["total_ops_s_at_scale"] / REFERENCE, 2))
    path.write_text(json.dumps(d, indent=1) + "\n")
    print(json.dumps({k: d[k] for k in ("bench", "nodes", "label", "figure", "reference", "ratio",
                                        "measured_total_ops_s")}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="job nodes: half trainer, half rollout (2 or 4)")
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--warm", type=int, default=3, help="rollouts trained before the window opens")
    p.add_argument("--scale-nodes", type=int, default=128)
    p.add_argument("--scale-gpus", type=int, default=8)
    p.add_argument("--rollout-period-s", type=float, default=60.0,
                   help="seconds per rollout at scale, for the per-rollout sources")
    p.add_argument("--label", default="", help="appended to the result file names (e.g. 'before')")
    p.add_argument("--local", action="store_true", help="`rlslurm run` on this machine instead of a SLURM job "
                   "(1 trainer node of 2 ranks + 1 rollout node)")
    p.add_argument("--no-boot", action="store_true",
                   help="use the running SLURM test cluster; neither boot nor stop it")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--resummarize", type=Path, nargs="*", help="recompute these result files' extrapolation")
    a = p.parse_args(argv)
    if a.resummarize:
        for f in a.resummarize:
            resummarize(f, scale_nodes=a.scale_nodes, scale_gpus=a.scale_gpus, rollout_period_s=a.rollout_period_s)
        return 0
    tn, rn = a.nodes // 2, a.nodes - a.nodes // 2
    if a.local:
        a.nodes, tn, rn = 2, 1, 1
    cluster = SlurmCluster(owner_pid=os.getpid(), env={"RLSLURM_CI_NODES": "4", "RLSLURM_CI_GPUS": "8"})
    work = Path(tempfile.mkdtemp(prefix="rlslurm-bench-fsops-"))
    run_dir = work / "run"
    t_start = time.monotonic()
    local = None
    try:
        prompts = make_prompts(work / "prompts.jsonl", n=64)
        if a.local:
            local = start_local(run_dir, prompts, work / "run.log")
            job = None
            print(f"[bench] rlslurm run pid {local.pid}, run dir {run_dir}", flush=True)
            wait_trained(lambda: local.poll() is None, run_dir, a.warm, 15 * 60,
                         lambda: _read(work / "run.log")[-4000:])
        else:
            if not a.no_boot:
                cluster.boot()
            job = submit_tiny_grpo(run_dir, prompts, 400, "--nodes", str(a.nodes), "--trainer-nodes", str(tn),
                                   "--rollout-nodes", str(rn), "--engines-per-node", "1", "--save-interval", "400")
            print(f"[bench] job {job}, run dir {run_dir}", flush=True)
            wait_trained(lambda: cluster.in_queue(job), run_dir, a.warm, 15 * 60, lambda: batch_log_tail(run_dir, job))
        m = measure(run_dir, job, a.window_s, work, root=local.pid if local else None)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        s = summarize(m, nodes=a.nodes, scale_nodes=a.scale_nodes, scale_gpus=a.scale_gpus,
                      rollout_period_s=a.rollout_period_s, meas_rollout_nodes=rn)
        try:
            rlslurm("stop", str(run_dir), "--reason", "bench_fs_ops done")
            local.wait(timeout=240) if local else cluster.wait_finished(job, 240)
        except (RuntimeError, SlurmError, subprocess.TimeoutExpired):
            local.kill() if local else cluster.cancel(job)
        per_class = {cls: {"instances": sorted(v["instances"]), "by_class": dict(v["counts"].by_class),
                           "by_source": {f"{k[0]} {k[1]}": n for k, n in sorted(v["counts"].by_source.items())},
                           "top_paths": dict(v["counts"].paths.most_common(25))}
                     for cls, v in sorted(m["per_class"].items())}
        line = {"bench": "fs_metadata_ops", "where": "rlslurm run (local)" if a.local else "SLURM test cluster",
                "nodes": a.nodes, "trainer_nodes": tn, "rollout_nodes": rn,
                "ranks_per_trainer_node": 2, "commit": head, "label": a.label,
                "figure": s["total_ops_s_at_scale"], "figure_is": f"steady-state metadata ops/s of the run dir, "
                f"extrapolated to {a.scale_nodes} nodes x {a.scale_gpus} GPUs, {a.rollout_period_s:g} s per rollout",
                "reference": REFERENCE, "reference_is": "the issue's bound (a target, not a measurement)",
                "ratio": round(s["total_ops_s_at_scale"] / REFERENCE, 2),
                "measured_total_ops_s": s["measured_total_ops_s"], "window_s": m["window_s"],
                "rollouts_in_window": m["rollouts_in_window"], "heartbeat_files": m["heartbeat_files"],
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(time.monotonic() - t_start, 1)}
        print(json.dumps(line), flush=True)
        a.results.mkdir(parents=True, exist_ok=True)
        suffix = f"-{a.label}" if a.label else ""
        (a.results / f"fs-ops-{'local' if a.local else f'{a.nodes}nodes'}{suffix}.json").write_text(json.dumps(
            {**line, "rows": s["rows"], "per_class": per_class, "processes": m["processes"]}, indent=1) + "\n")
        with open(a.results / "fs-ops.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
    finally:
        if local is not None and local.poll() is None:
            os.killpg(local.pid, signal.SIGKILL)
        if not a.no_boot and cluster.booted:
            print(cluster.stop().strip(), flush=True)
        print(f"[bench] strace logs and run dir kept in {work}" if os.environ.get("KEEP") else "", flush=True)
        if not os.environ.get("KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
