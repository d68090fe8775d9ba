"""absorb.py and layer.py: W_UK/W_UV layouts, the absorption algebra and the named errors.

Every expectation is computed here in fp64 from the definitions (kv_b_proj as an nn.Linear weight
[H·(d_nope + d_v), r] applied to c_kv), never from the library's own output.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_cases import make_mla_case, mla_oracle, rel_err
from specs import MLA_CONFIGS, SPECS, BatchSpec

from mla_fa3 import absorb
from mla_fa3.policy.paths import DecodeKernel
from mla_fa3.layer import MLAWeights
from mla_fa3.layer import AttentionLayer, LayerKind, MLADims
from mla_fa3.metadata import MetadataBuilder

CFGS = ["odd_small", "deepseek_v3"]


def _weights(cfg, seed=0, dtype=torch.float32):
    d, H = cfg.dims, cfg.num_heads
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) / math.sqrt(d.kv_lora_rank)
    return w.to(dtype), MLAWeights.from_kv_b_proj(w.to(dtype), d, num_heads=H)


@pytest.mark.parametrize("cfg_name", CFGS)
def test_from_kv_b_proj_layouts(cfg_name):
    cfg = MLA_CONFIGS[cfg_name]
    d, H = cfg.dims, cfg.num_heads
    w, mw = _weights(cfg)
    rows = d.qk_nope_head_dim + d.v_head_dim
    assert mw.w_uk.shape == (H, d.qk_nope_head_dim, d.kv_lora_rank) and mw.w_uk.is_contiguous()
    assert mw.w_uv.shape == (H, d.kv_lora_rank, d.v_head_dim) and mw.w_uv.is_contiguous()
    for h in (0, H - 1):
        torch.testing.assert_close(mw.w_uk[h], w[h * rows: h * rows + d.qk_nope_head_dim], rtol=0, atol=0)
        torch.testing.assert_close(mw.w_uv[h], w[h * rows + d.qk_nope_head_dim: (h + 1) * rows].t(), rtol=0, atol=0)
    assert (mw.num_heads, mw.qk_nope_head_dim, mw.kv_lora_rank, mw.v_head_dim) == (
        H, d.qk_nope_head_dim, d.kv_lora_rank, d.v_head_dim)
    half = mw.to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.w_uv.is_contiguous()


@pytest.mark.parametrize("cfg_name", CFGS)
def test_absorbed_scores_and_outputs_equal_the_decompressed_ones(cfg_name):
    """q_lat·c_kv == q_nope·k_nope and o_lat·W_UVᵀ == Σ p·v, with k_nope, v = kv_b_proj(c_kv) (fp64 truth)."""
    cfg = MLA_CONFIGS[cfg_name]
    d, H = cfg.dims, cfg.num_heads
    w, mw = _weights(cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    T, L = 5, 7
    q_nope = torch.randn(T, H, d.qk_nope_head_dim, generator=g)
    c_kv = torch.randn(L, d.kv_lora_rank, generator=g)
    kv = torch.nn.functional.linear(c_kv.double(), w.double()).view(L, H, -1)  # the MHA decompression
    k_nope, v = kv[..., : d.qk_nope_head_dim], kv[..., d.qk_nope_head_dim:]
    q_lat = absorb.absorb_query(q_nope, mw)
    assert q_lat.shape == (T, H, d.kv_lora_rank) and q_lat.is_contiguous()
    s_abs = torch.einsum("thr,lr->thl", q_lat.double(), c_kv.double())
    s_mha = torch.einsum("thd,lhd->thl", q_nope.double(), k_nope)
    assert rel_err(s_abs, s_mha) <= 1e-5
    p = torch.softmax(torch.randn(T, H, L, generator=g).double(), dim=-1)
    o_lat = torch.einsum("thl,lr->thr", p, c_kv.double()).float()
    o = absorb.project_output(o_lat, mw)
    assert o.shape == (T, H, d.v_head_dim) and o.is_contiguous()
    assert rel_err(o, torch.einsum("thl,lhd->thd", p, v)) <= 1e-5
    k2, v2 = absorb.decompress_kv(c_kv, mw)
    assert rel_err(k2, k_nope) <= 1e-5 and rel_err(v2, v) <= 1e-5
    assert k2.is_contiguous() and v2.is_contiguous()


def test_absorb_query_into_a_strided_view():
    cfg = MLA_CONFIGS["odd_small"]
    d, H = cfg.dims, cfg.num_heads
    w, mw = _weights(cfg)
    q_nope = torch.randn(4, H, d.qk_nope_head_dim)
    buf = torch.full((4, H, d.latent_dim), 9.0)
    absorb.absorb_query(q_nope, mw, out=buf[..., : d.kv_lora_rank])
    want = torch.einsum("thd,hdr->thr", q_nope.double(), w.double().view(H, -1, d.kv_lora_rank)[:, : d.qk_nope_head_dim])
    assert rel_err(buf[..., : d.kv_lora_rank], want) <= 1e-5
    assert torch.all(buf[..., d.kv_lora_rank:] == 9.0)


def _metadata(case):
    return MetadataBuilder(case.layout.req_to_token_pool, case.spec.page_size, "cpu").build(case.batch)


@pytest.mark.parametrize("spec_name", ["extend_with_prefix", "verify_k4", "mixed_long_prefix"])
def test_forward_absorbed_matches_oracle_without_the_backend(spec_name):
    case = make_mla_case(spec_name, "odd_small", seed=4)
    buf = case.pool.kv_buffer[case.layer.layer_id]
    buf[case.batch.out_cache_loc] = case.new_latent
    out = absorb.forward_absorbed(case.q, case.layer, _metadata(case), case.pool.paged(case.layer.layer_id),
                                  impl="reference")
    assert rel_err(out, mla_oracle(case)) <= 1e-5


@pytest.mark.parametrize("spec_name", ["small_decode", "verify_k2_page64"])
def test_flashmla_kernel_equals_oracle(spec_name):
    from mla_fa3 import ops
    s = SPECS[spec_name]
    case = make_mla_case(BatchSpec(s.mode, s.prefix_lens, s.extend_lens, page_size=64), "deepseek_v3", seed=5)
    case.pool.kv_buffer[case.layer.layer_id][case.batch.out_cache_loc] = case.new_latent
    md = _metadata(case)
    paged = case.pool.paged(case.layer.layer_id)
    with pytest.raises(ValueError, match="schedule"):
        absorb.forward_absorbed(case.q, case.layer, md, paged, kernel=DecodeKernel.FLASHMLA, impl="reference")
    sq = md.max_seqlen_q
    schedule = ops.get_mla_decode_metadata(md.cache_seqlens, case.cfg.num_heads * sq, impl="reference")
    out = absorb.forward_absorbed(case.q, case.layer, md, paged, kernel=DecodeKernel.FLASHMLA, schedule=schedule,
                                  impl="reference")
    assert rel_err(out, mla_oracle(case)) <= 1e-5


def test_flashmla_refuses_unequal_query_lengths():
    from mla_fa3 import ops
    case = make_mla_case(BatchSpec(SPECS["mixed_page64"].mode, (65, 10), (1, 3), page_size=64), "tiny")
    md = _metadata(case)
    schedule = ops.get_mla_decode_metadata(md.cache_seqlens, 4, impl="reference")
    with pytest.raises(ValueError, match="equal query length"):
        absorb.forward_absorbed(case.q, case.layer, md, case.pool.paged(1), kernel=DecodeKernel.FLASHMLA,
                                schedule=schedule, impl="reference")


# ---------------------------------------------------------------------------------------------------
# named errors


def test_mla_weights_named_errors():
    d = MLADims(40, 24, 8, 20)
    good = torch.randn(3 * 44, 40)
    with pytest.raises(ValueError, match="weight must be"):
        MLAWeights.from_kv_b_proj(torch.randn(3 * 44, 41), d)
    with pytest.raises(ValueError, match="weight must be"):
        MLAWeights.from_kv_b_proj(torch.randn(3 * 44 + 1, 40), d)
    with pytest.raises(ValueError, match="num_heads"):
        MLAWeights.from_kv_b_proj(good, d, num_heads=4)
    with pytest.raises(TypeError, match="weight must be a dequantized"):
        MLAWeights.from_kv_b_proj(good.to(torch.float8_e4m3fn), d)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        MLAWeights.from_kv_b_proj(good.numpy(), d)
    with pytest.raises(ValueError, match="w_uv must be"):
        MLAWeights(w_uk=torch.randn(3, 24, 40), w_uv=torch.randn(3, 41, 20))
    with pytest.raises(ValueError, match="w_uk must be 3-D"):
        MLAWeights(w_uk=torch.randn(24, 40), w_uv=torch.randn(3, 40, 20))
    w = MLAWeights.from_kv_b_proj(good, d)
    with pytest.raises(ValueError, match="mla_weights must have"):
        w.check_matches(4, d)


def test_layer_named_errors():
    d = MLADims(40, 24, 8, 20)
    w = MLAWeights.from_kv_b_proj(torch.randn(3 * 44, 40), d)
    ok = dict(layer_id=0, kind=LayerKind.MLA, num_heads=3, num_kv_heads=1, head_dim=32, v_head_dim=20,
              scaling=0.17, mla=d, mla_weights=w)
    AttentionLayer(**ok)
    bad = {
        "layer_id": ({"layer_id": -1}, ValueError),
        "kind": ({"kind": "mla"}, TypeError),
        "num_heads": ({"num_heads": 0}, ValueError),
        "num_kv_heads": ({"num_kv_heads": 3}, ValueError),
        "head_dim": ({"head_dim": 31}, ValueError),
        "v_head_dim": ({"v_head_dim": 21}, ValueError),
        "scaling": ({"scaling": float("nan")}, ValueError),
        "logit_cap": ({"logit_cap": -1.0}, ValueError),
        "sliding_window": ({"sliding_window": -2}, ValueError),
        "mla must be": ({"mla": None}, TypeError),
        "mla_weights must have": ({"num_heads": 6}, ValueError),
    }
    for msg, (change, exc) in bad.items():
        with pytest.raises(exc, match=msg):
            AttentionLayer(**{**ok, **change})
    with pytest.raises(ValueError, match="only for LayerKind.MLA"):
        AttentionLayer(layer_id=0, kind=LayerKind.MHA, num_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=8,
                       scaling=0.3, mla=d)
    with pytest.raises(ValueError, match="CROSS"):
        AttentionLayer(layer_id=0, kind=LayerKind.CROSS, num_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=8,
                       scaling=0.3, sliding_window=4)
    with pytest.raises(ValueError, match="kv_lora_rank must be an int >= 1"):
        MLADims(0, 24, 8, 20)
    with pytest.raises(TypeError, match="qk_rope_head_dim must be an int"):
        MLADims(40, 24, 8.0, 20)
    with pytest.raises(ValueError, match="exclusive"):
        AttentionLayer.mla_layer(0, 3, d, 0.2, kv_b_proj_weight=torch.randn(132, 40), mla_weights=w)
    layer = AttentionLayer.mla_layer(0, 3, d, 0.2, kv_b_proj_weight=torch.randn(132, 40), sliding_window=5)
    assert layer.window_size == (5, 0) and d.latent_dim == 48 and d.qk_head_dim == 32


def test_check_query_named_errors():
    d = MLADims(40, 24, 8, 20)
    layer = AttentionLayer.mla_layer(0, 3, d, 0.2, kv_b_proj_weight=torch.randn(132, 40))
    absorb.check_query(torch.randn(2, 3, 32), layer)
    with pytest.raises(ValueError, match="q must be"):
        absorb.check_query(torch.randn(2, 3, 31), layer)
    with pytest.raises(ValueError, match="q must be"):
        absorb.check_query(torch.randn(3, 32), layer)
    with pytest.raises(TypeError, match="q dtype"):
        absorb.check_query(torch.randn(2, 3, 32, dtype=torch.float64), layer)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        absorb.check_query([1.0], layer)
