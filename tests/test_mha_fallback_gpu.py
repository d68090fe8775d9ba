"""mha_fallback on the H200 through FA3 (sgl-kernel): bf16 and FP8 (e4m3) KV, self- and cross-attention.

Same cases as the CPU tests (``test_mha_fallback`` / ``test_mha_fallback_cross``, ``mha_cases`` moved to CUDA),
with FA3 head dims. Tolerances come from precision:

* bf16: FA3's max error vs the fp64 oracle (on the bf16-rounded inputs) is at most twice the error of
  the same attention computed by torch in bf16 (scores, softmax and P·V in bf16), plus a floor of one
  bf16 ulp of max|ref|; and cosine similarity >= 0.9999.
* FP8: against the oracle run on the DEQUANTIZED cache and the e4m3-rounded query, cosine >= 0.999
  (FA3 also rounds P to e4m3 for the P·V product, so there is no tight elementwise bound).

Also checks that the path is CUDA-graph safe (a captured decode step replays with new inputs and
matches the eager step) — any device->host sync would fail the capture.
"""

from __future__ import annotations

import pytest
import torch

from mha_cases import (E4M3, FP8_CASES, MHAConfig, cross_oracle, fp8_query, make_cross_case, make_mha_case,
                       mha_oracle, pin_amax, visible)
from specs import CROSS_SPECS, DEC, LOCAL_CHUNKS, LOCAL_SPECS, NONIDLE_SPECS, BatchSpec

from mla_fa3 import mha_fallback, ops

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16

GPU_CONFIGS = {
    "gqa_8_2_d128": MHAConfig(8, 2, 128, 128),
    "mqa_d64": MHAConfig(8, 1, 64, 64),
    "mha_192_128": MHAConfig(16, 16, 192, 128),  # DeepSeek-V3's MHA head dims (d != d_v)
    "gqa_d256": MHAConfig(4, 2, 256, 256),
}

GPU_FEATURES = {  # name -> (config, layer options)
    "gqa": ("gqa_8_2_d128", {}),
    "mqa_window": ("mqa_d64", {"sliding_window": 5}),
    "gqa_softcap": ("gqa_8_2_d128", {"logit_cap": 2.0}),
    "192_128_window_softcap": ("mha_192_128", {"sliding_window": 3, "logit_cap": 2.0}),
    "d256": ("gqa_d256", {}),
}


