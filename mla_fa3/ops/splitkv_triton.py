"""Split-KV absorbed-MLA decode in Triton: the launch of both phases. Phase 1's device code is
``splitkv_kernel_triton.py``, the combine's ``splitkv_combine_triton.py``; this module reaches triton only through
them (``triton`` is imported only by the kernel modules).

Contract of ``ops.flash_mla_with_kvcache`` (its torch reference is ``reference.flash_mla_with_kvcache``):
q ``[bs, sq, H, D]`` (D = r + d_rope: q_lat | q_rope; or q_lat ``[bs, sq, H, r]`` with q_rope apart — the
absorbed step then never concatenates them), the latent pool read in place
``kv [num_pages, page_size, 1, D]`` (c_kv | k_rope), ``page_table [bs, max_pages] int32``,
``cache_seqlens [bs] int32`` = L_b. Query i of request b sits at position p = L_b - sq + i and,
causal, sees keys j <= p (bottom-right). With t = page_table[b, j // page_size], o = j % page_size:

    s_ij  = scale · q_i · kv[t, o]              (all D dims; e4m3 cache: · descale_k; e4m3 q: · descale_q)
    out_i = Σ_j softmax_j(s_i) · kv[t, o, :r]   (e4m3 cache: · descale_k)

An e4m3 cache is read with an e4m3 q (FlashMLA's FP8 contract) or with q in its own dtype (the tile is
converted in registers — exact, e4m3 fits in fp16 and fp32 — and the cache's scale folded into the scores
and the output; q is never rounded to e4m3). A bf16 q enters the dots in fp16 (Hopper converts e4m3 to
fp16 natively, to bf16 only through fp32) after an exact power-of-two rescaling per program that puts its
largest |q| in [2^13, 2^15): no overflow whatever q's magnitude, and bf16 -> fp16 exact for every component
within 2^27 of the largest (smaller ones become fp16 subnormals). The pool is never dequantized in memory.
    lse_i = ln Σ_j exp(s_ij)                     natural log, -inf and out 0 when no key is visible

Inside, scores are kept in base 2 (``s2 = s · log2 e``, ``exp2``); the partial LSEs in the workspace
are base 2 (``part_lse2``), and the combine returns ``lse = lse2 · ln 2`` — natural log, the
library's convention (``types.LSE_BASE``).

The step, two launches (programmatic dependent launches, see below; the schedule from ``splitkv_plan.py``, planned
on the host once per step, or on the device inside a CUDA graph by ``splitkv_replan_triton.py``, one program):

    # phase 1 (``splitkv_kernel_triton.py``): one program per (head tile, work row); rows past num_work exit
    for (tile, w) in grid(head_tiles, capacity):
        b, start, end, slot = work[w];  end = min(end, L_b)
        m, l, acc = -inf, 0, 0                      # [rows], [rows], [rows, r]; rows = heads x sq
        for n0 in range(start, end, BLOCK_N):
            kv_blk = kv[page_table[b, j // page_size], j % page_size]  for j in n0 .. n0+BLOCK_N-1 (< end)
                     (CONTIG, page >= BLOCK_N: one page id per block, a strided [BLOCK_N, D] tile;
                      the page ids of block n0 + BLOCK_N are read in this iteration: ``splitkv_kernel_triton.py``)
            s2 = (q_lat @ kv_blk[:, :r].T + q_rope @ kv_blk[:, r:].T) · scale · log2 e,  masked
            m_new = max(m, rowmax(s2)); alpha = 2^(m - m_new); p = 2^(s2 - m_new)
            l = l·alpha + rowsum(p);  acc = acc·alpha + p @ kv_blk[:, :r];  m = m_new
        part_o[slot] = acc / l;  part_lse2[slot] = m + log2 l         (empty row: 0, -inf)
    # phase 2 (combine, ``splitkv_combine_triton.py``): per (request, query, head), the splits' partials merged by
    # their LSEs into out and lse (natural log)

Launch switches (``KernelConfig``, ``splitkv_config.py``; the schedule carries the one it was planned
with): ``block_n`` / ``num_warps`` / ``num_stages`` / ``max_rows`` / ``max_registers`` (phase 1's ``maxnreg``);
``half_partials`` stores ``part_o`` in the output dtype (half the workspace traffic; one extra rounding per
split); ``reload_kv`` loads the latent tile a second time for P·V (an L2 hit: the first load is marked
evict-last), so that each load feeds a single dot — the compiler can then stage each in shared memory for its
one consumer. The c_kv tile otherwise serves both ``q_lat @ c_kvᵀ`` and ``p @ c_kv`` (the absorbed trick: V = the
same rows). ``latent_chunks``, and how the loads are pipelined: ``splitkv_kernel_triton.py``.

Programmatic dependent launch (``KernelConfig.pdl``, CUDA sm_90+): both phases are launched with the
programmatic-serialization attribute, so each is launched before its predecessor has finished — phase 1
while the step's previous kernel (the q absorption) drains, the combine once every phase-1 program has
left its key loop (``griddepcontrol.launch_dependents``) — and waits (``griddepcontrol.wait``) for the
predecessor's writes before reading them. The launch latency between the kernels is hidden; what each
computes and reads is unchanged. A CUDA graph captures the launches as programmatic edges. Elsewhere (the
interpreter, older GPUs) they launch in order. Measured: 0.7-1.3 µs less at 16 heads (bs 1-8), 0.9 µs more
at 128 heads, bs 1, 16k — the table turns it off there. When the launch just before phase 1 is the pool store
(``follows_store``, the SGLang adapter's decode), the store lets phase 1 launch at its own start and phase 1 reads
its schedule row, the length, q and its first page id before its wait, not after: that chain of dependent loads
then overlaps the store (measured inside SGLang's step on an H100: 0.7-1.7 µs less a layer at 16 heads, bs 1 and 4).

Only keys < min(end, L_b) are loaded (masked loads), so slots past a sequence's end and unused
page-table entries are never read. The grid is the schedule's capacity (fixed), the live work count
and per-request split offsets are read from device buffers: a captured CUDA graph replays whatever
schedule is ``copy_``-ed into them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .calls import FlashMLACall
from .pdl import launch_options, pdl_capable
from .splitkv_combine_triton import combine_splits
from .splitkv_config import NARROW_ROWS, KernelConfig, latent_chunks
from .splitkv_kernel_triton import _splitkv_partial_kernel
from .splitkv_plan import SplitKVSchedule, _next_pow2, head_block, split_granule
from .types import KernelUnavailableError
from .validate_gluon import unsupported

Tensor = torch.Tensor
LOG2E = 1.4426950408889634


def splitkv_mla_with_kvcache(
    call: FlashMLACall, schedule: SplitKVSchedule, config: Optional[KernelConfig] = None, *,
    w_uv: Optional[Tensor] = None, follows_store: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Run both phases on a validated call -> (out [bs, sq, H, r] — [bs, sq, H, N] with ``w_uv`` —, lse [bs, sq, H]
    float32, natural log).

    ``config``: the launch parameters; default the schedule's (the one its split count was planned with).
    ``w_uv`` ``[H, r, N]`` (validated by the caller): the output projection fused into the combine — out is then
    ``[bs, sq, H, N]``, ``o_lat @ w_uv[h]`` per row (``splitkv_combine_triton.py``). ``follows_store``: see
    ``splitkv_partials``."""
    config = schedule.config if config is None else config
    q = call.q
    bs, sq, H = q.shape[:3]
    width = call.head_dim_v if w_uv is None else w_uv.shape[2]
    out = torch.empty(bs, sq, H, width, dtype=call.out_dtype, device=q.device)
    lse = torch.empty(bs, sq, H, dtype=torch.float32, device=q.device)
    if bs == 0 or sq == 0 or H == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    counters = None if w_uv is None else torch.empty(bs * sq * H, dtype=torch.int32, device=q.device)
    pdl = config.pdl and pdl_capable(q.device)
    if config.warp_specialized:
        half = config.half_partials and call.out_dtype == torch.bfloat16
        part_o, part_lse2 = _warp_specialized_partials(call, schedule, w_uv, pdl, half, follows_store)
    else:
        part_o, part_lse2 = splitkv_partials(call, schedule, config, counters=counters, follows_store=follows_store)
    kv8 = call.kv_fp8 or call.is_fp8
    combine_splits(part_o, part_lse2, schedule.split_offsets, out, lse, call.descale_k if kv8 else None,
                   pdl=pdl, tile=config.combine_tile, w=w_uv, counters=counters, discard=config.discard_partials)
    return out, lse


