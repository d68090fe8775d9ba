"""The serving loop on the tiny DeepSeek (fp32, CPU reference kernels): continuous batching == alone.

Oracle: each request generated alone (one request, its whole prompt in one EXTEND step, then DECODE
steps), whose greedy tokens transformers reproduces (tests/test_model_hf.py). The loop runs the same
requests joining at different steps, with a small token budget (chunked prefill, MIXED steps) and a
pool too small for all of them (preemption + recompute); every request must get the same tokens.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from mla_fa3.models.loader import load_model
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint
from mla_fa3.serve.engine import Engine
from mla_fa3.serve.loop import ServingLoop
from mla_fa3.serve.scheduler import Request

_MODEL = {}


def _model():
    if "m" not in _MODEL:
        hf = random_hf_model("tiny_v2", seed=5)
        with tempfile.TemporaryDirectory() as d:
            _MODEL["m"] = load_model(save_hf_checkpoint(hf, d))
    return _MODEL["m"]


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


LENGTHS = (13, 4, 22, 9, 17, 6)
NEW = (9, 12, 6, 10, 8, 11)


def _alone(prompts, new, eos=None):
    model = _model()
    out = []
    for p, n in zip(prompts, new):
        eng = Engine(model, page_size=4, max_batch_size=1, max_context=64)
        out.append(eng.generate([p], n, eos_token_id=eos).token_ids[0])
    return out


@pytest.fixture(scope="module")
def alone_tokens():
    return _alone(_prompts(LENGTHS), NEW)


def _serve(prompts, new, *, num_pages, budget, eos=None, graphs=False):
    loop = ServingLoop(_model(), page_size=4, max_running=4, max_context=64, num_pages=num_pages,
                       token_budget=budget, use_cuda_graph=graphs, cuda_graph_batch_sizes=[1, 2, 4])
    reqs = [Request(rid=i, prompt=p, max_new_tokens=n, eos_token_id=eos, arrival=float(2 * i))
            for i, (p, n) in enumerate(zip(prompts, new))]
    loop.run(reqs, clock=lambda: float(len(loop.steps)))  # request i joins at step 2i
    return loop, reqs


@pytest.mark.parametrize("num_pages,budget,graphs", [(64, 64, False), (12, 8, False), (12, 8, True)])
def test_continuous_batching_equals_each_request_alone(alone_tokens, num_pages, budget, graphs):
    loop, reqs = _serve(_prompts(LENGTHS), NEW, num_pages=num_pages, budget=budget, graphs=graphs)
    assert [r.output for r in reqs] == alone_tokens
    modes = {s.mode for s in loop.steps}
    assert {"DECODE", "MIXED"} <= modes
    assert max(s.num_tokens for s in loop.steps) <= budget
    if num_pages == 12:  # 11 usable pages (44 tokens) for up to 4 requests of up to 28 tokens
        assert sum(r.num_preemptions for r in reqs) > 0
        assert sum(s.preempted for s in loop.steps) == sum(r.num_preemptions for r in reqs)
    if graphs:
        assert any(s.graph for s in loop.steps)
    # nothing leaked, every page zeroed on its way back
    assert loop.allocator.num_free_pages() == num_pages - 1
    assert loop.req_to_token_pool.available_size() == 4
    assert all(float(b[4:].abs().sum()) == 0.0 for b in loop.kv_pool.kv_buffer)  # page 0: graph padding rows
    for r in reqs:
        times = loop.times[r.rid]
        assert len(times.token_times) == len(r.output) and times.finish == times.token_times[-1]


def test_eos_in_continuous_batching_equals_alone():
    prompts = _prompts(LENGTHS)
    full = _alone(prompts[:3], NEW[:3])
    eos = full[0][2]
    alone = _alone(prompts[:3], NEW[:3], eos=eos)
    _, reqs = _serve(prompts[:3], NEW[:3], num_pages=40, budget=16, eos=eos)
    assert [r.output for r in reqs] == alone
    assert reqs[0].finish_reason == "eos"


def test_engine_generate_is_the_loop_with_all_requests_at_once():
    """Engine.generate (every prompt at once) == the loop's tokens for the same requests."""
    model = _model()
    prompts = _prompts((5, 11, 3), seed=8)
    res = Engine(model, page_size=4, max_batch_size=3, max_context=40, max_prefill_tokens=6).generate(prompts, 7)
    assert res.token_ids == _alone(prompts, (7, 7, 7))
