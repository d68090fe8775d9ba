"""A placeholder for ``flashinfer`` on the GPU machine, where it is not carried (its closure is GBs).

SGLang 0.5.17 imports names of flashinfer and of its submodules at import time on CUDA (e.g.
``layers/quantization/fp8_utils.py``: ``from flashinfer import bmm_fp8``) even where the attention backend never
calls them. ``install()`` adds an import hook that answers ``flashinfer`` and every ``flashinfer.*`` module with a
placeholder whose names are functions that raise when called. Used by ``tools/device_sglang_run.sh`` (through
``sitecustomize``) only; never by the library or CI.
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
            raise RuntimeError(f"{where}: flashinfer is not installed on this machine")

        # a class: SGLang subclasses some names, calls others; calling (instantiating) raises either way
        return type(name, (), {"__new__": missing, "__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "flashinfer" or fullname.startswith("flashinfer."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())  # after the real finders: an installed flashinfer wins
