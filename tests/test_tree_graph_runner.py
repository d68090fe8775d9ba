"""Tree steps (EAGLE topk > 1) through the GraphRunner and the multi-step draft backend, on the CPU.

The GraphRunner's CPU stand-in (no graph captured: ``run`` pads into the static buffers, replay-updates the
captured metadata and runs the step eagerly on the static views, the data path a CUDA graph replays) with a
``tree_shape`` fixed per runner: a full batch first, then smaller batches with other trees and request orders
(padded: the padding tree, ``seq_lens = n + 1``), each against the fp64 oracle that builds the whole mask
(``tree_cases.tree_oracle``) and against the eager step. ``MultiStepDraftBackend`` with a tree per step, as the
engine supplies it (one batch per step), eagerly, as one all-steps capture, and through a per-step runner.
A batch of another tree shape, or none, is refused before anything is written. The GPU twin is
``test_tree_graph_runner_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_cases import rel_err
from tree_cases import (ancestors_mask, draft_steps, make_verify_case, padded, padded_tree_batch, random_tree, sub_case,
                        tree_oracle)

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend, sglang_tree_steps
from mla_fa3.graphs.runner import GraphRunner, InputSpec
from mla_fa3.tree import DraftTree, DraftTreeError, sglang_draft_mask

TOL = 1e-5  # fp32 compute vs the fp64 oracle
VER, DRAFT = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE


def backend_kw(case, kernel: str) -> dict:
    return dict(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=case.layout.page_size,
                device=case.layout.device, num_heads=case.cfg.num_heads, mla_dims=case.cfg.dims, decode_kernel=kernel)


def input_specs(case) -> dict:
    d = case.cfg.dims
    return {"q": InputSpec((case.cfg.num_heads, d.qk_head_dim), case.q.dtype),
            "latent": InputSpec((d.latent_dim,), case.q.dtype)}


def make_runner(case, backend, mode, *, sizes=(2, 4), num_steps=1, **kw) -> GraphRunner:
    def step(batch, inputs):
        return backend.forward(inputs["q"], inputs["latent"], None, case.layer, batch)

    m, n = case.batch.tree.shape
    return GraphRunner(backend, step, batch_sizes=sizes, mode=mode, num_draft_tokens=m, num_draft_steps=num_steps,
                       max_context=case.layout.req_to_token_pool.max_context, input_specs=input_specs(case),
                       device=case.layout.device, tree_shape=(m, n), **kw)


def run_case(runner, case):
    return runner.run(case.batch, {"q": case.q, "latent": case.new_latent}).clone()


def eager(backend, case):
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q, case.new_latent, None, case.layer, case.batch)


def verify_rounds(page: int, seed: int):
    """A 4-request verify case, then 3 and 1 of its requests in other orders with other trees of the same k."""
    rng = random.Random(seed)
    case = make_verify_case([40, 3, 77, 12], [random_tree(5, rng) for _ in range(4)], page_size=page, seed=seed)
    return [case,
            sub_case(case, [2, 0, 1], [ancestors_mask(random_tree(5, rng)) for _ in range(3)]),
            sub_case(case, [3], [ancestors_mask(random_tree(5, rng))])]


@pytest.mark.parametrize("device_metadata", [True, False])
@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("splitkv", 1), ("flashmla", 64)])
def test_verify_tree_runner_pads_and_replays_like_the_oracle(kernel, page, device_metadata):
    rounds = verify_rounds(page, seed=page)
    case = rounds[0]
    backend = MLABackend(**backend_kw(case, kernel))
    runner = make_runner(case, backend, VER, device_metadata=device_metadata)
    for sub in rounds:
        out = run_case(runner, sub)
        assert rel_err(out, tree_oracle(sub)) <= TOL
        assert backend.explain().graph and backend.explain().tree == (5, 5)
        ref = eager(MLABackend(**backend_kw(case, kernel)), sub)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    buf = runner.buffers  # after the 1-request round, padded to 2: row 1 is a padding request
    assert buf.seq_lens_cpu[1] == 5 + 1 and buf.out_cache_loc[5:10].eq(0).all()
    pad = buf.tree_mask[1]
    assert pad[:, 0].all() and torch.equal(pad[:, 1:], torch.eye(5, dtype=torch.bool)[:, 1:])
    assert buf.tree_mask[1].equal(buf.padding["tree_mask"][1])  # the 3-request round's live row 1, reset


def test_tree_runner_refuses_other_shapes_and_chains_before_writing():
    rounds = verify_rounds(16, seed=3)
    case = rounds[0]
    backend = MLABackend(**backend_kw(case, "fa3"))
    runner = make_runner(case, backend, VER)
    run_case(runner, case)
    before = [t.clone() for t in (runner.buffers.seq_lens, runner.buffers.out_cache_loc, runner.buffers.tree_mask)]
    rng = random.Random(4)
    other = make_verify_case([10, 20], [random_tree(4, rng) for _ in range(2)], seed=3)  # k = 4, not 5
    chain = ForwardBatch.verify(case.batch.req_pool_indices_cpu.tolist(), case.batch.seq_lens_cpu.tolist(),
                                case.batch.out_cache_loc, "cpu", num_draft_tokens=5)
    with pytest.raises(DraftTreeError, match="captured tree shape"):
        runner.run(chain, {"q": case.q, "latent": case.new_latent})
    with pytest.raises(ValueError, match="num_draft_tokens|captured tree shape"):
        runner.run(other.batch, {"q": other.q, "latent": other.new_latent})
    after = (runner.buffers.seq_lens, runner.buffers.out_cache_loc, runner.buffers.tree_mask)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    chain_runner = GraphRunner(MLABackend(**backend_kw(case, "fa3")), lambda b, i: i["q"], batch_sizes=[4],
                               mode=VER, num_draft_tokens=5, max_context=64, input_specs=input_specs(case),
                               device="cpu")
    with pytest.raises(DraftTreeError, match="must be no tree"):
        chain_runner.run(case.batch, {"q": case.q, "latent": case.new_latent})
    with pytest.raises(DraftTreeError, match="tree_shape"):
        GraphRunner(backend, lambda b, i: None, batch_sizes=[2], mode=VER, num_draft_tokens=5, max_context=64,
                    tree_shape=(5, 6), device="cpu")
    with pytest.raises(DraftTreeError, match="tree_shape"):
        GraphRunner(backend, lambda b, i: None, batch_sizes=[2], mode=DRAFT, num_draft_tokens=3, max_context=64,
                    device="cpu")
    with pytest.raises(ValueError, match="prefix of 1"):
        GraphRunner(backend, lambda b, i: None, batch_sizes=[2], mode=VER, num_draft_tokens=5, max_context=5,
                    tree_shape=(5, 5), device="cpu")


@pytest.mark.parametrize("reparent", [False, True])
@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("splitkv", 1), ("flashmla", 64)])
def test_multi_step_draft_tree_eager_matches_oracle(kernel, page, reparent):
    """The engine hands every step's batch (its tree, its slots); each step's layer writes its branches' tokens,
    which later steps read; every step against the oracle."""
    steps = draft_steps([2, 19, 65], 3, 3, page_size=page, seed=5, reparent=reparent)
    draft = MultiStepDraftBackend(3, **backend_kw(steps[0], kernel))
    draft.init_forward_metadata([c.batch for c in steps])
    for i, c in enumerate(steps):
        out = draft.forward(c.q, c.new_latent, None, c.layer, c.batch)
        assert rel_err(out, tree_oracle(c)) <= TOL, i
    assert [r.tree for r in draft.explain()] == [(3, 9)] * 3


def test_sglang_tree_steps_builds_the_engine_batches():
    steps = draft_steps([4, 30], 2, 3, seed=6)
    bs, topk, S = 2, 2, 3
    keys = torch.stack([c.layout.token_slots(b, p, p + topk * S) for b, p in enumerate(steps[0].prefix_lens)
                        for c in steps[:1]])
    built = sglang_tree_steps(steps[0].batch.req_pool_indices_cpu.tolist(), steps[0].prefix_lens,
                              keys.view(bs, topk, S), "cpu")
    for i, (b, c) in enumerate(zip(built, steps)):
        assert torch.equal(b.out_cache_loc, c.batch.out_cache_loc) and torch.equal(b.seq_lens_cpu, c.batch.seq_lens_cpu)
        assert torch.equal(b.tree.mask_cpu, torch.from_numpy(sglang_draft_mask(bs, topk, S, i)))
        assert b.draft_step == i and b.positions.tolist() == [p + i for p in steps[0].prefix_lens for _ in range(2)]


def test_multi_step_draft_refuses_a_tree_without_its_steps():
    steps = draft_steps([4, 30], 2, 2, seed=7)
    draft = MultiStepDraftBackend(2, **backend_kw(steps[0], "fa3"))
    with pytest.raises(DraftTreeError, match="every step's batch"):
        draft.init_forward_metadata(steps[0].batch)
    with pytest.raises(ValueError, match="list of 2"):
        draft.init_forward_metadata([steps[0].batch])
    with pytest.raises(ValueError, match="step 1"):
        draft.init_forward_metadata([steps[0].batch, steps[0].batch])


def test_multi_step_draft_tree_all_steps_capture_and_replay():
    """One capture spanning every step (the tree shape fixed), replayed from the engine's step batches, padded."""
    steps = draft_steps([2, 19, 65], 3, 2, page_size=16, seed=8)
    draft = MultiStepDraftBackend(2, **backend_kw(steps[0], "splitkv"))
    draft.init_cuda_graph_state(4, steps[0].layout.req_to_token_pool.max_context, max_num_draft_tokens=3)
    captured = draft.capture_all_steps(4, tree_shape=(3, 6))
    assert all(md.tree is not None and md.batch_size == 4 for md in captured)
    batches = [padded_tree_batch(c, 4) for c in steps]  # 3 requests in the graph of 4, padded as a runner pads
    replayed = draft.replay_all_steps(batches)
    assert all(a is b for a, b in zip(captured, replayed))
    for c, batch in zip(steps, batches):
        out = draft.forward(padded(c.q, 12), padded(c.new_latent, 12), None, c.layer, batch)
        assert rel_err(out[:9], tree_oracle(c)) <= TOL


@pytest.mark.parametrize("device_metadata", [True, False])
def test_multi_step_draft_tree_through_the_runner(device_metadata):
    """A per-step runner over the multi-step backend: each step replays its own graph; a second round of fewer
    requests pads with the padding tree (key 0 only) and seq_lens n + 1."""
    steps = draft_steps([2, 19, 65], 3, 3, page_size=16, seed=9, reparent=True)
    draft = MultiStepDraftBackend(3, **backend_kw(steps[0], "fa3"))
    runner = make_runner(steps[0], draft, DRAFT, num_steps=3, device_metadata=device_metadata)
    for round_idx in ([0, 1, 2], [2]):  # 3 requests padded to 4, then 1 padded to 2
        for c in steps:
            c = c if round_idx == [0, 1, 2] else sub_case(c, round_idx)
            out = run_case(runner, c)
            assert rel_err(out, tree_oracle(c)) <= TOL
            assert draft.step(c.batch.draft_step).explain().tree == (3, 9)
    assert runner.buffers.seq_lens_cpu[1] == 9 + 1 and runner.buffers.tree_mask[1, :, 1:].sum() == 0
