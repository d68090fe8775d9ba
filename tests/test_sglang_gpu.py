"""The SGLang plugin on the GPU (FA3 / FlashMLA / split-KV): SGLang's own attention kit — its MLA cases and its runner
modes (CUDA-graph decode, target verify eager and under graphs) — on ``mla_fa3`` and on SGLang's ``fa3`` with the same
cases at DeepSeek's latent dims; the FP8 cache read in place against an fp64 oracle over the e4m3-rounded keys; a
real CUDA graph of the adapter's decode replayed with new lengths."""

from __future__ import annotations

import pytest
import torch

from tests.sglang_world import D_ROPE, R, TESTCASE, case, check_close, kit, kit_fixture, needs_sglang, run_split_form

pytestmark = [pytest.mark.gpu, needs_sglang]

BACKENDS = ["mla_fa3", "fa3"]
KIT_NAMES = sorted(c.name for c in kit.make_mla_cases("mla_fa3")) if kit is not None else []


def _kit_case(name, backend):
    return {c.name: c for c in kit.make_mla_cases(backend)}[name]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", KIT_NAMES)
def test_kit_mla_case_gpu(name, backend):
    kit.run_mla_attention_case(TESTCASE, _kit_case(name, backend), kv_lora_rank=R, qk_rope_head_dim=D_ROPE,
                               device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [n for n in KIT_NAMES if "decode" in n])
def test_kit_cuda_graph_decode_gpu(name, backend):
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

    cg.run_mla_cuda_graph_decode_case(TESTCASE, _kit_case(name, backend), kv_lora_rank=R, qk_rope_head_dim=D_ROPE,
                                      device="cuda", dtype=torch.bfloat16)


# SGLang's own fa3 fails these kit cases at DeepSeek's dims (H100, SGLang 0.5.17, sgl-kernel 0.4.5, 2026-12-07:
# docs/perf/2026-12-07/h100-run2/run16-sglang_tree.txt); strict, so that a fixed release shows
_FA3_FAILS = pytest.mark.xfail(strict=True, reason="SGLang's fa3 backend fails this kit case itself (topk 2 verify: "
                               "81 of 384 values off, max |Δ| 0.64; EAGLE draft graph at page 16: 2 of 9 off)")


@pytest.mark.parametrize("backend,topk", [("mla_fa3", 1), ("mla_fa3", 2), ("fa3", 1),
                                          pytest.param("fa3", 2, marks=_FA3_FAILS)])
@pytest.mark.parametrize("graph", [False, True])
def test_kit_target_verify_gpu(backend, graph, topk):
    """The kit's EAGLE verify, a chain (topk 1) or its draft tree (topk 2: a root and two branches, FULL_MASK)."""
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as tv

    c = case("TARGET_VERIFY", prefix_lens=(14, 5), extend_lens=(3, 3), backend=backend, name=f"verify_{backend}")
    run = tv.run_mla_eagle_verify_cuda_graph_case if graph else tv.run_mla_eagle_verify_case
    run(TESTCASE, c, topk=topk, kv_lora_rank=R, qk_rope_head_dim=D_ROPE, device="cuda", dtype=torch.bfloat16)


# The kit's EAGLE draft case compares the graph replay's draft tokens with an eager run's, exactly. At topk 2, page 1
# they differ in 1-2 of 15 values, always for the second of the three requests, on ours and on SGLang's own fa3 (the
# same data: tools/draft_graph_probe.py; here fa3's case name seeds other data, which passes). The cause is SGLang's
# (docs/PERFORMANCE_HISTORY.md "Inside SGLang, tenth run"): its store kernel ignores the stride of the per-step slot
# vector, so the kit's model stores draft rows at wrong slots in both runs, and the padded replay's reach
# request 1's. On the CPU SGLang's torch store honours strides and the runner passes (tests/test_sglang_draft.py). Our
# own store had the same blind spot and reads the stride now (tests/test_store_rows.py).
_UPSTREAM_STORE = ("SGLang's store kernel (set_mla_kv_buffer_kernel) reads the per-step out_cache_loc its EAGLE draft "
                   "hands it (per_step_draft_out_cache_loc: a view of stride num_steps) as contiguous, so the kit's "
                   "model stores the draft rows at other steps' slots, and the padded replay's at request 1's too "
                   "(located 2026-12-07, tenth run: tools/draft_graph_probe.py --guard; fa3 the same)")
