"""`rlslurm import-slime SCRIPT`: a slime launch script -> the `rlslurm submit` command (or run YAML).

The script is read, never run (slime_import/bash.py); its train.py arguments are mapped flag by
flag (slime_import/mapping.py). What is not mapped is listed with the script's line and the
reason. The flag map for users: docs/slime-flags.md.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlslurm.errors import ConfigError, UserError
from rlslurm.slime_import.bash import ScriptError, read_script
from rlslurm.slime_import.mapping import group_flags, map_flags


@dataclass
class Imported:
    path: str
    argv: list[str]
    model: str | None
    dropped: list[tuple[int, str]] = field(default_factory=list)   # (line, "--flag: why")
    notes: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[tuple[int, str]] = field(default_factory=list)   # the script, or the run, differs from slime's
    # values not known here, kept in the command as `<unset:NAME>` (rlslurm/settings/placeholder.py)
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    summary: str = ""             # the closing check: every flag and variable accounted for
    refusal: str | None = None    # what `rlslurm submit` would still refuse in the result

    def report_lines(self) -> list[str]:
        """The warnings, the values still to fill, one line per flag left out, then the notes, each
        naming the script's line, and the closing check."""
        at = lambda line: f"{self.path}:{line}" if line else self.path  # noqa: E731
        lines = [f"{at(ln)}: warning: {msg}" for ln, msg in sorted(self.warnings, key=lambda d: d[0])]
        lines += [f"{at(ln)}: to fill: {msg}" for ln, msg in sorted(self.placeholders, key=lambda d: d[0])]
        lines += [f"{at(ln)}: not mapped: {msg}" for ln, msg in sorted(self.dropped, key=lambda d: d[0])]
        lines += [f"{at(ln)}: note: {msg}" for ln, msg in sorted(self.notes, key=lambda d: d[0])]
        if self.summary:
            lines.append(f"{self.path}: {self.summary}")
        if self.refusal:
            lines.append(f"{self.path}: rlslurm submit would refuse the result as it stands: {self.refusal}")
        return lines


