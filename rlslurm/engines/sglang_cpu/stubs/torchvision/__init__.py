"""Import-only stand-in for torchvision on rlslurm's SGLang CPU path.

SGLang 0.5.23 imports torchvision at module level in its multimodal processors, which the
text-only server still imports. The only torchvision wheel on the registries is a CUDA build
that breaks `import sglang` on CPU torch (`operator torchvision::nms does not exist`), so this
package is put on the SGLang server's PYTHONPATH instead (rlslurm.engines.sglang_cpu.cpu_env).

Every `torchvision.*` submodule imports, and every attribute is a placeholder that can be
referenced at import time (`InterpolationMode.BICUBIC`, type hints) but raises a clear error
when called, so a vision model on the CPU path fails loudly instead of computing garbage.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+rlslurm.stub"
_MSG = ("torchvision is not available on rlslurm's SGLang CPU path (import-only stub in "
        "rlslurm/engines/sglang_cpu/stubs); vision models are not supported there")


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__}: {_MSG}")


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"{__name__}.{name}")
