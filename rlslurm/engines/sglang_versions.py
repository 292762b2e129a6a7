"""The SGLang versions rlslurm supports and every way they differ, in one place (docs/sglang-versions.md).

0.5.23 is the CPU/CI version (rlslurm/engines/sglang_cpu pins it). 0.5.14 is the GPU machines' version:
the last SGLang whose pin, torch==2.11.0, is the image's own torch (docs/gpu.md). Between the two, the
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
from dataclasses import dataclass

from rlslurm.errors import ConfigError


@dataclass(frozen=True)
class SGLangAPI:
    version: str
    weight_update_session: bool   # /begin_weight_update + /end_weight_update exist
    cpu_path: bool                # rlslurm's CPU device path runs it (engines/sglang_cpu)


SUPPORTED: dict[str, SGLangAPI] = {
    "0.5.14": SGLangAPI("0.5.14", weight_update_session=False, cpu_path=False),
    "0.5.23": SGLangAPI("0.5.23", weight_update_session=True, cpu_path=True),
}
# An engine record written before versions were recorded: the version rlslurm was built against.
DEFAULT = SUPPORTED["0.5.23"]


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def api_for(version: str | None) -> SGLangAPI:
    """The API of an engine that reported `version` (None: an older record, DEFAULT)."""
    if version is None:
        return DEFAULT
    try:
        return SUPPORTED[version]
    except KeyError:
        raise ConfigError(f"SGLang {version} is not supported by rlslurm (supported: {', '.join(SUPPORTED)})") from None


def check_gpu_sglang() -> SGLangAPI:
    """Before starting a GPU engine: the installed SGLang is one rlslurm knows the API of."""
    found = installed_sglang_version()
    if found not in SUPPORTED:
        what = "is not installed" if found is None else f"is {found}"
        raise ConfigError(f"rollout device cuda: SGLang {what}; rlslurm supports sglang "
                          f"{' or '.join(SUPPORTED)} (pip install 'rlslurm[sglang]', or docs/gpu.md)")
    return SUPPORTED[found]
