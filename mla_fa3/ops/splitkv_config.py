"""Launch configuration of the split-KV decode kernel, and the measured table that picks one per shape.

A :class:`KernelConfig` holds everything that is fixed when the kernel is compiled (key block, warps,
pipeline stages, rows per program, partial-result precision, whether the key tile is loaded once or
twice) plus the planner's ``waves`` (programs per SM the split count aims for). The schedule carries the
config it was planned with (``SplitKVSchedule.config``), so the kernel launch and the split count
always agree; a CUDA graph keeps the config it was captured with.

``choose_config(heads, bs, ctx, kv_fp8=)`` reads :data:`CONFIG_TABLE` (a bf16 / fp16 cache) or
:data:`E4M3_CONFIG_TABLE` (an e4m3 cache): measured rows ``(heads, bs, ctx) -> config`` (``python -m
mla_fa3.bench.splitkv --sweep [--fp8]`` prints a fresh table to paste here). The row of the same head class
(<= 32 heads: memory-bound; more: compute-bound) nearest in (log2 bs, log2 ctx) wins (``table_key``: that row's
key). ``combine_tile(rows)`` is the combine's tile (splits per load, columns) by output rows unless a config names
one, ``check_combine_tile`` the check of one given instead. Pure host code: no triton import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

__all__ = ["KernelConfig", "CONFIG_TABLE", "E4M3_CONFIG_TABLE", "choose_config", "table_key", "MAX_BLOCK_N",
           "NARROW_ROWS", "FUSED_PROJECTION_MAX_TOKENS", "FUSED_PROJECTION_MAX_COLUMNS", "latent_chunks",
           "combine_tile", "check_combine_tile"]

MAX_BLOCK_N = 64  # key blocks never exceed the split granule (64): a block then lies in one page of >= block_n
WIDE_HEADS = 32  # more heads than this: compute-bound rows of the table
NARROW_ROWS = 64  # fewer rows (heads x query tokens) per program than this: the dots run as mma.sync, else wgmma
COMBINE_WIDE = (16, 64)  # (splits loaded at once, latent columns) of a combine program; >= 128 output rows
COMBINE_MID = (64, 64)  # 64-127 output rows (16 heads, bs 4-7): a quarter of the wide tile's loop trips
COMBINE_NARROW = (128, 32)  # fewer output rows (bs·sq·H < 64): twice the programs, an eighth of the loop trips
# query tokens (bs·sq) up to which the output projection runs inside the combine (``KernelConfig.fused_projection``):
# every (token, head) row's programs read their rows of w_uv[h], so the weights are read once per token
FUSED_PROJECTION_MAX_TOKENS = 8
# output columns (w_uv's N) up to which it may: a combine program holds its [columns, N] block of w_uv[h] in registers
# (the combine tile's 32 or 64 columns x 256 fp32 over 4 warps: at most 128 per thread; ``combine_splits`` refuses a
# wider block, e.g. a bench's ``tile=``); wider projections run after the combine
FUSED_PROJECTION_MAX_COLUMNS = 256


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of phase 1 and the planner's waves (None: chosen from the shape).

    block_n       keys per loop step (16, 32 or 64)
    num_warps     warps per program (None: 4 for <= 32 rows, else 8)
    num_stages    software-pipeline depth of the key loads
    max_rows      heads x query tokens per program (the tl.dot M dimension)
    waves         programs per SM the split planner aims for
    half_partials partial outputs stored in the output dtype (bf16/fp16) instead of float32
    reload_kv     load the latent tile a second time for P·V (each load then feeds one dot)
    pdl           programmatic dependent launch of both phases (CUDA sm_90+; elsewhere they launch in order); with
                  ``warp_specialized`` the combine alone (phase 1 signals it after its key loops)
    max_registers registers per thread phase 1 is compiled to (``maxnreg``; None: the compiler's choice): fewer
                  registers fit more programs on an SM (with few stages, shared memory allows up to 4)
    latent_chunks q·kᵀ over the latent as this many column chunks (1, 2 or 4), each its own dot: under mma.sync
                  (< 64 rows) one dot is a chain of dependent mma per warp (36 for DeepSeek's 512 + 64 columns),
                  chunks make independent chains; P·V and the output are chunked alike. Applies when the latent
                  width is a power of two of at least 32 columns per chunk, at < 64 rows; else 1
    prefetch_pages read the next key block's page id one iteration ahead, so that the tile loads are multi-buffered
                  (``num_stages`` - 1 in flight); None: on under mma.sync (< 64 rows), off under wgmma, where
                  the buffers share shared memory with a 64-row q
    fused_projection with an output projection given (``splitkv_mla_with_kvcache(w_uv=)``), it runs inside the
                  combine for up to ``FUSED_PROJECTION_MAX_TOKENS`` query tokens (bs·sq) and
                  ``FUSED_PROJECTION_MAX_COLUMNS`` output columns; else (False, the default, or more) a per-head
                  matmul after the combine (``ops.head_matmul``). Off: measured 0.4-5 µs
                  slower per step on the H200 (docs/PERFORMANCE_HISTORY.md, 2026-12-06)
    warp_specialized phase 1 as the warp-specialized Gluon kernel (``gluon_decode.py``: a TMA producer warp, a
                  wgmma consumer warpgroup, one program per SM) instead of the Triton one; the same schedule,
                  workspace and combine. Its shapes so far: 16 heads, one query token (two, causal, over a bf16
                  cache), bf16 or e4m3 cache with a bf16 q, page 64, DeepSeek's 512 + 64 columns, no fused
                  projection; a launch outside them raises ValueError. Needs block_n 64
                  (its tile); one program fits an SM, so ``waves`` is programs per SM in sequence (1.0: one wave);
                  ``half_partials`` applies, num_warps / num_stages / max_rows / max_registers / latent_chunks /
                  prefetch_pages / reload_kv do not (its warps, ring and registers are its own)
    combine_tile  (splits per load, columns) of the combine's programs, two powers of two; None: ``combine_tile``'s
                  rule by output rows
    fit_splits    the planner's fit (``splitkv_plan.fit_chunk``): a chunk up to a quarter longer where that keeps the
                  splits within the target's slots and a model of the rounds says the plan ends sooner; off: the even
                  share rounded up to the granule, whatever the count (the plan before 2026-12-08)
    even_splits   the planner's even cut (``splitkv_plan._cut_even``): each request gets its share of the target
                  in splits that differ by at most one key block (``block_n``), instead of chunk-sized splits on
                  64-key (or page) starts — so that every program slot holds a split and every SM about the same
                  keys (at bs 4 x 64k on 132 SMs: 264 splits of 31 or 32 blocks instead of 256 of 32, where 8 SMs
                  hold one split and 124 hold two)
    discard_partials the combine drops the partial outputs it read from the L2 (``discard.global.L2``) instead of
                  letting them be written back to memory when the next layer's stream evicts them (at 16 heads, bs 4
                  with bf16 partials: 4 MB a layer, 2.6 % of a 32k step's bytes); where its column blocks are whole
                  128-byte lines no other program reads (``splitkv_combine_triton.discards_partials``), else ignored
    """

    block_n: int = 32
    num_warps: Optional[int] = None
    num_stages: int = 2
    max_rows: int = 64
    waves: float = 2.0
    half_partials: bool = False
    reload_kv: bool = False
    pdl: bool = True
    max_registers: Optional[int] = None
    latent_chunks: int = 1
    prefetch_pages: Optional[bool] = None
    fused_projection: bool = False
    warp_specialized: bool = False
    combine_tile: Optional[Tuple[int, int]] = None
    fit_splits: bool = True
    even_splits: bool = False
    discard_partials: bool = False

    def __post_init__(self):
        if self.block_n not in (16, 32, 64):
            raise ValueError(f"block_n must be 16, 32 or {MAX_BLOCK_N}, got {self.block_n}")
        if self.max_rows not in (16, 32, 64, 128):
            raise ValueError(f"max_rows must be 16, 32, 64 or 128, got {self.max_rows}")
        if self.max_registers is not None and not (isinstance(self.max_registers, int) and 64 <= self.max_registers
                                                   <= 255 and self.max_registers % 8 == 0):
            raise ValueError(f"max_registers must be None or a multiple of 8 in [64, 255], got {self.max_registers}")
        if self.latent_chunks not in (1, 2, 4):
            raise ValueError(f"latent_chunks must be 1, 2 or 4, got {self.latent_chunks}")
        if self.num_warps not in (None, 2, 4, 8, 16) or self.num_stages < 1 or not self.waves > 0:
            raise ValueError(f"bad num_warps / num_stages / waves: {self.num_warps}, {self.num_stages}, {self.waves}")
        if self.combine_tile is not None:
            if not (isinstance(self.combine_tile, tuple) and len(self.combine_tile) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in self.combine_tile)):
                raise ValueError(f"combine_tile must be None or a (splits, columns) tuple of ints, got "
                                 f"{self.combine_tile!r}")
            check_combine_tile(self.combine_tile)
        if self.warp_specialized and (self.block_n != 64 or self.fused_projection):
            raise ValueError("warp_specialized needs block_n 64 (its tile) and no fused_projection, got block_n "
                             f"{self.block_n}, fused_projection {self.fused_projection}")

    def label(self) -> str:
        extra = (("-h" if self.half_partials else "") + ("-r" if self.reload_kv else "")
                 + ("" if self.pdl else "-nopdl") + (f"-reg{self.max_registers}" if self.max_registers else "")
                 + (f"-c{self.latent_chunks}" if self.latent_chunks > 1 else "")
                 + ({None: "", True: "-pf", False: "-nopf"}[self.prefetch_pages])
                 + ("-fp" if self.fused_projection else "") + ("-ws" if self.warp_specialized else "")
                 + ("-t{}x{}".format(*self.combine_tile) if self.combine_tile else "")
                 + ("" if self.fit_splits else "-nofit") + ("-e" if self.even_splits else "")
                 + ("-d" if self.discard_partials else ""))
        return (f"n{self.block_n}-w{self.num_warps or 'auto'}-s{self.num_stages}-v{self.waves:g}-m{self.max_rows}"
                f"{extra}")

    def with_(self, **kw) -> "KernelConfig":
        return replace(self, **kw)


