"""``mla_fa3.bench.kernel_roofline``: the decode kernels alone over the roofline, from ``bench.splitkv``'s recorded
CSV. Oracle: the CSV read with the csv module and divided here (each kernel's µs / roofline_us, the fastest row of a
shape per kernel)."""

from __future__ import annotations

import csv
import pathlib

import pytest

from mla_fa3.bench import kernel_roofline

CSV = pathlib.Path(__file__).resolve().parents[1] / "docs" / "perf" / "2026-12-06" / "h200" / "kernel_alone" / "splitkv.csv"


def test_each_kernels_ratio_is_the_recorded_time_over_the_roofline():
    ratios = kernel_roofline.over_roofline(kernel_roofline.read_rows(str(CSV)))
    with open(CSV, newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(ratios) == len({(r["heads"], r["batch"], r["context"]) for r in raw}) == 32
    for rec in raw:
        cell = ratios[(int(rec["heads"]), int(rec["batch"]), int(rec["context"]))]
        for col in ("splitkv_us", "fa3_us", "flashmla_us"):
            assert cell[col] == pytest.approx(float(rec[col]) / float(rec["roofline_us"]), rel=1e-12)
    # 16 heads, bs 1, 16k: split-KV 12.38 µs over a 4.39 µs roofline
    assert ratios[(16, 1, 16384)]["splitkv_us"] == pytest.approx(2.8199, rel=1e-4)


def test_the_fastest_variant_of_a_shape_counts_and_an_untimed_kernel_is_left_out():
    rows = [dict(heads="16", batch="4", context="32768", roofline_us="50", splitkv_us="80", fa3_us="70",
                 flashmla_us=""),
            dict(heads="16", batch="4", context="32768", roofline_us="50", splitkv_us="60", fa3_us="70",
                 flashmla_us="")]
    assert kernel_roofline.over_roofline(rows) == {(16, 4, 32768): {"splitkv_us": 1.2, "fa3_us": 1.4}}


def test_the_plot_is_drawn_from_the_recorded_csv(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "roofline.png"
    assert kernel_roofline.main([str(CSV), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert str(out) in capsys.readouterr().out
    empty = tmp_path / "empty.csv"
    empty.write_text("heads,batch,context,roofline_us,splitkv_us,fa3_us,flashmla_us\n")
    assert kernel_roofline.main([str(empty), "--out", str(tmp_path / "none.png")]) == 1
