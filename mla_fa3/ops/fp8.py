"""FP8 (e4m3) storage of the KV caches and queries: the torch reference of the quantization ops.

A tensor ``x`` is stored with a per-tensor scale ``s`` (float32, ``[1]``, on the device) as

    x8 = e4m3( clamp(x / s, -448, 448) )          448 = the largest finite float8_e4m3fn
    x ~= float(x8) * s                             (the kernels' "descale" is s itself)

``x / s`` is computed in float32 (correctly rounded), the cast rounds to nearest even. Overflow
saturates to ±448 (never NaN: depending on the torch build, a plain ``.to(float8_e4m3fn)`` of a value
past 464 gives NaN). A non-finite input element is stored as a finite value — ±inf as ±448, NaN as
0 — silently (the latent pool raises instead under ``debug_checks``, reading device values).

Queries are quantized per step with a scale from their own absmax (:func:`quantize_e4m3_dynamic`):
``s = max(absmax, 2^-100) / 448`` (fp32), ``q8 = e4m3(q / s)``; ``|q / s| <= 448 (1 + 2^-23)`` rounds
to at most 448, so no clamp is needed; a NaN in q makes s (and so every q8) NaN, as torch's max does.

These functions are the reference (any device, a few torch kernels each, no host read: legal inside
a CUDA graph). The public ops ``ops.store_e4m3`` / ``ops.quantize_query_e4m3`` run them, or the fused
Triton kernels of ``fp8_triton.py`` (one launch for the store, two for the query) with the same
results bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FP8_DTYPE", "FP8_E4M3_MAX", "DYNAMIC_TINY", "quantize_e4m3", "dequantize_e4m3", "quantize_e4m3_dynamic"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
DYNAMIC_TINY = 2.0 ** -100  # floor of a dynamic absmax (an all-zero tensor gets a finite scale)


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
    An empty x gets descale 1.
    """
    if x.numel() == 0:
        return x.to(FP8_DTYPE), torch.ones(1, dtype=torch.float32, device=x.device)
    amax = torch.linalg.vector_norm(x.detach(), ord=float("inf"), dtype=torch.float32)
    # divide by a tensor, not a Python number: on CUDA torch turns division by a scalar into a multiply by
    # its reciprocal (1 ulp off); tensor / tensor is the correctly rounded division the fused kernel does
    divisor = torch.full((), FP8_E4M3_MAX, dtype=torch.float32, device=amax.device)
    scale = amax.clamp_min_(DYNAMIC_TINY).div_(divisor).reshape(1)
    return torch.div(x, scale).to(FP8_DTYPE), scale
