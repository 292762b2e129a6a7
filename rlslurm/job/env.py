"""What a process inside the het job knows about its place in it.

SLURM 22.05 het jobs add `SLURM_JOB_NODELIST_HET_GROUP_<n>` and `SLURM_HET_SIZE` (there is no
`SLURM_HET_JOB_ID`: `SLURM_JOB_ID` is the leader id in every group).
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass

ATTEMPT_ENV = "RLSLURM_ATTEMPT"


@dataclass(frozen=True)
class JobEnv:
    job_id: str | None
    restart_count: int  # SLURM_RESTART_COUNT: this job's runs so far
    attempt: int  # the run's attempt number: names logs/attempt-N, the rendezvous record, metrics lines
    het_size: int
    nodelist_het: dict[int, str]
    step_nodelist: str | None
    node: str
    procid: int
    cuda_visible_devices: str | None
    hostname: str

    def as_dict(self) -> dict:
        return asdict(self)


def job_env(env: dict[str, str] | None = None) -> JobEnv:
    env = dict(os.environ) if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    procid = int(env.get("SLURM_PROCID", "0"))
    het = {}
    for key, value in env.items():
        if key.startswith("SLURM_JOB_NODELIST_HET_GROUP_"):
            het[int(key.rsplit("_", 1)[1])] = value
    return JobEnv(
        job_id=job_id,
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
        # Set by the batch script (continuing across `rlslurm resubmit`) and by `rlslurm run`.
        attempt=int(env.get(ATTEMPT_ENV) or env.get("SLURM_RESTART_COUNT") or 0),
        het_size=int(env.get("SLURM_HET_SIZE", "1")),
        nodelist_het=het,
        step_nodelist=env.get("SLURM_STEP_NODELIST"),
        node=node,
        procid=procid,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        hostname=socket.gethostname(),
    )
