"""Per-shape choice of the absorbed-MLA decode kernel: FA3 or FlashMLA, from the recorded H200 sweep.

Both kernels compute the same absorbed decode step (``absorb.py``): per request ``b``, ``H`` query
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
1k context, ~1.0-1.2x either way elsewhere.
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

Offline check on the recorded sweep (``evaluate_on_csv``; slowdown = picked kernel time / faster
kernel time, 180 page-64 rows): the fitted table picks within 2 % everywhere (worst 1.019x); leave
each row out of the table and predict it from its neighbours: 172/180 within 5 %, 177/180 within
15 %, worst 1.215x. The skew-blind table the sweep ran with: 106/180 within 5 %, worst 2.10x.

Regenerate the table from a decode-benchmark CSV (``mla-fa3 bench decode --out DIR``)::

    python -m mla_fa3.kernel_choice --from-csv DIR/decode.csv      # prints the MEASURED literal
    python -m mla_fa3.kernel_choice --evaluate DIR/decode.csv      # the summary above for that CSV

and paste the literal over ``MEASURED`` below, or load it at run time with ``table_from_csv(path)``
and pass ``table=`` to the functions.
"""

from __future__ import annotations

import argparse
import csv
import math
import numbers
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # absorb imports this module's caller chain; resolve the enum lazily at run time
    from mla_fa3.absorb import DecodeKernel

