"""MLABackend on the H200: FA3 / FlashMLA in bf16 against the NON-absorbed fp64 oracle.

Tolerance from precision (FA3's own test rule): the kernel's max error vs the fp64 oracle may be at
most twice the error of the same absorbed computation done by torch in bf16 (each op rounding to
bf16) on the same inputs, and the cosine similarity to the oracle must be >= 0.9999. The oracle sees
exactly the bf16 values the backend got (q, latent rows, W_UK / W_UV as stored).
Skipped without CUDA sm90 + sgl_kernel (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import (capture_layer_graph, check_bf16_rule, follow_up, make_batch, make_mla_case, mla_oracle,
                       padded)
from specs import NONIDLE_SPECS, SPECS, BatchSpec

from mla_fa3 import ops
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend

pytestmark = pytest.mark.gpu

BF16, DEV = torch.bfloat16, "cuda"
DEC, VER, DRAFT = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE
MIN_COSINE = 0.9999


def torch_bf16_absorbed(case) -> torch.Tensor:
    """The absorbed MLA math in plain torch, every op in bf16 (the precision baseline): [T, H, d_v]."""
    d, w = case.cfg.dims, case.layer.mla_weights
    r = d.kv_lora_rank
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        q = case.q[s:e]
        lat = case.latent[b].to(device=DEV, dtype=BF16)
        q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk)  # [H, n, r] bf16
        scores = (torch.matmul(q_lat, lat[:, :r].t()) + torch.matmul(q_rope.transpose(0, 1), lat[:, r:].t()))
        scores = scores * case.layer.scaling  # [H, n, L] bf16
        n, L = e - s, lat.shape[0]
        pos = torch.arange(L - n, L, device=DEV).unsqueeze(1)
        mask = torch.arange(L, device=DEV).unsqueeze(0) <= pos
        p = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(BF16)
        o_lat = torch.matmul(p, lat[:, :r])  # [H, n, r] bf16
        outs.append(torch.bmm(o_lat, w.w_uv).transpose(0, 1))  # [n, H, d_v] bf16
    return torch.cat(outs)


def check_precision(out: torch.Tensor, case) -> None:
    check_bf16_rule(out, mla_oracle(case), torch_bf16_absorbed(case), MIN_COSINE)


def backend_for(case, **kw) -> MLABackend:
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device=DEV, impl="fa3", prefill_path="absorbed", **kw)


def run_step(case, **kw):
    backend = backend_for(case, **kw)
    backend.init_forward_metadata(case.batch)
    out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert ops.last_impl() is ops.Impl.FA3
    return out, backend


@pytest.mark.parametrize("spec_name", NONIDLE_SPECS)
@pytest.mark.parametrize("cfg_name", ["deepseek_v3", "deepseek_v3_h128"])
def test_fa3_every_mode_vs_oracle(spec_name, cfg_name):
    case = make_mla_case(spec_name, cfg_name, dtype=BF16, device=DEV, seed=len(spec_name))
    out, backend = run_step(case)
    assert out.dtype == BF16 and torch.isfinite(out).all()
    assert backend.explain().kernel == "fa3"
    check_precision(out, case)


@pytest.mark.parametrize("spec_name", ["small_decode", "decode_page64_long", "verify_k2_page64", "draft_decode"])
@pytest.mark.parametrize("cfg_name", ["deepseek_v3", "deepseek_v3_h128"])
def test_flashmla_vs_fa3_on_page_64(spec_name, cfg_name):
    s = SPECS[spec_name]
    spec = BatchSpec(s.mode, s.prefix_lens, s.extend_lens, page_size=64)
    outs = {}
    for kernel in ("fa3", "flashmla"):
        case = make_mla_case(spec, cfg_name, dtype=BF16, device=DEV, seed=3)
        out, backend = run_step(case, decode_kernel=kernel, num_heads=case.cfg.num_heads)
        assert backend.explain().kernel == kernel
        check_precision(out, case)
        outs[kernel] = out.double()
    cos = torch.nn.functional.cosine_similarity(outs["fa3"].flatten(), outs["flashmla"].flatten(), dim=0).item()
    assert cos >= MIN_COSINE


@pytest.mark.parametrize("mode", [DEC, VER, DRAFT])
def test_decode_like_steps_do_not_sync(mode):
    k = 3 if mode is VER else 1
    case = make_mla_case(BatchSpec(mode, (30, 100, 7), (k,) * 3, page_size=16), "deepseek_v3", dtype=BF16,
                         device=DEV, seed=2)
    backend = backend_for(case)
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.init_forward_metadata(case.batch)
        out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    check_precision(out, case)


@pytest.mark.parametrize("kernel", ["fa3", "flashmla"])
@pytest.mark.parametrize("mode,k", [(DEC, 1), (VER, 2)])
def test_cuda_graph_replay_smaller_batches_vs_oracle(kernel, mode, k):
    """Capture backend.forward at bs 4 in a real CUDA graph; replay padded live batches of 3 and 2."""
    spec = BatchSpec(mode, (40, 3, 77), (k,) * 3, page_size=64)
    case = make_mla_case(spec, "deepseek_v3", dtype=BF16, device=DEV, seed=5)
    d, H, cap = case.cfg.dims, case.cfg.num_heads, 4
    backend = backend_for(case, decode_kernel=kernel, num_heads=H)
    backend.init_cuda_graph_state(cap, case.layout.req_to_token_pool.max_context, max_num_draft_tokens=k)
    # static inputs the graph reads: q, latent rows, out_cache_loc (the metadata lives in the builder's buffers)
    q_buf = torch.zeros(cap * k, H, d.qk_head_dim, dtype=BF16, device=DEV)
    lat_buf = torch.zeros(cap * k, d.latent_dim, dtype=BF16, device=DEV)
    loc_buf = torch.zeros(cap * k, dtype=torch.int64, device=DEV)
    if mode is VER:
        static = ForwardBatch.verify([0] * cap, [k] * cap, loc_buf, DEV, num_draft_tokens=k)
    else:
        static = ForwardBatch.decode([0] * cap, [1] * cap, loc_buf, DEV)
    assert static.out_cache_loc is loc_buf
    graph, out_buf = capture_layer_graph(backend, case.layer, q_buf, lat_buf, static)
    for step in (follow_up(case, mode, (40, 3, 77), (k,) * 3, requests=[0, 1, 2], seed=0, pad_to=cap),
                 follow_up(case, mode, (60, 30), (k, k), requests=[2, 0], seed=1, pad_to=cap)):
        backend.init_forward_metadata_replay_cuda_graph(step.batch)
        q_buf.copy_(padded(step.q, cap * k))
        lat_buf.copy_(padded(step.new_latent, cap * k))
        loc_buf.copy_(step.batch.out_cache_loc)
        graph.replay()
        T = step.q.shape[0]
        check_precision(out_buf[:T].clone(), step)


def test_draft_steps_on_gpu_equal_eager_decodes():
    steps, prefix = 3, (9, 70)
    spec = BatchSpec(DRAFT, prefix, (1, 1), page_size=16, reserve=steps + 1)
    case = make_mla_case(spec, "deepseek_v3", dtype=BF16, device=DEV, seed=7, reserve=steps + 1)
    d, H = case.cfg.dims, case.cfg.num_heads
    g = torch.Generator().manual_seed(3)
    draft = MultiStepDraftBackend(steps, req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                                  page_size=16, device=DEV, impl="fa3")
    draft.init_forward_metadata(case.batch)
    eager = backend_for(case)
    for i in range(steps):
        q = torch.randn(2, H, d.qk_head_dim, generator=g).to(DEV, BF16)
        lat = torch.randn(2, d.latent_dim, generator=g).to(DEV, BF16)
        loc = torch.stack([case.layout.slots[b][prefix[b] + i] for b in range(2)]).to(DEV)
        out = draft.forward(q, lat, None, case.layer, draft.step_batch(case.batch, i, loc))
        dec = make_batch(case.layout, DEC, [p + i for p in prefix], [1, 1])
        eager.init_forward_metadata(dec)
        ref = eager.forward(q, lat, None, case.layer, dec)  # rewrites the same rows
        assert torch.isfinite(out).all()
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
        assert cos >= MIN_COSINE


def test_debug_checks_catch_out_of_pool_slots_on_the_gpu():
    """On CUDA the range checks read device values, so they run under debug_checks=True (off the hot
    path by default): a slot past the pool is then a named error before any kernel or pool write."""
    case = make_mla_case("small_decode", "deepseek_v3", dtype=BF16, device=DEV, seed=3)
    row = case.layout.rows[0]
    table = case.layout.req_to_token_pool.req_to_token
    good = table[row, 0].clone()
    table[row, 0] = case.pool.num_slots + 64
    with pytest.raises(ValueError, match="page"):
        backend_for(case, debug_checks=True).init_forward_metadata(case.batch)
    table[row, 0] = good
    case.batch.out_cache_loc[0] = case.pool.num_slots + 5
    with pytest.raises(ValueError, match="out_cache_loc"):
        backend_for(case, debug_checks=True).init_forward_metadata(case.batch)
