"""GPU twin of ``test_tree_graph_runner.py``: the GraphRunner with a tree shape fixed per runner captures real CUDA
graphs of tree steps (TARGET_VERIFY trees; a multi-step draft tree, one graph per step and size) and replays them
for smaller batches with other trees and request orders; every replay meets the precision rule of
``test_tree_steps_gpu.py`` (bf16: at most twice the torch-bf16 error vs the fp64 full-mask oracle, cosine >=
0.9999), and a run's host part (check, pad, metadata update) never syncs. Skipped without CUDA sm90 + sgl_kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from test_tree_graph_runner import backend_kw, make_runner
from test_tree_steps_gpu import check_precision
from tree_cases import ancestors_mask, draft_steps, make_verify_case, random_tree, sub_case

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend

pytestmark = pytest.mark.gpu

BF16, DEV = torch.bfloat16, "cuda"


def replay(runner, case):
    key = None
    with runner.no_sync_check():
        key = runner.prepare(case.batch, {"q": case.q, "latent": case.new_latent})
    return runner.replay(key)[: case.q.shape[0]].clone()


@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("fa3", 64), ("splitkv", 1), ("flashmla", 64)])
def test_verify_tree_graphs_replay_smaller_batches(kernel, page):
    rng = random.Random(page)
    case = make_verify_case([40, 300, 777, 12], [random_tree(6, rng) for _ in range(4)], cfg="deepseek_v3",
                            page_size=page, dtype=BF16, device=DEV, seed=3)
    backend = MLABackend(**backend_kw(case, kernel))
    runner = make_runner(case, backend, ForwardMode.TARGET_VERIFY)
    rounds = [case, sub_case(case, [2, 0, 1], [ancestors_mask(random_tree(6, rng)) for _ in range(3)]),
              sub_case(case, [3], [ancestors_mask(random_tree(6, rng))]), case]
    for sub in rounds:
        out = replay(runner, sub)
        assert backend.explain().graph and backend.explain().tree == (6, 6)
        check_precision(out, sub)


@pytest.mark.parametrize("kernel,page", [("fa3", 16), ("splitkv", 1), ("flashmla", 64)])
def test_multi_step_draft_tree_graphs(kernel, page):
    steps = draft_steps([2, 257, 900], 4, 3, cfg="deepseek_v3", page_size=page, dtype=BF16, device=DEV, seed=5,
                        reparent=True)
    draft = MultiStepDraftBackend(3, **backend_kw(steps[0], kernel))
    runner = make_runner(steps[0], draft, ForwardMode.DRAFT_DECODE, num_steps=3)
    for idx in ([0, 1, 2], [2]):
        for c in steps:
            c = c if idx == [0, 1, 2] else sub_case(c, idx)
            check_precision(replay(runner, c), c)
