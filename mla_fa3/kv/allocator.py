"""The paged slot allocator: pages of ``page_size`` slots handed to request rows, each page with one owner.

Symbols: ``P`` pages of ``p`` = ``page_size`` slots each (``p`` = 1 or a power of two), so ``S = P * p``
slots; slot ``s`` lives on page ``s // p`` at offset ``s % p``.

:class:`PagedAllocator` hands out pages ``1 .. P-1``; page 0 (slots ``0 .. p-1``) is the padding
page that CUDA-graph padding rows write to and read from, and is never handed out. Token ``j`` of a
request lives on the request's page ``j // p`` at offset ``j % p``: a request's tokens
``i*p .. (i+1)*p - 1`` share one page, so ``req_to_token[req, ::p] // p`` is its page table.

Ownership: every page is free, owned by one request row (``alloc_for_request``), or held raw by the
caller (``alloc_pages``). The owner-aware API is per request: ``alloc_for_request`` /
``truncate_request`` / ``free_request`` act only on a row the :class:`ReqToTokenPool` holds, and only on
that row's pages; ``free_request`` twice on a row with no tokens taken in between is a double free;
``free_pages`` returns raw pages only and refuses a page a request owns. Each call
validates everything first and raises a named error (``OwnershipError``, ``OutOfSlotsError``,
``ValueError``, ``TypeError``) with nothing changed. Invariant, per held row:
``len(request_pages(row)) == ceil(allocated_len[row] / p)`` (``allocated_len`` lives in the pool,
where the metadata builder reads it).

Hot-path rule: nothing here reads a CUDA tensor's value; the bookkeeping is host-side (Python lists).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from mla_fa3.host import to_device
from mla_fa3.checks import check_ids, check_int
from mla_fa3.kv.pools import check_page_size
from mla_fa3.kv.req_to_token import OutOfSlotsError, OwnershipError, ReqToTokenPool

__all__ = ["PagedAllocator", "FREE", "RAW"]

FREE = -1  # page owner: on the free list
RAW = -2  # page owner: handed out by alloc_pages (the caller holds it, no request does)
_PADDING = -3  # page owner of page 0: never handed out


class PagedAllocator:
    """Pages ``1 .. num_pages-1`` of ``page_size`` slots; page 0 is the reserved padding page.

    Bookkeeping is host-side (Python lists), so allocation never reads device memory. The allocator
    remembers each request row's pages in order and each page's owner; it serves one
    :class:`ReqToTokenPool` (the first one it is used with; another raises).
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str):
        self.page_size = check_page_size(page_size)
        self.num_pages = check_int(num_pages, "num_pages (page 0 is reserved)", minimum=2)
        self.num_slots = num_pages * page_size
        self.device = torch.device(device)
        self._free: deque[int] = deque(range(1, num_pages))
        self._owner = [_PADDING] + [FREE] * (num_pages - 1)  # per page: FREE, RAW or the owning row
        self._req_pages: dict[int, list[int]] = {}
        self._pool: ReqToTokenPool | None = None

    # ------------------------------------------------------------------ raw pages
    def num_free_pages(self) -> int:
        return len(self._free)

    def page_owner(self, page: int) -> int:
        """The request row owning ``page``, or ``FREE`` / ``RAW`` (page 0, the padding page: -3)."""
        return self._owner[check_ids(page, "page", self.num_pages)[0]]

    def alloc_pages(self, n: int) -> list[int]:
        """``n`` raw page ids (never 0), held by the caller; OutOfSlotsError, changing nothing, when fewer
        are free. Return them with :meth:`free_pages`."""
        pages = self._take(check_int(n, "n", minimum=0))
        for page in pages:
            self._owner[page] = RAW
        return pages

    def free_pages(self, ids: object) -> None:
        """Return raw pages from :meth:`alloc_pages`. A page that is free, owned by a request (release it
        with ``free_request`` / ``truncate_request``), page 0 or given twice raises; nothing changes."""
        pages = check_ids(ids, "ids", self.num_pages)
        for page in pages:
            owner = self._owner[page]
            if owner == _PADDING:
                raise ValueError(f"ids holds page 0, the padding page (pages are 1 .. {self.num_pages - 1})")
            if owner == FREE:
                raise OwnershipError(f"ids holds page {page}, which is already free")
            if owner != RAW:
                raise OwnershipError(f"ids holds page {page}, owned by request row {owner}: release it with "
                                     "free_request / truncate_request")
        if len(set(pages)) != len(pages):
            raise OwnershipError(f"ids holds a page twice: {pages}")
        self._give_back(pages)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlotsError(f"n = {n} pages asked, only {len(self._free)} of "
                                  f"{self.num_pages - 1} free (page_size {self.page_size})")
        return [self._free.popleft() for _ in range(n)]

    def _give_back(self, pages: list[int]) -> None:
        for page in pages:
            self._owner[page] = FREE
            self._free.append(page)

    # ------------------------------------------------------------------ per request (owner-aware)
    def request_pages(self, req_idx: int) -> list[int]:
        """The pages of request row ``req_idx`` in token order (a copy)."""
        return list(self._req_pages.get(req_idx, ()))

    def _held_row(self, pool: ReqToTokenPool, req_idx: object) -> tuple[int, list[int]]:
        """(row, its pages) after checking the pool is ours and the row is held with our pages."""
        if not isinstance(pool, ReqToTokenPool):
            raise TypeError(f"req_to_token_pool must be a ReqToTokenPool, got {type(pool).__name__}")
        if self._pool is None:
            self._pool = pool
        elif pool is not self._pool:
            raise ValueError("req_to_token_pool is not the ReqToTokenPool this allocator serves")
        row = pool.check_held(req_idx, "req_idx")
        pages = self._req_pages.get(row, [])
        if len(pages) != -(-pool.allocated_len[row] // self.page_size):
            raise OwnershipError(f"req_idx {row} holds {pool.allocated_len[row]} tokens that this allocator did "
                                 f"not give (it owns {len(pages)} pages): a claimed row")
        return row, pages

    def alloc_for_request(self, req_to_token_pool: ReqToTokenPool, req_idx: int, start: int,
                          num_tokens: int) -> Tensor:
        """Slots for tokens ``start .. start+num_tokens-1`` of request row ``req_idx``.

        Writes them to ``req_to_token[req_idx, start:start+num_tokens]`` and returns them as an int64
        tensor on the allocator's device. Token ``j`` goes to the request's page ``j // p``: a
        partially filled last page is continued, new pages are taken only past it. ``start`` may
        rewind into already-owned pages (e.g. rejected draft tokens are overwritten), but may not skip
        a whole page: ``start <= (pages owned) * p``. The row's ``allocated_len`` becomes
        ``max(allocated_len, start + num_tokens)``. Raises OutOfSlotsError and changes nothing when
        the pages run out; OwnershipError for a row the pool does not hold.
        """
        p = self.page_size
        pool = req_to_token_pool
        row, owned = self._held_row(pool, req_idx)
        num_tokens = check_int(num_tokens, "num_tokens", minimum=0)
        start = check_int(start, "start", minimum=0)
        if start > len(owned) * p:
            raise ValueError(f"start must be an int in [0, {len(owned) * p}] (request {row} owns "
                             f"{len(owned)} pages of {p}), got {start}")
        end = start + num_tokens
        if end > pool.max_context:
            raise ValueError(f"num_tokens: start + num_tokens = {end} exceeds max_context {pool.max_context}")
        new = self._take(max(0, -(-end // p) - len(owned)))  # raises before any change
        for page in new:
            self._owner[page] = row
        pages = owned + new
        self._req_pages[row] = pages
        pool.allocated_len[row] = max(pool.allocated_len[row], end)
        pool.released[row] = False
        tok = torch.arange(start, end, dtype=torch.int64)
        page_of_tok = torch.tensor(pages, dtype=torch.int64)[tok // p] if num_tokens else tok
        slots = to_device(page_of_tok * p + tok % p, self.device)
        pool.req_to_token[row, start:end] = slots.to(torch.int32)
        return slots

    def truncate_request(self, req_to_token_pool: ReqToTokenPool, req_idx: int, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` tokens of the request (at most its ``allocated_len``); free the
        pages past them.

        Returns the freed page ids, for the pools' :meth:`kv.pools._TokenPoolBase.clear_pages` (as ``free_request``).
        """
        pool = req_to_token_pool
        row, pages = self._held_row(pool, req_idx)
        num_tokens = check_int(num_tokens, "num_tokens", minimum=0, maximum=pool.allocated_len[row])
        keep = -(-num_tokens // self.page_size)
        freed = list(pages[keep:])
        self._give_back(freed)
        self._req_pages[row] = pages[:keep]
        pool.allocated_len[row] = num_tokens
        pool.req_to_token[row, num_tokens:] = 0
        return freed

    def free_request(self, req_to_token_pool: ReqToTokenPool, req_idx: int) -> list[int]:
        """Free every page of request row ``req_idx`` and zero its row (the row itself stays held: return
        it with ``ReqToTokenPool.free``). Raises OwnershipError, changing nothing, for a row the pool does
        not hold and for a double free (the row's pages already freed here, no tokens taken since).

        Returns the freed page ids, for the pools' :meth:`kv.pools._TokenPoolBase.clear_pages`.
        """
        row, _ = self._held_row(req_to_token_pool, req_idx)
        if req_to_token_pool.released[row]:
            raise OwnershipError(f"req_idx {row}: its pages were already freed by free_request (a double free); "
                                 "return the row with ReqToTokenPool.free")
        freed = self.truncate_request(req_to_token_pool, row, 0)
        req_to_token_pool.released[row] = True
        return freed

    def alloc_for_requests(self, req_to_token_pool: ReqToTokenPool, req_idx: Sequence[int],
                           starts: Sequence[int], num_tokens: Sequence[int]) -> Tensor:
        """:meth:`alloc_for_request` for many rows at once (a serving step): one host computation, one
        host->device copy and one ``req_to_token`` scatter instead of a few torch ops per row.

        Returns the slots of every row's tokens, row after row, as one int64 tensor on the allocator's
        device. Checks every row (held by the pool, ours, distinct) and counts the pages first:
        OutOfSlotsError / OwnershipError / ValueError, changing nothing, when a row is invalid or the
        pages run out.
        """
        p, pool = self.page_size, req_to_token_pool
        if not len(req_idx) == len(starts) == len(num_tokens):
            raise ValueError(f"req_idx, starts and num_tokens must have one entry per row, got "
                             f"{len(req_idx)}, {len(starts)}, {len(num_tokens)}")
        rows, needs, ends = [], [], []
        for r, start, n in zip(req_idx, starts, num_tokens):
            row, owned = self._held_row(pool, r)
            start, n = check_int(start, "starts", minimum=0), check_int(n, "num_tokens", minimum=0)
            if start > len(owned) * p:
                raise ValueError(f"starts: row {row} owns {len(owned)} pages of {p}, start {start} is outside "
                                 f"[0, {len(owned) * p}]")
            if start + n > pool.max_context:
                raise ValueError(f"num_tokens: row {row} asks {n} tokens from {start}, over max_context "
                                 f"{pool.max_context}")
            rows.append(row)
            ends.append(start + n)
            needs.append(max(0, -(-(start + n) // p) - len(owned)))
        if len(set(rows)) != len(rows):
            raise ValueError(f"req_idx holds a row twice: {rows}")
        fresh = self._take(sum(needs))  # raises before any change
        k = 0
        for row, need, end in zip(rows, needs, ends):
            for page in fresh[k:k + need]:
                self._owner[page] = row
            self._req_pages.setdefault(row, []).extend(fresh[k:k + need])
            pool.allocated_len[row] = max(pool.allocated_len[row], end)
            pool.released[row] = False
            k += need
        if all(n == 1 for n in num_tokens):  # a decode step: plain ints
            slots = [self._req_pages[row][j // p] * p + j % p for row, j in zip(rows, starts)]
            host = torch.tensor([rows, list(starts), slots], dtype=torch.int64)
        else:
            parts = []
            for row, start, n in zip(rows, starts, num_tokens):
                cols = np.arange(start, start + n, dtype=np.int64)
                parts.append(np.stack([np.full(n, row, dtype=np.int64), cols,
                                       np.asarray(self._req_pages[row], dtype=np.int64)[cols // p] * p + cols % p]))
            host = torch.from_numpy(np.concatenate(parts, axis=1)) if parts else torch.zeros(3, 0, dtype=torch.int64)
        packed = to_device(host, self.device)
        pool.req_to_token[packed[0], packed[1]] = packed[2].to(torch.int32)
        return packed[2]
