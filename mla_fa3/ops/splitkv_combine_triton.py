"""Phase 2 of the split-KV decode (``splitkv_kernel_triton.py`` has phase 1, ``splitkv_triton.py`` launches both):
the combine.

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

With the output projection fused in (``w`` = MLA's W_UVᵀ per head, ``KernelConfig.fused_projection``):

    y[vb] = round(out[vb columns]) @ w[h][vb rows, :]          # each program's share, to a float32 workspace
    fence; arrived = atomic_add(count[row], 1)                # count zeroed by phase 1 (``splitkv_partials``)
    if arrived == last: out_row = Σ_vb y[vb] in vb order      # the last program of the row; deterministic

Measured on the H200 (docs/PERFORMANCE_HISTORY.md, 2026-12-06): 0.4-5 µs slower per step than the combine
followed by the per-head matmul (whose launch PDL hides), at 16 heads, bs 1-8 and 128 heads, bs 1 — so it is a
switch, off by default: each program's weight rows and the serial last pass cost more than the launch saved.

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
from .probe_triton import write_stamp
from .splitkv_config import FUSED_PROJECTION_MAX_COLUMNS, check_combine_tile, combine_tile
from .splitkv_plan import _next_pow2

Tensor = torch.Tensor


@triton.jit
def _fence_gpu(x):
    """``x`` unchanged, after a GPU-scope memory fence in every thread that holds part of it (``fence.acq_rel.gpu``):
    the thread's earlier writes are visible GPU-wide before anything that depends on the result."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _discard_l2(ptr, pred):
    """``discard.global.L2`` of the 128-byte line at ``ptr`` where ``pred`` is non-zero: the line is dropped from the
    L2 without being written back to memory (its content becomes undefined)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p discard.global.L2 [$1], 128; mov.b32 $0, 0; }",
        "=r,l,r", [ptr, pred], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _splitkv_combine_kernel(
    PartO, PartLse2, SplitOffsets, Out, Lse, DescaleK, W, Ws, Count, Probe,
    stride_ow, stride_os, stride_oh,
    stride_lw, stride_ls,
    stride_outb, stride_outs, stride_outh,
    stride_lseb, stride_lses,
    stride_wh, stride_wk,
    H: tl.constexpr, SQ: tl.constexpr, DV: tl.constexpr, N_OUT: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_NO: tl.constexpr, KV8: tl.constexpr, PDL: tl.constexpr,
    PROJECT: tl.constexpr, FENCE: tl.constexpr, PROBE: tl.constexpr, DISCARD: tl.constexpr,
):
    row = tl.program_id(0)  # (b, i, h) of the output
    vb = tl.program_id(1)
    if PROBE:  # the program's timeline (``combine_splits(probe=)``): its start, first read of a partial, end and SM
        t_start = tl.extra.cuda.globaltimer()
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
    if PROBE:
        t_read = tl.extra.cuda.globaltimer()
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
    if DISCARD:  # the partial lines this program alone read are dead: dropped from the L2, never written back
        tl.debug_barrier()  # after every thread's loads of them (a discarded line is undefined)
        LINE: tl.constexpr = 128 // (PartO.dtype.element_ty.primitive_bitwidth // 8)  # elements a 128-byte line
        for c in range(s0, s1, BLOCK_S):
            slots = c + tl.arange(0, BLOCK_S)
            for j in tl.static_range(BLOCK_DV // LINE):
                _discard_l2(o_base + slots * stride_ow + vb * BLOCK_DV + j * LINE, (slots < s1).to(tl.int32))
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.sum(total, 0)
    live = denom > 0.0
    out = tl.sum(acc, 0) / tl.where(live, denom, 1.0)
    if KV8:
        out = out * tl.load(DescaleK)
    out_row = Out + b.to(tl.int64) * stride_outb + i * stride_outs + h * stride_outh
    if PROJECT:  # o_lat's columns `cols`, rounded as the unfused path stores them, times their rows of w[h]
        o_lat = out.to(Out.dtype.element_ty).to(tl.float32)
        n_out = tl.arange(0, BLOCK_NO)
        n_ok = n_out < N_OUT
        w_blk = tl.load(W + h.to(tl.int64) * stride_wh + cols.to(tl.int64)[:, None] * stride_wk + n_out[None, :],
                        mask=c_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        y = tl.sum(o_lat[:, None] * w_blk, 0)  # [BLOCK_NO]: this column block's share of the row's projection
        chunks = tl.num_programs(1)
        ws_row = Ws + row.to(tl.int64) * chunks * BLOCK_NO
        tl.store(ws_row + vb * BLOCK_NO + n_out, y)
        # the last of the row's `chunks` programs to arrive sums the shares in column-block order (deterministic) and
        # writes the row. CUDA's threadfence pattern: every thread fences its share stores, then a CTA barrier, so
        # that the one thread issuing the count's release does so after all of them (the reduction below need not
        # be a barrier: it may compile to one warp's redux)
        one = tl.full([BLOCK_NO], 1, tl.int32)
        if FENCE:
            one = _fence_gpu(one)
            tl.debug_barrier()
        arrived = tl.atomic_add(Count + row, tl.max(one, 0), sem="acq_rel", scope="gpu")
        if arrived == chunks - 1:
            offs = n_out
            if FENCE:
                offs = _fence_gpu(offs)
            projected = tl.zeros([BLOCK_NO], tl.float32)
            for c in range(0, chunks):  # shares read from L2 (.cg): other SMs wrote them
                projected += tl.load(ws_row + c * BLOCK_NO + offs, cache_modifier=".cg")
            tl.store(out_row + n_out, projected.to(Out.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_row + cols, out.to(Out.dtype.element_ty), mask=c_ok)
    if vb == 0:
        lse = tl.where(live, (top + tl.log2(tl.where(live, denom, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + b.to(tl.int64) * stride_lseb + i * stride_lses + h, lse)
    if PROBE:
        write_stamp(Probe, row.to(tl.int64) * tl.num_programs(1) + vb, t_start, t_read)


def _launch_tile(rows: int, dv: int, tile: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """(splits per load, columns) of a combine of ``rows`` output rows of ``dv`` columns: ``tile`` (checked) or
    ``combine_tile``'s rule, the columns at most ``dv`` rounded up to a power of two."""
    block_s, cdv = combine_tile(rows) if tile is None else check_combine_tile(tile)
    return block_s, min(cdv, _next_pow2(dv))


