"""rlslurm.models.cpu_shim on this CPU-only machine. Runs in a subprocess: the shim changes
process-wide torch state (a TorchFunctionMode), which must not leak into other tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from convert_helpers import REPO

pytestmark = pytest.mark.megatron

PROBE = r"""
import json, torch
import torch.distributed as dist
from rlslurm.models import cpu_shim
r = {}
cpu_shim.apply(); first = cpu_shim.applied(); cpu_shim.apply()
r["applied"] = first; r["idempotent"] = cpu_shim.applied() == first
r["zeros_device"] = str(torch.zeros(2, device="cuda").device)
r["cuda_call"] = str(torch.ones(1).cuda().device)
r["to_cuda"] = str(torch.ones(1).to("cuda:0").device)
r["type"] = torch.ones(1).type()
r["pinned"] = torch.empty(2, pin_memory=True).is_pinned()
import megatron.core.transformer.moe.moe_utils as mu, megatron.core.transformer.multi_latent_attention as mla
r["te_general_gemm"] = repr(mu.te_general_gemm); r["mla_have_te"] = mla.HAVE_TE
# the tracker must work: seed, fork, and fork restores the outer state
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % __PORT__, rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, get_cuda_rng_tracker
ps.initialize_model_parallel(1)
model_parallel_cuda_manual_seed(7)
torch.manual_seed(0); outer = torch.rand(1).item(); torch.manual_seed(0)
with get_cuda_rng_tracker().fork():
    a = torch.rand(1).item()
r["outer_restored"] = torch.rand(1).item() == outer
model_parallel_cuda_manual_seed(7)
with get_cuda_rng_tracker().fork():
    b = torch.rand(1).item()
r["fork_reproducible"] = a == b and a != outer
print("RESULT" + json.dumps(r))
"""


def test_cpu_shim_patches_what_megatron_needs():
    if torch.cuda.is_available():
        pytest.skip("the shim is a no-op with CUDA")
    from rlslurm.net import free_port

    code = PROBE.replace("__PORT__", str(free_port()))
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.split("RESULT", 1)[1])
    assert {"current_device", "synchronize", "rng", "cuda_mode"} <= set(r["applied"])
    assert r["idempotent"]
    assert r["zeros_device"] == r["cuda_call"] == r["to_cuda"] == "cpu"
    assert r["type"] == "torch.cuda.FloatTensor"
    assert r["pinned"] is False
    assert r["te_general_gemm"] == "None" and r["mla_have_te"] is False
    assert r["outer_restored"] and r["fork_reproducible"]


def test_without_apply_nothing_is_patched():
    p = subprocess.run([sys.executable, "-c", "import torch; from rlslurm.models import cpu_shim; "
                        "print(cpu_shim.applied(), torch.cuda.current_device.__module__)"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[0] == "[]" and "torch.cuda" in p.stdout
