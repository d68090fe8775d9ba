"""Host values in, tensors out, never a device->host sync: how every layer turns an engine's lists and CPU tensors
into the int32 / int64 tensors the kernels read, and checks a tensor's dtype, rank and length without reading it.

Rules: lengths arrive as Python ints or CPU tensors (a device tensor would have to be read, which syncs) and
become int32 CPU copies; slot and row indices become int64 device tensors (a device tensor is kept as is, its
values unread); every host->device copy is non-blocking (:func:`to_device`); a ``bool`` or a float is never an
int (``checks.check_int``).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from mla_fa3.checks import check_int

__all__ = ["IntsLike", "to_device", "host_ints", "cpu_int32", "index_tensor", "index_tensors", "check_tensor_1d"]

IntsLike = Union[Sequence[int], Tensor]


def to_device(t: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """Copy to ``device`` without blocking the host (never a device->host sync).

    ``non_blocking=True`` also for pageable CPU sources: the CUDA driver stages a pageable buffer
    before ``cudaMemcpyAsync`` returns, so the source may be freed or reused at once; a blocking copy
    would instead synchronize the stream (and trip ``torch.cuda.set_sync_debug_mode("error")``).
    """
    return t.to(device=device, dtype=dtype, non_blocking=True)


def host_ints(values: object, name: str) -> list[int]:
    """A list of Python ints from a sequence: bools and floats raise TypeError (``1.5`` is never truncated)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = list(values)
    if all(type(v) is int for v in out):  # the common case, without a call per element
        return out
    return [check_int(v, f"{name}[{i}]", minimum=None) for i, v in enumerate(out)]


def cpu_int32(values: IntsLike, name: str) -> Tensor:
    """A 1-D int32 CPU tensor from a list / tuple / CPU integer tensor; rejects CUDA (that would sync)."""
    if isinstance(values, Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a Python list or a CPU tensor (reading a device tensor "
                             f"would sync), got a tensor on {values.device}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {values.dtype}")
        t = values.to(torch.int32)
    else:
        t = torch.tensor(host_ints(values, name), dtype=torch.int32)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() and int(t.numpy().min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    return t


def index_tensor(values: IntsLike, name: str, device: torch.device) -> Tensor:
    """A 1-D int64 tensor on ``device`` (a device tensor is kept as is: no value is read)."""
    return index_tensors(values, name, device)[0]


def index_tensors(values: IntsLike, name: str, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """(1-D int64 tensor on ``device``, its CPU copy when the values came from the host, else None)."""
    if isinstance(values, Tensor):
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.device.type != "cpu":
            return to_device(values, device, torch.int64), None
        t = values.to(torch.int64)
    else:
        t = torch.tensor(host_ints(values, name), dtype=torch.int64)
    if t.numel() and int(t.numpy().min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    return to_device(t, device), t


def check_tensor_1d(t: object, name: str, dtypes: tuple, length: int | None, *, cpu: bool = False) -> None:
    """Dtype / rank / length / placement check that reads no tensor value (no sync)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {t.shape[0]}")
    if cpu and t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
