"""`hf-to-mcore` / `mcore-to-hf`: HF safetensors <-> megatron-core distributed checkpoints.

Run one process per model-parallel rank, e.g. for TP=2:

    torchrun --nproc_per_node 2 -m rlslurm.convert hf-to-mcore --model qwen3-8B \\
        --hf /ckpt/Qwen3-8B --out /ckpt/qwen3-8B-mcore --tp 2
    torchrun --nproc_per_node 1 -m rlslurm.convert mcore-to-hf --model qwen3-8B \\
        --load /ckpt/qwen3-8B-mcore --out /ckpt/qwen3-8B-hf --hf-config-from /ckpt/Qwen3-8B

(also `rlslurm convert ...`). The mapping is `rlslurm.convert`, the same one the trainer loads
with and the weight sync exports with. A Megatron checkpoint written here carries
`rlslurm_model.json` (rlslurm.convert.meta: architecture, padded vocabulary, parallel sizes,
dtype), so it can be read back at any TP/PP/EP/ETP that divides its padded vocabulary and is
checked against the model config. `--etp` (the routed experts' tensor parallelism, default `--tp`)
changes the process count: PP x lcm(TP, ETP x EP) (rlslurm/convert/runtime.py).
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` (slime's flags) split
the layers over the stages unevenly, as the trainer does: the checkpoint numbers its layers globally
(megatron's layer_number), so a checkpoint written at one split reads back at any other.
"""

from __future__ import annotations

import shutil
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Iterator

import torch
import typer

from rlslurm.buffer.atomic import StorageError
from rlslurm.cli_typer import App, Group
from rlslurm.errors import ConfigError, UserError
from rlslurm.settings.parallel_grid import stage_layers

app = App(cls=Group, add_completion=False, no_args_is_help=True,
          help="Convert HF safetensors <-> megatron-core distributed checkpoints.")


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


# slime's flags for an uneven pipeline (rlslurm/settings/parallel_grid.py stage_layers); the checkpoint's layers
# are numbered globally, so any split reads any other
_FIRST_HELP = "layers of the first pipeline stage (default: an even split)"
_LAST_HELP = "layers of the last pipeline stage (default: an even split)"

_TORCH = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}
_HF_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _progress(enabled: bool, description: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[name]}"), disable=not enabled, transient=False,
                    console=_console())


def _console():
    from rich.console import Console

    return Console(stderr=True, emoji=False)  # ":100:" in a message is a line number, not 💯


def _summary(title: str, rows: dict[str, object]) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for k, v in rows.items():
        table.add_row(k, str(v))
    _console().print(table)


def _reduce_sum(values: list[int]) -> list[int]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(t)
    return t.tolist()


