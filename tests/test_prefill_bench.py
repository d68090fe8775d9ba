"""The prefill benchmark's CSV -> fit -> constants flow, run on CPU with tiny shapes (no timing claims): the smoke
run itself fits nothing (``bench.smoke``), ``policy.prefill_fit`` fits its CSV."""

from __future__ import annotations

import csv

import torch

from mla_fa3.bench import prefill
from mla_fa3.policy import prefill_fit


def test_bench_writes_the_csv_the_fit_reads(tmp_path, capsys):
    assert prefill.main(["--device", "cpu", "--heads", "2", "--new", "16", "--prefix", "0,130", "--workspace", "64",
                         "--repeat", "2", "--budget-ms", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MHA run-to-run spread" in out and "H200_COSTS" not in out and "paste" not in out
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


def test_prefill_host_bench_runs_and_restores_the_kernels_it_nulls():
    from mla_fa3.bench import prefill_host
    from mla_fa3.ops import reference

    real = torch.bmm, reference.flash_attn_varlen_func, reference.merge_state
    r = prefill_host.measure(4, 3, 32, 16, 4, 3, null_gemm=True)
    assert (torch.bmm, reference.flash_attn_varlen_func, reference.merge_state) == real
    assert r["layer_us_3"] > 0 and r["plan_us_3"] > 0 and r["batch_chunks"] >= 1
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with prefill_host.null_kernels(null_gemm=True):
        out = torch.empty(2, 3, 5)
        assert torch.bmm(a, b, out=out) is out and not out.any()  # one cheap op on the output
        torch.testing.assert_close(torch.bmm(a, b), real[0](a, b))  # without out=: the real GEMM
