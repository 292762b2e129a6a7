"""slime's environment for its processes -> rlslurm's `--env` / `--secret-env`.

slime's scripts give train.py's processes their environment two ways: the `env_vars` of `ray job
submit --runtime-env-json` (CUDA_DEVICE_MAX_CONNECTIONS, the reproducibility recipe's
CUBLAS_WORKSPACE_CONFIG, NCCL_ALGO and NVTE_ALLOW_NONDETERMINISTIC_ALGO, ...), and `export`s before
the script's own `ray start`, which the Ray cluster it starts inherits. Both become `--env NAME=VALUE`
(the runtime env winning where both name a variable), except the variables below, which rlslurm sets
itself or which belong to Ray; a secret-looking name becomes `--secret-env NAME`, its value never
printed. Every variable gets a line: carried, or not carried and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlslurm.secret_env import looks_secret
from rlslurm.settings.placeholder import names as placeholder_names, placeholder
from rlslurm.slime_import.bash import Script, Unresolved

_RENDEZVOUS = "rlslurm's job sets the trainer's rendezvous itself (torchrun on the first trainer node)"
_PROXY = ("rlslurm's engines and router add the job's own hosts to no_proxy/NO_PROXY themselves "
          "(engines/engine.py); the rest of the proxy settings come from the submitting environment")
_RAY = "Ray's own; rlslurm runs no Ray"
_GPUS = "SLURM gives each step its GPUs and rlslurm places its processes on them"
# Variables rlslurm sets itself, or that only Ray reads: never carried, each with why.
SET_BY_RLSLURM: dict[str, str] = {
    "PYTHONPATH": ("slime's Megatron-LM checkout (and slime's own directories); rlslurm runs the megatron-core "
                   "of its installed stack (docs/supported-stacks.md), which a PYTHONPATH to a checkout would "
                   "shadow; plugins are named module:attr or file.py:attr (docs/slime-plugins.md)"),
    "MASTER_ADDR": _RENDEZVOUS, "MASTER_PORT": _RENDEZVOUS,
    "no_proxy": _PROXY, "NO_PROXY": _PROXY,
    "RAY_ADDRESS": _RAY, "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": _RAY, "DASHBOARD_PORT": _RAY,
    "HEAD_NODE_ADDRESS": _RAY,
    "CUDA_VISIBLE_DEVICES": _GPUS, "HIP_VISIBLE_DEVICES": _GPUS,
}
# Variables slime's scripts compute on the node they run on, where the library's own default detects
# the same: not carried when their value is not known here (with --var it is carried).
DETECTED: dict[str, str] = {
    "NCCL_NVLS_ENABLE": ("the script computes it from `nvidia-smi topo -m` where it runs; unset, NCCL enables "
                         "NVLink SHARP by itself where the nodes have it"),
}
# slime's INT4 fake-QAT switches: reported on a line of their own (slime_import/__init__.py)
FAKE_QAT_PREFIX = "OPEN_TRAINING_INT4_"


@dataclass
class Carried:
    argv: list[str] = field(default_factory=list)
    notes: list[tuple[int, str]] = field(default_factory=list)
    dropped: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[tuple[int, str]] = field(default_factory=list)


def _runtime_env(sc: Script, out: Carried) -> dict[str, tuple[int, str]]:
    if sc.runtime_env is None:
        return {}
    line, text, why = sc.runtime_env
    if text is None:
        out.warnings.append((line, f"--runtime-env-json: its value is not known here ({why}); none of its "
                                   "variables is carried"))
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        out.warnings.append((line, f"--runtime-env-json is not JSON ({e.msg} at character {e.pos}); none of its "
                                   "variables is carried"))
        return {}
    env = data.get("env_vars") if isinstance(data, dict) else None
    other = sorted(k for k in (data if isinstance(data, dict) else {}) if k != "env_vars")
    if other:
        out.dropped.append((line, f"--runtime-env-json {', '.join(other)}: Ray's runtime environment "
                                  "(rlslurm runs the installed stack on every node, with no Ray)"))
    if not isinstance(env, dict):
        return {}
    return {str(k): (line, "" if v is None else str(v)) for k, v in env.items()}


def _line_of(text: str, name: str, default: int) -> int:
    """The script's line that names `name` as a JSON key (`"NAME":` or `\\"NAME\\":`), else `default`."""
    for n, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        if f'"{name}"' in code.replace('\\"', '"') and ":" in code:
            return n
    return default


def carry_env(sc: Script, fake_qat_reported: bool, text: str = "") -> Carried:
    """`text`: the script, to name each runtime-env variable's own line."""
    out = Carried()
    entries: dict[str, tuple[int, str, str]] = {}   # name -> (line, value, where)
    for name, line in sc.exports.items():
        value = sc.scalars.get(name)
        if isinstance(value, Unresolved):
            sc.unknown.setdefault(name, (line, value.reason))
            value = placeholder(name)
        entries[name] = (line, "" if value is None else value, "export")
    for name, (line, value) in _runtime_env(sc, out).items():
        entries[name] = (_line_of(text, name, line), value, "--runtime-env-json")
    carried: dict[str, list[str]] = {}
    for name, (line, value, where) in entries.items():
        said = f"{name} ({where})"
        if name in SET_BY_RLSLURM:
            out.dropped.append((line, f"{said}: not carried: {SET_BY_RLSLURM[name]}"))
        elif name.startswith(FAKE_QAT_PREFIX):
            if not fake_qat_reported:
                out.dropped.append((line, f"{said}: slime's INT4 fake-QAT switch, off in this script; rlslurm has "
                                          "no fake-QAT (docs/low-precision.md)"))
        elif name in DETECTED and placeholder_names(value):
            out.dropped.append((line, f"{said}={value}: not carried: {DETECTED[name]}"))
        elif looks_secret(name):
            out.argv += ["--secret-env", name]
            out.notes.append((line, f"{said}: --secret-env {name}, its value not printed: {name} must be in the "
                                    "environment of `rlslurm submit`"))
        else:
            out.argv += ["--env", f"{name}={value}"]
            carried.setdefault(where, []).append(name)
    for where, carried_names in carried.items():
        line = min(entries[n][0] for n in carried_names)
        out.notes.append((line, f"{where}: --env {', '.join(carried_names)}, as the script gives them"))
    return out
