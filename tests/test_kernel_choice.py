"""kernel_choice: valid kernels, FA3 whenever page != 64, the measured H200 anchors, CSV regeneration.

The anchors (shared/device/README.md, per layer, bf16, page 64, graph replay) are restated here as
the README gives them — throughputs — and the winner is derived in the test from those numbers.
The CSV loop runs the decode benchmark itself on CPU (reference kernels, one tiny shape) and reads
its CSV back, so the columns the regeneration reads are the ones the benchmark writes.
"""

from __future__ import annotations

import csv
import io
from contextlib import redirect_stdout

import pytest

from mla_fa3 import kernel_choice as kc
from mla_fa3.absorb import DecodeKernel
from mla_fa3.bench import roofline
from mla_fa3.bench.timing import h200_ceilings

# (heads, batch, context) -> (FA3, FlashMLA) throughput, README units (TB/s or TFLOP/s): higher wins
README_ANCHORS = {
    (16, 64, 8192): (3.77, 3.90),
    (16, 128, 4096): (3.83, 4.03),
    (16, 64, 32768): (4.19, 4.15),
    (16, 1, 65536): (1.56, 1.29),
    (128, 64, 8192): (588.0, 626.0),
    (128, 32, 131072): (558.0, 595.0),
}
GRID = dict(heads=(1, 8, 16, 32, 64, 128), batch=(1, 3, 16, 64, 128, 512), context=(1, 100, 4096, 65536, 1 << 20))


def _grid():
    for h in GRID["heads"]:
        for b in GRID["batch"]:
            for c in GRID["context"]:
                yield h, b, c


@pytest.mark.parametrize("page", [1, 2, 16, 32, 128])
def test_fa3_whenever_page_is_not_64(page):
    for h, b, c in _grid():
        choice = kc.explain_decode_kernel(h, b, c, page)
        assert choice.kernel is DecodeKernel.FA3
        assert f"page_size {page}" in choice.reason


def test_valid_kernel_and_reason_for_every_page64_shape():
    seen = set()
    for h, b, c in _grid():
        choice = kc.explain_decode_kernel(h, b, c, 64)
        assert isinstance(choice.kernel, DecodeKernel) and choice.reason
        assert kc.choose_decode_kernel(h, b, c, 64) is choice.kernel
        seen.add(choice.kernel)
    assert seen == {DecodeKernel.FA3, DecodeKernel.FLASHMLA}  # the table really discriminates


@pytest.mark.parametrize("shape", list(README_ANCHORS))
def test_measured_anchor_winners(shape):
    fa3, flashmla = README_ANCHORS[shape]
    gain = flashmla / fa3  # same work for both: the throughput ratio is the time ratio
    want = DecodeKernel.FLASHMLA if gain >= kc.MIN_GAIN else DecodeKernel.FA3
    assert kc.choose_decode_kernel(*shape, 64) is want


def test_anchor_regions_from_the_brief():
    # FlashMLA at 128 heads; FlashMLA at 16 heads, bs 64-128, ctx 4-8k; FA3 at 16 heads, bs 1, 64k
    assert kc.choose_decode_kernel(128, 16, 16384, 64) is DecodeKernel.FLASHMLA
    assert kc.choose_decode_kernel(16, 96, 6000, 64) is DecodeKernel.FLASHMLA
    assert kc.choose_decode_kernel(16, 1, 65536, 64) is DecodeKernel.FA3


@pytest.mark.parametrize("args, exc, match", [
    ((0, 1, 1, 64), ValueError, "num_heads"),
    ((16, 0, 1, 64), ValueError, "batch_size"),
    ((16, 1, -5, 64), ValueError, "max_seqlen_k"),
    ((16, 1, 1, 0), ValueError, "page_size"),
    (("16", 1, 1, 64), TypeError, "num_heads"),
    ((16, True, 1, 64), TypeError, "batch_size"),
    ((16, 1, 1.5, 64), TypeError, "max_seqlen_k"),
])
def test_bad_input_raises_naming_the_argument(args, exc, match):
    with pytest.raises(exc, match=match):
        kc.choose_decode_kernel(*args)


def _rows(spec):
    """DecodeRows from {(heads, bs, ctx, page, lengths): (fa3_ms, flashmla_ms)}."""
    ceil = h200_ceilings()
    out = []
    for (h, b, c, p, kind), (fa3, mla) in spec.items():
        row = roofline.make_row(h, b, c, p, kind, b * c, ceil)
        row.fa3_ms, row.flashmla_ms = fa3, mla
        out.append(row)
    return out


