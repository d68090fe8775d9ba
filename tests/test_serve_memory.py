"""The memory planner against what is actually allocated (pool, request table, weights) and its refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mla_fa3.models.deepseek import DeepseekForCausalLM
from mla_fa3.serve.configs import bench_config, model_config
from mla_fa3.serve.memory import GIB, MemoryPlanError, plan_memory
from mla_fa3.serve.loop import ServingLoop


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_v3_latent_row_is_576_bytes_in_fp8_and_1152_in_bf16():
    cfg = model_config("deepseek_v3_tp8")
    kw = dict(weight_dtype="fp8", page_size=64, max_context=32768, max_running=64)
    assert plan_memory(cfg, kv_dtype="fp8", **kw).kv_bytes_per_token_layer == 576
    bf16 = plan_memory(cfg, kv_dtype="bf16", **kw)
    assert bf16.kv_bytes_per_token_layer == 1152 and bf16.kv_bytes_per_token == 1152 * 61
    # fp8 KV holds twice the tokens in the same pool bytes (up to a page of rounding)
    fp8 = plan_memory(cfg, kv_dtype="fp8", **kw)
    assert abs(fp8.kv_tokens - 2 * bf16.kv_tokens) <= 2 * 64


def test_plan_matches_the_allocations_of_the_serving_loop():
    cfg = model_config("tiny")
    plan = plan_memory(cfg, gpu_memory_gib=0.05, weight_dtype="fp32", kv_dtype="fp32", page_size=4,
                       max_running=3, max_context=64, token_budget=32, prefill_workspace_tokens=16,
                       reserved_gib=0.0, headroom_fraction=0.1)
    model = DeepseekForCausalLM(cfg, dtype=torch.float32)
    model.prepare_attention()
    loop = ServingLoop(model, page_size=4, max_running=3, max_context=64, memory_plan=plan)
    assert loop.allocator.num_pages == plan.num_pages
    assert _bytes(loop.kv_pool.kv_buffer) == plan.kv_pool_bytes
    assert plan.kv_bytes_per_token_layer == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert _bytes([loop.req_to_token_pool.req_to_token]) == plan.req_to_token_bytes
    params = {id(p): p for p in list(model.parameters()) + list(model.buffers())}
    assert _bytes(params.values()) == plan.weights_bytes
    absorbed = [t for a in model.attention_layers for t in (a.mla_weights.w_uk, a.mla_weights.w_uv)]
    assert _bytes(absorbed) == plan.absorbed_bytes
    terms = plan.terms()
    assert sum(b for _, b, _ in terms) == plan.gpu_memory_bytes and min(b for _, b, _ in terms) >= 0
    assert plan.kv_tokens == (plan.num_pages - 1) * 4
    assert json.loads(plan.to_json())["kv_tokens"] == plan.kv_tokens
    with pytest.raises(ValueError, match="page_size"):
        ServingLoop(model, page_size=8, max_running=3, max_context=64, memory_plan=plan)


def test_refuses_a_configuration_that_does_not_fit():
    cfg = model_config("deepseek_v3_tp8")
    with pytest.raises(MemoryPlanError, match="weights"):  # 85B bf16 parameters on one 140 GiB GPU
        plan_memory(cfg, weight_dtype="bf16")
    with pytest.raises(MemoryPlanError, match="max_context"):
        plan_memory(bench_config(16, 4), gpu_memory_gib=2.0, max_context=1 << 20)
    with pytest.raises(ValueError, match="kv_dtype"):
        plan_memory(cfg, kv_dtype="int4")
    assert issubclass(MemoryPlanError, ValueError)


def test_more_memory_more_pages_and_terms_are_monotone():
    cfg = bench_config(16, 4)
    small, big = (plan_memory(cfg, gpu_memory_gib=g, graph_batch_sizes=[1, 8]) for g in (40.0, 80.0))
    assert big.num_pages > small.num_pages
    per_page = 64 * 4 * 1152
    gained = big.num_pages - small.num_pages
    assert abs(gained * per_page - (40 * GIB - 40 * GIB * 0.05)) <= per_page  # the headroom scales with M
    assert math.isclose(small.weights_bytes, big.weights_bytes)