def _run(fn) -> None:
    try:
        fn()
    except (UserError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


@app.command("hf-to-mcore")
def hf_to_mcore_cmd(
    model: str = typer.Option(..., "--model", help="model config name or YAML path"),
    hf: Path = typer.Option(..., "--hf", help="HF checkpoint directory (config.json + safetensors)"),
    out: Path = typer.Option(..., "--out", help="output directory for the Megatron checkpoint"),
    tp: int = typer.Option(1, "--tp"),
    pp: int = typer.Option(1, "--pp"),
    ep: int = typer.Option(1, "--ep"),
    etp: int = typer.Option(None, "--etp", help="tensor parallelism of the routed experts (default: --tp; "
                                                "slime's --expert-tensor-parallel-size)"),
    first: int = typer.Option(None, "--decoder-first-pipeline-num-layers", help=_FIRST_HELP),
    last: int = typer.Option(None, "--decoder-last-pipeline-num-layers", help=_LAST_HELP),
    dtype: DType = typer.Option(DType.bf16, "--dtype", help="parameter dtype of the Megatron checkpoint"),
    vocab_divisible_by: int = typer.Option(
        128, "--vocab-divisible-by",
        help="pad the vocabulary to a multiple of this x TP (recorded; readers at any TP dividing the "
             "padded size can load it, e.g. 1024 lets TP 1..8 share one checkpoint)"),
) -> None:
    """HF safetensors -> megatron-core distributed checkpoint at the chosen TP/PP/EP/ETP."""
    _run(lambda: _hf_to_mcore(model, hf, out, tp, pp, ep, _TORCH[dtype], vocab_divisible_by, etp, (first, last)))


def _hf_to_mcore(model_name: str, hf: Path, out: Path, tp: int, pp: int, ep: int, dtype: torch.dtype,
                 vocab_divisible_by: int = 128, etp: int | None = None,
                 stages: tuple[int | None, int | None] = (None, None)) -> None:
    from rlslurm.convert import check_hf_config, load_hf_checkpoint, runtime
    from rlslurm.convert.meta import write_meta
    from rlslurm.settings.model_config import load_model_config

    etp = runtime.check_world(tp, pp, ep, etp)
    mc = load_model_config(model_name)
    stage_layers(mc.arch.num_layers, pp, *stages, model=mc.name, pp_flag="--pp")  # before any process group
    check_hf_config(mc, hf)
    rt = runtime.init(tp, pp, ep, etp, stages)
    try:
        from megatron.core import dist_checkpointing

        t0 = time.time()
        net, vpad = runtime.build(mc, rt, dtype, vocab_divisible_by=vocab_divisible_by)
        with _progress(rt.is_main, "HF -> Megatron (rank 0)") as bar:
            task = bar.add_task("load", total=None, name="")

            def tick(name: str, total: int) -> None:
                bar.update(task, total=total, advance=1, name=name)

            summary = load_hf_checkpoint(net, mc, hf, check_config=False, progress=tick)
        if rt.is_main:
            if out.exists() and any(out.iterdir()):
                raise ConfigError(f"--out {out}: directory exists and is not empty")
            out.mkdir(parents=True, exist_ok=True)
        rt.barrier()
        dist_checkpointing.save(net.sharded_state_dict(), str(out))
        tensors, nbytes = _reduce_sum([summary["tensors"], summary["bytes"]])
        if rt.is_main:
            write_meta(out, {
                "model": mc.name, "arch": mc.arch.model_dump(mode="json"), "hf_model_type": mc.hf_model_type,
                "vocab_size_padded": vpad, "tp": tp, "pp": pp, "ep": ep, "etp": etp,
                "decoder_first_pipeline_num_layers": stages[0], "decoder_last_pipeline_num_layers": stages[1],
                "dtype": _HF_NAME[dtype],
                "source": str(hf.resolve()),
            })
            _summary("hf-to-mcore", {
                "model": mc.name, "from": hf, "to": out, "TP/PP/EP/ETP": f"{tp}/{pp}/{ep}/{etp}",
                "layers per stage": "/".join(map(str, stage_layers(mc.arch.num_layers, pp, *stages))),
                "dtype": _HF_NAME[dtype], "padded vocab": f"{mc.arch.vocab_size} -> {vpad}",
                "shards loaded (all ranks)": tensors, "bytes (all ranks)": nbytes,
                "seconds": f"{time.time() - t0:.1f}",
            })
        rt.barrier()
    finally:
        runtime.shutdown()


@app.command("mcore-to-hf")
def mcore_to_hf_cmd(
    model: str = typer.Option(..., "--model", help="model config name or YAML path"),
    load: Path = typer.Option(..., "--load", help="Megatron distributed checkpoint directory"),
    out: Path = typer.Option(..., "--out", help="output HF directory"),
    hf_config_from: Path = typer.Option(None, "--hf-config-from",
                                        help="HF directory whose config.json and tokenizer files to copy "
                                             "(required unless the model config is a tiny test model)"),
    tp: int = typer.Option(1, "--tp"),
    pp: int = typer.Option(1, "--pp"),
    ep: int = typer.Option(1, "--ep"),
    etp: int = typer.Option(None, "--etp", help="tensor parallelism of the routed experts (default: --tp; "
                                                "slime's --expert-tensor-parallel-size)"),
    first: int = typer.Option(None, "--decoder-first-pipeline-num-layers", help=_FIRST_HELP),
    last: int = typer.Option(None, "--decoder-last-pipeline-num-layers", help=_LAST_HELP),
    dtype: DType = typer.Option(None, "--dtype", help="dtype of the HF tensors (default: the checkpoint's)"),
) -> None:
    """megatron-core distributed checkpoint -> HF safetensors (trimmed vocabulary, HF names)."""
    _run(lambda: _mcore_to_hf(model, load, out, hf_config_from, tp, pp, ep, _TORCH[dtype] if dtype else None, etp,
                              (first, last)))


def _hf_config(mc, hf_config_from: Path | None, dtype: torch.dtype) -> dict:
    import json

    from rlslurm.convert import check_hf_config

    if hf_config_from is not None:
        check_hf_config(mc, hf_config_from)
        cfg = json.loads((hf_config_from / "config.json").read_text())
    elif mc.tiny:
        from rlslurm.tiny import hf_config_dict

        cfg = hf_config_dict(mc)
    else:
        raise ConfigError(f"--hf-config-from: needed for {mc.name} (its config.json and tokenizer are copied)")
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = _HF_NAME[dtype]
    return cfg


def _mcore_to_hf(model_name: str, load: Path, out: Path, hf_config_from: Path | None, tp: int, pp: int, ep: int,
                 dtype: torch.dtype | None, etp: int | None = None,
                 stages: tuple[int | None, int | None] = (None, None)) -> None:
    from rlslurm.convert import mcore_to_hf, runtime, save_hf_checkpoint
    from rlslurm.convert.meta import check_meta, read_meta
    from rlslurm.settings.model_config import load_model_config

    etp = runtime.check_world(tp, pp, ep, etp)
    mc = load_model_config(model_name)
    stage_layers(mc.arch.num_layers, pp, *stages, model=mc.name, pp_flag="--pp")  # before any process group
    if not load.is_dir():
        raise ConfigError(f"--load {load}: not a directory")
    vpad = check_meta(mc, load, tp)
    meta = read_meta(load)
    ckpt_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        meta.get("dtype", "float32"), torch.float32)
    out_dtype = dtype or ckpt_dtype
    config = _hf_config(mc, hf_config_from, out_dtype)
    rt = runtime.init(tp, pp, ep, etp, stages)
    try:
        from megatron.core import dist_checkpointing, parallel_state as ps

        t0 = time.time()
        net, _ = runtime.build(mc, rt, ckpt_dtype, vocab_size_padded=vpad)
        sharded = net.sharded_state_dict()
        state = dist_checkpointing.load(sharded, str(load))
        # a run's checkpoint (RUN/checkpoints/iter_N) also holds the optimizer, the scheduler and the
        # trainer's progress beside the model (trainer/checkpoint/state.py): the model's part is converted
        net.load_state_dict({k: v for k, v in state.items() if k in sharded})
        stage = ps.get_pipeline_model_parallel_rank()
        writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        stream = mcore_to_hf(mc, net, dtype=out_dtype)
        target = out if pp == 1 else out / f".stage{stage:03d}"
        if rt.is_main:
            if out.exists() and any(p for p in out.iterdir() if not p.name.startswith(".stage")):
                raise ConfigError(f"--out {out}: directory exists and is not empty")
            out.mkdir(parents=True, exist_ok=True)
        rt.barrier()
        written = {"tensors": 0, "bytes": 0}
        with _progress(rt.is_main, f"Megatron -> HF (stage {stage})") as bar:
            task = bar.add_task("export", total=None, name="")

            def ticking(it: Iterator) -> Iterator:
                for name, t in it:
                    bar.update(task, advance=1, name=name)
                    yield name, t

            if writer:
                written = save_hf_checkpoint(ticking(stream), target, config=config if pp == 1 else None,
                                             copy_aux_from=(hf_config_from if pp == 1 else None))
            else:
                for _ in stream:  # every TP/EP rank takes part in the gathers
                    pass
        rt.barrier()
        if pp > 1 and rt.is_main:
            _merge_stages(out, pp, config, hf_config_from)
        tensors, nbytes = _reduce_sum([written["tensors"], written["bytes"]])
        if rt.is_main:
            _summary("mcore-to-hf", {
                "model": mc.name, "from": load, "to": out, "TP/PP/EP/ETP": f"{tp}/{pp}/{ep}/{etp}",
                "layers per stage": "/".join(map(str, stage_layers(mc.arch.num_layers, pp, *stages))),
                "dtype": _HF_NAME[out_dtype], "HF tensors written": tensors, "bytes": nbytes,
                "seconds": f"{time.time() - t0:.1f}",
            })
        rt.barrier()
    finally:
        runtime.shutdown()


