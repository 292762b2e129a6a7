"""Parity worker, run under torchrun by tests/convert (one process per TP rank, gloo, CPU).

For every model config named on the command line: build the Megatron GPTModel at TP=world size,
load the HF checkpoint `<ckpt_root>/<model>` through rlslurm.convert, and record
- max |logits_megatron - logits_hf| on a fixed batch (HF transformers on the same files, fp32),
- the HF -> Megatron -> HF round trip: every exported tensor compared with the file, bit for bit,
- the loss on the same batch (for TP=1 vs TP=2 comparisons).
Rank 0 writes one JSON file per model to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# Per-expert checkpoint names of transformers 5's fused expert parameters: (MoE block, gate, up, down).
# conversion_mapping.py reads qwen2_moe-style names for most families and mixtral's for minimax_m2
# (`block_sparse_moe.experts.E.w1/w3/w2`, the router `block_sparse_moe.gate`).
EXPERT_NAMES = {"minimax_m2": ("block_sparse_moe", "w1", "w3", "w2")}
QWEN2_MOE_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def _hf_grads(hf, model_type: str) -> dict:
    """HF parameter gradients by checkpoint name. transformers 5 fuses MoE experts into 3-D
    parameters (`experts.gate_up_proj` [E, 2f, h], gate first; `experts.down_proj` [E, h, f])
    while checkpoints keep per-expert tensors: split them back."""
    block, gate_n, up_n, down_n = EXPERT_NAMES.get(model_type, QWEN2_MOE_NAMES)
    out = {}
    for n, p in hf.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if n.endswith("mlp.experts.gate_up_proj"):
            base = n[: -len("mlp.experts.gate_up_proj")] + f"{block}.experts."
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, 0)
                out[f"{base}{e}.{gate_n}.weight"], out[f"{base}{e}.{up_n}.weight"] = gate, up
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("mlp.experts.down_proj")] + f"{block}.experts."
            for e in range(g.shape[0]):
                out[f"{base}{e}.{down_n}.weight"] = g[e]
        elif n.endswith("mlp.gate.weight"):
            out[n[: -len("mlp.gate.weight")] + f"{block}.gate.weight"] = g
        else:
            out[n] = g
    return out


def _sgd_step_loss(model, grads: dict, ids, pos, vocab: int, lr: float = 1.0, max_norm: float = 1e-2) -> tuple:
    """One step of what megatron's optimizer does with `grads` (the finalised gradients by parameter
    name), then the loss: the gradient norm as megatron's clip_grads takes it (each TP-sharded
    parameter once per rank, a replicated one from TP rank 0 only, summed over the model-parallel
    group; routed experts over the expert groups, as megatron's expert optimizer does, and the two
    combined as its ChainedOptimizer does), the clipped SGD update (max_norm far below the norm, so
    the norm sets the step), and the summed token NLL after it. Returns (norm, loss)."""
    import math

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    named = list(model.named_parameters())
    dense = [grads[n] for n, p in named if ".local_experts." not in n and param_is_not_tensor_parallel_duplicate(p)]
    expert = [grads[n] for n, p in named if ".local_experts." in n and param_is_not_tensor_parallel_duplicate(p)]
    sq = get_grad_norm_fp32(dense, grad_stats_parallel_group=ps.get_model_parallel_group()) ** 2
    if any(".local_experts." in n for n, _ in named):
        expert_group = ps.get_expert_tensor_model_pipeline_parallel_group()
        sq += get_grad_norm_fp32(expert, grad_stats_parallel_group=expert_group) ** 2
    norm = math.sqrt(sq)
    scale = lr * min(1.0, max_norm / (norm + 1e-6))
    with torch.no_grad():
        for n, p in named:
            p.data.add_(grads[n].to(p.dtype), alpha=-scale)
        logits = gather_from_tensor_model_parallel_region(model(ids, pos, None))[..., :vocab].cpu()
    ids = ids.cpu()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return norm, float(loss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ep", default="1", help="comma list of EP sizes to run in turn (EP > 1: MoE models only)")
    ap.add_argument("models", nargs="+", help="model config names or YAML paths (checkpoint: <ckpt-root>/<name>)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    # CPU (CI): gloo. On a GPU machine (megatron-core 0.19 check): NCCL, one GPU per rank.
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from rlslurm.models import cpu_shim

    cpu_shim.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from rlslurm.convert import HFCheckpoint, load_hf_checkpoint, mcore_to_hf
    from rlslurm.models.build import build_gpt_model, mask_padded_vocab, padded_vocab_size, transformer_config
    from rlslurm.settings.model_config import load_model_config

    out = Path(args.out)
    runs = [(int(ep), name) for ep in args.ep.split(",") for name in args.models]
    for ep, name in runs:
        tp = world // ep
        mc = load_model_config(name)
        if ep > 1 and mc.arch.moe is None:
            continue
        result: dict = {"model": mc.name, "tp": tp, "ep": ep}
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
            model_parallel_cuda_manual_seed(1234)
            hf_dir = Path(args.ckpt_root) / mc.name
            tcfg = transformer_config(mc, params_dtype=torch.float32, tp=tp, pp=1, ep=ep, cp=1, overrides={})
            vpad = padded_vocab_size(mc.arch.vocab_size, tp)
            model = build_gpt_model(mc, tcfg, vocab_size_padded=vpad)
            model.eval()
            summary = load_hf_checkpoint(model, mc, hf_dir)
            result["loaded_tensors"] = summary["tensors"]
            if mc.arch.dsa is not None:
                # GLM-5: what the trainer built for the sparse attention (models/dsa.py)
                cores = {type(m).__name__ for n, m in model.named_modules()
                         if n.endswith("self_attention.core_attention")}
                idx = [m for n, m in model.named_modules() if n.endswith("core_attention.indexer")]
                result["dsa"] = {"core_attention": sorted(cores), "indexers": sorted({type(m).__name__ for m in idx}),
                                 "k_norm_eps": sorted({m.k_norm.eps for m in idx}),
                                 "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad)}

            g = torch.Generator().manual_seed(0)
            # No special tokens: HF's embedding has padding_idx=<pad>, whose gradient torch always
            # zeroes (and whose zero-initialised row makes RMSNorm's gradient blow up in Megatron,
            # which has no padding_idx). RL batches mask pad positions out of the loss anyway.
            ids = torch.randint(4, mc.arch.vocab_size, (2, 12), generator=g)
            pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).to(dev)
            ids_cpu, ids = ids, ids.to(dev)
            with torch.no_grad():
                logits = model(ids, pos, None)  # [b, s, vocab/tp]
                logits = gather_from_tensor_model_parallel_region(logits)[..., : mc.arch.vocab_size].cpu()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     ids_cpu[:, 1:].reshape(-1))
            result["loss"] = float(loss)
            # Token log-probs the way a trainer computes them: vocab-parallel cross entropy on this
            # rank's logits slice, TP padding masked; and the loss backpropagates through it.
            model.train()
            local = model(ids, pos, None)
            local = mask_padded_vocab(local, mc.arch.vocab_size)
            nll = vocab_parallel_cross_entropy(local[:, :-1].transpose(0, 1).contiguous(),
                                               ids[:, 1:].transpose(0, 1).contiguous())
            nll.sum().backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            result["grad_finite"] = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)
            token_logprobs = (-nll).transpose(0, 1).detach().cpu()  # [b, s-1]
            # Gradients in HF names: finish what megatron's finalize_model_grads does for norms
            # (sum over TP of sequence-parallel and q/k-norm grads), then export the grads through
            # the same mapping as the weights (gathered over TP/EP).
            # Summed over TP, by megatron's rule (finalize_model_grads.py:354-356): sequence-parallel
            # norms, and per-head q/k norms by name when the config has qk_layernorm (MiniMax-M2's
            # all-heads q/k norm is TP-sharded and its config has it off: models/qk_norm.py).
            tp_group = ps.get_tensor_model_parallel_group()
            weights, finalised = {}, {}
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    weights[pname] = p.data
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    if tp > 1 and (getattr(p, "sequence_parallel", False) or
                                   (tcfg.qk_layernorm and ("q_layernorm" in pname or "k_layernorm" in pname))):
                        g = g.clone()
                        dist.all_reduce(g, group=tp_group)
                    if ".local_experts." in pname and ep > 1:
                        # Every data-parallel replica feeds the same batch here, and each expert
                        # serves the tokens of all of them: its gradient is the sum over the DP
                        # replicas, which megatron's gradient averaging divides by the DP size.
                        g = g / ps.get_data_parallel_world_size()
                    finalised[pname] = g
                    p.data = g
                grads = {n: t.cpu() for n, t in mcore_to_hf(mc, model)}
                for pname, p in model.named_parameters():
                    p.data = weights[pname]
            model.eval()

            exported = {}
            for hf_name, t in mcore_to_hf(mc, model):
                if hf_name in exported:
                    raise AssertionError(f"exported twice: {hf_name}")
                exported[hf_name] = t.cpu()
            if rank == 0:
                from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

                from rlslurm.models.family import family_of, remote_base
                from rlslurm.models.hf_config import load_hf_config

                # MiMo's own classes are remote code: its main model is transformers' Qwen2 (as
                # SGLang's mimo.py builds it on Qwen2Model), loaded from the same files with the
                # config read as rlslurm reads it; the MTP tensors stay unread, as SGLang's
                # MiMoForCausalLM skips them too
                kw = {"config": load_hf_config(hf_dir)} if remote_base(mc.hf_model_type) else {}
                # Qwen3.5: the whole vision-language model (its language model's tensor names), text input
                auto = AutoModelForImageTextToText if family_of(mc.hf_model_type).text_config else AutoModelForCausalLM
                hf = auto.from_pretrained(hf_dir, dtype=torch.float32, **kw).eval()
                with torch.no_grad():
                    ref = hf(ids_cpu).logits
                result["max_abs_logits"] = float((ref - logits).abs().max())
                ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, ids_cpu[:, 1:, None]).squeeze(-1)
                result["max_abs_logprobs"] = float((ref_lp - token_logprobs).abs().max())
                result["ref_logit_scale"] = float(ref.abs().max())
                hf.zero_grad()
                ref_train = hf(ids_cpu).logits
                ref_nll = -torch.log_softmax(ref_train[:, :-1], -1).gather(-1, ids_cpu[:, 1:, None])
                ref_nll.sum().backward()
                hf_grads = _hf_grads(hf, mc.hf_model_type)
                diffs, scale = {}, 0.0
                for n, g in grads.items():
                    if n not in hf_grads:
                        continue  # buffers (router correction bias): no gradient
                    ref_g = hf_grads[n]
                    if ref_g.shape != g.shape:
                        raise AssertionError(f"gradient of {n}: shape {tuple(g.shape)} vs HF {tuple(ref_g.shape)}")
                    diffs[n] = float((ref_g - g).abs().max())
                    scale = max(scale, float(ref_g.abs().max()))
                worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
                result["max_abs_grad"] = worst[0][1]
                result["worst_grads"] = worst
                result["grads_compared"] = len(diffs)
                result["grad_scale"] = scale
                ckpt = HFCheckpoint(hf_dir)
                names = set(ckpt.names())
                result["missing_in_export"] = sorted(names - set(exported))
                result["extra_in_export"] = sorted(set(exported) - names)
                result["not_bit_exact"] = sorted(
                    n for n in names & set(exported)
                    if exported[n].dtype != ckpt.get(n).dtype or not torch.equal(exported[n], ckpt.get(n)))
                result["exported"] = len(exported)
            # last, as it changes the weights: one clipped step, and the loss after it (every layout
            # must take the same step)
            result["step_grad_norm"], result["step_loss"] = _sgd_step_loss(model, finalised, ids, pos,
                                                                           mc.arch.vocab_size)
            result["ok"] = True
        except Exception as e:  # recorded, so one family's failure does not hide the others'
            result["ok"] = False
            result["error"] = "".join(traceback.format_exception(e))[-4000:]
            print(result["error"], file=sys.stderr)
        finally:
            ps.destroy_model_parallel()
        if rank == 0:
            (out / f"{mc.name}.tp{tp}.ep{ep}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlslurm.exit_guard import skip_final_gc_at_exit

    skip_final_gc_at_exit()  # the product roles' exit: seconds of a core saved per torchrun worker
    main()
