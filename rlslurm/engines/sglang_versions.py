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
import logging
import re
from dataclasses import dataclass

from rlslurm.errors import ConfigError

log = logging.getLogger(__name__)


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


# pip extras that install each tested version on GPU machines (pyproject.toml; docs/sglang-versions.md)
EXTRAS = {"0.5.23": "rlslurm[sglang]", "0.5.14": "rlslurm[sglang-torch211]"}


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.5.20.post1" -> (0, 5, 20); () if it has none."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


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


def check_gpu_sglang(allow_untested: bool = False) -> SGLangAPI:
    """Before starting a GPU engine: the installed SGLang is a tested one, or --allow-untested-sglang
    says to go on with a warning and the nearest tested version's API."""
    found = installed_sglang_version()
    if found in SUPPORTED:
        return SUPPORTED[found]
    install = " or ".join(f"pip install '{EXTRAS[v]}' (SGLang {v})" for v in SUPPORTED)
    if found is None:
        raise ConfigError(f"rollout device cuda: SGLang is not installed; {install} (docs/sglang-versions.md)")
    if not allow_untested:
        raise ConfigError(f"rollout device cuda: SGLang is {found}, not a tested version ({', '.join(SUPPORTED)}); "
                          f"{install}, or --allow-untested-sglang to try it (docs/sglang-versions.md)")
    api = nearest_tested(found)
    log.warning("SGLang %s is not a tested version (%s); going on as --allow-untested-sglang asks, with SGLang "
                "%s's API (docs/sglang-versions.md)", found, ", ".join(SUPPORTED), api.version)
    return api
