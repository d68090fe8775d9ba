"""ReqToTokenPool: request rows of the request-to-token table."""

from __future__ import annotations

import pytest
import torch

from mla_fa3.kv.req_to_token import OutOfSlotsError, ReqToTokenPool


def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert sorted(rows) == [0, 1, 2]
    with pytest.raises(OutOfSlotsError, match="n = 1"):
        pool.alloc(1)
    pool.req_to_token[rows[1]] = 7
    pool.free(rows[1])
    assert pool.req_to_token[rows[1]].eq(0).all() and pool.available_size() == 1
    with pytest.raises(ValueError, match="idx"):
        pool.free(rows[1])
    assert pool.alloc(1) == [rows[1]]
