"""Whether an exception while the trainer builds its models or loads their weights ends the job or is retried
(docs/user-errors.md, "Building the model and loading its weights").

Building a megatron-core model from a model config, a TransformerConfig and a layer spec is deterministic, and
so is matching a checkpoint to the model: a retry after another queue wait fails the same way, up to
--max-failures times. So such an exception is final, a `ModelBuildError` (a UserError: recorded in
user_error.json, the job ends without requeue, rlslurm/user_error.py), when

- it is of a type that code raises for a wrong program or a wrong input, never for the machine:
  `DETERMINISTIC` (AssertionError, TypeError, ValueError, ... : megatron's asserts at build, a spec or a
  config it refuses) and `DETERMINISTIC_ELSEWHERE` (megatron's CheckpointingException: a checkpoint whose
  keys or shapes do not fit the model; safetensors' SafetensorError: a damaged file), and
- nothing in its chain of causes (`__cause__`, `__context__`) is an I/O error (OSError, the run directory's
  StorageError): a file that could not be read this time may be readable after a requeue (megatron wraps a
  FileNotFoundError into a CheckpointingException, for one).

torch.distributed.checkpoint gathers each rank's failure into one CheckpointException (a BaseException):
final when every rank's failure is (a key of the model missing from the checkpoint: megatron's KeyError).

Everything else keeps failing the attempt as before, retried within --max-failures: I/O errors, and
RuntimeErrors (CUDA and NCCL errors, out of memory, torch.distributed timeouts), which a node can cause.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from rlslurm.errors import UserError

DETERMINISTIC: tuple[type[BaseException], ...] = (AssertionError, TypeError, ValueError, KeyError, IndexError,
                                                  AttributeError, NotImplementedError, ImportError)
# (module, class): exception types of other packages, where those are installed
DETERMINISTIC_ELSEWHERE = (("megatron.core.dist_checkpointing.core", "CheckpointingException"),
                           ("safetensors", "SafetensorError"))
MAX_CAUSE_CHARS = 400


class ModelBuildError(UserError):
    """Building the model or loading its weights failed the way it would on every retry."""


def _deterministic_types() -> tuple[type[BaseException], ...]:
    found = []
    for module, name in DETERMINISTIC_ELSEWHERE:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return DETERMINISTIC + tuple(found)


def _io_in_chain(e: BaseException) -> bool:
    from rlslurm.buffer.atomic import StorageError

    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, (OSError, StorageError)):
            return True
        stack += [cur.__cause__, cur.__context__]
    return False


def _rank_failures(e: BaseException) -> list[BaseException] | None:
    """The failures of each rank that torch.distributed.checkpoint's CheckpointException carries, or None."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return None
    if not isinstance(e, CheckpointException):
        return None
    return [pair[0] for pair in e.failures.values()]


def is_final(e: BaseException) -> bool:
    """The rule of the module docstring."""
    ranks = _rank_failures(e)
    if ranks is not None:
        return bool(ranks) and all(is_final(x) for x in ranks)
    return isinstance(e, _deterministic_types()) and not _io_in_chain(e)


def _describe(e: BaseException) -> str:
    ranks = _rank_failures(e)
    if ranks:
        return f"{type(e).__name__} of {len(ranks)} rank(s), the first: {_describe(ranks[0])}"
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "?"


@contextlib.contextmanager
def final_if_deterministic(what: str) -> Iterator[None]:
    """Run the block; an exception that `is_final` becomes a one-line ModelBuildError naming `what`, its
    type, its message and megatron-core's version. UserErrors and everything else pass unchanged."""
    try:
        yield
    except BaseException as e:  # torch's CheckpointException is no Exception; is_final leaves out the rest
        if isinstance(e, UserError) or not is_final(e):
            raise
        cause = _describe(e)
        if len(cause) > MAX_CAUSE_CHARS:
            cause = cause[:MAX_CAUSE_CHARS] + "..."
        raise ModelBuildError(f"{what} failed on megatron-core {_megatron_version()}: {cause} "
                              "(deterministic: the job ends instead of requeueing; docs/user-errors.md)") from e
