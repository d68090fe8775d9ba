"""What each EAGLE draft step reads and writes, by SGLang's own kernels, against the layout mla_fa3's draft backend is
built on (CPU; SGLang's Triton kernels run by Triton's interpreter, this file as a script in a subprocess).

SGLang's kernels (``kernels/ops/speculative/cache_locs.py``): ``generate_draft_decode_kv_indices`` — the KV slots
each draft query reads at each step, as SGLang's Triton and FlashInfer draft backends get them — and
``assign_draft_cache_locs_contiguous`` with ``eagle_utils.per_step_draft_out_cache_loc`` — the slots each step
stores its new latent rows at (page 1 or topk 1; page > 1 with topk > 1 writes the slots the read kernel's formula
names, ``eagle_worker_common.prepare_for_draft``).

Ours (``integrations/sglang/draft.py``): at step i, query row (b, j) reads ``req_to_token[b, :P_b]`` and the tree keys
``req_to_token[b, draft_columns[b, key]]`` that ``sglang_draft_mask(bs, topk, S, i)`` lets branch j see, in key
order; it stores at SGLang's ``out_cache_loc``, which must be its own key of step i. Checked: the same slots in the
same order for every row and step, at pages 1, 16 and 64, topk 1 to 4, 1 to 5 steps, prefixes on and off page
boundaries.
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter
from tests.sglang_world import needs_sglang  # SGLang's import shim and its CPU import set, here and in the subprocess

pytestmark = needs_sglang

# (page size, topk, steps, prefixes)
CASES = [(1, 2, 3, (14, 5, 30)), (1, 4, 5, (1, 9)), (1, 1, 3, (7, 2, 11)), (16, 2, 3, (14, 16, 33)),
         (16, 3, 4, (15, 1)), (64, 2, 5, (62, 64, 130)), (16, 1, 4, (17, 3))]


def _table(bs: int, pool_len: int, seed: int) -> torch.Tensor:
    """req_to_token: every row a permutation of distinct slots (so each column names one slot)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(bs * pool_len, generator=g)[:pool_len] + 1 for _ in range(bs)])


def sglang_reads(table, prefixes, topk: int, steps: int, page: int) -> list[list[list[list[int]]]]:
    """[step][b][j] -> the slots SGLang's ``generate_draft_decode_kv_indices`` gives that draft query, in order."""
    from sglang.kernels.ops.speculative.cache_locs import generate_draft_decode_kv_indices
    from sglang.srt.utils import next_power_of_2

    bs, pool_len = table.shape
    seq = torch.tensor(prefixes, dtype=torch.int64)
    rows = torch.arange(bs, dtype=torch.int64)
    width = int(seq.sum()) * topk + bs * topk * steps
    kv_indices = torch.full((steps, width), -1, dtype=torch.int64)
    kv_indptr = torch.zeros((steps, bs * topk + 1), dtype=torch.int32)
    positions = seq.repeat_interleave(topk)
    generate_draft_decode_kv_indices[(steps, bs, topk)](
        rows, table, seq, kv_indices, kv_indptr, positions, pool_len, kv_indices.shape[1], kv_indptr.shape[1],
        next_power_of_2(bs), next_power_of_2(steps), next_power_of_2(bs * topk), page)
    out = []
    for i in range(steps):  # row (b, j) reads its prefix and its own i + 1 draft tokens, rows one after the other
        per_row, starts = [], [0]
        for b in range(bs):
            per_branch = []
            for _ in range(topk):
                n = prefixes[b] + i + 1
                per_branch.append(kv_indices[i, starts[-1]:starts[-1] + n].tolist())
                starts.append(starts[-1] + n)
            per_row.append(per_branch)
        assert kv_indptr[i].tolist() == starts, f"step {i}: SGLang's kv_indptr {kv_indptr[i].tolist()}, rows {starts}"
        out.append(per_row)
    return out


def sglang_writes(table, prefixes, topk: int, steps: int) -> torch.Tensor:
    """[steps, bs * topk] the slots each step stores at (page 1 or topk 1: SGLang's contiguous assignment)."""
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    bs, pool_len = table.shape
    loc = torch.empty(bs * topk * steps, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(bs,)](torch.arange(bs, dtype=torch.int64), table,
                                              torch.tensor(prefixes, dtype=torch.int64), loc, pool_len, topk, steps)
    return per_step_draft_out_cache_loc(loc, bs, topk, steps)


def our_reads(table, prefixes, topk: int, steps: int, page: int, step: int) -> list[list[list[int]]]:
    from mla_fa3.integrations.sglang.draft import draft_columns
    from mla_fa3.tree import sglang_draft_mask

    bs = table.shape[0]
    columns = draft_columns(torch.tensor(prefixes), topk, steps, page)
    mask = torch.from_numpy(sglang_draft_mask(bs, topk, steps, step))
    return [[table[b, :prefixes[b]].tolist() + table[b, columns[b][mask[b, j]]].tolist() for j in range(topk)]
            for b in range(bs)]


def _check(page: int, topk: int, steps: int, prefixes, seed: int) -> None:
    pool_len = max(prefixes) + topk * (steps + 2 * page)
    table = _table(len(prefixes), pool_len, seed)
    theirs = sglang_reads(table, list(prefixes), topk, steps, page)
    for i in range(steps):
        ours = our_reads(table, list(prefixes), topk, steps, page, i)
        assert ours == theirs[i], f"step {i}: ours {ours} != SGLang's {theirs[i]}"
    if page == 1 or topk == 1:
        writes = sglang_writes(table, list(prefixes), topk, steps)
        for i in range(steps):
            own = [theirs[i][b][j][-1] for b in range(len(prefixes)) for j in range(topk)]
            assert writes[i].tolist() == own, f"step {i}: stored at {writes[i].tolist()}, read as its own key {own}"


def _interpreter_run() -> dict:
    rng = random.Random(0)
    return run_cases([(f"page{p}/topk{t}/steps{s}/{pre}", lambda p=p, t=t, s=s, pre=pre: _check(p, t, s, pre,
                                                                                                rng.randrange(99)))
                      for p, t, s, pre in CASES])


def test_draft_steps_read_and_write_the_slots_sglangs_kernels_name():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__, timeout=400) == {}


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
