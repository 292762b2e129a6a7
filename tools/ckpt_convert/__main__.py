"""`python tools/ckpt_convert ARGS...` = `rlslurm convert ARGS...` (HF <-> Megatron checkpoints).

The layout's checkpoint converter: a thin entry from a checkout, not a package (the converter
is `rlslurm.convert`, which the trainer and the weight sync use too). Works under torchrun as
well: `torchrun --nproc_per_node 2 tools/ckpt_convert hf-to-mcore ... --tp 2`. README.md here.
"""

import os
import sys

# this checkout's rlslurm first: run from a checkout, the entry converts with its own code
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlslurm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["rlslurm", "convert", *sys.argv[1:]]
    main()
