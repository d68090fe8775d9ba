"""The device code of the warp-specialized absorbed-MLA decode (phase 1, Triton's Gluon; issue 40): 16 heads, bf16 or
e4m3 cache. Its launch, compilation and the op: ``gluon_decode.py``.

Symbols: H = 16 heads, SQ = 1 or 2 query tokens per request (causal, bottom-right), r = 512 latent columns,
d_rope = 64, D = r + d_rope = 576, page = BLOCK_N = 64 keys (one page is one key tile), CW = 64 columns per chunk
(a 128-byte swizzled TMA box), CHUNKS = D / CW = 9 chunks per tile, 8 of them the value (c_kv) and the last one
k_rope. Same contract as
``splitkv_triton.splitkv_mla_with_kvcache`` (docstring there; torch oracle ``reference.flash_mla_with_kvcache``):
the step is this module's phase 1 plus our combine (``splitkv_combine_triton.combine_splits``), which merges the
base-2 partials into (out [bs, SQ, H, r] bf16, lse [bs, SQ, H] float32, natural log).

The kernel computes the TRANSPOSED tiles: keys are wgmma's M dimension and the 16 heads its N dimension
(wgmma takes N = 16; M is 64 per warpgroup; with two query tokens N = 32 rows n = j · 16 + h, each masked to its
own causal limit L - 1 + j), so no row of the tensor core is padding, S needs 8 registers per
thread and the whole [r, H] output accumulator 64 — one consumer warpgroup holds it (the heads-as-M layout
would pad 16 heads to M = 64 and need a [64, 512] fp32 accumulator: 256 registers per thread, two warpgroups).

    # one program (CTA) per schedule work row w = (b, start, end, slot); rows past num_work write nothing
    # (written for SQ = 1, N = H = 16 rows; SQ = 2: N = 32 rows n = j·H + h, and "key < end" below is
    # key < min(end, L_b - 1 + j) per row)
    end = min(end, L_b);  tiles = ceil((end - start) / 64)         (start: a multiple of 64, the planner's granule)
    smem: q [9][16, 64] (loaded once), kv ring [STAGES][9][64, 64] (the 8 value chunks of a stage together, the
          k_rope chunk in a ring of its own), p [16, 64], mbarriers ready/empty[STAGES]
    producer warp (1 warp, few registers):
        for i in range(tiles):                                      (page id of tile i + 1 read one tile ahead)
            s = i % STAGES; wait empty[s] (phase ((i // STAGES) & 1) ^ 1)
            expect ready[s] 9·8 KB; for c in 0..8: TMA kv2d[page_table[b, start/64 + i]·64 : +64, 64c : 64c + 64]
                                                        -> ring[s][c]   (kv2d = the pool viewed [pages·64, 576])
    consumer warpgroup (4 warps, the default partition):
        q -> smem (plain loads: q_lat and q_rope may lie apart, any strides);  m = -inf [H], l = 0 [64, H],
        accᵀ[c] = 0 [64, H] for c in 0..7
        for i in range(tiles):
            wait ready[s]
            Sᵀ = Σ_c ring[s][c] @ q[c]ᵀ                      9 wgmma m64n16k16 x 4 (K 64 per chunk), async, wait
            s2 = where(key < end, Sᵀ · scale · log2 e, -inf)
            m' = max(m, colmax(s2)); α = 2^(m - m'); Pᵀ = 2^(s2 - m'); m = m'
            l = l·α + Pᵀ   (elementwise, per thread: summed over keys once, after the loop)
            last tile of the request (end - n0 < 64): rows past end of ring[s][0..7] <- 0 (the page's tail may
                hold anything, NaN included, and 0 · NaN = NaN in P·V; keys are masked in s2 already)
            p <- P (bf16);  accᵀ[c] = accᵀ[c]·α + ring[s][c]ᵀ @ Pᵀ  for c in 0..7  (A: the V chunk, MN-major)
            arrive empty[s]
        part_o[slot][h, 64c + j] = accᵀ[c][j, h] / Σ l[:, h];  part_lse2[slot][h] = m + log2 Σ l   (0, -inf: no key)

Ring: STAGES = 2 tiles of 9 x 8 KB = 144 KB, plus q 18 KB and p 2 KB: 164 KB of shared memory, one CTA per SM;
while the consumer works on one tile the next one (72 KB) is in flight, more than the ~40 KB per SM that
bandwidth x latency asks for. A ring of single chunks (24 chunks = 2.7 tiles in 212 KB) is the next step if two
tiles are not enough.

Registers: the consumer holds accᵀ (64), Sᵀ / Pᵀ / l (8 each) and the per-head vectors; the producer warp runs
with ``PRODUCER_REGS`` (setmaxnreg). ``compile_for_hopper`` compiles for sm_90a without a GPU
(``tests/test_gluon_decode_compile.py`` reads wgmma, TMA and mbarrier instructions off the PTX and the spill
count off the cubin); docs/DECODE_KERNEL.md has the numbers and the design discussion.

The e4m3 cache (``KV8``; kv ``float8_e4m3fn`` + ``descale_k [1]``, q bf16 and never rounded to e4m3): the same
kernel with the ring holding e4m3 boxes [64, 64] (64 bytes a row, 64-byte swizzle; 9 x 4 KB = 36 KB a tile) and
STAGES_FP8 = 3 tiles (108 KB). wgmma takes no e4m3 x 16-bit product, so after ``wait ready[s]`` the consumer
converts the tile in shared memory, e4m3 ring[s] -> fp16 stg [9][64, 64] (72 KB; one ``cvt.rn.f16x2.e4m3x2`` per
2 values — e4m3 -> bf16 would add two F2F per 2 values; on the last tile the value rows past the end are zeroed in
the ring first), fences, and runs both dots on stg exactly as above, in fp16: q rescaled by an exact power of two
2^k (largest |q| in [2^13, 2^15), as ``splitkv_triton.py`` does), P stored fp16. ring[s] is released right after
the Sᵀ wgmma are issued (stg holds the tile). Scores: s · scale · 2^k · descale_k · log2 e; the output's descale_k
is applied by the combine (``combine_splits(..., descale_k)``), not here. Shared memory 205,884 B.

``reg_a`` (``REG_A``, the e4m3 cache only): no staging tile. Each chunk goes from the e4m3 ring straight into wgmma's
A-operand registers and is converted there (``cvt.rn.f16x2.e4m3x2``), so the conversion's shared-memory writes, its
fence and the dots' second read of the tile are gone, and the ring holds STAGES_FP8_REG = 5 tiles (180 KB). Every
read is 16 contiguous bytes a thread: for Sᵀ the contraction index of each chunk is permuted (column 16t + 2j + e is
k = 8j + 2t + e; q is stored in the same order, the sum is unchanged); for P·V the latent columns are renumbered
(``_v_step``: accᵀ[c] row ρ = 16w + 8rb + g holds latent column 16 (8w + g) + 2c + rb), so one 16-key step reads
all 8 value chunks a thread needs with four 16-byte loads, and the partial outputs are written back in that order.
``gluon_decode.FP8_REG_A_MIN_ROWS`` says which variant ``gluon_partials`` runs by default (measured: faster from bs 16,
slower at bs 1-4; docs/DECODE_KERNEL.md).

Written against the Gluon API of triton 3.6 (the GPU machine's); see docs/DECODE_KERNEL.md for what differs in
3.9. Imported lazily by its users: a CPU install without triton never imports it.

Measured (docs/DECODE_KERNEL.md has the tables), H100, 2026-12-07: the bf16 kernel correct, 1.03-1.09x the roofline
and 1.20x our Triton split-KV at bs 64, latency-bound at bs 1-4 (1.14-2.75x the roofline); the staged e4m3 read
correct and 1.2-1.5x the Triton e4m3 read, but 1.6-1.9x its own roofline (conversion-bound). The register read has
not run on a GPU yet.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

CW = 64  # columns per chunk: 64 bf16 = 128 bytes, the widest 128B-swizzled TMA box
STAGES = 2  # key tiles in the shared-memory ring (bf16 cache)
STAGES_FP8 = 3  # key tiles in the ring of an e4m3 cache (36 KB each; plus the 72 KB bf16 staging tile)
STAGES_FP8_REG = 5  # ... when the dots convert in registers (``reg_a``): no staging tile, 180 KB of ring
NUM_WARPS = 4  # the consumer warpgroup (the default partition)
PRODUCER_REGS = 40  # registers per thread of the producer warp (setmaxnreg; 24 is the floor)

# the TMA load's name: ``async_copy_global_to_shared`` in triton 3.6, ``async_load`` in later releases (3.9 raises
# on the old name)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _producer(kv_desc, ring, rope, ready, empty, pt, first_page, n_tiles, CHUNKS: gl.constexpr,
              NSTAGES: gl.constexpr, WAIT: gl.constexpr):
    """The load warp: for each tile, wait for a free ring slot, then 9 TMA boxes of the tile's page into it (the 8
    value chunks into ring[s · 8 ..], k_rope into rope[s]). ``WAIT``: launched as a programmatic dependent of the pool
    store (``gluon_partials(follows_store=True)``), the warp waits for that store (``griddepcontrol.wait``) before
    its first box: everything before — the schedule row, the length, the page ids, q — was written before the store
    began, and only the pool's rows are read after."""
    BN: gl.constexpr = kv_desc.block_type.shape[0]
    BW: gl.constexpr = kv_desc.block_type.shape[1]
    if WAIT:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    page_next = first_page
    for i in range(n_tiles):
        page = page_next
        page_next = gl.load(pt + i + 1, mask=i + 1 < n_tiles, other=0)  # read ahead: its latency hides behind the wait
        s = i % NSTAGES
        mbarrier.wait(empty.index(s), ((i // NSTAGES) & 1) ^ 1)  # a fresh barrier counts as released once
        bar = ready.index(s)
        mbarrier.expect(bar, CHUNKS * kv_desc.block_type.nbytes)
        row = page * BN
        for c in gl.static_range(CHUNKS):
            _tma_load(kv_desc, [row, c * BW], bar, _chunk(ring, rope, s, c, CHUNKS - 1))


@gluon.jit
def _zero_tail(ring, base, valid, LAT_CHUNKS: gl.constexpr, BN: gl.constexpr, BW: gl.constexpr,
               layout: gl.constexpr):
    """Rows >= ``valid`` of the value chunks ring[base .. base + LAT_CHUNKS) set to 0 (in place, shared memory)."""
    keep = (gl.arange(0, BN, layout=gl.SliceLayout(1, layout)) < valid)[:, None]
    for c in gl.static_range(LAT_CHUNKS):
        buf = ring.index(base + c)
        x = buf.load(layout)
        buf.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _chunk(ring, rope, s, c: gl.constexpr, LAT: gl.constexpr):
    """Chunk c of ring stage s: a value chunk ring[s · LAT + c] (c < LAT) or the k_rope chunk rope[s] (c = LAT). The
    value chunks of a stage lie together (512 rows: ``_v_step`` reads them as one [8, 64, 64] view)."""
    if c == LAT:
        return rope.index(s)
    else:
        return ring.index(s * LAT + c)


@gluon.jit
def _convert_tile(ring, rope, s, stg, CHUNKS: gl.constexpr, layout: gl.constexpr):
    """e4m3 chunks 0 .. CHUNKS of stage s -> fp16 stg[0 .. CHUNKS) (exact: e4m3 fits fp16; one cvt per 2 values)."""
    for c in gl.static_range(CHUNKS):
        stg.index(c).store(_chunk(ring, rope, s, c, CHUNKS - 1).load(layout).to(gl.float16))


@gluon.jit
def _stage_values_36(ring, s, NSTAGES: gl.constexpr, LAT: gl.constexpr, BN: gl.constexpr, BW: gl.constexpr):
    """The LAT value chunks of ring stage s as one [LAT, BN, BW] view (they lie together; triton 3.6's name)."""
    return ring._reinterpret(ring.dtype, [NSTAGES, LAT * BN, BW], ring.layout).index(s).reshape([LAT, BN, BW])


@gluon.jit
def _stage_values_39(ring, s, NSTAGES: gl.constexpr, LAT: gl.constexpr, BN: gl.constexpr, BW: gl.constexpr):
    """``_stage_values_36`` under the name later releases give the reinterpretation."""
    return ring.reinterpret(ring.dtype, [NSTAGES, LAT * BN, BW], ring.layout).index(s).reshape([LAT, BN, BW])


# a shared-memory view's reinterpretation: ``_reinterpret`` in triton 3.6, ``reinterpret`` in later releases
_stage_values = _stage_values_39 if hasattr(gl.shared_memory_descriptor, "reinterpret") else _stage_values_36


@gluon.jit
def _v_step(vt, ks, LAT: gl.constexpr, BN: gl.constexpr, BW: gl.constexpr):
    """The e4m3 register read's A operands for k-step ``ks`` of P·V: keys 16·ks .. 16·ks + 15 of the 8 value chunks
    ``vt`` [LAT, BN, BW] of one ring stage -> 8 fp16 tensors [64, 16] (chunk c: accᵀ[c]'s rows ρ x the 16 keys).

    The latent columns are renumbered so that every thread's values lie in 16 contiguous bytes a key: accᵀ[c] row
    ρ = 16w + 8rb + g (warp w, lane group g, register half rb — wgmma's A layout) is latent column
    16 (8w + g) + 2c + rb, i.e. the value chunk 2w + g // 4, column 16 (g % 4) + 2c + rb. Thread (w, g, t) reads
    keys 2t, 2t + 1, 2t + 8, 2t + 9 of that chunk, 16 bytes each (4 loads; the byte-wise transposed read of the
    natural order takes 32 one-byte loads per chunk), the output columns are written back in the same order."""
    pv_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [1, 0, 0]],
        warp_bases=[[2, 0, 0], [4, 0, 0]], block_bases=[], shape=[LAT, 16, BW])
    x = vt.slice(ks * 16, 16, dim=1).load(pv_l).to(gl.float16)  # [chunk, key, column]
    # chunk = 2w + g2, column = 16 g01 + 2c + rb  ->  [ρ = (w, rb, g2, g01), key, c = (c2, c1, c0)]
    x = x.reshape([4, 2, 16, 4, 8, 2]).permute((0, 5, 1, 3, 2, 4)).reshape([64, 16, 2, 2, 2])
    c0a, c0b = x.split()
    c1a, c1b = c0a.split()
    c1c, c1d = c0b.split()
    p0, p4 = c1a.split()  # c0 = 0, c1 = 0: c = 0, 4
    p2, p6 = c1b.split()  # c0 = 0, c1 = 1: c = 2, 6
    p1, p5 = c1c.split()  # c0 = 1, c1 = 0: c = 1, 5
    p3, p7 = c1d.split()  # c0 = 1, c1 = 1: c = 3, 7
    return (p0, p1, p2, p3, p4, p5, p6, p7)


@gluon.jit
def _consumer(q_row, qr_row, stride_qs, stride_qh, stride_qrs, stride_qrh, ring, rope, stg, q_smem, p_smem, ready,
              empty,
              o_row, stride_os, stride_oh, lse_row, stride_ls, start, end, seqlen, n_tiles, live, scale_log2, DescaleK,
              H: gl.constexpr, SQ: gl.constexpr, R: gl.constexpr, CHUNKS: gl.constexpr, NSTAGES: gl.constexpr,
              BN: gl.constexpr, BW: gl.constexpr, KV8: gl.constexpr, REG_A: gl.constexpr, PDL: gl.constexpr):
    """The math warpgroup: q into shared memory, then Sᵀ, the online softmax and accᵀ per tile; the partials.
    Its N = H · SQ columns are the query rows n = j · H + h (query token j, head h). ``REG_A`` (e4m3 cache only):
    each chunk of the tile is read from the ring straight into wgmma's A-operand registers and converted there
    (no fp16 copy of the tile in shared memory)."""
    LAT: gl.constexpr = R // BW
    N: gl.constexpr = H * SQ
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    head_l: gl.constexpr = gl.SliceLayout(0, acc_l)  # [N]
    key_l: gl.constexpr = gl.SliceLayout(1, acc_l)  # [BN] (and [BW]: the rows of accᵀ are latent columns)
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [16, 64] per pass, rows x 16 B
    cvt_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # e4m3 [32, 64] per pass, rows x 16 B
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)  # wgmma's A in registers
    # REG_A, Sᵀ: a K chunk read 16 contiguous bytes a row (two 16-byte loads a thread: rows g and g + 8 of its
    # warp's 16, bytes 16t .. 16t + 15), then reinterpreted as wgmma's A with the contraction index permuted —
    # column 16t + 2j + e is logical k = 8j + 2t + e; q's columns are stored in the same order (``_k_order``)
    a16_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)  # [64, 16]: one k-step
    ks_l: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
                                                    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                                    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BN, BW])

    # q: 8 latent chunks and the rope chunk, [H, 64] each (wgmma's B, K-major after the permute below)
    nn = gl.arange(0, N, layout=gl.SliceLayout(1, tile_l))
    cc = gl.arange(0, BW, layout=gl.SliceLayout(0, tile_l))
    if REG_A:  # q's logical column k holds its column 16t + 2j + e (k = 8j + 2t + e): the K chunks' order (ks_l)
        cc = 16 * ((cc % 8) // 2) + 2 * (cc // 8) + cc % 2
    q_off = (nn // H) * stride_qs + (nn % H) * stride_qh  # row n = j · H + h: q[b, j, h]
    qr_off = (nn // H) * stride_qrs + (nn % H) * stride_qrh
    if KV8:
        # e4m3 cache: the dots run in fp16 (e4m3 -> fp16 is one native cvt per 2 values on sm90; -> bf16 would add
        # two more, F2F, per 2 values). q (bf16, never rounded to e4m3) is first rescaled by a power of two 2^k
        # (exact) so that its largest |q| lies in [2^13, 2^15): no fp16 overflow, and bf16 -> fp16 exact for every
        # component within 2^27 of the largest (splitkv_triton.py does the same); 2^k and the cache's per-tensor
        # scale fold into the score scale (the scale also into the output: in the combine).
        qs = ()
        for c in gl.static_range(LAT):
            qs = qs + (gl.load(q_row + q_off[:, None] + c * BW + cc[None, :]).to(gl.float32),)
        qs = qs + (gl.load(qr_row + qr_off[:, None] + cc[None, :]).to(gl.float32),)
        amax = gl.max(gl.max(gl.abs(qs[0]), axis=1), axis=0)
        for c in gl.static_range(1, CHUNKS):
            amax = gl.maximum(amax, gl.max(gl.max(gl.abs(qs[c]), axis=1), axis=0))
        big = amax > 0.0
        shift = gl.where(big, gl.floor(gl.log2(gl.where(big, amax, 1.0))) - 13.0, 0.0)
        pow2 = gl.exp2(shift)
        q_inv = gl.exp2(-shift)  # a power of two: q · q_inv is exact, no division
        for c in gl.static_range(CHUNKS):
            q_smem.index(c).store((qs[c] * q_inv).to(gl.float16))
        scale_log2 = scale_log2 * pow2 * gl.load(DescaleK)
    else:
        for c in gl.static_range(LAT):
            q_smem.index(c).store(gl.load(q_row + q_off[:, None] + c * BW + cc[None, :]))
        q_smem.index(LAT).store(gl.load(qr_row + qr_off[:, None] + cc[None, :]))
    fence_async_shared()

    m = gl.full([N], float("-inf"), gl.float32, head_l)
    l_part = gl.zeros([BN, N], gl.float32, acc_l)  # per-thread partial row sums, reduced once after the loop
    acc = ()
    for c in gl.static_range(LAT):
        acc = acc + (gl.zeros([BW, N], gl.float32, acc_l),)
    if SQ > 1:  # causal, bottom-right: query token j sees keys < seqlen - (SQ - 1 - j)
        lim = gl.minimum(end, seqlen - (SQ - 1) + gl.arange(0, N, layout=head_l) // H)
    for i in range(n_tiles):
        s = i % NSTAGES
        n0 = start + i * BN
        mbarrier.wait(ready.index(s), (i // NSTAGES) & 1)
        if REG_A:  # the value rows past the end <- 0 in the ring (they may hold NaN); the dots convert in registers
            if end - n0 < BN:
                _zero_tail(ring, s * LAT, end - n0, LAT, BN, BW, cvt_l)
                fence_async_shared()
        elif KV8:  # e4m3 ring[s] -> fp16 stg; the dots read stg
            if end - n0 < BN:  # the last tile: the value rows past the end <- 0 in the ring first (may hold NaN)
                _zero_tail(ring, s * LAT, end - n0, LAT, BN, BW, cvt_l)
            _convert_tile(ring, rope, s, stg, CHUNKS, cvt_l)
            fence_async_shared()  # the generic-proxy writes (stg; the zeroed ring rows) before wgmma / the next TMA
            # 0, but opaque and loop-variant: else the 17 wgmma smem descriptors of stg (64-bit each) are hoisted
            # out of the loop and held across it (triton 3.6 then spills them)
            base = gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [i], dtype=gl.int32, is_pure=True,
                                             pack=1)
        st = gl.zeros([BN, N], gl.float32, acc_l)
        if REG_A:  # chunk c + 1 is read and converted while chunk c's wgmma runs (at most one in flight)
            for c in gl.static_range(CHUNKS):
                x = _chunk(ring, rope, s, c, LAT).load(ks_l).to(gl.float16)
                x = x.reshape([BN, 4, 8, 2]).permute((0, 2, 1, 3)).reshape([BN, BW])  # column 16t+2j+e -> k 8j+2t+e
                a = gl.convert_layout(x, a_l)  # the same registers in another order: no data moves
                st = warpgroup_mma(a, q_smem.index(c).permute((1, 0)), st, is_async=True)
                st, a = warpgroup_mma_wait(1, deps=[st, a])
        elif KV8:
            for c in gl.static_range(CHUNKS):
                st = warpgroup_mma(stg.index(base + c), q_smem.index(c).permute((1, 0)), st, is_async=True)
        else:
            for c in gl.static_range(CHUNKS):
                st = warpgroup_mma(_chunk(ring, rope, s, c, LAT), q_smem.index(c).permute((1, 0)), st, is_async=True)
        if KV8 and not REG_A:  # ring[s] was read into stg before the barrier that precedes these wgmma: release it
            mbarrier.arrive(empty.index(s), count=1)
        st = warpgroup_mma_wait(0, deps=[st])

        keys = n0 + gl.arange(0, BN, layout=key_l)
        if SQ > 1:
            s2 = gl.where(keys[:, None] < lim[None, :], st * scale_log2, float("-inf"))
        else:
            s2 = gl.where((keys < end)[:, None], st * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s2, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_safe)
        p = gl.exp2(s2 - m_safe[None, :])
        l_part = l_part * alpha[None, :] + p
        m = m_new
        if not KV8:
            if end - n0 < BN:  # the request's last tile: the page's rows past its end are not keys (may hold NaN)
                _zero_tail(ring, s * LAT, end - n0, LAT, BN, BW, tile_l)
        p_smem.store(gl.permute(p.to(p_smem.dtype), (1, 0)))
        fence_async_shared()
        new_acc = ()
        if REG_A:  # accᵀ[c] += Vᵀ_c · Pᵀ one k-step of 16 keys at a time, all 8 chunks' A from one read (_v_step)
            vt = _stage_values(ring, s, NSTAGES, LAT, BN, BW)
            for c in gl.static_range(LAT):
                new_acc = new_acc + (acc[c] * alpha[None, :],)
            for ks in gl.static_range(BN // 16):
                parts = _v_step(vt, ks, LAT, BN, BW)
                pk = p_smem.slice(ks * 16, 16, dim=1).permute((1, 0))  # [16 keys, N]
                issued = ()
                for c in gl.static_range(LAT):
                    issued = issued + (warpgroup_mma(gl.convert_layout(parts[c], a16_l), pk, new_acc[c],
                                                     is_async=True),)
                res = warpgroup_mma_wait(LAT, deps=issued + parts)  # the previous k-step's 8 are done
                new_acc = ()
                for c in gl.static_range(LAT):
                    new_acc = new_acc + (res[c],)
            mbarrier.arrive(empty.index(s), count=1)  # every chunk of ring[s] is in registers by now
        elif KV8:
            for c in gl.static_range(LAT):
                new_acc = new_acc + (warpgroup_mma(stg.index(base + c).permute((1, 0)), p_smem.permute((1, 0)),
                                                   acc[c] * alpha[None, :], is_async=True),)
        else:
            for c in gl.static_range(LAT):
                new_acc = new_acc + (warpgroup_mma(ring.index(s * LAT + c).permute((1, 0)), p_smem.permute((1, 0)),
                                                   acc[c] * alpha[None, :], is_async=True),)
        acc = warpgroup_mma_wait(0, deps=new_acc)
        if not KV8:
            mbarrier.arrive(empty.index(s), count=1)

    if PDL:  # the key loop is done: the combine (a programmatic dependent) may launch; it waits for the whole grid
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    if live:
        l = gl.sum(l_part, axis=0)
        seen = l > 0.0
        l_safe = gl.where(seen, l, 1.0)
        hv = gl.arange(0, N, layout=head_l)
        gl.store(lse_row + (hv // H) * stride_ls + hv % H, gl.where(seen, m + gl.log2(l_safe), float("-inf")))
        out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [0, 1])  # latent column fastest: coalesced
        jj = gl.arange(0, BW, layout=gl.SliceLayout(1, out_l))
        ho = gl.arange(0, N, layout=gl.SliceLayout(0, out_l))
        o_off = (ho // H) * stride_os + (ho % H) * stride_oh
        inv = 1.0 / l_safe
        for c in gl.static_range(LAT):
            o = gl.convert_layout(acc[c] * inv[None, :], out_l)
            if REG_A:  # accᵀ[c] row ρ is latent column _v_column(c, ρ) (_v_step's order)
                col = 16 * (8 * (jj // 16) + jj % 8) + 2 * c + (jj // 8) % 2
            else:
                col = c * BW + jj
            gl.store(o_row + o_off[None, :] + col[:, None], o)


@gluon.jit
def gluon_mla_decode_kernel(
    kv_desc, Q, QR, PageTable, SeqLens, Work, NumWork, PartO, PartLse2, DescaleK,
    stride_qb, stride_qs, stride_qh, stride_qrb, stride_qrs, stride_qrh, stride_ptb, max_pages, stride_ow, stride_os,
    stride_oh, stride_lw, stride_ls,
    scale_log2,
    H: gl.constexpr, SQ: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, NSTAGES: gl.constexpr,
    PRODUCER_NREG: gl.constexpr, KV8: gl.constexpr, REG_A: gl.constexpr, PDL: gl.constexpr, WAIT: gl.constexpr,
):
    BN: gl.constexpr = kv_desc.block_type.shape[0]
    BW: gl.constexpr = kv_desc.block_type.shape[1]
    CHUNKS: gl.constexpr = (R + DR) // BW
    w = gl.program_id(0)
    num_work = gl.load(NumWork)
    b = gl.load(Work + w * 4)
    start = gl.load(Work + w * 4 + 1)
    stop = gl.load(Work + w * 4 + 2)
    slot = gl.load(Work + w * 4 + 3)
    live = w < num_work
    # the first page id is read with the length, not after it (one dependent load less before the first TMA)
    pt = PageTable + b.to(gl.int64) * stride_ptb + start // BN
    first_page = gl.load(pt, mask=live & (start < stop) & (start // BN < max_pages), other=0)
    seqlen = gl.load(SeqLens + b)
    end = gl.minimum(stop, seqlen)
    n_tiles = gl.where(live & (end > start), (end - start + BN - 1) // BN, 0)

    LAT: gl.constexpr = R // BW
    ring = gl.allocate_shared_memory(kv_desc.dtype, [NSTAGES * LAT, BN, BW], kv_desc.layout)  # the value chunks
    rope = gl.allocate_shared_memory(kv_desc.dtype, [NSTAGES, BN, BW], kv_desc.layout)  # the k_rope chunk
    DT: gl.constexpr = gl.float16 if KV8 else gl.bfloat16  # the dots' operand type
    N: gl.constexpr = H * SQ  # wgmma's N: the query rows (token, head) of one request
    qp_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, BW], DT)
    if KV8 and not REG_A:  # the fp16 copy of one e4m3 tile, the dots' A operand (no e4m3 x 16-bit wgmma)
        stg = gl.allocate_shared_memory(DT, [CHUNKS, BN, BW], gl.NVMMASharedLayout.get_default_for([BN, BW], DT))
    else:
        stg = ring
    q_smem = gl.allocate_shared_memory(DT, [CHUNKS, N, BW], qp_l)
    p_smem = gl.allocate_shared_memory(DT, [N, BN], qp_l)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NSTAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    q_row = Q + b.to(gl.int64) * stride_qb
    qr_row = QR + b.to(gl.int64) * stride_qrb
    o_row = PartO + slot.to(gl.int64) * stride_ow
    lse_row = PartLse2 + slot.to(gl.int64) * stride_lw
    gl.warp_specialize([
        (_consumer, (q_row, qr_row, stride_qs, stride_qh, stride_qrs, stride_qrh, ring, rope, stg, q_smem, p_smem,
                     ready, empty, o_row, stride_os, stride_oh, lse_row, stride_ls, start, end, seqlen, n_tiles, live,
                     scale_log2, DescaleK, H, SQ, R, CHUNKS, NSTAGES, BN, BW, KV8, REG_A, PDL)),
        (_producer, (kv_desc, ring, rope, ready, empty, pt, first_page, n_tiles, CHUNKS, NSTAGES, WAIT)),
    ], [1], [PRODUCER_NREG])
