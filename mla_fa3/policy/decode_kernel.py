"""Per-shape choice of the absorbed-MLA decode kernel: FA3, FlashMLA or split-KV, from the recorded H200 sweeps.

All three kernels compute the same absorbed decode step (``absorb.py``): per request ``b``, ``H`` query
heads of a 576-wide latent query (``q_lat`` [H, r=512] | ``q_rope`` [H, 64]) over ``L_b`` cached
latent rows (``c_kv`` | ``k_rope``), output [H, 512]. Per layer and step, with ``bs`` requests,

    bytes  = Σ_b L_b · 576 · 2          (bf16 latent cache, read once)
    FLOPs  = 2 · H · Σ_b L_b · (576 + 512)
    skew   = mean_b L_b / max_b L_b      (1 = equal lengths; the sweep's "skewed" batches: ~0.34-0.40)

Small ``H`` is memory bound, ``H = 128`` compute bound on the H200. The full sweep
(``docs/perf/decode_2026-12-02_run1.csv``; page 64, heads 16-128, bs 1-128, context 1k-128k, equal
and skewed lengths) shows: FlashMLA up to 3x faster on SKEWED batches (FA3 splits the KV by the
longest request and balances badly when lengths differ; ~2x at 64-128 heads, 1.1-1.3x at 16-32),
FA3 up to 1.7x faster for a single request at 4k-64k with <= 64 heads, FlashMLA 1.1-1.3x faster at
1k context, ~1.0-1.2x either way elsewhere. The split-KV sweep
(``docs/perf/2026-12-03/decode_small_batch.csv``; heads 16 / 128, bs 1-8, context 16k-128k, equal
lengths) shows our Triton split-KV kernel 3-25 % faster than the faster of FA3 / FlashMLA at 16 heads,
bs 1-2, 16k-32k, within 1 % at 16 heads bs 1 64k, and slower everywhere else (up to 3.7x at 128 heads).
Those are kernels alone. The same 32 shapes as WHOLE backend steps per forced kernel
(``docs/perf/2026-12-03/run5/decode_whole_step.csv``, ``bench decode --whole-step``) differ where the kernels'
surroundings do: FlashMLA's step adds the q concatenation, and split-KV's schedule is planned per step (on the
device inside the graph since 2026-12-03; on the host before, which made it lose everywhere). As whole
steps split-KV wins at 16 heads, bs 1 at 16k-64k (1.03-1.09x) and bs 2 at 16k (1.06x), FA3 elsewhere at bs <= 2,
FlashMLA or FA3 at bs 4-8 within a few %, split-KV nowhere at 128 heads (1.0-3.3x slower). The table holds those
whole-step rows at these shapes (the backend step then stays within 0.96-1.05x of the plain unfused step).
FlashMLA needs page size 64.

The choice (host arithmetic on host numbers; no tensors, no sync):
- FA3 when ``page_size != 64``;
- else find the nearest measured shape in (log2 H, log2 bs, log2 L_max, log2 skew) with the L1
  distance ``HEADS_WEIGHT·|Δlog2 H| + |Δlog2 bs| + |Δlog2 L| + SKEW_WEIGHT·|Δlog2 skew|`` (heads move
  the bound; equal vs skewed, ~1.4 log2 units of skew, outweighs one grid step of shape). A query skew
  below the most skewed measurement counts as that measurement (FA3's imbalance only grows with skew).
  Shapes within ``TIE_DISTANCE`` of the nearest are equally near: their FA3/FlashMLA gains are
  averaged geometrically (a query midway between two grid points follows both).
- FlashMLA if that gain >= ``MIN_GAIN`` (measured at least 2 % faster), else FA3 (the default kernel:
  no scheduler-metadata step). Farther than ``MAX_DISTANCE`` from every shape: FA3.
- Split-KV (``ops.splitkv_mla_with_kvcache``, our Triton kernel) replaces that pick only when every one
  of the nearest shapes has a measured ``splitkv_ms`` and its geometric-mean gain over the faster of
  FA3 / FlashMLA is >= ``MIN_GAIN``: one nearest shape without a split-KV measurement (``None``) rules it
  out, and the reason says so (split-KV is picked on evidence only; a missing time is never a gain).

Offline check on the recorded sweeps (``evaluate_on_csv``; slowdown = picked kernel time / fastest
measured kernel time, page-64 rows). 2026-12-06/h200/decode_whole_step (the table's small-batch rows): 32/32
within 5 % (worst 1.016x, mean 1.0013x), split-KV picked at 16 heads, bs 1-4 (16k-128k) and bs 8 (all but 64k);
leave-one-out over its own 32 rows: 31/32, worst 1.076x. (run4/final/decode_whole_step, the table before:
32/32, worst 1.011x; scored by this table 31/32, worst 1.054x.) The same table on an H100's two whole-step
CSVs (docs/perf/2026-12-06/h100): 32/32 within 5 %, worst 1.048x.
decode_2026-12-02_run1 (kernels alone): 171/174 scored rows within 5 %, worst 1.159x — the misses are shapes the
whole-step sweep re-measured, where the table follows the whole step by design; the 6 rows where split-KV is picked
have no split-KV time there (not scored); leave-one-out over its 180 rows: 172/180 within 5 %, 177/180 within
15 %, worst 1.215x. The skew-blind table that sweep ran with: 106/180, worst 2.10x. With the kernel-alone
small-batch rows instead (``decode_small_batch``, the table of 2026-12-03): split-KV picked at 16 heads bs 1
16k and 32k, bs 2 16k, 32/32 of those kernel times within 5 %.

The table (``Measured``, ``MEASURED``) lives in ``policy/decode_table.py`` and is re-exported here, as is
the CSV reader (``policy/decode_csv.py``). Regenerate it from decode-benchmark CSVs
(``mla-fa3 bench decode --out DIR``; repeat ``--from-csv`` to merge sweeps, oldest first)::

    python -m mla_fa3.policy.decode_kernel --from-csv DIR/decode.csv      # prints the MEASURED literal
    python -m mla_fa3.policy.decode_kernel --evaluate DIR/decode.csv      # the summary above for that CSV

and paste the literal over ``MEASURED`` in ``policy/decode_table.py``, or load it at run time with
``table_from_csvs(paths)`` and pass ``table=`` to the functions.
"""

