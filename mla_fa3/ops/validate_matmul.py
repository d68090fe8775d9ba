"""Boundary checks of ``ops.head_matmul`` (the per-head matmul of MLA's absorption and output projection).

As ``validate.py`` for the attention ops: shapes, dtypes and devices only (no tensor value read, no sync, legal
during CUDA-graph capture); every error a ``ValueError`` / ``TypeError`` naming the argument.
"""

from __future__ import annotations

from . import _checks as chk

KERNEL = "the per-head matmul kernel"


def check_head_matmul(x, w, out, names=("x", "w", "out")) -> None:
    """Validate ``head_matmul``: x [T, H, K], w [H, K, N], out [T, H, N] or None; one float dtype and device, last
    dimensions contiguous. ``names``: the three arguments' names in the caller's words (errors name them)."""
    xn, wn, on = names
    chk.tensor(x, xn)
    chk.tensor(w, wn)
    chk.rank(x, xn, 3, "[T, H, K]")
    chk.rank(w, wn, 3, "[H, K, N]")
    if x.dtype not in chk.TRITON_FLOAT_DTYPES:
        raise ValueError(f"{xn} must be float32, float16 or bfloat16, got {x.dtype}")
    chk.same_dtype(w, wn, x.dtype, xn)
    chk.same_device(w, wn, x.device, xn)
    if w.shape[0] != x.shape[1] or w.shape[1] != x.shape[2]:
        raise ValueError(f"{wn} must be [H, K, N] with {xn}'s H, K = {tuple(x.shape[1:])}, got {tuple(w.shape)}")
    if out is not None:
        chk.tensor(out, on)
        want = (x.shape[0], x.shape[1], w.shape[2])
        if tuple(out.shape) != want:
            raise ValueError(f"{on} must be [T, H, N] = {list(want)}, got {tuple(out.shape)}")
        chk.same_dtype(out, on, x.dtype, xn)
        chk.same_device(out, on, x.device, xn)
        chk.last_dim_contiguous(out, on, KERNEL)
    chk.last_dim_contiguous(x, xn, KERNEL)
    chk.last_dim_contiguous(w, wn, KERNEL)


def check_output_projection(w_uv, num_heads: int, head_dim_v: int, dtype, device) -> None:
    """Validate the output projection given to ``splitkv_mla_with_kvcache`` (``w_uv``): ``[H, head_dim_v, N]`` of the
    attention's heads and value width, in its output dtype, on its device, last dimension contiguous."""
    chk.tensor(w_uv, "w_uv")
    chk.rank(w_uv, "w_uv", 3, "[H, head_dim_v, N]")
    if w_uv.shape[0] != num_heads or w_uv.shape[1] != head_dim_v or w_uv.shape[2] < 1:
        raise ValueError(f"w_uv must be [H, head_dim_v, N] = [{num_heads}, {head_dim_v}, N >= 1], got "
                         f"{tuple(w_uv.shape)}")
    chk.same_dtype(w_uv, "w_uv", dtype, "the attention's output")
    chk.same_device(w_uv, "w_uv", device, "q")
    chk.last_dim_contiguous(w_uv, "w_uv", KERNEL)
