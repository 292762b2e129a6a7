"""`rlslurm submit` on real GPUs (issue 30): a real SLURM cluster on the 4-GPU machine, booted from the
carried kit (tools/gpu/slurm-boot.sh: several slurmd on one host, each node's gres the real /dev/nvidiaN;
docs/slurm-test-cluster.md, "SLURM on the GPU machine"), three jobs through the product's main path:

* a het job, trainer 1 node x 2 GPUs (TP2), rollout 1 node x 2 GPUs (one TP2 engine): USR1 mid-run ->
  checkpoint -> requeue -> resume, each rollout trained once;
* a one-node job (`--nodes 1 --gpus-per-node 4 --trainer-gpus 2`): the two --overlap steps split the
  job's GPUs themselves (rlslurm/gpus.py step_gpus);
* a colocated job (`--nodes 1 --colocate`): trainer and engine on the same 2 GPUs, weights by CUDA IPC.

Each asserts the transport (metrics.jsonl's record of every publish; --weight-sync-fallback off) and the
GPUs each step used: SLURM's CUDA_VISIBLE_DEVICES and the GPU each process holds (env reports, and
nvidia-smi's own pid -> GPU list mid-run). Needs the kit (.gpu-bundle/slurm, or RLSLURM_GPU_SLURM_KIT)
and 4 GPUs; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from rlslurm.curve import reward_curve
from rlslurm.demo_task import make_prompts
from tests.gpu.bundle_flags import run_flags
from tests.gpu.run_checks import who_is_on_which_gpu
from tests.helpers.deliveries import assert_delivered_by, final_lineage
from tests.helpers.slurm_runs import env_reports, ledger, rlslurm
from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("RLSLURM_GPU_SLURM_KIT", REPO / ".gpu-bundle" / "slurm"))
NUM_ROLLOUT = 12


def _why_not() -> str | None:
    import torch

    if not (KIT / "manifest.tsv").exists():
        return f"no SLURM kit at {KIT} (tools/gpu/slurm-kit.sh)"
    if torch.cuda.device_count() < 4:
        return "needs 4 GPUs"
    if os.geteuid() != 0:
        return "boots SLURM daemons: needs root"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"SLURM on GPUs: {_why_not()}")


def boot(nodes: int) -> SlurmCluster:
    p = subprocess.run(["bash", str(REPO / "tools/gpu/slurm-boot.sh"), str(KIT)], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "RLSLURM_GPU_NODES": str(nodes)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    print(p.stdout[-1500:])
    return SlurmCluster()


@pytest.fixture(scope="module")
def cluster():
    """Booted per layout (a 2-node or a 1-node cluster), stopped at the end."""
    holder: dict = {}

    def get(nodes: int) -> SlurmCluster:
        if holder.get("nodes") != nodes:
            holder["cluster"], holder["nodes"] = boot(nodes), nodes
        return holder["cluster"]

    yield get
    if "cluster" in holder:
        holder["cluster"].stop()


def submit(run_dir: Path, prompts: Path, *extra: str) -> int:
    rlslurm("submit", "--model", "tiny-qwen3", "--device", "cuda", "--prompt-data", str(prompts), "--run-dir",
            str(run_dir), "--no-exclusive", "--cpus-per-node", "8", "--time", "30", "--signal-grace-s", "120",
            "--custom-rm-path", "rlslurm.demo_task:reward", "--num-rollout", str(NUM_ROLLOUT), "--num-epoch", "100",
            "--rollout-dtype", "bfloat16", "--rollout-temperature", "1.0", "--verify-weight-sync",
            "--save-interval", "4",
            "--weight-sync-fallback", "off", "--weight-sync-timeout-s", "60", "--engine-health-interval-s", "5",
            *run_flags(), *extra)
    return int(json.loads((run_dir / "jobs.json").read_text())["jobs"][-1]["job_id"])


def follow(cl: SlurmCluster, job: int, run_dir: Path, *, usr1_after: int | None = None) -> dict[str, set[str]]:
    """Until the job ends: nvidia-smi's view once 2 rollouts are trained, USR1 to the batch shell once
    `usr1_after` are. Returns that view."""
    seen: dict[str, set[str]] = {}
    sent = False
    deadline = time.monotonic() + 540
    while cl.state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        assert time.monotonic() < deadline, batch_tail(run_dir, job)
        n = len(reward_curve(run_dir))
        if n >= 2 and not seen:
            seen = who_is_on_which_gpu(run_dir)
        if usr1_after is not None and not sent and n >= usr1_after:
            cl.signal_batch(job, "USR1")
            sent = True
        time.sleep(1.0)
    assert cl.state(job) == "COMPLETED", batch_tail(run_dir, job)
    return seen


def batch_tail(run_dir: Path, job: int) -> str:
    parts = [f"== slurm-{job}.out\n" + (run_dir / f"logs/slurm-{job}.out").read_text(errors="replace")[-3000:]
             if (run_dir / f"logs/slurm-{job}.out").exists() else "no batch log"]
    for f in sorted(run_dir.glob("logs/attempt-*/*.log")):
        parts.append(f"== {f.relative_to(run_dir)}\n{f.read_text(errors='replace')[-1500:]}")
    return "\n".join(parts)


def step_gpus(run_dir: Path) -> dict[int, dict[str, tuple[str | None, set[str]]]]:
    """Per attempt and role: SLURM's CUDA_VISIBLE_DEVICES of the step and the GPUs its processes used
    (a trainer rank's from torch; the rollout node's own first GPUs, its engines' device 0..)."""
    out: dict[int, dict] = {}
    for a in sorted(int(p.name.split("-")[1]) for p in run_dir.glob("logs/attempt-*")):
        reps = env_reports(run_dir, a)
        trainer = {r["gpu_uuid"] for k, r in reps.items() if k.startswith("trainer")}
        rollout = [r for k, r in reps.items() if k.startswith("rollout")]
        out[a] = {"trainer": ({r["cuda_visible_devices"] for k, r in reps.items() if k.startswith("trainer")}, trainer),
                  "rollout": ({r["cuda_visible_devices"] for r in rollout},
                              {u for r in rollout for u in r["gpu_uuids"]})}
    return out


def check_common(run_dir: Path, seen: dict[str, set[str]], transport: str, *, shared: bool) -> None:
    assert final_lineage(run_dir) == list(range(NUM_ROLLOUT))
    assert_delivered_by(run_dir, transport, versions=set(range(1, NUM_ROLLOUT + 1)))
    assert seen["trainer"] and seen["engines"], seen
    if shared:
        assert seen["trainer"] == seen["engines"], seen
    else:
        assert not seen["trainer"] & seen["engines"], seen


def test_het_job_tp2_trainer_tp2_engine_usr1_requeue(cluster, tmp_path: Path) -> None:
    cl = cluster(2)
    run_dir, prompts = tmp_path / "run", make_prompts(tmp_path / "prompts.jsonl", n=64)
    job = submit(run_dir, prompts, "--nodes", "2", "--gpus-per-node", "2", "--trainer-procs-per-node", "2",
                 "--tensor-model-parallel-size", "2", "--rollout-num-gpus-per-engine", "2")
    seen = follow(cl, job, run_dir, usr1_after=5)
    lines = ledger(run_dir)
    assert [(l["attempt"], l["reason"]) for l in lines] == [(0, "preempted (USR1)"), (1, "finished")], lines
    ids = {a: sorted({m["rollout_id"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                      if m["attempt"] == a}) for a in (0, 1)}
    assert ids[0] + ids[1] == list(range(NUM_ROLLOUT)), ids  # the USR1 checkpoint held everything attempt 0 trained
    check_common(run_dir, seen, "nccl", shared=False)
    gpus = step_gpus(run_dir)
    for a, g in gpus.items():  # each attempt: the trainer's node's 2 GPUs, the rollout node's 2 others
        assert len(g["trainer"][1]) == 2 and len(g["rollout"][1]) >= 2 and not g["trainer"][1] & g["rollout"][1], (a, g)
    print(f"het job {job}: attempts {ids}; GPUs per attempt {gpus}; nvidia-smi mid-run {seen}")


def test_one_node_job_splits_its_gpus(cluster, tmp_path: Path) -> None:
    cl = cluster(1)
    run_dir, prompts = tmp_path / "run", make_prompts(tmp_path / "prompts.jsonl", n=64)
    job = submit(run_dir, prompts, "--nodes", "1", "--gpus-per-node", "4", "--trainer-gpus", "2",
                 "--tensor-model-parallel-size", "1")
    seen = follow(cl, job, run_dir)
    check_common(run_dir, seen, "nccl", shared=False)
    g = step_gpus(run_dir)[0]
    # both --overlap steps see the job's 4 GPUs; each takes its own first (rlslurm/gpus.py step_gpus)
    assert g["trainer"][0] == {"0,1,2,3"} and g["rollout"][0] == {"2,3,0,1"}, g
    assert len(g["trainer"][1]) == 2 and not g["trainer"][1] & seen["engines"], (g, seen)
    print(f"one-node job {job}: steps {g}; nvidia-smi mid-run {seen}")


def test_colocated_job_shares_its_gpus_and_copies_in_place(cluster, tmp_path: Path) -> None:
    cl = cluster(1)
    run_dir, prompts = tmp_path / "run", make_prompts(tmp_path / "prompts.jsonl", n=64)
    job = submit(run_dir, prompts, "--nodes", "1", "--colocate", "--gpus-per-node", "2",
                 "--rollout-num-gpus-per-engine", "2")
    seen = follow(cl, job, run_dir)
    check_common(run_dir, seen, "cuda-ipc", shared=True)
    g = step_gpus(run_dir)[0]
    assert g["trainer"][1] <= seen["engines"] and len(g["trainer"][1]) == 2, (g, seen)
    print(f"colocated job {job}: steps {g}; nvidia-smi mid-run {seen}")
