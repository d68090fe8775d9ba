"""Split-KV absorbed-MLA decode in Triton: phase 1 and the launch of both phases (``triton`` is imported only by
the kernel modules: this one, ``splitkv_combine_triton.py``, ``splitkv_replan_triton.py`` and ``fp8_triton.py``).

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

    # phase 1: one program per (head tile, work row); rows past num_work exit at once
    for (tile, w) in grid(head_tiles, capacity):
        b, start, end, slot = work[w];  end = min(end, L_b)
        m, l, acc = -inf, 0, 0                      # [rows], [rows], [rows, r]; rows = heads x sq
        for n0 in range(start, end, BLOCK_N):
            kv_blk = kv[page_table[b, j // page_size], j % page_size]  for j in n0 .. n0+BLOCK_N-1 (< end)
                     (CONTIG, page >= BLOCK_N: one page id per block, a strided [BLOCK_N, D] tile;
                      the page ids of block n0 + BLOCK_N are read in this iteration, see Pipelining)
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
one consumer. The
c_kv tile otherwise serves both ``q_lat @ c_kvᵀ`` and ``p @ c_kv`` (the absorbed trick: V = the same rows).
``latent_chunks`` (2 or 4, at < 64 rows) loads the latent tile as that many column chunks and runs q·kᵀ as one
dot per chunk, summed after scaling: under mma.sync each warp's share of one dot is a single chain of dependent
mma (32 + 4 for DeepSeek's 512 + 64 columns, read off the SASS), chunks make 2 or 4 independent chains the
scheduler interleaves (a plain sum of dots would be folded back into one chain by the compiler, hence the scaling
first). P·V and the partial output are chunked alike (the chunks of ``acc`` are independent already).

Pipelining (Triton 3.6, sm_90; read off the compiled TTGIR): ``num_stages`` buffers the tile loads as
asynchronous copies into shared memory only if (1) their addresses depend on no load of the same
iteration — so the next block's page id is read one iteration ahead — and (2) every use of a load goes
through one shared-memory layout. A bf16 tile meets (2) as it is (the transposed use is a view of the
staged tile); an e4m3 tile under mma.sync (< 64 rows) does not — it must be converted in registers, and
the transposed conversion is a register shuffle — so the launcher sets ``RELOAD`` for it (converting the
tile once instead, staged as fp16 for both dots, was measured 1.1-1.4x slower: a block-wide barrier per key
block; docs/PERFORMANCE_HISTORY.md, "The e4m3 split-KV kernel"). Without (1),
the compiler kept one buffer and every iteration waited out the load's full latency (until
2026-12-03: 40.4 µs at 16 heads, bs 1, 64k; 28.4 µs for this phase now). The read-ahead (``PREFETCH``) is on under
mma.sync; at >= 64 rows (wgmma, 128 heads) it is ``KernelConfig.prefetch_pages``' choice, off in the table: measured
no faster there, the 64-row kernel being bound by its dots (docs/PERFORMANCE_HISTORY.md, 2026-12-06).

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
import triton
import triton.language as tl

from .calls import FlashMLACall
from .pdl import launch_options, pdl_capable
from .splitkv_combine_triton import combine_splits
from .splitkv_config import NARROW_ROWS, KernelConfig, latent_chunks
from .splitkv_plan import SPLIT_GRANULE, SplitKVSchedule, _next_pow2, head_block
from .types import KernelUnavailableError
from .validate_gluon import unsupported

Tensor = torch.Tensor
LOG2E = 1.4426950408889634


@triton.jit
def _page_ids(PageTable, pt_row, n0, end, offs_n, PAGE: tl.constexpr, CONTIG: tl.constexpr):
    """The page id(s) of keys n0 .. n0 + BLOCK_N - 1: one (CONTIG) or one per key; 0 at and past ``end``."""
    if CONTIG:
        ids = tl.load(PageTable + pt_row + n0 // PAGE, mask=n0 < end, other=0)
    else:
        keys = n0 + offs_n
        ids = tl.load(PageTable + pt_row + keys // PAGE, mask=keys < end, other=0)
    return ids


@triton.jit
def _load_tile(KV, page, n0, end, offs_n, offs_c, c_ok,
               stride_kvp, stride_kvs, col0: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               CONTIG: tl.constexpr, EXACT_C: tl.constexpr, EVICT: tl.constexpr):
    """keys n0 .. n0 + BLOCK_N - 1 (< end), columns col0 + offs_c: a [BLOCK_N, C] tile of the latent rows.

    ``page``: ``_page_ids`` of the block. CONTIG (PAGE >= BLOCK_N, block starts on a multiple of BLOCK_N): the
    block lies in one page — one page id, one strided tile. Else one page id per key."""
    keys = n0 + offs_n
    key_ok = keys < end
    if CONTIG:
        rows = KV + page.to(tl.int64) * stride_kvp + ((n0 % PAGE) + offs_n) * stride_kvs
    else:
        rows = KV + page.to(tl.int64) * stride_kvp + (keys % PAGE) * stride_kvs
    ptrs = rows[:, None] + col0 + offs_c[None, :]
    if EXACT_C:
        return tl.load(ptrs, mask=key_ok[:, None], other=0.0, eviction_policy=EVICT)
    return tl.load(ptrs, mask=key_ok[:, None] & c_ok[None, :], other=0.0, eviction_policy=EVICT)


@triton.jit
def _splitkv_partial_kernel(
    Q, QR, KV, PageTable, SeqLens, Work, NumWork, PartO, PartLse2, DescaleQ, DescaleK, Counters, num_counters, Probe,
    stride_qb, stride_qs, stride_qh,
    stride_qrb, stride_qrs, stride_qrh,
    stride_kvp, stride_kvs,
    stride_ptb, pt_keys,
    stride_ow, stride_os, stride_oh,
    stride_lw, stride_ls,
    scale_log2,
    H: tl.constexpr, SQ: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, SQ_PAD: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, Q8: tl.constexpr, KV8: tl.constexpr, IEEE: tl.constexpr,
    CONTIG: tl.constexpr, RELOAD: tl.constexpr, NARROW: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    CHUNKS: tl.constexpr, ZERO: tl.constexpr, EARLY: tl.constexpr, PROBE: tl.constexpr,
):
    tile = tl.program_id(0)
    w = tl.program_id(1)
    if PROBE:  # the program's timeline (``splitkv_partials(probe=)``): its start, first key load, end and SM
        t_start = tl.extra.cuda.globaltimer()
    if PDL and not EARLY:  # launched before the previous kernel ended (programmatic dependent launch): wait for its
        # writes. EARLY (the previous kernel is the pool store, see ``splitkv_partials``): the wait comes after the
        # prologue instead — its schedule row, length, q and first page id are read while the store runs
        tl.extra.cuda.gdc_wait()
    if ZERO:  # the combine's arrival counters (its fused output projection) start at zero: one program clears them
        if tile == 0:
            if w == 0:
                for z0 in range(0, num_counters, 1024):
                    z = z0 + tl.arange(0, 1024)
                    tl.store(Counters + z, tl.zeros([1024], tl.int32), mask=z < num_counters)
    num_work = tl.load(NumWork)
    b = tl.load(Work + w * 4)  # every row < capacity exists: read with the count, not after it (one round trip less)
    start = tl.load(Work + w * 4 + 1)
    stop = tl.load(Work + w * 4 + 2)
    slot = tl.load(Work + w * 4 + 3)
    if w < num_work:
        seqlen = tl.load(SeqLens + b)
        end = tl.minimum(stop, seqlen)

        BLOCK_M: tl.constexpr = BLOCK_H * SQ_PAD
        EXACT_V: tl.constexpr = BLOCK_DV == DV
        EXACT_R: tl.constexpr = BLOCK_DR == DR
        CW: tl.constexpr = BLOCK_DV // CHUNKS  # latent columns per chunk (CHUNKS > 1 only when EXACT_V)
        rows = tl.arange(0, BLOCK_M)
        qi = rows // BLOCK_H  # query token of the row
        hh = tile * BLOCK_H + rows % BLOCK_H  # head of the row
        row_ok = (qi < SQ) & (hh < H)
        offs_v = tl.arange(0, CW)
        offs_r = tl.arange(0, BLOCK_DR)
        offs_n = tl.arange(0, BLOCK_N)
        v_ok = offs_v < DV
        r_ok = offs_r < DR
        pt_row = b.to(tl.int64) * stride_ptb

        q_row = Q + b.to(tl.int64) * stride_qb + qi * stride_qs + hh * stride_qh
        qr_row = QR + b.to(tl.int64) * stride_qrb + qi * stride_qrs + hh * stride_qrh  # the rope part (may be apart)
        q_lat = ()  # the latent part of q, CHUNKS column chunks (a tuple: one dot, and one dependent chain, each)
        for c in tl.static_range(CHUNKS):
            q_lat = q_lat + (tl.load(q_row[:, None] + c * CW + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :],
                                     other=0.0),)
        q_pe = tl.load(qr_row[:, None] + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        if Q8:  # e4m3 q and cache (FlashMLA's FP8 contract): both exact in fp16
            q_lat = _chunks_to(q_lat, tl.float16, CHUNKS)
            q_pe = q_pe.to(tl.float16)
            scale_log2 = scale_log2 * tl.load(DescaleQ)
        elif KV8 and not IEEE:  # a bf16 / fp16 q over an e4m3 cache: the dots run in fp16 (e4m3 -> fp16 is one
            # native conversion on sm90, e4m3 -> bf16 is not). q is first rescaled by a power of two 2^k (exact) so
            # that the program's largest |q| lies in [2^13, 2^15) (a log2 rounded either way): no overflow, and
            # bf16's 8 significant bits fit fp16's 11 for every component within 2^27 of the largest; 2^k folds
            # into the score scale.
            qp = q_pe.to(tl.float32)
            amax = tl.max(tl.max(tl.abs(qp), 1), 0)
            for c in tl.static_range(CHUNKS):
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(q_lat[c].to(tl.float32)), 1), 0))
            big = amax > 0.0
            shift = tl.where(big, tl.floor(tl.log2(tl.where(big, amax, 1.0))) - 13.0, 0.0)
            pow2 = tl.exp2(shift)
            q_lat = _chunks_over(q_lat, pow2, tl.float16, CHUNKS)
            q_pe = (qp / pow2).to(tl.float16)
            scale_log2 = scale_log2 * pow2
        if KV8:  # the cache's per-tensor scale folds into the scores (and into the output, in the combine)
            scale_log2 = scale_log2 * tl.load(DescaleK)
        last_key = seqlen - SQ + qi  # causal: row sees keys <= last_key

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = ()
        for c in tl.static_range(CHUNKS):
            acc = acc + (tl.zeros([BLOCK_M, CW], tl.float32),)
        # PREFETCH: the next block's page id is read one iteration ahead: the tile loads then depend on no load of
        # their own iteration, and Triton's pipeliner multi-buffers them (num_stages - 1 tiles in flight; with the
        # page id read in the same iteration it keeps a single buffer and every iteration waits out the load's
        # latency). On by default under mma.sync (< 64 rows); at >= 64 rows (wgmma) a config's choice: the
        # multi-buffered tiles and q share the shared memory (KernelConfig.prefetch_pages)
        if PREFETCH:  # the first id masked by the planned stop (within the table's row), not by the length: its load
            # issues beside the length's instead of after it. An id read past the length is never used: every key
            # of its tile is masked by ``end``
            page_next = _page_ids(PageTable, pt_row, start, tl.minimum(stop, pt_keys), offs_n, PAGE, CONTIG)
        if EARLY:  # the store's rows are read from here on: wait for it (and its memory flush)
            tl.extra.cuda.gdc_wait()
        if PROBE:
            t_keys = tl.extra.cuda.globaltimer()
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                page = page_next
                page_next = _page_ids(PageTable, pt_row, n0 + BLOCK_N, end, offs_n, PAGE, CONTIG)
            else:
                page = _page_ids(PageTable, pt_row, n0, end, offs_n, PAGE, CONTIG)
            c_kv = ()
            for c in tl.static_range(CHUNKS):
                c_kv = c_kv + (_load_tile(KV, page, n0, end, offs_n, offs_v, v_ok, stride_kvp, stride_kvs, c * CW,
                                          PAGE, BLOCK_N, CONTIG, EXACT_V, "evict_last" if RELOAD and NARROW else ""),)
            k_pe = _load_tile(KV, page, n0, end, offs_n, offs_r, r_ok, stride_kvp, stride_kvs,
                              DV, PAGE, BLOCK_N, CONTIG, EXACT_R, "")
            # q·kᵀ: one dot per latent chunk, each its own chain of mma.sync (one chain of DV / 16 + DR / 16
            # dependent mma per warp when CHUNKS = 1); the rope dot extends the last chunk's chain
            s = _score_dot(q_lat[CHUNKS - 1], c_kv[CHUNKS - 1], q_lat[CHUNKS - 1].dtype, NARROW, IEEE)
            s = _score_dot(q_pe, k_pe, q_pe.dtype, NARROW, IEEE, s)
            s = s * scale_log2
            for c in tl.static_range(CHUNKS - 1):  # scaled before the sum: a sum of dots would fold into one chain
                s += _score_dot(q_lat[c], c_kv[c], q_lat[c].dtype, NARROW, IEEE) * scale_log2
            keys = n0 + offs_n
            visible = (keys < end)[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= last_key[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            new_acc = ()
            for c in tl.static_range(CHUNKS):
                if RELOAD:  # a second load of the same rows (an L2 hit): each load feeds one dot
                    v_blk = _load_tile(KV, page, n0, end, offs_n, offs_v, v_ok, stride_kvp, stride_kvs, c * CW,
                                       PAGE, BLOCK_N, CONTIG, EXACT_V, "evict_first" if NARROW else "")
                else:
                    v_blk = c_kv[c]
                v_blk = v_blk.to(q_lat[c].dtype)  # e4m3 -> q's dtype (no-op otherwise)
                if IEEE:
                    a_c = tl.dot(p.to(v_blk.dtype), v_blk, acc=acc[c] * alpha[:, None], input_precision="ieee")
                else:
                    a_c = tl.dot(p.to(v_blk.dtype), v_blk, acc=acc[c] * alpha[:, None])
                new_acc = new_acc + (a_c,)
            acc = new_acc
            m = m_new
        if PDL:  # the keys are done: the combine may launch (its programs wait for this grid's writes); signalled at
            # the start instead, its waiting programs slowed phase 1 (docs/PERFORMANCE_HISTORY.md)
            tl.extra.cuda.gdc_launch_dependents()

        seen = l > 0.0
        lse2 = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
        o_ptr = PartO + slot.to(tl.int64) * stride_ow + qi * stride_os + hh * stride_oh
        for c in tl.static_range(CHUNKS):
            o = acc[c] / tl.where(seen, l, 1.0)[:, None]
            tl.store(o_ptr[:, None] + c * CW + offs_v[None, :], o.to(PartO.dtype.element_ty),
                     mask=row_ok[:, None] & v_ok[None, :])
        tl.store(PartLse2 + slot.to(tl.int64) * stride_lw + qi * stride_ls + hh, lse2, mask=row_ok)
        if PROBE:
            stamp = Probe + (w.to(tl.int64) * tl.num_programs(0) + tile) * 4
            tl.store(stamp, tl.extra.cuda.smid().to(tl.int64))
            tl.store(stamp + 1, t_start)
            tl.store(stamp + 2, t_keys)
            tl.store(stamp + 3, tl.extra.cuda.globaltimer())


@triton.jit
def _chunks_to(chunks, dtype: tl.constexpr, CHUNKS: tl.constexpr):
    """Each tensor of a ``CHUNKS``-tuple converted to ``dtype``."""
    out = ()
    for c in tl.static_range(CHUNKS):
        out = out + (chunks[c].to(dtype),)
    return out


@triton.jit
def _chunks_over(chunks, divisor, dtype: tl.constexpr, CHUNKS: tl.constexpr):
    """Each tensor of a ``CHUNKS``-tuple divided by ``divisor`` in fp32, then converted to ``dtype``."""
    out = ()
    for c in tl.static_range(CHUNKS):
        out = out + ((chunks[c].to(tl.float32) / divisor).to(dtype),)
    return out


@triton.jit
def _score_dot(q, k, dtype: tl.constexpr, NARROW: tl.constexpr, IEEE: tl.constexpr, acc=None):
    """q · kᵀ (+ acc) for a key tile ``k [BLOCK_N, C]``, converted to q's ``dtype`` (e4m3 -> fp16 in registers;
    exact). At < 64 rows transposed first: the load then keeps its asynchronous multi-buffered copy (converted
    first, its transpose is a register shuffle and the pipeliner leaves the load synchronous); wgmma stages the
    converted tile itself."""
    if NARROW:
        k_t = tl.trans(k).to(dtype)
    else:
        k_t = tl.trans(k.to(dtype))
    if IEEE:
        return tl.dot(q, k_t, acc=acc, input_precision="ieee")
    return tl.dot(q, k_t, acc=acc)


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
        part_o, part_lse2 = _warp_specialized_partials(call, schedule, w_uv, pdl, half)
    else:
        part_o, part_lse2 = splitkv_partials(call, schedule, config, counters=counters, follows_store=follows_store)
    kv8 = call.kv_fp8 or call.is_fp8
    combine_splits(part_o, part_lse2, schedule.split_offsets, out, lse, call.descale_k if kv8 else None,
                   pdl=pdl, tile=config.combine_tile, w=w_uv, counters=counters)
    return out, lse


def _warp_specialized_partials(call: FlashMLACall, schedule: SplitKVSchedule, w_uv: Optional[Tensor], pdl: bool,
                               half: bool):
    """Phase 1 of a schedule planned with ``KernelConfig.warp_specialized``: the Gluon kernel (imported here, on
    first use: triton >= 3.6 with Gluon; its absence is a named error), its shape checked before the launch
    (``pdl``: it lets the combine launch once its key loops are done; ``half``: bf16 partial outputs)."""
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
    return gluon_decode.gluon_partials(call, schedule, pdl=pdl, half=half)


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
        # split starts are multiples of SPLIT_GRANULE and of the page (the planner's granule), block_n <= 64:
        # with page >= block_n every key block lies in one page
        CONTIG=page >= config.block_n and SPLIT_GRANULE % config.block_n == 0,
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
    if probe is not None and (probe.dtype != torch.int64 or probe.device != q.device
                              or tuple(probe.shape) != (cap, -(-H // block_h), 4)):
        raise ValueError(f"probe must be an int64 [{cap}, {-(-H // block_h)}, 4] tensor on {q.device} (capacity, head "
                         f"tiles, 4), got {probe.dtype} {tuple(probe.shape)} on {probe.device}")
    _splitkv_partial_kernel[(-(-H // block_h), cap)](
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
