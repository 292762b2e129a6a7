"""Real single-host SLURM cluster for the test suite (see README.md in this folder)."""

from .cluster import (
    TERMINAL_STATES,
    ClusterBootError,
    SlurmCluster,
    SlurmError,
    parse_kv_line,
)

__all__ = ["TERMINAL_STATES", "ClusterBootError", "SlurmCluster", "SlurmError", "parse_kv_line"]
