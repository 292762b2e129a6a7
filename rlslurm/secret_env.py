"""Secret environment variables (HF_TOKEN, WANDB_API_KEY, ...): passed by file, never by run.yaml.

`--env NAME=VALUE` values land in RUN/run.yaml, which is 0640 (group-readable with
`--group-shared`) and is printed by `rlslurm submit --dry-run`. A variable is a *secret* when
its name has a secret-looking word (`looks_secret`: HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY,
MY_PASSWORD, ...) or is named by `--secret-env NAME`. Secrets are taken out of `slurm.env`
when the config is validated (config.py keeps their values in a private attribute that
`model_dump` never writes), their names go to `slurm.secret_env` in run.yaml, and their values
to RUN/control/secret_env (0600), which the batch script sources and `rlslurm run` reads.
A name given only as `--secret-env NAME` takes its value from the environment `rlslurm submit`
(or `rlslurm run`) runs in, so the value is not even on the command line.

The file is shell: one `export NAME=<shlex-quoted value>` per line. Names are validated
identifiers and values are quoted by `shlex.quote`, so sourcing it runs nothing; Python reads it
back with `shlex` (POSIX rules, the same as bash for single-quoted words).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from rlslurm.errors import ConfigError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words of a name (split at '_') that mark it secret. Whole words only: TOKENIZERS_PARALLELISM
# is not a secret, HF_TOKEN and HUGGING_FACE_HUB_TOKEN are.
SECRET_WORDS = frozenset({"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "CREDENTIAL"})
FILE_NAME = "secret_env"


def looks_secret(name: str) -> bool:
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def secret_env_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / "control" / FILE_NAME


def render_env_file(values: Mapping[str, str]) -> str:
    for name in values:
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"--secret-env {name!r}: not a valid environment variable name")
    return "".join(f"export {name}={shlex.quote(str(value))}\n" for name, value in values.items())


def parse_env_file(text: str, *, where: str) -> dict[str, str]:
    words = shlex.split(text, comments=False, posix=True)
    if len(words) % 2:
        raise ConfigError(f"{where}: not a file rlslurm wrote (expected `export NAME=VALUE` lines)")
    out: dict[str, str] = {}
    for export, assignment in zip(words[::2], words[1::2]):
        name, sep, value = assignment.partition("=")
        if export != "export" or not sep or not ENV_NAME.fullmatch(name):
            raise ConfigError(f"{where}: not a file rlslurm wrote (expected `export NAME=VALUE` lines)")
        out[name] = value
    return out


def read_secret_env(run_dir: str | Path) -> dict[str, str]:
    """The secrets of a run ({} if it has none)."""
    path = secret_env_file(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    return parse_env_file(text, where=str(path))


def secret_values(names: list[str], given: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Every secret's value: from `--env NAME=VALUE` (`given`), else from the submitting environment."""
    out: dict[str, str] = {}
    for name in names:
        if name in given:
            out[name] = given[name]
        elif name in environ:
            out[name] = environ[name]
        else:
            raise ConfigError(f"--secret-env {name}: {name} is not set in this environment and not given as "
                              f"--env {name}=VALUE; export it before `rlslurm submit` / `rlslurm run`")
    return out
