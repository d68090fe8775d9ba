"""Benchmark outputs a reader sees: the plots drawn from the recorded H200 CSVs, and CPU smoke runs that
say they are smoke runs (never "H200 ... FA3").

Oracle for the plotted numbers: the recorded CSV read with the csv module and divided here
(backend_ms / min(fa3_ms, flashmla_ms); min(...) / roofline_ms), independently of ``DecodeRow``.
"""

from __future__ import annotations

import csv
import math
import pathlib

import pytest
import torch

from mla_fa3.bench import roofline

PERF = pathlib.Path(__file__).resolve().parents[1] / "docs" / "perf"
DECODE_CSV = PERF / "decode_2026-12-02_run2.csv"
PREFILL_CSV = PERF / "prefill_2026-12-02_run2.csv"


def _raw_decode():
    with open(DECODE_CSV, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("metric", sorted(roofline.DECODE_METRICS))
def test_heat_map_cells_equal_the_recorded_csv(metric):
    rows = roofline.read_csv(str(DECODE_CSV))
    raw = _raw_decode()
    checked = 0
    for heads in (16, 128):
        for page, lengths in ((64, "equal"), (64, "skewed"), (1, "equal")):
            batches, contexts, grid = roofline.decode_grid(rows, metric, heads=heads, page=page, lengths=lengths)
            for rec in raw:
                if (int(rec["heads"]), int(rec["page"]), rec["lengths"]) != (heads, page, lengths):
                    continue
                kernels = [float(rec[k]) for k in ("fa3_ms", "flashmla_ms") if rec[k]]
                best = min(kernels)
                want = float(rec["backend_ms"]) / best if metric == "backend_over_best" \
                    else best / float(rec["roofline_ms"])
                got = grid[batches.index(int(rec["batch"]))][contexts.index(int(rec["context"]))]
                assert got == pytest.approx(want, rel=1e-12), rec
                checked += 1
    assert checked >= 60


def test_heat_map_has_a_hole_where_no_shape_was_measured():
    rows = roofline.read_csv(str(DECODE_CSV))
    batches, _, grid = roofline.decode_grid(rows, "backend_over_best", heads=16, page=64, lengths="skewed")
    assert all(v is None for v in grid[batches.index(1)])  # skewed needs >= 2 requests: not in the sweep


def test_plots_are_drawn_from_the_recorded_csvs(tmp_path, capsys):
    """The plotting entry on a slice of the recorded decode CSV (two head counts: keeps the test fast)."""
    pytest.importorskip("matplotlib")
    part = tmp_path / "decode_part.csv"
    with open(DECODE_CSV, newline="") as f, open(part, "w", newline="") as out:
        lines = f.read().splitlines(keepends=True)
        out.writelines([lines[0]] + [ln for ln in lines[1:] if ln.split(",")[0] in ("16", "128")])
    assert roofline.main(["--decode-csv", str(part), "--prefill-csv", str(PREFILL_CSV),
                          "--out", str(tmp_path)]) == 0
    for name in ("decode_roofline.png", "decode_backend_vs_best.png", "prefill_paths.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name
        assert (PERF / name).is_file(), f"docs/perf/{name} is referenced by docs/PERFORMANCE.md"
    assert "prefill_paths.png" in capsys.readouterr().out


def test_prefill_csv_reader_keeps_the_recorded_numbers():
    rows = roofline.read_prefill_csv(str(PREFILL_CSV))
    with open(PREFILL_CSV, newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(rows) == len(raw) == 32
    for r, rec in zip(rows, raw):
        assert r["prefix"] == int(rec["prefix"]) and r["auto_path"] == rec["auto_path"]
        assert math.isclose(r["mha_ms"], float(rec["mha_ms"]))


@pytest.fixture
def _threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_cpu_smoke_runs_are_labelled(capsys, tmp_path, _threads):
    from mla_fa3.bench import decode, prefill
    from mla_fa3.bench.smoke import SMOKE_LABEL

    assert decode.main(["--device", "cpu", "--heads", "16", "--batch", "1", "--context", "64", "--page", "64",
                        "--lengths", "equal", "--budget-ms", "1", "--max-iters", "1", "--quiet"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[0]
    assert "CPU smoke run" in first and "H200 4.3" not in first
    assert prefill.main(["--device", "cpu", "--heads", "2", "--new", "8", "--prefix", "0", "--budget-ms", "1",
                         "--out", str(tmp_path / "p.csv")]) == 0
    assert capsys.readouterr().out.startswith(SMOKE_LABEL + "\n")


def test_smoke_label_only_off_the_h200_path():
    assert roofline.smoke_label("cuda") is None and roofline.smoke_label("cuda:1", "fa3") is None
    assert "cuda with impl=reference" in roofline.smoke_label("cuda", "reference")
    table = roofline.markdown_table([], roofline.Ceilings(4.3e12, 790e12, "H200"), roofline.smoke_label("cpu"))
    assert table.startswith("**CPU smoke run**")


def test_plain_step_bench_computes_the_whole_attention(_threads):
    """The plain unfused step the backend is compared with attends over every cached token (fp64 oracle)."""
    from mla_fa3.bench.decode import DIMS, Cell
    from mla_fa3.bench.plain_step import plain_step_fn

    gen = torch.Generator().manual_seed(0)
    cell = Cell(64, 2, 70, torch.device("cpu"), gen)
    fn = plain_step_fn(cell, 2, gen, impl="reference")
    out = fn()[-1].double()
    q, latent, weights, scale = fn.inputs
    w, r, dn = weights[-1], DIMS.kv_lora_rank, DIMS.qk_nope_head_dim
    buf = cell.pool.kv_buffer[len(weights) - 1].double()
    for b in range(2):
        keys = buf[cell.req_pool.req_to_token[b, :70].long()]
        keys[-1] = latent[b].double()  # the step stores its own token's row first
        q_lat = torch.einsum("hn,hnr->hr", q[b, :, :dn].double(), w.w_uk.double())
        s = scale * (q_lat @ keys[:, :r].T + q[b, :, dn:].double() @ keys[:, r:].T)
        o = torch.einsum("hl,lr,hrv->hv", torch.softmax(s, -1), keys[:, :r], w.w_uv.double())
        torch.testing.assert_close(out[b], o, atol=2e-2, rtol=2e-2)  # bf16 inputs, fp32 reference kernel