def torch_lowp_attention(q, k, v, mask, *, scale, softcap) -> torch.Tensor:
    """One request's attention computed by torch in q's low precision (bf16 scores, softmax, P·V)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask.to(q.device).unsqueeze(0), float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.einsum("hnl,lhd->nhd", p, v)


def torch_bf16_self(case) -> torch.Tensor:
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        k = case.keys[b].to(device=DEV, dtype=BF16)
        v = case.values[b].to(device=DEV, dtype=BF16)
        mask = visible(e - s, k.shape[0], window=case.layer.sliding_window, chunk=case.chunk)
        outs.append(torch_lowp_attention(case.q[s:e], k, v, mask, scale=case.layer.scaling,
                                         softcap=case.layer.logit_cap))
    return torch.cat(outs)


def torch_bf16_cross(case) -> torch.Tensor:
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        E = case.spec.encoder_lens[b]
        if E == 0:
            outs.append(torch.zeros(e - s, case.cfg.num_heads, case.cfg.v_head_dim, dtype=BF16, device=DEV))
            continue
        k = case.enc_keys[b].to(device=DEV, dtype=BF16)
        v = case.enc_values[b].to(device=DEV, dtype=BF16)
        mask = torch.ones(e - s, E, dtype=torch.bool)
        outs.append(torch_lowp_attention(case.q[s:e], k, v, mask, scale=case.cross.scaling,
                                         softcap=case.cross.logit_cap))
    return torch.cat(outs)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().cpu().flatten(), b.double().cpu().flatten(), dim=0))


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor) -> None:
    out, ref, torch_out = out.double().cpu(), ref.double().cpu(), torch_out.double().cpu()
    assert torch.isfinite(out).all()
    err = float((out - ref).abs().max())
    err_torch = float((torch_out - ref).abs().max())
    floor = float(ref.abs().max()) * 2 ** -8
    assert err <= 2 * err_torch + floor, f"FA3 error {err:.3e} vs torch bf16 error {err_torch:.3e}"
    assert cos(out, ref) >= 0.9999


def _fa3_self(case, **kw) -> torch.Tensor:
    out = case.forward(impl="fa3", **kw)
    assert ops.last_impl() is ops.Impl.FA3
    return out


# ------------------------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("feature", GPU_FEATURES)
@pytest.mark.parametrize("spec_name", NONIDLE_SPECS)
def test_bf16_matches_oracle(spec_name, feature):
    cfg, opts = GPU_FEATURES[feature]
    case = make_mha_case(spec_name, GPU_CONFIGS[cfg], dtype=BF16, device=DEV, **opts)
    out = _fa3_self(case)
    assert out.dtype == BF16
    assert_bf16_close(out, mha_oracle(case), torch_bf16_self(case))


@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("local_name", LOCAL_SPECS)
def test_bf16_local_attention(local_name, window):
    spec, chunk = LOCAL_SPECS[local_name], LOCAL_CHUNKS[local_name]
    case = make_mha_case(spec, GPU_CONFIGS["gqa_8_2_d128"], dtype=BF16, device=DEV, chunk=chunk,
                         sliding_window=window)
    assert_bf16_close(_fa3_self(case), mha_oracle(case), torch_bf16_self(case))


@pytest.mark.parametrize("cfg", ["gqa_8_2_d128", "mha_192_128"])
@pytest.mark.parametrize("name", CROSS_SPECS)
def test_bf16_cross_attention(name, cfg):
    case = make_cross_case(name, GPU_CONFIGS[cfg], dtype=BF16, device=DEV)
    out = case.forward_cross(impl="fa3")
    assert_bf16_close(out, cross_oracle(case), torch_bf16_cross(case))


# -------------------------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("cfg", ["gqa_8_2_d128", "mha_192_128"])
@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_matches_dequantized_oracle(name, cfg):
    spec, _, opts, chunk = FP8_CASES[name]
    case = make_mha_case(spec, GPU_CONFIGS[cfg], dtype=BF16, kv_dtype=E4M3, device=DEV, chunk=chunk,
                         k_scale=0.02, v_scale=0.02, **opts)
    out = _fa3_self(case)
    assert out.dtype == BF16 and torch.isfinite(out).all()
    assert cos(out, mha_oracle(case, from_pool=True, q=fp8_query(case.q))) >= 0.999


@pytest.mark.parametrize("name", ["several_extend_write_p1", "several_decode_p16", "several_mixed_p64"])
def test_fp8_cross_attention(name):
    case = make_cross_case(name, GPU_CONFIGS["gqa_8_2_d128"], dtype=BF16, kv_dtype=E4M3, device=DEV,
                           k_scale=0.02, v_scale=0.02)
    out = case.forward_cross(impl="fa3")
    assert torch.isfinite(out).all()
    assert cos(out, cross_oracle(case, from_pool=True, q=fp8_query(case.q))) >= 0.999


@pytest.mark.parametrize("kv_dtype", [None, E4M3])
def test_fa3_matches_reference_kernel(kv_dtype):
    """Same inputs through FA3 and the torch reference kernel (both fed by this module)."""
    case = make_mha_case("mixed_long_prefix", GPU_CONFIGS["gqa_8_2_d128"], dtype=BF16, kv_dtype=kv_dtype,
                         device=DEV, sliding_window=9, logit_cap=5.0, k_scale=0.02, v_scale=0.02)
    fa3 = _fa3_self(case)
    ref = case.forward(impl="reference")
    assert cos(fa3, ref) >= (0.9999 if kv_dtype is None else 0.999)


# --------------------------------------------------------------------------------------- graphs


@pytest.mark.parametrize("kv_dtype", [None, E4M3])
@pytest.mark.parametrize("window", [-1, 6])
def test_decode_step_is_graph_capturable(kv_dtype, window):
    """Capture store + attention of a decode step; replay with new q/k/v equals the eager step."""
    spec = BatchSpec(DEC, (5, 40, 17, 70), (1, 1, 1, 1), page_size=16)
    case = make_mha_case(spec, GPU_CONFIGS["gqa_8_2_d128"], dtype=BF16, kv_dtype=kv_dtype, device=DEV,
                         sliding_window=window, k_scale=0.02, v_scale=0.02)
    q, k, v = case.q.clone(), case.k_new.clone(), case.v_new.clone()

    def step():
        return mha_fallback.forward(q, k, v, case.layer, case.batch, case.metadata, case.pool, impl="fa3")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator(device=DEV).manual_seed(5)
    q.copy_(pin_amax(torch.randn(q.shape, generator=g, device=DEV), case.cfg.num_kv_heads))
    k.copy_(torch.randn(k.shape, generator=g, device=DEV))
    v.copy_(torch.randn(v.shape, generator=g, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    eager = step()
    assert torch.isfinite(replayed).all()
    assert float((replayed.float() - eager.float()).abs().max()) <= 1e-3 * float(eager.float().abs().max())
    q8 = fp8_query(q) if kv_dtype is not None else q
    assert cos(replayed, mha_oracle(case, from_pool=True, q=q8)) >= 0.999
