"""Fused FP8 (e4m3) quantization in Triton: the pool store (one launch), the query (two launches) and the absorbed
query (two: ``absorb_query_e4m3``, the per-head matmul of ``head_matmul_triton.py`` writing q_lat and the absmax
partials, then the query's launch 2). The same store kernel serves a float pool (``store_rows``: a cast instead of
the quantization), one launch in place of torch's indexed assignment.

Contracts and torch reference: ``fp8.py`` (``quantize_e4m3`` + a scatter, ``quantize_e4m3_dynamic``);
the results are the reference's bit for bit (NaN payloads aside). Validation is the caller's
(``ops.store_e4m3`` / ``ops.store_rows`` / ``ops.quantize_query_e4m3``); nothing here reads a tensor value on the
host, so all are legal inside a CUDA graph (the query's two work buffers come from ``torch.empty``). A store's slot
outside the buffer is skipped, not written (the values of ``loc`` are the caller's: the pools check them).

Store, one program per (block of rows, block of columns):

    s = scale[0];  y = x[t, c] / s (fp32, div_rn);  y = 0 if NaN;  y = clamp(y, ±448)
    out[loc[t], c] = e4m3(y)                  # a float pool (store_rows): out[loc[t], c] = x[t, c] in out's dtype

Query (``q = [a | b]`` given as its two parts, e.g. ``q_lat`` [T, H, r] and a strided ``q_rope``
view [T, H, d_rope]: the concatenation is never materialized in the input dtype):

    # launch 1, P <= MAX_PARTIALS programs, each strides over blocks of rows (t, h):
    partial[p] = max |a|, |b| over its rows          (NaN if any element is NaN)
    # launch 2, one program per block of rows: every program reduces the P partials itself
    amax = max_p partial[p] (NaN if any);  s = max(amax, 2^-100) / 448   (fp32, div_rn; NaN stays NaN)
    out[t, h] = e4m3([a | b] / s);  program 0 writes descale[0] = s

Up to ``QUANT_PDL_MAX_ROWS`` rows both launch as programmatic dependent launches (as split-KV's phases): launch 2
starts while launch 1 runs and waits (``griddepcontrol.wait``) for its partials; launch 1 waits likewise for q's
producer. What each reads and writes is unchanged. Measured on an H100: 0.2-1.2 µs less per call from 16 to 1024
rows, 0.3 µs more at 8192 (docs/PERFORMANCE_HISTORY.md, "The query quantization's launches chained").

The absorbed query (``absorb_query_e4m3``) replaces launch 1 by the absorption itself: the per-head matmul's programs
each write their absmax partial of the rounded q_lat (and of q_rope), and launch 2 reads those — one launch fewer,
the same bytes out as ``quantize_query_e4m3`` of the same q_lat.

The two-launch split is the price of a global maximum without a grid-wide barrier (and without an
atomic max, which would need a zeroed buffer: a third launch). One launch in which every program reduces
the whole of q itself was measured on the H200: 1 µs faster at 16 rows, slower from 64 rows on (15 against
8 µs at 128), as each program walks q's blocks one after another (docs/PERFORMANCE_HISTORY.md, "a one-launch query
quantization tried").

The e4m3 bytes are computed in integer arithmetic (:func:`_e4m3_code`: round to nearest even, then
the bit fields) and stored through a uint8 view — no fp32 -> fp8 cast instruction: Triton's CPU
interpreter rounds that cast differently (not to nearest even; NaN to a finite code), so this way the
interpreter tests exercise exactly the arithmetic the GPU runs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import head_matmul_triton as hm
from .fp8 import DYNAMIC_TINY, FP8_DTYPE, FP8_E4M3_MAX
from .pdl import launch_options, pdl_capable

Tensor = torch.Tensor
STORE_BLOCK_W = 128  # columns per store program (576 = 4.5 blocks)
# rows per program of the store and of the query's two launches, by row count: (up to this many rows, rows per
# program). Each thread quantizes its elements one after another (a division and the integer rounding of
# ``_e4m3_code``), so at decode sizes fewer rows per program — more programs, fewer elements per thread — finish
# sooner. Measured on an H100 (docs/PERFORMANCE_HISTORY.md, 2026-12-06): the store 3.9-4.0 µs with 16 rows per
# program against 1.5-1.6 with 1 (1-64 rows), 4.3 against 2.4 with 4 (512 rows); the absorbed query 8.0-13.0 µs with
# 16 against 5.2-10.6 with 4 (16 and 128 heads, up to 2048 (t, h) rows), 16 fastest from 8192 rows on
STORE_BLOCK_T = ((64, 1), (1024, 4))  # more rows: 16 per program
QUANT_BLOCK_N = ((2048, 4),)  # (t, h) rows per block of both query launches; more rows: 16
MAX_PARTIALS = 256  # programs of the absmax launch (each later program reads all their partials)
# the query's two launches as programmatic dependent launches (CUDA sm_90+) up to this many (t, h) rows: measured on
# an H100, 0.2-1.2 µs less per call from 16 to 1024 rows, 0.3 µs more at 8192 (docs/PERFORMANCE_HISTORY.md); 0: never
QUANT_PDL_MAX_ROWS = 4096
# the store lets the next launch start as soon as all its programs run (``griddepcontrol.launch_dependents`` at its
# start: a programmatic dependent still waits for the store's writes) up to this many rows: split-KV's phase 1 then
# reads its prologue while the store runs (``splitkv_partials(follows_store=)``). Larger stores (prefill) keep the
# SMs to themselves
STORE_EARLY_DEPENDENTS_MAX_ROWS = 1024


@triton.jit
def _e4m3_code(y):
    """fp32 ``y`` (NaN, or finite with ``|y| <= 448 (1 + 2^-23)``) -> its e4m3 byte (int32 0..255):
    nearest value, ties to even; NaN -> 0x7F (with y's sign bit).

    Normal e4m3 (|y| >= 2^-6): keep 3 of fp32's 23 mantissa bits, rounding on the integer bits (a carry
    moves into the exponent by itself), then re-bias the exponent (127 -> 7). Subnormal (|y| < 2^-6,
    spacing 2^-9): ``(|y| + 2^14) - 2^14`` — fp32's spacing at 2^14 is 2^-9, so the add rounds to nearest
    even there — and the code is the count of 2^-9 (8 = 2^-6 is the smallest normal's code too)."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
    sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(y != y, 0x7F, code)
    return code | (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7)


@triton.jit
def _bf16_bits(x):
    """fp32 ``x`` -> the int16 bits of the nearest bfloat16, ties to even (NaN -> a quiet NaN with x's sign): the
    GPU's conversion, in integer arithmetic so that Triton's CPU interpreter (whose fp32 -> bf16 and fp16 -> bf16
    casts do not round to nearest even) runs what the GPU runs. A carry out of the mantissa moves into the exponent
    by itself (up to inf)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.int16)


@triton.jit
def _store_rows_kernel(X, X2, Scale, Loc, Out, T, W, W1, S, stride_loc, stride_x, stride_x2, stride_out,
                       E4M3: tl.constexpr, TO_BF16: tl.constexpr, MAX: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, TRIGGER: tl.constexpr):
    """out[loc[t], c] = [x | x2][t, c] (columns < W1 from x, the rest from x2), quantized to its e4m3 code (E4M3:
    Out is a uint8 view) or cast to Out's dtype (TO_BF16, fp32 / fp16 into bf16: rounded in integer arithmetic,
    ``_bf16_bits``). A slot outside [0, S) is not written (nothing past the buffer; the values of loc are the
    caller's to check). Loc is read with its stride: SGLang's EAGLE draft hands each step's ``out_cache_loc`` as a
    column of its [bs·topk, steps] slot table (``per_step_draft_out_cache_loc``: stride = steps). TRIGGER: the next
    launch, if a programmatic dependent, may start now (it waits for these writes before it reads them)."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_ok = rows < T
    slot = tl.load(Loc + rows.to(tl.int64) * stride_loc, mask=row_ok, other=0).to(tl.int64)
    row_ok = row_ok & (slot >= 0) & (slot < S)
    mask = row_ok[:, None] & (cols < W)[None, :]
    first = (cols < W1)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask & first, other=0.0)
    x2 = tl.load(X2 + r64 * stride_x2 + (cols - W1)[None, :], mask=mask & ~first, other=0.0)
    x = tl.where(first, x, x2)
    if E4M3:
        y = tl.math.div_rn(x.to(tl.float32), tl.load(Scale))
        y = tl.where(y != y, 0.0, y)
        y = tl.minimum(tl.maximum(y, -MAX), MAX)
        val = _e4m3_code(y).to(tl.uint8)
    elif TO_BF16:
        val = _bf16_bits(x.to(tl.float32)).to(tl.bfloat16, bitcast=True)
    else:
        val = x.to(Out.dtype.element_ty)
    tl.store(Out + slot[:, None] * stride_out + cols[None, :], val, mask=mask)


