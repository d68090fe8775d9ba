"""Boundary checks of the FP8 quantization ops (``ops.store_e4m3``, ``ops.quantize_query_e4m3``,
``ops.absorb_query_e4m3``) and of the float pool's store that shares their kernel (``ops.store_rows``).

As ``validate.py`` for the attention ops: shapes, dtypes and devices only (no tensor value read, no sync,
legal during CUDA-graph capture); every error a ``ValueError`` / ``TypeError`` naming the argument.
"""

from __future__ import annotations

import torch

from . import _checks as chk
from .validate_matmul import check_head_matmul

Tensor = torch.Tensor
KERNELS = "the FP8 Triton kernels"


def check_store_e4m3(out, loc, x, scale, rest=None) -> None:
    """Validate ``store_e4m3``: out [S, W] e4m3, loc [T] int64/int32, x [T, W] float (or x [T, W1] and rest
    [T, W - W1], one dtype), scale [1] float32, one device."""
    _check_store(out, loc, x, scale, rest, e4m3=True)


def check_store_rows(out, loc, x, rest=None) -> None:
    """Validate ``store_rows``: out [S, W] and x [T, W] float32 / float16 / bfloat16 (or x [T, W1] and rest
    [T, W - W1], one dtype), loc [T] int64/int32, one device."""
    _check_store(out, loc, x, None, rest, e4m3=False)


def _check_store(out, loc, x, scale, rest, *, e4m3: bool) -> None:
    """Both stores, in one order: an e4m3 ``out`` with ``scale`` [1] float32, or a float ``out`` (no scale); the
    row given whole (x) or in two parts (x, then rest)."""
    chk.tensor(out, "out")
    chk.tensor(loc, "loc")
    chk.tensor(x, "x")
    if rest is not None:
        chk.tensor(rest, "rest")
    if e4m3:
        chk.tensor(scale, "scale")
        if out.dtype != torch.float8_e4m3fn:
            raise ValueError(f"out must be float8_e4m3fn, got {out.dtype}")
    elif out.dtype not in chk.TRITON_FLOAT_DTYPES:
        raise ValueError(f"out must be float32, float16 or bfloat16 (store_e4m3 for an e4m3 pool), got {out.dtype}")
    chk.rank(out, "out", 2, "[S, W]")
    chk.rank(x, "x", 2, "[T, W]")
    if x.dtype not in chk.TRITON_FLOAT_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if rest is None and x.shape[1] != out.shape[1]:
        raise ValueError(f"x must have out's width {out.shape[1]}, got shape {tuple(x.shape)}")
    if rest is not None:
        chk.rank(rest, "rest", 2, "[T, W - W1]")
        if rest.dtype != x.dtype:
            raise ValueError(f"rest must have x's dtype {x.dtype}, got {rest.dtype}")
        if rest.shape[0] != x.shape[0] or x.shape[1] + rest.shape[1] != out.shape[1]:
            raise ValueError(f"x and rest must be [T, W1] and [T, W - W1] with W1 + (W - W1) = out's width "
                             f"{out.shape[1]}, got {tuple(x.shape)} and {tuple(rest.shape)}")
    if loc.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"loc must be int64 or int32, got {loc.dtype}")
    if tuple(loc.shape) != (x.shape[0],):
        raise ValueError(f"loc must be [T] = [{x.shape[0]}] (one slot per row of x), got shape {tuple(loc.shape)}")
    if e4m3 and (scale.dtype != torch.float32 or tuple(scale.shape) != (1,)):
        raise ValueError(f"scale must be a [1] float32 tensor, got {tuple(scale.shape)} {scale.dtype}")
    parts = ((x, "x"),) + (((rest, "rest"),) if rest is not None else ())
    for t, name in ((loc, "loc"),) + parts + (((scale, "scale"),) if e4m3 else ()):
        chk.same_device(t, name, out.device, "out")
    chk.last_dim_contiguous(out, "out", KERNELS)
    for t, name in parts:
        chk.last_dim_contiguous(t, name, KERNELS)


def check_quantize_query(q_a, q_b) -> None:
    """Validate ``quantize_query_e4m3``: q_a [T, H, DA], q_b [T, H, DB], one float dtype and device."""
    chk.tensor(q_a, "q_a")
    chk.tensor(q_b, "q_b")
    chk.rank(q_a, "q_a", 3, "[T, H, DA]")
    chk.rank(q_b, "q_b", 3, "[T, H, DB]")
    if q_a.dtype not in chk.TRITON_FLOAT_DTYPES:
        raise ValueError(f"q_a must be float32, float16 or bfloat16, got {q_a.dtype}")
    if q_b.dtype != q_a.dtype:
        raise ValueError(f"q_b dtype must match q_a's {q_a.dtype}, got {q_b.dtype}")
    if tuple(q_b.shape[:2]) != tuple(q_a.shape[:2]):
        raise ValueError(f"q_b must be [T, H, DB] with q_a's T, H = {tuple(q_a.shape[:2])}, got {tuple(q_b.shape)}")
    chk.same_device(q_b, "q_b", q_a.device, "q_a")
    chk.last_dim_contiguous(q_a, "q_a", KERNELS)
    chk.last_dim_contiguous(q_b, "q_b", KERNELS)


def check_absorb_query(q_nope, w_uk, q_rope) -> None:
    """Validate ``absorb_query_e4m3``: ``head_matmul``'s checks of q_nope [T, H, K] and w_uk [H, K, R], and q_rope
    [T, H, DB] of their dtype and device."""
    check_head_matmul(q_nope, w_uk, None, names=("q_nope", "w_uk", "out"))
    chk.tensor(q_rope, "q_rope")
    chk.rank(q_rope, "q_rope", 3, "[T, H, DB]")
    chk.same_dtype(q_rope, "q_rope", q_nope.dtype, "q_nope")
    if tuple(q_rope.shape[:2]) != tuple(q_nope.shape[:2]):
        raise ValueError(f"q_rope must be [T, H, DB] with q_nope's T, H = {tuple(q_nope.shape[:2])}, "
                         f"got {tuple(q_rope.shape)}")
    chk.same_device(q_rope, "q_rope", q_nope.device, "q_nope")
    chk.last_dim_contiguous(q_rope, "q_rope", KERNELS)
