"""Contracts of ``mla_fa3.integrations.sglang`` that the mutation pass found unchecked (docs/MUTATION.md): the decode
kernel setting, the refusal of a CUDA graph for a prefill step, and ``forward_extend``'s default of storing the new
latent (SGLang's ``AttentionBackend`` signature: ``save_kv_cache=True``).
"""

from __future__ import annotations

import pytest
import torch

from tests.sglang_world import D_ROPE, R, case, kit, kit_fixture, needs_sglang

pytestmark = needs_sglang

if kit is not None:
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from mla_fa3.integrations.sglang.adapter import DECODE_KERNEL_ENV, _decode_kernel_setting
    from mla_fa3.integrations.sglang.convert import UnsupportedStepError


@pytest.mark.parametrize("value,kv_fp8,want", [
    (None, False, "auto"), ("auto", False, "auto"), ("FlashMLA", False, "flashmla"), ("fa3", False, "fa3"),
    (None, True, None), ("auto", True, None), ("flashmla", True, "flashmla"), ("splitkv", True, "splitkv"),
])
def test_decode_kernel_setting(monkeypatch, value, kv_fp8, want):
    # None: the FP8 pool's own automatic choice (FlashMLA FP8 / split-KV); "auto" on a bf16 pool: the measured one
    if value is None:
        monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_KERNEL_ENV, value)
    assert _decode_kernel_setting(kv_fp8) == want


@pytest.mark.parametrize("value,kv_fp8", [("fa3", True), ("triton", False)])
def test_decode_kernel_setting_refusals(monkeypatch, value, kv_fp8):
    monkeypatch.setenv(DECODE_KERNEL_ENV, value)
    with pytest.raises(ValueError, match=DECODE_KERNEL_ENV):
        _decode_kernel_setting(kv_fp8)


def test_a_prefill_cuda_graph_is_refused_by_name():
    fx = kit_fixture(case("EXTEND", prefix_lens=(3,), extend_lens=(2,), name="mut_graph_extend"))
    with pytest.raises(UnsupportedStepError, match="CUDA graphs of EXTEND steps are not served"):
        fx.backend.init_forward_metadata_out_graph(fx.forward_batch, in_capture=True)


