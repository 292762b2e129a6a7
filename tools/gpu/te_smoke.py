"""On the GPU machine, after staging the transformer-engine part (tools/gpu/build-te-part.sh, docs/gpu.md):
does TE load and compute here? A bf16 te.Linear and te.LayerNormLinear forward and backward, each compared
with the same maths in plain torch, and the versions and libraries TE found. Prints one JSON line; exit 1
on a failure, with its cause in the line.

    . tools/gpu/env.sh && python3 tools/gpu/te_smoke.py
"""

from __future__ import annotations

import json
import sys
import traceback


def main() -> int:
    rec: dict = {}
    try:
        import torch
        import transformer_engine
        import transformer_engine.pytorch as te

        rec["te"] = transformer_engine.__version__
        rec["torch"] = torch.__version__
        rec["gpu"] = torch.cuda.get_device_name(0)
        torch.manual_seed(0)
        x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        lin = te.Linear(1024, 2048, bias=True, params_dtype=torch.bfloat16)
        y = lin(x)
        y.float().square().mean().backward()
        ref_x = x.detach().clone().requires_grad_(True)
        ref = torch.nn.functional.linear(ref_x, lin.weight.detach(), lin.bias.detach())
        ref.float().square().mean().backward()
        rec["linear_max_abs_diff"] = float((y - ref).abs().max())
        rec["linear_grad_max_abs_diff"] = float((x.grad - ref_x.grad).abs().max())

        ln = te.LayerNormLinear(1024, 512, normalization="RMSNorm", params_dtype=torch.bfloat16)
        z = ln(x.detach())
        ref_z = torch.nn.functional.linear(
            torch.nn.functional.rms_norm(x.detach().float(), (1024,), ln.layer_norm_weight.float(), ln.eps)
            .to(torch.bfloat16), ln.weight.detach())
        rec["rmsnorm_linear_max_abs_diff"] = float((z - ref_z).abs().max())
        torch.cuda.synchronize()
        ok = all(rec[k] < 0.1 for k in rec if k.endswith("diff"))
        rec["ok"] = ok
    except Exception as e:  # the point is to say what failed, in one line
        rec["ok"] = False
        rec["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    print(json.dumps(rec), flush=True)
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
