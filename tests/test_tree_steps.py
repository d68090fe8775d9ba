"""Speculative tree steps (EAGLE topk > 1) on the CPU: TARGET_VERIFY trees and DRAFT_DECODE branch steps on every
decode kernel's reference, against an fp64 oracle that builds the whole causal-plus-tree mask itself
(``tree_cases.tree_oracle``), over shuffled pages poisoned with NaN (unused slots, the tail of each row, the
padding page, a draft's future keys, stale ``req_to_token`` columns). CUDA-graph capture / replay of the
metadata with the tree shape fixed per graph (the CPU stand-in, as tests/test_backend.py does for the chain).
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_cases import rel_err
from tree_cases import (KERNEL_PAGES, backend_for, chain, make_draft_case, make_verify_case, padded,
                        padded_tree_batch, random_tree, star, tree_of, tree_oracle)

from mla_fa3.batch import ForwardMode
from mla_fa3.policy.paths import DecodeKernel

TOL = 1e-5  # fp32 compute vs the fp64 oracle
VER, DRAFT = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE


def run(case, batch=None, q=None, new=None, **kw):
    backend = backend_for(case, **kw)
    batch = case.batch if batch is None else batch
    backend.init_forward_metadata(batch)
    out = backend.forward(case.q if q is None else q, case.new_latent if new is None else new, None, case.layer,
                          batch)
    return out, backend


def trees_for(shape: str, k_hint: int, bs: int, rng: random.Random) -> list[list[int]]:
    """``bs`` different trees of one size k (a verify step's k is fixed across requests)."""
    if shape == "chain":
        return [chain(k_hint)] * bs
    if shape == "star":
        return [star(k_hint)] * bs
    if shape == "random":
        return [random_tree(k_hint, rng) for _ in range(bs)]
    depth, width = map(int, shape.split("x"))
    first = tree_of(depth, width, rng)
    k = len(first)
    return [first] + [random_tree(k, rng) for _ in range(bs - 1)]  # different trees, one k


SHAPES = ["chain", "star", "random", "1x1", "1x8", "8x1", "2x4", "3x3", "4x2", "8x8"]


@pytest.mark.parametrize("kernel,page", KERNEL_PAGES)
@pytest.mark.parametrize("shape", SHAPES)
def test_verify_tree_matches_fp64_oracle(kernel, page, shape):
    """Depth 1-8, width 1-8 (chains, stars, random trees, EAGLE-shaped ones), a different tree per request, page
    sizes 1/16/64, on every decode kernel; the prefix part on the kernel, the tree part, merged by LSE."""
    rng = random.Random(hash((shape, page)) % 1000)
    trees = trees_for(shape, 6, 3, rng)
    case = make_verify_case([1, 23, 70], trees, page_size=page, seed=len(trees[0]))
    out, backend = run(case, decode_kernel=kernel)
    assert rel_err(out, tree_oracle(case)) <= TOL
    rec = backend.explain()
    assert rec.mode == "TARGET_VERIFY" and rec.kernel == kernel and rec.tree == (len(trees[0]),) * 2
    assert "tree" in rec.summary()


@pytest.mark.parametrize("via", ["parents", "mask", "sglang"])
def test_tree_forms_give_one_answer(via):
    """A parent array, a [bs, k, k] mask and SGLang's flat FULL_MASK custom_mask describe the same trees."""
    rng = random.Random(3)
    trees = [random_tree(7, rng) for _ in range(4)]
    case = make_verify_case([4, 9, 31, 64], trees, via=via, seed=2)
    out, _ = run(case)
    assert rel_err(out, tree_oracle(case)) <= TOL


@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("splitkv", 1), ("flashmla", 64)])
def test_chain_as_tree_equals_causal_verify(kernel, page):
    """topk = 1: a chain given as a tree and today's causal verify (no tree) give the same answer, both the
    oracle's; the causal one plans no tree."""
    causal = make_verify_case([5, 40, 66], [chain(5)] * 3, via="chain", page_size=page, seed=4)
    as_tree = make_verify_case([5, 40, 66], [chain(5)] * 3, via="parents", page_size=page, seed=4)
    out_c, be_c = run(causal, decode_kernel=kernel)
    out_t, be_t = run(as_tree, decode_kernel=kernel)
    assert be_c.explain().tree is None and be_c.forward_metadata.tree is None
    assert be_t.explain().tree == (5, 5)
    assert rel_err(out_c, tree_oracle(causal)) <= TOL and rel_err(out_t, tree_oracle(as_tree)) <= TOL
    assert rel_err(out_t, out_c.double()) <= TOL


