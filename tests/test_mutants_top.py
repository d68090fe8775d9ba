"""Contracts of the top-level modules (backend, absorb, batch, ...) that the mutation pass found unchecked
(docs/MUTATION.md): named errors at the boundary, before any kernel runs (DESIGN's hard rules), and values worked
by hand.
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import make_mla_case

from mla_fa3.absorb import attend_latent
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool


@pytest.fixture(scope="module")
def case():
    return make_mla_case("small_decode", "odd_small", seed=1)


def test_attend_latent_refuses_a_q_rope_of_another_width(case):
    layer, T = case.layer, 3
    H, r, dr = layer.num_heads, layer.mla.kv_lora_rank, layer.mla.qk_rope_head_dim
    q_lat = torch.zeros(T, H, r)
    with pytest.raises(ValueError, match="q_lat and q_rope must be"):
        attend_latent(q_lat, torch.zeros(T, H, dr + 1), layer, None, None)
    with pytest.raises(ValueError, match="q_lat and q_rope must be"):
        attend_latent(q_lat, torch.zeros(T, H + 1, dr), layer, None, None)


def test_backend_refuses_mla_dims_of_another_type(case):
    with pytest.raises(TypeError, match="mla_dims must be an MLADims, got tuple"):
        MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=case.spec.page_size,
                   device=case.layout.device, impl="reference", num_heads=case.layer.num_heads, mla_dims=(512, 64))


def test_flashmla_cannot_read_an_fp8_pool_off_page_64():
    pool = MLATokenPool(1, 8, 16, 32, 16, torch.bfloat16, "cpu", kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="decode_kernel='flashmla' cannot read an FP8 latent pool of page_size 16"):
        MLABackend(req_to_token_pool=ReqToTokenPool(2, 64, "cpu"), kv_pool=pool, page_size=16, device="cpu",
                   impl="reference", num_heads=4, decode_kernel="flashmla")


def test_extend_batch_refuses_lengths_of_different_counts():
    # [1] + [2, 3, 4] would broadcast silently: the lengths must be per request, one each
    with pytest.raises(ValueError, match="prefix_lens and extend_lens must have the same length, got 1 and 3"):
        ForwardBatch.extend([0, 1, 2], [1], [2, 3, 4], list(range(9)), "cpu")


def test_extend_positions_hand_worked():
    # prefixes 2 and 0, new 3 and 1: positions 2, 3, 4 then 0; seq_lens 5 and 1
    b = ForwardBatch.extend([0, 1], [2, 0], [3, 1], [10, 11, 12, 13], "cpu")
    assert b.positions.tolist() == [2, 3, 4, 0]
    assert b.seq_lens_cpu.tolist() == [5, 1]


def test_check_real_contract():
    import math

    from mla_fa3.checks import check_real

    assert check_real(3, "x") == 3.0 and isinstance(check_real(3, "x"), float)
    assert check_real(0.0, "x") == 0.0 and check_real(-2.5, "x") == -2.5
    assert check_real(0.5, "x", positive=True) == 0.5
    for bad, positive in ((math.inf, False), (math.nan, False), (0.0, True), (-1.0, True)):
        with pytest.raises(ValueError, match="x must be a finite number"):
            check_real(bad, "x", positive=positive)
    with pytest.raises(TypeError, match="x must be a real number, got bool"):
        check_real(True, "x")


def _draft(case, num_steps=3):
    from mla_fa3.draft_backend import MultiStepDraftBackend

    return MultiStepDraftBackend(num_steps, req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                                 page_size=case.spec.page_size, device=case.layout.device, impl="reference")


def test_draft_step_index_is_in_range(case):
    draft = _draft(case)
    assert draft.step(0) is draft.backends[0] and draft.step(2) is draft.backends[2]
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match=r"i must be a draft step in \[0, 3\)"):
            draft.step(bad)


def test_draft_step_i_advances_lengths_and_positions_by_i(case):
    draft = _draft(case)
    base = ForwardBatch.draft_decode([0, 1], [5, 9], [20, 21], "cpu", step=0)  # positions 4 and 8
    got = draft.step_batch(base, 2, out_cache_loc=torch.tensor([30, 31]))
    assert got.draft_step == 2
    assert got.seq_lens_cpu.tolist() == [7, 11] and got.positions.tolist() == [6, 10]
    assert got.out_cache_loc.tolist() == [30, 31]
