"""The paired KV-cache accuracy comparison (``mla_fa3.kv_accuracy``) on CPU.

The statistics against a published value (Newcombe's interval for paired proportions as printed by
R's ``contingencytables``), against the score equation that defines the Wilson interval, against the
Wald interval for large counts, and the paired counts on a hand-checkable table. Then the whole
comparison on the tiny model (fp32 on CPU: the model-dtype cache equals transformers, the FP8 caches
do not): same positions for every cache, the pooled counts and the printed verdicts.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_fa3.hf_compare import PositionScores
from mla_fa3.kv_accuracy import (Z95, compare_kv_caches, format_comparison, paired_difference_interval, paired_gap,
                                 wilson_interval)


def test_newcombe_interval_matches_the_published_example():
    # Cavo et al. (2012), complete response before / after consolidation therapy: [[59, 6], [16, 80]];
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables", ch. 8, Newcombe
    # square-and-add: estimate -0.0621, 95% CI -0.1186 to -0.0046 (R contingencytables, test-ch8.R).
    lo, hi = paired_difference_interval(59, 6, 16, 80)
    assert (6 - 16) / 161 == pytest.approx(-0.0621, abs=5e-5)
    assert lo == pytest.approx(-0.1186, abs=5e-5) and hi == pytest.approx(-0.0046, abs=5e-5)


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (97, 100), (2950, 3000)])
def test_wilson_bounds_solve_the_score_equation(k, n):
    lo, hi = wilson_interval(k, n)
    p_hat = k / n
    for p in (lo, hi):  # (p_hat - p)^2 = z^2 p (1 - p) / n at each bound
        assert (p_hat - p) ** 2 == pytest.approx(Z95 ** 2 * p * (1 - p) / n, abs=1e-12)
    assert lo <= p_hat <= hi and (lo == 0) == (k == 0) and (hi == 1) == (k == n)
    inside = [i / 1000 for i in range(1001) if (p_hat - i / 1000) ** 2 <= Z95 ** 2 * (i / 1000) * (1 - i / 1000) / n]
    assert lo <= min(inside) and max(inside) <= hi and min(inside) - lo < 1e-3 and hi - max(inside) < 1e-3


def test_newcombe_is_the_wald_interval_for_large_counts():
    n, b, c = 10 ** 6, 2000, 1000
    lo, hi = paired_difference_interval(500_000, b, c, n - 500_000 - b - c)
    half = Z95 * math.sqrt(b + c - (b - c) ** 2 / n) / n  # Wald: sqrt(b + c - (b - c)^2 / n) / n
    assert lo == pytest.approx(0.001 - half, abs=1e-3 * half) and hi == pytest.approx(0.001 + half, abs=1e-3 * half)


def test_newcombe_interval_symmetries_and_errors():
    lo, hi = paired_difference_interval(990, 0, 0, 10)  # no discordant pair: around 0, not of zero width
    assert lo == pytest.approx(-hi) and 0 < hi < 0.01
    assert paired_difference_interval(40, 3, 9, 8) == pytest.approx(tuple(-x for x in
                                                                         paired_difference_interval(40, 9, 3, 8)[::-1]))
    with pytest.raises(ValueError, match="counts"):
        paired_difference_interval(0, 0, 0, 0)
    with pytest.raises(ValueError, match="k <= n"):
        wilson_interval(4, 3)


def _scores(ours, ref, decode):
    n = len(ours)
    return PositionScores(torch.tensor(ours), torch.tensor(ref), torch.ones(n, dtype=torch.float64),
                          torch.tensor(decode))


def test_paired_gap_counts_a_hand_table():
    ref, decode = [1, 2, 3, 4, 5, 6], [False, False, False, True, True, True]
    bf16 = _scores([1, 2, 3, 0, 0, 6], ref, decode)  # right at 0, 1, 2, 5
    fp8 = _scores([1, 0, 3, 4, 0, 9], ref, decode)  # right at 0, 2, 3
    g = paired_gap(bf16, fp8)  # both: 0, 2; only bf16: 1, 5; only fp8: 3; neither: 4; same argmax: 0, 2, 4
    assert (g.both, g.only_ref, g.only_test, g.neither, g.same_top1, g.n) == (2, 2, 1, 1, 3, 6)
    assert g.gap == pytest.approx(1 / 6) and (g.low, g.high) == pytest.approx(paired_difference_interval(2, 2, 1, 1))
    d = paired_gap(bf16, fp8, torch.tensor(decode))  # rows 3, 4, 5: only fp8, neither, only bf16
    assert (d.both, d.only_ref, d.only_test, d.neither, d.same_top1) == (0, 1, 1, 1, 1) and d.gap == 0
    with pytest.raises(ValueError, match="same positions"):
        paired_gap(bf16, _scores([1, 0, 3, 4, 0, 9], [1, 2, 3, 4, 5, 7], decode))


def test_compare_kv_caches_on_cpu():
    cmp = compare_kv_caches(config="tiny_v3", seeds=(0, 1), prompt_lengths=(12, 7), steps=5, dtype=torch.float32,
                            device="cpu", max_prefill_tokens=8, fp8_kernels=("flashmla", "splitkv"))
    model_cache, unit, calibrated, skv_unit, skv_calibrated = cmp.runs
    assert [r.name for r in cmp.runs[1:]] == ["fp8 flashmla, scale 1.0", "fp8 flashmla, calibrated",
                                              "fp8 splitkv, scale 1.0", "fp8 splitkv, calibrated"]
    assert skv_unit.kv_scales == unit.kv_scales and skv_calibrated.kv_scales == calibrated.kv_scales
    # the decode kernel reads the cache on decode rows only: prefill rows are the same computation, decode rows
    # differ (split-KV keeps q exact, FlashMLA FP8 rounds it to e4m3)
    for fm, skv in ((unit, skv_unit), (calibrated, skv_calibrated)):
        prefill = ~fm.scores.decode
        assert torch.equal(fm.scores.cosine[prefill], skv.scores.cosine[prefill])
        assert not torch.equal(fm.scores.cosine[fm.scores.decode], skv.scores.cosine[fm.scores.decode])
    decode = model_cache.scores.decode
    assert cmp.positions == 2 * (12 + 7 + 2 * 5) and int(decode.sum()) == 2 * 2 * 5
    for run in cmp.runs:  # every cache scored on the same rows against the same transformers argmax
        assert torch.equal(run.scores.ref_top1, model_cache.scores.ref_top1) and torch.equal(run.scores.decode, decode)
    assert model_cache.scores.hits.all() and float(model_cache.scores.cosine.min()) > 0.99999  # fp32 = transformers
    assert model_cache.kv_scales is None and unit.kv_scales == [[1.0] * 3] * 2
    assert all(0 < s < 1 for seed in calibrated.kv_scales for s in seed)
    for i, run in enumerate(cmp.runs[1:], start=1):
        assert float(run.scores.cosine[decode].mean()) < 1 - 1e-6  # decode rows read the quantized cache
        g = cmp.gap(i)
        assert g.n == cmp.positions and g.only_test == 0  # the fp32 cache is right everywhere
        assert g.only_ref == int((~run.scores.hits).sum())
        parts = [cmp.gap(i, p) for p in ("prefill", "decode")]
        assert sum(p.n for p in parts) == g.n and sum(p.only_ref for p in parts) == g.only_ref
    text = format_comparison(cmp)
    assert "58 positions (prefill 38, decode 20)" in text and "fp32 cache" in text
    verdicts = [line for line in text.splitlines() if "MET" in line or "MISSED" in line]
    assert len(verdicts) == 8 and all("95% interval" in line for line in verdicts)
    with pytest.raises(ValueError, match="^fp8_kernels must be distinct names"):
        compare_kv_caches(config="tiny_v3", seeds=(0,), device="cpu", fp8_kernels=("fa3",))
