"""Placeholders for packages SGLang imports on the GPU machine but this project does not carry there.

SGLang 0.5.17 imports names of flashinfer and of its submodules at import time on CUDA (e.g.
``layers/quantization/fp8_utils.py``: ``from flashinfer import bmm_fp8``) even where the attention backend never
calls them, and its EAGLE draft worker imports the DSA backend, which imports ``deep_gemm``
(``speculative/eagle_worker_v2.py``: ``_capture_cuda_graphs``; ``layers/attention/dsa_backend.py``), whatever the
attention backend. ``install(packages)`` adds an import hook that answers each package and every ``package.*``
module with a placeholder whose names are classes that raise when instantiated or called. It sits after the real
finders: a package that is installed wins. Used by ``tools/device_sglang_run.sh`` (through ``sitecustomize``) and by
one CPU test (``tests/test_sglang_draft.py``: SGLang's scheduler module imports setproctitle, uvicorn and fastapi,
which the CPU import set does not carry); never by the library.
"""

from __future__ import annotations

import importlib.abc
import logging
import importlib.machinery
import sys
import types


class _Placeholder(types.ModuleType):
    __version__ = "0.0.0+placeholder"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        where = f"{self.__name__}.{name}"
        if name == "logger" or name.endswith("_logger"):
            return logging.getLogger(where)  # SGLang sets flashinfer's log level (configure_logger)

        def missing(cls, *args, **kwargs):
            raise RuntimeError(f"{where}: {self.__name__.split('.')[0]} is not installed on this machine")

        # a class: SGLang subclasses some names, calls others; calling (instantiating) raises either way
        return type(name, (), {"__new__": missing, "__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install(packages: tuple[str, ...]) -> None:
    covered = {p for f in sys.meta_path if isinstance(f, _Finder) for p in f.packages}
    new = tuple(p for p in packages if p not in covered)
    if new:
        sys.meta_path.append(_Finder(new))  # after the real finders: an installed package wins
