"""Phase 2 of the split-KV decode (``splitkv_triton.py`` has phase 1 and launches both): the combine.

Phase 1 leaves, per split s of request b (the slots ``split_offsets[b] .. split_offsets[b+1]``), the normalized
partial output ``part_o[s]`` and its base-2 LSE ``part_lse2[s]`` (-inf: an empty split). The combine merges them
per (request, query, head):

    # one program per (request, query, head) and block of r columns; it loads BLOCK_S splits at a time (a
    # [splits, columns] tile, ``combine_tile``) in one pass, the running maximum M rescaling the sums so far
    # (as phase 1 does over keys)
    for (b·i·h, vb) in grid(bs·sq·H, r / BLOCK_DV):
        S = slots split_offsets[b] .. split_offsets[b+1]
        M = max_s part_lse2[s];  w_s = 2^(part_lse2[s] - M);  W = Σ_s w_s
        out = Σ_s w_s · part_o[s] / W;  lse = (M + log2 W) · ln 2   (no split / W = 0: 0, -inf)

An e4m3 cache's scale (``descale_k``) folds into ``out`` here. Launched as a programmatic dependent of phase 1
(``pdl``), it reads the split offsets (written before phase 1 launched) while phase 1 still runs, and the partials
only after ``griddepcontrol.wait``.

Why the combine is a second launch, not "the last program of a request combines": that program
would read every split of the request alone (bs 1, 16 heads, 256 splits: 4-8 MB through one SM,
tens of µs); the separate launch spreads the same bytes over bs·sq·H·(r/64) programs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .pdl import launch_options
from .splitkv_config import check_combine_tile, combine_tile
from .splitkv_plan import _next_pow2

Tensor = torch.Tensor


@triton.jit
def _splitkv_combine_kernel(
    PartO, PartLse2, SplitOffsets, Out, Lse, DescaleK,
    stride_ow, stride_os, stride_oh,
    stride_lw, stride_ls,
    stride_outb, stride_outs, stride_outh,
    stride_lseb, stride_lses,
    H: tl.constexpr, SQ: tl.constexpr, DV: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, KV8: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)  # (b, i, h) of the output
    vb = tl.program_id(1)
    b = row // (SQ * H)
    i = (row // H) % SQ
    h = row % H
    cols = vb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    c_ok = cols < DV
    # the split offsets were written before phase 1 passed its own wait (this grid launches only after every phase-1
    # program has): read them while phase 1 runs; its partials only after the wait (PDL: launched early)
    s0 = tl.load(SplitOffsets + b)
    s1 = tl.load(SplitOffsets + b + 1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    lse_base = PartLse2 + i * stride_ls + h
    o_base = PartO + i * stride_os + h * stride_oh

    # one pass, the running maximum rescaling what is summed so far (as phase 1 does over keys): w_s = 2^(lse2_s - top)
    top = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
    for c in range(s0, s1, BLOCK_S):
        slots = c + tl.arange(0, BLOCK_S)
        ok = slots < s1
        lse2 = tl.load(lse_base + slots * stride_lw, mask=ok, other=float("-inf"))
        part = tl.load(o_base + slots[:, None] * stride_ow + cols[None, :], mask=ok[:, None] & c_ok[None, :],
                       other=0.0).to(tl.float32)
        new_top = tl.maximum(top, tl.max(lse2, 0))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp2(top - safe)  # 0 while nothing was seen (top = -inf)
        wgt = tl.exp2(lse2 - safe)
        acc = acc * rescale + wgt[:, None] * part
        total = total * rescale + wgt
        top = new_top
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.sum(total, 0)
    live = denom > 0.0
    out = tl.sum(acc, 0) / tl.where(live, denom, 1.0)
    if KV8:
        out = out * tl.load(DescaleK)
    out_ptr = Out + b.to(tl.int64) * stride_outb + i * stride_outs + h * stride_outh + cols
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=c_ok)
    if vb == 0:
        lse = tl.where(live, (top + tl.log2(tl.where(live, denom, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + b.to(tl.int64) * stride_lseb + i * stride_lses + h, lse)


def combine_splits(part_o: Tensor, part_lse2: Tensor, split_offsets: Tensor, out: Tensor, lse: Tensor,
                   descale_k: Optional[Tensor] = None, *, pdl: bool = False,
                   tile: Optional[Tuple[int, int]] = None) -> None:
    """Phase 2 alone, into ``out [bs, sq, H, r]`` and ``lse [bs, sq, H]`` (natural log): request b's splits are the
    slots ``split_offsets[b] .. split_offsets[b + 1]`` of ``part_o [slots, sq, H, r]`` (float32 or the output
    dtype) and ``part_lse2 [slots, sq, H]`` (base 2; -inf: an empty split). ``descale_k``: an e4m3 cache's scale,
    folded into ``out``. ``pdl``: launched as a programmatic dependent of the phase-1 launch just before it.
    ``tile``: (splits per load, columns), powers of two, instead of ``combine_tile``'s (``bench.splitkv_phases``
    compares them)."""
    bs, sq, H, dv = out.shape
    one = lse  # any float32 pointer: read only with descale_k
    block_s, cdv = combine_tile(bs * sq * H) if tile is None else check_combine_tile(tile)
    cdv = min(cdv, _next_pow2(dv))
    _splitkv_combine_kernel[(bs * sq * H, -(-dv // cdv))](
        part_o, part_lse2, split_offsets, out, lse, one if descale_k is None else descale_k,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse2.stride(0), part_lse2.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        H=H, SQ=sq, DV=dv, BLOCK_S=block_s, BLOCK_DV=cdv, KV8=descale_k is not None, PDL=pdl,
        num_warps=4 if block_s * cdv <= 4096 else 8, **launch_options(pdl),
    )
