"""The tree part of a speculative tree step in Triton: ``ops.tree_attention`` in one launch (``triton`` is imported
only by the kernel modules; this one is imported by ``tree_attention.py`` only when it runs the kernel).

Contract of ``ops.tree_attention`` (its torch form is the reference): query row i of request b (token-major row
``t = b·m + i``) attends, head by head, to the tree keys ``j`` its mask shows, ``mask[b, i, j]``, whose latent rows
are ``kv[key_slots[b, j]]`` = [c_kv (r) | k_rope (d_rope)]; returns out ``[T, H, r]`` in q's dtype and the natural-log
LSE ``[T, H]`` float32 (-inf, out 0, for a row that sees no key).

The torch form materializes q in fp32 and the scores ``[bs, m, H, n]`` (at bs 32, 64 draft tokens, 128 heads:
540 MB of fp32 q and 67 MB of scores per layer). Here the (row, head) pairs of one request are the M dimension of
a tile — FlashMLA's trick for MLA decode, where every head reads the same latent rows — so each program reads its
request's tree keys (n <= 64 rows, an L2 hit after the first program) once per 64 or 128 pairs:

    for (b, mb) in grid(bs, cdiv(m·H, BLOCK_M)):
        pairs p = mb·BLOCK_M + [0, BLOCK_M)          (row i = p // H, head h = p % H; t = b·m + i)
        vis[p, j] = mask[b, i, j];  any[j] = OR_p vis[p, j]   (keys no pair of the tile sees are never loaded)
        s[p, j] = scale · (Σ_chunks q_lat[t, h, c]·c_kv[j, c] + q_rope[t, h]·k_rope[j])   (· kv_scale for e4m3)
        s = softcap · tanh(s / softcap) if softcap > 0;  s = -inf where not vis
        mx = rowmax(s);  e = exp(s - mx);  l = rowsum(e);  lse = mx + ln l   (l = 0: lse -inf, e 0)
        for each chunk c of r:  out[t, h, c] = (e / l) @ c_kv[:, c]   (· kv_scale), rounded once to q's dtype

With a prior state (``prior=(o_P, lse_P)``: the prefix part, a disjoint key set) the merge is fused: lse =
ln(e^lse_P + e^lse_T), P is scaled by e^(lse_T - lse) and each output chunk gains e^(lse_P - lse) · o_P before its
one rounding — no separate merge kernel, no rounding of the tree part on its own.

With ``out_splits`` > 1 the grid gains a third axis: each of a tile's programs computes the whole score tile again
(the keys are an L2 hit) and writes only its group of ``r / out_splits`` output columns — more programs, each a
shorter P·V loop, for the small grids of a tree step at bs 1 (16 heads, 8 draft tokens: two tiles). The LSE is
written by group 0.

The dots take q's dtype (an e4m3 key tile is converted to it in registers: exact for fp16 / bf16 / fp32) with fp32
accumulation; fp32 inputs run them in IEEE fp32, not TF32. The probabilities enter P·V in q's dtype (as FA3 and
FlashMLA round P to bf16). The key tile is loaded twice (scores, then P·V): the second load is an L2 hit. No host
value is read: capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor
MAX_KEYS = 128  # n: one tile of keys (a draft tree has at most a few dozen)


@triton.jit
def _tree_attention_kernel(QL, QR, KV, Slots, Mask, Out, Lse, KVScale, PriorO, PriorLse, m, H, n, scale, softcap,
                           stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_kv, stride_sb,
                           stride_mb, stride_mi, stride_ot, stride_oh, stride_lt, stride_pot, stride_poh,
                           stride_plt, stride_plh,
                           R: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
                           IEEE: tl.constexpr, PRIOR: tl.constexpr, OUT_COLS: tl.constexpr):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    cs = tl.program_id(2)  # output column group: columns [cs·OUT_COLS, (cs + 1)·OUT_COLS) of r
    pairs = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ok = pairs < m * H
    i = pairs // H
    h = pairs % H
    t = (b * m + i).to(tl.int64)
    keys = tl.arange(0, BLOCK_N)
    key_ok = keys < n
    vis = tl.load(Mask + b.to(tl.int64) * stride_mb + i[:, None].to(tl.int64) * stride_mi + keys[None, :],
                  mask=pair_ok[:, None] & key_ok[None, :], other=0) != 0          # [BLOCK_M, BLOCK_N]
    seen = tl.max(vis.to(tl.int32), axis=0) > 0                                  # [BLOCK_N]
    slots = tl.load(Slots + b.to(tl.int64) * stride_sb + keys, mask=seen, other=0)
    kv_row = KV + slots * stride_kv                                               # [BLOCK_N] pointers
    q_row = QL + t * stride_qlt + h.to(tl.int64) * stride_qlh                     # [BLOCK_M] pointers
    dt = QL.dtype.element_ty

    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c0 in range(0, R, BLOCK_R):
        cols = c0 + tl.arange(0, BLOCK_R)
        col_ok = cols < R
        q = tl.load(q_row[:, None] + cols[None, :], mask=pair_ok[:, None] & col_ok[None, :], other=0.0)
        k = tl.load(kv_row[:, None] + cols[None, :], mask=seen[:, None] & col_ok[None, :], other=0.0).to(dt)
        if IEEE:
            s += tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s += tl.dot(q, tl.trans(k))
    rcols = tl.arange(0, BLOCK_DR)
    rcol_ok = rcols < DR
    qr = tl.load(QR + t[:, None] * stride_qrt + h[:, None].to(tl.int64) * stride_qrh + rcols[None, :],
                 mask=pair_ok[:, None] & rcol_ok[None, :], other=0.0)
    kr = tl.load(kv_row[:, None] + R + rcols[None, :], mask=seen[:, None] & rcol_ok[None, :], other=0.0).to(dt)
    if IEEE:
        s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
    else:
        s += tl.dot(qr, tl.trans(kr))

    s = s * scale
    if FP8:
        kv_scale = tl.load(KVScale)
        s = s * kv_scale
    if SOFTCAP:  # softcap · tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates to ±1, no overflow)
        s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0))
    s = tl.where(vis, s, float("-inf"))
    mx = tl.max(s, axis=1)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    e = tl.exp2((s - mx_safe[:, None]) * 1.4426950408889634)  # exp(-inf) = 0 on masked keys
    l = tl.sum(e, axis=1)
    lse = tl.where(l > 0.0, mx_safe + tl.log(l), float("-inf"))
    inv = tl.where(l > 0.0, 1.0 / l, 0.0)
    if PRIOR:  # merge with the prior state: weights e^(lse_X - lse) of the union's lse (0 for an empty side)
        lse_p = tl.load(PriorLse + t * stride_plt + h.to(tl.int64) * stride_plh, mask=pair_ok,
                        other=float("-inf"))
        top = tl.maximum(lse, lse_p)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_t = tl.exp(lse - top)
        w_p = tl.exp(lse_p - top)
        tot = w_t + w_p
        inv_tot = tl.where(tot > 0.0, 1.0 / tot, 0.0)
        lse = tl.where(tot > 0.0, top + tl.log(tot), float("-inf"))
        inv = inv * (w_t * inv_tot)
        prior_w = w_p * inv_tot
        po_row = PriorO + t * stride_pot + h.to(tl.int64) * stride_poh
    tl.store(Lse + t * stride_lt + h, lse, mask=pair_ok & (pairs * 0 + cs == 0))  # group 0 writes the lse
    if FP8:
        inv = inv * kv_scale
    p = (e * inv[:, None]).to(dt)

    o_row = Out + t * stride_ot + h.to(tl.int64) * stride_oh
    for c0 in range(cs * OUT_COLS, tl.minimum(R, (cs + 1) * OUT_COLS), BLOCK_R):
        cols = c0 + tl.arange(0, BLOCK_R)
        col_ok = cols < R
        v = tl.load(kv_row[:, None] + cols[None, :], mask=seen[:, None] & col_ok[None, :], other=0.0).to(dt)
        if IEEE:
            o = tl.dot(p, v, input_precision="ieee")
        else:
            o = tl.dot(p, v)
        if PRIOR:
            po = tl.load(po_row[:, None] + cols[None, :], mask=pair_ok[:, None] & col_ok[None, :], other=0.0)
            o += prior_w[:, None] * po.to(tl.float32)
        tl.store(o_row[:, None] + cols[None, :], o.to(dt), mask=pair_ok[:, None] & col_ok[None, :])


# the grid's programs below which the output columns are split (``out_splits_for``); 0: never. Measured (H100,
# 2026-12-07, docs/PERFORMANCE.md "Inside SGLang", eighth run): SGLang's tree verify at 16 heads, bs 1 / 8 / 32,
# 8-64 draft tokens, 1.10-1.23x SGLang's fa3 with this rule against 0.98-1.20x unsplit (fifth run: 1024 the same as
# 256); the kernel alone gains up to 1.6x on grids of 2-128 programs and loses from 512 (bs 32 x 64 draft tokens:
# 50 -> 67 us at 2 groups)
SPLIT_BELOW_PROGRAMS = 256


def out_splits_for(programs: int, r: int, block_r: int) -> int:
    """Output column groups for a grid of ``programs`` tiles: up to 4 (each a whole number of ``block_r`` columns)
    while the grid has fewer than ``SPLIT_BELOW_PROGRAMS`` programs, else 1."""
    chunks = triton.cdiv(r, block_r)
    splits = 1
    while splits < 4 and splits * 2 <= chunks and programs * splits < SPLIT_BELOW_PROGRAMS:
        splits *= 2
    return splits


def block_m_for(heads: int) -> int:
    """(row, head) pairs per program: 128 from 128 heads up (two head tiles per query row would read its keys twice
    as often), else 64 — 4 rows of 16 heads, a row's 64 heads, or 32 rows of 2."""
    return 128 if heads >= 128 else 64


