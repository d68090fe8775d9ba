"""policy.decode_csv: decode-bench CSVs -> the Measured table, merging sweeps, and the built-in MEASURED.

The oracle for the built-in table is the two recorded CSVs, read here with ``csv`` alone: every shape of
the split-KV sweep (decode_small_batch) is in the table with that sweep's three times, every other shape of
the full sweep (run1) with run1's two, and no shape twice.
"""

from __future__ import annotations

import csv
import io
from contextlib import redirect_stdout
from dataclasses import replace

from mla_fa3.policy import decode_csv
from mla_fa3.policy import decode_kernel as kc
from mla_fa3.policy.paths import DecodeKernel

from test_decode_kernel import SMALL, SMALL_KERNEL, SMALL_PREV, SWEEP, small_batch

SKV = DecodeKernel.SPLITKV


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["heads", "batch", "context", "page", "lengths", "kv_tokens", "fa3_ms",
                                          "flashmla_ms", "splitkv_ms"])
        w.writeheader()
        for h, bs, ctx, fa3, mla, skv in rows:
            w.writerow(dict(heads=h, batch=bs, context=ctx, page=64, lengths="equal", kv_tokens=bs * ctx,
                            fa3_ms=fa3, flashmla_ms=mla, splitkv_ms="" if skv is None else skv))
    return str(path)


def test_builtin_table_is_the_five_sweeps_merged(monkeypatch):
    """MEASURED is what --from-csv run1 --from-csv decode_small_batch --from-csv decode_whole_step_pdl --from-csv
    run4/decode_whole_step --from-csv 2026-12-06/h200/decode_whole_step prints (200 shapes, each once; the
    latest whole-step sweep replaces the earlier ones' and the kernel-alone small-batch rows whole)."""
    root = SWEEP.parents[2]
    monkeypatch.chdir(root)  # the documented command runs from the repository root (sources are its paths)
    rel = [str(p.relative_to(root)) for p in (SWEEP, SMALL_KERNEL, *SMALL_PREV, SMALL)]
    assert decode_csv.table_from_csvs(rel) == kc.MEASURED
    keys = [decode_csv.shape_key(m) for m in kc.MEASURED]
    assert len(keys) == len(set(keys)) == 200
    small = small_batch()
    with open(SWEEP, newline="") as f:
        run1 = {(int(r["heads"]), int(r["batch"]), int(r["context"]), r["lengths"]): r
                for r in csv.DictReader(f) if r["page"] == "64"}
    assert len(run1) == 180 and len(small) == 32
    by_shape = {(m.num_heads, m.batch_size, m.context, m.skew == 1.0): m for m in kc.MEASURED}
    for (h, bs, ctx), t in small.items():  # the later sweep's row, whole
        m = by_shape[(h, bs, ctx, True)]
        assert (m.fa3_ms, m.flashmla_ms, m.splitkv_ms) == (t["fa3"], t["mla"], t["skv"]) and "whole_step" in m.source
    for (h, bs, ctx, kind), r in run1.items():
        m = by_shape[(h, bs, ctx, kind == "equal" or bs == 1)]
        if kind == "equal" and (h, bs, ctx) in small:
            continue
        assert (m.fa3_ms, m.flashmla_ms, m.splitkv_ms) == (float(r["fa3_ms"]), float(r["flashmla_ms"]), None)
    assert sum((h, bs, ctx) in small for h, bs, ctx, kind in run1 if kind == "equal") == 12  # re-measured
    assert sum(m.splitkv_ms is not None for m in kc.MEASURED) == 32


def test_a_later_csv_replaces_the_whole_row_of_a_shape(tmp_path):
    old = _write(tmp_path / "old.csv", [(16, 1, 4096, 0.02, 0.03, None), (16, 1, 16384, 0.024, 0.040, None)])
    new = _write(tmp_path / "new.csv", [(16, 1, 16384, 0.023, 0.039, 0.018), (16, 2, 16384, 0.026, 0.031, 0.025)])
    merged = decode_csv.table_from_csvs([old, new])
    assert [(m.batch_size, m.context, m.fa3_ms, m.splitkv_ms, m.source) for m in merged] == [
        (1, 4096, 0.02, None, f"bench CSV {old}"),
        (1, 16384, 0.023, 0.018, f"bench CSV {new}"), (2, 16384, 0.026, 0.025, f"bench CSV {new}")]
    # the other order: the old row wins, without a split-KV time (times are never mixed across runs)
    back = {(m.batch_size, m.context): m for m in decode_csv.table_from_csvs([new, old])}
    assert (back[(1, 16384)].fa3_ms, back[(1, 16384)].splitkv_ms) == (0.024, None)
    assert back[(2, 16384)].splitkv_ms == 0.025
    # the CLI merges repeated --from-csv the same way, and the literal reproduces the merged table
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert kc.main(["--from-csv", old, "--from-csv", new]) == 0
    scope = {"Measured": kc.Measured}
    exec(buf.getvalue(), scope)
    assert scope["MEASURED"] == merged
    # the merged table picks split-KV at the re-measured shape; the unmerged concatenation does not (see below)
    assert kc.explain_decode_kernel(16, 1, 16384, 64, table=merged).kernel is SKV


def test_a_shape_kept_twice_would_hide_splitkv_where_it_wins():
    """Why the merge drops the older row: at a shape measured twice, the row without a split-KV time ties
    with the row that has one (distance 0), and a tie with an unmeasured shape never picks split-KV."""
    run1, small = kc.table_from_csv(str(SWEEP)), kc.table_from_csv(str(SMALL_KERNEL))
    t = small_batch(SMALL_KERNEL)[(16, 1, 16384)]  # the kernels alone: split-KV won there
    assert min(t["fa3"], t["mla"]) / t["skv"] > 1.2  # split-KV measured > 20 % faster there
    naive = kc.explain_decode_kernel(16, 1, 16384, 64, table=run1 + small)
    assert naive.kernel is not SKV and "split-KV not measured at 1 of these 2 shapes" in naive.reason
    merged = kc.explain_decode_kernel(16, 1, 16384, 64, table=kc.table_from_csvs([str(SWEEP), str(SMALL_KERNEL)]))
    assert merged.kernel is SKV and f"split-KV {t['skv']:.4g} ms" in merged.reason


def test_literal_round_trips_a_table_with_and_without_splitkv_times():
    scope = {"Measured": kc.Measured}
    exec(decode_csv.format_table(kc.MEASURED), scope)
    assert scope["MEASURED"] == kc.MEASURED
    no_skv = tuple(replace(m, splitkv_ms=None) for m in kc.MEASURED[:3])
    text = decode_csv.format_table(no_skv)
    assert "splitkv_ms" not in text
    exec(text, scope)
    assert scope["MEASURED"] == no_skv
