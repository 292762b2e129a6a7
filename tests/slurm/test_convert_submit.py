"""`rlslurm convert ... --submit`: a real single-group SLURM job submitted through submitit runs the
converter under torchrun (TP=2, gloo) and produces a checkpoint that converts back bit-exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlslurm.errors import ConfigError
from rlslurm.settings.model_config import load_model_config
from rlslurm.slurm.convert_job import split_submit_args
from rlslurm.tiny import make_tiny_checkpoint


def test_split_submit_args_counts_model_parallel_processes(tmp_path: Path) -> None:
    job = split_submit_args(["hf-to-mcore", "--model", "m", "--tp", "2", "--pp", "2", "--submit",
                             "--partition", "gpu", "--time=30", "--job-dir", str(tmp_path)])
    assert job.nproc == 4 and job.partition == "gpu" and job.time == 30 and job.job_dir == tmp_path
    assert job.argv == ["hf-to-mcore", "--model", "m", "--tp", "2", "--pp", "2"]


@pytest.mark.parametrize("flags, needle", [
    (["--partition", "gpu\n#SBATCH --uid=0"], "--partition: 'gpu\\n#SBATCH --uid=0' is not a valid SLURM name"),
    (["--partition=gpu\n"], "--partition: 'gpu\\n' is not a valid SLURM name"),
    (["--account", "proj; rm -rf ~"], "--account: 'proj; rm -rf ~' is not a valid SLURM name"),
    (["--time", "-5"], "--time: must be >= 1, got -5"),
    (["--time", "1h"], "--time: '1h' is not an integer"),
    (["--cpus-per-task", "0"], "--cpus-per-task: must be >= 1"),
    (["--gpus-per-node", "-1"], "--gpus-per-node: must be >= 0"),
    (["--tp", "0"], "--tp: must be >= 1"),
])
def test_submit_flags_are_validated_like_the_run_config(flags, needle) -> None:
    # submitit writes partition and account into #SBATCH lines: the run config's own check applies
    with pytest.raises(ConfigError) as ei:
        split_submit_args(["hf-to-mcore", "--model", "m", "--submit", *flags])
    assert needle in str(ei.value)


def test_convert_submit_refuses_a_bad_partition_in_one_line_before_submitting(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "convert", "hf-to-mcore", "--submit",
                        "--partition", "gpu\n#SBATCH --uid=0", "--job-dir", str(tmp_path / "jobs")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "--partition:" in p.stderr, p.stderr
    assert not (tmp_path / "jobs").exists()  # nothing was submitted


@pytest.mark.slurm
@pytest.mark.megatron
def test_conversion_job_round_trips(slurm_cluster, tmp_path: Path) -> None:
    mc = load_model_config("tiny-qwen3")
    hf = make_tiny_checkpoint(mc, tmp_path / "hf")
    mcore, back = tmp_path / "mcore", tmp_path / "back"

    def convert(*args: str) -> None:
        p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "convert", *args, "--submit", "--wait",
                            "--time", "10", "--job-dir", str(tmp_path / "jobs")],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)
        logs = "\n".join(f.read_text()[-3000:] for f in (tmp_path / "jobs").glob("*/*.out"))
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n{logs}"
        assert "submitted conversion job" in p.stdout

    convert("hf-to-mcore", "--model", "tiny-qwen3", "--hf", str(hf), "--out", str(mcore), "--tp", "2",
            "--dtype", "fp32")
    convert("mcore-to-hf", "--model", "tiny-qwen3", "--load", str(mcore), "--out", str(back),
            "--hf-config-from", str(hf))
    a, b = load_file(hf / "model.safetensors"), load_file(next(back.glob("*.safetensors")))
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)
