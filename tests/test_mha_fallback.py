"""mha_fallback on CPU (reference kernels) against fp64 dense attention with explicit masks.

Every case builds a shuffled paged layout (``mla_cases.make_layout``: random page order, stale slot ids in
unused ``req_to_token`` columns), an MHA pool whose every slot starts as NaN (reading a slot that is
not a live key poisons the output), writes each request's cached prefix, then runs ``forward`` with
the new tokens' K/V (which it must store at ``out_cache_loc`` before attending) and compares with
``tests/oracle.dense_attention`` over the ground-truth keys, with the mask written here from the
definitions:

    query at absolute position p sees key j  iff  j <= p
                                              and (W < 0 or j >= p - W)       (sliding window W)
                                              and (C = None or j // C == p // C)   (local chunk C)

FP8 (e4m3) pools are compared with the oracle run on the DEQUANTIZED cache (e4m3(x / scale) * scale of the
K/V the test wrote or handed to the step, quantized here, never read back from the pool under test) and the
e4m3-rounded query. The query's KV-head groups get very different magnitudes per request
(``mha_cases.Q_GROUP_MAGS``), so the q scale's granularity matters, and the oracle quantizes q with the
granularity ``mha_fallback`` documents for the step (``mha_cases.q_scale_runs``): ``max|q| / 448`` per request and
KV-head group for decode, draft decode and target-verify without local attention, per tensor otherwise.

The cases (``MHA_CONFIGS``, ``make_mha_case``, ``mha_oracle``) are in ``mha_cases.py``; the specs
(``SPECS``, ``LOCAL_SPECS``) in ``specs.py``.
"""

from __future__ import annotations

import pytest
import torch

from mha_cases import (E4M3, FP8_CASES, FP8_TOL, FP32_TOL, Q_GROUP_MAGS, MHAConfig, fp8_query, make_mha_case,
                       mha_oracle, q_scale_runs, quantize_e4m3, rel_err_per_request, same_bits)
from mla_cases import rel_err
from specs import DEC, LOCAL_CHUNKS, LOCAL_SPECS, NONIDLE_SPECS, BatchSpec

from mla_fa3 import mha_fallback, ops
from mla_fa3.layer import LayerKind

# ------------------------------------------------------------------------------------------- cases

FEATURES = {  # name -> (config, layer options)
    "gqa": ("gqa_8_2", {}),
    "mqa_window": ("mqa", {"sliding_window": 5}),
    "gqa_softcap": ("gqa_8_2", {"logit_cap": 1.5}),
    "dv_window_softcap": ("mha_dv_differs", {"sliding_window": 3, "logit_cap": 1.5}),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("spec_name", NONIDLE_SPECS)
def test_matches_oracle(spec_name, feature):
    cfg, opts = FEATURES[feature]
    case = make_mha_case(spec_name, cfg, **opts)
    out = case.forward()
    assert out.shape == (case.batch.num_tokens, case.cfg.num_heads, case.cfg.v_head_dim)
    assert out.dtype == case.q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, mha_oracle(case)) < FP32_TOL


@pytest.mark.parametrize("spec_name", ["small_decode", "verify_k4"])
def test_deepseek_v3_dims(spec_name):
    case = make_mha_case(spec_name, "deepseek_v3_mha_dims", sliding_window=40)
    assert rel_err(case.forward(), mha_oracle(case)) < FP32_TOL


@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("local_name", LOCAL_SPECS)
def test_local_attention(local_name, window):
    spec, chunk = LOCAL_SPECS[local_name], LOCAL_CHUNKS[local_name]
    case = make_mha_case(spec, "gqa_8_2", chunk=chunk, sliding_window=window)
    assert case.metadata.local is not None
    assert rel_err(case.forward(), mha_oracle(case)) < FP32_TOL


def test_local_attention_differs_from_global():
    """The chunk mask really cuts: the same step without local attention gives another answer."""
    spec, chunk = LOCAL_SPECS["extend_borders_p4"], LOCAL_CHUNKS["extend_borders_p4"]
    local = make_mha_case(spec, chunk=chunk)
    out_local = local.forward()
    plain = make_mha_case(spec)
    out_plain = plain.forward()
    assert rel_err(out_local, out_plain) > 1e-2
    assert rel_err(out_plain, mha_oracle(plain)) < FP32_TOL