FLASHMLA_PAGE_SIZE = 64  # FlashMLA's paged KV cache has a fixed block size of 64 tokens
MIN_GAIN = 1.02  # FlashMLA must be measured at least 2 % faster to be worth its scheduling step
HEADS_WEIGHT = 2.0  # heads move the memory/compute bound: a heads mismatch counts double
SKEW_WEIGHT = 2.0  # per log2 unit of mean/max length: equal vs skewed outweighs one grid step of shape
MAX_DISTANCE = 3.0  # farther than this (log2 units) from every measured shape: no evidence -> FA3
TIE_DISTANCE = 0.05  # shapes this close to the nearest distance are equally near (gains averaged)
MEAN_SLACK = 1e-4  # relative slack for mean_seqlen_k > max_seqlen_k (a float32 mean of equal lengths)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Measured:
    """One measured shape: per-layer decode kernel times at page 64, bf16, one query token each."""

    num_heads: int  # query heads H (one latent KV head)
    batch_size: int  # requests, one query token each
    context: int  # longest KV length in the batch (every request's for equal lengths)
    fa3_ms: float  # FA3 kernel time, ms (CUDA-graph replay)
    flashmla_ms: float  # FlashMLA kernel time, ms (CUDA-graph replay)
    source: str = "H200 anchor"  # where the numbers come from
    skew: float = 1.0  # mean / max KV length over the batch, in (0, 1]; 1 = equal lengths

    def __post_init__(self):
        for name in ("num_heads", "batch_size", "context"):
            _check_positive_int(name, getattr(self, name))
        for name in ("fa3_ms", "flashmla_ms"):
            if not (_is_real(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not (_is_real(self.skew) and 0 < self.skew <= 1):
            raise ValueError(f"skew must be a number in (0, 1], got {self.skew!r}")

    @property
    def flashmla_gain(self) -> float:
        """FA3 time / FlashMLA time: > 1 when FlashMLA is faster."""
        return self.fa3_ms / self.flashmla_ms

    def shape(self) -> str:
        return f"heads {self.num_heads}, bs {self.batch_size}, ctx {self.context}, skew {self.skew:.2f}"


@dataclass(frozen=True)
class KernelChoice:
    """The chosen decode kernel and why (for ``MLABackend.explain()``)."""

    kernel: "DecodeKernel"
    reason: str


def _decode_kernel_enum():
    from mla_fa3.absorb import DecodeKernel  # lazy: absorb/backend may import this module

    return DecodeKernel


def _query_skew(max_seqlen_k: int, mean_seqlen_k) -> float:
    """mean / max of the batch's KV lengths (1.0 when the mean is unknown), validated."""
    if mean_seqlen_k is None:
        return 1.0
    if isinstance(mean_seqlen_k, bool) or not isinstance(mean_seqlen_k, numbers.Real):
        raise TypeError(f"mean_seqlen_k must be a number or None, got {type(mean_seqlen_k).__name__}")
    if not (math.isfinite(mean_seqlen_k) and 0 <= mean_seqlen_k <= max_seqlen_k * (1 + MEAN_SLACK)):
        raise ValueError(f"mean_seqlen_k must be in [0, max_seqlen_k={max_seqlen_k}], got {mean_seqlen_k!r}")
    return min(1.0, mean_seqlen_k / max_seqlen_k)


_COORDS: dict[int, tuple[tuple[Measured, ...], list[tuple[float, float, float, float]], float]] = {}


def _log_coords(table: tuple[Measured, ...]) -> tuple[list[tuple[float, float, float, float]], float]:
    """(weighted log2 coordinates of every shape, least skew) of ``table``, cached by identity."""
    hit = _COORDS.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1], hit[2]
    coords = [(HEADS_WEIGHT * math.log2(m.num_heads), math.log2(m.batch_size), math.log2(m.context),
               SKEW_WEIGHT * math.log2(m.skew)) for m in table]
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
) -> KernelChoice:
    """Choose FA3 or FlashMLA for one decode step's shape and say why.

    ``max_seqlen_k`` / ``mean_seqlen_k``: the longest and the mean KV length of the batch (host
    numbers, from ``seq_lens_cpu``); ``mean_seqlen_k=None`` treats the lengths as equal. ``table``
    defaults to ``MEASURED``. Pure host arithmetic: no tensors, no sync.
    """
    for name, value in (
        ("num_heads", num_heads),
        ("batch_size", batch_size),
        ("max_seqlen_k", max_seqlen_k),
        ("page_size", page_size),
    ):
        _check_positive_int(name, value)
    skew = _query_skew(max_seqlen_k, mean_seqlen_k)
    if not (_is_real(min_gain) and min_gain > 0):
        raise ValueError(f"min_gain must be a positive number, got {min_gain!r}")
    kernels = _decode_kernel_enum()
    if page_size != FLASHMLA_PAGE_SIZE:
        return KernelChoice(kernels.FA3,
                            f"page_size {page_size} != {FLASHMLA_PAGE_SIZE} (FlashMLA's block size) -> FA3")
    table = MEASURED if table is None else tuple(table)
    if not table:
        return KernelChoice(kernels.FA3, "no measured shapes -> FA3 (default)")
    coords, least_skew = _log_coords(table)
    skew = max(skew, least_skew)  # more skewed than measured: counts as the most skewed measurement
    qh, qb, qc, qs = (HEADS_WEIGHT * math.log2(num_heads), math.log2(batch_size), math.log2(max_seqlen_k),
                      SKEW_WEIGHT * math.log2(skew))
    dists = [abs(h - qh) + abs(b - qb) + abs(c - qc) + abs(s - qs) for h, b, c, s in coords]
    best = min(dists)
    near = [m for m, d in zip(table, dists) if d <= best + TIE_DISTANCE]
    if best > MAX_DISTANCE:
        return KernelChoice(kernels.FA3, f"no measured shape within {MAX_DISTANCE:g} log2 units (nearest: "
                                         f"{near[0].shape()}) -> FA3 (default)")
    gain = math.exp(sum(math.log(m.flashmla_gain) for m in near) / len(near))
    where = "; ".join(f"{m.shape()}: FA3 {m.fa3_ms:.4g} ms, FlashMLA {m.flashmla_ms:.4g} ms" for m in near[:4])
    where += f"; and {len(near) - 4} more" if len(near) > 4 else ""
    sources = sorted({m.source for m in near})
    where = f"nearest measured shape{'s' if len(near) > 1 else ''} ({', '.join(sources)}) {where}"
    what = "gain" if len(near) == 1 else "geometric-mean gain"
    if gain >= min_gain:
        return KernelChoice(kernels.FLASHMLA, f"{where} -> FlashMLA {what} {gain:.3f}x")
    if gain >= 1.0:
        return KernelChoice(kernels.FA3, f"{where} -> FlashMLA {what} {gain:.3f}x < {min_gain} -> FA3")
    return KernelChoice(kernels.FA3, f"{where} -> FA3 {1 / gain:.3f}x faster")


