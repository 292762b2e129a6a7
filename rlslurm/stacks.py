"""The supported stacks: the versions of torch, megatron-core, SGLang and transformer-engine that have
run together, each one a constraints file of the repository (docs/supported-stacks.md).

Every check of what is installed reads `STACKS`: `rlslurm --version` and `rlslurm doctor`, submit
(rlslurm/preflight.py check_stack, where the job runs this host's environment) and each role at its
start (`check_role`: trainer, rollout, convert), where anything outside them is one line (a user error:
the job ends without requeue) unless --allow-untested-stack says to go on with a warning. SGLang's API
per version (engines/sglang_versions.py) and the tests that compare this list with constraints/*.txt
and pyproject.toml's extras read it too.

Supported means: every component a role runs is installed at the version of one listed stack, the
same stack for all of them. A role checks only what it runs: the trainer and a conversion torch and
megatron-core (and transformer-engine when the trainer would use it); the rollout torch and SGLang, and
only when it starts engines. Local version labels do not count (torch 2.11.0+cu130 and 2.11.0+cpu are
both 2.11.0). transformers and sglang-router are pinned by the constraints files and printed, not
checked: SGLang pins its own transformers.

Reads package metadata only: nothing here imports torch (a login node may have none).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
from dataclasses import dataclass

from rlslurm.errors import ConfigError

log = logging.getLogger(__name__)

DOC = "docs/supported-stacks.md"


@dataclass(frozen=True)
class Stack:
    name: str
    constraints: str             # the file that pins it, relative to the repository root
    python: str                  # the Python it ran on
    measured: str                # where and how it ran
    install: str                 # how to install it
    torch: str
    megatron_core: str
    sglang: str
    sglang_router: str
    transformers: str
    # transformer-engine releases that have run with it: none yet (docs/supported-stacks.md)
    transformer_engine: tuple[str, ...] = ()
    sglang_extra: str | None = None  # the pyproject.toml extra that installs its SGLang, where one does

    def version(self, component: str) -> str | None:
        return {"torch": self.torch, "megatron-core": self.megatron_core, "sglang": self.sglang,
                "sglang-router": self.sglang_router, "transformers": self.transformers}.get(component)


STACKS: tuple[Stack, ...] = (
    Stack("cpu", "constraints/cpu.txt", python="3.11",
          measured="CPU: CI, the test suite and the demo (fresh Debian 12, no GPU)",
          install="bash tools/install.sh",
          torch="2.13.0", megatron_core="0.16.1", sglang="0.5.23", sglang_router="0.3.2", transformers="5.19.0"),
    Stack("gpu-torch211", "constraints/gpu-torch211.txt", python="3.12",
          measured="H100/H200 with torch 2.11.0+cu130: the GPU tier (tests/gpu, docs/gpu.md); its trainer half is "
                   "also CI's second environment (CPU)",
          install="pip install -c constraints/gpu-torch211.txt '.[train,rollout,sglang-torch211]'",
          torch="2.11.0", megatron_core="0.19.2", sglang="0.5.14", sglang_router="0.3.2", transformers="5.8.1",
          sglang_extra="sglang-torch211"),
)
BY_NAME = {s.name: s for s in STACKS}

# The components of a stack, by distribution name; CHECKED are those a role's check compares.
COMPONENTS = ("torch", "megatron-core", "sglang", "sglang-router", "transformers", "transformer-engine")
CHECKED = ("torch", "megatron-core", "sglang", "transformer-engine")


def sglang_versions() -> list[str]:
    """The SGLang releases of the listed stacks (engines/sglang_versions.py builds its API table from these)."""
    return sorted({s.sglang for s in STACKS}, key=release)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.11.0+cu130" -> (2, 11, 0); () if it has none."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def same_release(installed: str, listed: str) -> bool:
    """An installed version is a listed one: equal but for a local label (+cu130, +cpu)."""
    return installed.split("+", 1)[0] == listed


# ------------------------------------------------------------------------------------ what is installed


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_version(component: str) -> str | None:
    """The installed version of a component (package metadata; never imported). transformer-engine
    importable without metadata (built from source) is "unknown"."""
    version = _dist_version(component)
    if component == "transformer-engine" and version is None:
        version = _dist_version("transformer-engine-torch")
        if version is None and importlib.util.find_spec("transformer_engine") is not None:
            version = "unknown"
    return version


def installed() -> dict[str, str | None]:
    return {c: installed_version(c) for c in COMPONENTS}


def trainer_uses_te(cfg=None) -> bool:
    """Whether the trainer builds its layers with transformer-engine: only when the run asks for it
    (--transformer-impl transformer_engine, rlslurm/settings/transformer_impl.py); an installed TE is
    otherwise not used, and not a checked component."""
    from rlslurm.settings.transformer_impl import TE

    return cfg is not None and cfg.train.transformer_impl == TE


# ------------------------------------------------------------------------------------ roles


@dataclass(frozen=True)
class Verdict:
    """What a role (or a whole node) runs against the stacks."""

    components: tuple[str, ...]       # what it runs, of CHECKED
    found: dict[str, str | None]      # installed versions of those
    stack: Stack | None               # the supported stack they all match, if any
    missing: tuple[str, ...] = ()     # needed and not installed
    why: str = ""                     # why no stack matches (one clause), when stack is None

    @property
    def supported(self) -> bool:
        return self.stack is not None


def needs(role: str, *, engines: bool = True, te: bool | None = None) -> tuple[str, ...]:
    """The checked components a role runs: the trainer and a conversion torch and megatron-core (and
    transformer-engine when it would be used), the rollout torch and SGLang when it starts engines
    (none otherwise: the engine-free rollout functions need neither)."""
    te = trainer_uses_te() if te is None else te
    if role in ("trainer", "convert"):
        return ("torch", "megatron-core") + (("transformer-engine",) if te else ())
    if role == "rollout":
        return ("torch", "sglang") if engines else ()
    if role == "node":  # everything a node of both groups runs
        return needs("trainer", te=te) + ("sglang",)
    raise ValueError(f"unknown role {role!r}")


def _listed(stack: Stack, component: str) -> tuple[str, ...]:
    if component == "transformer-engine":
        return stack.transformer_engine
    v = stack.version(component)
    return (v,) if v else ()


# Needed by every role at any version: the trainer reads config.json and the rollout driver its tokenizer
# with it (the checkpoint checks at submit read config.json without it only where the job runs another
# environment: models/hf_config.py load_hf_config).
PRESENT = ("transformers",)


def judge(components: tuple[str, ...], found: dict[str, str | None] | None = None,
          present: tuple[str, ...] = ()) -> Verdict:
    """The stack all `components` match at their installed versions, or why none does; `present` must
    be installed at any version."""
    everything = installed() if found is None else found
    found = {c: everything.get(c) for c in (*components, *present)}
    missing = tuple(c for c in found if found[c] is None)
    if missing:
        return Verdict(components, found, None, missing, f"{' and '.join(missing)} not installed")
    if not components:  # nothing whose version counts (a rollout without engines)
        return Verdict(components, found, None)
    fits = {c: [s for s in STACKS if any(same_release(found[c], v) for v in _listed(s, c))]  # type: ignore[arg-type]
            for c in components}
    stack = next((s for s in STACKS if all(s in fits[c] for c in components)), None)
    if stack is not None:
        return Verdict(components, found, stack)
    problems = tuple(c for c in components if not fits[c])
    if problems:
        why = "; ".join(_not_listed(c, found[c]) for c in problems)  # type: ignore[arg-type]
    else:  # each is some stack's, but not the same one's
        why = "a mix of " + " and ".join(f"{c} {found[c]} (stack {', '.join(s.name for s in fits[c])})"
                                         for c in components)
    return Verdict(components, found, None, (), why)


def _not_listed(component: str, version: str) -> str:
    if component == "transformer-engine":
        return (f"transformer-engine {version} is installed and the trainer would use it, but no supported stack "
                "has run with transformer-engine")
    listed = ", ".join(sorted({v for s in STACKS for v in _listed(s, component)}, key=release))
    return f"{component} {version} is not a supported version ({listed})"


def describe(stack: Stack, components: tuple[str, ...] = CHECKED) -> str:
    """`stack gpu-torch211: torch 2.11.0, megatron-core 0.19.2, ...`."""
    parts = [f"{c} {v}" for c in components if c != "transformer-engine" and (v := stack.version(c))]
    if "transformer-engine" in components:
        parts.append("no transformer-engine" if not stack.transformer_engine
                     else f"transformer-engine {'/'.join(stack.transformer_engine)}")
    return f"stack {stack.name}: {', '.join(parts)}"


def unsupported_message(who: str, verdict: Verdict) -> str:
    """One line: what is installed, what is supported, how to get a supported stack."""
    supported = "; ".join(describe(s, verdict.components) for s in STACKS) if verdict.components else ""
    fix = f"install a supported stack with its constraints file ({DOC})" + (f": {supported}" if supported else "")
    if verdict.missing:
        names = verdict.missing
        listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
        return f"{who}: {listed} {'are' if len(names) > 1 else 'is'} not installed; {fix}"
    shown = [c for c in verdict.components if c != "transformer-engine" or verdict.found[c]]
    installed_text = ", ".join(f"{c} {verdict.found[c]}" for c in shown)
    return (f"{who}: installed {installed_text}: not a supported stack ({verdict.why}); supported: {supported}; "
            f"install one with its constraints file ({DOC}), or --allow-untested-stack to try it")


ALLOW_FLAG = "--allow-untested-stack"


def check_role(role: str, *, allow_untested: bool, engines: bool = True, te: bool | None = None,
               found: dict[str, str | None] | None = None, warnings: list[str] | None = None) -> Stack | None:
    """At a role's start (and at submit, for the roles of a job that runs this environment): its
    components are one supported stack's, or a ConfigError (one line; in a role a user error: no
    requeue). A component missing is always an error; an untested version or mix is a warning with
    `allow_untested` (--allow-untested-stack), logged or added to `warnings`. Returns the stack (None:
    untested, or nothing to check)."""
    verdict = judge(needs(role, engines=engines, te=te), found, PRESENT)
    if verdict.supported or not (verdict.components or verdict.missing):
        return verdict.stack
    msg = unsupported_message(f"{role} stack", verdict)
    if verdict.missing or not allow_untested:
        raise ConfigError(msg)
    warning = f"{msg.split('; supported:')[0]}; going on as {ALLOW_FLAG} asks"
    if warnings is None:
        log.warning("%s", warning)
    else:
        warnings.append(warning)
    return None


def check_run_role(role: str, cfg, *, model=None, warnings: list[str] | None = None) -> Stack | None:
    """`check_role` for a role of a run, with its flags: the rollout runs torch and SGLang only when it
    starts engines (settings/layout.py no_engines_reason; `model` at submit, before RUN/hf_init exists),
    and --allow-untested-sglang covers it too."""
    if role == "rollout":
        from rlslurm.settings.layout import no_engines_reason

        return check_role("rollout", engines=no_engines_reason(cfg, model) is None, warnings=warnings,
                          allow_untested=cfg.run.allow_untested_stack or cfg.rollout.allow_untested_sglang)
    return check_role(role, allow_untested=cfg.run.allow_untested_stack, warnings=warnings,
                      te=trainer_uses_te(cfg))


def check_convert_args(args: list[str]) -> list[str]:
    """A checkpoint conversion (`rlslurm convert`, `python -m rlslurm.convert`) runs the trainer's
    components: checked before the converter imports torch (not for --help). Returns `args` without
    --allow-untested-stack, which the converter's own parser does not take."""
    rest = [a for a in args if a != ALLOW_FLAG]
    if "--help" not in rest and "-h" not in rest and rest:
        check_role("convert", allow_untested=len(rest) < len(args))
    return rest
