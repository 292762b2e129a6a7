"""One module per model family, each defining `FAMILY` (rlslurm/models/family.py); the registry reads
every module here (docs/extending.md, "Adding a model family")."""
