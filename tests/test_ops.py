"""The pure-torch reference of ``mla_fa3.ops`` against the fp64 oracle (``tests/oracle.py``).

One named table of cases (``ops_cases.OP_SPECS``) drives every paged-attention test; each case is built
with an adversarial cache: SHUFFLED page ids, NaN in every cache slot outside a request's first L tokens
(tails of last pages, spare pages, padding page 0) and a huge out-of-range id (2**30) in every unused
page-table entry. The oracle sees only the dense per-request K/V that the builder wrote into the pages.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from oracle import dense_attention
from ops_cases import FLASHMLA, OP_SPECS, Case, Spec, build_case, build_flashmla, flashmla_oracle, oracle, tolerances

from mla_fa3 import ops
from mla_fa3.ops import reference, validate


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Force several online-softmax key blocks and query chunks per request."""
    monkeypatch.setattr(reference, "KEY_BLOCK", 5)
    monkeypatch.setattr(reference, "SCORE_BUDGET", 64)


def _check(case: Case, out, lse):
    ref_out, ref_lse = oracle(case)
    atol, rtol, lse_atol = tolerances(case.spec.dtype, case.spec.fp8)
    assert out.dtype == (torch.bfloat16 if case.spec.fp8 else case.q.dtype)
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:-1]
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


@pytest.mark.parametrize("name", list(OP_SPECS))
def test_kvcache_reference_matches_oracle(name, tiny_blocks):
    case = build_case(OP_SPECS[name])
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True,
                                           impl="reference")
    assert ops.last_impl() is ops.Impl.REFERENCE
    _check(case, out, lse)


@pytest.mark.parametrize("name", ["extend_with_prefix", "mla_small", "window_left"])
def test_kvcache_default_blocks(name):
    case = build_case(OP_SPECS[name], seed=1)
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True)
    _check(case, out, lse)


def test_rows_without_keys_are_zero_with_neg_inf_lse():
    case = build_case(OP_SPECS["batched_q_longer_than_cache"])
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True)
    # request 0: L = 2, sq = 4 -> query positions -2, -1 see nothing under causal
    assert torch.isneginf(lse[0, :2]).all() and (out[0, :2] == 0).all()
    assert torch.isfinite(lse[0, 2:]).all()
    out1 = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs)
    torch.testing.assert_close(out1, out, atol=0, rtol=0)  # return_lse=False: out alone


def test_lse_helpers_convert_bases():
    x = torch.tensor([0.0, 1.5, -3.0, float("-inf")])
    base2 = x / math.log(2)
    torch.testing.assert_close(ops.lse_base2_to_natural(base2), x)
    torch.testing.assert_close(ops.lse_natural_to_base2(x), base2)
    assert ops.LSE_BASE == "e"


# ------------------------------------------------------------------------------- varlen_func


VARLEN = {
    "causal_mixed": dict(q_lens=(4, 1, 9), k_lens=(10, 6, 9), heads=4, kv_heads=2, d=24, dv=16, causal=True),
    "noncausal": dict(q_lens=(3, 5), k_lens=(7, 2), heads=2, kv_heads=2, d=16, dv=16, causal=False),
    "window_softcap": dict(q_lens=(6,), k_lens=(20,), heads=2, kv_heads=1, d=8, dv=8, causal=True,
                           window=(5, -1), softcap=3.0),
    "empty_request": dict(q_lens=(0, 3), k_lens=(4, 3), heads=2, kv_heads=1, d=8, dv=8, causal=True),
}


