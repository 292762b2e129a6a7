"""`rlslurm import-slime SCRIPT`: a slime launch script -> the `rlslurm submit` command (or run YAML).

The script is read, never run (slime_import/bash.py); its train.py arguments are mapped flag by
flag (slime_import/mapping.py). What is not mapped is listed with the script's line and the
reason. The flag map for users: docs/slime-flags.md.
"""

from __future__ import annotations

import re
import shlex
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
    refusal: str | None = None    # what `rlslurm submit` would still refuse in the result

    def report_lines(self) -> list[str]:
        """The warnings, one line per flag left out, then the notes, each naming the script's line."""
        at = lambda line: f"{self.path}:{line}" if line else self.path  # noqa: E731
        lines = [f"{at(ln)}: warning: {msg}" for ln, msg in sorted(self.warnings, key=lambda d: d[0])]
        lines += [f"{at(ln)}: not mapped: {msg}" for ln, msg in sorted(self.dropped, key=lambda d: d[0])]
        lines += [f"{at(ln)}: note: {msg}" for ln, msg in sorted(self.notes, key=lambda d: d[0])]
        if self.refusal:
            lines.append(f"{self.path}: rlslurm submit would refuse the result as it stands: {self.refusal}")
        return lines


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
                                  "built from --hf-checkpoint's config.json at submit (rlslurm/convert/model_from_hf.py)"))
    if found is None and not notes:
        notes.append((0, "no `source scripts/models/<model>.sh` line: the model config is built from "
                         "--hf-checkpoint's config.json at submit (or pass --model)"))
    return found, dropped, notes


def import_script(path: Path, *, check: bool = True) -> Imported:
    text = _read(path)
    sc = read_script(text, str(path))
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
    mapped = map_flags(flags, model, mla)
    res = Imported(str(path), mapped.argv, model, dropped + mapped.dropped, notes + sc.notes + mapped.notes,
                   list(sc.warnings))
    if mapped.not_carried:
        features = list(dict.fromkeys(feature for _, feature in mapped.not_carried))
        res.warnings.append((mapped.not_carried[0][0], "the imported run does not do what this script does: "
                             f"{'; '.join(features)} (each not mapped below)"))
    fake_qat = _int4_fake_qat(text)
    if fake_qat is not None:
        res.dropped.append(fake_qat)
    if launcher == "train_async.py":
        res.notes.append((line, "train_async.py: slime's asynchronous trainer; rlslurm trains asynchronously with "
                                "--async-buffer-size N (not set by the import)"))
    if check:
        res.refusal = _refusal(res.argv)
    return res


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

    layer = parse_flags(imp.argv)
    cfg = build_config([layer])
    data: dict[str, Any] = {}
    for section, name in layer.values:
        value = getattr(getattr(cfg, section), name)
        data.setdefault(section, {})[name] = _plain(value)
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