from __future__ import annotations

import argparse
import csv
import math
import numbers
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mla_fa3.checks import check_int, is_real
from mla_fa3.policy.decode_csv import (format_table, row_measurement, shape_key, table_from_csv, table_from_csvs,
                                       table_from_rows)
from mla_fa3.policy.decode_table import MEASURED, Measured
from mla_fa3.policy.paths import FLASHMLA_PAGE_SIZE, DecodeKernel

__all__ = ["KernelChoice", "explain_decode_kernel", "choose_decode_kernels", "splitkv_measured", "splitkv_possible",
           "evaluate_on_csv", "Evaluation", "RuleStats", "main", "FA3_STEP_SCHEDULE_MAX_BATCH", "fa3_num_splits",
           # re-exported: the table (decode_table) and its CSV reader / literal printer (decode_csv)
           "Measured", "MEASURED", "table_from_rows", "table_from_csv", "table_from_csvs", "format_table"]

MIN_GAIN = 1.02  # FlashMLA must be measured at least 2 % faster to be worth its scheduling step
HEADS_WEIGHT = 2.0  # heads move the memory/compute bound: a heads mismatch counts double
SKEW_WEIGHT = 2.0  # per log2 unit of mean/max length: equal vs skewed outweighs one grid step of shape
MAX_DISTANCE = 3.0  # farther than this (log2 units) from every measured shape: no evidence -> FA3
TIE_DISTANCE = 0.05  # shapes this close to the nearest distance are equally near (gains averaged)
MEAN_SLACK = 1e-4  # relative slack for mean_seqlen_k > max_seqlen_k (a float32 mean of equal lengths)
# FA3 decode steps of at most this many requests plan FA3's tile schedule once per step (ops.get_fa3_schedule)
# instead of FA3's scheduler kernel in every layer: measured 0.7-3.9 us faster per layer at bs 1-8, +2.7 / +3.4 us
# at bs 16, 16k but -3.4 / -9.4 us at bs 16, 64k, and 21-66 us SLOWER per layer at bs 64 (H200, page 64, heads
# 16 / 128; python -m mla_fa3.bench.fa3_schedule, docs/perf/2026-12-04/run4/final/fa3_schedule.md)
FA3_STEP_SCHEDULE_MAX_BATCH = 8
# ... and ask FA3 for at most this many KV splits at >= FA3_FEW_SPLITS_HEADS heads and <= FA3_FEW_SPLITS_BATCH
# requests: its heuristic fills the SMs (~60 splits at 128 heads, bs 1), but every split writes an [H, 512] fp32
# partial that its combine reads back (256 KiB per split at 128 heads). 48 measured 2.1-4.6 us per layer faster at
# 128 heads, bs 1, 16k-64k (2.1 us slower at 128k), within -1.2 / +0.2 us at bs 2; never better at 16 heads or at
# bs >= 4 (same file, and run4/fa3_scheduler_metadata.txt)
FA3_FEW_SPLITS = 48
FA3_FEW_SPLITS_HEADS = 128
FA3_FEW_SPLITS_BATCH = 2