@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen_reference_matches_oracle(name, tiny_blocks):
    c = dict(VARLEN[name])
    g = torch.Generator().manual_seed(3)
    window, softcap = c.get("window", (-1, -1)), c.get("softcap", 0.0)
    qs = [torch.randn(n, c["heads"], c["d"], generator=g) for n in c["q_lens"]]
    ks = [torch.randn(n, c["kv_heads"], c["d"], generator=g) for n in c["k_lens"]]
    vs = [torch.randn(n, c["kv_heads"], c["dv"], generator=g) for n in c["k_lens"]]
    cu = lambda lens: torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)  # noqa: E731
    out, lse = ops.flash_attn_varlen_func(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_seqlens_q=cu(c["q_lens"]), cu_seqlens_k=cu(c["k_lens"]),
        max_seqlen_q=max(c["q_lens"]), max_seqlen_k=max(c["k_lens"]), causal=c["causal"], window_size=window,
        softcap=softcap, return_lse=True,
    )
    refs = [dense_attention(q, k, v, scale=c["d"] ** -0.5, causal=c["causal"], window=window, softcap=softcap)
            for q, k, v in zip(qs, ks, vs)]
    torch.testing.assert_close(out.double(), torch.cat([r[0] for r in refs]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.cat([r[1] for r in refs]), atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- merge_state


def _partial(q, k, v, mask, scale):
    return dense_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_state_equals_attention_over_union(dtype):
    g = torch.Generator().manual_seed(5)
    n, L, H, d = 6, 23, 3, 16
    q, k, v = torch.randn(n, H, d, generator=g), torch.randn(L, H, d, generator=g), torch.randn(L, H, d, generator=g)
    full = torch.ones(n, L, dtype=torch.bool)
    in_a = torch.rand(n, L, generator=g) < 0.5  # a random split of every row's keys
    in_a[0] = True  # row 0: every key in A, B empty
    o_a, l_a = _partial(q, k, v, in_a, 0.3)
    o_b, l_b = _partial(q, k, v, ~in_a, 0.3)
    o_ref, l_ref = _partial(q, k, v, full, 0.3)
    o, lse = ops.merge_state(o_a.to(dtype), l_a.float(), o_b.to(dtype), l_b.float())
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (n, H)
    atol = 2e-5 if dtype is torch.float32 else 1.5e-2
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse.double(), l_ref, atol=2e-5, rtol=1e-5)


def test_prepare_merge_state_a_nonempty_is_a_checked_flag():
    o, lse = torch.zeros(2, 1, 8), torch.zeros(2, 1)
    assert ops.prepare_merge_state(o, lse, o, lse, impl="reference", a_nonempty=True).a_nonempty is True
    assert ops.prepare_merge_state(o, lse, o, lse, impl="reference").a_nonempty is False
    with pytest.raises(TypeError, match="a_nonempty"):
        ops.prepare_merge_state(o, lse, o, lse, impl="reference", a_nonempty=1)


def test_merge_state_empty_states():
    o_a = torch.tensor([[[1.0, 2.0]], [[float("nan"), 0.0]], [[5.0, 5.0]], [[3.0, 4.0]]])
    o_b = torch.tensor([[[float("nan"), 7.0]], [[1.0, -1.0]], [[6.0, 6.0]], [[9.0, 9.0]]])
    inf = float("inf")
    lse_a = torch.tensor([[0.5], [-inf], [-inf], [inf]])  # +inf = an empty row as FA3 writes it
    lse_b = torch.tensor([[-inf], [2.0], [-inf], [1.0]])
    o, lse = ops.merge_state(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o, torch.tensor([[[1.0, 2.0]], [[1.0, -1.0]], [[0.0, 0.0]], [[9.0, 9.0]]]))
    torch.testing.assert_close(lse, torch.tensor([[0.5], [2.0], [-inf], [1.0]]))


def test_chunked_prefix_pattern_through_ops(tiny_blocks):
    """Prefix keys (non-causal) and new keys (causal) attended separately, merged = causal attention over all."""
    g = torch.Generator().manual_seed(6)
    P, n, H, d, dv = 11, 5, 2, 16, 8
    q = torch.randn(n, H, d, generator=g)
    k, v = torch.randn(P + n, H, d, generator=g), torch.randn(P + n, H, dv, generator=g)
    one = lambda x: torch.tensor([0, x], dtype=torch.int32)  # noqa: E731
    o_p, l_p = ops.flash_attn_varlen_func(q, k[:P], v[:P], cu_seqlens_q=one(n), cu_seqlens_k=one(P), max_seqlen_q=n,
                                          max_seqlen_k=P, softmax_scale=0.25, return_lse=True)
    o_n, l_n = ops.flash_attn_varlen_func(q, k[P:], v[P:], cu_seqlens_q=one(n), cu_seqlens_k=one(n), max_seqlen_q=n,
                                          max_seqlen_k=n, softmax_scale=0.25, causal=True, return_lse=True)
    o, lse = ops.merge_state(o_p, l_p, o_n, l_n)
    o_ref, l_ref = dense_attention(q, k, v, scale=0.25, causal=True)
    torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), l_ref, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- FlashMLA
@pytest.mark.parametrize("name", list(FLASHMLA))
def test_flash_mla_reference_matches_oracle(name, tiny_blocks):
    c = FLASHMLA[name]
    q, kv, table, lens, dense, extra = build_flashmla(c)
    fp8 = c.get("fp8") is True  # "kv": an e4m3 cache with q in fp32, exact against the dequantizing oracle
    sched = ops.get_mla_decode_metadata(lens, c["heads"] * c["sq"], is_fp8=fp8)
    assert isinstance(sched, ops.FlashMLASchedule) and sched.impl is ops.Impl.REFERENCE
    scale = (128 + c["d_rope"]) ** -0.5
    out, lse = ops.flash_mla_with_kvcache(q, kv, table, lens, head_dim_v=c["r"], schedule=sched, softmax_scale=scale,
                                          causal=True, return_lse=True, **extra)
    assert out.shape == (len(c["lens"]), c["sq"], c["heads"], c["r"]) and lse.shape == out.shape[:-1]
    ref_out, ref_lse = flashmla_oracle(c, dense, scale)
    atol, rtol, lse_atol = tolerances(torch.float32, fp8)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


