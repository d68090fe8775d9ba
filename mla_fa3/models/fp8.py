"""Block-wise FP8 weights of DeepSeek-V3 checkpoints: dequantize at load time.

A quantized linear weight ``W`` [out, in] is stored as ``q = weight`` (float8_e4m3fn, same shape) and
``s = weight_scale_inv`` (float32 [ceil(out / bo), ceil(in / bi)]), one scale per ``bo x bi`` block
(``quantization_config.weight_block_size``, [128, 128] for DeepSeek-V3). Despite the name,
``weight_scale_inv`` is the factor that *restores* the weight (quantization divided by it)::

    W[i, j] = float(q[i, j]) * s[i // bo, j // bi]

Edge blocks are partial (out or in not a multiple of the block). :func:`quantize_block_fp8` is the
inverse used to write FP8 checkpoints (``s = amax(block) / 448``, e4m3's largest finite value).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantize_block_fp8", "quantize_block_fp8", "expand_block_scales"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _check_block(block_size) -> tuple[int, int]:
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, int) and b > 0 for b in block_size)):
        raise ValueError(f"block_size must be two positive ints [bo, bi], got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def expand_block_scales(scale: Tensor, shape: tuple[int, int], block_size) -> Tensor:
    """scale [ceil(out/bo), ceil(in/bi)] -> [out, in] (each block's scale repeated over the block)."""
    bo, bi = _check_block(block_size)
    out, inp = shape
    want = (math.ceil(out / bo), math.ceil(inp / bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"weight_scale_inv must have shape {list(want)} for a weight of shape {list(shape)} "
                         f"and blocks {[bo, bi]}, got {list(scale.shape)}")
    return scale.repeat_interleave(bo, dim=0)[:out].repeat_interleave(bi, dim=1)[:, :inp]


def dequantize_block_fp8(weight: Tensor, scale_inv: Tensor, block_size=(128, 128), *,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """weight [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] -> [out, in] ``dtype``.

    The product is formed in float32 and rounded to ``dtype`` once.
    """
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {list(weight.shape)}")
    if not scale_inv.dtype.is_floating_point or scale_inv.dim() != 2:
        raise TypeError(f"weight_scale_inv must be a 2-D float tensor, got {scale_inv.dtype} "
                        f"{list(scale_inv.shape)}")
    scales = expand_block_scales(scale_inv.float(), tuple(weight.shape), block_size).to(weight.device)
    return (weight.float() * scales).to(dtype)


def quantize_block_fp8(weight: Tensor, block_size=(128, 128)) -> tuple[Tensor, Tensor]:
    """weight [out, in] float -> (q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/bo), ceil(in/bi)])."""
    bo, bi = _check_block(block_size)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D float tensor, got {weight.dtype} {list(weight.shape)}")
    out, inp = weight.shape
    po, pi = math.ceil(out / bo) * bo, math.ceil(inp / bi) * bi
    w = torch.zeros(po, pi, dtype=torch.float32, device=weight.device)
    w[:out, :inp] = weight.float()
    blocks = w.view(po // bo, bo, pi // bi, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [nbo, nbi]
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(po, pi)[:out, :inp].contiguous(), scale
