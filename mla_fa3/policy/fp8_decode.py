"""Per-shape choice of the decode kernel on an FP8 (e4m3) latent pool: FlashMLA FP8 or split-KV.

Two kernels read an e4m3 latent cache in place (FA3 cannot: ``HeaddimV > 256 requires fp16 and bf16``):

- FlashMLA's FP8 decode (``ops.flash_mla_with_kvcache``): e4m3 q and cache, so q is quantized per step
  (``ops.quantize_query_e4m3``, two launches) and the softmax probabilities meet the cache in e4m3;
  page 64 only;
- our split-KV Triton kernel (``ops.splitkv_mla_with_kvcache`` with a bf16 q and ``descale_k``): the cache
  tile is converted in registers, q is not rounded to e4m3 (it enters fp16 dots after an exact power-of-two
  rescale; the more accurate read: see
  docs/PERFORMANCE.md, "FP8 latent cache"); any page size.

Measured on the H200 (docs/PERFORMANCE_HISTORY.md, "The FP8 pool read by split-KV"): split-KV is the more accurate
read (top-1 gap to the bf16 cache +0.83 / +0.86 points against FlashMLA FP8's +1.51 / +1.33). Kernel alone
at 16 heads it is the faster one at bs 1 up to 32k and the slower one from 64k or from bs 2 (16.9 µs against
FlashMLA FP8's 22.1 at bs 1, 16k; 34.7 against 32.6 at bs 1, 64k): its e4m3 tile is converted per dot, P·V's
operand gathered byte by byte (docs/PERFORMANCE_HISTORY.md, "The e4m3 split-KV kernel"). ``auto`` picks by speed,
leaning to the more accurate read: split-KV unless FlashMLA FP8 is measured at least 2 % faster
(``FP8_MIN_GAIN``, the bf16 choice's margin turned round); ``decode_kernel='splitkv'`` by accuracy alone.

The choice (host arithmetic on host numbers, like ``policy.decode_kernel``):

- page size != 64: split-KV, the only kernel that reads that pool (the backend refuses such a pool at
  construction when the split-KV kernel cannot run);
- page 64: the nearest shapes of :data:`MEASURED_FP8` (the same weighted log2 distance, ties and
  ``MAX_DISTANCE`` as the bf16 choice); split-KV when its geometric-mean gain over FlashMLA FP8 there is
  >= ``FP8_MIN_GAIN`` (= 1 / 1.02: as fast within 2 %), else FlashMLA FP8; FlashMLA FP8 when no shape is near or
  split-KV cannot run here.

:data:`MEASURED_FP8` holds whole backend decode steps per layer (``mla-fa3 bench fp8 --out DIR``: the
FP8 pool with FlashMLA FP8, q quantization included, against the FP8 pool with split-KV), not kernels
alone: what the two paths cost differs outside the kernel. Regenerate it with
``python -m mla_fa3.policy.fp8_decode --from-csv OLD/fp8.csv --from-csv NEW/fp8.csv`` (oldest first: a shape that a
later CSV measured replaces the earlier row whole, so both times of a row come from one run) and paste the
literal below.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from typing import Sequence

from mla_fa3.checks import check_int, is_real
from mla_fa3.policy.decode_kernel import (HEADS_WEIGHT, MAX_DISTANCE, MIN_GAIN, TIE_DISTANCE, KernelChoice,
                                          _distances, _log_coords, _query_skew)
from mla_fa3.policy.decode_csv import shape_key
from mla_fa3.policy.paths import FLASHMLA_PAGE_SIZE, DecodeKernel

__all__ = ["MeasuredFP8", "MEASURED_FP8", "FP8_MIN_GAIN", "explain_fp8_decode_kernel", "choose_fp8_decode_kernels",
           "fp8_splitkv_possible", "table_from_fp8_csv", "table_from_fp8_csvs", "format_fp8_table", "main"]


# split-KV's read is the more accurate one (q never rounded to e4m3): it is picked when as fast within 2 %, i.e. unless
# FlashMLA FP8 is measured at least 2 % faster — the bf16 choice's margin (``MIN_GAIN``) turned round
FP8_MIN_GAIN = 1.0 / MIN_GAIN


@dataclass(frozen=True)
class MeasuredFP8:
    """One measured shape: whole decode step per layer on an FP8 pool (page 64, one query token each)."""

    num_heads: int
    batch_size: int
    context: int  # every request's KV length (equal lengths)
    flashmla_ms: float  # FlashMLA FP8 path: q quantized per step, e4m3 q · e4m3 cache
    splitkv_ms: float  # split-KV path: bf16 q, the e4m3 cache dequantized in registers
    source: str = "H200"
    skew: float = 1.0  # mean / max KV length (the distance's fourth coordinate)

    def __post_init__(self):
        for name in ("num_heads", "batch_size", "context"):
            check_int(getattr(self, name), name)
        for name in ("flashmla_ms", "splitkv_ms"):
            if not (is_real(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not (is_real(self.skew) and 0 < self.skew <= 1):
            raise ValueError(f"skew must be a number in (0, 1], got {self.skew!r}")

    @property
    def splitkv_gain(self) -> float:
        """FlashMLA FP8 time / split-KV time: > 1 when split-KV is faster."""
        return self.flashmla_ms / self.splitkv_ms

    def shape(self) -> str:
        return f"heads {self.num_heads}, bs {self.batch_size}, ctx {self.context}"


# H200: ``mla-fa3 bench fp8 --heads 16,128 --batch 1,2,4,16,64 --context 16k,64k --out DIR`` (whole backend step per
# layer, CUDA-graph replays of >= 16 layers, page 64; split-KV's schedule re-planned on the device in the graph; the
# absorption and output projection by the per-head matmul; FlashMLA FP8's query in two launches). Generated by
# ``python -m mla_fa3.policy.fp8_decode --from-csv docs/perf/2026-12-04/fp8.csv --from-csv
# docs/perf/2026-12-06/run4/h200/fp8/fp8.csv`` (2026-12-06: every shape of the first, so every row is from it).
# Split-KV wins at 16 heads, bs 1, 16k (1.16x), bs 1, 64k (1.08x) and bs 2, 16k (1.17x), and is slower everywhere
# else (0.19-0.94x FlashMLA FP8's speed).
MEASURED_FP8: tuple[MeasuredFP8, ...] = (
    MeasuredFP8(16, 1, 16384, flashmla_ms=0.0387964, splitkv_ms=0.0334484, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 1, 16384, flashmla_ms=0.0535486, splitkv_ms=0.0713146, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 1, 65536, flashmla_ms=0.0512884, splitkv_ms=0.0473467, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 1, 65536, flashmla_ms=0.0697568, splitkv_ms=0.154024, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 2, 16384, flashmla_ms=0.0395769, splitkv_ms=0.0338957, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 2, 16384, flashmla_ms=0.0574055, splitkv_ms=0.101498, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 2, 65536, flashmla_ms=0.0599549, splitkv_ms=0.0693174, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 2, 65536, flashmla_ms=0.0932028, splitkv_ms=0.266495, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 4, 16384, flashmla_ms=0.0441976, splitkv_ms=0.0470941, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 4, 16384, flashmla_ms=0.0685207, splitkv_ms=0.158176, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 4, 65536, flashmla_ms=0.0818591, splitkv_ms=0.11315, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 4, 65536, flashmla_ms=0.140992, splitkv_ms=0.502363, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 16, 16384, flashmla_ms=0.0817628, splitkv_ms=0.118209, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 16, 16384, flashmla_ms=0.145398, splitkv_ms=0.767753, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 16, 65536, flashmla_ms=0.228631, splitkv_ms=0.531759, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 16, 65536, flashmla_ms=0.44666, splitkv_ms=2.42543, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 64, 16384, flashmla_ms=0.235296, splitkv_ms=0.538907, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 64, 16384, flashmla_ms=0.466572, splitkv_ms=1.9207, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(16, 64, 65536, flashmla_ms=0.857746, splitkv_ms=1.8669, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
    MeasuredFP8(128, 64, 65536, flashmla_ms=1.66168, splitkv_ms=7.23944, source='bench CSV docs/perf/2026-12-06/run4/h200/fp8/fp8.csv'),
)


def explain_fp8_decode_kernel(num_heads: int, batch_size: int, max_seqlen_k: int, page_size: int, *,
                              mean_seqlen_k: float | None = None, table: Sequence[MeasuredFP8] | None = None,
                              min_gain: float = FP8_MIN_GAIN, allow_splitkv: bool = True) -> KernelChoice:
    """FlashMLA FP8 or split-KV for one decode step on an e4m3 latent pool, and why (module docstring).

    ``allow_splitkv=False``: the split-KV kernel cannot run here — then only page 64 is readable."""
    for name, value in (("num_heads", num_heads), ("batch_size", batch_size), ("max_seqlen_k", max_seqlen_k),
                        ("page_size", page_size)):
        check_int(value, name)
    skew = _query_skew(max_seqlen_k, mean_seqlen_k)
    if not (is_real(min_gain) and min_gain > 0):
        raise ValueError(f"min_gain must be a positive number, got {min_gain!r}")
    if page_size != FLASHMLA_PAGE_SIZE:
        if not allow_splitkv:
            raise ValueError(f"page_size must be {FLASHMLA_PAGE_SIZE} for an FP8 latent cache where the split-KV "
                             f"kernel cannot run (FlashMLA's FP8 decode takes pages of {FLASHMLA_PAGE_SIZE}), got "
                             f"{page_size}")
        return KernelChoice(DecodeKernel.SPLITKV, f"FP8 latent cache, page {page_size} != {FLASHMLA_PAGE_SIZE}: "
                                                  "split-KV (bf16 q, the e4m3 cache dequantized in registers)")
    flashmla = "FP8 latent cache: FlashMLA FP8 (e4m3 q and cache)"
    if not allow_splitkv:
        return KernelChoice(DecodeKernel.FLASHMLA, f"{flashmla}; split-KV cannot run here")
    table = MEASURED_FP8 if table is None else tuple(table)
    if not table:
        return KernelChoice(DecodeKernel.FLASHMLA, f"{flashmla}; no FP8 measurement to weigh split-KV against it")
    kernel, best, near, gain = _fp8_decide(table, num_heads, [(batch_size, max_seqlen_k, skew)], min_gain)[0]
    if best > MAX_DISTANCE:
        return KernelChoice(kernel, f"{flashmla}; no measured FP8 shape within {MAX_DISTANCE:g} log2 units")
    where = "; ".join(f"{table[i].shape()}: FlashMLA FP8 {table[i].flashmla_ms:.4g} ms, split-KV "
                      f"{table[i].splitkv_ms:.4g} ms" for i in near[:4])
    what = "gain" if len(near) == 1 else "geometric-mean gain"
    if kernel is DecodeKernel.SPLITKV:
        return KernelChoice(kernel, f"FP8 latent cache, nearest measured steps ({where}) -> split-KV (bf16 q) "
                                    f"{what} {gain:.3f}x over FlashMLA FP8")
    return KernelChoice(kernel, f"{flashmla}, nearest measured steps ({where}): split-KV {what} {gain:.3f}x "
                                f"< {min_gain:.3f}")


def choose_fp8_decode_kernels(num_heads: int, points: Sequence[tuple[int, int, float | None]], *,
                              allow_splitkv: bool = True, min_gain: float = FP8_MIN_GAIN) -> list[DecodeKernel]:
    """:func:`explain_fp8_decode_kernel`'s kernel at page 64 for each ``(batch, max length, mean length)``, in one
    NumPy pass (the decode-kernel cache checks a bucket's corners with it)."""
    if not allow_splitkv or not MEASURED_FP8:
        return [DecodeKernel.FLASHMLA] * len(points)
    queries = []
    for bs, mx, mean in points:
        check_int(bs, "batch_size")
        check_int(mx, "max_seqlen_k")
        queries.append((bs, mx, _query_skew(mx, mean)))
    return [k for k, _, _, _ in _fp8_decide(MEASURED_FP8, num_heads, queries, min_gain)]


def _fp8_decide(table: tuple[MeasuredFP8, ...], num_heads: int, queries, min_gain: float):
    """[(kernel, nearest distance, indices of the equally-near shapes, their split-KV gain)] per query."""
    coords, least_skew = _log_coords(table)
    dists = _distances(coords, num_heads, [(b, m, max(s, least_skew)) for b, m, s in queries])
    out = []
    for d in dists:
        best = float(d.min())
        near = [i for i in range(len(table)) if d[i] <= best + TIE_DISTANCE]
        gain = math.exp(sum(math.log(table[i].splitkv_gain) for i in near) / len(near))
        pick = DecodeKernel.SPLITKV if best <= MAX_DISTANCE and gain >= min_gain else DecodeKernel.FLASHMLA
        out.append((pick, best, near, gain))
    return out


def fp8_splitkv_possible(num_heads: int, table: Sequence[MeasuredFP8] | None = None, *,
                         min_gain: float = FP8_MIN_GAIN) -> bool:
    """Whether the page-64 choice can pick split-KV at ``num_heads`` (its graphs are then worth capturing).
    Never False where it could: see ``policy.decode_kernel.splitkv_possible``."""
    check_int(num_heads, "num_heads")
    reach = (MAX_DISTANCE + TIE_DISTANCE) / HEADS_WEIGHT
    return any(m.splitkv_gain >= min_gain and abs(math.log2(m.num_heads) - math.log2(num_heads)) <= reach
               for m in (MEASURED_FP8 if table is None else table))


def table_from_fp8_csv(path: str) -> tuple[MeasuredFP8, ...]:
    """The rows of a ``mla-fa3 bench fp8 --out DIR`` CSV that carry both FP8 paths' times (µs -> ms)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = []
    for r in rows:
        if r.get("fp8_us") and r.get("fp8_splitkv_us"):
            out.append(MeasuredFP8(int(r["heads"]), int(r["batch"]), int(r["context"]), float(r["fp8_us"]) / 1e3,
                                   float(r["fp8_splitkv_us"]) / 1e3, source=f"bench CSV {path}"))
    if not out:
        raise ValueError(f"path {path!r} has no rows with both fp8_us and fp8_splitkv_us")
    return tuple(out)


def table_from_fp8_csvs(paths: Sequence[str]) -> tuple[MeasuredFP8, ...]:
    """Several bench CSVs merged, oldest first: a shape (``decode_csv.shape_key``) that a later CSV measured replaces
    the earlier CSV's row (in its place: the order stays the first CSV's, new shapes appended)."""
    merged: dict = {}
    for path in paths:
        for m in table_from_fp8_csv(path):
            merged[shape_key(m)] = m
    return tuple(merged.values())


def format_fp8_table(table: Sequence[MeasuredFP8]) -> str:
    """The ``MEASURED_FP8`` literal to paste into this module."""
    lines = ["MEASURED_FP8: tuple[MeasuredFP8, ...] = ("]
    for m in table:
        lines.append(f"    MeasuredFP8({m.num_heads}, {m.batch_size}, {m.context}, flashmla_ms={m.flashmla_ms:.6g}, "
                     f"splitkv_ms={m.splitkv_ms:.6g}, source={m.source!r}),")
    return "\n".join(lines + [")"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.policy.fp8_decode",
                                description="Print the MEASURED_FP8 literal from a `mla-fa3 bench fp8 --out DIR` CSV")
    p.add_argument("--from-csv", metavar="CSV", required=True, action="append",
                   help="a bench CSV; repeat it, oldest first: a later CSV's shape replaces an earlier one's row")
    print(format_fp8_table(table_from_fp8_csvs(p.parse_args(argv).from_csv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
