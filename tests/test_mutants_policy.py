"""Contracts of ``mla_fa3.policy`` that the mutation pass found unchecked (docs/MUTATION.md).

Expected values follow from the documented rules (the decode-CSV row format, ``Measured``'s checks, the
weighted log2 distance of ``policy.decode_kernel``'s docstring), worked by hand in the comments.
"""

from __future__ import annotations

import math

import pytest

from mla_fa3.policy.decode_csv import row_measurement
from mla_fa3.policy.decode_kernel import explain_decode_kernel
from mla_fa3.policy.decode_table import Measured
from mla_fa3.policy.paths import DecodeKernel


def _row(**kw):
    row = dict(heads="16", batch="4", context="4096", page="64", lengths="equal", kv_tokens="16384",
               fa3_ms="0.2", flashmla_ms="0.1", splitkv_ms="")
    row.update(kw)
    return row


def test_a_row_without_one_kernel_time_is_skipped():
    assert row_measurement(0, _row(flashmla_ms=""), "t") is None
    assert row_measurement(0, _row(fa3_ms=""), "t") is None
    m = row_measurement(0, _row(), "t")
    assert (m.num_heads, m.batch_size, m.context, m.fa3_ms, m.flashmla_ms, m.skew) == (16, 4, 4096, 0.2, 0.1, 1.0)


def test_one_request_has_skew_one_whatever_its_lengths_column():
    # bs 1: mean / max of one length is 1 by definition, so the row needs no kv_tokens.
    row = _row(batch="1", lengths="skewed")
    del row["kv_tokens"]
    assert row_measurement(3, row, "t").skew == 1.0
    # bs 4, skewed: skew = kv_tokens / (bs * context) = 6144 / 16384 = 0.375
    assert row_measurement(3, _row(lengths="skewed", kv_tokens="6144"), "t").skew == 0.375


def test_a_zero_splitkv_time_counts_as_unmeasured():
    assert row_measurement(0, _row(splitkv_ms="0"), "t").splitkv_ms is None
    assert row_measurement(0, _row(splitkv_ms="0.05"), "t").splitkv_ms == 0.05