def tree_attention(q_lat: Tensor, q_rope: Tensor, kv: Tensor, key_slots: Tensor, mask: Tensor, *,
                   softmax_scale: float, softcap: float, kv_scale: Optional[Tensor],
                   prior: Optional[Tuple[Tensor, Tensor]] = None, out_splits: Optional[int] = None
                   ) -> Tuple[Tensor, Tensor]:
    """Launch (arguments checked by ``ops.tree_attention``): returns (out [T, H, r] q's dtype, lse [T, H] float32),
    merged with ``prior`` (o [T, H, r], lse [T, H] float32) when given. ``out_splits``: output column groups (a
    power of two, at most r's column blocks; None: ``out_splits_for`` the grid)."""
    bs, m, n = mask.shape
    T, H, r = q_lat.shape
    dr = q_rope.shape[2]
    if n > MAX_KEYS:
        raise ValueError(f"the tree kernel takes at most {MAX_KEYS} tree keys per request, got {n}")
    prior_o, prior_lse = prior if prior is not None else (None, None)
    for x, name in ((q_lat, "q_lat"), (q_rope, "q_rope"), (kv, "kv"), (prior_o, "prior's o")):
        if x is None:
            continue
        if x.shape[-1] and x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous for the tree kernel (stride {x.stride(-1)})")
    out = torch.empty(T, H, r, dtype=q_lat.dtype, device=q_lat.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q_lat.device)
    if T == 0 or H == 0:
        return out, lse
    mask_c = mask.contiguous()
    slots = key_slots.contiguous()
    block_m = block_m_for(H)
    fp8 = kv_scale is not None
    scale_arg = kv_scale if fp8 else lse  # an unused pointer when not FP8
    po, pl = (out, lse) if prior is None else (prior_o, prior_lse)  # unused pointers without a prior
    block_r = min(64, max(16, triton.next_power_of_2(r)))
    tiles = bs * triton.cdiv(m * H, block_m)
    if out_splits is None:
        out_splits = out_splits_for(tiles, r, block_r)
    chunks = triton.cdiv(r, block_r)
    if isinstance(out_splits, bool) or not isinstance(out_splits, int) or not 1 <= out_splits <= chunks or \
            out_splits & (out_splits - 1):
        raise ValueError(f"out_splits must be a power of two in [1, {chunks}] (r = {r} in blocks of {block_r}), got "
                         f"{out_splits!r}")
    grid = (bs, triton.cdiv(m * H, block_m), out_splits)
    _tree_attention_kernel[grid](
        q_lat, q_rope, kv, slots, mask_c.view(torch.int8), out, lse, scale_arg, po, pl, m, H, n,
        float(softmax_scale), float(softcap),
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0), slots.stride(0),
        mask_c.stride(0), mask_c.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        po.stride(0), po.stride(1), pl.stride(0), pl.stride(1),
        R=r, DR=dr, BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(n)),
        BLOCK_R=block_r, BLOCK_DR=max(16, triton.next_power_of_2(dr)),
        FP8=fp8, SOFTCAP=softcap > 0, IEEE=q_lat.dtype == torch.float32, PRIOR=prior is not None,
        OUT_COLS=triton.cdiv(chunks, out_splits) * block_r,
        num_warps=8 if block_m == 128 else 4, num_stages=2)
    return out, lse
