"""The job as its own processes see it, on every node: the SLURM environment (env.py), each
process's record of where it runs (report.py) and SLURM's time formats (timespec.py). Both roles
and the settings use these; nothing here imports the login side (rlslurm/slurm/, the CLI)."""
