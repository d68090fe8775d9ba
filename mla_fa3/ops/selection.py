"""Which implementation an op runs: the process-wide choice, its per-call override, and what ran last.

``Impl.AUTO`` (the default) resolves to FA3 on a CUDA device of capability (9, 0) where ``sgl_kernel``
imports, and to the torch REFERENCE off CUDA; on a CUDA tensor it never falls back silently (a named
``FA3UnavailableError`` says why) unless the caller chose ``reference``. Process-wide state (not per thread).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch

from . import fa3
from .types import Impl

__all__ = ["ImplLike", "set_impl", "get_impl", "use_impl", "coerce_impl", "resolve_impl", "last_impl",
           "fa3_available", "resolve", "ran", "coerce"]

ImplLike = Union[Impl, str]

_global_impl: Impl = Impl.AUTO
_last_impl: Optional[Impl] = None


def coerce(impl: ImplLike, name: str = "impl") -> Impl:
    if isinstance(impl, Impl):
        return impl
    if isinstance(impl, str):
        try:
            return Impl(impl.lower())
        except ValueError:
            pass
        raise ValueError(f"{name} must be one of {[i.value for i in Impl]}, got {impl!r}")
    raise TypeError(f"{name} must be an Impl or str, got {type(impl).__name__}")


def set_impl(impl: ImplLike) -> None:
    """Set the process-wide implementation used when an op gets ``impl=None``."""
    global _global_impl
    _global_impl = coerce(impl)


def get_impl() -> Impl:
    """The process-wide implementation choice (may be AUTO)."""
    return _global_impl


@contextlib.contextmanager
def use_impl(impl: ImplLike) -> Iterator[Impl]:
    """Context manager: run the enclosed ops with ``impl`` unless a call passes its own ``impl=``."""
    global _global_impl
    new = coerce(impl)
    old = _global_impl
    _global_impl = new
    try:
        yield new
    finally:
        _global_impl = old


def coerce_impl(impl: Optional[ImplLike]) -> Optional[Impl]:
    """``impl`` as an :class:`Impl` (None stays None: the global setting at call time); named error otherwise."""
    return None if impl is None else coerce(impl)


def resolve_impl(impl: Optional[ImplLike], device: Union[torch.device, str]) -> Impl:
    """FA3 or REFERENCE: what an op on ``device`` runs with ``impl`` (None = the global setting, now)."""
    return resolve(impl, torch.device(device))


def last_impl() -> Optional[Impl]:
    """FA3 or REFERENCE: what the most recent op call actually ran (None before the first call)."""
    return _last_impl


def _fa3_usable_on(device: torch.device) -> bool:
    return fa3.why_unavailable(device) is None


def fa3_available() -> bool:
    """True when a CUDA device of capability (9, 0) is present and ``sgl_kernel`` imports."""
    if not torch.cuda.is_available():
        return False
    return _fa3_usable_on(torch.device("cuda", torch.cuda.current_device()))


def resolve(impl: Optional[ImplLike], device: torch.device) -> Impl:
    """AUTO -> FA3 where it runs, REFERENCE off CUDA; FA3UnavailableError (why) for FA3 / AUTO on CUDA."""
    chosen = _global_impl if impl is None else coerce(impl)
    if chosen is Impl.TRITON:
        raise ValueError("impl='triton' runs only the ops of our Triton kernels (splitkv_mla_with_kvcache, store_e4m3, "
                         "store_rows, quantize_query_e4m3, absorb_query_e4m3, head_matmul); use fa3/reference/auto")
    if chosen is Impl.REFERENCE or (chosen is Impl.AUTO and device.type != "cuda"):
        return Impl.REFERENCE
    error = fa3.unavailable_error(device, auto=chosen is Impl.AUTO)
    if error is not None:
        raise error
    return Impl.FA3



def ran(impl: Impl) -> None:
    global _last_impl
    _last_impl = impl