def test_tree_metadata_is_the_prefix_and_the_tree_keys():
    """The step metadata is the prefix's (cache_seqlens = seq_lens - k, m query rows, no causal FA3 schedule);
    tree.key_slots are the slots of each row's last k columns (= out_cache_loc for verify)."""
    rng = random.Random(0)
    case = make_verify_case([3, 17], [random_tree(4, rng) for _ in range(2)], page_size=16)
    _, backend = run(case)
    md = backend.forward_metadata
    assert md.cache_seqlens.tolist() == [3, 17] and md.max_seqlen_q == 4 and md.cu_seqlens_q.tolist() == [0, 4, 8]
    assert torch.equal(md.tree.key_slots.reshape(-1), case.batch.out_cache_loc)
    assert backend.step_plan.fa3_schedule is None


@pytest.mark.parametrize("kernel,page", KERNEL_PAGES)
@pytest.mark.parametrize("layout_kind,topk,steps", [("sglang", 1, 3), ("sglang", 4, 3), ("sglang", 8, 2),
                                                     ("random", 2, 4), ("random", 4, 5)])
def test_draft_decode_tree_steps_match_oracle(kernel, page, layout_kind, topk, steps):
    """DRAFT_DECODE with topk branches per step: every step of a multi-step draft, in SGLang's layout (future
    draft keys in the row hold poison, masked out) and with random branch ancestry."""
    for step in range(steps):
        case = make_draft_case([2, 19, 65], topk, steps, step, page_size=page, layout_kind=layout_kind, seed=step)
        out, backend = run(case, decode_kernel=kernel)
        assert rel_err(out, tree_oracle(case)) <= TOL, step
        assert backend.explain().mode == "DRAFT_DECODE" and backend.explain().tree == (topk, case.num_keys)


def test_softcap_layer_runs_the_tree_on_fa3():
    rng = random.Random(5)
    case = make_verify_case([8, 30], [random_tree(5, rng) for _ in range(2)], logit_cap=2.0, page_size=64)
    out, _ = run(case, decode_kernel="flashmla")  # a softcap layer routes to FA3
    assert rel_err(out, tree_oracle(case)) <= TOL


def test_fp8_pool_tree_step_reads_e4m3_rows():
    """An e4m3 latent pool: the prefix part on split-KV (e4m3 tiles, q unrounded), the tree part dequantized;
    the oracle is given the rows the pool holds (dequantized)."""
    fp8 = torch.float8_e4m3fn
    rng = random.Random(6)
    case = make_verify_case([9, 33], [random_tree(6, rng) for _ in range(2)], kv_dtype=fp8, page_size=16)
    out, backend = run(case, decode_kernel="splitkv")
    assert backend.explain().kernel == "splitkv" and backend.explain().kv_dtype == "float8_e4m3fn"
    pool, scale = case.pool, float(case.pool.layer_scale(1))
    for b, p in enumerate(case.prefix_lens):  # the true rows as stored: e4m3 * scale
        slots = case.layout.token_slots(b, 0, p + case.num_keys)
        case.latent[b] = pool.kv_buffer[1][slots].float() * scale
    assert rel_err(out, tree_oracle(case, latent_dtype=torch.float32)) <= TOL