def choose_decode_kernel(
    num_heads: int,
    batch_size: int,
    max_seqlen_k: int,
    page_size: int,
    *,
    mean_seqlen_k: float | None = None,
    table: Sequence[Measured] | None = None,
) -> "DecodeKernel":
    """The decode kernel for this shape (see ``explain_decode_kernel`` for the reason)."""
    return explain_decode_kernel(num_heads, batch_size, max_seqlen_k, page_size, mean_seqlen_k=mean_seqlen_k,
                                 table=table).kernel


# ---------------------------------------------------------------------------------------------------
# Regenerating the table from a decode-benchmark CSV


def _row_measurement(i: int, row: dict, source: str) -> Measured | None:
    """The Measured of one CSV row (page 64 with both kernel times), or None for rows that are not."""
    try:
        if int(row["page"]) != FLASHMLA_PAGE_SIZE:
            return None
        fa3, mla = row.get("fa3_ms", ""), row.get("flashmla_ms", "")
        if fa3 in ("", None) or mla in ("", None):
            return None
        h, bs, ctx = int(row["heads"]), int(row["batch"]), int(row["context"])
        fa3_ms, mla_ms = float(fa3), float(mla)
        kind = row.get("lengths", "equal")
        if kind == "equal" or bs == 1:
            skew = 1.0
        else:  # the skew of the lengths actually run: Σ L_b / (bs · L_max)
            skew = round(int(row["kv_tokens"]) / (bs * ctx), 4)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"rows[{i}] is not a decode-benchmark row ({e!r}): {row}") from None
    if not (fa3_ms > 0 and mla_ms > 0 and 0 < skew <= 1):
        return None
    return Measured(h, bs, ctx, fa3_ms=fa3_ms, flashmla_ms=mla_ms, source=source, skew=skew)


def table_from_rows(rows: Iterable[dict], *, source: str = "bench CSV") -> tuple[Measured, ...]:
    """Measured shapes from decode-benchmark rows (dicts with the CSV's columns).

    Uses rows with ``page == 64`` and both ``fa3_ms`` and ``flashmla_ms`` present, equal and skewed
    lengths (skew = ``kv_tokens / (batch · context)``, rounded to 4 decimals); a shape seen twice keeps
    the last row. Sorted by (heads, batch, context, skew).
    """
    out: dict[tuple[int, int, int, float], Measured] = {}
    for i, row in enumerate(rows):
        m = _row_measurement(i, row, source)
        if m is not None:
            out[(m.num_heads, m.batch_size, m.context, m.skew)] = m
    return tuple(out[k] for k in sorted(out))


def table_from_csv(path: str) -> tuple[Measured, ...]:
    """``table_from_rows`` over a CSV written by ``mla-fa3 bench decode --out DIR``."""
    with open(path, newline="") as f:
        return table_from_rows(csv.DictReader(f), source=f"bench CSV {path}")


