"""The prefill benchmark's CSV -> fit -> constants flow, run on CPU with tiny shapes (no timing claims)."""

from __future__ import annotations

import csv

from mla_fa3.bench import prefill
from mla_fa3.policy import prefill_fit


def test_bench_writes_the_csv_the_fit_reads(tmp_path, capsys):
    assert prefill.main(["--device", "cpu", "--heads", "2", "--new", "16", "--prefix", "0,130", "--workspace", "64",
                         "--repeat", "2", "--budget-ms", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MHA run-to-run spread" in out and "H200_COSTS = CostConstants(" in out
    for run in (1, 2):
        rows = list(csv.DictReader(open(tmp_path / f"prefill_run{run}.csv")))
        assert [(r["prefix"], r["chunks"]) for r in rows] == [("0", "0"), ("130", "3")]
        assert (tmp_path / f"prefill_run{run}.md").read_text().count("\n| 2 | 16 |") == 2
        # the ceiling column is the stated formula at 790 TFLOP/s
        flops = 2 * 2 * 16 * (130 + 8) * 320 + (130 + 16) * 512 * 2 * 256 * 2
        assert float(rows[1]["ceiling_ms"]) == float(f"{flops / 790e9:.4g}")
    samples = prefill_fit.read_samples_csv(tmp_path / "prefill_run1.csv")
    assert [(s.prefix_lens, s.workspace_tokens) for s in samples] == [((0,), 64), ((130,), 64)]
    assert prefill_fit.main([str(tmp_path / "prefill_run1.csv")]) == 0
    assert capsys.readouterr().out.startswith("H200_COSTS = CostConstants(mha_attn_tflops=")