_DRAFT_GRAPH = pytest.mark.xfail(strict=True, reason="upstream: the kit's topk-2 draft replay with a padding row "
                                 "differs from its eager run in 1-2 of 15 draft values. " + _UPSTREAM_STORE)
_DRAFT_ATTENTION = pytest.mark.xfail(strict=True, reason="upstream: at draft step 0 request 1's attention output "
                                     "differs between the eager run and the padded replay because the pool it reads "
                                     "does (ours is within 0.014 of fp64 over it in both). " + _UPSTREAM_STORE)


@pytest.mark.parametrize("backend,topk,page_size", [("mla_fa3", 1, 16),
                                                    pytest.param("mla_fa3", 2, 1, marks=_DRAFT_GRAPH),
                                                    ("fa3", 2, 1), pytest.param("fa3", 1, 16, marks=_FA3_FAILS)])
def test_kit_eagle_draft_gpu(backend, topk, page_size):
    """The kit's EAGLE multi-step draft under its CUDA-graph runner: the draft backend SGLang's DraftBackendFactory
    builds (for mla_fa3: ours, through the plugin's HookRegistry route), topk 1 (a chain) and 2 (branches). The kit
    lays branches out linearly and refuses topk > 1 at page > 1 (for every backend); our page-aligned branches at
    page 16 are tested in test_sglang_draft.py and tests/test_tree_steps_gpu.py."""
    _run_kit_draft(backend, topk, page_size)


@_DRAFT_GRAPH
@pytest.mark.parametrize("kernel", ["auto", "fa3", "splitkv"])
def test_kit_eagle_draft_gpu_with_fa3_pinned_to_one_split(monkeypatch, kernel):
    """The topk-2, page-1 draft with FA3 pinned to one split wherever it plans its own (the tree's prefix part) and
    the prefix part's kernel fixed (``kernel``: ``MLA_FA3_DECODE_KERNEL``): the graph replay then repeats the eager
    step's arithmetic kernel for kernel, and the kit's draft tokens must match exactly. Unpinned, FA3 sizes its splits
    by the page table's width (the batch's in an eager step, the whole context in a graph)."""
    import sgl_kernel.flash_attn as fa

    from mla_fa3.integrations.sglang.adapter import DECODE_KERNEL_ENV

    monkeypatch.setenv(DECODE_KERNEL_ENV, kernel)

    def pinned(unpinned):
        def one_split(*args, **kwargs):
            kwargs["num_splits"] = 1
            return unpinned(*args, **kwargs)
        return one_split

    for name in ("flash_attn_with_kvcache", "get_scheduler_metadata"):
        monkeypatch.setattr(fa, name, pinned(getattr(fa, name)))
    _run_kit_draft("mla_fa3", 2, 1)


