"""FP8 (e4m3) storage of the KV caches: saturating quantization, dequantization, scale proposals.

A tensor ``x`` is stored with a per-tensor scale ``s`` (float32, ``[1]``, on the device) as

    x8 = e4m3( clamp(x / s, -448, 448) )          448 = the largest finite float8_e4m3fn
    x ~= float(x8) * s                             (the kernels' "descale" is s itself)

Overflow saturates to ±448 (never NaN: depending on the torch build, a plain ``.to(float8_e4m3fn)`` of
a value past 464 gives NaN). A non-finite input element is stored as a finite value — ±inf as ±448,
NaN as 0 — silently; the latent pool raises instead under ``debug_checks`` (which reads device values).
Every function here runs on the device without reading a tensor value on the host (legal inside a
CUDA graph), in few kernels (the store: divide, nan_to_num, clamp, cast).

Queries are quantized per step with a scale from their own absmax (:func:`quantize_e4m3_dynamic`):
``s = max(absmax, 2^-100) / 448`` (fp32), ``q8 = e4m3(q / s)`` — five small kernels (absmax, two for the
scale, divide, cast); ``|q / s| <= 448 (1 + 2^-23)`` rounds to at most 448, so no clamp is needed.

Scale proposal (calibration, :func:`propose_scale`): ``s = absmax · headroom / 448`` — the observed
absmax of the latent rows maps to 448 / headroom.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["kv_dtype_of", "FP8_DTYPE", "FP8_E4M3_MAX", "quantize_e4m3", "dequantize_e4m3", "quantize_e4m3_dynamic",
           "propose_scale", "check_scale"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 2.0 ** -100  # floor of a dynamic absmax (an all-zero tensor gets a finite scale)


def check_scale(value, name: str) -> float:
    """``value`` as a float if it is a finite number > 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    return float(value)


def quantize_e4m3(x: Tensor, scale: Tensor) -> Tensor:
    """x (any float dtype) -> e4m3 ``clamp(x / scale, ±448)``; ±inf -> ±448, NaN -> 0.

    scale: ``[1]`` (or broadcastable) float32 on x's device (x / scale is computed in float32).
    """
    y = torch.div(x, scale)
    if y.dtype != torch.float32:
        y = y.float()
    y = y.nan_to_num_(nan=0.0, posinf=FP8_E4M3_MAX, neginf=-FP8_E4M3_MAX)
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_e4m3(x8: Tensor, scale: Tensor, dtype: torch.dtype, *, out: Tensor | None = None) -> Tensor:
    """e4m3 ``x8`` -> ``float(x8) · scale`` in ``dtype`` (written into ``out`` when given)."""
    y = x8.float().mul_(scale)
    if out is None:
        return y.to(dtype)
    return out.copy_(y)


def quantize_e4m3_dynamic(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-tensor dynamic quantization: (x8 e4m3, descale [1] float32).

    descale = max(absmax(x), 2^-100) / 448 in float32; x8 = e4m3(x / descale) (x / descale in float32).
    """
    if x.numel() == 0:
        return x.to(FP8_DTYPE), torch.ones(1, dtype=torch.float32, device=x.device)
    amax = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dtype=torch.float32)
    scale = amax.clamp_min_(_TINY).div_(FP8_E4M3_MAX).reshape(1)
    return torch.div(x, scale).to(FP8_DTYPE), scale


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
