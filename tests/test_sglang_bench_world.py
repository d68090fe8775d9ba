"""The world ``benchmarks/sglang_backends.py`` times (CPU, SGLang's kit and pools, our reference kernels): with more
than one pool layer — its stacked step, a model's layers in one graph — every layer call must read and write its own
layer buffer of SGLang's pool, as SGLang's DeepSeek layers do. Oracle: fp64 attention over that buffer's rows of the
request (its page table), after the call stored the new row there; on pages of 64 and of 1 (SGLang's default)."""

from __future__ import annotations

import pytest
import torch

from tests.sglang_world import needs_sglang

pytestmark = needs_sglang


@pytest.mark.parametrize("page", [64, 1])
def test_each_stacked_layer_reads_its_own_pool_layer(page):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    from benchmarks import sglang_backends as sb

    bs, ctx, heads = 2, 256, 16
    assert sb.pool_layers_for(1, 65536, False) == 3 and sb.pool_layers_for(4, 65536, False) == 1
    fx = sb.decode_world(kit, ForwardMode.DECODE, heads, bs, ctx, False, device="cpu", pool_layers=3, page=page)
    pool = fx.runner.token_to_kv_pool
    assert len(fx.layers) == pool.layer_num == len(pool.kv_buffer) == 3
    backend = ATTENTION_BACKENDS["mla_fa3"](fx.runner)
    assert backend.page_size == page
    table = fx.runner.req_to_token_pool.req_to_token[:bs, :ctx].long()
    first_page = table[:, 1:64] - table[:, :63]  # slot steps within a request's first 64 tokens
    assert bool((first_page == 1).all()) if page == 64 else bool((first_page != 1).any())  # pages of 1: shuffled
    g = torch.Generator().manual_seed(0)
    q_lat, q_rope = (torch.randn(bs, heads, w, dtype=torch.bfloat16, generator=g) for w in (512, 64))
    c_kv, k_rope = (torch.randn(bs, 1, w, dtype=torch.bfloat16, generator=g) for w in (512, 64))
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fx.fb)
        outs = [layer(q_lat.view(bs, -1), c_kv, c_kv, fx.fb, q_rope=q_rope, k_rope=k_rope).float().view(bs, heads, 512)
                for layer in fx.layers]
    slots = fx.runner.req_to_token_pool.req_to_token[:bs, :ctx].long()
    for i, out in enumerate(outs):
        rows = pool.kv_buffer[i].view(-1, 576).double()
        new = torch.cat([c_kv, k_rope], -1).view(bs, 576).double()
        for b in range(bs):
            assert torch.equal(rows[slots[b, -1]], new[b]), f"layer {i}: request {b}'s new row not stored there"
            keys = rows[slots[b]]
            p = torch.softmax(torch.cat([q_lat[b], q_rope[b]], -1).double() @ keys.T * 192 ** -0.5, -1)
            err = (out[b].double() - p @ keys[:, :512]).abs().max().item()
            assert err < 2e-2, f"layer {i}, request {b}: {err} from the fp64 oracle over its own pool layer"
    assert (outs[0] - outs[1]).abs().max() > 0.1  # the layers' buffers differ, so must their outputs
