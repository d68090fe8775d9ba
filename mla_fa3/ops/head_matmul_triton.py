"""Per-head matmul of a few rows in Triton: MLA's absorption ``q_lat = q_nope · W_UK`` and output projection
``o = o_lat · W_UVᵀ`` at decode batch sizes, one launch.

Contract (``ops.head_matmul``; its torch reference is ``torch.bmm`` over heads)::

    out[t, h, :] = x[t, h, :] @ w[h]          x [T, H, K], w [H, K, N], out [T, H, N]; fp32 accumulation

At decode the T rows are few (one query token per request) and the weights many: 16.8 MB per layer for each of
DeepSeek-V3's two projections at 128 heads. ``torch.bmm`` (cuBLAS) runs them as H tiny GEMMs. Here one program per
(head, block of N columns) loads its [K, BLOCK_N] slice of w[h] once (columns contiguous: coalesced) and every row
of x against it — a weight-streaming kernel, with enough programs (``block_n``) to keep every SM loading. Measured
on the H200, weights rotated past the L2 (docs/PERFORMANCE_HISTORY.md, "The absorption and output projection at decode"):
6.5 / 6.4 µs against cuBLAS's 6.9 / 6.7 for W_UK / W_UV at 128 heads, one row (2.6 TB/s), 2.7 / 3.3 against 3.4 / 3.7
at 16 heads; 1.05-1.26x cuBLAS up to 16 rows, 0.95-0.99x at 128 heads, 32 rows (an H100: 1.00-1.03x there)::

    for (h, nb) in grid(H, N / BLOCK_N):
        acc[T_pad, BLOCK_N] = 0
        for k0 in range(0, K, BLOCK_K):
            acc += x[:, h, k0:k0+BLOCK_K] @ w[h, k0:k0+BLOCK_K, nb·BLOCK_N:(nb+1)·BLOCK_N]
        out[:, h, nb·BLOCK_N:...] = acc (rounded to out's dtype)
        [AMAX] partial[h · NB + nb] = max |rounded acc| (and, nb = 0, max |b[:, h, :]|); NaN if any is NaN

``AMAX`` is the FP8 query's first launch fused in (``fp8_triton.absorb_query_e4m3``): the absorbed q_lat's absmax
partials (and q_rope's, ``b``) come out of the same launch that computes q_lat, so the quantization needs one
launch more, not two. Rows are one M tile (T <= ``MAX_ROWS``; the op, ``ops.head_matmul``, runs ``torch.bmm`` above
its own ``HEAD_MATMUL_MAX_ROWS``, where cuBLAS is faster). Programmatic dependent launch (sm_90+): ``PDL`` makes the
program wait for the previous kernel's writes (``griddepcontrol.wait``) and lets the next launch start once its
weights are read.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_capable

Tensor = torch.Tensor
MAX_ROWS = 64  # rows (T) of one launch: a single M tile of acc [rows, block_n] fp32
MIN_PROGRAMS = 64  # block_n shrinks (64 -> 32 -> 16) until the grid has this many programs (H100: 32 at 16 heads, W_UV)
BLOCK_K = 128


@triton.jit
def _head_matmul_kernel(X, W, Out, B, Partial, T, K, N, DB,
                        stride_xt, stride_xh, stride_wh, stride_wk, stride_ot, stride_oh, stride_bt, stride_bh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DB: tl.constexpr,
                        AMAX: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    h = tl.program_id(0)
    nb = tl.program_id(1)
    if PDL:  # launched before the previous kernel ended: wait for its writes (x may be its output)
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < T
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    x_row = X + rows.to(tl.int64) * stride_xt + h.to(tl.int64) * stride_xh
    w_head = W + h.to(tl.int64) * stride_wh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_row[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_head + ks.to(tl.int64)[:, None] * stride_wk + cols[None, :],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc=acc)
    if PDL:  # the weights are read: the next launch may start (it waits for this grid's writes)
        tl.extra.cuda.gdc_launch_dependents()
    y = acc.to(Out.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(Out + rows.to(tl.int64)[:, None] * stride_ot + h.to(tl.int64) * stride_oh + cols[None, :], y, mask=mask)
    if AMAX:  # the rounded values the quantization reads: their largest |.|, NaN if one is NaN
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        amax = tl.max(tl.max(tl.abs(yf), 1), 0)
        nans = tl.sum(tl.sum((yf != yf).to(tl.int32), 1), 0)
        if nb == 0:  # this head's part of b (q_rope) joins the first column block's partial
            offs = tl.arange(0, BLOCK_DB)
            bv = tl.load(B + rows.to(tl.int64)[:, None] * stride_bt + h.to(tl.int64) * stride_bh + offs[None, :],
                         mask=row_ok[:, None] & (offs < DB)[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(bv), 1), 0))
            nans += tl.sum(tl.sum((bv != bv).to(tl.int32), 1), 0)
        tl.store(Partial + h * tl.num_programs(1) + nb, tl.where(nans > 0, float("nan"), amax))


def block_n_for(heads: int, n: int) -> int:
    """Columns per program: the largest of 64 / 32 / 16 giving >= ``MIN_PROGRAMS`` programs (else 16)."""
    for block_n in (64, 32, 16):
        if heads * triton.cdiv(n, block_n) >= MIN_PROGRAMS:
            return block_n
    return 16


def head_matmul(x: Tensor, w: Tensor, out: Tensor, *, b: Optional[Tensor] = None, partial: Optional[Tensor] = None,
                block_n: Optional[int] = None) -> None:
    """out[t, h] = x[t, h] @ w[h] in one launch (validated by the caller; 1 <= T <= MAX_ROWS).

    ``partial`` ([H · cdiv(N, block_n)] float32) also receives the absmax partials of the rounded output (and of
    ``b`` [T, H, DB], in the first column block of each head). ``block_n``: None picks ``block_n_for``."""
    T, H, K = x.shape
    if not 1 <= T <= MAX_ROWS:
        raise ValueError(f"the per-head matmul kernel takes 1 to {MAX_ROWS} rows in one tile, got {T}")
    N = w.shape[2]
    block_n = block_n or block_n_for(H, N)
    amax = partial is not None
    pdl = pdl_capable(x.device)
    bb = b if b is not None else x
    _head_matmul_kernel[(H, triton.cdiv(N, block_n))](
        x, w, out, bb, partial if amax else out, T, K, N, bb.shape[2] if b is not None else 0,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), bb.stride(0), bb.stride(1),
        BLOCK_M=max(16, triton.next_power_of_2(T)), BLOCK_N=block_n,
        BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(K))),
        BLOCK_DB=max(16, triton.next_power_of_2(bb.shape[2])) if b is not None else 16,
        AMAX=amax, IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=4, num_stages=3, **launch_options(pdl))
