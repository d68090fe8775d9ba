"""Contracts of ``mla_fa3.kv`` that the mutation pass found unchecked (docs/MUTATION.md).

Every expected value is worked by hand in the comments (slot = page * p + offset) or computed here in
float64; none is produced by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.fp8 import check_scale, kv_dtype_of, propose_scale
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool


def test_alloc_for_requests_hand_worked_slots():
    # page_size 4; the free list hands out pages 1, 2, 3, ... in order (page 0 is the padding page).
    pool = ReqToTokenPool(3, 32, "cpu")
    assert pool.alloc(3) == [0, 1, 2]
    alloc = PagedAllocator(10, 4, "cpu")
    # row 0: 6 tokens -> pages 1, 2 (slots 4..9); row 2: 3 tokens -> page 3 (slots 12..14); row 1: none.
    slots = alloc.alloc_for_requests(pool, [0, 2, 1], [0, 0, 0], [6, 3, 0])
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    assert alloc.request_pages(0) == [1, 2] and alloc.request_pages(2) == [3] and alloc.request_pages(1) == []
    assert [alloc.page_owner(page) for page in (1, 2, 3, 4)] == [0, 0, 2, -1]  # -1: FREE
    assert pool.req_to_token[0, :6].tolist() == [4, 5, 6, 7, 8, 9]
    assert pool.req_to_token[2, :3].tolist() == [12, 13, 14]
    # A decode step (one token per row): row 0 token 6 -> page 2 offset 2 = 10; row 2 token 3 -> page 3
    # offset 3 = 15.
    assert alloc.alloc_for_requests(pool, [0, 2], [6, 3], [1, 1]).tolist() == [10, 15]
    # Next step: row 0 token 7 -> 11; row 2 token 4 opens page 4 -> 16.
    assert alloc.alloc_for_requests(pool, [0, 2], [7, 4], [1, 1]).tolist() == [11, 16]
    assert alloc.request_pages(2) == [3, 4]
    assert pool.req_to_token[2, :5].tolist() == [12, 13, 14, 15, 16]
    assert list(pool.allocated_len) == [8, 0, 5]


def test_alloc_for_requests_refuses_a_row_over_max_context():
    pool = ReqToTokenPool(2, 16, "cpu")
    pool.alloc(2)
    alloc = PagedAllocator(20, 2, "cpu")
    alloc.alloc_for_requests(pool, [0], [0], [14])
    free = alloc.num_free_pages()
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.alloc_for_requests(pool, [1, 0], [0, 14], [1, 3])  # 14 + 3 > 16
    assert alloc.num_free_pages() == free and alloc.request_pages(1) == []


def test_propose_scale_contract():
    assert propose_scale(0.0) == 1.0  # absmax 0: scale 1.0, not an error
    assert propose_scale(448.0) == 1.0
    assert propose_scale(896.0, headroom=2.0) == 4.0  # 896 * 2 / 448
    for bad in (-1e-3, math.nan, math.inf):
        with pytest.raises(ValueError, match="absmax"):
            propose_scale(bad)


def test_check_scale_contract():
    assert check_scale(2, "s") == 2.0 and isinstance(check_scale(2, "s"), float)
    for bad in (True, 0, 0.0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="s must be"):
            check_scale(bad, "s")


def test_kv_dtype_of_each_setting():
    assert kv_dtype_of(None) is None
    assert kv_dtype_of("auto") is None
    assert kv_dtype_of("fp8") is torch.float8_e4m3fn
    assert kv_dtype_of("float8_e4m3fn") is torch.float8_e4m3fn
    assert kv_dtype_of(torch.bfloat16) is torch.bfloat16
    for bad in ("bf16", "e4m3", 8):
        with pytest.raises(ValueError, match="kv_dtype"):
            kv_dtype_of(bad)


def test_fp8_pool_stores_float64_rows_as_their_float32_values():
    # _rows_2d: rows of a dtype the store kernels do not take (here float64) go in as float32.
    pool = MLATokenPool(1, 4, 2, 4, 2, torch.float32, "cpu", kv_dtype=torch.float8_e4m3fn)
    pool.set_scales([0.5])
    c_kv = torch.tensor([[1.0, -3.0, 500.0, 0.1], [7.0, 0.0, -250.0, 2.5]], dtype=torch.float64)
    k_rope = torch.tensor([[0.25, 1000.0], [-1.0, 3.0]], dtype=torch.float64)
    pool.set_kv(0, torch.tensor([3, 6]), c_kv, k_rope)
    want = torch.cat([c_kv, k_rope], dim=1)
    want = (want / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64) * 0.5
    assert torch.equal(pool.dequantized(0, [3, 6]).double(), want)


def test_proposed_scales_need_an_observation():
    pool = MLATokenPool(2, 4, 2, 4, 2, torch.float32, "cpu", kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="observe_absmax"):
        pool.proposed_scales()
    pool.observe_absmax()
    pool.set_latent(1, torch.tensor([1, 2]), torch.tensor([[1.0, -2.0, 3.0, 4.0, 5.0, 6.0],
                                                           [0.0, 0.0, 0.0, -896.0, 0.0, 0.0]]))
    assert pool.proposed_scales() == [1.0, 2.0]  # layer 0 saw nothing (scale 1.0); layer 1: 896 / 448


def test_a_row_given_twice_is_named():
    pool = ReqToTokenPool(4, 8, "cpu")
    pool.alloc(4)
    with pytest.raises(ValueError, match=r"idx holds row\(s\) \[1, 3\] more than once"):
        pool.free([3, 1, 0, 1, 3])
    assert pool.available_size() == 0  # nothing freed