# (heads, bs, ctx) -> config for a bf16 / fp16 cache; measured on the H200 (bf16, page 64) by ``bench.splitkv --sweep``
# on 2026-12-03, the 16-head rows again on 2026-12-04 after the kernel's loads became multi-buffered (3 stages now
# pay), programmatic dependent launch A/B-tested per shape on 2026-12-04 (on at 16 heads, off at 128), the latent
# chunks on 2026-12-05 (``--ab latent_chunks``: 4 at 16 heads; docs/PERFORMANCE_HISTORY.md). The time of each shape's winner
# in the comment; docs/PERFORMANCE_HISTORY.md has the peers' times.
CONFIG_TABLE: dict = {
    (16, 1, 65536): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True, latent_chunks=4),  # 30.4 us
    (16, 2, 131072): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True, latent_chunks=4),  # 82.8 us
    (16, 4, 32768): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True, latent_chunks=4),  # 48.1 us
    (128, 1, 16384): KernelConfig(block_n=64, num_warps=8, num_stages=2, max_rows=64, waves=1.0, half_partials=False, reload_kv=False, pdl=False),  # 34.3 us
    (128, 2, 32768): KernelConfig(block_n=64, num_warps=8, num_stages=2, max_rows=64, waves=1.0, half_partials=False, reload_kv=False, pdl=False),  # 91.9 us
    (128, 4, 65536): KernelConfig(block_n=64, num_warps=8, num_stages=2, max_rows=64, waves=2.0, half_partials=False, reload_kv=True, pdl=False),  # 306.6 us
}
# (heads, bs, ctx) -> config for an e4m3 cache: the sweeps over e4m3 (``bench.splitkv --sweep --fp8``, 2026-12-04) chose
# the bf16 rows' configs; the latent chunks A/B on e4m3 (``--fp8 --ab latent_chunks``, 2026-12-05) 2 at 16 heads (4 is
# slower there: each chunk's tile is converted apart). The 128-head rows are CONFIG_TABLE's (wgmma: no chunks).
E4M3_CONFIG_TABLE: dict = {
    (16, 1, 65536): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True, latent_chunks=2),  # 33.5 us
    (16, 2, 131072): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True, latent_chunks=2),  # 100.4 us
    (16, 4, 32768): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True, latent_chunks=2),  # 33.8 / 101.0 us at bs 4, 16k / 64k
    **{key: config for key, config in CONFIG_TABLE.items() if key[0] > WIDE_HEADS},
}