def fa3_num_splits(num_heads: int, batch_size: int) -> int:
    """``num_splits`` the backend asks of FA3 (with its step schedule): 0 = FA3's heuristic, except many heads at
    one or two requests (``FA3_FEW_SPLITS``)."""
    few = num_heads >= FA3_FEW_SPLITS_HEADS and 0 < batch_size <= FA3_FEW_SPLITS_BATCH
    return FA3_FEW_SPLITS if few else 0


@dataclass(frozen=True)
class KernelChoice:
    """The chosen decode kernel and why (for ``MLABackend.explain()``)."""

    kernel: DecodeKernel
    reason: str


def _query_skew(max_seqlen_k: int, mean_seqlen_k) -> float:
    """mean / max of the batch's KV lengths (1.0 when the mean is unknown), validated."""
    if mean_seqlen_k is None:
        return 1.0
    if isinstance(mean_seqlen_k, bool) or not isinstance(mean_seqlen_k, numbers.Real):
        raise TypeError(f"mean_seqlen_k must be a number or None, got {type(mean_seqlen_k).__name__}")
    if not (math.isfinite(mean_seqlen_k) and 0 <= mean_seqlen_k <= max_seqlen_k * (1 + MEAN_SLACK)):
        raise ValueError(f"mean_seqlen_k must be in [0, max_seqlen_k={max_seqlen_k}], got {mean_seqlen_k!r}")
    return min(1.0, mean_seqlen_k / max_seqlen_k)


_COORDS: dict[int, tuple[tuple[Measured, ...], np.ndarray, float]] = {}


def _log_coords(table: tuple[Measured, ...]) -> tuple[np.ndarray, float]:
    """(weighted log2 coordinates of every shape, [4, N] float64: heads, batch, context, skew; least
    skew) of ``table``, cached by identity."""
    hit = _COORDS.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1], hit[2]
    coords = np.array([(HEADS_WEIGHT * math.log2(m.num_heads), math.log2(m.batch_size), math.log2(m.context),
                        SKEW_WEIGHT * math.log2(m.skew)) for m in table], dtype=np.float64).reshape(-1, 4).T.copy()
    if len(_COORDS) >= 16:
        _COORDS.clear()
    _COORDS[id(table)] = (table, coords, min(m.skew for m in table))
    return coords, _COORDS[id(table)][2]


