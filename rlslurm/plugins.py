"""Loading user plugins named on the command line.

A plugin is named `module.path:attr` (importable module) or `path/to/file.py:attr` (a
file, imported by path). `attr` may be dotted (`Class.method`). Every failure is a
ConfigError that names the flag the spec came from, because the user only sees the
flag they typed, not where we import it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from rlslurm.errors import ConfigError

# A file loaded twice (two flags naming the same file) must be one module, so that
# module-level state (a client, a cache) is shared rather than duplicated.
_FILE_MODULES: dict[Path, ModuleType] = {}


def split_spec(spec: str, *, what: str) -> tuple[str, str]:
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} {spec!r}: expected 'module.path:attr' or 'path/to/file.py:attr'")
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(f"{what} {spec!r}: expected 'module.path:attr' or 'path/to/file.py:attr'")
    return target, attr


def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(path: Path, *, what: str, spec: str) -> ModuleType:
    path = path.expanduser().resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    if not path.is_file():
        raise ConfigError(f"{what} {spec!r}: file {path} does not exist")
    # A unique, stable module name: two plugin files both called `reward.py` must not
    # shadow each other in sys.modules.
    name = f"rlslurm_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{what} {spec!r}: cannot import {path} (not a Python file?)")
    module = importlib.util.module_from_spec(module_spec)
    # Plugins often import helpers that sit beside them; make those importable.
    parent = str(path.parent)
    if parent not in sys.path:
        sys.path.append(parent)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ConfigError(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    _FILE_MODULES[path] = module
    return module


def _import_module(target: str, *, what: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and target.startswith(e.name):
            raise ConfigError(
                f"{what} {spec!r}: no module named {e.name!r} (is it installed or on PYTHONPATH? "
                f"a file path must end in .py)"
            ) from e
        raise ConfigError(f"{what} {spec!r}: importing {target} failed: {e}") from e
    except Exception as e:
        raise ConfigError(f"{what} {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e


def load_object(spec: str, *, what: str = "plugin") -> Any:
    """Import and return the object named by `spec`; `what` is the flag, for errors."""
    target, attr = split_spec(spec, what=what)
    if _is_file_target(target):
        module = _import_file(Path(target), what=what, spec=spec)
    else:
        module = _import_module(target, what=what, spec=spec)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            have = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ConfigError(
                f"{what} {spec!r}: {target} has no attribute {attr!r} (it has: {', '.join(have) or 'nothing'})"
            ) from None
    return obj


def load_callable(spec: str, *, what: str = "plugin", min_args: int | None = None) -> Callable[..., Any]:
    """`load_object` that also checks the object can be called with `min_args` positionals."""
    obj = load_object(spec, what=what)
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r}: {type(obj).__name__} object is not callable")
    if min_args is not None and not inspect.isclass(obj):
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):  # builtins without a signature: trust the user
            return obj
        try:
            sig.bind(*range(min_args))
        except TypeError:
            raise ConfigError(
                f"{what} {spec!r}: {getattr(obj, '__name__', obj)}{sig} cannot be called with {min_args} "
                f"positional argument(s)"
            ) from None
    return obj


@functools.lru_cache(maxsize=None)
def cached_callable(spec: str, *, what: str, min_args: int | None = None) -> Callable[..., Any]:
    """`load_callable`, once per spec: the trainer's plugins are looked up on every step or sample."""
    return load_callable(spec, what=what, min_args=min_args)
