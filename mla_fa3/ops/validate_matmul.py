"""Boundary checks of ``ops.head_matmul`` (the per-head matmul of MLA's absorption and output projection).

As ``validate.py`` for the attention ops: shapes, dtypes and devices only (no tensor value read, no sync, legal
during CUDA-graph capture); every error a ``ValueError`` / ``TypeError`` naming the argument.
"""

from __future__ import annotations

import torch

from . import _checks as chk

MATMUL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)



def check_head_matmul(x, w, out) -> None:
    """Validate ``head_matmul``: x [T, H, K], w [H, K, N], out [T, H, N] or None; one float dtype and device, last
    dimensions contiguous."""
    chk.tensor(x, "x")
    chk.tensor(w, "w")
    chk.rank(x, "x", 3, "[T, H, K]")
    chk.rank(w, "w", 3, "[H, K, N]")
    if x.dtype not in MATMUL_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    chk.same_dtype(w, "w", x.dtype, "x")
    chk.same_device(w, "w", x.device, "x")
    if w.shape[0] != x.shape[1] or w.shape[1] != x.shape[2]:
        raise ValueError(f"w must be [H, K, N] with x's H, K = {tuple(x.shape[1:])}, got {tuple(w.shape)}")
    if out is not None:
        chk.tensor(out, "out")
        want = (x.shape[0], x.shape[1], w.shape[2])
        if tuple(out.shape) != want:
            raise ValueError(f"out must be [T, H, N] = {list(want)}, got {tuple(out.shape)}")
        chk.same_dtype(out, "out", x.dtype, "x")
        chk.same_device(out, "out", x.device, "x")
        chk.contiguous_rows(out, "out")
    chk.contiguous_rows(x, "x")
    chk.contiguous_rows(w, "w")
