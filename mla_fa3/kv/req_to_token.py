"""The request-to-token table: which pool slot holds each token of each request row.

``req_to_token[req, j]`` (int32, on the compute device) is the slot of request row ``req``'s token ``j``;
unused entries are 0 (the padding slot). Rows are handed out by :meth:`ReqToTokenPool.alloc` and
returned by :meth:`ReqToTokenPool.free`; the slots are written by the allocator
(:class:`mla_fa3.kv.allocator.PagedAllocator`).

Cross-attention layout: a request's encoder tokens occupy the first
``encoder_region_columns(encoder_len, p) = ceil(encoder_len / p) * p`` columns of its
``req_to_token`` row; its decoder tokens start at that column, so both regions start on a page
border (allocate them with ``alloc_for_request(..., start=0, n=encoder_len)`` then
``start=encoder_region_columns(...)``).

Hot-path rule: nothing here reads a CUDA tensor's value; the bookkeeping is host-side.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import torch

from mla_fa3.batch import to_device
from mla_fa3.checks import check_int

__all__ = ["OutOfSlotsError", "ReqToTokenPool", "encoder_region_columns"]


class OutOfSlotsError(ValueError):
    """The pool has too few free pages / rows; nothing was changed."""


def encoder_region_columns(encoder_len: int, page_size: int) -> int:
    """Columns of a request's row taken by its encoder tokens: ``ceil(encoder_len / p) * p``."""
    return -(-encoder_len // page_size) * page_size


class ReqToTokenPool:
    """``req_to_token`` [size, max_context] int32 on ``device``: token slots per request row."""

    def __init__(self, size: int, max_context: int, device: torch.device | str):
        self.size = check_int(size, "size")
        self.max_context = check_int(max_context, "max_context")
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(size, max_context, dtype=torch.int32, device=self.device)
        self._free: deque[int] = deque(range(size))
        self._used: set[int] = set()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free rows (their entries are 0); OutOfSlotsError, changing nothing, if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfSlotsError(f"n = {n} request rows asked, only {len(self._free)} of {self.size} free")
        rows = [self._free.popleft() for _ in range(n)]
        self._used.update(rows)
        return rows

    def free(self, idx: int | Iterable[int]) -> None:
        """Return rows; their entries are reset to 0 (the padding slot)."""
        rows = [idx] if isinstance(idx, int) else list(idx)
        for row in rows:
            if row not in self._used:
                raise ValueError(f"idx {row} is not an allocated request row")
        for row in rows:
            self._used.discard(row)
            self._free.append(row)
        if rows:
            self.req_to_token[to_device(torch.tensor(rows, dtype=torch.int64), self.device)] = 0