@pytest.mark.parametrize("field", ["fa3_ms", "flashmla_ms", "splitkv_ms"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_measured_refuses_a_time_that_is_not_positive(field, bad):
    kw = dict(fa3_ms=1.0, flashmla_ms=1.0, splitkv_ms=1.0)
    kw[field] = bad
    with pytest.raises(ValueError, match=f"{field} must be a positive number"):
        Measured(16, 4, 4096, **kw)


def test_the_skew_weight_of_the_distance():
    # Query: 16 heads, bs 4, max 4096, mean 2048 -> skew 0.5 (log2: -1).
    # A (16, 4, 4096, skew 1.0), FlashMLA 2x faster: distance SKEW_WEIGHT * |0 - (-1)| = 2.0.
    # B (16, 16, 5793, skew 0.5), FA3 2x faster: distance log2(16/4) + log2(5793/4096) = 2 + 0.50008.
    # With SKEW_WEIGHT = 2 (docstring: equal vs skewed outweighs one grid step, counts double) A is nearest
    # (gap 0.5 > TIE_DISTANCE): FlashMLA. A weight of 3 would make B nearest: FA3.
    a = Measured(16, 4, 4096, fa3_ms=0.2, flashmla_ms=0.1, skew=1.0)
    b = Measured(16, 16, 5793, fa3_ms=0.1, flashmla_ms=0.2, skew=0.5)
    choice = explain_decode_kernel(16, 4, 4096, 64, mean_seqlen_k=2048, table=[a, b])
    assert choice.kernel is DecodeKernel.FLASHMLA, choice.reason
    # Without the skew difference (equal lengths) A is at distance 0: FlashMLA again, the control.
    assert explain_decode_kernel(16, 4, 4096, 64, table=[a, b]).kernel is DecodeKernel.FLASHMLA
    # And B alone is chosen where it is nearest: a query at B's shape.
    assert explain_decode_kernel(16, 16, 5793, 64, mean_seqlen_k=5793 / 2, table=[a, b]).kernel is DecodeKernel.FA3


# ---------------------------------------------------------------------------------------------- FP8 decode
def _fp8(heads, bs, ctx, flashmla_ms, splitkv_ms, skew=1.0):
    from mla_fa3.policy.fp8_decode import MeasuredFP8

    return MeasuredFP8(heads, bs, ctx, flashmla_ms=flashmla_ms, splitkv_ms=splitkv_ms, skew=skew)


@pytest.mark.parametrize("skew", [0.0, 1.5, math.nan])
def test_measured_fp8_refuses_a_skew_outside_zero_one(skew):
    with pytest.raises(ValueError, match="skew must be a number in"):
        _fp8(16, 4, 4096, 1.0, 1.0, skew=skew)


def test_fp8_choice_off_page_64_is_split_kv_by_default():
    from mla_fa3.policy.fp8_decode import explain_fp8_decode_kernel

    # FlashMLA's FP8 decode reads pages of 64 only: at page 16 split-KV runs, unless it cannot (then an error).
    assert explain_fp8_decode_kernel(16, 1, 4096, 16).kernel is DecodeKernel.SPLITKV
    with pytest.raises(ValueError, match="page_size must be 64"):
        explain_fp8_decode_kernel(16, 1, 4096, 16, allow_splitkv=False)


def test_fp8_choice_reads_the_nearest_shape():
    from mla_fa3.policy.fp8_decode import explain_fp8_decode_kernel

    far = _fp8(16, 64, 65536, flashmla_ms=0.1, splitkv_ms=0.4)  # split-KV 4x slower, 4 + 4 log2 units away
    near = _fp8(16, 4, 4096, flashmla_ms=0.4, splitkv_ms=0.1)  # split-KV 4x faster, the query's own shape
    for table in ([far, near], [near, far]):
        choice = explain_fp8_decode_kernel(16, 4, 4096, 64, table=table)
        assert choice.kernel is DecodeKernel.SPLITKV, choice.reason
        assert "4.000x" in choice.reason  # near's gain alone: 0.4 / 0.1


def test_fp8_choice_says_when_no_shape_is_near():
    from mla_fa3.policy.fp8_decode import explain_fp8_decode_kernel

    # 128 heads vs 16: HEADS_WEIGHT * 3 = 6 log2 units > MAX_DISTANCE 3 -> FlashMLA FP8, no evidence
    choice = explain_fp8_decode_kernel(16, 4, 4096, 64, table=[_fp8(128, 4, 4096, 0.4, 0.1)])
    assert choice.kernel is DecodeKernel.FLASHMLA
    assert "no measured FP8 shape within 3 log2 units" in choice.reason


def test_fp8_splitkv_possible_reaches_by_heads_distance():
    from mla_fa3.policy.fp8_decode import fp8_splitkv_possible

    table = [_fp8(16, 4, 4096, flashmla_ms=0.4, splitkv_ms=0.1)]
    # reach = (MAX_DISTANCE + TIE_DISTANCE) / HEADS_WEIGHT = 1.525 log2 units of heads: 16 -> 8..32 (not 64)
    assert fp8_splitkv_possible(16, table) and fp8_splitkv_possible(8, table) and fp8_splitkv_possible(32, table)
    assert not fp8_splitkv_possible(64, table) and not fp8_splitkv_possible(4, table)


@pytest.mark.parametrize("kv_fp8", [True, False])
def test_graph_kernels_without_a_head_count_never_include_split_kv(kv_fp8):
    import torch

    from mla_fa3.policy.kernel_choice import DecodeKernelChoice

    # split-KV runs here (the reference), but with no head count the table cannot say it is ever faster
    choice = DecodeKernelChoice(decode_kernel="auto", page_size=64, num_heads=None, kv_fp8=kv_fp8,
                                whole_row_kernels=True, impl="reference", device=torch.device("cpu"))
    want = (DecodeKernel.FLASHMLA,) if kv_fp8 else (DecodeKernel.FA3, DecodeKernel.FLASHMLA)
    assert choice.graph_kernels() == want


def test_prefill_override_coerce_takes_a_member_or_its_value():
    from mla_fa3.policy.paths import PrefillOverride

    assert PrefillOverride.coerce(PrefillOverride.MHA) is PrefillOverride.MHA
    assert PrefillOverride.coerce("absorbed") is PrefillOverride.ABSORBED
    with pytest.raises(ValueError, match=r"prefill_path must be one of \['auto', 'absorbed', 'mha'\], got 'MHA'"):
        PrefillOverride.coerce("MHA")


def test_fit_is_exact_on_noise_free_samples():
    # Times produced by the cost model with known constants and no prior pull: Levenberg-Marquardt must land
    # on those constants to ~1e-8 (a wrongly scaled Jacobian still creeps close, to ~1e-5, and is caught here).
    from dataclasses import replace

    from mla_fa3.policy.paths import AttentionPath
    from mla_fa3.policy.prefill_cost import H200_COSTS, estimate_costs_ms
    from mla_fa3.policy.prefill_fit import FITTED_CONSTANTS, CostSample, fit_cost_constants
    from test_prefill_cost import V3, W

    truth = replace(H200_COSTS, mha_attn_tflops=0.8 * H200_COSTS.mha_attn_tflops, gemm_tflops=0.7 * H200_COSTS.gemm_tflops,
                    chunk_overhead_us=150.0, mha_fixed_us=120.0, absorbed_fixed_us=60.0)
    samples = []
    for heads, prefix, new in [(16, [8192], [512]), (128, [32768], [4096]), (16, [0], [4096]), (128, [65536], [128]),
                               (16, [65536], [8192]), (128, [0], [256]), (128, [4096, 0], [64, 2048]), (16, [16384], [64])]:
        c = estimate_costs_ms(prefix, new, num_heads=heads, dims=V3, workspace_tokens=W, constants=truth)
        mha = c[AttentionPath.MHA_CHUNKED] if any(prefix) else c[AttentionPath.MHA_ONESHOT]
        samples.append(CostSample(heads, tuple(prefix), tuple(new), W, absorbed_ms=c[AttentionPath.ABSORBED], mha_ms=mha))
    fitted = fit_cost_constants(samples, V3, prior_weight=0.0)
    for name in FITTED_CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-8), name
