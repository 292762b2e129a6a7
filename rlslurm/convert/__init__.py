"""HF <-> Megatron conversion: the per-family mapping shared by the trainer's HF load, the weight
sync's export and `rlslurm convert`.

Public API:
- `check_hf_config(mc, hf_dir)`: config.json vs model config (ConfigError naming the field).
- `load_hf_checkpoint(model, mc, hf_dir)`: safetensors -> this rank's shards of a GPTModel.
- `mcore_to_hf(mc, model)`: generator of `(hf_name, full_tensor)`, gathered over TP/EP.
- `hf_to_mcore(mc, hf_state, tp_rank, tp_size, targets=...)`: the sharded import, streamed.
- `save_hf_checkpoint(tensors, out_dir, config=...)`: atomic safetensors writer.
- `meta.check_meta(mc, ckpt_dir, tp)`: a converted Megatron checkpoint's architecture check and its
  recorded padded vocabulary (build the model with it to read the checkpoint at another TP).
"""

# The names are loaded on first use (PEP 562): a caller that needs one torch-free name (the login
# side's check_hf_config) must not pay for the torch import that `export` brings (seconds per CLI call).
_WHERE = {"mcore_to_hf": "export", "check_hf_config": "rlslurm.models.hf_config", "HFCheckpoint": "hf_io",
          "save_hf_checkpoint": "hf_io", "load_hf_checkpoint": "load", "hf_to_mcore": "mapping"}

__all__ = ["HFCheckpoint", "check_hf_config", "hf_to_mcore", "load_hf_checkpoint", "mcore_to_hf",
           "save_hf_checkpoint"]


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        where = _WHERE[name]
        value = getattr(importlib.import_module(where if "." in where else f"{__name__}.{where}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