def _warp_specialized_partials(call: FlashMLACall, schedule: SplitKVSchedule, w_uv: Optional[Tensor], pdl: bool,
                               half: bool, follows_store: bool):
    """Phase 1 of a schedule planned with ``KernelConfig.warp_specialized``: the Gluon kernel (imported here, on
    first use: triton >= 3.6 with Gluon; its absence is a named error), its shape checked before the launch
    (``pdl``: it lets the combine launch once its key loops are done; ``half``: bf16 partial outputs;
    ``follows_store``: as ``splitkv_partials``', its producer waiting for the store before the first TMA)."""
    if w_uv is not None:
        raise ValueError("KernelConfig.warp_specialized: the output projection is not fused into its combine")
    why = unsupported(call, schedule)
    if why is not None:
        raise ValueError(f"KernelConfig.warp_specialized: {why}")
    try:
        from . import gluon_decode
    except Exception as exc:  # ImportError (a triton without Gluon) or a broken install
        raise KernelUnavailableError(f"the warp-specialized decode kernel needs triton >= 3.6 with Gluon: "
                                     f"{type(exc).__name__}: {exc}") from exc
    return gluon_decode.gluon_partials(call, schedule, pdl=pdl, half=half, follows_store=follows_store)


def phase1_meta(config: KernelConfig, *, heads: int, sq: int, dv: int, dr: int, page: int, q8: bool, kv8: bool,
                ieee: bool, causal: bool, pdl: bool, early: bool, zero: bool, probe: bool = False) -> Tuple[int, dict]:
    """(heads per program, the launch's keyword arguments: constexprs, warps, stages, PDL and register options) of
    phase 1 for ``config`` — what ``splitkv_partials`` launches with, and ``splitkv_compile`` compiles."""
    block_h = head_block(heads, sq, config.max_rows)
    sq_pad = _next_pow2(sq)
    rows = block_h * sq_pad
    narrow = rows < NARROW_ROWS
    meta = dict(
        H=heads, SQ=sq, DV=dv, DR=dr, PAGE=page,
        BLOCK_H=block_h, SQ_PAD=sq_pad, BLOCK_DV=max(16, _next_pow2(dv)), BLOCK_DR=max(16, _next_pow2(dr)),
        BLOCK_N=config.block_n, CAUSAL=causal, Q8=q8, KV8=kv8, IEEE=ieee,
        # split starts are multiples of the planner's granule (splitkv_plan.split_granule: the page and
        # SPLIT_GRANULE, or with even_splits block_n itself), a multiple of block_n <= 64: with page >= block_n
        # every key block lies in one page
        CONTIG=page >= config.block_n and split_granule(config, page) % config.block_n == 0,
        # e4m3 under mma.sync (< 64 rows): the tile is loaded twice, so that each load feeds one dot and keeps its
        # asynchronous copy (see the kernel); with >= 64 rows (wgmma) the one load is pipelined as it is
        RELOAD=config.reload_kv or (kv8 and narrow), NARROW=narrow,
        PREFETCH=narrow if config.prefetch_pages is None else config.prefetch_pages, PDL=pdl,
        CHUNKS=latent_chunks(config, dv, rows), ZERO=zero, EARLY=early, PROBE=probe,
        num_warps=config.num_warps or (4 if rows <= 32 else 8), num_stages=config.num_stages, **launch_options(pdl),
    )
    if config.max_registers is not None:
        meta["maxnreg"] = config.max_registers
    return block_h, meta