def explain_decode_kernel(
    num_heads: int,
    batch_size: int,
    max_seqlen_k: int,
    page_size: int,
    *,
    mean_seqlen_k: float | None = None,
    table: Sequence[Measured] | None = None,
    min_gain: float = MIN_GAIN,
    allow_splitkv: bool = True,
) -> KernelChoice:
    """Choose FA3, FlashMLA or split-KV for one decode step's shape on a bf16 latent pool and say why
    (an e4m3 pool: ``policy.fp8_decode``).

    ``max_seqlen_k`` / ``mean_seqlen_k``: the longest and the mean KV length of the batch (host
    numbers, from ``seq_lens_cpu``); ``mean_seqlen_k=None`` treats the lengths as equal. ``table``
    defaults to ``MEASURED``. ``allow_splitkv=False``: the split-KV kernel cannot run here (no Triton):
    choose between FA3 and FlashMLA only. Pure host arithmetic: no tensors, no sync.
    """
    for name, value in (
        ("num_heads", num_heads),
        ("batch_size", batch_size),
        ("max_seqlen_k", max_seqlen_k),
        ("page_size", page_size),
    ):
        check_int(value, name)
    skew = _query_skew(max_seqlen_k, mean_seqlen_k)
    if not (is_real(min_gain) and min_gain > 0):
        raise ValueError(f"min_gain must be a positive number, got {min_gain!r}")
    if page_size != FLASHMLA_PAGE_SIZE:
        return KernelChoice(DecodeKernel.FA3,
                            f"page_size {page_size} != {FLASHMLA_PAGE_SIZE} (FlashMLA's block size) -> FA3")
    table = MEASURED if table is None else tuple(table)
    if not table:
        return KernelChoice(DecodeKernel.FA3, "no measured shapes -> FA3 (default)")
    coords, least_skew = _log_coords(table)
    dists = _distances(coords, num_heads, [(batch_size, max_seqlen_k, max(skew, least_skew))])[0]
    kernel, best, near_idx, gain, skv_gain = _decide(table, dists, min_gain, allow_splitkv)
    near = [table[i] for i in near_idx]
    if best > MAX_DISTANCE:
        return KernelChoice(DecodeKernel.FA3, f"no measured shape within {MAX_DISTANCE:g} log2 units (nearest: "
                                         f"{near[0].shape()}) -> FA3 (default)")
    where = "; ".join(f"{m.shape()}: FA3 {m.fa3_ms:.4g} ms, FlashMLA {m.flashmla_ms:.4g} ms" for m in near[:4])
    where += f"; and {len(near) - 4} more" if len(near) > 4 else ""
    sources = sorted({m.source for m in near})
    where = f"nearest measured shape{'s' if len(near) > 1 else ''} ({', '.join(sources)}) {where}"
    what = "gain" if len(near) == 1 else "geometric-mean gain"
    unmeasured = sum(m.splitkv_gain is None for m in near)
    if allow_splitkv and 0 < unmeasured < len(near):  # a tie with an unmeasured shape: no evidence there
        where += f"; split-KV not measured at {unmeasured} of these {len(near)} shapes (not picked)"
    if allow_splitkv and not unmeasured:
        where += "; split-KV " + ", ".join(f"{m.splitkv_ms:.4g} ms" for m in near[:4])
    if kernel is DecodeKernel.SPLITKV:
        return KernelChoice(kernel, f"{where} -> split-KV {what} {skv_gain:.3f}x over the faster of FA3 / FlashMLA")
    if kernel is DecodeKernel.FLASHMLA:
        return KernelChoice(kernel, f"{where} -> FlashMLA {what} {gain:.3f}x")
    if gain >= 1.0:
        return KernelChoice(kernel, f"{where} -> FlashMLA {what} {gain:.3f}x < {min_gain} -> FA3")
    return KernelChoice(kernel, f"{where} -> FA3 {1 / gain:.3f}x faster")