def parse_vars(items: list[str]) -> dict[str, str]:
    """`--var NAME=VALUE` items; one line naming a malformed one."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UserError(f"--var {item!r}: expected NAME=VALUE (NAME a shell variable name)")
        out[name] = value
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory (a slime launch script is expected)") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it: {e.strerror or e}") from None


def _model(sources: list, path: str) -> tuple[str | None, list[tuple[int, str]], list[tuple[int, str]]]:
    """`source .../models/<name>.sh` -> the rlslurm model config of that name."""
    from rlslurm.settings.model_config import available_models

    names = available_models()
    dropped, notes = [], []
    found = None
    for w in sources:
        tail = w.literal_tail().rsplit("/", 1)[-1]
        if not tail.endswith(".sh"):
            continue
        stem = tail[:-3]
        match = stem if stem in names else next((n for n in names if n.lower() == stem.lower()), None)
        if match:
            found = match
            notes.append((w.line, f"source {tail}: --model {match} (its architecture is rlslurm/settings/model_configs/"
                                  f"{match}.yaml)"))
        elif "/models/" in w.literal_tail() or w.literal_tail().startswith("models/"):
            notes.append((w.line, f"source {tail}: rlslurm ships no model config {stem!r}, so the model config is "
                                  "built from --hf-checkpoint's config.json at submit "
                                  "(rlslurm/models/model_from_hf.py)"))
    if found is None and not notes:
        notes.append((0, "no `source scripts/models/<model>.sh` line: the model config is built from "
                         "--hf-checkpoint's config.json at submit (or pass --model)"))
    return found, dropped, notes


def import_script(path: Path, *, check: bool = True, variables: Mapping[str, str] | None = None,
                  environ: Mapping[str, str] | None = None) -> Imported:
    """`variables`: --var NAME=VALUE; `environ`: where the variables the script does not set come
    from (the CLI passes its own environment; None: nowhere)."""
    from rlslurm.slime_import.runtime_env import carry_env

    text = _read(path)
    sc = read_script(text, str(path), variables, environ)
    if sc.launch is None:
        raise ScriptError(f"{path}: no `python3 train.py ...` (or train_async.py) command found; "
                          "nothing to import")
    launcher, args, line = sc.launch
    model, dropped, notes = _model(sc.sources, str(path))
    mla = False
    if model is not None:
        from rlslurm.settings.model_config import load_model_config

        mla = bool(load_model_config(model).arch.mla)
    flags = group_flags(args, dropped)
    mapped = map_flags(flags, model, mla, _node_gpus(sc))
    res = Imported(str(path), mapped.argv, model, dropped + mapped.dropped, notes + sc.notes + mapped.notes,
                   list(sc.warnings))
    fake_qat = _int4_fake_qat(text)
    if fake_qat is not None:
        res.dropped.append(fake_qat)
    env = carry_env(sc, fake_qat is not None, text)
    res.argv += env.argv
    res.notes += env.notes
    res.dropped += env.dropped
    res.warnings += env.warnings
    if mapped.not_carried:
        features = list(dict.fromkeys(feature for _, feature in mapped.not_carried))
        res.warnings.append((mapped.not_carried[0][0], "the imported run does not do what this script does: "
                             f"{'; '.join(features)} (each not mapped below)"))
    if launcher == "train_async.py":
        res.notes.append((line, "train_async.py: slime's asynchronous trainer; rlslurm trains asynchronously with "
                                "--async-buffer-size N (not set by the import)"))
    res.placeholders = _placeholders(res.argv, sc)
    res.summary = _accounted(flags, mapped, env, res)
    if check:
        res.refusal = _refusal(res.argv)
    return res


def _node_gpus(sc) -> tuple[int, str]:
    """The GPUs of the node the script is written for: its `ray start --head --num-gpus N` (a
    script's Ray cluster of that one node), else 8, the nodes slime's scripts start Ray with."""
    if sc.ray_gpus is not None and sc.ray_gpus[1].isdigit():
        line, gpus = sc.ray_gpus
        return int(gpus), f"the script's `ray start --head --num-gpus {gpus}`, line {line}"
    return 8, "slime's scripts start Ray with --num-gpus 8 per node"


def _placeholders(argv: list[str], sc) -> list[tuple[int, str]]:
    """One line per variable (or command) whose value the command still needs, naming its flags."""
    from rlslurm.settings.placeholder import names

    flags: dict[str, list[str]] = {}
    flag = ""
    for tok in argv:
        if tok.startswith("--"):
            flag = tok
        for name in names(tok):
            shown = tok.split("=", 1)[0] if flag == "--env" else flag
            if shown not in flags.setdefault(name, []):
                flags[name].append(shown)
    out = []
    for name, used in flags.items():
        line, why = sc.unknown.get(name, (0, f"{name} is not known here"))
        how = (f"import again with --var {name}=VALUE (or edit the command)" if re.fullmatch(r"\w+", name)
               else "put its value in the command (or give the variables it uses with --var and import again)")
        out.append((line, f"<unset:{name}> in {', '.join(used)}: {why}; {how}: rlslurm submit refuses it until then"))
    return out


def _accounted(flags, mapped, env, res: Imported) -> str:
    """The closing check: every launch flag of the script is carried (as given or renamed), set by
    rlslurm, or on a `not mapped` line of its own; a flag no rule took would be a bug of the import
    and is named as not carried rather than lost. Every variable of its environment is carried or on
    a line of its own (slime_import/runtime_env.py)."""
    for f in flags:
        if id(f) not in mapped.outcome:
            res.dropped.append((f.line, f"{f.shown}: no rule of the import took it (a bug of rlslurm "
                                        "import-slime: please report it); not carried"))
            mapped.outcome[id(f)] = "not carried"
    n_env = sum(1 for a in env.argv if a in ("--env", "--secret-env"))
    parts = [f"{mapped.count(k)} {k}" for k in ("carried", "renamed", "set by rlslurm", "not carried")]
    return (f"checked: {len(flags)} launch flags: {', '.join(parts)} (each not carried on its line above); "
            f"{n_env} environment variables carried, {len(env.dropped)} not (on their lines); "
            f"{len(res.placeholders)} values to fill")


# slime's INT4 fake quantization-aware training: switched on by environment variables its INT4 scripts
# put in ray's runtime env JSON (scripts/low_precision/run-*-int4.sh, read by
# slime/backends/megatron_utils at THUDM/slime 624b824), not by a train.py flag, so the flag mapping
# never sees it. The script is read as text: the JSON is one quoted word of `ray job submit`.
FAKE_QAT = re.compile(r'OPEN_TRAINING_INT4_FAKE_QAT_FLAG\\?"?\s*[:=]\s*\\?"?([^"\\\s,}]*)')
QAT_GROUP = re.compile(r'OPEN_TRAINING_INT4_GROUP_SIZE\\?"?\s*[:=]\s*\\?"?([^"\\\s,}]*)')


def _int4_fake_qat(text: str) -> tuple[int, str] | None:
    """(line, why) when the script turns on slime's INT4 fake-QAT: rlslurm trains plain bf16 (docs/low-precision.md)."""
    m = FAKE_QAT.search(text)
    if m is None or m.group(1).lower() in ("", "0", "false"):
        return None
    g = QAT_GROUP.search(text)
    group = f", OPEN_TRAINING_INT4_GROUP_SIZE={g.group(1)}" if g else ""
    return (text.count("\n", 0, m.start()) + 1,
            f"OPEN_TRAINING_INT4_FAKE_QAT_FLAG={m.group(1)}{group} (ray runtime env): slime's INT4 fake "
            "quantization-aware training; rlslurm trains plain bf16 and quantizes to INT4 only when it syncs the "
            "weights to the engines (docs/low-precision.md)")


def _refusal(argv: list[str]) -> str | None:
    """What `rlslurm submit --dry-run` would refuse in `argv` (missing files are no refusal here)."""
    from rlslurm.resolve import resolve

    try:
        resolve(argv, strict_inputs=False)
    except ConfigError as e:
        return str(e)
    return None


def as_command(imp: Imported) -> str:
    """`rlslurm submit` with one flag and its values per line, every word shell-quoted."""
    lines, cur = [], ["rlslurm", "submit"]
    for tok in imp.argv:
        if tok.startswith("--") and cur[0].startswith("--") or tok.startswith("--") and cur[0] == "rlslurm":
            lines.append(cur)
            cur = []
        cur.append(tok)
    lines.append(cur)
    return " \\\n    ".join(" ".join(shlex.quote(t) for t in ln) for ln in lines) + "\n"


def as_yaml(imp: Imported) -> str:
    """The run YAML (`rlslurm submit --config`) of the same settings, the report as comments after it."""
    from rlslurm.settings.flags import build_config, parse_flags
    from rlslurm.settings.placeholder import names

    layer = parse_flags(imp.argv)
    # values still to fill are written as they are (submit --config refuses them, naming the key)
    held = {k: v for k, v in layer.values.items() if names(yaml.safe_dump(v))}
    for k in held:
        del layer.values[k]
    cfg = build_config([layer])
    data: dict[str, Any] = {}
    for section, name in layer.values:
        value = getattr(getattr(cfg, section), name)
        data.setdefault(section, {})[name] = _plain(value)
    for (section, name), value in held.items():
        data.setdefault(section, {})[name] = value
    if layer.megatron:
        data["megatron"] = dict(layer.megatron)
    if layer.sglang_args:
        data["sglang_args"] = list(layer.sglang_args)
    text = f"# rlslurm run config imported from {imp.path} (rlslurm import-slime --yaml)\n"
    text += yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    report = imp.report_lines()
    if report:
        text += "\n# not imported:\n" + "".join(f"# {ln}\n" for ln in report)
    return text


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
