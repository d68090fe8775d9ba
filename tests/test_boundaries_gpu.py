"""Ownership and length checks on the GPU: host checks without a sync; slot checks under debug_checks.

Run on the H200: ``pytest -q tests/test_boundaries_gpu.py tests/test_soak.py`` (skips without CUDA sm90 +
sgl_kernel).
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import make_mla_case
from specs import BatchSpec

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode

pytestmark = pytest.mark.gpu


def _backend(case, **kw) -> MLABackend:
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device="cuda", **kw)


def test_seq_lens_over_the_allocation_is_refused_on_the_gpu_without_a_sync():
    case = make_mla_case("small_decode", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    row = case.layout.rows[0]
    allocated = case.layout.req_to_token_pool.allocated_len[row]
    batch = ForwardBatch.decode([row], [allocated + 1], case.layout.slots[0][:1].cuda(), "cuda")
    backend = _backend(case)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(ValueError, match="exceeds the .* tokens allocated"):
            backend.init_forward_metadata(batch)
        backend.init_forward_metadata(case.batch)  # a good batch plans without a sync
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_duplicate_and_foreign_slots_are_refused_on_the_gpu_with_debug_checks():
    case = make_mla_case(BatchSpec(ForwardMode.EXTEND, (3, 5), (2, 2)), "tiny", dtype=torch.bfloat16,
                         device="cuda", seed=2)
    rows, s = case.layout.rows, case.layout.slots
    dup = torch.stack([s[0][3], s[0][3], s[1][5], s[1][6]]).cuda()
    foreign = torch.stack([s[0][3], s[1][4], s[1][5], s[1][6]]).cuda()
    for loc, match in ((dup, "twice"), (foreign, "is not the slot")):
        batch = ForwardBatch.extend(rows, [3, 5], [2, 2], loc, "cuda")
        _backend(case).init_forward_metadata(batch)  # device slots: not read without debug_checks
        with pytest.raises(ValueError, match=match):
            _backend(case, debug_checks=True).init_forward_metadata(batch)
