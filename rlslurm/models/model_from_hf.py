"""The model config of a run: `--model`'s YAML, or else built from `--hf-checkpoint`'s config.json.

slime's scripts name their model by `source scripts/models/X.sh`, and most X have no rlslurm YAML.
For every family rlslurm maps (rlslurm/models/families/) the architecture is read from config.json
instead, by the same table the check walks (models/hf_config.py), and the result is put through
`check_hf_config` against the same file, so the two can never disagree silently. Such a model has no
per-node defaults unless its architecture is exactly a shipped config's (then that config is used,
defaults included): the run's flags (or the field defaults) apply. A run with neither flag is
refused naming both; there is no default model.

The trainer builds the same config from the same file on its node (trainer/setup.py), so run.yaml
records `model: null` and the checkpoint, not a copy of the architecture.
"""

from __future__ import annotations

from pathlib import Path

from rlslurm.errors import ConfigError, UserError
from rlslurm.settings.model_config import ModelConfig, load_model_config

NO_MODEL = ("no model: pass --model NAME (`rlslurm models`, or a model config YAML) or --hf-checkpoint DIR "
            "(its config.json gives the architecture)")


def run_model(model: str | None, hf_checkpoint: Path | str | None) -> ModelConfig:
    """`--model`'s config when given; else the one `--hf-checkpoint`'s config.json describes."""
    if model:
        return load_model_config(model)
    if hf_checkpoint is None:
        raise ConfigError(NO_MODEL)
    hf = Path(hf_checkpoint)
    if not (hf / "config.json").is_file():
        from rlslurm.settings.paths import model_download_hint

        if hint := model_download_hint(hf, "--hf-checkpoint"):
            raise ConfigError(f"--hf-checkpoint {hf} does not exist{hint}")
        raise ConfigError(f"--hf-checkpoint {hf}: no config.json here, so the model cannot be determined: pass "
                          "--model NAME, or run where the checkpoint is")
    return shipped_match(model_config_from_hf(hf))


def shipped_match(mc: ModelConfig) -> ModelConfig:
    """The shipped model config of exactly this architecture, with its per-node defaults (a checkpoint
    of Qwen/Qwen3-4B runs as `--model qwen3-4B` would); else `mc`, which has none."""
    from rlslurm.settings.model_config import available_models

    for name in available_models():
        shipped = load_model_config(name)
        if (shipped.arch, shipped.hf_model_type) == (mc.arch, mc.hf_model_type):
            return shipped
    return mc


def model_config_from_hf(hf_dir: Path) -> ModelConfig:
    """The model config that `hf_dir`'s config.json describes (models/hf_config.py arch_from_hf), checked
    against the same file; every problem is one ConfigError naming --hf-checkpoint."""
    from rlslurm.models.family import NOT_EXPRESSIBLE, family_names, family_of
    from rlslurm.models.hf_config import FileConfig, arch_from_hf, check_hf_config, load_hf_config

    flag = f"--hf-checkpoint {hf_dir}"
    try:
        cfg = load_hf_config(hf_dir)
    except UserError as e:
        raise ConfigError(f"{flag}: {e}") from None
    if isinstance(cfg, FileConfig):  # derived fields and defaults are transformers' (docs/supported-stacks.md)
        raise ConfigError(f"{flag}: without --model the architecture is read from config.json with transformers, "
                          "which is not installed here: pass --model NAME (`rlslurm models`, or a model config YAML), "
                          "or install transformers where you submit")
    mt = cfg.model_type
    if mt in NOT_EXPRESSIBLE:
        raise ConfigError(f"{flag}: config.json model_type {mt!r} has no rlslurm mapping: {NOT_EXPRESSIBLE[mt]}")
    family = family_of(mt)
    if family is None:
        raise ConfigError(f"{flag}: config.json model_type {mt!r} has no rlslurm mapping (supported: "
                          f"{', '.join(family_names())}); pass --model with a model config YAML")
    try:
        arch = arch_from_hf(family, cfg, hf_dir.name or str(hf_dir))
    except UserError as e:
        raise ConfigError(f"{flag}: {e}") from None
    archs = getattr(cfg, "architectures", None) or []
    raw = {"name": hf_dir.name or str(hf_dir), "hf_architecture": archs[0] if archs else "", "hf_model_type": mt,
           "arch": arch}
    try:
        mc = ModelConfig.model_validate(raw)
    except ValueError as e:  # pydantic's ValidationError: the first problem, one line
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{flag}: config.json gives a model rlslurm cannot build: {loc}: "
                          f"{first['msg'].removeprefix('Value error, ')}") from None
    try:
        check_hf_config(mc, hf_dir)  # the inverse agrees with the check the trainer makes at start-up
    except UserError as e:
        raise ConfigError(f"{flag}: {e}") from None
    return mc