def latent_chunks(config: KernelConfig, head_dim_v: int, rows: int) -> int:
    """The latent chunks phase 1 runs with: ``config.latent_chunks`` where each chunk is a whole power-of-two
    block of >= 32 columns and the dots run as mma.sync (``rows`` < NARROW_ROWS), else 1 (wgmma chains itself)."""
    whole = head_dim_v >= 16 and head_dim_v & (head_dim_v - 1) == 0
    if rows < NARROW_ROWS and whole and head_dim_v // config.latent_chunks >= 32:
        return config.latent_chunks
    return 1


def combine_tile(rows: int) -> Tuple[int, int]:
    """(splits per load, columns) of a combine program for ``rows`` = bs·sq·H output rows. The narrow tile's 32
    columns were measured on the H200 (16 heads, bs 1, 16k / 64k: 15.5 / 33.4 µs for both phases against 16.5 / 36.1
    with the wide tile; no change at bs 4 or 128 heads); its 128 splits per load (instead of 64) on an H100 in three
    runs on two days (0.2-0.7 µs less at 16 heads, bs 1-2, 16k-128k; 128 splits per load lose at bs >= 4) —
    docs/PERFORMANCE_HISTORY.md. The mid tile inside SGLang's step on an H100 (2026-12-08: 0.1-0.7 µs less a layer
    in each of 13 pairs at 16 heads, bs 4, 16k-64k, where a request has 64 splits: one load instead of four;
    docs/PERFORMANCE.md)."""
    return COMBINE_NARROW if rows < 64 else COMBINE_MID if rows < 128 else COMBINE_WIDE


