"""Per-shape choice of the absorbed-MLA decode kernel: FA3 or FlashMLA, from measured winners.

Both kernels compute the same absorbed decode step (``absorb.py``): per request, ``H`` query heads
of a 576-wide latent query (``q_lat`` [H, r=512] | ``q_rope`` [H, 64]) over ``L`` cached latent rows
(``c_kv`` | ``k_rope``), output [H, 512]. Per layer and step the work is

    bytes  = bs · L · 576 · 2          (bf16 latent cache, read once)
    FLOPs  = 2 · bs · H · L · (576 + 512)

so small ``H`` is memory bound and ``H = 128`` compute bound on the H200. Neither kernel wins
everywhere (shared/device/README.md): FlashMLA is ~6 % faster at 128 heads and ~3-5 % at 16 heads
with large batches over 4-8k contexts; FA3 is faster at 16 heads for a single long request (it
splits the KV more finely) and ties around 16 heads, bs 64, 32k. FlashMLA needs page size 64.

The choice: FlashMLA only when ``page_size == 64`` AND the nearest measured shape (distance in
log2 units, heads weighted double since heads move the bound; at most ``MAX_DISTANCE`` away) had
FlashMLA faster by at least ``MIN_GAIN``; FA3 otherwise (the default kernel: no scheduler-metadata
step, any page size). ``explain_decode_kernel``
returns the reason string for the backend's explain record.

Regenerate the table from a decode-benchmark CSV (``mla-fa3 bench decode --out DIR``)::

    python -m mla_fa3.kernel_choice --from-csv DIR/decode.csv      # prints the MEASURED literal

then paste it over ``MEASURED`` below (and record the command in docs/PERFORMANCE.md), or load it at
run time with ``table_from_csv(path)`` and pass ``table=`` to the functions.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # absorb imports this module's caller chain; resolve the enum lazily at run time
    from mla_fa3.absorb import DecodeKernel

FLASHMLA_PAGE_SIZE = 64  # FlashMLA's paged KV cache has a fixed block size of 64 tokens
MIN_GAIN = 1.02  # FlashMLA must be measured at least 2 % faster to be worth its scheduling step
HEADS_WEIGHT = 2.0  # heads move the memory/compute bound: a heads mismatch counts double
MAX_DISTANCE = 3.0  # farther than this (log2 units) from every measured shape: no evidence -> FA3


@dataclass(frozen=True)
class Measured:
    """One measured shape: per-layer decode kernel times at page 64, bf16, equal lengths."""

    num_heads: int  # query heads H (one latent KV head)
    batch_size: int  # requests, one query token each
    context: int  # KV tokens per request
    fa3_ms: float  # FA3 kernel time, ms (CUDA-graph replay)
    flashmla_ms: float  # FlashMLA kernel time, ms (CUDA-graph replay)
    source: str = "H200 anchor"  # where the numbers come from

    @property
    def flashmla_gain(self) -> float:
        """FA3 time / FlashMLA time: > 1 when FlashMLA is faster."""
        return self.fa3_ms / self.flashmla_ms


def _anchor(h: int, bs: int, ctx: int, fa3: float, mla: float, unit: str) -> Measured:
    """An anchor from shared/device/README.md given as throughput (TB/s or TFLOP/s) -> times in ms."""
    work = bs * ctx * 576 * 2 if unit == "TB/s" else 2 * bs * h * ctx * (576 + 512)
    return Measured(h, bs, ctx, work / (fa3 * 1e12) * 1e3, work / (mla * 1e12) * 1e3)


# Measured winners (H200, sgl-kernel 0.4.5, bf16, page 64, CUDA-graph replay, per layer).
MEASURED: tuple[Measured, ...] = (
    _anchor(16, 64, 8192, 3.77, 3.90, "TB/s"),
    _anchor(16, 128, 4096, 3.83, 4.03, "TB/s"),
    _anchor(16, 64, 32768, 4.19, 4.15, "TB/s"),
    _anchor(16, 1, 65536, 1.56, 1.29, "TB/s"),
    _anchor(128, 64, 8192, 588.0, 626.0, "TFLOP/s"),
    _anchor(128, 32, 131072, 558.0, 595.0, "TFLOP/s"),
)


@dataclass(frozen=True)
class KernelChoice:
    """The chosen decode kernel and why (for ``MLABackend.explain()``)."""

    kernel: "DecodeKernel"
    reason: str


def _decode_kernel_enum():
    from mla_fa3.absorb import DecodeKernel  # lazy: absorb/backend may import this module

    return DecodeKernel


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _distance(m: Measured, num_heads: int, batch_size: int, context: int) -> float:
    return (
        HEADS_WEIGHT * abs(math.log2(m.num_heads / num_heads))
        + abs(math.log2(m.batch_size / batch_size))
        + abs(math.log2(m.context / context))
    )


def explain_decode_kernel(
    num_heads: int,
    batch_size: int,
    max_seqlen_k: int,
    page_size: int,
    *,
    table: Sequence[Measured] | None = None,
    min_gain: float = MIN_GAIN,
) -> KernelChoice:
    """Choose FA3 or FlashMLA for one decode step's shape and say why.

    ``max_seqlen_k`` is the longest KV length in the batch (host int, from ``seq_lens_cpu``);
    ``table`` defaults to ``MEASURED``. Pure host arithmetic: no tensors, no sync.
    """
    for name, value in (
        ("num_heads", num_heads),
        ("batch_size", batch_size),
        ("max_seqlen_k", max_seqlen_k),
        ("page_size", page_size),
    ):
        _check_positive_int(name, value)
    if not (isinstance(min_gain, (int, float)) and min_gain > 0):
        raise ValueError(f"min_gain must be a positive number, got {min_gain!r}")
    kernels = _decode_kernel_enum()
    if page_size != FLASHMLA_PAGE_SIZE:
        return KernelChoice(kernels.FA3, f"page_size {page_size} != {FLASHMLA_PAGE_SIZE} (FlashMLA's block size) -> FA3")
    table = MEASURED if table is None else tuple(table)
    if not table:
        return KernelChoice(kernels.FA3, "no measured shapes -> FA3 (default)")
    near = min(table, key=lambda m: _distance(m, num_heads, batch_size, max_seqlen_k))
    dist = _distance(near, num_heads, batch_size, max_seqlen_k)
    if dist > MAX_DISTANCE:
        return KernelChoice(kernels.FA3, f"no measured shape within {MAX_DISTANCE:g} log2 units (nearest: heads "
                                         f"{near.num_heads}, bs {near.batch_size}, ctx {near.context}) -> FA3 (default)")
    where = (
        f"nearest measured shape heads {near.num_heads}, bs {near.batch_size}, ctx {near.context} "
        f"({near.source}): FA3 {near.fa3_ms:.4g} ms, FlashMLA {near.flashmla_ms:.4g} ms"
    )
    gain = near.flashmla_gain
    if gain >= min_gain:
        return KernelChoice(kernels.FLASHMLA, f"{where} -> FlashMLA {gain:.3f}x faster")
    if gain >= 1.0:
        return KernelChoice(kernels.FA3, f"{where} -> FlashMLA gain {gain:.3f}x < {min_gain} -> FA3")
    return KernelChoice(kernels.FA3, f"{where} -> FA3 {1 / gain:.3f}x faster")


def choose_decode_kernel(
    num_heads: int,
    batch_size: int,
    max_seqlen_k: int,
    page_size: int,
    *,
    table: Sequence[Measured] | None = None,
) -> "DecodeKernel":
    """The decode kernel for this shape (see ``explain_decode_kernel`` for the reason)."""
    return explain_decode_kernel(num_heads, batch_size, max_seqlen_k, page_size, table=table).kernel


# ---------------------------------------------------------------------------------------------------
# Regenerating the table from a decode-benchmark CSV


def table_from_rows(rows: Iterable[dict], *, source: str = "bench CSV") -> tuple[Measured, ...]:
    """Measured shapes from decode-benchmark rows (dicts with the CSV's columns).

    Uses rows with ``page == 64``, ``lengths == "equal"`` and both ``fa3_ms`` and ``flashmla_ms``
    present; a shape seen twice keeps the last row.
    """
    out: dict[tuple[int, int, int], Measured] = {}
    for i, row in enumerate(rows):
        try:
            if int(row["page"]) != FLASHMLA_PAGE_SIZE or row.get("lengths", "equal") != "equal":
                continue
            fa3, mla = row.get("fa3_ms", ""), row.get("flashmla_ms", "")
            if fa3 in ("", None) or mla in ("", None):
                continue
            key = (int(row["heads"]), int(row["batch"]), int(row["context"]))
            fa3_ms, mla_ms = float(fa3), float(mla)
        except (KeyError, ValueError) as e:
            raise ValueError(f"rows[{i}] is not a decode-benchmark row ({e!r}): {row}") from None
        if not (fa3_ms > 0 and mla_ms > 0):
            continue
        out[key] = Measured(*key, fa3_ms=fa3_ms, flashmla_ms=mla_ms, source=source)
    return tuple(out[k] for k in sorted(out))


def table_from_csv(path: str) -> tuple[Measured, ...]:
    """``table_from_rows`` over a CSV written by ``mla-fa3 bench decode --out DIR``."""
    with open(path, newline="") as f:
        return table_from_rows(csv.DictReader(f), source=f"bench CSV {path}")


def format_table(table: Sequence[Measured]) -> str:
    """Python source of a ``MEASURED`` literal for ``table`` (to paste into this module)."""
    lines = ["MEASURED: tuple[Measured, ...] = ("]
    for m in table:
        lines.append(
            f"    Measured({m.num_heads}, {m.batch_size}, {m.context}, fa3_ms={m.fa3_ms:.6g}, "
            f"flashmla_ms={m.flashmla_ms:.6g}, source={m.source!r}),  # gain {m.flashmla_gain:.3f}"
        )
    lines.append(")")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mla_fa3.kernel_choice",
        description="Print the measured FA3-vs-FlashMLA decode table, or regenerate it from a bench CSV.",
    )
    p.add_argument("--from-csv", metavar="CSV", help="decode-benchmark CSV (mla-fa3 bench decode --out DIR)")
    args = p.parse_args(argv)
    table = table_from_csv(args.from_csv) if args.from_csv else MEASURED
    if not table:
        print(f"{args.from_csv}: no page-64 equal-length rows with both fa3_ms and flashmla_ms", file=sys.stderr)
        return 1
    print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