# ---------------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("splitkv", 1), ("flashmla", 64)])
@pytest.mark.parametrize("mode", [VER, DRAFT])
def test_graph_capture_then_replay_of_tree_steps(kernel, page, mode):
    """CPU stand-in for graph replay: a tree graph captured at bs 4 (shape fixed), replayed by padded batches with
    other trees, lengths and request orders; the stale rows of a larger replay do not leak into a smaller one."""
    rng = random.Random(7)
    if mode is VER:
        cases = [make_verify_case([40, 3, 77], [random_tree(5, rng) for _ in range(3)], page_size=page, seed=1),
                 make_verify_case([60, 30], [random_tree(5, rng) for _ in range(2)], page_size=page, seed=2)]
    else:
        cases = [make_draft_case([40, 3, 77], 3, 3, 1, page_size=page, seed=1),
                 make_draft_case([60, 30], 3, 3, 1, page_size=page, seed=2, layout_kind="sglang")]
    m, n = cases[0].batch.tree.shape
    for case in cases:  # one backend per case (its pools), the same capture and replays
        backend = backend_for(case, decode_kernel=kernel)
        backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context, max_num_draft_tokens=m)
        captured = backend.init_forward_metadata_capture_cuda_graph(4, mode, num_draft_tokens=m, tree_shape=(m, n))
        assert captured.tree is not None and backend.explain().graph and backend.explain().tree == (m, n)
        for pad_first in (True, False):
            batch = padded_tree_batch(case, 4)
            if pad_first:  # a larger live batch first: its rows must not leak into the next replay
                md = backend.init_forward_metadata_replay_cuda_graph(batch)
            md = backend.init_forward_metadata_replay_cuda_graph(batch)
            assert md is captured
            out = backend.forward(padded(case.q, 4 * m), padded(case.new_latent, 4 * m), None, case.layer, batch)
            T = case.q.shape[0]
            assert rel_err(out[:T], tree_oracle(case)) <= TOL


def test_chain_and_tree_graphs_coexist_and_refuse_each_other():
    rng = random.Random(8)
    tree_case = make_verify_case([10, 20], [random_tree(4, rng) for _ in range(2)], seed=3)
    chain_case = make_verify_case([10, 20], [chain(4)] * 2, via="chain", seed=3)
    backend = backend_for(tree_case)
    backend.init_cuda_graph_state(2, tree_case.layout.req_to_token_pool.max_context, max_num_draft_tokens=4)
    backend.init_forward_metadata_capture_cuda_graph(2, VER, num_draft_tokens=4)
    with pytest.raises(ValueError, match="fits no captured|not captured"):  # no tree graph yet
        backend.init_forward_metadata_replay_cuda_graph(tree_case.batch)
    backend.init_forward_metadata_capture_cuda_graph(2, VER, num_draft_tokens=4, tree_shape=(4, 4))
    md = backend.init_forward_metadata_replay_cuda_graph(tree_case.batch)
    assert md.tree is not None
    out = backend.forward(tree_case.q, tree_case.new_latent, None, tree_case.layer, tree_case.batch)
    assert rel_err(out, tree_oracle(tree_case)) <= TOL
    md = backend.init_forward_metadata_replay_cuda_graph(chain_case.batch)
    assert md.tree is None and backend.explain().tree is None
    other = make_verify_case([10, 20], [random_tree(3, rng) for _ in range(2)], seed=3)
    with pytest.raises(ValueError, match="fits no captured|not captured"):  # another tree shape
        backend.init_forward_metadata_replay_cuda_graph(other.batch)


def test_tree_over_the_captured_size_is_refused():
    rng = random.Random(9)
    case = make_verify_case([10, 20], [random_tree(6, rng) for _ in range(2)])
    backend = backend_for(case)
    backend.init_cuda_graph_state(2, case.layout.req_to_token_pool.max_context, max_num_draft_tokens=4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        backend.init_forward_metadata_capture_cuda_graph(2, VER, num_draft_tokens=6, tree_shape=(6, 6))
    with pytest.raises(ValueError, match="tree_shape"):
        backend.init_forward_metadata_capture_cuda_graph(2, VER, num_draft_tokens=4, tree_shape=(4, 5))


def test_kernels_of_a_tree_step_are_the_ones_asked_for():
    rng = random.Random(10)
    case = make_verify_case([10, 20], [random_tree(4, rng) for _ in range(2)], page_size=64)
    for kernel in DecodeKernel:
        _, backend = run(case, decode_kernel=kernel.value)
        assert backend.step_plan.kernel is kernel
