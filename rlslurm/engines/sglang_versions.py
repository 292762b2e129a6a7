"""How the SGLang versions of the supported stacks differ, in one place (docs/sglang-versions.md).

The versions are those of rlslurm/stacks.py's STACKS. 0.5.23 is the CPU stack's (rlslurm/engines/sglang_cpu
pins it). 0.5.14 is the GPU stack's: the last SGLang whose pin, torch==2.11.0, is the image's own torch
(docs/gpu.md). Between the two, the
HTTP contract rlslurm uses differs in one place: 0.5.23 wraps a weight update in a session
(/begin_weight_update, /end_weight_update: in-place-quantised weights become loadable between them);
0.5.14 has no such endpoints and needs none for unquantised weights. Everything else rlslurm calls
(/generate, /model_info's weight_version, /pause_generation, /continue_generation,
/init_weights_update_group, /update_weights_from_distributed, /update_weights_from_disk,
/update_weight_version, /destroy_weights_update_group) and every launch flag it sets
(--weight-version, --skip-server-warmup, --max-total-tokens, --api-key) are the same in both.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass

from rlslurm import stacks
from rlslurm.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SGLangAPI:
    version: str
    weight_update_session: bool   # /begin_weight_update + /end_weight_update exist
    cpu_path: bool                # rlslurm's CPU device path runs it (engines/sglang_cpu)


# The oldest supported release with /begin_weight_update and /end_weight_update (0.5.14 has neither).
WEIGHT_UPDATE_SESSION_SINCE = (0, 5, 23)
# The release the CPU path (engines/sglang_cpu) patches.
CPU_PATH = "0.5.23"

SUPPORTED: dict[str, SGLangAPI] = {
    v: SGLangAPI(v, weight_update_session=stacks.release(v) >= WEIGHT_UPDATE_SESSION_SINCE, cpu_path=v == CPU_PATH)
    for v in stacks.sglang_versions()
}
# An engine record written before versions were recorded: the version rlslurm was built against.
DEFAULT = SUPPORTED[CPU_PATH]


@dataclass(frozen=True)
class Renamed:
    """What a release that dropped a launch flag has instead: `new` (None: nothing does the same, and
    `lost` says what a run without it does not have), given `value` where a switch became a flag with
    a value, with `values` translating the old flag's values where they changed. `noop`: the old
    flag did nothing any more, so dropping it loses nothing (`lost` says why)."""
    new: str | None
    value: str | None = None
    values: tuple[tuple[str, str], ...] = ()
    lost: str = ""
    noop: bool = False

    def argv(self, values: list[str]) -> list[str]:
        """The new flag and its values in place of the old flag's `values`."""
        assert self.new is not None
        if self.value is not None:
            return [self.new, self.value]
        table = dict(self.values)
        return [self.new, *(table.get(v, v) for v in values)]


