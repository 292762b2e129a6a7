"""`rlslurm convert ... --submit`: run a checkpoint conversion as a single-group SLURM job.

A conversion is one node of `tp x pp x ep` processes (`pp x lcm(tp, etp x ep)` with `--etp`), exactly what submitit is
made for: it writes the batch script, pickles the call, and gives back a job handle whose `result()` is the
torchrun exit code. (The RL run itself is a heterogeneous job, which submitit cannot express; it
comes from rlslurm/templates/.) The processes run the interpreter that submitted, on the node.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlslurm.errors import ConfigError
from rlslurm.settings.config import check_slurm_name
from rlslurm.settings.parallel_grid import converter_world


def _int_at_least(low: int):
    def convert(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
        if value < low:
            raise ValueError(f"must be >= {low}, got {value}")
        return value

    return convert


# submitit writes these into #SBATCH lines: partition and account pass the run config's own check
# (rlslurm/settings/config.py), so a newline or a space cannot end the line or add a directive.
_SUBMIT_FLAGS = {"--partition": check_slurm_name, "--account": check_slurm_name, "--time": _int_at_least(1),
                 "--gpus-per-node": _int_at_least(0), "--cpus-per-task": _int_at_least(1), "--job-dir": Path}


# `rlslurm convert --help` and its subcommands' show this (the flags are taken out before the
# converter's own parser sees the rest, so that parser cannot list them).
SUBMIT_HELP = ("As a SLURM job: add --submit [--wait] and optionally --partition NAME, --account NAME, --time MINUTES "
               "(default 60), --gpus-per-node N (default 0), --cpus-per-task N (default 2), --job-dir DIR (default "
               "convert-jobs): one node runs TP x PP x EP processes under torchrun. Without --submit the conversion "
               "runs in this process (torchrun it for TP/PP/EP > 1). Example: rlslurm convert hf-to-mcore --model "
               "qwen3-8B --hf /ckpt/Qwen3-8B --out /ckpt/qwen3-8B-mcore --tp 2 --submit --partition gpu "
               "--gpus-per-node 2 --wait")


@dataclass
class ConvertJob:
    argv: list[str]           # the conversion's own arguments (hf-to-mcore ... / mcore-to-hf ...)
    nproc: int
    partition: str | None = None
    account: str | None = None
    time: int = 60            # minutes
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    job_dir: Path = Path("convert-jobs")


def split_submit_args(args: list[str]) -> ConvertJob:
    """Take `--submit` and the SLURM flags out of a `rlslurm convert` command line."""
    conv: list[str] = []
    opts: dict[str, object] = {}
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, inline = a.partition("=")
        if a == "--submit":
            i += 1
            continue
        if name in _SUBMIT_FLAGS:
            raw = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
            if raw is None:
                raise ConfigError(f"{name} needs a value")
            try:
                opts[name[2:].replace("-", "_")] = _SUBMIT_FLAGS[name](raw)
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None
            i += 1 if eq else 2
            continue
        conv.append(a)
        i += 1
    sizes: dict[str, int] = {}
    for flag in ("--tp", "--pp", "--ep", "--etp"):
        if flag in conv:
            try:
                sizes[flag] = _int_at_least(1)(conv[conv.index(flag) + 1])
            except IndexError:
                raise ConfigError(f"{flag} needs an integer") from None
            except ValueError as e:
                raise ConfigError(f"{flag}: {e}") from None
    tp = sizes.get("--tp", 1)
    # the converter's own rule: one process per model-parallel rank (rlslurm/convert/runtime.py)
    nproc = converter_world(tp=tp, pp=sizes.get("--pp", 1), ep=sizes.get("--ep", 1), etp=sizes.get("--etp", tp))
    return ConvertJob(argv=conv, nproc=nproc, **opts)  # type: ignore[arg-type]


def run_conversion(argv: list[str], nproc: int) -> int:
    """Runs inside the job: torchrun with one process per model-parallel rank."""
    from rlslurm.net import rendezvous_port
    from rlslurm.stacks import check_convert_args

    check_convert_args(argv)  # the node's stack, before torchrun imports torch (rlslurm/stacks.py)
    port = rendezvous_port("127.0.0.1")
    # torchrun with its rendezvous store on 127.0.0.1 only (rlslurm/slurm/torchrun.py)
    cmd = [sys.executable, "-m", "rlslurm.slurm.torchrun", "--nnodes=1", "--node-rank=0", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "rlslurm.convert", *argv]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def submit(job: ConvertJob):
    import submitit

    ex = submitit.AutoExecutor(folder=str(job.job_dir / "%j"), cluster="slurm")
    params: dict[str, object] = {"timeout_min": job.time, "nodes": 1, "tasks_per_node": 1,
                                 "cpus_per_task": job.cpus_per_task, "name": "rlslurm-convert"}
    if job.partition:
        params["slurm_partition"] = job.partition
    if job.account:
        params["slurm_account"] = job.account
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
    ex.update_parameters(**params)
    return ex.submit(run_conversion, job.argv, job.nproc)