def fp8_oracle_query(case) -> torch.Tensor:
    return fp8_query(case.q, rows=q_scale_runs(case.spec.mode, case.q_rows, case.chunk is not None),
                     num_kv_heads=case.cfg.num_kv_heads)


# the FP8 cases, plus a local-attention decode step (one query per virtual request: per-request q scales)
FP8_CPU_CASES = {**FP8_CASES, "local_decode": (LOCAL_SPECS["decode_borders_p4"], "gqa_8_2", {}, 8)}


@pytest.mark.parametrize("name", FP8_CPU_CASES)
def test_fp8_matches_dequantized_oracle(name):
    spec, cfg, opts, chunk = FP8_CPU_CASES[name]
    case = make_mha_case(spec, cfg, kv_dtype=E4M3, chunk=chunk, q_group_mags=Q_GROUP_MAGS, **opts)
    out = case.forward()
    assert out.dtype == case.q.dtype
    # the new tokens' K and V are stored quantized at out_cache_loc (checked against e4m3 of the given values)
    lid = case.layer.layer_id
    for b, pre in enumerate(case.spec.prefix_lens):
        loc = case.layout.token_slots(b, pre, case.spec.seq_lens[b])
        assert same_bits(case.pool.k_buffer[lid][loc], quantize_e4m3(case.keys[b][pre:], case.k_scale))
        assert same_bits(case.pool.v_buffer[lid][loc], quantize_e4m3(case.values[b][pre:], case.v_scale))
    # the oracle: K/V quantized here from the values written, q quantized with the documented granularity
    ref = mha_oracle(case, quantized=True, q=fp8_oracle_query(case))
    assert max(rel_err_per_request(out, ref, case.q_rows)) < FP8_TOL
    # and with moderate queries (|q| <= 7) the whole FP8 round trip stays close to full precision (the groups
    # 64x larger above make softmaxes so sharp that e4m3 rounding of q and K moves them by more than this)
    pinned = make_mha_case(spec, cfg, kv_dtype=E4M3, chunk=chunk, **opts)
    full = mha_oracle(pinned)
    cos = torch.nn.functional.cosine_similarity(pinned.forward().double().flatten(), full.flatten(), dim=0)
    assert cos > 0.995


@pytest.mark.parametrize("name", ["decode_gqa", "verify_window", "extend_prefix_mqa"])
def test_fp8_query_scale_granularity_is_visible(name):
    """The other granularity (per tensor for decode / verify, per request for extend) gives a different answer,
    well past FP8_TOL: the oracle above can tell which one ran."""
    spec, cfg, opts, chunk = FP8_CASES[name]
    case = make_mha_case(spec, cfg, kv_dtype=E4M3, chunk=chunk, q_group_mags=Q_GROUP_MAGS, **opts)
    runs = q_scale_runs(case.spec.mode, case.q_rows, chunk is not None)
    other = fp8_query(case.q, rows=None if runs else case.q_rows, num_kv_heads=case.cfg.num_kv_heads)
    right = mha_oracle(case, quantized=True, q=fp8_oracle_query(case))
    wrong = mha_oracle(case, quantized=True, q=other)
    assert max(rel_err_per_request(wrong, right, case.q_rows)) > 4 * FP8_TOL


