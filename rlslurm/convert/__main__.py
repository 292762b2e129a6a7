"""`python -m rlslurm.convert ...` / `torchrun --nproc_per_node N -m rlslurm.convert ...`."""

import sys

if __name__ == "__main__":
    from rlslurm.errors import UserError
    from rlslurm.stacks import check_convert_args

    try:  # the converter's stack, before it imports torch (rlslurm/stacks.py)
        args = check_convert_args(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from rlslurm.convert.cli import app

    app(args=args, prog_name="ckpt_convert")