def format_table(table: Sequence[Measured]) -> str:
    """Python source of a ``MEASURED`` literal for ``table`` (to paste into this module).

    Two shapes per line as (heads, batch, context, skew, fa3_ms, flashmla_ms); floats are printed
    with ``repr`` so that the literal reproduces ``table`` exactly. Needs only ``Measured`` in scope.
    """
    groups: dict[str, list[Measured]] = {}
    for m in table:
        groups.setdefault(m.source, []).append(m)
    lines = ["MEASURED: tuple[Measured, ...] = ("]
    for source, ms in groups.items():
        lines += ["    *(Measured(h, b, ctx, fa3_ms=fa3, flashmla_ms=mla, skew=skew,",
                  f"               source={source!r})",
                  "      for h, b, ctx, skew, fa3, mla in (  # heads, batch, context, skew, FA3 ms, FlashMLA ms"]
        cells = [f"({m.num_heads}, {m.batch_size}, {m.context}, {m.skew!r}, {m.fa3_ms!r}, {m.flashmla_ms!r}),"
                 for m in ms]
        lines += ["        " + " ".join(cells[i:i + 2]) for i in range(0, len(cells), 2)]
        lines.append("    )),")
    lines.append(")")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Offline evaluation on a recorded sweep


@dataclass(frozen=True)
class RuleStats:
    """How one kernel-choice rule did on a sweep's page-64 rows (slowdown = picked / faster kernel time)."""

    rows: int  # page-64 rows with both kernel times
    flashmla_picks: int  # rows where the rule picked FlashMLA
    within_5pct: int  # rows with slowdown <= 1.05
    within_15pct: int  # rows with slowdown <= 1.15
    worst_slowdown: float  # max slowdown (1.0 = always the faster kernel)
    worst_shape: str  # the row where the worst slowdown happened
    mean_slowdown: float  # arithmetic mean of the slowdowns

    def line(self) -> str:
        return (f"within 5 %: {self.within_5pct}/{self.rows}, within 15 %: {self.within_15pct}/{self.rows}, "
                f"worst {self.worst_slowdown:.3f}x ({self.worst_shape}), mean {self.mean_slowdown:.4f}x, "
                f"FlashMLA picked {self.flashmla_picks}/{self.rows}")


@dataclass(frozen=True)
class Evaluation:
    """``evaluate_on_csv``'s summary: the rule, its leave-one-out check and the recorded picks."""

    path: str  # the sweep CSV
    fitted: RuleStats  # the rule with the given table (default MEASURED) on every page-64 row
    leave_one_out: RuleStats  # each row predicted from the CSV's own table without that row
    recorded: RuleStats | None  # the ``backend_kernel`` column: what the backend picked in the sweep

    def format(self) -> str:
        lines = [f"{self.path}: slowdown = picked kernel / faster kernel, page-64 rows",
                 f"  rule (table):        {self.fitted.line()}",
                 f"  rule (leave-1-out):  {self.leave_one_out.line()}"]
        if self.recorded is not None:
            lines.append(f"  recorded backend:    {self.recorded.line()}")
        return "\n".join(lines)


def _stats(picks: Sequence[tuple[Measured, bool]]) -> RuleStats:
    """RuleStats of (row, picked FlashMLA) pairs."""
    slow = [(m.flashmla_ms if mla else m.fa3_ms) / min(m.fa3_ms, m.flashmla_ms) for m, mla in picks]
    worst = max(range(len(slow)), key=slow.__getitem__)
    return RuleStats(len(slow), sum(mla for _, mla in picks), sum(s <= 1.05 for s in slow),
                     sum(s <= 1.15 for s in slow), slow[worst], picks[worst][0].shape(), sum(slow) / len(slow))