@_DRAFT_ATTENTION
def test_kit_eagle_draft_attention_eager_vs_graph(monkeypatch):
    """The kit's topk-2, page-1 draft case with every draft step's attention inputs (the queries) and output (ours,
    per step and layer) copied into buffers of their own — in the graph run those copies are captured, so each replay
    rewrites them. Wherever the live rows' queries of the eager run and of the graph replay are equal (step 0 always:
    both runs start from the same inputs; a later step while the draft tokens before it agree), their attention
    outputs must agree to bf16 rounding. A failure names the first step, layer and row that differ."""
    from mla_fa3.integrations.sglang import draft

    runs: list[dict] = []  # one dict per draft pool (the kit's eager fixture first, then the graph one)
    seen: dict[int, dict] = {}
    absorbed = draft.SGLangDraftStepBackend._forward_absorbed

    def recording(self, q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope):
        out = absorbed(self, q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope)
        store = seen.setdefault(id(self.req_to_token_pool), {})
        if not store:
            runs.append(store)
        key = (self.step, int(layer.layer_id))
        parts = (q, out) if q_rope is None else (torch.cat([q.flatten(1), q_rope.flatten(1)], dim=1), out)
        if key not in store:  # allocated at the first call (a warm-up, before any capture)
            store[key] = tuple(torch.empty_like(t) for t in parts)
        for buf, t in zip(store[key], parts):
            buf.copy_(t)
        return out

    monkeypatch.setattr(draft.SGLangDraftStepBackend, "_forward_absorbed", recording)
    try:
        _run_kit_draft("mla_fa3", 2, 1)
    except AssertionError:
        pass  # the kit's own token comparison (test_kit_eagle_draft_gpu); here the attention is compared
    torch.cuda.synchronize()
    assert len(runs) == 2, f"expected the kit's eager and graph fixtures, saw {len(runs)} pools"
    eager, graph = runs
    live = 3 * 2  # the case's 3 requests x topk 2 branches (the graph's padding rows follow)
    compared = []
    for key in sorted(eager):
        (qa, oa), (qb, ob) = eager[key], graph[key]
        same_q = torch.equal(qa[:live], qb[:live])
        assert same_q or key[0] > 0, f"draft step 0, layer {key[1]}: the two runs' queries differ (the kit's inputs?)"
        if not same_q:
            continue
        a, b = oa[:live].float(), ob[:live].float()
        diff = (a - b).abs().amax(dim=-1)
        row = int(diff.argmax())
        assert diff.max().item() <= 2e-2 * max(a.abs().max().item(), 1.0), (
            f"draft step {key[0]}, layer {key[1]}, same queries: eager and graph attention differ, most at row {row} "
            f"(request {row // 2}, branch {row % 2}) by {diff.max().item():.4g}")
        compared.append(key)
    assert any(step == 0 for step, _ in compared)


