"""Path choice (path_choice): the cost model against the H200 measurements, overrides, splits, errors, re-fit.

The measured anchors (shared/device/README.md, kernels only, bf16, page 64, DeepSeek-V3 dims):
128 heads, 4096 new over a 32k prefix: chunked MHA (8k chunks) 18.3 ms, absorbed 62.9 ms;
16 heads, 512 new over 64k: absorbed 1.82 ms, chunked MHA 1.97 ms.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_fa3.layer import MLADims
from mla_fa3.path_choice import (
    CostConstants,
    CostSample,
    PrefillPath,
    choose_path,
    decode_rows,
    estimate_costs_ms,
    fit_cost_constants,
)

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
W = 8192

# name: (heads, prefix, new, measured absorbed ms, measured chunked-MHA ms, path that must win)
MEASURED = {
    "h128_4k_over_32k": (128, 32768, 4096, 62.9, 18.3, PrefillPath.MHA_CHUNKED),
    "h16_512_over_64k": (16, 65536, 512, 1.82, 1.97, PrefillPath.ABSORBED),
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_measured_shapes_pick_the_faster_path(name):
    H, p, n, _, _, want = MEASURED[name]
    d = choose_path([p], [n], num_heads=H, dims=V3, workspace_tokens=W)
    assert d.path is want
    assert d.requested == "auto" and want.value in d.reason and "auto" in d.reason
    assert d.num_chunks == (-(-p // W) if want is PrefillPath.MHA_CHUNKED else 0)
    assert want.value in d.explain()


@pytest.mark.parametrize("name", list(MEASURED))
def test_model_reproduces_the_measurements(name):
    H, p, n, absorbed_ms, mha_ms, _ = MEASURED[name]
    costs = estimate_costs_ms([p], [n], num_heads=H, dims=V3, workspace_tokens=W)
    assert costs[PrefillPath.ABSORBED] == pytest.approx(absorbed_ms, rel=0.04)
    assert costs[PrefillPath.MHA_CHUNKED] == pytest.approx(mha_ms, rel=0.04)
    assert costs[PrefillPath.MHA_ONESHOT] == math.inf  # a prefix is present: one-shot does not apply


def test_override_is_respected():
    H, p, n, *_ = MEASURED["h128_4k_over_32k"]
    d = choose_path([p], [n], num_heads=H, dims=V3, workspace_tokens=W, prefill_path="absorbed")
    assert d.path is PrefillPath.ABSORBED and "override" in d.reason
    H, p, n, *_ = MEASURED["h16_512_over_64k"]
    d = choose_path([p], [n], num_heads=H, dims=V3, workspace_tokens=W, prefill_path="mha")
    assert d.path is PrefillPath.MHA_CHUNKED and "override" in d.reason
    d = choose_path([0, 0], [64, 3], num_heads=H, dims=V3, workspace_tokens=W, prefill_path="mha")
    assert d.path is PrefillPath.MHA_ONESHOT and d.num_chunks == 0
    with pytest.raises(ValueError, match="prefill_path must be one of"):
        choose_path([0], [4], num_heads=H, dims=V3, workspace_tokens=W, prefill_path="fast")


def test_no_prefix_long_prompt_is_oneshot_mha():
    d = choose_path(torch.tensor([0, 0], dtype=torch.int32), torch.tensor([4096, 2048], dtype=torch.int32),
                    num_heads=128, dims=V3, workspace_tokens=W)
    assert d.path is PrefillPath.MHA_ONESHOT
    assert d.costs_ms[PrefillPath.MHA_CHUNKED] == math.inf


def test_mixed_step_decode_rows_stay_absorbed():
    prefix, extend = [32768, 900, 0, 5000], [4096, 1, 7, 1]
    assert decode_rows(prefix, extend) == [False, True, False, True]
    d = choose_path(prefix, extend, num_heads=128, dims=V3, workspace_tokens=W)
    assert d.path is PrefillPath.MHA_CHUNKED and d.num_decode_rows == 2 and d.split
    # the decode rows' absorbed cost is charged to the MHA option too
    alone = estimate_costs_ms([32768, 0], [4096, 7], num_heads=128, dims=V3, workspace_tokens=W)
    assert d.costs_ms[PrefillPath.MHA_CHUNKED] > alone[PrefillPath.MHA_CHUNKED]
    only_decode = choose_path([10, 20], [1, 1], num_heads=16, dims=V3, workspace_tokens=W, prefill_path="mha")
    assert only_decode.path is PrefillPath.ABSORBED and not only_decode.split
    verify = choose_path([100, 200], [4, 4], num_heads=16, dims=V3, workspace_tokens=W, decode_like=True)
    assert verify.path is PrefillPath.ABSORBED and "decode-like" in verify.reason


def test_smaller_workspace_costs_more_chunks():
    a = estimate_costs_ms([65536], [512], num_heads=16, dims=V3, workspace_tokens=65536)
    b = estimate_costs_ms([65536], [512], num_heads=16, dims=V3, workspace_tokens=1024)
    assert b[PrefillPath.MHA_CHUNKED] > a[PrefillPath.MHA_CHUNKED]
    assert b[PrefillPath.ABSORBED] == a[PrefillPath.ABSORBED]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="prefix_lens and extend_lens must have the same length"):
        choose_path([1, 2], [3], num_heads=16, dims=V3, workspace_tokens=W)
    with pytest.raises(ValueError, match="extend_lens must be >= 0"):
        choose_path([1], [-3], num_heads=16, dims=V3, workspace_tokens=W)
    with pytest.raises(TypeError, match="prefix_lens must be a 1-D integer tensor"):
        choose_path(torch.tensor([1.0]), [3], num_heads=16, dims=V3, workspace_tokens=W)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        choose_path([1], [3], num_heads=0, dims=V3, workspace_tokens=W)
    with pytest.raises(ValueError, match="workspace_tokens must be a positive int"):
        choose_path([1], [3], num_heads=16, dims=V3, workspace_tokens=0)
    with pytest.raises(ValueError, match="hbm_tbps must be > 0"):
        CostConstants(hbm_tbps=0.0)
    with pytest.raises(TypeError, match="constants must be a CostConstants"):
        choose_path([1], [3], num_heads=16, dims=V3, workspace_tokens=W, constants={"hbm_tbps": 4})


def test_fit_recovers_a_slower_machine():
    """Samples timed on a machine 20 % slower in attention and GEMMs: the re-fit model predicts them."""
    truth = CostConstants(mha_attn_tflops=600.0, absorbed_attn_tflops=500.0, gemm_tflops=520.0, hbm_tbps=3.2)
    shapes = [(16, 8192, 512), (128, 32768, 4096), (16, 0, 4096), (128, 65536, 128), (16, 65536, 8192)]
    samples = []
    for H, p, n in shapes:
        c = estimate_costs_ms([p], [n], num_heads=H, dims=V3, workspace_tokens=W, constants=truth)
        mha = c[PrefillPath.MHA_CHUNKED] if p else c[PrefillPath.MHA_ONESHOT]
        samples.append(CostSample(H, (p,), (n,), W, absorbed_ms=c[PrefillPath.ABSORBED], mha_ms=mha))
    fitted = fit_cost_constants(samples, V3, rounds=6)
    for s in samples:
        c = estimate_costs_ms(s.prefix_lens, s.extend_lens, num_heads=s.num_heads, dims=V3, workspace_tokens=W,
                              constants=fitted)
        mha = c[PrefillPath.MHA_CHUNKED] if s.prefix_lens[0] else c[PrefillPath.MHA_ONESHOT]
        assert c[PrefillPath.ABSORBED] == pytest.approx(s.absorbed_ms, rel=0.05)
        assert mha == pytest.approx(s.mha_ms, rel=0.05)
    assert fitted.mha_attn_tflops < CostConstants().mha_attn_tflops
