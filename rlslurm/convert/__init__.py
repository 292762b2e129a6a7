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

from rlslurm.convert.export import mcore_to_hf
from rlslurm.convert.hf_config import check_hf_config
from rlslurm.convert.hf_io import HFCheckpoint, save_hf_checkpoint
from rlslurm.convert.load import load_hf_checkpoint
from rlslurm.convert.mapping import hf_to_mcore

__all__ = ["HFCheckpoint", "check_hf_config", "hf_to_mcore", "load_hf_checkpoint", "mcore_to_hf",
           "save_hf_checkpoint"]
