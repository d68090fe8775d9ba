"""FA3 / FlashMLA / merge_state_v2 (sgl-kernel, H200) against the fp64 oracle and the torch reference.

Same named case table as ``tests/test_ops.py`` (``ops_cases.py``) (shuffled pages, NaN past every sequence, 2**30 in unused
page-table entries), run in bf16. Tolerances come from precision, as in FA3's own tests:
    err(FA3 vs fp64 oracle) <= 2 · err(plain torch bf16 attention vs fp64 oracle) + 1e-4
plus cosine similarity >= 0.9999 against the reference on the same inputs (0.999 for fp8, whose
P·V runs in e4m3 inside the kernel), and LSE within a small absolute tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from oracle import dense_attention, visible_mask
from ops_cases import (FLASHMLA, OP_SPECS, Spec, build_case, build_flashmla, check, cosine, flashmla_oracle,
                       oracle)

from mla_fa3 import ops
from mla_fa3.ops import Impl

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
# FA3 runs qv (absorbed MLA) only for v head dims >= 256; smaller ones are rejected by validation.
GPU_SPECS = [name for name, spec in OP_SPECS.items() if not spec.fp8 and not (spec.mla and spec.dv < 256)]


def torch_lowp(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, qv=None, dtype=BF16):
    """Plain torch attention computed in ``dtype`` (scores, softmax, P·V): the precision baseline."""
    q, k, v = (x.to(DEV, dtype) for x in (q, k, v))
    n, H, _ = q.shape
    L, h_kv, _ = k.shape
    k, v = k.repeat_interleave(H // h_kv, 1), v.repeat_interleave(H // h_kv, 1)
    s = torch.einsum("nhd,lhd->hnl", q, k)
    if qv is not None:
        s = s + torch.einsum("nhd,lhd->hnl", qv.to(DEV, dtype), v)
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible_mask(n, L, causal=causal, window=window).to(DEV), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", p, v).cpu()


def _lowp_case(case):
    s = case.spec
    outs = [torch_lowp(q, k, v, qv=qv, scale=case.scale, causal=s.causal, window=s.window, softcap=s.softcap)
            for q, qv, k, v in case.dense]
    return torch.stack(outs) if s.sq else torch.cat(outs)


@pytest.mark.parametrize("name", GPU_SPECS)
def test_fa3_kvcache_matches_oracle(name):
    case = build_case(OP_SPECS[name], device=DEV, dtype=BF16)
    args = (case.q, case.k_cache, case.v_cache)
    out, lse = ops.flash_attn_with_kvcache(*args, **case.kwargs, return_lse=True, impl="fa3")
    assert ops.last_impl() is Impl.FA3
    assert out.dtype == BF16 and lse.dtype == torch.float32 and lse.shape == out.shape[:-1]
    ref_impl, _ = ops.flash_attn_with_kvcache(*args, **case.kwargs, return_lse=True, impl="reference")
    ref_out, ref_lse = oracle(case)
    check(out, lse, ref_out, ref_lse, _lowp_case(case), ref_impl)


def test_auto_picks_fa3_on_h200():
    assert ops.fa3_available()
    case = build_case(OP_SPECS["decode_bs1"], device=DEV, dtype=BF16)
    ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs)
    assert ops.last_impl() is Impl.FA3


def test_fa3_fp8_mha_head_dim_128_with_descales():
    spec = Spec(lens=(300, 77, 1), new=(1, 5, 1), heads=8, kv_heads=2, d=128, dv=128, fp8=True, page_size=16)
    case = build_case(spec, device=DEV)
    args = (case.q, case.k_cache, case.v_cache)
    out, lse = ops.flash_attn_with_kvcache(*args, **case.kwargs, return_lse=True, impl="fa3")
    assert ops.last_impl() is Impl.FA3 and out.dtype == BF16
    ref_impl, _ = ops.flash_attn_with_kvcache(*args, **case.kwargs, return_lse=True, impl="reference")
    ref_out, ref_lse = oracle(case)
    assert cosine(out, ref_out) >= 0.999
    check(out, lse, ref_out, ref_lse, None, ref_impl, min_cos=0.999, lse_atol=2e-2)


def _varlen_inputs(q_lens, k_lens, H=16, d=192, dv=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, H, d, generator=g).to(BF16) for n in q_lens]
    ks = [torch.randn(n, H, d, generator=g).to(BF16) for n in k_lens]
    vs = [torch.randn(n, H, dv, generator=g).to(BF16) for n in k_lens]
    return qs, ks, vs


def _cu(lens):
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(DEV)


def test_fa3_varlen_192_128_with_lse():
    q_lens, k_lens, scale = (5, 130, 1), (300, 130, 7), 192**-0.5
    qs, ks, vs = _varlen_inputs(q_lens, k_lens)
    kw = dict(cu_seqlens_q=_cu(q_lens), cu_seqlens_k=_cu(k_lens), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
              softmax_scale=scale, causal=True, return_lse=True)
    q, k, v = (torch.cat(x).to(DEV) for x in (qs, ks, vs))
    out, lse = ops.flash_attn_varlen_func(q, k, v, **kw, impl="fa3")
    assert ops.last_impl() is Impl.FA3 and lse.shape == (q.shape[0], 16)
    ref_impl, _ = ops.flash_attn_varlen_func(q, k, v, **kw, impl="reference")
    refs = [dense_attention(a.float(), b.float(), c.float(), scale=scale, causal=True) for a, b, c in zip(qs, ks, vs)]
    lowp = torch.cat([torch_lowp(a, b, c, scale=scale, causal=True) for a, b, c in zip(qs, ks, vs)])
    check(out, lse, torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs]), lowp, ref_impl)


def test_merge_state_v2_chunked_prefix_and_empty_rows():
    P, n, scale = 257, 64, 192**-0.5
    qs, ks, vs = _varlen_inputs((n,), (P + n,), seed=1)
    q, k, v = qs[0].to(DEV), ks[0].to(DEV), vs[0].to(DEV)
    kw = dict(softmax_scale=scale, return_lse=True, impl="fa3")
    o_p, l_p = ops.flash_attn_varlen_func(q, k[:P], v[:P], cu_seqlens_q=_cu((n,)), cu_seqlens_k=_cu((P,)),
                                          max_seqlen_q=n, max_seqlen_k=P, **kw)
    o_n, l_n = ops.flash_attn_varlen_func(q, k[P:], v[P:], cu_seqlens_q=_cu((n,)), cu_seqlens_k=_cu((n,)),
                                          max_seqlen_q=n, max_seqlen_k=n, causal=True, **kw)
    o, lse = ops.merge_state(o_p, l_p, o_n, l_n, impl="fa3")
    assert ops.last_impl() is Impl.FA3
    o_ref, l_ref = dense_attention(qs[0].float(), ks[0].float(), vs[0].float(), scale=scale, causal=True)
    lowp = torch_lowp(qs[0], ks[0], vs[0], scale=scale, causal=True)
    ref_impl, _ = ops.merge_state(o_p, l_p, o_n, l_n, impl="reference")
    check(o, lse, o_ref, l_ref, lowp, ref_impl)
    # empty states: row 0 both empty, row 1 only b, row 2 only a
    inf = float("inf")
    la, lb = l_p.clone(), l_n.clone()
    la[0], lb[0], la[1], lb[2] = -inf, -inf, -inf, -inf
    o2, lse2 = ops.merge_state(o_p, la, o_n, lb, impl="fa3")
    r2, rl2 = ops.merge_state(o_p, la, o_n, lb, impl="reference")
    assert (o2[0] == 0).all() and torch.isneginf(lse2[0]).all()
    torch.testing.assert_close(o2.float(), r2.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse2, rl2, atol=1e-5, rtol=1e-5)
    self_o, self_lse = ops.merge_state(o_p, l_p, o_p, l_p, impl="fa3")
    torch.testing.assert_close(self_lse, l_p + math.log(2), atol=1e-5, rtol=1e-5)
    # a validated merge whose state a has no empty row (a_nonempty): b's empty rows (-inf and FA3's +inf)
    # still drop out, without the both-empty rewrite
    lb[1], lb[3] = inf, -inf
    call = ops.prepare_merge_state(o_n, l_n, o_p, lb, impl="fa3", a_nonempty=True)
    o3, lse3 = ops.run_merge_state(call, o_n, l_n, o_p, lb)
    r3, rl3 = ops.merge_state(o_n, l_n, o_p, lb, impl="reference")
    assert torch.isfinite(o3).all() and torch.isfinite(lse3).all()
    torch.testing.assert_close(o3.float(), r3.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse3, rl3, atol=1e-5, rtol=1e-5)


GPU_FLASHMLA = {
    "decode_deepseek": FLASHMLA["decode_deepseek"],
    "mtp_deepseek_sq2": dict(lens=(100, 64, 3), sq=2, heads=16, r=512, d_rope=64, page=64),
}


@pytest.mark.parametrize("name", list(GPU_FLASHMLA))
def test_flashmla_bf16_page64(name):
    c = GPU_FLASHMLA[name]
    q, kv, table, lens, dense, _ = build_flashmla(c, device=DEV, dtype=BF16)
    sched = ops.get_mla_decode_metadata(lens, c["heads"] * c["sq"], impl="fa3")
    assert sched.impl is Impl.FA3 and sched.tile_scheduler_metadata is not None
    scale = (128 + c["d_rope"]) ** -0.5
    kw = dict(head_dim_v=c["r"], schedule=sched, softmax_scale=scale, causal=True, return_lse=True)
    out, lse = ops.flash_mla_with_kvcache(q, kv, table, lens, **kw, impl="fa3")
    assert ops.last_impl() is Impl.FA3 and lse.shape == out.shape[:-1]
    ref_impl, _ = ops.flash_mla_with_kvcache(q, kv, table, lens, **kw, impl="reference")
    ref_out, ref_lse = flashmla_oracle(c, dense, scale)
    lowp = torch.stack([torch_lowp(qb, kvb, kvb[..., : c["r"]], scale=scale, causal=True) for qb, kvb in dense])
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)


def test_flashmla_fp8_page64():
    c = dict(FLASHMLA["decode_deepseek"], fp8=True)
    q, kv, table, lens, dense, extra = build_flashmla(c, device=DEV)
    sched = ops.get_mla_decode_metadata(lens, c["heads"], is_fp8=True, impl="fa3")
    scale = (128 + c["d_rope"]) ** -0.5
    kw = dict(head_dim_v=c["r"], schedule=sched, softmax_scale=scale, causal=True, return_lse=True, **extra)
    out, lse = ops.flash_mla_with_kvcache(q, kv, table, lens, **kw, impl="fa3")
    assert out.dtype == BF16
    ref_impl, _ = ops.flash_mla_with_kvcache(q, kv, table, lens, **kw, impl="reference")
    ref_out, ref_lse = flashmla_oracle(c, dense, scale)
    assert cosine(out, ref_out) >= 0.999
    check(out, lse, ref_out, ref_lse, None, ref_impl, min_cos=0.999, lse_atol=2e-2)


def test_fa3_rejects_fp8_latent_cache_with_qv_before_kernel():
    spec = OP_SPECS["mla_deepseek_dims"]
    case = build_case(spec, device=DEV, dtype=BF16)
    f8 = torch.float8_e4m3fn
    kw = dict(case.kwargs, qv=case.kwargs["qv"].to(f8), k_descale=torch.ones(2, 1, device=DEV),
              v_descale=torch.ones(2, 1, device=DEV))
    latent = torch.cat([case.v_cache, case.k_cache], dim=-1).to(f8)
    with pytest.raises(ValueError, match="^qv is not supported by FA3"):
        ops.flash_attn_with_kvcache(case.q.to(f8), latent[..., spec.dv:], latent[..., : spec.dv], **kw, impl="fa3")
