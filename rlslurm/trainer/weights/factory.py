"""The one place that turns the run's weight-sync plan (rlslurm/settings/weight_plan.py) into the trainer's
publisher: which of disk.py, base.py's two that send nothing, broadcast.py or ipc.py, with what
options and fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rlslurm.buffer.control import Control
from rlslurm.job.env import job_env
from rlslurm.settings.weight_plan import WeightSyncPlan
from rlslurm.trainer.weights.base import NullPublisher, SyncOptions, VersionRecorder, WeightPublisher
from rlslurm.trainer.weights.disk import DiskPublisher


def publisher_for(plan: WeightSyncPlan, st: Any, control: Control, *, hf_dir: Path | None, replay: bool,
                  no_engines: bool, ending: Callable[[], bool], note: Callable[[str], None]) -> WeightPublisher:
    """`st`: the trainer's state (trainer/setup.py): the model config and the parameters' dtype;
    `replay`: --load-debug-rollout-data; `no_engines`: the run starts none."""
    quantizer = quantized_export(plan, hf_dir)
    disk = DiskPublisher(st.mc, control.run.weights_dir, control, hf_dir=hf_dir, dtype=st.tcfg.params_dtype,
                         quantizer=quantizer)
    if plan.by_disk:
        return disk  # also in replay: the trained weights are then on disk to evaluate
    if replay:
        return NullPublisher()  # no engine listens
    if no_engines:
        # --debug-train-only: nothing to publish, but the driver paces its rollouts by the version
        return VersionRecorder(control)
    rd = control.run
    common = dict(api_key=rd.api_key() if rd.api_key_file.exists() else None,
                  opts=SyncOptions.from_plan(plan, dtype=st.tcfg.params_dtype, quantizer=quantizer),
                  fallback=disk if plan.fallback == "disk" else None, attempt=job_env().attempt,
                  ending=ending, note=note)
    if plan.transport == "ipc":  # --colocate: in place on each GPU
        from rlslurm.trainer.weights.ipc import ipc_publisher

        return ipc_publisher(st.mc, control, node=job_env().node, **common)
    from rlslurm.trainer.weights.broadcast import broadcast_publisher

    return broadcast_publisher(st.mc, control, **common)


def quantized_export(plan: WeightSyncPlan, hf_dir: Path | None) -> Any:
    """The plan's quantizing sync (an FP8 or INT4 --hf-checkpoint): which weights to quantize, read
    off that checkpoint's tensors (convert/fp8.py `Fp8Export`, convert/int4.py `Int4Export`); None
    for an unquantized one."""
    if hf_dir is None:
        return None
    if plan.fp8_block is not None:
        from rlslurm.convert.fp8 import Fp8Export

        return Fp8Export.of_checkpoint(hf_dir, plan.fp8_block)
    if plan.int4_group is not None:
        from rlslurm.convert.int4 import Int4Export

        return Int4Export.of_checkpoint(hf_dir, plan.int4_group)
    return None
