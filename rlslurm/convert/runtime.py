"""Process setup shared by both conversion directions: torch.distributed (gloo on CPU, NCCL on
GPU), megatron's parallel state, the model, and the converter's metadata file.

The converter runs one process per model-parallel rank and no more: world size = PP x lcm(TP,
ETP x EP), the fewest ranks on which megatron-core's dense grid (TP x DP) and expert grid (ETP x EP
x expert-DP) both fit (rlslurm/settings/parallel_grid.py); any data parallelism is only there for the
experts. With ETP = TP (the default) that is TP x PP x EP. Started without torchrun it is a single
process (TP=PP=EP=ETP=1).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from rlslurm.errors import ConfigError
from rlslurm.net import rendezvous_port
from rlslurm.settings.model_config import ModelConfig
from rlslurm.settings.parallel_grid import converter_world


@dataclasses.dataclass
class Runtime:
    rank: int
    world: int
    tp: int
    pp: int
    ep: int
    etp: int
    # the first/last pipeline stage's layers (None: an even split; rlslurm/settings/parallel_grid.py stage_layers)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()


def check_world(tp: int, pp: int, ep: int, etp: int | None = None) -> int:
    """Refuse parallel sizes that do not match the processes started (before any heavy import);
    returns ETP (None: TP)."""
    etp = tp if etp is None else etp
    for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp)):
        if v < 1:
            raise ConfigError(f"{flag}={v}: must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    need = converter_world(tp=tp, pp=pp, ep=ep, etp=etp)
    if world != need:
        said = f" --etp {etp}" if etp != tp else ""
        raise ConfigError(
            f"--tp {tp} --pp {pp} --ep {ep}{said} needs {need} processes "
            f"(torchrun --nproc_per_node {need}), got WORLD_SIZE={world}"
        )
    return etp


def init(tp: int, pp: int, ep: int, etp: int | None = None, stages: tuple[int | None, int | None] = (None, None)
         ) -> Runtime:
    """Start torch.distributed + megatron parallel state for the requested sizes (etp None: TP;
    `stages`: the first and last pipeline stage's layers, None for an even split)."""
    etp = check_world(tp, pp, ep, etp)
    if "RANK" not in os.environ:  # plain `python -m rlslurm.convert`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(rendezvous_port("127.0.0.1")))
    world = int(os.environ["WORLD_SIZE"])
    from rlslurm.models import cpu_shim

    cpu_shim.apply()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(1234)
    return Runtime(dist.get_rank(), world, tp, pp, ep, etp, *stages)


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def build(mc: ModelConfig, rt: Runtime, dtype: torch.dtype, vocab_size_padded: int | None = None,
          vocab_divisible_by: int = 128):
    """This rank's GPTModel chunk (first/last pipeline stages carry embedding/output)."""
    from megatron.core import parallel_state as ps

    from rlslurm.models.build import build_gpt_model, padded_vocab_size, transformer_config

    tcfg = transformer_config(mc, params_dtype=dtype, tp=rt.tp, pp=rt.pp, ep=rt.ep, etp=rt.etp, cp=1,
                              first_stage_layers=rt.first_stage_layers, last_stage_layers=rt.last_stage_layers,
                              overrides={})
    vpad = vocab_size_padded or padded_vocab_size(mc.arch.vocab_size, rt.tp, vocab_divisible_by)
    if vpad % rt.tp:
        raise ConfigError(f"--tp {rt.tp}: the checkpoint's padded vocabulary {vpad} is not divisible by it")
    model = build_gpt_model(mc, tcfg, vocab_size_padded=vpad,
                            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    model.eval()
    return model, vpad