@triton.jit
def _abs_max_rows(P, rows, row_ok, H, stride_t, stride_h, D, BLOCK_D: tl.constexpr):
    """(max |x| per row, NaN count per row) of rows (t, h) = divmod(rows, H) of a [T, H, D] tensor."""
    cols = tl.arange(0, BLOCK_D)
    t = (rows // H).to(tl.int64)
    h = (rows % H).to(tl.int64)
    x = tl.load(P + t[:, None] * stride_t + h[:, None] * stride_h + cols[None, :],
                mask=row_ok[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    return tl.max(tl.abs(x), axis=1), tl.sum((x != x).to(tl.int32), axis=1)


@triton.jit
def _absmax_partial_kernel(A, B, Partial, N, H, stride_at, stride_ah, stride_bt, stride_bh, DA, DB, num_blocks,
                           BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the quantizing launch may start now (it waits for this grid's writes); q's producer's writes awaited
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    nans = tl.zeros([BLOCK_N], dtype=tl.int32)
    for blk in range(pid, num_blocks, tl.num_programs(0)):
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        ma, na = _abs_max_rows(A, rows, ok, H, stride_at, stride_ah, DA, BLOCK_DA)
        mb, nb = _abs_max_rows(B, rows, ok, H, stride_bt, stride_bh, DB, BLOCK_DB)
        amax = tl.maximum(amax, tl.maximum(ma, mb))
        nans += na + nb
    m = tl.max(amax, axis=0)
    tl.store(Partial + pid, tl.where(tl.sum(nans, axis=0) > 0, float("nan"), m))


@triton.jit
def _quantize_rows(P, Out, rows, row_ok, H, stride_t, stride_h, D, col0, OUT_W, s, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    t = (rows // H).to(tl.int64)
    h = (rows % H).to(tl.int64)
    mask = row_ok[:, None] & (cols < D)[None, :]
    x = tl.load(P + t[:, None] * stride_t + h[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
    y = tl.math.div_rn(x.to(tl.float32), s)
    code = _e4m3_code(y)  # y is finite (|y| <= 448 (1 + 2^-23)) or NaN: s > 0
    tl.store(Out + rows.to(tl.int64)[:, None] * OUT_W + col0 + cols[None, :], code.to(tl.uint8), mask=mask)


@triton.jit
def _quantize_query_kernel(A, B, Partial, Out, Descale, N, H, stride_at, stride_ah, stride_bt, stride_bh, DA, DB,
                           num_partials, MAX: tl.constexpr, TINY: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched while the absmax launch runs: wait for its partials
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK_P)
    part = tl.load(Partial + offs, mask=offs < num_partials, other=0.0)
    amax = tl.max(part, axis=0)
    amax = tl.where(tl.sum((part != part).to(tl.int32), axis=0) > 0, float("nan"), amax)
    s = tl.math.div_rn(tl.maximum(amax, TINY, propagate_nan=tl.PropagateNan.ALL), MAX)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(Descale, s)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    _quantize_rows(A, Out, rows, ok, H, stride_at, stride_ah, DA, 0, DA + DB, s, BLOCK_DA)
    _quantize_rows(B, Out, rows, ok, H, stride_bt, stride_bh, DB, DA, DA + DB, s, BLOCK_DB)


def rows_per_program(rows: int, rule: Tuple[Tuple[int, int], ...], otherwise: int = 16) -> int:
    """The rows per program that ``rule`` ((up to rows, rows per program), ascending) gives ``rows``."""
    for limit, block in rule:
        if rows <= limit:
            return block
    return otherwise


def store_e4m3(out: Tensor, loc: Tensor, x: Tensor, scale: Tensor, rest: Optional[Tensor] = None) -> None:
    """out[loc[t], :] = e4m3(clamp(row[t] / scale, ±448)) (NaN -> 0), row = x ([T, W]) or [x | rest]; out [S, W]
    (last dims contiguous)."""
    _store_rows(out.view(torch.uint8), loc, x, rest, scale, e4m3=True)


def store_rows(out: Tensor, loc: Tensor, x: Tensor, rest: Optional[Tensor] = None) -> None:
    """out[loc[t], :] = row[t] cast to out's float dtype (round to nearest even), row = x ([T, W]) or [x | rest];
    out [S, W] (last dims contiguous)."""
    _store_rows(out, loc, x, rest, x, e4m3=False)  # x stands in for the scale pointer: read only when E4M3


def _store_rows(out: Tensor, loc: Tensor, x: Tensor, rest: Optional[Tensor], scale: Tensor, *, e4m3: bool) -> None:
    T, W1 = x.shape
    if T == 0:
        return
    W = out.shape[1]
    x2 = x if rest is None else rest  # without rest no column reads it (W1 = W)
    block_t = rows_per_program(T, STORE_BLOCK_T)
    grid = (triton.cdiv(T, block_t), triton.cdiv(W, STORE_BLOCK_W))
    to_bf16 = not e4m3 and out.dtype == torch.bfloat16 and x.dtype != torch.bfloat16
    _store_rows_kernel[grid](x, x2, scale, loc, out, T, W, W1, out.shape[0], loc.stride(0), x.stride(0), x2.stride(0),
                             out.stride(0), E4M3=e4m3, TO_BF16=to_bf16, MAX=FP8_E4M3_MAX, BLOCK_T=block_t,
                             BLOCK_W=STORE_BLOCK_W,
                             TRIGGER=T <= STORE_EARLY_DEPENDENTS_MAX_ROWS and pdl_capable(out.device))


def quantize_query_e4m3(a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    """[a | b] ([T, H, DA], [T, H, DB], last dims contiguous) -> (q8 [T, H, DA + DB] e4m3, descale [1] fp32)."""
    T, H, DA = a.shape
    N = T * H
    if N == 0:
        return _empty_query(a, b)
    block_n = rows_per_program(N, QUANT_BLOCK_N)  # both launches' blocks of rows
    num_blocks = triton.cdiv(N, block_n)
    P = min(num_blocks, MAX_PARTIALS)
    partial = torch.empty(P, dtype=torch.float32, device=a.device)
    pdl = _query_pdl(a, N)
    _absmax_partial_kernel[(P,)](a, b, partial, N, H, a.stride(0), a.stride(1), b.stride(0), b.stride(1), DA,
                                 b.shape[2], num_blocks, **_blocks(a, b, block_n), PDL=pdl, **launch_options(pdl))
    return _quantize_from_partials(a, b, partial, pdl)


def absorb_query_e4m3(q_nope: Tensor, w_uk: Tensor, q_rope: Tensor) -> Tuple[Tensor, Tensor]:
    """q_lat = q_nope · w_uk per head, then [q_lat | q_rope] as ``quantize_query_e4m3``: two launches, the first the
    per-head matmul with the absmax partials fused in (``head_matmul_triton``). q_nope [T, H, K], w_uk [H, K, R],
    q_rope [T, H, DB] (last dims contiguous; 1 <= T <= head_matmul_triton.MAX_ROWS)."""
    T, H, _ = q_nope.shape
    R = w_uk.shape[2]
    q_lat = torch.empty(T, H, R, dtype=q_nope.dtype, device=q_nope.device)
    block_n = hm.block_n_for(H, R)
    partial = torch.empty(H * triton.cdiv(R, block_n), dtype=torch.float32, device=q_nope.device)
    hm.head_matmul(q_nope, w_uk, q_lat, b=q_rope, partial=partial, block_n=block_n)
    return _quantize_from_partials(q_lat, q_rope, partial, _query_pdl(q_nope, T * H))


def _quantize_from_partials(a: Tensor, b: Tensor, partial: Tensor, pdl: bool) -> Tuple[Tensor, Tensor]:
    """The query's last launch: the absmax from ``partial``, then [a | b] quantized with it."""
    T, H, DA = a.shape
    DB = b.shape[2]
    out = torch.empty(T, H, DA + DB, dtype=FP8_DTYPE, device=a.device)
    descale = torch.empty(1, dtype=torch.float32, device=a.device)
    N = T * H
    P = partial.shape[0]
    block_n = rows_per_program(N, QUANT_BLOCK_N)
    _quantize_query_kernel[(triton.cdiv(N, block_n),)](
        a, b, partial, out.view(torch.uint8), descale, N, H, a.stride(0), a.stride(1), b.stride(0), b.stride(1), DA, DB,
        P, MAX=FP8_E4M3_MAX, TINY=DYNAMIC_TINY, BLOCK_P=triton.next_power_of_2(P), **_blocks(a, b, block_n), PDL=pdl,
        **launch_options(pdl))
    return out, descale


def _empty_query(a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    T, H, DA = a.shape
    out = torch.empty(T, H, DA + b.shape[2], dtype=FP8_DTYPE, device=a.device)
    return out, torch.ones(1, dtype=torch.float32, device=a.device)


def _query_pdl(a: Tensor, rows: int) -> bool:
    return rows <= QUANT_PDL_MAX_ROWS and pdl_capable(a.device)


def _blocks(a: Tensor, b: Tensor, block_n: int) -> dict:
    return dict(BLOCK_N=block_n, BLOCK_DA=triton.next_power_of_2(a.shape[2]),
                BLOCK_DB=triton.next_power_of_2(b.shape[2]))