@pytest.mark.parametrize("uniform", [False, True])
def test_quantize_query_scales(uniform):
    """q_scale = max|q| / 448 per tensor, or per request and KV-head group; q8 * scale round-trips q."""
    bs, per, h_kv, group, d = 3, 2, 2, 4, 16
    g = torch.Generator().manual_seed(4)
    mags = torch.tensor([1e-4, 1.0, 300.0]).view(bs, 1, 1, 1, 1)  # very different magnitudes per request
    q = (torch.randn(bs, per, h_kv, group, d, generator=g) * mags).view(bs * per, h_kv * group, d)
    q8, scale = mha_fallback.quantize_query(q, bs, h_kv, uniform=uniform)
    assert q8.dtype == E4M3 and q8.shape == q.shape and scale.shape == (bs, h_kv) and scale.dtype == torch.float32
    if uniform:
        want = q.view(bs, per, h_kv, group, d).abs().amax(dim=(1, 3, 4)) / 448.0
    else:
        want = (q.abs().max() / 448.0).expand(bs, h_kv)
    assert torch.allclose(scale, want, rtol=1e-6, atol=0)
    back = q8.float().view(bs, per, h_kv, group, d) * scale.view(bs, 1, h_kv, 1, 1)
    err = (back - q.view(bs, per, h_kv, group, d)).abs()
    # e4m3: 3 mantissa bits (relative step 2^-3, error <= 2^-4 of |q|) down to the subnormal step 2^-9 * scale
    bound = 2 ** -4 * q.view(bs, per, h_kv, group, d).abs() + 2 ** -10 * scale.view(bs, 1, h_kv, 1, 1)
    assert (err <= bound * 1.0001).all()
    if not uniform:  # one scale for all: the tiny request underflows to 0 (what per-request scales avoid)
        assert (back[0] == 0).all()


def test_bf16_pool():
    case = make_mha_case("mixed_long_prefix", "gqa_8_2", dtype=torch.bfloat16, sliding_window=7)
    out = case.forward()
    assert out.dtype == torch.bfloat16
    # fp32 accumulation, one bf16 rounding of the output: within 2^-8 of max|ref|
    assert rel_err(out, mha_oracle(case)) < 2 ** -8


def test_window_counts_current_token():
    """sliding_window = W: a query sees W + 1 keys, itself included (uniform scores: out = mean of them)."""
    spec = BatchSpec(DEC, (9,), (1,), page_size=4)
    case = make_mha_case(spec, "mqa", sliding_window=3)
    case.q.zero_()  # every score 0: softmax is uniform over the visible keys
    out = case.forward()
    v = case.values[0]  # [10, 1, d_v]
    expected = v[6:10].mean(dim=0)  # positions 6, 7, 8, 9 (the query's own position is 9)
    assert torch.allclose(out[0], expected.expand_as(out[0]), atol=1e-6)
    case0 = make_mha_case(spec, "mqa", sliding_window=0)
    case0.q.zero_()
    assert torch.allclose(case0.forward()[0], v[9].expand_as(out[0]), atol=1e-6)


def test_save_kv_cache_false_does_not_write():
    case = make_mha_case("extend_with_prefix", "gqa_8_2")
    case.pool.set_kv(1, case.batch.out_cache_loc, case.k_new, case.v_new)  # written beforehand
    before = case.pool.k_buffer[1].clone(), case.pool.v_buffer[1].clone()
    out = mha_fallback.forward(case.q, torch.randn_like(case.k_new), torch.randn_like(case.v_new), case.layer,
                               case.batch, case.metadata, case.pool, save_kv_cache=False)
    assert same_bits(case.pool.k_buffer[1], before[0]) and same_bits(case.pool.v_buffer[1], before[1])
    assert rel_err(out, mha_oracle(case)) < FP32_TOL


def test_kv_none_reads_cached_tokens():
    case = make_mha_case("verify_k4", "mqa")
    case.pool.set_kv(1, case.batch.out_cache_loc, case.k_new, case.v_new)
    out = mha_fallback.forward(case.q, None, None, case.layer, case.batch, case.metadata, case.pool)
    assert rel_err(out, mha_oracle(case)) < FP32_TOL


def test_other_layer_untouched():
    case = make_mha_case("small_decode", "gqa_8_2", layer_id=1)
    case.forward()
    assert torch.isnan(case.pool.k_buffer[0]).all() and torch.isnan(case.pool.v_buffer[0]).all()


def test_idle_returns_empty():
    case = make_mha_case("idle", "gqa_8_2")
    out = case.forward()
    assert out.shape == (0, 8, 16)


# ------------------------------------------------------------------------------------ named errors


