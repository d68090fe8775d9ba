"""Decode-benchmark CSVs -> the ``Measured`` table of ``policy.decode_kernel``, and the literal to paste.

A row of ``mla-fa3 bench decode --out DIR`` (``DIR/decode.csv``) gives one measured shape when it is page
64 with both ``fa3_ms`` and ``flashmla_ms`` (``splitkv_ms`` when the run timed the split-KV kernel):
(heads, batch, context = longest KV length, skew = ``kv_tokens / (batch · context)`` rounded to 4 decimals).

Several sweeps merge into one table (:func:`table_from_csvs`): a shape that a later CSV measured replaces
the earlier CSV's row of that shape whole, so every row's kernel times come from one run (a split-KV time
is compared with the FA3 / FlashMLA times measured beside it, never with another run's), and no shape has
two rows (at a shape measured twice, a row without a split-KV time would otherwise tie with the one that
has it, and a tie with an unmeasured row never picks split-KV). The merged table is ordered by CSV, then by
(heads, batch, context, skew) — the order :func:`format_table` prints, so the literal reproduces it.
Host only; ``decode_kernel`` re-exports these functions and runs them from its command line.
"""

from __future__ import annotations

import csv
from typing import Iterable, Sequence

from mla_fa3.policy.decode_table import Measured
from mla_fa3.policy.paths import FLASHMLA_PAGE_SIZE

__all__ = ["row_measurement", "shape_key", "table_from_rows", "table_from_csv", "table_from_csvs", "format_table"]


def shape_key(m: Measured) -> tuple[int, int, int, float]:
    """(heads, batch, context, skew): what makes two measurements the same shape."""
    return m.num_heads, m.batch_size, m.context, m.skew


def row_measurement(i: int, row: dict, source: str) -> Measured | None:
    """The Measured of one CSV row (page 64 with both kernel times), or None for rows that are not."""
    try:
        if int(row["page"]) != FLASHMLA_PAGE_SIZE:
            return None
        fa3, mla = row.get("fa3_ms", ""), row.get("flashmla_ms", "")
        if fa3 in ("", None) or mla in ("", None):
            return None
        h, bs, ctx = int(row["heads"]), int(row["batch"]), int(row["context"])
        fa3_ms, mla_ms = float(fa3), float(mla)
        skv = row.get("splitkv_ms", "")
        skv_ms = None if skv in ("", None) else float(skv)
        kind = row.get("lengths", "equal")
        if kind == "equal" or bs == 1:
            skew = 1.0
        else:  # the skew of the lengths actually run: Σ L_b / (bs · L_max)
            skew = round(int(row["kv_tokens"]) / (bs * ctx), 4)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"rows[{i}] is not a decode-benchmark row ({e!r}): {row}") from None
    if not (fa3_ms > 0 and mla_ms > 0 and 0 < skew <= 1):
        return None
    if skv_ms is not None and not skv_ms > 0:
        skv_ms = None
    return Measured(h, bs, ctx, fa3_ms=fa3_ms, flashmla_ms=mla_ms, source=source, skew=skew, splitkv_ms=skv_ms)


def table_from_rows(rows: Iterable[dict], *, source: str = "bench CSV") -> tuple[Measured, ...]:
    """Measured shapes from decode-benchmark rows (dicts with the CSV's columns).

    Uses rows with ``page == 64`` and both ``fa3_ms`` and ``flashmla_ms`` present (``splitkv_ms`` when the
    row has it), equal and skewed lengths; a shape seen twice keeps the last row. Sorted by
    (heads, batch, context, skew).
    """
    out: dict[tuple[int, int, int, float], Measured] = {}
    for i, row in enumerate(rows):
        m = row_measurement(i, row, source)
        if m is not None:
            out[shape_key(m)] = m
    return tuple(out[k] for k in sorted(out))


def table_from_csv(path: str) -> tuple[Measured, ...]:
    """``table_from_rows`` over a CSV written by ``mla-fa3 bench decode --out DIR`` (source: the path)."""
    with open(path, newline="") as f:
        return table_from_rows(csv.DictReader(f), source=f"bench CSV {path}")


def table_from_csvs(paths: Sequence[str]) -> tuple[Measured, ...]:
    """Several sweeps merged, the later CSV winning: a shape a later CSV measured drops the earlier CSVs' row
    of that shape (every row keeps its own CSV's times and source). Ordered by CSV, then by shape."""
    tables = [table_from_csv(p) for p in paths]
    later: set[tuple[int, int, int, float]] = set()
    kept: list[tuple[Measured, ...]] = []
    for table in reversed(tables):
        kept.append(tuple(m for m in table if shape_key(m) not in later))
        later.update(shape_key(m) for m in table)
    return tuple(m for table in reversed(kept) for m in table)


def format_table(table: Sequence[Measured]) -> str:
    """Python source of a ``MEASURED`` literal for ``table`` (to paste into ``policy/decode_table.py``).

    One block per source, two shapes per line as (heads, batch, context, skew, fa3_ms, flashmla_ms[,
    splitkv_ms]); floats are printed with ``repr`` so that the literal reproduces ``table`` exactly when its
    rows are grouped by source (as :func:`table_from_csvs` returns them). A source with split-KV
    measurements gets the 7-field form (None where a shape lacks one). Needs only ``Measured`` in scope.
    """
    groups: dict[str, list[Measured]] = {}
    for m in table:
        groups.setdefault(m.source, []).append(m)
    lines = ["MEASURED: tuple[Measured, ...] = ("]
    for source, ms in groups.items():
        skv = any(m.splitkv_ms is not None for m in ms)
        if skv:
            lines += ["    *(Measured(h, b, ctx, fa3_ms=fa3, flashmla_ms=mla, splitkv_ms=skv, skew=skew,",
                      f"               source={source!r})",
                      "      for h, b, ctx, skew, fa3, mla, skv in (  # heads, batch, context, skew, FA3 / FlashMLA / "
                      "split-KV ms"]
        else:
            lines += ["    *(Measured(h, b, ctx, fa3_ms=fa3, flashmla_ms=mla, skew=skew,",
                      f"               source={source!r})",
                      "      for h, b, ctx, skew, fa3, mla in (  # heads, batch, context, skew, FA3 ms, FlashMLA ms"]
        cells = [f"({m.num_heads}, {m.batch_size}, {m.context}, {m.skew!r}, {m.fa3_ms!r}, {m.flashmla_ms!r}"
                 + (f", {m.splitkv_ms!r})," if skv else "),") for m in ms]
        lines += ["        " + " ".join(cells[i:i + 2]) for i in range(0, len(cells), 2)]
        lines.append("    )),")
    lines.append(")")
    return "\n".join(lines)
