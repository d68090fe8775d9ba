"""The draft trees SGLang's EAGLE really writes, read by mla_fa3 as the tree SGLang really verifies (CPU).

SGLang's own pipeline builds each case: random draft distributions through its ``select_top_k_tokens`` for every
draft step and ``organize_draft_results`` (``speculative/spec_utils.py``, ``eagle_utils.py``), then its tree
builder, the Triton ``sgl_build_tree_kernel_efficient_triton`` (``kernels/ops/speculative/spec_tree.py``, the
CUDA kernel's port), run by Triton's CPU interpreter (this file as a script in a subprocess). It writes the mask in
the layout asked for (QLEN_ONLY, the buffer our backend offers; FULL_MASK, SGLang's default), the positions, and
``retrieve_next_token`` / ``retrieve_next_sibling``: the tree its greedy verification walks.

Oracle: the parent of every node, read from those retrieve links alone (a node's children are its next token and
that one's chain of siblings), its ancestors written out by ``tests.tree_cases.ancestors_mask``, its depth by
walking parents. Checked: ``convert.verify_tree`` (what the adapter builds the verify step's tree from) gives that
mask for every request, in both layouts, with padding rows past the live ones, and SGLang's positions are prefix +
depth. A transposed or shifted reading of the mask, or a tree other than the one verified, fails.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter
from tests.sglang_world import needs_sglang  # SGLang's import shim and its CPU import set, here and in the subprocess

pytestmark = needs_sglang

# (bs, topk, steps, draft tokens k): chains (topk 1), EAGLE's usual shapes, wide and deep trees, k up to the whole
# candidate set (topk + (steps - 1) * topk^2 candidates, plus the root)
SHAPES = [(1, 1, 3, 4), (3, 2, 3, 4), (2, 2, 4, 8), (4, 4, 3, 10), (2, 8, 2, 16), (3, 3, 5, 12), (2, 2, 2, 7)]


def sglang_draft(bs: int, topk: int, steps: int, k: int, seed: int):
    """SGLang's draft bookkeeping over random draft distributions: (parent_list, top_scores_index) as its EAGLE
    worker hands them to the tree builder."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    g = torch.Generator().manual_seed(seed)
    vocab = 64

    def top(rows):
        p = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1)
        return p.topk(topk, dim=-1)

    topk_p, topk_index = top(bs)
    hidden, scores = torch.zeros(bs, 4), None
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        input_ids, hidden, scores, tree_info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        score_list.append(tree_info[0])
        token_list.append(tree_info[1])
        parents_list.append(tree_info[2])
        topk_p, topk_index = top(input_ids.shape[0])
    parent_list, top_scores_index, _ = organize_draft_results(score_list, token_list, parents_list, k)
    return parent_list, top_scores_index


def build_tree(bs, topk, steps, k, prefixes, mode, seed):
    """SGLang's tree builder (its Triton kernel) on one draft: (mask, positions, next_token, next_sibling)."""
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, sgl_build_tree_kernel_triton

    parent_list, top_scores_index = sglang_draft(bs, topk, steps, k, seed)
    seq = torch.tensor(prefixes, dtype=torch.int64)
    size = bs * k * k if mode == "QLEN_ONLY" else int(seq.sum()) * k + bs * k * k
    mask = torch.ones(size, dtype=torch.bool)  # SGLang fills True first (the prefix columns stay True)
    positions = torch.empty(bs * k, dtype=torch.int64)
    retrieve = torch.full((3, bs, k), -1, dtype=torch.int64)
    sgl_build_tree_kernel_triton(parent_list, top_scores_index, seq, mask, positions, retrieve[0], retrieve[1],
                                 retrieve[2], topk, steps, k, getattr(TreeMaskMode, mode))
    return mask, positions.view(bs, k), retrieve[1], retrieve[2]


def parents_from_links(next_token: list[int], next_sibling: list[int]) -> list[int]:
    """The parent array of the tree SGLang's greedy verification walks: node c is a child of p when c is p's next
    token or a sibling reached from it; every node but the root has exactly one parent."""
    k = len(next_token)
    parents = [-1] * k
    for p in range(k):
        c = next_token[p]
        while c != -1:
            assert parents[c] == -1 and c != 0, f"node {c} reached twice"
            parents[c] = p
            c = next_sibling[c]
    assert all(p != -1 for p in parents[1:]), f"a node outside the tree: {parents}"
    return parents


def depth(parents: list[int], i: int) -> int:
    d = 0
    while parents[i] != -1:
        i, d = parents[i], d + 1
    return d


def _check(shape, mode: str, seed: int) -> None:
    from mla_fa3.integrations.sglang.convert import verify_tree
    from tests.tree_cases import ancestors_mask

    bs, topk, steps, k = shape
    rng = random.Random(seed)
    prefixes = [rng.randrange(1, 40) for _ in range(bs)]
    mask, positions, next_token, next_sibling = build_tree(bs, topk, steps, k, prefixes, mode, seed)
    trees = [parents_from_links(next_token[b].tolist(), next_sibling[b].tolist()) for b in range(bs)]
    for b, parents in enumerate(trees):
        want = [prefixes[b] + depth(parents, i) for i in range(k)]
        assert positions[b].tolist() == want, f"request {b}: positions {positions[b].tolist()}, prefix + depth {want}"
    padded = bs + 2  # a CUDA-graph replay: two padding rows past the live requests (fill-value prefixes)
    fb = SimpleNamespace(spec_info=SimpleNamespace(custom_mask=mask, positions=positions.flatten()))
    qlen = mask if mode == "QLEN_ONLY" else None
    tree = verify_tree(fb, padded, k, torch.tensor(prefixes + [1, 1]), torch.device("cpu"), qlen_buffer=qlen)
    got = tree.mask
    for b, parents in enumerate(trees):
        assert torch.equal(got[b], ancestors_mask(parents)), f"request {b} ({mode}): {got[b].int().tolist()} " \
            f"is not the verified tree {parents}"
    assert torch.equal(got[bs:], torch.ones(k, k, dtype=torch.bool).tril().expand(2, k, k)), "padding rows: a chain"


def _interpreter_run() -> dict:
    return run_cases([(f"{mode}/{shape}/seed{seed}", lambda s=shape, m=mode, seed=seed: _check(s, m, seed))
                      for shape in SHAPES for mode in ("QLEN_ONLY", "FULL_MASK") for seed in (0, 1, 2)])


def test_sglang_tree_builder_output_is_read_as_the_tree_sglang_verifies():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__, timeout=400) == {}


def test_the_oracle_reads_parents_from_retrieve_links():
    """The oracle itself on a hand-written tree: root 0 with children 1 and 3 (3 reached as 1's sibling), 2 under 1."""
    assert parents_from_links([1, 2, -1, -1], [-1, 3, -1, -1]) == [-1, 0, 1, 0]
    with pytest.raises(AssertionError, match="outside the tree"):
        parents_from_links([1, -1, -1], [-1, -1, -1])


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