def splitkv_partials(
    call: FlashMLACall, schedule: SplitKVSchedule, config: Optional[KernelConfig] = None, *,
    counters: Optional[Tensor] = None, follows_store: bool = False, probe: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Phase 1 alone on a validated call of >= 1 request, query and head -> the workspace the combine reads:
    (part_o [capacity, sq, H, r] float32 or, with ``half_partials``, the output dtype; part_lse2 [capacity, sq, H]
    float32, base 2). Slot s holds split s's normalized partial output and LSE (rows past ``num_work``: unwritten).

    ``counters`` (int32): zeroed by one program, after the wait for the previous kernel — the arrival counters of a
    combine with the output projection fused in. ``splitkv_mla_with_kvcache`` runs it and the combine;
    ``bench.splitkv_phases`` times it alone.

    ``follows_store``: the caller's word that the launch just before this one on the stream is the pool store of
    the rows this call reads (``ops.store_rows`` / ``store_e4m3``, or torch's indexed assignment), itself launched
    in order (not as a programmatic dependent). Every program then reads its schedule row, the length, q and its
    first page id before it waits for the store — all written before the store began — so that this prologue
    overlaps the store (which lets its dependents launch at its start). Without it (any other predecessor may
    write q) the wait comes first. Results are the same bits either way; it matters only with PDL.

    ``probe`` (benchmarks: ``benchmarks/splitkv_probe.py``): ``[capacity, head tiles, 4] int64`` on the GPU; each live
    program writes its row ``[work row, head tile]`` = (SM id, start, first key load, end), ``%globaltimer``
    nanoseconds (CUDA only: the interpreter has no timer). Rows of idle programs are left as they were."""
    config = schedule.config if config is None else config
    q, kv = call.q, call.kv_cache
    dv = call.head_dim_v
    q_rope = q[..., dv:] if call.q_rope is None else call.q_rope  # q whole, or its rope part given apart
    bs, sq, H = q.shape[:3]
    if bs == 0 or sq == 0 or H == 0:
        raise ValueError(f"splitkv_partials needs >= 1 request, query token and head, got q of shape {tuple(q.shape)}")
    if schedule.granule % config.block_n:  # a key block must not straddle a split's start (nor, so, a page)
        raise ValueError(f"the schedule's splits start on multiples of {schedule.granule} keys, not of the config's "
                         f"block_n {config.block_n}: launch it with the config it was planned with (schedule.config)")
    D = dv + q_rope.shape[3]
    page = kv.shape[1]
    cap = schedule.capacity
    half = config.half_partials and call.out_dtype in (torch.bfloat16, torch.float16)
    part_o = torch.empty(cap, sq, H, dv, dtype=call.out_dtype if half else torch.float32, device=q.device)
    part_lse2 = torch.empty(cap, sq, H, dtype=torch.float32, device=q.device)
    q8, kv8 = call.is_fp8, call.kv_fp8 or call.is_fp8
    one = part_lse2  # any float32 pointer: read only under Q8 / KV8
    pdl = config.pdl and pdl_capable(q.device)
    block_h, meta = phase1_meta(config, heads=H, sq=sq, dv=dv, dr=D - dv, page=page, q8=q8, kv8=kv8,
                                ieee=q.dtype == torch.float32, causal=call.causal, pdl=pdl,
                                early=pdl and follows_store and counters is None,  # zeroing must follow the wait
                                zero=counters is not None, probe=probe is not None)
    tiles = -(-H // block_h)
    if probe is not None and (probe.dtype != torch.int64 or probe.device != q.device
                              or tuple(probe.shape) != (cap, tiles, 4)):
        raise ValueError(f"probe must be an int64 [{cap}, {tiles}, 4] tensor on {q.device} (capacity, head tiles, 4), "
                         f"got {probe.dtype} {tuple(probe.shape)} on {probe.device}")
    _splitkv_partial_kernel[(tiles, cap)](
        q, q_rope, kv, call.page_table, call.cache_seqlens, schedule.work, schedule.num_work, part_o, part_lse2,
        call.descale_q if q8 else one, call.descale_k if kv8 else one,
        schedule.num_work if counters is None else counters, 0 if counters is None else counters.numel(),
        schedule.num_work if probe is None else probe,
        q.stride(0), q.stride(1), q.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        kv.stride(0), kv.stride(1),
        call.page_table.stride(0), call.page_table.shape[1] * page,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse2.stride(0), part_lse2.stride(1),
        call.softmax_scale * LOG2E, **meta,
    )
    return part_o, part_lse2
