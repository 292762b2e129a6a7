"""Helpers shared by the test areas (imported as `tests.helpers.<module>`): the rlslurm CLI as a user runs
it, prompt files, HF directory shapes, tiny quantized checkpoints, the shared CPU SGLang deployment, process
and port lookups, SLURM run records. A helper of one area lives in that area (tests/<area>/helpers.py or its
conftest.py); a fixture every area uses is in tests/conftest.py (`prompts`, `tiny_model`). Free ports come from
rlslurm.net.free_port, the allocator the launcher itself uses: tests keep no copy of it."""
