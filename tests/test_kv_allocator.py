"""PagedAllocator (and the encoder region of a request row) against a plain-Python model of it.

The allocator fuzz keeps its own model (per request a Python list of the slots handed out, and the rows
freed with no allocation since) and checks after every operation: no slot owned twice, page 0 never handed
out, token j of a request at offset j % p of the request's (j // p)-th page, req_to_token equal to the
model, free + owned pages partitioning 1 .. P-1, and an exhausted allocation or a double free changing
nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import OutOfSlotsError, OwnershipError, ReqToTokenPool, encoder_region_columns

def _check_invariants(alloc: PagedAllocator, pool: ReqToTokenPool, model: dict[int, list[int]]) -> None:
    p = alloc.page_size
    seen: set[int] = set()
    owned_pages: set[int] = set()
    for req, slots in model.items():
        assert pool.req_to_token[req, : len(slots)].tolist() == slots
        assert pool.req_to_token[req, len(slots):].eq(0).all()
        for j, s in enumerate(slots):
            assert s not in seen, f"slot {s} handed out twice"
            seen.add(s)
            assert s // p != 0, "page 0 handed out"
            assert s % p == j % p, "token not at its page offset"
            assert s // p == slots[j - j % p] // p, "a page's tokens are split over pages"
        pages = alloc.request_pages(req)
        assert [slots[i] // p for i in range(0, len(slots), p)] == pages[: -(-len(slots) // p)]
        assert not owned_pages & set(pages)
        owned_pages |= set(pages)
    assert 0 not in owned_pages
    assert len(owned_pages) + alloc.num_free_pages() == alloc.num_pages - 1


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocator_fuzz(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = ReqToTokenPool(6, 96, "cpu")
    alloc = PagedAllocator(1 + 40 // page_size + 3, page_size, "cpu")
    rows = pool.alloc(6)
    model: dict[int, list[int]] = {r: [] for r in rows}
    released: set[int] = set()  # rows freed by free_request and not allocated since
    exhausted = double_frees = 0
    for _ in range(300):
        req = rng.choice(rows)
        op = rng.random()
        if op < 0.65:
            cur = len(model[req])
            start = cur if rng.random() < 0.8 else rng.randint(max(0, cur - 3), cur)  # rewinds too
            n = rng.randint(0, 9)
            if start + n > 96:
                continue
            before = (pool.req_to_token.clone(), alloc.num_free_pages(), alloc.request_pages(req))
            try:
                slots = alloc.alloc_for_request(pool, req, start, n)
            except OutOfSlotsError as exc:
                exhausted += 1
                assert "pages" in str(exc)
                assert torch.equal(pool.req_to_token, before[0])
                assert (alloc.num_free_pages(), alloc.request_pages(req)) == before[1:]
            else:
                assert slots.dtype == torch.int64 and slots.shape == (n,)
                if start < cur:  # rewound: the old slots are reused, in place
                    assert slots[: cur - start].tolist() == model[req][start:cur][: n]
                model[req] = model[req][:start] + slots.tolist() + model[req][start + n:]
                released.discard(req)
        elif op < 0.8:
            keep = rng.randint(0, len(model[req]))
            alloc.truncate_request(pool, req, keep)
            model[req] = model[req][:keep]
        elif req in released:
            before = (pool.req_to_token.clone(), alloc.num_free_pages(), alloc.request_pages(req))
            with pytest.raises(OwnershipError, match="double free"):
                alloc.free_request(pool, req)
            assert torch.equal(pool.req_to_token, before[0])
            assert (alloc.num_free_pages(), alloc.request_pages(req)) == before[1:]
            double_frees += 1
        else:
            alloc.free_request(pool, req)
            model[req] = []
            released.add(req)
        _check_invariants(alloc, pool, model)
    assert exhausted > 0, "the fuzz never reached exhaustion: shrink the pool"
    assert double_frees > 0, "the fuzz never freed a request twice"


def test_alloc_continues_the_last_partial_page() -> None:
    pool = ReqToTokenPool(2, 32, "cpu")
    pool.alloc(2)
    alloc = PagedAllocator(8, 4, "cpu")
    a = alloc.alloc_for_request(pool, 1, 0, 3).tolist()
    b = alloc.alloc_for_request(pool, 1, 3, 2).tolist()
    assert b[0] == a[0] + 3  # token 3 fills the first page
    assert b[1] // 4 != a[0] // 4 and b[1] % 4 == 0  # token 4 opens a new page at offset 0
    assert alloc.num_free_pages() == 7 - 2


def test_encoder_region_then_decoder_starts_on_a_page_border() -> None:
    pool = ReqToTokenPool(1, 64, "cpu")
    pool.alloc(1)
    alloc = PagedAllocator(10, 8, "cpu")
    enc = alloc.alloc_for_request(pool, 0, 0, 5)
    col = encoder_region_columns(5, 8)
    assert col == 8 and encoder_region_columns(16, 8) == 16 and encoder_region_columns(0, 8) == 0
    dec = alloc.alloc_for_request(pool, 0, col, 3)
    assert dec[0] % 8 == 0 and dec[0] // 8 != enc[0] // 8
    assert pool.req_to_token[0, 5:8].eq(0).all()


@pytest.mark.parametrize("page_size", [0, 3, 6, -4, True, 2.0])
def test_page_size_must_be_a_power_of_two(page_size) -> None:
    with pytest.raises(ValueError, match="page_size"):
        PagedAllocator(8, page_size, "cpu")
    with pytest.raises(ValueError, match="page_size"):
        MLATokenPool(1, 8, page_size, 4, 2, torch.float32, "cpu")


def test_allocator_named_errors() -> None:
    pool = ReqToTokenPool(2, 16, "cpu")
    pool.alloc(2)
    alloc = PagedAllocator(4, 4, "cpu")
    with pytest.raises(ValueError, match="start"):
        alloc.alloc_for_request(pool, 0, 4, 1)  # would skip a whole page
    with pytest.raises(ValueError, match="req_idx"):
        alloc.alloc_for_request(pool, 2, 0, 1)
    with pytest.raises(ValueError, match="max_context"):
        alloc.alloc_for_request(pool, 0, 0, 17)
    with pytest.raises(OutOfSlotsError, match="pages"):
        alloc.alloc_for_request(pool, 0, 0, 16)  # 4 pages asked, 3 usable
    assert isinstance(OutOfSlotsError("x"), ValueError)
    pages = alloc.alloc_pages(2)
    with pytest.raises(ValueError, match="ids"):
        alloc.free_pages([0])
    alloc.free_pages(pages)
    with pytest.raises(ValueError, match="already free"):
        alloc.free_pages(pages[:1])
