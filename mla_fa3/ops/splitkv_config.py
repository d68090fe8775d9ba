"""Launch configuration of the split-KV decode kernel, and the measured table that picks one per shape.

A :class:`KernelConfig` holds everything that is fixed when the kernel is compiled (key block, warps,
pipeline stages, rows per program, partial-result precision, whether the key tile is loaded once or
twice) plus the planner's ``waves`` (programs per SM the split count aims for). The schedule carries the
config it was planned with (``SplitKVSchedule.config``), so the kernel launch and the split count
always agree; a CUDA graph keeps the config it was captured with.

``choose_config(heads, bs, ctx)`` reads :data:`CONFIG_TABLE`: measured rows ``(heads, bs, ctx) ->
config`` (``python -m mla_fa3.bench.splitkv --sweep`` prints a fresh table to paste here). The row of
the same head class (<= 32 heads: memory-bound; more: compute-bound) nearest in (log2 bs, log2 ctx)
wins. Pure host code: no triton import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["KernelConfig", "CONFIG_TABLE", "choose_config", "MAX_BLOCK_N"]

MAX_BLOCK_N = 64  # key blocks never exceed the split granule (64): a block then lies in one page of >= block_n
WIDE_HEADS = 32  # more heads than this: compute-bound rows of the table


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
    pdl           programmatic dependent launch of both phases (CUDA sm_90+; elsewhere they launch in order)
    max_registers registers per thread phase 1 is compiled to (``maxnreg``; None: the compiler's choice): fewer
                  registers fit more programs on an SM (with few stages, shared memory allows up to 4)
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

    def __post_init__(self):
        if self.block_n not in (16, 32, 64):
            raise ValueError(f"block_n must be 16, 32 or {MAX_BLOCK_N}, got {self.block_n}")
        if self.max_rows not in (16, 32, 64, 128):
            raise ValueError(f"max_rows must be 16, 32, 64 or 128, got {self.max_rows}")
        if self.max_registers is not None and not (isinstance(self.max_registers, int) and 64 <= self.max_registers
                                                   <= 255 and self.max_registers % 8 == 0):
            raise ValueError(f"max_registers must be None or a multiple of 8 in [64, 255], got {self.max_registers}")
        if self.num_warps not in (None, 2, 4, 8, 16) or self.num_stages < 1 or not self.waves > 0:
            raise ValueError(f"bad num_warps / num_stages / waves: {self.num_warps}, {self.num_stages}, {self.waves}")

    def label(self) -> str:
        extra = (("-h" if self.half_partials else "") + ("-r" if self.reload_kv else "")
                 + ("" if self.pdl else "-nopdl") + (f"-reg{self.max_registers}" if self.max_registers else ""))
        return (f"n{self.block_n}-w{self.num_warps or 'auto'}-s{self.num_stages}-v{self.waves:g}-m{self.max_rows}"
                f"{extra}")

    def with_(self, **kw) -> "KernelConfig":
        return replace(self, **kw)


# (heads, bs, ctx) -> config; measured on the H200 (bf16, page 64) by ``bench.splitkv --sweep`` on 2026-12-03, the
# 16-head rows again on 2026-12-04 after the kernel's loads became multi-buffered (3 stages now pay), programmatic
# dependent launch A/B-tested per shape on 2026-12-04 (on at 16 heads, off at 128: docs/PERFORMANCE.md). The time of
# each shape's winner in the comment; docs/PERFORMANCE.md has the peers' times.
CONFIG_TABLE: dict = {
    (16, 1, 65536): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True),  # 30.7 us
    (16, 2, 131072): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True),  # 84.2 us
    (16, 4, 32768): KernelConfig(block_n=32, num_warps=4, num_stages=3, max_rows=64, waves=2.0, half_partials=True, reload_kv=False, pdl=True),  # 48.9 us
    (128, 1, 16384): KernelConfig(block_n=64, num_warps=8, num_stages=2, max_rows=64, waves=1.0, half_partials=False, reload_kv=False, pdl=False),  # 34.3 us
    (128, 2, 32768): KernelConfig(block_n=64, num_warps=8, num_stages=2, max_rows=64, waves=1.0, half_partials=False, reload_kv=False, pdl=False),  # 91.9 us
    (128, 4, 65536): KernelConfig(block_n=64, num_warps=8, num_stages=2, max_rows=64, waves=2.0, half_partials=False, reload_kv=True, pdl=False),  # 306.6 us
}


def choose_config(heads: int, bs: int, ctx: int, table: Optional[dict] = None) -> KernelConfig:
    """The table's config for (heads, bs, ctx): same head class, nearest in (log2 bs, log2 ctx)."""
    table = CONFIG_TABLE if table is None else table
    wide = heads > WIDE_HEADS
    rows = [(k, v) for k, v in table.items() if (k[0] > WIDE_HEADS) == wide] or list(table.items())
    if not rows:
        return KernelConfig()

    def dist(key):
        return (abs(math.log2(max(bs, 1)) - math.log2(key[1])) + abs(math.log2(max(ctx, 1)) - math.log2(key[2])),
                key)

    return min(rows, key=lambda kv: dist(kv[0]))[1]
