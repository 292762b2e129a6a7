"""Create the run directory and submit the het job with `sbatch --parsable`."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rlslurm.buffer.atomic import read_hint, write_bytes_atomic, write_json_atomic
from rlslurm.buffer.rundir import RunDir
from rlslurm.errors import ConfigError, UserError
from rlslurm.resolve import Resolved
from rlslurm.secret_env import render_env_file, secret_env_file, secret_values
from rlslurm.settings.layout import makes_init_checkpoint
from rlslurm.settings.runfile import dump_run_config
from rlslurm.slurm.render import render

log = logging.getLogger(__name__)

SBATCH_TIMEOUT_S = 60


@dataclass
class Submission:
    job_id: str
    run_dir: Path
    script: str


def prepare_run_dir(res: Resolved, *, resume: bool = False) -> RunDir:
    """Create RUN (0700), write run.yaml (immutable once written), the api key, the secret
    environment (control/secret_env, 0600; never in run.yaml) and, for tiny models without a
    checkpoint, a random-init HF checkpoint in RUN/hf_init."""
    cfg = res.cfg
    run_dir = cfg.run_dir.resolve()
    rd = RunDir(run_dir)
    if rd.run_yaml.exists() and not resume:
        raise ConfigError(
            f"--run-dir {run_dir} already holds a run (run.yaml exists); resubmit it with "
            f"`rlslurm resubmit {run_dir}` or pick another --run-name/--run-dir"
        )
    secrets = None
    if not resume:  # checked before anything is created: a missing value is the user's to fix first
        secrets = secret_values(cfg.slurm.secret_env, cfg.slurm.secret_given(), os.environ)
    elif cfg.slurm.secret_env and not secret_env_file(run_dir).exists():
        raise ConfigError(f"{secret_env_file(run_dir)} is missing: run.yaml names secret variables "
                          f"({', '.join(cfg.slurm.secret_env)}) whose values were kept there")
    init = not resume and makes_init_checkpoint(cfg, res.model)
    if init and not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        # a login node with only `pip install .` (docs/supported-stacks.md): refused before anything is created
        raise ConfigError(f"--model {res.model.name} without --hf-checkpoint: submit writes a random-init checkpoint "
                          "(RUN/hf_init) with torch and transformers, which are not installed here; pass "
                          "--hf-checkpoint DIR, or submit where they are")
    rd = RunDir.create(run_dir, group_shared=cfg.run.group_shared)
    if secrets:
        write_bytes_atomic(secret_env_file(run_dir), render_env_file(secrets).encode(), mode=0o600)
    if not resume:
        if init:
            from rlslurm.tiny import make_tiny_checkpoint

            cfg.model.hf_checkpoint = make_tiny_checkpoint(res.model, run_dir / "hf_init", seed=cfg.run.seed)
        cfg.run.run_dir = run_dir
        write_bytes_atomic(rd.run_yaml, dump_run_config(cfg).encode())
    rd.ensure_api_key()
    return rd


def sbatch(script_path: Path, cwd: Path, *extra: str) -> str:
    """Submit; returns the job id. The job's working directory is `cwd` (the run dir)."""
    cmd = ["sbatch", "--parsable", *extra, str(script_path)]
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)
    except FileNotFoundError:
        raise UserError("sbatch not found: run `rlslurm submit` on a SLURM login node (or use `rlslurm run`)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"sbatch did not answer within {SBATCH_TIMEOUT_S}s (is slurmctld up?)") from None
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().splitlines()
        raise UserError(f"sbatch refused {script_path}: {msg[-1] if msg else 'rc=' + str(out.returncode)}")
    return out.stdout.strip().split(";")[0]


def submit(res: Resolved, *, resume: bool = False, reset_failures: bool = False) -> Submission:
    """`resume` (`rlslurm resubmit`): the job's attempts continue the run's numbering, and a
    `resubmitted` ledger record (with `reset_failures`: a new failure budget) precedes it."""
    rd = prepare_run_dir(res, resume=resume)
    from rlslurm.buffer.attempts import next_attempt, record_resubmit
    from rlslurm.settings.runfile import load_run_config

    cfg = load_run_config(rd.path)  # submit exactly what the processes will read
    base = next_attempt(rd) if resume else 0
    script = render(cfg, rd.path, attempt_base=base)
    write_bytes_atomic(rd.job_sbatch, script.encode(), mode=0o700)
    if resume:
        record_resubmit(rd, base, reset_failures)
    job_id = sbatch(rd.job_sbatch, rd.path)
    jobs = _jobs(rd.path)
    jobs.append({"job_id": job_id, "submitted_at": time.time()})
    write_json_atomic(rd.path / "jobs.json", {"jobs": jobs})
    return Submission(job_id=job_id, run_dir=rd.path, script=script)


def _jobs(run_dir: Path, *, set_aside_damaged: bool = True) -> list[dict]:
    """RUN/jobs.json's list of submitted jobs (newest last). Damaged on disk it is set aside with a
    warning (buffer/atomic.py `read_hint`) and read as empty: it only names the current job, which a
    resubmit rewrites, never something worth ending the run over."""
    data = read_hint(Path(run_dir) / "jobs.json", set_aside_damaged=set_aside_damaged) or {}
    jobs = data.get("jobs")
    ok = isinstance(jobs, list) and all(isinstance(j, dict) and isinstance(j.get("job_id"), str) for j in jobs)
    if data and not ok:
        log.warning("%s: its job list is damaged; read as empty", Path(run_dir) / "jobs.json")
    return list(jobs) if ok else []


def current_job_id(run_dir: Path) -> str | None:
    jobs = _jobs(run_dir, set_aside_damaged=False)
    return jobs[-1]["job_id"] if jobs else None