def test_flash_mla_e4m3_cache_with_a_float_q_is_the_reference_and_split_kv_only():
    """FlashMLA reads an e4m3 cache only with an e4m3 q: the mixed call is refused for FA3 before any kernel."""
    c = FLASHMLA["fp8kv_small"]
    q, kv, table, lens, _, extra = build_flashmla(c, dtype=torch.bfloat16)
    fake = ops.FlashMLASchedule(ops.Impl.FA3, torch.zeros(4, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="^kv_cache is torch.float8_e4m3fn but q is torch.bfloat16: FlashMLA"):
        validate.check_flash_mla(q, kv, table, lens, head_dim_v=c["r"], schedule=fake, softmax_scale=0.1, causal=True,
                                 impl=ops.Impl.FA3, descale_q=None, **extra)
    r = c["r"]  # the rope part apart is the split-KV op's form only; an e4m3 q is always given whole
    with pytest.raises(ValueError, match="^q_rope must be None for FlashMLA"):
        validate.check_flash_mla(q[..., :r], kv, table, lens, head_dim_v=r, schedule=fake, softmax_scale=0.1,
                                 causal=True, impl=ops.Impl.FA3, descale_q=None, q_rope=q[..., r:], **extra)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^q_rope must be None with a torch.float8_e4m3fn q"):
        validate.check_flash_mla(q8[..., :r], kv, table, lens, head_dim_v=r, schedule=replace(fake, is_fp8=True),
                                 softmax_scale=0.1, causal=True, impl=ops.Impl.REFERENCE, descale_q=torch.ones(1),
                                 q_rope=q8[..., r:], **extra)


@pytest.mark.parametrize("name", ["mtp_sq2_small", "decode_deepseek"])
def test_split_qv_form_over_row_views_matches_oracle(name):
    """The absorbed path's FA3 call on views of the 576 row (q = q[..., r:], k_cache = k_rope view, v_cache = c_kv
    view, qv = q[..., :r]: no copies) is MLA attention over the whole row: the fp64 oracle of ``flashmla_oracle``.
    (The reference FlashMLA op is this same call, so the two are not compared with each other.)"""
    c = FLASHMLA[name]
    q, kv, table, lens, dense, _ = build_flashmla(c, seed=2)
    r = c["r"]
    k_rope, c_kv = kv[..., r:], kv[..., :r]
    assert k_rope.data_ptr() == kv.data_ptr() + r * kv.element_size() and c_kv.data_ptr() == kv.data_ptr()
    out, lse = ops.flash_attn_with_kvcache(q[..., r:], k_rope, c_kv, qv=q[..., :r], page_table=table,
                                           cache_seqlens=lens, softmax_scale=0.1, causal=True, return_lse=True)
    ref_out, ref_lse = flashmla_oracle(c, dense, 0.1)
    atol, rtol, lse_atol = tolerances(torch.float32)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


def test_schedule_copy_updates_in_place():
    dst = ops.FlashMLASchedule(ops.Impl.FA3, torch.zeros(4, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    src = replace(dst, tile_scheduler_metadata=torch.ones(4, 8, dtype=torch.int32),
                  num_splits=torch.arange(3, dtype=torch.int32))
    buf = dst.tile_scheduler_metadata
    dst.copy_(src)
    assert dst.tile_scheduler_metadata is buf and (buf == 1).all()
    assert dst.num_splits.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="other"):
        dst.copy_(replace(src, is_fp8=True))


def test_idle_batch_returns_empty():
    q = torch.randn(0, 4, 16)
    cache = torch.randn(2, 4, 2, 16)
    out, lse = ops.flash_attn_with_kvcache(
        q, cache, cache, page_table=torch.zeros(0, 1, dtype=torch.int32), cache_seqlens=torch.zeros(0, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32), max_seqlen_q=0, return_lse=True,
    )
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_reference_scores_stay_bounded(monkeypatch):
    """Online softmax in blocks: every product is [H_kv, group * q_chunk, <= max(key_block, d_v)], never [L, L]."""
    monkeypatch.setattr(reference, "KEY_BLOCK", 8)
    monkeypatch.setattr(reference, "SCORE_BUDGET", 256)
    sizes, bmm = [], torch.bmm

    def spy(a, b, **kw):
        out = bmm(a, b, **kw)
        sizes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "bmm", spy)
    case = build_case(Spec(lens=(96,), new=(96,), heads=4, kv_heads=2, page_size=8))
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True)
    # scores [H_kv, group * q_chunk, key_block] = [2, 2 * 8, 8] with q_chunk = 256 // (4 * 8); P.V [2, 16, dv = 16]
    assert sizes and max(n for _, n, _ in sizes) <= 16 and max(k for _, _, k in sizes) <= 16  # L = 96
    _check(case, out, lse)