def _no_kernel(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel ran before the input was rejected")
    monkeypatch.setattr(ops, "flash_attn_with_kvcache", boom)


def _assert_rejected(case, exc, match, **overrides):
    args = dict(q=case.q, k=case.k_new, v=case.v_new, layer=case.layer, batch=case.batch,
                metadata=case.metadata, pool=case.pool)
    args.update(overrides)
    k_before = case.pool.k_buffer[case.layer.layer_id].clone()
    with pytest.raises(exc, match=match):
        mha_fallback.forward(args["q"], args["k"], args["v"], args["layer"], args["batch"], args["metadata"],
                             args["pool"])
    assert same_bits(case.pool.k_buffer[case.layer.layer_id], k_before), \
        "the pool was written before the input was rejected"


def test_error_mla_layer(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode")
    case.layer.kind = LayerKind.MLA
    _assert_rejected(case, ValueError, "^layer.kind")


def test_error_cross_with_window_or_local(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode")
    case.layer.kind = LayerKind.CROSS
    case.layer.sliding_window = 4
    _assert_rejected(case, ValueError, "^layer.sliding_window")
    case.layer.sliding_window = -1
    case.layer.use_local_attention = True
    _assert_rejected(case, ValueError, "^layer.use_local_attention")


def test_error_missing_local_or_encoder_metadata(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("extend_with_prefix")
    case.layer.use_local_attention = True
    _assert_rejected(case, ValueError, "^metadata.local")
    case.layer.use_local_attention = False
    case.layer.kind = LayerKind.CROSS
    _assert_rejected(case, ValueError, "^metadata.encoder", k=None, v=None)


@pytest.mark.parametrize("head_dim, v_head_dim", [(288, 16), (16, 320), (24, 16)])
def test_error_fp8_head_dims(monkeypatch, head_dim, v_head_dim):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode", MHAConfig(2, 1, head_dim, v_head_dim), kv_dtype=E4M3)
    name = "head_dim" if head_dim != 16 else "v_head_dim"
    _assert_rejected(case, ValueError, f"^layer.{name}")


def test_error_shapes_and_dtypes(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("extend_with_prefix", "gqa_8_2")
    T, H, d = case.q.shape
    _assert_rejected(case, ValueError, "^q must have shape", q=case.q[:-1])
    _assert_rejected(case, ValueError, "^q must have shape", q=case.q[:, :4])
    _assert_rejected(case, ValueError, "^q must have shape", q=torch.randn(T, H, 2 * d))
    _assert_rejected(case, TypeError, "^q dtype", q=case.q.to(torch.bfloat16))
    _assert_rejected(case, ValueError, "^q must be on", q=torch.empty(T, H, d, device="meta"))
    _assert_rejected(case, ValueError, "^k must have shape", k=case.k_new[:-1])
    _assert_rejected(case, ValueError, "^k must have shape", k=torch.randn(T, 8, d))
    _assert_rejected(case, ValueError, "^v must have shape", v=case.v_new[..., :8])
    _assert_rejected(case, ValueError, "^k and v must be given together", v=None)
    _assert_rejected(case, TypeError, "^k must be a torch.Tensor", k=[1.0])


def test_error_layer_pool_mismatch(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode", "gqa_8_2")
    case.layer.num_kv_heads = 4
    _assert_rejected(case, ValueError, "^layer.num_kv_heads")
    case = make_mha_case("small_decode", "gqa_8_2", num_layers=2, layer_id=1)
    case.layer.layer_id = 5
    with pytest.raises(ValueError, match="^layer.layer_id"):
        case.forward()


@pytest.mark.parametrize("spec_name, chunk", [("mixed_long_prefix", None), ("verify_k4", None),
                                              ("extend_with_prefix", 16)])
def test_through_backend(spec_name, chunk):
    """MLABackend dispatches an MHA layer (and its local-attention variant) to this module."""
    from mla_fa3.backend import MLABackend

    case = make_mha_case(spec_name, "gqa_8_2", sliding_window=6, logit_cap=2.0, chunk=chunk)
    backend = MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                         page_size=case.spec.page_size, device="cpu", attention_chunk_size=chunk)
    backend.init_forward_metadata(case.batch)
    out = backend.forward(case.q, case.k_new, case.v_new, case.layer, case.batch)
    assert rel_err(out, mha_oracle(case)) < FP32_TOL