def _merge_stages(out: Path, pp: int, config: dict, aux_from: Path | None) -> None:
    """Pipeline stages wrote their own shards: move them up and write one index, config last."""
    import json
    import os

    from rlslurm.convert import HFCheckpoint
    from rlslurm.convert.hf_io import AUX_FILES, INDEX_NAME, _atomic_write_bytes, _fsync_dir

    weight_map: dict[str, str] = {}
    total = 0
    for stage in range(pp):
        sdir = out / f".stage{stage:03d}"
        ck = HFCheckpoint(sdir)
        for name in ck.names():
            t = ck.get(name)
            total += t.numel() * t.element_size()
        for f in sorted(sdir.glob("*.safetensors")):
            new = f"pp{stage:03d}-{f.name}"
            os.replace(f, out / new)
            for name, shard in list(ck._where.items()):
                if shard == f:
                    weight_map[name] = new
        shutil.rmtree(sdir)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic_write_bytes(out / INDEX_NAME, json.dumps(index, indent=2).encode())
    if aux_from is not None:
        for aux in AUX_FILES:
            if (aux_from / aux).exists():
                shutil.copyfile(aux_from / aux, out / aux)
    _atomic_write_bytes(out / "config.json", json.dumps(config, indent=2).encode())
    _fsync_dir(out)
