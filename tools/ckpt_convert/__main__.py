"""`python -m tools.ckpt_convert ...` / `torchrun --nproc_per_node N -m tools.ckpt_convert ...`."""

from tools.ckpt_convert.cli import app

if __name__ == "__main__":
    app(prog_name="ckpt_convert")
