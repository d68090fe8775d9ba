"""FP8 (e4m3) KV caches: the scale settings — checks, calibration proposals, the kv_dtype option.

The storage format and its quantization (``x8 = e4m3(clamp(x / s, ±448))``, read as ``float(x8) · s``,
per-tensor scale ``s`` [1] float32 on the device) are the kernel layer's: ``ops/fp8.py`` (torch
reference) and ``ops.store_e4m3`` / ``ops.quantize_query_e4m3`` (fused Triton kernels on CUDA).

Scale proposal (calibration, :func:`propose_scale`): ``s = absmax · headroom / 448`` — the observed
absmax of the latent rows maps to 448 / headroom.
"""

from __future__ import annotations

import math

import torch

from mla_fa3.ops.fp8 import FP8_E4M3_MAX

__all__ = ["kv_dtype_of", "propose_scale", "check_scale"]


def check_scale(value, name: str) -> float:
    """``value`` as a float if it is a finite number > 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    return float(value)


def propose_scale(absmax: float, headroom: float = 1.0) -> float:
    """The per-tensor scale that maps ``absmax`` to ``448 / headroom`` (``absmax`` 0: scale 1.0)."""
    headroom = check_scale(headroom, "headroom")
    if not math.isfinite(absmax) or absmax < 0:
        raise ValueError(f"absmax must be a finite float >= 0, got {absmax!r}")
    return absmax * headroom / FP8_E4M3_MAX if absmax > 0 else 1.0


def kv_dtype_of(value) -> torch.dtype | None:
    """A KV storage dtype setting: None / "auto" (the model's dtype), "fp8" / "float8_e4m3fn", or a torch.dtype."""
    if value is None or value == "auto":
        return None
    if value in ("fp8", "float8_e4m3fn"):
        return torch.float8_e4m3fn
    if isinstance(value, torch.dtype):
        return value
    raise ValueError(f"kv_dtype must be None, 'auto', 'fp8' or a torch.dtype, got {value!r}")
