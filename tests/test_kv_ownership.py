"""Ownership of KV memory: every misuse of a row or page raises a named error and changes nothing.

Each test is one case of issue "[reliability]": double frees (also ``free([r, r])``), freeing a page a
live request owns, using a row never allocated or already freed, rows out of range, 0-d tensors /
numpy ints / bools as ids. "Changes nothing" is checked against a snapshot of every piece of host and
device state the pool and allocator hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_fa3.kv.allocator import FREE, RAW, PagedAllocator
from mla_fa3.kv.req_to_token import OutOfSlotsError, OwnershipError, ReqToTokenPool


def world(rows: int = 4, pages: int = 9, page_size: int = 4, ctx: int = 32):
    pool = ReqToTokenPool(rows, ctx, "cpu")
    return pool, PagedAllocator(pages, page_size, "cpu")


def snapshot(pool: ReqToTokenPool, alloc: PagedAllocator):
    return (pool.req_to_token.clone(), list(pool._free), list(pool._held), list(pool.allocated_len),
            list(pool.released), list(alloc._free), list(alloc._owner),
            {k: list(v) for k, v in alloc._req_pages.items()})


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def unchanged(pool, alloc, fn, exc, match):
    before = snapshot(pool, alloc)
    with pytest.raises(exc, match=match):
        fn()
    assert same(before, snapshot(pool, alloc)), "a refused call changed state"


# ---------------------------------------------------------------------------------- rows
def test_free_the_same_row_twice_in_one_call_is_refused():
    pool, alloc = world()
    pool.alloc(4)
    unchanged(pool, alloc, lambda: pool.free([1, 1]), OwnershipError, r"more than once")
    pool.free([1])
    assert pool.alloc(1) == [1] and pool.available_size() == 0  # the row came back once


def test_double_free_of_a_row_is_refused():
    pool, alloc = world()
    rows = pool.alloc(2)
    pool.free(rows[0])
    unchanged(pool, alloc, lambda: pool.free(rows[0]), OwnershipError, "not a held request row")
    unchanged(pool, alloc, lambda: pool.free([rows[1], rows[0]]), OwnershipError, "not a held")  # none freed
    assert pool.is_held(rows[1])


def test_free_of_a_row_never_allocated_is_refused():
    pool, alloc = world()
    pool.alloc(1)
    unchanged(pool, alloc, lambda: pool.free(3), OwnershipError, "idx 3 is not a held")


@pytest.mark.parametrize("bad,exc", [(4, ValueError), (-1, ValueError), ([0, 9], ValueError),
                                     (True, TypeError), (1.0, TypeError), (torch.tensor([1.0]), TypeError),
                                     (torch.tensor(True), TypeError), ("1", TypeError)])
def test_free_with_a_bad_id_is_a_named_error(bad, exc):
    pool, alloc = world()
    pool.alloc(4)
    unchanged(pool, alloc, lambda: pool.free(bad), exc, "idx")


@pytest.mark.parametrize("ident", [torch.tensor(2), np.int64(2), torch.tensor([2]), (2,)])
def test_free_accepts_0d_tensors_numpy_ints_and_sequences(ident):
    pool, _ = world()
    pool.alloc(4)
    pool.free(ident)
    assert not pool.is_held(2) and pool.available_size() == 1


def test_free_of_a_row_still_holding_tokens_is_refused():
    pool, alloc = world()
    row = pool.alloc(1)[0]
    alloc.alloc_for_request(pool, row, 0, 5)
    unchanged(pool, alloc, lambda: pool.free(row), OwnershipError, "still holds 5 tokens")
    alloc.free_request(pool, row)
    pool.free(row)


def test_claim_refuses_a_held_row_and_bad_lengths():
    pool, alloc = world()
    pool.alloc(1)
    unchanged(pool, alloc, lambda: pool.claim([0], 3), OwnershipError, "already held")
    unchanged(pool, alloc, lambda: pool.claim([1, 1], 3), OwnershipError, "more than once")
    unchanged(pool, alloc, lambda: pool.claim([1], 33), ValueError, "num_tokens")
    pool.claim([2, 3], [4, 0])
    assert pool.allocated_len[2:].tolist() == [4, 0] and pool.available_size() == 1
    # the allocator refuses a claimed row whose tokens it did not give
    unchanged(pool, alloc, lambda: alloc.alloc_for_request(pool, 2, 4, 1), OwnershipError, "claimed row")


# ---------------------------------------------------------------------------------- pages
def test_free_pages_refuses_a_page_a_live_request_owns():
    pool, alloc = world()
    rows = pool.alloc(2)
    slots = alloc.alloc_for_request(pool, rows[0], 0, 6)
    page = int(slots[0]) // 4
    assert alloc.page_owner(page) == rows[0]
    unchanged(pool, alloc, lambda: alloc.free_pages([page]), OwnershipError, f"owned by request row {rows[0]}")
    # so the next allocation can never hand it to a second request
    other = alloc.alloc_for_request(pool, rows[1], 0, 4 * alloc.num_free_pages())
    assert not {int(s) // 4 for s in other} & set(alloc.request_pages(rows[0]))


def test_raw_pages_double_free_and_page_zero():
    pool, alloc = world()
    pages = alloc.alloc_pages(2)
    assert [alloc.page_owner(p) for p in pages] == [RAW, RAW]
    unchanged(pool, alloc, lambda: alloc.free_pages([pages[0], pages[0]]), OwnershipError, "twice")
    unchanged(pool, alloc, lambda: alloc.free_pages([0]), ValueError, "padding page")
    unchanged(pool, alloc, lambda: alloc.free_pages([9]), ValueError, "outside")
    unchanged(pool, alloc, lambda: alloc.free_pages([True]), TypeError, "ids")
    alloc.free_pages(np.array(pages).tolist())
    assert alloc.page_owner(pages[0]) == FREE
    unchanged(pool, alloc, lambda: alloc.free_pages(pages[:1]), OwnershipError, "already free")


# ---------------------------------------------------------------------------------- per request
@pytest.mark.parametrize("call", ["alloc", "free", "truncate"])
def test_request_calls_on_a_row_never_allocated_or_freed(call):
    pool, alloc = world()
    rows = pool.alloc(2)
    alloc.alloc_for_request(pool, rows[1], 0, 3)
    alloc.free_request(pool, rows[1])
    pool.free(rows[1])
    fn = {"alloc": lambda r: alloc.alloc_for_request(pool, r, 0, 1),
          "free": lambda r: alloc.free_request(pool, r),
          "truncate": lambda r: alloc.truncate_request(pool, r, 0)}[call]
    unchanged(pool, alloc, lambda: fn(3), OwnershipError, "req_idx 3 is not a held")  # never allocated
    unchanged(pool, alloc, lambda: fn(rows[1]), OwnershipError, "not a held")  # freed
    unchanged(pool, alloc, lambda: fn(9), ValueError, r"req_idx holds 9, outside \[0, 4\)")  # no IndexError
    unchanged(pool, alloc, lambda: fn(True), TypeError, "req_idx")
    unchanged(pool, alloc, lambda: fn([rows[0]]), TypeError, "req_idx")


def test_free_request_twice_is_a_double_free():
    """One contract with ReqToTokenPool.free: the second free_request of a row raises OwnershipError and changes
    nothing; a row that took tokens since (either allocation call), or was handed out anew, frees again."""
    pool, alloc = world(rows=2)
    row, other = pool.alloc(2)
    alloc.alloc_for_request(pool, row, 0, 6)
    alloc.alloc_for_request(pool, other, 0, 3)
    pages = alloc.request_pages(row)
    assert alloc.free_request(pool, row) == pages and all(alloc.page_owner(p) == FREE for p in pages)
    unchanged(pool, alloc, lambda: alloc.free_request(pool, row), OwnershipError, f"req_idx {row}.*double free")
    unchanged(pool, alloc, lambda: alloc.free_request(pool, torch.tensor(row)), OwnershipError, "double free")
    alloc.alloc_for_request(pool, row, 0, 1)
    again = alloc.request_pages(row)
    assert len(again) == 1 and alloc.free_request(pool, row) == again
    alloc.alloc_for_requests(pool, [row], [0], [2])
    alloc.free_request(pool, row)
    unchanged(pool, alloc, lambda: alloc.free_request(pool, row), OwnershipError, "double free")
    assert alloc.request_pages(other) and pool.allocated_len[other] == 3  # the other request kept its pages
    pool.free(row)
    assert pool.alloc(1) == [row]
    assert alloc.free_request(pool, row) == []  # a row handed out anew holds nothing: not a double free
    unchanged(pool, alloc, lambda: alloc.free_request(pool, row), OwnershipError, "double free")


def test_request_calls_accept_numpy_and_0d_tensor_rows():
    pool, alloc = world()
    row = pool.alloc(1)[0]
    alloc.alloc_for_request(pool, np.int32(row), np.int64(0), 5)
    alloc.truncate_request(pool, torch.tensor(row), 2)
    assert pool.allocated_len[row] == 2 and len(alloc.request_pages(row)) == 1
    pages = alloc.request_pages(row)
    assert alloc.free_request(pool, torch.tensor(row)) == pages


def test_truncate_beyond_the_allocated_tokens_and_bad_counts():
    pool, alloc = world(ctx=64)
    row = pool.alloc(1)[0]
    alloc.alloc_for_request(pool, row, 0, 3)  # 3 tokens on one page of 4
    unchanged(pool, alloc, lambda: alloc.truncate_request(pool, row, 4), ValueError, "num_tokens must be an int <= 3")
    unchanged(pool, alloc, lambda: alloc.truncate_request(pool, row, -1), ValueError, "num_tokens")
    unchanged(pool, alloc, lambda: alloc.alloc_for_request(pool, row, 0, 1.0), TypeError, "num_tokens")
    unchanged(pool, alloc, lambda: alloc.alloc_for_request(pool, row, True, 1), TypeError, "start")
    unchanged(pool, alloc, lambda: alloc.alloc_for_request(pool, row, 0, 65), ValueError, "max_context")
    unchanged(pool, alloc, lambda: alloc.alloc_for_request(pool, row, 0, 40), OutOfSlotsError, "pages")


def test_allocated_len_follows_alloc_rewind_truncate_and_free():
    pool, alloc = world(page_size=4)
    row = pool.alloc(1)[0]
    alloc.alloc_for_request(pool, row, 0, 6)
    assert pool.allocated_len[row] == 6 and len(alloc.request_pages(row)) == 2
    alloc.alloc_for_request(pool, row, 4, 1)  # a rewind never shrinks what is allocated
    assert pool.allocated_len[row] == 6
    freed = alloc.truncate_request(pool, row, 4)
    assert pool.allocated_len[row] == 4 and len(freed) == 1 and alloc.page_owner(freed[0]) == FREE
    alloc.free_request(pool, row)
    assert pool.allocated_len[row] == 0 and alloc.request_pages(row) == []


def test_an_allocator_serves_one_pool():
    pool, alloc = world()
    other = ReqToTokenPool(4, 32, "cpu")
    pool.alloc(1), other.alloc(1)
    alloc.alloc_for_request(pool, 0, 0, 1)
    unchanged(pool, alloc, lambda: alloc.alloc_for_request(other, 0, 0, 1), ValueError, "not the ReqToTokenPool")
    with pytest.raises(TypeError, match="req_to_token_pool"):
        alloc.alloc_for_request(pool.req_to_token, 0, 0, 1)


@pytest.mark.parametrize("row", [-1, -4, 4, 99])
def test_a_batch_row_out_of_range_is_named_even_when_it_would_wrap_to_a_held_row(row):
    """NumPy indexing wraps -1 to the last row: a held, long-enough last row must not vouch for it."""
    from mla_fa3.batch import ForwardBatch, ForwardMode
    from mla_fa3.metadata import MetadataBuilder

    pool = ReqToTokenPool(4, 64, "cpu")
    pool.claim([0, 1, 2, 3], 32)  # every row held with 32 tokens: a wrapped index would pass the ownership test
    rows = torch.tensor([row], dtype=torch.int64)
    assert not pool.rows_cover(rows.numpy(), np.array([20]))
    seq = torch.tensor([20], dtype=torch.int32)
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, req_pool_indices=rows, seq_lens=seq,
                         seq_lens_cpu=seq.clone(), out_cache_loc=torch.zeros(1, dtype=torch.int64),
                         req_pool_indices_cpu=rows.clone())
    with pytest.raises(ValueError, match=rf"req_pool_indices must be in \[0, 4\), got {row}"):
        MetadataBuilder(pool, 16, "cpu").batch_checks.validate(batch)