def check_combine_tile(tile: Tuple[int, int]) -> Tuple[int, int]:
    """A combine tile given instead of the rule's (``splitkv_combine_triton.combine_splits(tile=)``): (splits per load,
    columns), both powers of two; else ValueError."""
    block_s, cols = tile
    if block_s < 1 or cols < 1 or block_s & (block_s - 1) or cols & (cols - 1):
        raise ValueError(f"combine tile must be two powers of two (splits per load, columns), got {tile}")
    return block_s, cols


def choose_config(heads: int, bs: int, ctx: int, table: Optional[dict] = None, *, kv_fp8: bool = False) -> KernelConfig:
    """The table's config for (heads, bs, ctx): same head class, nearest in (log2 bs, log2 ctx). ``table`` None:
    :data:`E4M3_CONFIG_TABLE` for an e4m3 cache (``kv_fp8``), else :data:`CONFIG_TABLE`."""
    if table is None:
        table = E4M3_CONFIG_TABLE if kv_fp8 else CONFIG_TABLE
    key = table_key(heads, bs, ctx, table)
    return KernelConfig() if key is None else table[key]


def table_key(heads: int, bs: int, ctx: int, table: dict) -> Optional[Tuple[int, int, int]]:
    """The row of ``table`` that ``choose_config`` reads for (heads, bs, ctx) (None: an empty table): same head class,
    nearest in (log2 bs, log2 ctx), ties to the smaller key."""
    wide = heads > WIDE_HEADS
    keys = [k for k in table if (k[0] > WIDE_HEADS) == wide] or list(table)
    if not keys:
        return None

    def dist(key):
        return (abs(math.log2(max(bs, 1)) - math.log2(key[1])) + abs(math.log2(max(ctx, 1)) - math.log2(key[2])),
                key)

    return min(keys, key=dist)
