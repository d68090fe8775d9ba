"""The SGLang plugin on the CPU (our reference kernels): registration, SGLang's own attention test kit on our
backend at DeepSeek's latent dims, and the adapter's every mode against fp64 oracles written from the definition.

Oracles: ``tests/oracle.dense_attention`` (fp64) over keys built from the tensors the test made (never read back from
the pool under test); for an FP8 cache the same keys rounded to e4m3 first (SGLang's pool stores e4m3 codes with
scale 1). Tolerance from precision: the adapter's error against fp64 may be at most twice the error of rounding the
exact answer to the output dtype, plus the reference's fp32 accumulation.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle import dense_attention
from tests.sglang_world import (D_ROPE, FP8, R, TESTCASE, SGLangMode, case, check_close, kit, kit_fixture,
                                needs_sglang, run_split_form, runner_like)

pytestmark = needs_sglang

if kit is not None:
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.server_args import ServerArgs

    from mla_fa3.integrations.sglang import plugin
    from mla_fa3.integrations.sglang.adapter import SGLangMLABackend
    from mla_fa3.integrations.sglang.convert import UnsupportedStepError


# ------------------------------------------------------------------------------------------------- registration
def test_register_makes_mla_fa3_a_backend_choice():
    import argparse

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS

    plugin.register()  # idempotent: a second call adds nothing twice
    assert ATTENTION_BACKENDS["mla_fa3"] is plugin.create_backend
    for names in (ATTENTION_BACKEND_CHOICES, CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
                  FORWARD_ABSORB_CORE_ATTENTION_BACKENDS, handlers.MHA_ONE_SHOT_SUPPORTED_BACKENDS):
        assert names.count("mla_fa3") == 1
    assert handlers.AttentionBackendRegistry.get_handler("mla_fa3") is plugin.handle_attention
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "x", "--attention-backend", "mla_fa3"])
    assert args.attention_backend == "mla_fa3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "x", "--attention-backend", "mla_fa3_typo"])


def test_entry_point_is_declared():
    """SGLang finds the plugin by its entry point (the installed package's metadata)."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("mla_fa3") == "mla_fa3.integrations.sglang.plugin:register"


# ------------------------------------------------------------------------------------------------- SGLang's kit
KIT_CASES = {c.name: c for c in kit.make_mla_cases("mla_fa3")} if kit is not None else {}


@pytest.mark.parametrize("name", sorted(KIT_CASES))
def test_kit_mla_case(name):
    """SGLang's MLA attention cases (extend over prefixes across page borders, decode) at r = 512, d_rope = 64."""
    kit.run_mla_attention_case(TESTCASE, KIT_CASES[name], kv_lora_rank=R, qk_rope_head_dim=D_ROPE, device="cpu",
                               dtype=torch.bfloat16)


@pytest.mark.parametrize("name", sorted(n for n, c in KIT_CASES.items() if c.forward_mode.is_decode()))
def test_cuda_graph_protocol_decode(name):
    """SGLang's CUDA-graph decode protocol (the kit's cuda_graph_decode_runner, which needs sgl_kernel to import: it
    runs in test_sglang_gpu.py): state for bs 4, capture on fill-value rows, then a replay of the live requests
    padded to 4 gives the eager answer and the kit's reference."""
    c = KIT_CASES[name]
    eager = kit_fixture(c)
    want = kit.run_mla_fixture_eager(eager)
    fx = kit_fixture(c, runner_batch_size=4)
    backend, fill = fx.backend, fx.backend.get_cuda_graph_seq_len_fill_value()
    capture = kit.make_mla_case_with_prefix_lens(c, f"{name}_capture", (fill - 1,) * 4)
    cap_batch = kit._make_forward_batch(capture, fx.runner, max_context_len=128, device="cpu")
    cap_inputs = kit.make_mla_random_inputs(capture, fx, dtype=torch.bfloat16, device="cpu")
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
        backend.init_forward_metadata_out_graph(cap_batch, in_capture=True)
        backend.init_forward_metadata_in_graph(cap_batch)
        kit.run_mla_forward(fx, cap_batch, cap_inputs)
        pads = (fill - 1,) * (4 - c.batch_size)
        replay = kit.make_mla_case_with_prefix_lens(c, f"{name}_replay", c.prefix_lens + pads)
        inputs = kit.make_mla_padded_replay_inputs(replay, fx, pads, kit.mla_fixture_inputs(fx), dtype=torch.bfloat16,
                                                   device="cpu")
        batch = kit._make_forward_batch(replay, fx.runner, max_context_len=128, device="cpu")
        kit.prepare_mla_runner_inputs(fx, replay, batch, inputs, max_context_len=128)
        backend.init_forward_metadata_out_graph(batch)
        with pytest.raises(RuntimeError, match="in_graph"):  # the device half has not run: refused, not stale
            kit.run_mla_forward(fx, batch, inputs)
        backend.init_forward_metadata_in_graph(batch)  # what graph.replay() re-runs
        got = kit.run_mla_forward(fx, batch, inputs)
    ref = kit.expected_mla_output_from_inputs(fx, replay, inputs, None)
    torch.testing.assert_close(got, ref, atol=kit.MLA_ATOL, rtol=kit.MLA_RTOL)
    torch.testing.assert_close(got[: c.num_input_tokens], want, atol=0, rtol=0)  # same kernel, same inputs
    assert backend.explain().graph


def _verify_fixture(k: int, topk: int = 1):
    """The kit's TARGET_VERIFY batch: SGLang's seq_lens exclude the k draft tokens; spec_info carries k and topk."""
    from types import SimpleNamespace

    c = case("TARGET_VERIFY", prefix_lens=(14, 5, 30), extend_lens=(k,) * 3, name=f"verify_k{k}")
    fx = kit_fixture(c)
    fb = fx.forward_batch
    fb.seq_lens = torch.tensor(c.prefix_lens, dtype=torch.int32)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    fb.spec_info = SimpleNamespace(draft_token_num=k, topk=topk)
    return fx


@pytest.mark.parametrize("k", [1, 4])
def test_target_verify_chain(k):
    """k draft tokens per request, each seeing the prefix and the drafts before it (a chain: topk = 1)."""
    fx = _verify_fixture(k)
    torch.testing.assert_close(kit.run_mla_fixture_eager(fx), kit.expected_mla_fixture_output(fx),
                               atol=kit.MLA_ATOL, rtol=kit.MLA_RTOL)
    assert fx.backend.explain().mode == "TARGET_VERIFY"


def test_target_verify_tree_without_its_mask_is_refused():
    """topk > 1 with no custom_mask to read the tree from: a named error before any kernel, not a chain's answer."""
    with pytest.raises(UnsupportedStepError, match="custom_mask"):
        kit.run_mla_fixture_eager(_verify_fixture(4, topk=2))


# ------------------------------------------------------------------------------------------------- our oracles
SPLIT_CASES = {
    "decode_page16": dict(mode_name="DECODE", prefix_lens=(14, 15, 16, 0), page_size=16),
    "decode_page64": dict(mode_name="DECODE", prefix_lens=(63, 64, 1), page_size=64),
    "decode_page1": dict(mode_name="DECODE", prefix_lens=(5, 9), page_size=1),
    "extend_prefix": dict(mode_name="EXTEND", prefix_lens=(0, 8, 16), extend_lens=(15, 8, 1), page_size=16),
    "mixed": dict(mode_name="MIXED", prefix_lens=(7, 20), extend_lens=(5, 1), page_size=16),
}


@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_form_matches_fp64(name, dtype):
    spec = dict(SPLIT_CASES[name])
    fx = kit_fixture(case(spec.pop("mode_name"), name=name, **spec), dtype=dtype)
    check_close(*run_split_form(fx))


@pytest.mark.parametrize("name", ["decode_page16", "extend_prefix"])
def test_concatenated_form_matches_fp64(name):
    spec = dict(SPLIT_CASES[name])
    fx = kit_fixture(case(spec.pop("mode_name"), name=f"{name}_cat", **spec))
    check_close(*run_split_form(fx, concat=True))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_head_counts(tp):
    """Attention TP splits DeepSeek's 128 heads over the ranks; each rank's adapter sees 128 / tp heads and the
    whole latent cache."""
    fx = kit_fixture(case("DECODE", prefix_lens=(30, 3), page_size=16, num_heads=128 // tp, name=f"tp{tp}"))
    assert fx.backend.num_heads == 128 // tp
    check_close(*run_split_form(fx))


@pytest.mark.parametrize("page_size", [64])  # other pages are read by split-KV (Triton): test_sglang_gpu.py
def test_fp8_decode_reads_the_e4m3_pool_in_place(page_size):
    """An FP8 pool (SGLang's uint8 buffer) is read as e4m3 with scale 1, never dequantized: the answer is the fp64
    attention over the e4m3-rounded keys (the bf16 query is not rounded by split-KV; FlashMLA rounds it: a wider
    bound there, from e4m3's relative step 2^-3 on q)."""
    fx = kit_fixture(case("DECODE", prefix_lens=(40, 63, 2), page_size=page_size, name=f"fp8_{page_size}"), fp8=True)
    assert fx.runner.token_to_kv_pool.kv_buffer[0].dtype == torch.uint8
    before = [b.data_ptr() for b in fx.runner.token_to_kv_pool.kv_buffer]
    out, oracle, tol = run_split_form(fx)
    kernel = fx.backend.explain().kernel
    if kernel == "flashmla":  # q rounded to e4m3 per step
        tol = max(tol, 0.08 * oracle.abs().max().item())
    _check(out, oracle, tol) if kernel != "flashmla" else \
        torch.testing.assert_close(out, oracle, atol=tol, rtol=0)
    assert [b.data_ptr() for b in fx.runner.token_to_kv_pool.kv_buffer] == before
    assert fx.backend.mla_pool.kv_buffer[0].data_ptr() == before[0]  # our pool views SGLang's buffer


def test_the_kernel_is_told_of_the_store_only_when_the_adapter_stored(monkeypatch):
    """``follows_store`` lets split-KV read q, the page table and its schedule before it waits for the launch just
    before it: safe only when that launch is the adapter's own store (SGLang's kernels before it may still be writing
    q). The adapter says so exactly when it stored this step's rows, and the answer is the fp64 oracle's either way."""
    from mla_fa3 import absorb

    seen = []
    real = absorb.attend_latent

    def spy(*args, **kwargs):
        seen.append(kwargs.get("follows_store"))
        return real(*args, **kwargs)

    monkeypatch.setattr(absorb, "attend_latent", spy)
    fx = kit_fixture(case("DECODE", prefix_lens=(30, 3), page_size=16, name="follows_store"))
    check_close(*run_split_form(fx))
    assert seen == [True]
    c, fb, layer = fx.case, fx.forward_batch, fx.actual_module.attn_mqa
    T, H = c.num_input_tokens, c.num_heads
    q_lat = torch.randn(T, H * R, dtype=fx.runner.dtype)
    q_rope = torch.randn(T, H, D_ROPE, dtype=fx.runner.dtype)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata(fb)
        layer(q_lat, None, None, fb, q_rope=q_rope, k_rope=None, save_kv_cache=False)
        k = torch.randn(T, 1, R, dtype=fx.runner.dtype)
        layer(q_lat, k, k, fb, q_rope=q_rope, k_rope=torch.randn(T, 1, D_ROPE, dtype=fx.runner.dtype),
              save_kv_cache=False)
    assert seen == [True, False, False]


def test_idle_batch_returns_an_empty_output():
    fx = kit_fixture(case("DECODE", prefix_lens=(3,), name="idle"))
    fb = fx.forward_batch
    fb.forward_mode, fb.batch_size = SGLangMode.IDLE, 0
    H = fx.case.num_heads
    q = torch.empty(0, H * (R + D_ROPE), dtype=torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata(fb)
        out = fx.backend.forward(q, None, None, fx.actual_module.attn_mqa, fb)
        assert tuple(out.shape) == (0, H * R)
        fx.backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)  # an IDLE rank's graph-runner update
        fx.backend.init_forward_metadata_out_graph(fb)
        assert tuple(fx.backend.forward(q, None, None, fx.actual_module.attn_mqa, fb).shape) == (0, H * R)


# ------------------------------------------------------------------------------------------------- MHA calls
def test_mha_calls_merge_to_full_attention():
    """The model's chunked-prefix loop on our MHA calls: the new tokens causally (with LSE), each prefix chunk
    non-causally, merged by LSE as the model does — equals fp64 attention over prefix + new."""
    g = torch.Generator().manual_seed(1)
    fx = kit_fixture(case("EXTEND", prefix_lens=(12, 5), extend_lens=(4, 6), page_size=16, name="mha"))
    fb, H, d, dv, dtype = fx.forward_batch, fx.case.num_heads, 192, 128, torch.bfloat16
    layer = _mha_layer(H)
    pre, ext = fx.case.prefix_lens, fx.case.input_lens
    q = torch.randn(sum(ext), H, d, generator=g).to(dtype)
    k_new, v_new = torch.randn(sum(ext), H, d, generator=g).to(dtype), torch.randn(sum(ext), H, dv, generator=g).to(dtype)
    k_pre = [torch.randn(p, H, d, generator=g).to(dtype) for p in pre]
    v_pre = [torch.randn(p, H, dv, generator=g).to(dtype) for p in pre]
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata(fb)
        fb.mha_return_lse = True
        fb.set_attn_attend_prefix_cache(False)
        o, lse = fx.backend.forward(q, k_new, v_new, layer, fb, save_kv_cache=False)
        # one prefix chunk per request boundary split in two chunks: [first half of each prefix], [the rest]
        halves = [[p // 2 for p in pre], [p - p // 2 for p in pre]]
        starts = [[0, 0], [p // 2 for p in pre]]
        fb.set_attn_attend_prefix_cache(True)
        fb.prefix_chunk_cu_seq_lens = [torch.tensor([0, *torch.tensor(h).cumsum(0).tolist()], dtype=torch.int32)
                                       for h in halves]
        fb.prefix_chunk_max_seq_lens = [max(h) for h in halves]
        for i, (h, s) in enumerate(zip(halves, starts)):
            fb.prefix_chunk_idx = i
            kc = torch.cat([k_pre[b][s[b]:s[b] + h[b]] for b in range(len(pre))])
            vc = torch.cat([v_pre[b][s[b]:s[b] + h[b]] for b in range(len(pre))])
            oc, lc = fx.backend.forward(q, kc, vc, layer, fb, save_kv_cache=False)
            o, lse = _merge(o, lse, oc, lc)
    start, errs = 0, []
    for b, n in enumerate(ext):
        keys = torch.cat([k_pre[b], k_new[start:start + n]])
        vals = torch.cat([v_pre[b], v_new[start:start + n]])
        want, want_lse = dense_attention(q[start:start + n], keys, vals, scale=layer.scaling, causal=True)
        errs.append((o[start:start + n].double() - want).abs().max().item())
        torch.testing.assert_close(lse[start:start + n].double(), want_lse, atol=1e-4, rtol=0)
        start += n
    assert max(errs) < 1.5e-2  # two bf16 roundings of partial outputs (|o| <= 4) before the merge


def _merge(o_a, lse_a, o_b, lse_b):
    """LSE merge written out in fp64 (what the model's merge_state_v2 computes)."""
    lse_a, lse_b = lse_a.double(), lse_b.double()
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    return o_a.double() * w_a + o_b.double() * w_b, lse


def _mha_layer(H):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=H, head_dim=192, scaling=192 ** -0.5, num_kv_heads=H, layer_id=0,
                          v_head_dim=128)


# ------------------------------------------------------------------------------------------------- refusals
def test_refusals_at_construction():
    fx = kit_fixture(case("DECODE", prefix_lens=(3,), name="refuse"))
    SGLangMLABackend(runner_like(fx))  # the unchanged runner builds
    with pytest.raises(ValueError, match="num-draft-tokens 65"):
        SGLangMLABackend(runner_like(fx, server_args=dict(speculative_eagle_topk=4,
                                                           speculative_num_draft_tokens=65)))
    with pytest.raises(ValueError, match="serves MLA models"):
        SGLangMLABackend(runner_like(fx, use_mla_backend=False))
    with pytest.raises(ValueError, match="power of two"):
        SGLangMLABackend(runner_like(fx, page_size=3))
    with pytest.raises(ValueError, match="dcp-size 2"):
        SGLangMLABackend(runner_like(fx, server_args=dict(dcp_size=2)))


def test_refusals_per_step_name_what_was_sent():
    fx = kit_fixture(case("DECODE", prefix_lens=(3, 4), name="refuse_step"))
    fb = fx.forward_batch
    fb.forward_mode = SGLangMode.SPLIT_PREFILL
    with pytest.raises(UnsupportedStepError, match="SPLIT_PREFILL"):
        fx.backend.init_forward_metadata(fb)
    fb.forward_mode = SGLangMode.DECODE
    fb.spec_info = object()  # a draft step
    with pytest.raises(UnsupportedStepError, match="draft"):
        fx.backend.init_forward_metadata(fb)
    fb.spec_info = None
    fb.seq_lens_cpu = None
    with pytest.raises(UnsupportedStepError, match="seq_lens_cpu"):
        fx.backend.init_forward_metadata(fb)
    fb.seq_lens_cpu = fb.seq_lens.cpu()
    fx.backend.init_forward_metadata(fb)
    q = torch.zeros(2, 4 * (R + D_ROPE), dtype=torch.bfloat16)
    with pytest.raises(UnsupportedStepError, match="sinks"):
        fx.backend.forward(q, None, None, fx.actual_module.attn_mqa, fb, sinks=torch.zeros(4))


def test_fp8_prefill_is_routed_to_mha():
    """On an FP8 cache the handler sends every prefill to the MHA path; an absorbed extend is refused by name."""
    fx = kit_fixture(case("EXTEND", prefix_lens=(3,), extend_lens=(2,), page_size=64, name="fp8_ext"), fp8=True)
    with pytest.raises(UnsupportedStepError, match="MHA path"):
        kit.run_mla_fixture_eager(fx)

    class Attn:
        kv_cache_dtype = "fp8_e4m3"

    fb = fx.forward_batch
    method = plugin.handle_attention(Attn(), fb)
    assert method.name in ("MHA_ONE_SHOT", "MHA_CHUNKED_KV")
