"""Phase 1 of split-KV in Triton: the device code (``splitkv_triton.py`` has the contract and launches it, with
its constexprs from ``phase1_meta``; the combine is ``splitkv_combine_triton.py``).

One program per (head tile, work row) of the schedule (``splitkv_plan.py``): the online softmax over its
split's keys, in base 2, into one partial output and LSE (``splitkv_triton.py``'s pseudo-code).

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

Only keys < min(end, L_b) are loaded (masked loads), so slots past a sequence's end and unused
page-table entries are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .probe_triton import write_stamp


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
            write_stamp(Probe, w.to(tl.int64) * tl.num_programs(0) + tile, t_start, t_keys)


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
