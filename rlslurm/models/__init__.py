"""The model families: what each architecture is (rlslurm/models/families/), how its HF config.json and
its Megatron model relate to the model config, and the megatron-core model build with the layers that
megatron-core lacks. Below both roles' packages and rlslurm.convert: it imports none of them."""
