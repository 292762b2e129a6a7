"""The trainer's end of a weight-update group against SGLang's own receiver code.

The receivers run `sglang.srt.utils.common.init_custom_process_group` (what an engine's
`/init_weights_update_group` runs) and receive the way `/update_weights_from_distributed` does,
so a store-prefix or backend mismatch in `SyncGroup` shows up here as a join that never happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlslurm.errors import ConfigError
from rlslurm.net import free_port
from rlslurm.trainer.weights.group import GroupSpec, SyncGroup, SyncGroupError, flatten_bucket, iter_buckets

HERE = Path(__file__).parent
REPO = HERE.parents[1]


@pytest.mark.parametrize("kw, msg", [
    ({"world_size": 1}, "world size 1 < 2"),
    ({"backend": "mpi"}, "backend must be gloo or nccl"),
    ({"group_name": ""}, "must not be empty"),
])
def test_group_spec_rejects(kw, msg):
    base = dict(master_addr="127.0.0.1", master_port=29999, world_size=3, group_name="g", backend="gloo",
                timeout_s=5.0)
    with pytest.raises(ConfigError, match=msg):
        GroupSpec(**{**base, **kw})


@pytest.mark.sglang
def test_a_flattened_bucket_is_what_the_engine_views_back():
    """The installed SGLang's own receive bucket (FlattenedTensorBucket.empty, what an engine told
    load_format=flattened_bucket allocates), filled with our bytes, gives back every tensor exactly:
    one dtype per bucket, as iter_buckets(one_dtype=True) makes them."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    g = torch.Generator().manual_seed(0)
    stream = [("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
              ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
              ("c", torch.randn(2, 3, generator=g)), ("d", torch.tensor(1.5)),
              ("e", torch.randn(4, 1, generator=g).half())]
    buckets = list(iter_buckets(stream, 1 << 20, torch.device("cpu"), one_dtype=True))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c", "d"], ["e"]]
    for bucket in buckets:
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        recv = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        flat = flatten_bucket([t for _, t in bucket])
        assert flat.dtype == torch.uint8 and flat.shape == recv.get_flattened_tensor().shape
        recv.get_flattened_tensor().copy_(flat)
        got = dict(recv.reconstruct_tensors())
        for n, t in bucket:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    # without one_dtype a size-bound bucket mixes them
    assert [[n for n, _ in b] for b in iter_buckets(stream, 1 << 20, torch.device("cpu"))] == [list("abcde")]


def test_join_without_engines_times_out_within_bound():
    port = free_port()
    g = SyncGroup(GroupSpec("127.0.0.1", port, 2, "lonely", "gloo", 2.0)).open()
    t0 = time.monotonic()
    with pytest.raises(SyncGroupError, match=rf"'lonely' on 127.0.0.1:{port}: engines did not join within 2 s"):
        g.join()
    assert time.monotonic() - t0 < 10
    g.close()
    # The port is free again: a rebuild can host a new store (here on the same port).
    SyncGroup(GroupSpec("127.0.0.1", port, 2, "again", "gloo", 1.0)).open().close()


def _receiver(port: int, rank: int, world: int, group: str, buckets: list, *, stall_at: int = -1) -> subprocess.Popen:
    from rlslurm.engines.sglang_cpu import cpu_env

    env = cpu_env(dict(os.environ, PYTHONPATH=str(REPO)))
    return subprocess.Popen([sys.executable, str(HERE / "sglang_receiver.py"), str(port), str(rank), str(world),
                             group, json.dumps(buckets), "--stall-at", str(stall_at)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.sglang
def test_sglang_receivers_get_the_tensors_and_a_stalled_one_is_bounded():
    from rlslurm.engines import sglang_cpu

    if sglang_cpu.installed_sglang_version() is None:
        pytest.skip("sglang is not installed (tools/install.sh installs it)")
    # Bucket 1 and 2 are larger than a socket buffer, so a receiver that never reads blocks the sender.
    big = [4 * 1024 * 1024]
    buckets = [[[3, 4], [5], [2, 2, 2]], [big], [big]]
    port = free_port()
    g = SyncGroup(GroupSpec("127.0.0.1", port, 3, "wsync-test", "gloo", 180.0)).open()
    procs = [_receiver(port, 1, 3, "wsync-test", buckets), _receiver(port, 2, 3, "wsync-test", buckets, stall_at=1)]
    try:
        g.join()  # the receivers import sglang first (~20 s on a loaded 2-core box)
        gen = torch.Generator().manual_seed(7)
        first = [torch.randn(s, generator=gen) for s in buckets[0]]
        g.broadcast(first)
        t0 = time.monotonic()
        with pytest.raises(SyncGroupError, match="failed or timed out"):
            g.broadcast([torch.ones(big)], timeout_s=3.0)
            g.broadcast([torch.ones(big)], timeout_s=3.0)
        assert time.monotonic() - t0 < 3.0 * 2 + 10
        g.close()
        # Closing our end releases a receiver still blocked in the group: it fails instead of
        # waiting for its own 30-minute default.
        out1, err1 = procs[0].communicate(timeout=60)
        lines = [json.loads(x) for x in out1.splitlines()]
        assert lines[0] == {"joined": True}
        assert lines[1]["bucket"] == 0
        assert lines[1]["sums"] == pytest.approx([float(t.double().sum()) for t in first], rel=1e-6)
        assert procs[0].returncode == 3, (out1, err1[-2000:])
        assert "error" in lines[-1]
    finally:
        g.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


_GIVEN_UP_JOIN = r"""
import sys, time
from rlslurm import exit_guard
from rlslurm.net import free_port
from rlslurm.trainer.weights.group import GroupSpec, SyncCancelled, SyncGroup
from rlslurm.user_error import run_dir_arg, run_role

class SlowTeardown:  # finalization still going when the join's wait times out (3 s)
    def __del__(self, _sleep=time.sleep):
        _sleep(5)

def main(argv):
    t0 = time.monotonic()
    g = SyncGroup(GroupSpec("127.0.0.1", free_port(), 2, "g", "gloo", 3.0)).open()
    try:
        g.join(cancel=lambda: time.monotonic() - t0 > 0.5)
    except SyncCancelled:
        print("given up", len(exit_guard.still_blocked()), flush=True)
    g.close()
    return 7

keep = SlowTeardown()
if sys.argv[1] == "role":
    run_role("trainer", main, run_dir_arg)
sys.exit(main(None))
"""


def test_a_join_given_up_at_the_end_does_not_abort_the_exit():
    """CI, stop 40: all tests passed, then pytest died with SIGABRT (exit 134). A join given up by a
    cancel stays blocked in c10d until its timeout; waking while Python finalizes aborts the process
    (3.11). A role's exit (user_error.run_role) steps around it: the status main() returns is the
    status the job sees. The same script exiting plainly aborts, which is what makes this a test."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = {how: subprocess.Popen([sys.executable, "-c", _GIVEN_UP_JOIN, how], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for how in ("role", "plain")}
    runs = {}
    for how, p in procs.items():  # both at once: each waits out the join's timeout and a slow teardown
        out, err = p.communicate(timeout=120)
        runs[how] = (p.returncode, out, err)
    for rc, out, err in runs.values():
        assert out.startswith("given up 1"), out + err
    assert runs["role"][0] == 7, runs["role"][2][-2000:]
    assert runs["plain"][0] == -6, runs["plain"][2][-2000:]  # SIGABRT: the exposure is real
