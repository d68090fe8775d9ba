"""Contracts of ``mla_fa3.ops`` that the mutation pass found unchecked (docs/MUTATION.md); oracles in float64,
written from the definitions in ``lse.py`` / ``ops`` docstrings.
"""

from __future__ import annotations

import pytest
import torch

from mla_fa3 import ops


def test_run_merge_state_merges_and_rechecks_the_validated_shape():
    g = torch.Generator().manual_seed(0)
    T, H, d = 3, 2, 4
    o_a, o_b = torch.randn(T, H, d, generator=g), torch.randn(T, H, d, generator=g)
    l_a, l_b = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    call = ops.prepare_merge_state(o_a, l_a, o_b, l_b, impl="reference")
    out, lse = ops.run_merge_state(call, o_a, l_a, o_b, l_b)
    # o = (o_a e^{l_a} + o_b e^{l_b}) / (e^{l_a} + e^{l_b}),  lse = ln(e^{l_a} + e^{l_b})  (natural log)
    ea, eb = l_a.double().exp(), l_b.double().exp()
    want = (o_a.double() * ea[..., None] + o_b.double() * eb[..., None]) / (ea + eb)[..., None]
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), (ea + eb).log(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="o_a / o_b must be"):
        ops.run_merge_state(call, o_a[:2], l_a[:2], o_b[:2], l_b[:2])
    with pytest.raises(ValueError, match="o_a / o_b must be"):
        ops.run_merge_state(call, o_a.double(), l_a, o_b.double(), l_b)


def test_a_validated_varlen_call_takes_only_a_q_like_its_own():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 4, generator=g)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    chosen, call = ops.prepare_flash_attn_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3,
                                                 max_seqlen_k=3, causal=True, impl="reference")
    q2 = torch.randn(5, 2, 8, generator=g)
    assert call.with_q(q2).q is q2 and call.q is q
    strided = torch.randn(5, 2, 16, generator=g)[:, :, ::2]  # q's shape and dtype, last stride 2
    for bad in (q2[:4], q2.double(), strided):
        with pytest.raises(ValueError, match="q must match the validated call's q"):
            call.with_q(bad)


def _tree_inputs(seed=2, bs=2, m=2, n=3, H=2, r=4, dr=2, slots=11):
    g = torch.Generator().manual_seed(seed)
    q_lat, q_rope = torch.randn(bs * m, H, r, generator=g), torch.randn(bs * m, H, dr, generator=g)
    kv = torch.randn(slots, r + dr, generator=g)
    key_slots = torch.randperm(slots, generator=g)[: bs * n].view(bs, n).to(torch.int64)
    mask = torch.rand(bs, m, n, generator=g) < 0.6
    mask[:, :, 0] = True  # every query sees a key
    return q_lat, q_rope, kv, key_slots, mask


def test_tree_attention_matches_float64_and_names_bad_shapes():
    q_lat, q_rope, kv, key_slots, mask = _tree_inputs()
    bs, m, n = mask.shape
    r, scale = q_lat.shape[2], 0.7
    out, lse = ops.tree_attention(q_lat, q_rope, kv, key_slots, mask, softmax_scale=scale)
    # row t = b*m + i over keys j with mask[b, i, j]: s = scale (q_lat·c_kv + q_rope·k_rope), out = Σ softmax(s) c_kv
    for b in range(bs):
        rows = kv[key_slots[b]].double()
        for i in range(m):
            t, vis = b * m + i, mask[b, i]
            s = scale * (q_lat[t].double() @ rows[vis, :r].T + q_rope[t].double() @ rows[vis, r:].T)  # [H, |V|]
            p = torch.softmax(s, dim=-1)
            torch.testing.assert_close(out[t].double(), p @ rows[vis, :r], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[t].double(), torch.logsumexp(s, dim=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kv must be"):
        ops.tree_attention(q_lat, q_rope, torch.randn(11, r + 3), key_slots, mask, softmax_scale=scale)
    with pytest.raises(ValueError, match="kv must be"):
        ops.tree_attention(q_lat, q_rope, kv.view(11, 1, -1), key_slots, mask, softmax_scale=scale)
    with pytest.raises(ValueError, match="key_slots must be"):
        ops.tree_attention(q_lat, q_rope, kv, key_slots[:, :2], mask, softmax_scale=scale)