def choose_decode_kernels(num_heads: int, points: Sequence[tuple[int, int, float | None]], *,
                          allow_splitkv: bool = True, min_gain: float = MIN_GAIN) -> list[DecodeKernel]:
    """The kernel :func:`explain_decode_kernel` picks (page 64, bf16 latent, ``MEASURED``) at each
    ``(batch_size, max_seqlen_k, mean_seqlen_k)`` of ``points``: the same decision, its distances for all
    points in one NumPy pass and no reason text (the decode-kernel cache checks a bucket's corners with it)."""
    table = MEASURED
    if not table:
        return [DecodeKernel.FA3] * len(points)
    coords, least_skew = _log_coords(table)
    queries = []
    for bs, mx, mean in points:
        check_int(bs, "batch_size")
        check_int(mx, "max_seqlen_k")
        queries.append((bs, mx, max(_query_skew(mx, mean), least_skew)))
    dists = _distances(coords, num_heads, queries)
    best = dists.min(axis=1)
    first = dists.argmin(axis=1).tolist()
    ties = (dists <= best[:, None] + TIE_DISTANCE).sum(axis=1).tolist()
    out = []
    for i, (d, b) in enumerate(zip(dists, best.tolist())):  # the equally-near shapes: mostly one
        near = [first[i]] if ties[i] == 1 else np.flatnonzero(d <= b + TIE_DISTANCE).tolist()
        out.append(_rule(table, b, near, min_gain, allow_splitkv)[0])
    return out


def _distances(coords: np.ndarray, num_heads: int, queries: Sequence[tuple[int, int, float]]) -> np.ndarray:
    """[Q, N] weighted L1 distances in log2 units from each (batch, max length, skew) query to every shape:
    per element the float64 sums of one row's terms, heads + batch + context + skew, in that order."""
    q = np.array([(HEADS_WEIGHT * math.log2(num_heads), math.log2(b), math.log2(m), SKEW_WEIGHT * math.log2(sk))
                  for b, m, sk in queries], dtype=np.float64)
    h, b, c, s = coords
    return (np.abs(h - q[:, 0:1]) + np.abs(b - q[:, 1:2])) + np.abs(c - q[:, 2:3]) + np.abs(s - q[:, 3:4])


def _decide(table: tuple[Measured, ...], dists: np.ndarray, min_gain: float, allow_splitkv: bool
            ) -> tuple[DecodeKernel, float, list[int], float, float | None]:
    """(kernel, nearest distance, indices of the equally-near shapes, their FlashMLA gain, their split-KV
    gain or None) for one query's distances: the rule of :func:`explain_decode_kernel`."""
    best = float(dists.min())
    return _rule(table, best, np.flatnonzero(dists <= best + TIE_DISTANCE).tolist(), min_gain, allow_splitkv)


def _rule(table: tuple[Measured, ...], best: float, near: list[int], min_gain: float, allow_splitkv: bool
          ) -> tuple[DecodeKernel, float, list[int], float, float | None]:
    """The choice from the equally-near shapes ``near`` (indices into ``table``) at distance ``best``."""
    gain = math.exp(sum(math.log(table[i].flashmla_gain) for i in near) / len(near))
    if best > MAX_DISTANCE:
        return DecodeKernel.FA3, best, near, gain, None
    skv = [table[i].splitkv_gain for i in near]
    skv_gain = None
    if allow_splitkv and all(g is not None for g in skv):
        skv_gain = math.exp(sum(math.log(g) for g in skv) / len(skv))
        if skv_gain >= min_gain:
            return DecodeKernel.SPLITKV, best, near, gain, skv_gain
    if gain >= min_gain:
        return DecodeKernel.FLASHMLA, best, near, gain, skv_gain
    return DecodeKernel.FA3, best, near, gain, skv_gain


def splitkv_measured(table: Sequence[Measured] | None = None) -> bool:
    """Whether ``table`` (default ``MEASURED``) has any split-KV time: without one the choice never picks it
    (:func:`splitkv_possible` says whether it can at a given head count)."""
    return any(m.splitkv_ms is not None for m in (MEASURED if table is None else table))