def combine_grid(rows: int, dv: int, tile: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """The combine's grid (output rows, column blocks) for ``rows`` = bs·sq·H rows of ``dv`` columns and ``tile``
    (None: the rule's): the shape of ``combine_splits``' stamp buffer, less its last dimension."""
    return rows, -(-dv // _launch_tile(rows, dv, tile)[1])


def combine_meta(*, bs: int, sq: int, heads: int, dv: int, tile: Optional[Tuple[int, int]], kv8: bool, pdl: bool,
                 n_out: Optional[int] = None, fence: bool = False, probe: bool = False,
                 discard: bool = False) -> Tuple[Tuple[int, int], dict]:
    """(grid, the launch's keyword arguments: constexprs, warps and the PDL option) of the combine —
    what ``combine_splits`` launches with, and ``splitkv_compile`` compiles. ``n_out``: the fused projection's output
    columns (None: no projection; more than ``FUSED_PROJECTION_MAX_COLUMNS`` is a ValueError). ``discard``: the
    partial lines dropped from the L2 once read (``discards_partials`` says where that is safe)."""
    block_s, cdv = _launch_tile(bs * sq * heads, dv, tile)
    grid = (bs * sq * heads, -(-dv // cdv))  # combine_grid's
    project = n_out is not None
    block_no = _next_pow2(n_out) if project else 16
    if project and (n_out > FUSED_PROJECTION_MAX_COLUMNS or cdv * block_no > 64 * FUSED_PROJECTION_MAX_COLUMNS):
        raise ValueError(f"the fused output projection takes at most {FUSED_PROJECTION_MAX_COLUMNS} output columns "
                         f"(w's N) and a [columns, N] weight block of at most 64 x {FUSED_PROJECTION_MAX_COLUMNS} "
                         f"(tile columns {cdv}), got N = {n_out}: project after the combine (ops.head_matmul)")
    meta = dict(H=heads, SQ=sq, DV=dv, N_OUT=n_out if project else dv, BLOCK_S=block_s, BLOCK_DV=cdv,
                BLOCK_NO=block_no, KV8=kv8, PDL=pdl, PROJECT=project, FENCE=fence, PROBE=probe, DISCARD=discard,
                num_warps=4 if block_s * cdv <= 4096 else 8, **launch_options(pdl))
    return grid, meta


def discards_partials(part_o: Tensor, columns: int) -> bool:
    """Whether a combine over ``part_o [slots, sq, H, r]`` in blocks of ``columns`` may drop the partial lines it read
    from the L2 (``KernelConfig.discard_partials``): on CUDA from sm_80, where each program's column block of a
    (slot, token, head) row is whole 128-byte lines that no other program reads — r a multiple of the block, the
    block of whole lines, the row strides and the workspace's address multiples of a line."""
    return (part_o.is_cuda and torch.cuda.get_device_capability(part_o.device)[0] >= 8  # discard: sm_80 and later
            and whole_lines(part_o, columns))


def whole_lines(part_o: Tensor, columns: int) -> bool:
    """``discards_partials`` but for the device: each ``columns`` block of a row of ``part_o`` is whole 128-byte lines
    of its own."""
    size = part_o.element_size()
    return (part_o.shape[3] % columns == 0 and (columns * size) % 128 == 0 and part_o.data_ptr() % 128 == 0
            and part_o.stride(3) == 1 and all((part_o.stride(d) * size) % 128 == 0 for d in (0, 1, 2)))


def combine_splits(part_o: Tensor, part_lse2: Tensor, split_offsets: Tensor, out: Tensor, lse: Tensor,
                   descale_k: Optional[Tensor] = None, *, pdl: bool = False,
                   tile: Optional[Tuple[int, int]] = None, w: Optional[Tensor] = None,
                   counters: Optional[Tensor] = None, probe: Optional[Tensor] = None,
                   discard: bool = False) -> None:
    """Phase 2 alone, into ``out [bs, sq, H, r]`` and ``lse [bs, sq, H]`` (natural log): request b's splits are the
    slots ``split_offsets[b] .. split_offsets[b + 1]`` of ``part_o [slots, sq, H, r]`` (float32 or the output
    dtype) and ``part_lse2 [slots, sq, H]`` (base 2; -inf: an empty split). ``descale_k``: an e4m3 cache's scale,
    folded into ``out``. ``pdl``: launched as a programmatic dependent of the phase-1 launch just before it.
    ``tile``: (splits per load, columns), powers of two, instead of ``combine_tile``'s (``bench.splitkv_phases``
    compares them).

    ``w`` ``[H, r, N]`` (last dim contiguous, out's dtype): the output projection fused in — ``out [bs, sq, H, N]``
    receives ``o_lat[b, i, h] @ w[h]`` (o_lat rounded to out's dtype first, as the unfused path stores it; fp32
    sums; N <= ``FUSED_PROJECTION_MAX_COLUMNS``, else a ValueError), ``counters`` ``[>= bs·sq·H] int32`` all zero
    on entry (phase 1 zeroes them: ``splitkv_partials``); each row's count ends at its column-block count — scratch,
    not state.

    ``probe`` (benchmarks: ``benchmarks/splitkv_probe.py``): ``[bs·sq·H, column blocks, 4] int64`` on the GPU
    (``combine_grid`` gives the grid); each program writes its row = (SM id, start, first read of a partial — after
    its wait for phase 1 under ``pdl`` —, end), ``%globaltimer`` nanoseconds (CUDA only).

    ``discard``: once read, the partial outputs are dropped from the L2 (``discard.global.L2``) instead of being
    written back to memory when evicted — where ``discards_partials`` finds it safe, else ignored; ``part_o``'s
    content is undefined afterwards (``KernelConfig.discard_partials``)."""
    bs, sq, H = out.shape[:3]
    dv = part_o.shape[3]
    one = lse  # any float32 pointer: read only with descale_k
    project = w is not None
    grid, meta = combine_meta(bs=bs, sq=sq, heads=H, dv=dv, tile=tile, kv8=descale_k is not None, pdl=pdl,
                              n_out=out.shape[3] if project else None, fence=project and out.is_cuda,
                              probe=probe is not None)
    meta["DISCARD"] = discard and discards_partials(part_o, meta["BLOCK_DV"])
    if probe is not None and (probe.dtype != torch.int64 or probe.device != out.device
                              or tuple(probe.shape) != grid + (4,)):
        raise ValueError(f"probe must be an int64 [{grid[0]}, {grid[1]}, 4] tensor on {out.device} (output rows, "
                         f"column blocks, 4), got {probe.dtype} {tuple(probe.shape)} on {probe.device}")
    ws = torch.empty(grid[0] * grid[1] * meta["BLOCK_NO"] if project else 1, dtype=torch.float32, device=out.device)
    _splitkv_combine_kernel[grid](
        part_o, part_lse2, split_offsets, out, lse, one if descale_k is None else descale_k,
        w if project else one, ws, counters if project else split_offsets, split_offsets if probe is None else probe,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse2.stride(0), part_lse2.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        w.stride(0) if project else 0, w.stride(1) if project else 0,
        **meta,
    )
