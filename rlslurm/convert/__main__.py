"""`python -m rlslurm.convert ...` / `torchrun --nproc_per_node N -m rlslurm.convert ...`."""

from rlslurm.convert.cli import app

if __name__ == "__main__":
    app(prog_name="ckpt_convert")