def splitkv_possible(num_heads: int, table: Sequence[Measured] | None = None, *, min_gain: float = MIN_GAIN) -> bool:
    """Whether the choice can pick split-KV for some step at ``num_heads`` (e.g. worth capturing its graphs).

    Never False where :func:`explain_decode_kernel` could pick it: a pick needs a nearest shape whose
    split-KV gain is >= ``min_gain`` (a geometric mean >= min_gain has a member >= min_gain) within
    ``MAX_DISTANCE + TIE_DISTANCE``, which its heads term alone, ``HEADS_WEIGHT·|Δlog2 H|``, must not exceed.
    """
    check_int(num_heads, "num_heads")
    reach = (MAX_DISTANCE + TIE_DISTANCE) / HEADS_WEIGHT
    return any(m.splitkv_gain is not None and m.splitkv_gain >= min_gain
               and abs(math.log2(m.num_heads) - math.log2(num_heads)) <= reach
               for m in (MEASURED if table is None else table))


# ---------------------------------------------------------------------------------------------------
# Offline evaluation on a recorded sweep


@dataclass(frozen=True)
class RuleStats:
    """How one kernel-choice rule did on a sweep's page-64 rows (slowdown = picked / fastest kernel time)."""

    rows: int  # rows scored: page-64 rows with both FA3 and FlashMLA times, less the unscored ones
    flashmla_picks: int  # scored rows where the rule picked FlashMLA
    within_5pct: int  # rows with slowdown <= 1.05
    within_15pct: int  # rows with slowdown <= 1.15
    worst_slowdown: float  # max slowdown (1.0 = always the fastest measured kernel; nan: no row scored)
    worst_shape: str  # the row where the worst slowdown happened
    mean_slowdown: float  # arithmetic mean of the slowdowns
    splitkv_picks: int = 0  # scored rows where the rule picked split-KV
    unscored: int = 0  # rows where the rule picked split-KV but the CSV has no split-KV time: not scored
    splitkv_at: tuple[str, ...] = ()  # the shapes of every split-KV pick (scored or not)

    def line(self) -> str:
        out = (f"within 5 %: {self.within_5pct}/{self.rows}, within 15 %: {self.within_15pct}/{self.rows}, "
               f"worst {self.worst_slowdown:.3f}x ({self.worst_shape}), mean {self.mean_slowdown:.4f}x, "
               f"FlashMLA picked {self.flashmla_picks}/{self.rows}, split-KV {self.splitkv_picks}/{self.rows}")
        if self.unscored:
            out += f"; split-KV picked on {self.unscored} more rows without a split-KV time (not scored)"
        return out


@dataclass(frozen=True)
class Evaluation:
    """``evaluate_on_csv``'s summary: the rule, its leave-one-out check and the recorded picks."""

    path: str  # the sweep CSV
    fitted: RuleStats  # the rule with the given table (default MEASURED) on every page-64 row
    leave_one_out: RuleStats  # each row predicted from the CSV's own table without that row
    recorded: RuleStats | None  # the ``backend_kernel`` column: what the backend picked in the sweep

    def format(self) -> str:
        lines = [f"{self.path}: slowdown = picked kernel / fastest measured kernel, page-64 rows",
                 f"  rule (table):        {self.fitted.line()}",
                 f"  rule (leave-1-out):  {self.leave_one_out.line()}"]
        if self.recorded is not None:
            lines.append(f"  recorded backend:    {self.recorded.line()}")
        if self.fitted.splitkv_at:
            lines.append(f"  split-KV picked (table) at: {'; '.join(self.fitted.splitkv_at)}")
        return "\n".join(lines)


def _time_ms(m: Measured, kernel: DecodeKernel) -> float | None:
    """The measured time of ``kernel`` at ``m`` (None: split-KV, not measured there)."""
    if kernel is DecodeKernel.SPLITKV:
        return m.splitkv_ms
    return m.flashmla_ms if kernel is DecodeKernel.FLASHMLA else m.fa3_ms


