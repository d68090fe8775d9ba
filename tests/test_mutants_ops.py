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
