"""`python -m rlslurm ...`: the `rlslurm` command, for a node or venv whose PATH lacks the script."""

from rlslurm.cli import main

if __name__ == "__main__":
    main()