def evaluate_on_csv(path: str, *, table: Sequence[Measured] | None = None, min_gain: float = MIN_GAIN) -> Evaluation:
    """Replay the choice on every page-64 row of a decode-benchmark CSV against its measured times.

    Each row is queried as the backend would: (heads, batch, context = longest length, mean length =
    ``kv_tokens / batch``). ``fitted`` uses ``table`` (default ``MEASURED``); ``leave_one_out`` uses the
    table regenerated from this CSV minus the row's own shape (how the rule does between grid points);
    ``recorded`` scores the ``backend_kernel`` column. Host arithmetic only.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    data = [(m, row) for i, row in enumerate(rows) if (m := _row_measurement(i, row, f"bench CSV {path}"))]
    if not data:
        raise ValueError(f"path {path!r} has no page-64 rows with both fa3_ms and flashmla_ms")
    full = table_from_rows(row for _, row in data)
    kernels = _decode_kernel_enum()

    def picks_flashmla(m: Measured, row: dict, tab) -> bool:
        mean = int(row["kv_tokens"]) / m.batch_size if row.get("kv_tokens") else m.context
        return kernels.FLASHMLA is explain_decode_kernel(m.num_heads, m.batch_size, m.context, FLASHMLA_PAGE_SIZE,
                                                         mean_seqlen_k=min(mean, m.context), table=tab,
                                                         min_gain=min_gain).kernel

    def key(m: Measured):
        return m.num_heads, m.batch_size, m.context, m.skew

    fitted = _stats([(m, picks_flashmla(m, row, table)) for m, row in data])
    loo = _stats([(m, picks_flashmla(m, row, [t for t in full if key(t) != key(m)])) for m, row in data])
    recorded = [(m, row["backend_kernel"] == "flashmla") for m, row in data
                if row.get("backend_kernel") in ("fa3", "flashmla")]
    return Evaluation(path, fitted, loo, _stats(recorded) if recorded else None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mla_fa3.kernel_choice",
        description="Print the measured FA3-vs-FlashMLA decode table, regenerate it from a bench CSV, or "
                    "evaluate the choice on a bench CSV.",
    )
    p.add_argument("--from-csv", metavar="CSV", help="decode-benchmark CSV (mla-fa3 bench decode --out DIR)")
    p.add_argument("--evaluate", metavar="CSV",
                   help="score the choice (table: --from-csv's, else the built-in) on this CSV's page-64 rows")
    args = p.parse_args(argv)
    table = table_from_csv(args.from_csv) if args.from_csv else MEASURED
    if not table:
        print(f"{args.from_csv}: no page-64 rows with both fa3_ms and flashmla_ms", file=sys.stderr)
        return 1
    if args.evaluate:
        print(evaluate_on_csv(args.evaluate, table=table).format())
    else:
        print(format_table(table))
    return 0


# ---------------------------------------------------------------------------------------------------
# The measured table (H200, sgl-kernel 0.4.5, bf16, page 64, CUDA-graph replay, per layer), from
# ``python -m mla_fa3.kernel_choice --from-csv docs/perf/decode_2026-12-02_run1.csv``

MEASURED: tuple[Measured, ...] = (
    *(Measured(h, b, ctx, fa3_ms=fa3, flashmla_ms=mla, skew=skew,
               source='bench CSV docs/perf/decode_2026-12-02_run1.csv')
      for h, b, ctx, skew, fa3, mla in (  # heads, batch, context, skew, FA3 ms, FlashMLA ms
        (16, 1, 1024, 1.0, 0.0143772, 0.0110278), (16, 1, 4096, 1.0, 0.0170358, 0.0227449),
        (16, 1, 16384, 1.0, 0.0237049, 0.0399111), (16, 1, 65536, 1.0, 0.0404053, 0.0526347),
        (16, 1, 131072, 1.0, 0.058968, 0.071408), (16, 4, 1024, 0.4041, 0.0146598, 0.0120692),
        (16, 4, 1024, 1.0, 0.0149158, 0.0124809), (16, 4, 4096, 0.4042, 0.0181333, 0.0232356),
        (16, 4, 4096, 1.0, 0.0197316, 0.0200053), (16, 4, 16384, 0.4042, 0.0257653, 0.031408),
        (16, 4, 16384, 1.0, 0.0350187, 0.034), (16, 4, 65536, 0.4042, 0.051104, 0.05632),
        (16, 4, 65536, 1.0, 0.09064, 0.08816), (16, 4, 131072, 0.4042, 0.080224, 0.08472),
        (16, 4, 131072, 1.0, 0.158608, 0.156784), (16, 16, 1024, 0.3511, 0.0160249, 0.0126151),
        (16, 16, 1024, 1.0, 0.0186649, 0.0153476), (16, 16, 4096, 0.3511, 0.0216427, 0.0203733),
        (16, 16, 4096, 1.0, 0.033728, 0.0293707), (16, 16, 16384, 0.3511, 0.044768, 0.0408),
        (16, 16, 16384, 1.0, 0.088336, 0.082448), (16, 16, 65536, 0.3511, 0.121584, 0.117056),
        (16, 16, 65536, 1.0, 0.291328, 0.295408), (16, 16, 131072, 0.3511, 0.23464, 0.218144),
        (16, 16, 131072, 1.0, 0.567856, 0.584576), (16, 64, 1024, 0.3412, 0.0225387, 0.020512),
        (16, 64, 1024, 1.0, 0.035856, 0.0314987), (16, 64, 4096, 0.3412, 0.051408, 0.039504),
        (16, 64, 4096, 1.0, 0.0896, 0.08456), (16, 64, 16384, 0.3412, 0.140128, 0.111632),
        (16, 64, 16384, 1.0, 0.294416, 0.293104), (16, 64, 65536, 0.3412, 0.501872, 0.399872),
        (16, 64, 65536, 1.0, 1.1813, 1.15101), (16, 64, 131072, 0.3412, 0.966288, 0.788096),
        (16, 64, 131072, 1.0, 2.3967, 2.2871), (16, 128, 1024, 0.3396, 0.03516, 0.030048),
        (16, 128, 1024, 1.0, 0.053968, 0.04348), (16, 128, 4096, 0.3397, 0.076448, 0.065552),
        (16, 128, 4096, 1.0, 0.155568, 0.148496), (16, 128, 16384, 0.3397, 0.238592, 0.20808),
        (16, 128, 16384, 1.0, 0.565344, 0.587072), (16, 128, 65536, 0.3397, 0.910176, 0.782864),
        (16, 128, 65536, 1.0, 2.39504, 2.29098), (16, 128, 131072, 0.3397, 1.86589, 1.56192),
        (16, 128, 131072, 1.0, 4.77635, 4.54736), (32, 1, 1024, 1.0, 0.0151165, 0.011752),
        (32, 1, 4096, 1.0, 0.0179092, 0.0234833), (32, 1, 16384, 1.0, 0.0252391, 0.0408036),
        (32, 1, 65536, 1.0, 0.0418187, 0.054848), (32, 1, 131072, 1.0, 0.061536, 0.072528),
        (32, 4, 1024, 0.4041, 0.0153252, 0.0128946), (32, 4, 1024, 1.0, 0.0157656, 0.0134833),
        (32, 4, 4096, 0.4042, 0.0183627, 0.0251093), (32, 4, 4096, 1.0, 0.0206933, 0.020416),
        (32, 4, 16384, 0.4042, 0.0267627, 0.0318773), (32, 4, 16384, 1.0, 0.0363627, 0.0347733),
        (32, 4, 65536, 0.4042, 0.05592, 0.058), (32, 4, 65536, 1.0, 0.092432, 0.089408),
        (32, 4, 131072, 0.4042, 0.090544, 0.085456), (32, 4, 131072, 1.0, 0.161008, 0.158608),
        (32, 16, 1024, 0.3511, 0.0168782, 0.0139271), (32, 16, 1024, 1.0, 0.0207342, 0.0166364),
        (32, 16, 4096, 0.3511, 0.023648, 0.0212213), (32, 16, 4096, 1.0, 0.0362827, 0.0308053),
        (32, 16, 16384, 0.3511, 0.051776, 0.042176), (32, 16, 16384, 1.0, 0.090784, 0.08392),
        (32, 16, 65536, 0.3511, 0.159232, 0.11888), (32, 16, 65536, 1.0, 0.29648, 0.296096),
        (32, 16, 131072, 0.3511, 0.335664, 0.212976), (32, 16, 131072, 1.0, 0.571472, 0.593648),
        (32, 64, 1024, 0.3412, 0.0237173, 0.0206613), (32, 64, 1024, 1.0, 0.0391787, 0.0335893),
        (32, 64, 4096, 0.3412, 0.052016, 0.040864), (32, 64, 4096, 1.0, 0.093808, 0.08584),
        (32, 64, 16384, 0.3412, 0.149296, 0.11392), (32, 64, 16384, 1.0, 0.298544, 0.30184),
        (32, 64, 65536, 0.3412, 0.558096, 0.40456), (32, 64, 65536, 1.0, 1.2189, 1.17925),
        (32, 64, 131072, 0.3412, 1.06171, 0.83584), (32, 64, 131072, 1.0, 2.42787, 2.33792),
        (32, 128, 1024, 0.3396, 0.036496, 0.030928), (32, 128, 1024, 1.0, 0.053776, 0.043776),
        (32, 128, 4096, 0.3397, 0.084656, 0.068064), (32, 128, 4096, 1.0, 0.157744, 0.148672),
        (32, 128, 16384, 0.3397, 0.30896, 0.218304), (32, 128, 16384, 1.0, 0.58536, 0.604048),
        (32, 128, 65536, 0.3397, 1.05976, 0.809744), (32, 128, 65536, 1.0, 2.44051, 2.36288),
        (32, 128, 131072, 0.3397, 2.08598, 1.64277), (32, 128, 131072, 1.0, 4.77118, 4.68342),
        (64, 1, 1024, 1.0, 0.0163657, 0.012841), (64, 1, 4096, 1.0, 0.0193355, 0.0250296),
        (64, 1, 16384, 1.0, 0.0275467, 0.0433564), (64, 1, 65536, 1.0, 0.0452747, 0.0573333),
        (64, 1, 131072, 1.0, 0.06476, 0.075848), (64, 4, 1024, 0.4041, 0.01668, 0.0142085),
        (64, 4, 1024, 1.0, 0.0173638, 0.0152489), (64, 4, 4096, 0.4042, 0.02096, 0.0262507),
        (64, 4, 4096, 1.0, 0.0248836, 0.0214382), (64, 4, 16384, 0.4042, 0.032224, 0.0340853),
        (64, 4, 16384, 1.0, 0.042768, 0.038176), (64, 4, 65536, 0.4042, 0.081488, 0.060928),
        (64, 4, 65536, 1.0, 0.098864, 0.094416), (64, 4, 131072, 0.4042, 0.140032, 0.091344),
        (64, 4, 131072, 1.0, 0.167984, 0.16744), (64, 16, 1024, 0.3511, 0.0203982, 0.0156587),
        (64, 16, 1024, 1.0, 0.0234489, 0.0202524), (64, 16, 4096, 0.3511, 0.030304, 0.0242933),
        (64, 16, 4096, 1.0, 0.0414773, 0.0351733), (64, 16, 16384, 0.3511, 0.073856, 0.046144),
        (64, 16, 16384, 1.0, 0.0964, 0.09008), (64, 16, 65536, 0.3511, 0.26152, 0.125808),
        (64, 16, 65536, 1.0, 0.301424, 0.310976), (64, 16, 131072, 0.3511, 0.481648, 0.22624),
        (64, 16, 131072, 1.0, 0.585072, 0.636256), (64, 64, 1024, 0.3412, 0.0328533, 0.0242293),
        (64, 64, 1024, 1.0, 0.0471947, 0.0402027), (64, 64, 4096, 0.3412, 0.07784, 0.047344),
        (64, 64, 4096, 1.0, 0.103536, 0.093808), (64, 64, 16384, 0.3412, 0.25808, 0.127072),
        (64, 64, 16384, 1.0, 0.308832, 0.325408), (64, 64, 65536, 0.3412, 0.905408, 0.4316),
        (64, 64, 65536, 1.0, 1.20296, 1.24427), (64, 64, 131072, 0.3412, 1.74336, 0.854112),
        (64, 64, 131072, 1.0, 2.44762, 2.45616), (64, 128, 1024, 0.3396, 0.041808, 0.034952),
        (64, 128, 1024, 1.0, 0.054384, 0.045248), (64, 128, 4096, 0.3397, 0.12536, 0.077024),
        (64, 128, 4096, 1.0, 0.158816, 0.150688), (64, 128, 16384, 0.3397, 0.49192, 0.235584),
        (64, 128, 16384, 1.0, 0.584432, 0.650848), (64, 128, 65536, 0.3397, 1.72053, 0.85128),
        (64, 128, 65536, 1.0, 2.2936, 2.48566), (64, 128, 131072, 0.3397, 3.43642, 1.70498),
        (64, 128, 131072, 1.0, 4.8097, 4.88093), (128, 1, 1024, 1.0, 0.016989, 0.0138347),
        (128, 1, 4096, 1.0, 0.0201882, 0.0195859), (128, 1, 16384, 1.0, 0.0326489, 0.0376409),
        (128, 1, 65536, 1.0, 0.059984, 0.052288), (128, 1, 131072, 1.0, 0.090056, 0.078152),
        (128, 4, 1024, 0.4041, 0.0174391, 0.0142311), (128, 4, 1024, 1.0, 0.0197012, 0.0149854),
        (128, 4, 4096, 0.4042, 0.0238062, 0.0223911), (128, 4, 4096, 1.0, 0.0287236, 0.025248),
        (128, 4, 16384, 0.4042, 0.0457973, 0.0348533), (128, 4, 16384, 1.0, 0.0526133, 0.0453813),
        (128, 4, 65536, 0.4042, 0.129296, 0.065552), (128, 4, 65536, 1.0, 0.140384, 0.122528),
        (128, 4, 131072, 0.4042, 0.23984, 0.108992), (128, 4, 131072, 1.0, 0.252544, 0.227024),
        (128, 16, 1024, 0.3511, 0.0235307, 0.0175378), (128, 16, 1024, 1.0, 0.0284, 0.0225031),
        (128, 16, 4096, 0.3511, 0.0436747, 0.029024), (128, 16, 4096, 1.0, 0.0497653, 0.0436373),
        (128, 16, 16384, 0.3511, 0.122688, 0.058448), (128, 16, 16384, 1.0, 0.133936, 0.123904),
        (128, 16, 65536, 0.3511, 0.50088, 0.167824), (128, 16, 65536, 1.0, 0.493248, 0.499808),
        (128, 16, 131072, 0.3511, 0.85568, 0.312432), (128, 16, 131072, 1.0, 1.08218, 1.00811),
        (128, 64, 1024, 0.3412, 0.038256, 0.031584), (128, 64, 1024, 1.0, 0.0413867, 0.0359573),
        (128, 64, 4096, 0.3412, 0.11568, 0.063248), (128, 64, 4096, 1.0, 0.12528, 0.11592),
        (128, 64, 16384, 0.3412, 0.47352, 0.17472), (128, 64, 16384, 1.0, 0.457088, 0.506608),
        (128, 64, 65536, 0.3412, 1.61056, 0.613456), (128, 64, 65536, 1.0, 2.1313, 2.0321),
        (128, 64, 131072, 0.3412, 3.19688, 1.39136), (128, 64, 131072, 1.0, 4.24298, 3.9925),
        (128, 128, 1024, 0.3396, 0.046744, 0.050408), (128, 128, 1024, 1.0, 0.077144, 0.068784),
        (128, 128, 4096, 0.3397, 0.135264, 0.112928), (128, 128, 4096, 1.0, 0.243392, 0.237328),
        (128, 128, 16384, 0.3397, 0.49072, 0.332128), (128, 128, 16384, 1.0, 0.970896, 1.02744),
        (128, 128, 65536, 0.3397, 1.79925, 1.38134), (128, 128, 65536, 1.0, 4.25464, 3.99821),
        (128, 128, 131072, 0.3397, 3.57616, 2.78243), (128, 128, 131072, 1.0, 8.57704, 8.01699),
    )),
)

if __name__ == "__main__":
    sys.exit(main())