# Launch flags of an older supported SGLang that a newer supported one dropped, keyed by the release
# without them. 0.5.14 registers each old name as a deprecated alias of the new one (its
# srt/server_args.py, "Deprecated argument registrations": `new_flag=`), and already has every new
# name, so the new name is right for both stacks; 0.5.23 knows only the new ones. A table per
# release: a later supported SGLang adds its own.
_CP_MODE = (("in-seq-split", "zigzag"), ("round-robin-split", "interleave"))
RENAMED_FLAGS: dict[str, dict[str, Renamed]] = {
    "0.5.23": {
        "--cuda-graph-bs": Renamed("--cuda-graph-bs-decode"),
        "--cuda-graph-max-bs": Renamed("--cuda-graph-max-bs-decode"),
        "--nsa-prefill-backend": Renamed("--dsa-prefill-backend"),
        "--nsa-decode-backend": Renamed("--dsa-decode-backend"),
        "--mamba-scheduler-strategy": Renamed("--mamba-radix-cache-strategy"),
        "--stream-output": Renamed("--incremental-streaming-output"),
        "--speculative-dflash-draft-window-size": Renamed("--speculative-draft-window-size"),
        "--piecewise-cuda-graph-tokens": Renamed("--cuda-graph-bs-prefill"),
        "--piecewise-cuda-graph-max-tokens": Renamed("--cuda-graph-max-bs-prefill"),
        "--enable-breakable-cuda-graph": Renamed("--cuda-graph-backend-prefill", value="breakable"),
        "--disable-piecewise-cuda-graph": Renamed("--cuda-graph-backend-prefill", value="disabled"),
        "--enforce-piecewise-cuda-graph": Renamed("--cuda-graph-backend-prefill", value="tc_piecewise"),
        "--enable-dsa-prefill-context-parallel": Renamed("--enable-prefill-cp"),
        "--enable-nsa-prefill-context-parallel": Renamed("--enable-prefill-cp"),
        "--enable-prefill-context-parallel": Renamed("--enable-prefill-cp"),
        "--dsa-prefill-cp-mode": Renamed("--cp-strategy", values=_CP_MODE),
        "--nsa-prefill-cp-mode": Renamed("--cp-strategy", values=_CP_MODE),
        "--prefill-cp-mode": Renamed("--cp-strategy", values=_CP_MODE),
        "--piecewise-cuda-graph-compiler": Renamed(None, lost="the choice of compiler (eager or inductor) for "
                                                              "piecewise CUDA graphs: SGLang 0.5.23 has no such flag"),
        "--prefill-round-robin-balance": Renamed(None, lost="0.5.14 already took it as a no-op", noop=True),
        "--collect-tokens-histogram": Renamed(None, lost="SGLang collects token histograms with --enable-metrics",
                                              noop=True),
    },
}


def renamed_flag(flag: str, version: str | None) -> Renamed | None:
    """What SGLang `version` (the installed one) has for `flag`, a launch flag it dropped; None when
    the table does not list it."""
    return RENAMED_FLAGS.get(version or "", {}).get(flag)


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


_release = stacks.release


def nearest_tested(version: str) -> SGLangAPI:
    """The API rlslurm assumes for an untested version: the newest tested release not newer than it
    (an older one has fewer endpoints, and rlslurm calls only what that one has), else the oldest."""
    tested = sorted(SUPPORTED.values(), key=lambda a: _release(a.version))
    below = [a for a in tested if _release(a.version) <= _release(version)]
    return below[-1] if below else tested[0]


def api_for(version: str | None) -> SGLangAPI:
    """The API of an engine that reported `version` (None: an older record, DEFAULT). An untested
    version could only have started with --allow-untested-sglang (check_gpu_sglang): its API is
    the nearest tested one's."""
    if version is None:
        return DEFAULT
    return SUPPORTED.get(version) or nearest_tested(version)


def gpu_install_hint() -> str:
    """How to install the SGLang of each stack that has run on GPUs (its pyproject extra)."""
    return " or ".join(f"pip install -c {s.constraints} 'rlslurm[{s.sglang_extra}]' (SGLang {s.sglang})"
                       for s in stacks.STACKS if s.sglang_extra)


def check_gpu_sglang(allow_untested: bool = False) -> SGLangAPI:
    """Before starting a GPU engine: the installed SGLang's API. A version of no supported stack needs
    --allow-untested-sglang (or --allow-untested-stack), which goes on with a warning and the nearest
    tested version's API. (Whether the rest of the node's stack is supported is the rollout's check at
    its start: rlslurm/stacks.py check_role.)"""
    found = installed_sglang_version()
    if found in SUPPORTED:
        return SUPPORTED[found]
    if found is None:
        raise ConfigError(f"rollout device cuda: SGLang is not installed; {gpu_install_hint()} "
                          f"(docs/sglang-versions.md)")
    if not allow_untested:
        raise ConfigError(f"rollout device cuda: SGLang is {found}, not a tested version ({', '.join(SUPPORTED)}); "
                          f"{gpu_install_hint()}, or --allow-untested-sglang to try it (docs/sglang-versions.md)")
    api = nearest_tested(found)
    log.warning("SGLang %s is not a tested version (%s); going on as --allow-untested-sglang asks, with SGLang "
                "%s's API (docs/sglang-versions.md)", found, ", ".join(SUPPORTED), api.version)
    return api
