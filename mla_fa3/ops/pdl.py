"""Programmatic dependent launch (CUDA sm_90+) for our Triton kernels: where it is available, and the launch option.

A kernel launched with it starts before the previous kernel on the stream has finished and must wait
(``tl.extra.cuda.gdc_wait()``) before it reads that kernel's writes; a kernel may let its dependents start early
(``gdc_launch_dependents()``), which then wait for its whole grid. Elsewhere (the interpreter, older GPUs) kernels
launch in order. Pure host code: no triton import.
"""

from __future__ import annotations

import functools

import torch


def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA on sm_90 or newer (asked of the driver once per GPU: every launch asks)."""
    if device.type != "cuda":
        return False
    return _sm90_or_newer(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """The Triton launch keyword arguments of a (non-)programmatic launch."""
    return dict(launch_pdl=True) if pdl else {}