def test_table_regenerated_from_a_bench_csv(tmp_path):
    spec = {
        (16, 64, 8192, 64, "equal"): (0.20, 0.30),  # FA3 wins at 16 heads
        (128, 64, 8192, 64, "equal"): (0.30, 0.20),  # FlashMLA wins at 128 heads
        (128, 64, 8192, 64, "skewed"): (0.10, 0.90),  # ignored: skewed rows
        (128, 64, 8192, 1, "equal"): (0.10, None),  # ignored: page 1
    }
    path = tmp_path / "decode.csv"
    roofline.write_csv(_rows(spec), str(path))
    table = kc.table_from_csv(str(path))
    assert [(m.num_heads, m.fa3_ms, m.flashmla_ms) for m in table] == [(16, 0.2, 0.3), (128, 0.3, 0.2)]
    assert kc.choose_decode_kernel(16, 64, 8192, 64, table=table) is DecodeKernel.FA3
    assert kc.choose_decode_kernel(128, 64, 8192, 64, table=table) is DecodeKernel.FLASHMLA
    assert kc.choose_decode_kernel(128, 64, 8192, 1, table=table) is DecodeKernel.FA3
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert kc.main(["--from-csv", str(path)]) == 0
    scope = {"Measured": kc.Measured}
    exec(buf.getvalue(), scope)  # the printed literal is valid Python giving the same table
    assert scope["MEASURED"] == table


def test_decode_bench_cpu_smoke_feeds_kernel_choice(tmp_path):
    """The benchmark end to end on CPU (reference kernels): CSV columns, ratios, and the table loop."""
    from mla_fa3.bench import decode

    rc = decode.main(["--device", "cpu", "--impl", "reference", "--heads", "16", "--batch", "2", "--context", "96",
                      "--page", "64", "--budget-ms", "0.01", "--max-iters", "1", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "decode.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    assert [(r["heads"], r["batch"], r["context"], r["page"], r["lengths"]) for r in recs] == [
        ("16", "2", "96", "64", "equal"), ("16", "2", "96", "64", "skewed")]
    for r in recs:
        fa3, mla, backend = float(r["fa3_ms"]), float(r["flashmla_ms"]), float(r["backend_ms"])
        assert r["backend_kernel"] in ("fa3", "flashmla")
        assert float(r["backend_over_best"]) == pytest.approx(backend / min(fa3, mla), rel=1e-4)
        kv = sum(roofline_lengths(r))
        assert int(r["bytes"]) == kv * 576 * 2 and int(r["flops"]) == 2 * 16 * kv * (576 + 512)
    table = kc.table_from_csv(str(tmp_path / "decode.csv"))
    assert len(table) == 1 and table[0].num_heads == 16  # the equal-lengths row
    assert (tmp_path / "decode.md").read_text().count("| 16 | 2 | 96 | 64 |") == 2


def roofline_lengths(rec):
    """Per-request lengths of a CSV row, recomputed here: equal = ctx each, skewed = ctx·16^(-b/(bs-1))."""
    bs, ctx = int(rec["batch"]), int(rec["context"])
    if rec["lengths"] == "equal" or bs == 1:
        return [ctx] * bs
    return [max(1, round(ctx * 16.0 ** (-b / (bs - 1)))) for b in range(bs)]


def test_roofline_matches_the_readme_formula():
    ceil = h200_ceilings()
    # 16 heads, bs 64, 8k: memory bound, bytes / 4.3 TB/s
    row = roofline.make_row(16, 64, 8192, 64, "equal", 64 * 8192, ceil)
    assert row.bytes == 64 * 8192 * 576 * 2 and row.bound == "memory"
    assert row.roofline_ms == pytest.approx(64 * 8192 * 576 * 2 / 4.3e12 * 1e3)
    # 128 heads: compute bound, FLOPs / 790 TFLOP/s
    row = roofline.make_row(128, 32, 131072, 64, "equal", 32 * 131072, ceil)
    assert row.flops == 2 * 32 * 128 * 131072 * (576 + 512) and row.bound == "compute"
    assert row.roofline_ms == pytest.approx(row.flops / 790e12 * 1e3)


def test_far_from_every_measured_shape_falls_back_to_fa3():
    # 16 heads, bs 3, 64 tokens: >= 10 log2 units from every anchor (all anchors have >= 4k context)
    choice = kc.explain_decode_kernel(16, 3, 64, 64)
    assert choice.kernel is DecodeKernel.FA3 and "no measured shape" in choice.reason
    # the same shape with a table measured there follows the measurement
    near = (kc.Measured(16, 4, 64, fa3_ms=0.010, flashmla_ms=0.005, source="test"),)
    assert kc.choose_decode_kernel(16, 3, 64, 64, table=near) is DecodeKernel.FLASHMLA
