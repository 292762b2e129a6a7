"""Values `rlslurm import-slime` could not know, kept visible in the command it prints.

A slime script's flag whose value needs something the importer does not run (a variable the script
does not set, one set inside an `if`, a command's output) is printed with `<unset:NAME>` where that
value goes (`--hf-checkpoint '<unset:BASE_DIR>/Kimi-K2-Thinking-fp8/'`), never dropped (one word: no
blank, so that bash's word splitting keeps it whole). `rlslurm
submit` (resolve) refuses any value that still holds one, naming the flag and the variable, so a
placeholder cannot reach a job.
"""

from __future__ import annotations

import re
from typing import Any

from rlslurm.errors import ConfigError

PATTERN = re.compile(r"<unset:([^<>\s]+)>")


def placeholder(name: str) -> str:
    """The text standing for the value of `name` (a variable, or `$(command)`)."""
    return f"<unset:{name}>"


def names(text: str) -> list[str]:
    """The variables (or commands) whose placeholders `text` holds."""
    return PATTERN.findall(text)


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def check_filled(layer: Any, where: str = "") -> None:
    """ConfigError for the first value of a flag layer (rlslurm/settings/flags.py `Layer`) that holds
    a placeholder: its flag, its value and what to do."""
    from rlslurm.settings.flags import flag_name

    def label(key: tuple[str, str]) -> str:  # the flag, or the YAML file's line and key
        origin = layer.origin.get(key) or flag_name(key[1])
        return origin if origin.startswith("--") else f"{origin}: {key[1]}"

    items = [(label(key), value) for key, value in layer.values.items()]
    items += [(f"--megatron-{k.replace('_', '-')}", v) for k, v in layer.megatron.items()]
    items += [("--sglang-*", layer.sglang_args), ("--router-*", layer.router_args)]
    for flag, value in items:
        for text in _strings(value):
            found = names(text)
            if found:
                how = (f"import again with --var {found[0]}=VALUE, or put the value in place of the placeholder"
                       if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", found[0]) else
                       "put the value in place of the placeholder (the output of a command the import does not run)")
                raise ConfigError(f"{where}{flag} {text}: a value rlslurm import-slime could not know "
                                  f"({found[0]} where the script was read); {how}")
