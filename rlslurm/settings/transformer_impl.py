"""--transformer-impl: which layer implementation the trainer builds the model with (docs/transformer-engine.md).

`local` (the default) is megatron-core's own modules with rlslurm's extensions (models/build.py): the
implementation every test and every GPU run of rlslurm has used. `transformer_engine` is
transformer-engine's layer spec, taken only when asked for: it has not run in rlslurm's tests or on its
GPUs, and an importable transformer-engine does not choose it.

`te_refusal` says in one line why `transformer_engine` cannot run here: --device cpu (transformer-engine
has no CPU kernels), transformer-engine not installed, or a version outside the range the installed
megatron-core declares for it (its package metadata). resolve() asks it where the job runs this Python
environment (rlslurm/preflight.py job_env_is_ours), the trainer always (models/build.py). No torch here:
the version comes from package metadata, and only `import_it` (the trainer) imports transformer-engine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from typing import Literal

TransformerImpl = Literal["local", "transformer_engine"]
LOCAL: TransformerImpl = "local"
TE: TransformerImpl = "transformer_engine"
FLAG = "--transformer-impl"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_te_requirement() -> tuple[str, str] | None:
    """(megatron-core's version, the version specifier it declares for transformer-engine: "" for any),
    from megatron-core's package metadata (0.16.1: `>=2.9.0a0,<2.12.0`, its `dev` extra; 0.19.2: none,
    its `te` extra); None when megatron-core is not installed or declares no transformer-engine."""
    mcore = _version("megatron-core")
    if mcore is None:
        return None
    specs = []
    for req in importlib.metadata.requires("megatron-core") or []:
        m = re.match(r"\s*transformer[-_]engine\s*(\[[^\]]*\])?\s*([^;]*)", req, re.I)
        if m:
            specs.append(m.group(2).strip().strip("()"))
    if not specs:
        return None
    # several extras may name it: the narrowest (non-empty) one is what megatron-core was tested with
    return mcore, max(specs, key=len)


def te_refusal(impl: str, *, device: str, import_it: bool = False) -> str | None:
    """Why --transformer-impl `impl` cannot run in this Python environment, or None (always None for local)."""
    if impl != TE:
        return None
    if device == "cpu":
        return f"{FLAG} {TE} with --device cpu: transformer-engine has no CPU kernels; use {FLAG} {LOCAL}"
    if importlib.util.find_spec("transformer_engine") is None:
        return (f"{FLAG} {TE}: transformer-engine is not installed in this Python environment "
                f"(pip install 'rlslurm[te]'), or use {FLAG} {LOCAL}, the default")
    have = _version("transformer-engine") or _version("transformer-engine-torch")
    req = megatron_te_requirement()
    if have is not None and req is not None and req[1]:
        from packaging.specifiers import SpecifierSet

        if not SpecifierSet(req[1], prereleases=True).contains(have, prereleases=True):
            return (f"{FLAG} {TE}: transformer-engine {have} is outside what megatron-core {req[0]} supports "
                    f"(transformer-engine{req[1]}); install a version in that range or use {FLAG} {LOCAL}")
    if import_it:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as e:  # a broken install (CUDA libraries, torch ABI) shows only here
            cause = " ".join(str(e).split())[:300]
            return f"{FLAG} {TE}: transformer-engine {have or ''} does not import: {type(e).__name__}: {cause}"
    return None
