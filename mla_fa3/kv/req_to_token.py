"""The request-to-token table: which pool slot holds each token of each request row.

``req_to_token[req, j]`` (int32, on the compute device) is the slot of request row ``req``'s token ``j``;
unused entries are 0 (the padding slot). Rows are handed out by :meth:`ReqToTokenPool.alloc` and
returned by :meth:`ReqToTokenPool.free`; the slots are written by the allocator
(:class:`mla_fa3.kv.allocator.PagedAllocator`).

Ownership (host-side, never a device read): every row is either free or held. A held row knows
``allocated_len[row]``: its tokens ``0 .. allocated_len-1`` have slots in ``req_to_token`` (the
allocator sets it; the metadata builder refuses a batch whose ``seq_lens`` exceed it), and
``released[row]``: its pages were freed by the allocator's ``free_request`` and it took no tokens since
(a second ``free_request`` is a double free). A row is returned with :meth:`free` only once its tokens
are released (``allocated_len`` 0, i.e. after the allocator's ``free_request``). Every misuse — a
double free (also ``free([r, r])``), a row out of range, a bool / float / device tensor as an id —
raises a named ``ValueError``/``TypeError`` before anything changes. Code that writes ``req_to_token``
itself (a benchmark or a test fixture owning its layout) takes its rows with :meth:`claim` and says how
many tokens each holds.

Cross-attention layout: a request's encoder tokens occupy the first
``encoder_region_columns(encoder_len, p) = ceil(encoder_len / p) * p`` columns of its
``req_to_token`` row; its decoder tokens start at that column, so both regions start on a page
border (allocate them with ``alloc_for_request(..., start=0, n=encoder_len)`` then
``start=encoder_region_columns(...)``).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from mla_fa3.host import to_device
from mla_fa3.checks import check_ids, check_int

__all__ = ["OutOfSlotsError", "OwnershipError", "ReqToTokenPool", "encoder_region_columns"]


class OutOfSlotsError(ValueError):
    """The pool has too few free pages / rows; nothing was changed."""


class OwnershipError(ValueError):
    """A row or page used by someone who does not hold it (double free, freed row, another's page);
    nothing was changed."""


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
        # host arrays (NumPy, so that a batch's rows are checked in one vectorized read):
        self._held = np.zeros(size, dtype=bool)  # row handed out (alloc / claim) and not freed
        self.allocated_len = np.zeros(size, dtype=np.int64)  # tokens of the row with a slot in req_to_token
        self.released = np.zeros(size, dtype=bool)  # pages freed by free_request, no tokens taken since

    def available_size(self) -> int:
        return len(self._free)

    def is_held(self, row: int) -> bool:
        """Row ``row`` is handed out (by :meth:`alloc` or :meth:`claim`) and not freed."""
        return 0 <= row < self.size and bool(self._held[row])

    def rows_cover(self, rows: np.ndarray, span: np.ndarray) -> bool:
        """Every row of ``rows`` (int array) is in range, held and has ``span`` tokens allocated (a few NumPy
        reductions; False when any is not — the caller names the offender)."""
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.size):  # NumPy would wrap -1
            return False
        return bool(self._held[rows].all()) and not bool((span > self.allocated_len[rows]).any())

    def check_held(self, row: object, name: str = "req_idx") -> int:
        """``row`` as an int if it is a held row; else TypeError / ValueError / OwnershipError (named)."""
        if isinstance(row, (list, tuple)) or (isinstance(row, torch.Tensor) and row.dim() != 0):
            raise TypeError(f"{name} must be one row id (an int), got {type(row).__name__}")
        row = check_ids(row, name, self.size)
        if not self._held[row[0]]:
            raise OwnershipError(f"{name} {row[0]} is not a held request row (never allocated, or freed)")
        return row[0]

    def alloc(self, n: int) -> list[int]:
        """``n`` free rows (their entries are 0); OutOfSlotsError, changing nothing, if fewer are free."""
        n = check_int(n, "n", minimum=0)
        if n > len(self._free):
            raise OutOfSlotsError(f"n = {n} request rows asked, only {len(self._free)} of {self.size} free")
        rows = [self._free.popleft() for _ in range(n)]
        for row in rows:
            self._held[row] = True
            self.allocated_len[row] = 0
            self.released[row] = False
        return rows

    def claim(self, rows: object, num_tokens: object) -> None:
        """Hold the free rows ``rows`` whose ``req_to_token`` entries the caller writes itself.

        ``num_tokens``: per row (or one int for all), the tokens the caller has given slots. For
        benchmarks and fixtures that own their layout; an engine uses :meth:`alloc` and the allocator.
        """
        rows = check_ids(rows, "rows", self.size)
        lens = [num_tokens] * len(rows) if not isinstance(num_tokens, (list, tuple)) else list(num_tokens)
        if len(lens) != len(rows):
            raise ValueError(f"num_tokens must have one entry per row ({len(rows)}), got {len(lens)}")
        lens = [check_int(n, "num_tokens", minimum=0, maximum=self.max_context) for n in lens]
        self._check_distinct(rows, "rows")
        for row in rows:
            if self._held[row]:
                raise OwnershipError(f"rows holds {row}, which is already held")
        for row, n in zip(rows, lens):
            self._free.remove(row)
            self._held[row] = True
            self.allocated_len[row] = n
            self.released[row] = False

    def set_allocated_len(self, row: int, num_tokens: int) -> None:
        """Record that tokens ``0 .. num_tokens-1`` of held row ``row`` have slots (the allocator calls it)."""
        row = self.check_held(row, "row")
        self.allocated_len[row] = check_int(num_tokens, "num_tokens", minimum=0, maximum=self.max_context)

    def free(self, idx: object) -> None:
        """Return held rows (an int, a list of ints or a CPU int tensor); their entries are reset to 0.

        Raises (changing nothing) for a row out of range, not held, given twice, or still holding
        tokens (release them with the allocator's ``free_request`` first).
        """
        rows = check_ids(idx, "idx", self.size)
        self._check_distinct(rows, "idx")
        for row in rows:
            if not self._held[row]:
                raise OwnershipError(f"idx {row} is not a held request row (never allocated, or already freed)")
            if self.allocated_len[row]:
                raise OwnershipError(f"idx {row} still holds {self.allocated_len[row]} tokens: release them "
                                     "(PagedAllocator.free_request) before freeing the row")
        for row in rows:
            self._held[row] = False
            self._free.append(row)
        if rows:
            self.req_to_token[to_device(torch.tensor(rows, dtype=torch.int64), self.device)] = 0

    @staticmethod
    def _check_distinct(rows: list[int], name: str) -> None:
        if len(set(rows)) != len(rows):
            dup = sorted({r for r in rows if rows.count(r) > 1})
            raise OwnershipError(f"{name} holds row(s) {dup} more than once")