def _run_kit_draft(backend, topk, page_size):
    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_runner as dr

    c = case("DECODE", prefix_lens=(14, 5, 30), page_size=page_size, backend=backend,
             name=f"draft_{backend}_{topk}_{page_size}")
    dr.run_mla_eagle_draft_cuda_graph_runner_case(TESTCASE, c, topk=topk, speculative_num_steps=3,
                                                  speculative_num_draft_tokens=4 if topk > 1 else 3,
                                                  kv_lora_rank=R, qk_rope_head_dim=D_ROPE, device="cuda",
                                                  dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kit_draft_extend_v2_cuda_graph_gpu(backend):
    """The kit's DRAFT_EXTEND_V2 (a fixed window of 3 tokens per request) eager and captured / replayed with padding
    rows, on the backend itself (for mla_fa3: the chain verify's shape)."""
    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_extend_runner as de

    c = case("DRAFT_EXTEND_V2", prefix_lens=(14, 5, 30), extend_lens=(3, 3, 3), backend=backend,
             name=f"draft_extend_{backend}")
    de.run_mla_draft_extend_v2_cuda_graph_case(TESTCASE, c, kv_lora_rank=R, qk_rope_head_dim=D_ROPE, device="cuda",
                                               dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk,page_size", [(1, 16), (2, 1)])
def test_kit_eagle_draft_extend_runner_gpu(backend, topk, page_size):
    """SGLang's production draft-extend CUDA-graph runner (EAGLEDraftExtendV2CudaGraphRunner) over the backend
    DraftBackendFactory builds for the draft's extend (for mla_fa3: ours, through the plugin's route)."""
    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_extend_runner as de

    c = case("DRAFT_EXTEND_V2", prefix_lens=(14, 5, 30), extend_lens=(4, 4, 4), page_size=page_size, backend=backend,
             name=f"draft_extend_runner_{backend}_{topk}_{page_size}")
    de.run_mla_eagle_draft_extend_v2_cuda_graph_runner_case(TESTCASE, c, topk=topk, kv_lora_rank=R,
                                                            qk_rope_head_dim=D_ROPE, device="cuda",
                                                            dtype=torch.bfloat16)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kernel", ["auto", "splitkv", "flashmla"])
def test_fp8_decode_gpu(page_size, kernel, monkeypatch):
    """SGLang's uint8 FP8 pool read in place by FlashMLA FP8 (q rounded to e4m3: a bound from its step) or split-KV
    (q kept in bf16: the precision-derived bound)."""
    if kernel == "flashmla" and page_size != 64:
        pytest.skip("FlashMLA reads pages of 64")
    monkeypatch.setenv("MLA_FA3_DECODE_KERNEL", kernel)
    fx = kit_fixture(case("DECODE", prefix_lens=(700, 63, 2, 1500), page_size=page_size, num_heads=16,
                          name=f"fp8_{kernel}_{page_size}"), device="cuda", fp8=True, max_context_len=2048)
    out, oracle, tol = run_split_form(fx)
    ran = fx.backend.explain().kernel
    if ran == "flashmla":
        torch.testing.assert_close(out, oracle, atol=0.08 * oracle.abs().max().item(), rtol=0)
    else:
        check_close(out, oracle, 2 * tol)  # bf16 output of an fp32-accumulated kernel: twice the reference's bound


@pytest.mark.parametrize("num_heads", [16, 128])
def test_split_form_gpu_matches_fp64(num_heads):
    fx = kit_fixture(case("DECODE", prefix_lens=(1000, 64, 1, 333), page_size=64, num_heads=num_heads,
                          name=f"split_gpu_{num_heads}"), device="cuda", max_context_len=1024)
    out, oracle, tol = run_split_form(fx)
    check_close(out, oracle, 2 * tol)


def test_real_cuda_graph_replay_with_new_lengths():
    """The adapter's decode captured in a torch.cuda.graph at bs 4, replayed for 3 live requests of other lengths:
    the eager answer of the same step, and no tensor allocated inside the replayed step."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    c = case("DECODE", prefix_lens=(100, 37, 64), page_size=64, num_heads=16, name="graph_real")
    fx = kit_fixture(c, device="cuda", max_context_len=512, runner_batch_size=4)
    backend, layer = fx.backend, fx.actual_module.attn_mqa
    H = c.num_heads
    pad = kit.make_mla_case_with_prefix_lens(c, "graph_pad", c.prefix_lens + (0,))
    batch = kit._make_forward_batch(pad, fx.runner, max_context_len=512, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, H * (R + D_ROPE), device="cuda", generator=g, dtype=torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
        backend.init_forward_metadata_in_graph(batch)
        layer(q, None, None, batch, save_kv_cache=False)  # warm-up (Triton compiles, FA3 loads)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.init_forward_metadata_in_graph(batch)  # SGLang's runner captures it before the layers
            out = layer(q, None, None, batch, save_kv_cache=False)
        for lens in [(100, 37, 64), (7, 200, 1), (300, 300, 300)]:
            step = kit.make_mla_case_with_prefix_lens(c, "graph_step", tuple(lens) + (0,))
            live = kit._make_forward_batch(step, fx.runner, max_context_len=512, device="cuda")
            backend.init_forward_metadata_out_graph(live)
            graph.replay()
            got = out.clone()
            backend.init_forward_metadata(live)
            want = layer(q, None, None, live, save_kv_cache=False)
            torch.testing.assert_close(got[:3], want[:3], atol=2e-2, rtol=2e-2)