def _stats(picks: Sequence[tuple[Measured, DecodeKernel]]) -> RuleStats:
    """RuleStats of (row, picked kernel) pairs; slowdown against the fastest kernel measured at the row.

    A split-KV pick at a row without a split-KV time has no time to score: it is counted (``unscored``),
    never scored as another kernel's time."""
    scored = [(m, k, t) for m, k in picks if (t := _time_ms(m, k)) is not None]
    slow = [t / min(x for x in (m.fa3_ms, m.flashmla_ms, m.splitkv_ms) if x is not None) for m, _, t in scored]
    skv_at = tuple(m.shape() for m, k in picks if k is DecodeKernel.SPLITKV)
    if not slow:
        return RuleStats(0, 0, 0, 0, math.nan, "-", math.nan, 0, len(picks), skv_at)
    worst = max(range(len(slow)), key=slow.__getitem__)
    return RuleStats(len(slow), sum(k is DecodeKernel.FLASHMLA for _, k, _ in scored), sum(s <= 1.05 for s in slow),
                     sum(s <= 1.15 for s in slow), slow[worst], scored[worst][0].shape(), sum(slow) / len(slow),
                     sum(k is DecodeKernel.SPLITKV for _, k, _ in scored), len(picks) - len(scored), skv_at)


def evaluate_on_csv(path: str, *, table: Sequence[Measured] | None = None, min_gain: float = MIN_GAIN) -> Evaluation:
    """Replay the choice on every page-64 row of a decode-benchmark CSV against its measured times.

    Each row is queried as the backend would: (heads, batch, context = longest length, mean length =
    ``kv_tokens / batch``). ``fitted`` uses ``table`` (default ``MEASURED``); ``leave_one_out`` uses the
    table regenerated from this CSV minus the row's own shape (how the rule does between grid points);
    ``recorded`` scores the ``backend_kernel`` column. Host arithmetic only.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    data = [(m, row) for i, row in enumerate(rows) if (m := row_measurement(i, row, f"bench CSV {path}"))]
    if not data:
        raise ValueError(f"path {path!r} has no page-64 rows with both fa3_ms and flashmla_ms")
    full = table_from_rows(row for _, row in data)

    def pick(m: Measured, row: dict, tab) -> DecodeKernel:
        mean = int(row["kv_tokens"]) / m.batch_size if row.get("kv_tokens") else m.context
        return explain_decode_kernel(m.num_heads, m.batch_size, m.context, FLASHMLA_PAGE_SIZE,
                                     mean_seqlen_k=min(mean, m.context), table=tab, min_gain=min_gain).kernel

    fitted = _stats([(m, pick(m, row, table)) for m, row in data])
    loo = _stats([(m, pick(m, row, [t for t in full if shape_key(t) != shape_key(m)])) for m, row in data])
    kernels = {k.value: k for k in DecodeKernel}
    recorded = [(m, kernels[row["backend_kernel"]]) for m, row in data if row.get("backend_kernel") in kernels]
    return Evaluation(path, fitted, loo, _stats(recorded) if recorded else None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mla_fa3.policy.decode_kernel",
        description="Print the measured decode-kernel table, regenerate it from bench CSVs (the MEASURED literal to "
                    "paste into mla_fa3/policy/decode_table.py), or evaluate the choice on bench CSVs.",
    )
    p.add_argument("--from-csv", metavar="CSV", action="append",
                   help="decode-benchmark CSV (mla-fa3 bench decode --out DIR); prints its table as the MEASURED "
                        "literal to paste into mla_fa3/policy/decode_table.py. Repeat to merge sweeps: a shape "
                        "measured by a later CSV replaces the earlier CSVs' row of that shape")
    p.add_argument("--evaluate", metavar="CSV", action="append",
                   help="score the choice (table: --from-csv's, else the built-in) on this CSV's page-64 rows "
                        "(repeatable)")
    args = p.parse_args(argv)
    table = table_from_csvs(args.from_csv) if args.from_csv else MEASURED
    if not table:
        print(f"{', '.join(args.from_csv)}: no page-64 rows with both fa3_ms and flashmla_ms", file=sys.stderr)
        return 1
    if args.evaluate:
        print("\n".join(evaluate_on_csv(path, table=table).format() for path in args.evaluate))
    else:
        print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
