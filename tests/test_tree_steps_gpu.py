"""Speculative tree steps on the GPU: every decode kernel (FA3, FlashMLA, split-KV; FP8 pool included) in bf16
against the fp64 oracle that builds the whole causal-plus-tree mask (``tree_cases.tree_oracle``), and real CUDA
graph capture / replay with the tree shape fixed per graph.

Tolerance from precision: the max error vs the fp64 oracle may be at most twice the error of the same tree step
done by torch in bf16 (each op rounding to bf16, the explicit full mask) on the same inputs, and the cosine to the
oracle >= 0.9999. FlashMLA's FP8 read rounds q (and its probabilities) to e4m3: cosine >= 0.999 and a relative
error bound as tests/test_fp8_cache_gpu.py uses. Skipped without CUDA sm90 + sgl_kernel (tests/conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_cases import check_bf16_rule, cosine, rel_err
from tree_cases import (KERNEL_PAGES, backend_for, chain, make_draft_case, make_verify_case, padded,
                        padded_tree_batch, random_tree, star, tree_of, tree_oracle)

from mla_fa3.batch import ForwardMode

pytestmark = pytest.mark.gpu

BF16, DEV = torch.bfloat16, "cuda"
VER, DRAFT = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE
MIN_COSINE = 0.9999


def torch_bf16_tree(case) -> torch.Tensor:
    """The absorbed tree step in plain torch, every op in bf16, over the explicit [m, P + n] mask: [T, H, d_v]."""
    d, w = case.cfg.dims, case.layer.mla_weights
    r, outs, row = d.kv_lora_rank, [], 0
    for b, p in enumerate(case.prefix_lens):
        m, n = case.masks[b].shape
        q = case.q[row:row + m]
        lat = case.latent[b].to(device=DEV, dtype=BF16)
        q_nope, q_rope = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk)
        s = (torch.matmul(q_lat, lat[:, :r].t()) + torch.matmul(q_rope.transpose(0, 1), lat[:, r:].t()))
        s = s * case.layer.scaling
        mask = torch.cat([torch.ones(m, p, dtype=torch.bool), case.masks[b]], 1).to(DEV)
        prob = torch.softmax(s.float().masked_fill(~mask, float("-inf")), dim=-1).to(BF16)
        outs.append(torch.bmm(torch.matmul(prob, lat[:, :r]), w.w_uv).transpose(0, 1))
        row += m
    return torch.cat(outs)


def check_precision(out: torch.Tensor, case) -> None:
    check_bf16_rule(out, tree_oracle(case), torch_bf16_tree(case), MIN_COSINE)


def run(case, **kw):
    backend = backend_for(case, **kw)
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q, case.new_latent, None, case.layer, case.batch), backend


@pytest.mark.parametrize("kernel,page", KERNEL_PAGES)
@pytest.mark.parametrize("shape", ["chain", "star", "random", "1x8", "8x1", "3x3", "8x8"])
def test_verify_tree_on_every_kernel(kernel, page, shape):
    rng = random.Random(hash((shape, page)) % 1000)
    if shape in ("chain", "star", "random"):
        k = 6
        trees = {"chain": [chain(k)] * 3, "star": [star(k)] * 3}.get(shape) or [random_tree(k, rng) for _ in range(3)]
    else:
        depth, width = map(int, shape.split("x"))
        first = tree_of(depth, width, rng)
        trees = [first] + [random_tree(len(first), rng) for _ in range(2)]
    case = make_verify_case([1, 300, 1000], trees, cfg="deepseek_v3", page_size=page, dtype=BF16, device=DEV)
    out, backend = run(case, decode_kernel=kernel)
    assert backend.explain().kernel == kernel and backend.explain().ran == kernel
    check_precision(out, case)


@pytest.mark.parametrize("kernel,page", KERNEL_PAGES)
@pytest.mark.parametrize("layout_kind,topk", [("sglang", 4), ("random", 8)])
def test_draft_tree_steps_on_every_kernel(kernel, page, layout_kind, topk):
    for step in range(3):
        case = make_draft_case([2, 257, 900], topk, 3, step, cfg="deepseek_v3", page_size=page, dtype=BF16,
                               device=DEV, layout_kind=layout_kind, seed=step)
        out, _ = run(case, decode_kernel=kernel)
        check_precision(out, case)


@pytest.mark.parametrize("kernel", ["fa3", "flashmla", "splitkv"])
def test_chain_as_tree_equals_causal_verify_on_gpu(kernel):
    causal = make_verify_case([5, 400, 999], [chain(5)] * 3, via="chain", cfg="deepseek_v3", page_size=64,
                              dtype=BF16, device=DEV, seed=4)
    tree = make_verify_case([5, 400, 999], [chain(5)] * 3, via="parents", cfg="deepseek_v3", page_size=64,
                            dtype=BF16, device=DEV, seed=4)
    out_c, _ = run(causal, decode_kernel=kernel)
    out_t, _ = run(tree, decode_kernel=kernel)
    check_precision(out_c, causal)
    check_precision(out_t, tree)


@pytest.mark.parametrize("kernel", ["flashmla", "splitkv"])
def test_fp8_pool_tree_step(kernel):
    rng = random.Random(6)
    case = make_verify_case([9, 333, 1000], [random_tree(6, rng) for _ in range(3)], cfg="deepseek_v3",
                            page_size=64, dtype=BF16, device=DEV, kv_dtype=torch.float8_e4m3fn)
    out, backend = run(case, decode_kernel=kernel)
    assert backend.explain().kv_dtype == "float8_e4m3fn" and backend.explain().kernel == kernel
    scale = float(case.pool.layer_scale(1))
    for b, p in enumerate(case.prefix_lens):  # the rows as the pool holds them
        slots = case.layout.token_slots(b, 0, p + case.num_keys).to(DEV)
        case.latent[b] = (case.pool.kv_buffer[1][slots].float() * scale).cpu()
    ref = tree_oracle(case, latent_dtype=torch.float32)
    assert torch.isfinite(out).all()
    if kernel == "splitkv":  # q is not rounded: the bf16 rule
        assert cosine(out, ref) >= MIN_COSINE
    else:
        assert cosine(out, ref) >= 0.999 and rel_err(out, ref) <= 0.08


@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("splitkv", 1), ("flashmla", 64)])
@pytest.mark.parametrize("mode", [VER, DRAFT])
def test_tree_graph_capture_and_replay(kernel, page, mode):
    """A real CUDA graph of one MLA layer's tree step (bs 4, the tree shape fixed), for two cases (3 and 2 live
    requests padded to 4, other trees and lengths; each case brings its own pools, so its own backend), replayed
    twice: each replay meets the precision rule and agrees with the eager step (a cosine: the eager step runs at 3
    or 2 requests, the graph at 4, so split counts may differ)."""
    rng = random.Random(7)
    if mode is VER:
        cases = [make_verify_case([40, 300, 77], [random_tree(5, rng) for _ in range(3)], cfg="deepseek_v3",
                                  page_size=page, dtype=BF16, device=DEV, seed=1)]
        cases.append(make_verify_case([600, 30], [random_tree(5, rng) for _ in range(2)], cfg="deepseek_v3",
                                      page_size=page, dtype=BF16, device=DEV, seed=1))
    else:
        cases = [make_draft_case([40, 300, 77], 3, 3, 1, cfg="deepseek_v3", page_size=page, dtype=BF16, device=DEV,
                                 seed=1, layout_kind="random")]
        cases.append(make_draft_case([600, 30], 3, 3, 1, cfg="deepseek_v3", page_size=page, dtype=BF16, device=DEV,
                                     seed=1, layout_kind="random"))
    for case in cases:  # each case brings its pools: one backend and graph per case, two replays each
        m, n = case.batch.tree.shape
        backend = backend_for(case, decode_kernel=kernel)
        backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context, max_num_draft_tokens=m)
        static = padded_tree_batch(case, 4)
        q_buf, lat_buf = padded(case.q, 4 * m), padded(case.new_latent, 4 * m)
        backend.init_forward_metadata_capture_cuda_graph(static)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                backend.forward(q_buf, lat_buf, None, case.layer, static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out_buf = backend.forward(q_buf, lat_buf, None, case.layer, static)
        for _ in range(2):
            backend.init_forward_metadata_replay_cuda_graph(static)
            graph.replay()
            torch.cuda.synchronize()
            T = case.q.shape[0]
            check_precision(out_buf[:T].clone(), case)
            eager, _ = run(case, decode_kernel=kernel)
            assert cosine(out_buf[:T], eager) >= 0.99999
