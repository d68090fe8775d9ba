"""Argument checks shared by every layer: one checker per kind of value, named errors, no tensor reads.

Every public boundary of the library validates its host arguments with these, so the rules are the
same everywhere: a ``bool`` is never an int, a float is never truncated to an int, and the error names
the argument (``ValueError("num_pages must be an int >= 2, got 1")``).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_int", "check_ids", "check_real", "is_real"]


def check_int(value: object, name: str, minimum: int | None = 1, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a bool) in ``[minimum, maximum]``; else TypeError / ValueError.

    ``minimum=None`` / ``maximum=None`` leave that side open. Integer numpy scalars are accepted (and
    returned as ``int``); floats are refused even when integral, so ``1.5`` is never truncated to 1.
    """
    if type(value) is not int:  # the common case skips the (slow) abstract-class checks
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum}, got {value}")
    return value


def check_ids(value: object, name: str, size: int) -> list[int]:
    """Ids in ``[0, size)`` as a list of Python ints: from an int, a list / tuple of ints, or a CPU
    integer tensor (0-d or 1-D); numpy integers count as ints. Bools, floats and device tensors (reading
    one would sync) raise TypeError; an id out of range ValueError. Nothing is read twice, nothing changed.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"{name} must be host ints or a CPU tensor (reading a {value.device} tensor "
                            "would sync)")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {value.dtype}")
        if value.dim() > 1:
            raise ValueError(f"{name} must be 0-D or 1-D, got shape {tuple(value.shape)}")
        ids = [int(v) for v in value.reshape(-1).tolist()]
    elif isinstance(value, (list, tuple)):
        ids = [check_int(v, f"{name}[{i}]", minimum=None) for i, v in enumerate(value)]
    else:
        ids = [check_int(value, name, minimum=None)]
    for i in ids:
        if not 0 <= i < size:
            raise ValueError(f"{name} holds {i}, outside [0, {size})")
    return ids


def is_real(value: object) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_real(value: object, name: str, *, positive: bool = False) -> float:
    """``value`` as a float if it is a finite real (``> 0`` with ``positive``); else TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)