def test_forward_extend_stores_the_new_latent_by_default():
    fx = kit_fixture(case("EXTEND", prefix_lens=(3, 5), extend_lens=(2, 4), name="mut_save_default"))
    fb, layer = fx.forward_batch, fx.actual_module.attn_mqa
    T, H = fx.case.num_input_tokens, fx.case.num_heads
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, H * R, generator=g).to(torch.bfloat16)
    q_rope = torch.randn(T, H, D_ROPE, generator=g).to(torch.bfloat16)
    c_kv = torch.randn(T, 1, R, generator=g).to(torch.bfloat16)
    k_rope = torch.randn(T, 1, D_ROPE, generator=g).to(torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata(fb)
        fx.backend.forward_extend(q, c_kv, c_kv, layer, fb, q_rope=q_rope, k_rope=k_rope)  # no save_kv_cache
    rows = fx.runner.token_to_kv_pool.kv_buffer[layer.layer_id][fb.out_cache_loc.long()].reshape(T, -1)
    assert torch.equal(rows, torch.cat([c_kv[:, 0], k_rope[:, 0]], -1))


def test_fp8_decode_keeps_the_absorbed_path():
    # Only a prefill over an FP8 cache is sent to MHA; a decode step on it stays absorbed MLA (SGLang's own rule).
    from mla_fa3.integrations.sglang import plugin

    fx = kit_fixture(case("DECODE", prefix_lens=(3, 9), page_size=64, name="mut_fp8_decode"), fp8=True)

    class Attn:
        kv_cache_dtype = "fp8_e4m3"

    assert plugin.handle_attention(Attn(), fx.forward_batch).name == "MLA"


def test_fp8_prefill_takes_one_shot_mha_when_the_step_fits_the_chunk_capacity():
    # SGLang's rule (_support_mha_one_shot): one shot when the step's keys (sum of seq_lens, here 3 + 2 = 5) fit
    # forward_batch.get_max_chunk_capacity(); chunked over the prefix otherwise
    from mla_fa3.integrations.sglang import plugin

    plugin.register()
    fx = kit_fixture(case("EXTEND", prefix_lens=(3,), extend_lens=(2,), page_size=64, name="mut_fp8_oneshot"),
                     fp8=True)
    fb = fx.forward_batch

    class Attn:
        kv_cache_dtype = "fp8_e4m3"

    fb.get_max_chunk_capacity = lambda: 5
    assert plugin.handle_attention(Attn(), fb).name == "MHA_ONE_SHOT"
    fb.get_max_chunk_capacity = lambda: 4
    assert plugin.handle_attention(Attn(), fb).name == "MHA_CHUNKED_KV"


def test_host_lengths_pad_a_replay_and_device_lengths_are_cut_to_the_batch():
    """``host_int32``: a replay's host copy of the live rows only is padded to bs with the fill value 1; a device
    tensor longer than the batch (a padded buffer) is read for its first bs rows only."""
    from mla_fa3.integrations.sglang.convert import host_int32, to_mla_batch

    assert host_int32([5, 6], "seq_lens_cpu", 4).tolist() == [5, 6, 1, 1]
    assert host_int32(torch.tensor([7, 8, 9]), "seq_lens_cpu", 2).tolist() == [7, 8]
    fx = kit_fixture(case("EXTEND", prefix_lens=(3, 4), extend_lens=(2, 5), name="cut_to_bs"))
    fb = fx.forward_batch
    fb.extend_prefix_lens = torch.cat([fb.extend_prefix_lens, torch.tensor([99], dtype=fb.extend_prefix_lens.dtype)])
    ours = to_mla_batch(fb, device=torch.device("cpu"), num_draft_tokens=0)
    assert ours.extend_prefix_lens.tolist() == [3, 4]


def test_a_tree_verify_replay_with_no_live_request_reads_chains():
    """A captured tree verify replayed with every row padding (spec_info.positions empty): each row a chain."""
    from types import SimpleNamespace

    from mla_fa3.integrations.sglang.convert import verify_tree

    k, bs = 3, 2
    fb = SimpleNamespace(spec_info=SimpleNamespace(custom_mask=torch.ones(bs * k * k, dtype=torch.bool),
                                                   positions=torch.zeros(0, dtype=torch.int64)))
    tree = verify_tree(fb, bs, k, torch.ones(bs, dtype=torch.int32), torch.device("cpu"))
    assert torch.equal(tree.mask, torch.ones(k, k, dtype=torch.bool).tril().expand(bs, k, k))


def test_a_draft_of_one_request_is_not_idle_and_two_steps_build_one_step_backend():
    """The multi-step draft: a batch of one request runs (its branch outputs are not the empty IDLE answer); the
    hook builds ours for 2 steps (one step backend: the last step's token needs no forward), None for 1."""
    from tests.test_sglang_draft import _draft_world, _factory, _run_draft

    from mla_fa3.integrations.sglang import plugin

    fx, backend, fb, draft_loc = _draft_world(2, 3, prefixes=(14,))
    for out, oracle, tol in _run_draft(fx, backend, fb, draft_loc):
        assert out.shape[0] == 2
        assert (out - oracle).abs().max().item() <= tol
    decode_hook, _ = plugin.DRAFT_HOOKS.values()
    runner = backend.model_runner
    two = decode_hook(lambda *a, **k: "sglang's", _factory("mla_fa3", runner=runner, steps=2))
    assert len(two.attn_backends) == 1
    assert decode_hook(lambda *a, **k: "sglang's", _factory("mla_fa3", runner=runner, steps=1)) is None
