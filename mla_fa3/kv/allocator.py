"""The paged slot allocator: pages of ``page_size`` slots handed to request rows.

Symbols: ``P`` pages of ``p`` = ``page_size`` slots each (``p`` = 1 or a power of two), so ``S = P * p``
slots; slot ``s`` lives on page ``s // p`` at offset ``s % p``.

:class:`PagedAllocator` hands out pages ``1 .. P-1``; page 0 (slots ``0 .. p-1``) is the padding
page that CUDA-graph padding rows write to and read from, and is never handed out. Token ``j`` of a
request lives on the request's page ``j // p`` at offset ``j % p``: a request's tokens
``i*p .. (i+1)*p - 1`` share one page, so ``req_to_token[req, ::p] // p`` is its page table.

Hot-path rule: nothing here reads a CUDA tensor's value; the bookkeeping is host-side.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from mla_fa3.batch import to_device
from mla_fa3.kv.pools import check_page_size
from mla_fa3.kv.req_to_token import OutOfSlotsError, ReqToTokenPool

__all__ = ["PagedAllocator"]


class PagedAllocator:
    """Pages ``1 .. num_pages-1`` of ``page_size`` slots; page 0 is the reserved padding page.

    Bookkeeping is host-side (Python lists), so allocation never reads device memory. The allocator
    remembers each request row's pages in order; it serves one :class:`ReqToTokenPool`.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str):
        self.page_size = check_page_size(page_size)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is reserved), got {num_pages!r}")
        self.num_pages = num_pages
        self.num_slots = num_pages * page_size
        self.device = torch.device(device)
        self._free: deque[int] = deque(range(1, num_pages))
        self._is_free = [False] + [True] * (num_pages - 1)
        self._req_pages: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ raw pages
    def num_free_pages(self) -> int:
        return len(self._free)

    def alloc_pages(self, n: int) -> list[int]:
        """``n`` page ids (never 0); OutOfSlotsError, changing nothing, when fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfSlotsError(f"n = {n} pages asked, only {len(self._free)} of "
                                  f"{self.num_pages - 1} free (page_size {self.page_size})")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free_pages(self, ids: Iterable[int]) -> None:
        ids = [int(i) for i in ids]
        for page in ids:
            if not 1 <= page < self.num_pages:
                raise ValueError(f"ids holds page {page}, outside 1 .. {self.num_pages - 1}")
            if self._is_free[page]:
                raise ValueError(f"ids holds page {page}, which is already free")
        if len(set(ids)) != len(ids):
            raise ValueError(f"ids holds a page twice: {ids}")
        for page in ids:
            self._is_free[page] = True
            self._free.append(page)

    # ------------------------------------------------------------------ per request
    def request_pages(self, req_idx: int) -> list[int]:
        """The pages of request row ``req_idx`` in token order (a copy)."""
        return list(self._req_pages.get(req_idx, ()))

    def alloc_for_request(self, req_to_token_pool: ReqToTokenPool, req_idx: int, start: int,
                          num_tokens: int) -> Tensor:
        """Slots for tokens ``start .. start+num_tokens-1`` of request row ``req_idx``.

        Writes them to ``req_to_token[req_idx, start:start+num_tokens]`` and returns them as an int64
        tensor on the allocator's device. Token ``j`` goes to the request's page ``j // p``: a
        partially filled last page is continued, new pages are taken only past it. ``start`` may
        rewind into already-owned pages (e.g. rejected draft tokens are overwritten), but may not skip
        a whole page: ``start <= (pages owned) * p``. Raises OutOfSlotsError and changes nothing when
        the pages run out.
        """
        p = self.page_size
        pool_rows, max_context = req_to_token_pool.req_to_token.shape
        if not isinstance(req_idx, int) or not 0 <= req_idx < pool_rows:
            raise ValueError(f"req_idx must be an int in [0, {pool_rows}), got {req_idx!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        owned = self._req_pages.get(req_idx, [])
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(owned) * p:
            raise ValueError(f"start must be an int in [0, {len(owned) * p}] (request {req_idx} owns "
                             f"{len(owned)} pages of {p}), got {start!r}")
        end = start + num_tokens
        if end > max_context:
            raise ValueError(f"num_tokens: start + num_tokens = {end} exceeds max_context {max_context}")
        need = max(0, -(-end // p) - len(owned))
        pages = owned + self.alloc_pages(need)  # raises before any change
        self._req_pages[req_idx] = pages
        tok = torch.arange(start, end, dtype=torch.int64)
        page_of_tok = torch.tensor(pages, dtype=torch.int64)[tok // p] if num_tokens else tok
        slots = to_device(page_of_tok * p + tok % p, self.device)
        req_to_token_pool.req_to_token[req_idx, start:end] = slots.to(torch.int32)
        return slots

    def truncate_request(self, req_to_token_pool: ReqToTokenPool, req_idx: int, num_tokens: int) -> list[int]:
        """Keep the first ``num_tokens`` tokens of the request; free the pages past them.

        Returns the freed page ids, for the pools' :meth:`kv.pools._TokenPoolBase.clear_pages` (as ``free_request``).
        """
        pages = self._req_pages.get(req_idx, [])
        keep = -(-num_tokens // self.page_size)
        if num_tokens < 0 or keep > len(pages):
            raise ValueError(f"num_tokens must be in [0, {len(pages) * self.page_size}], got {num_tokens}")
        freed = list(pages[keep:])
        self.free_pages(freed)
        self._req_pages[req_idx] = pages[:keep]
        req_to_token_pool.req_to_token[req_idx, num_tokens:] = 0
        return freed

    def free_request(self, req_to_token_pool: ReqToTokenPool, req_idx: int) -> list[int]:
        """Free every page of request row ``req_idx`` and zero its row (the row itself stays allocated).

        Returns the freed page ids, for the pools' :meth:`kv.pools._TokenPoolBase.clear_pages`.
        """
        pages = self._req_pages.pop(req_idx, [])
        self.free_pages(pages)
        req_to_token_pool.req_to_token[req_idx] = 0
        return list(pages)

    def alloc_for_requests(self, req_to_token_pool: ReqToTokenPool, req_idx: Sequence[int],
                           starts: Sequence[int], num_tokens: Sequence[int]) -> Tensor:
        """:meth:`alloc_for_request` for many rows at once (a serving step): one host computation, one
        host->device copy and one ``req_to_token`` scatter instead of a few torch ops per row.

        Returns the slots of every row's tokens, row after row, as one int64 tensor on the allocator's
        device. Checks every row and counts the pages first: OutOfSlotsError (or ValueError), changing
        nothing, when a row is invalid or the pages run out.
        """
        p = self.page_size
        pool_rows, max_context = req_to_token_pool.req_to_token.shape
        if not len(req_idx) == len(starts) == len(num_tokens):
            raise ValueError(f"req_idx, starts and num_tokens must have one entry per row, got "
                             f"{len(req_idx)}, {len(starts)}, {len(num_tokens)}")
        if len(set(req_idx)) != len(req_idx):
            raise ValueError(f"req_idx holds a row twice: {list(req_idx)}")
        need_total, needs = 0, []
        for row, start, n in zip(req_idx, starts, num_tokens):
            if not isinstance(row, int) or not 0 <= row < pool_rows:
                raise ValueError(f"req_idx must hold ints in [0, {pool_rows}), got {row!r}")
            owned = len(self._req_pages.get(row, ()))
            if not isinstance(start, int) or not 0 <= start <= owned * p:
                raise ValueError(f"starts: row {row} owns {owned} pages of {p}, start {start!r} is outside "
                                 f"[0, {owned * p}]")
            if not isinstance(n, int) or n < 0 or start + n > max_context:
                raise ValueError(f"num_tokens: row {row} asks {n!r} tokens from {start}, over max_context "
                                 f"{max_context} or negative")
            need = max(0, -(-(start + n) // p) - owned)
            needs.append(need)
            need_total += need
        fresh = self.alloc_pages(need_total)  # raises before any change
        k = 0
        for row, need in zip(req_idx, needs):
            pages = self._req_pages.setdefault(row, [])
            pages.extend(fresh[k:k + need])
            k += need
        if all(n == 1 for n in num_tokens):  # a decode step: plain ints
            slots = [self._req_pages[row][j // p] * p + j % p for row, j in zip(req_idx, starts)]
            host = torch.tensor([list(req_idx), list(starts), slots], dtype=torch.int64)
        else:
            parts = []
            for row, start, n in zip(req_idx, starts, num_tokens):
                cols = np.arange(start, start + n, dtype=np.int64)
                parts.append(np.stack([np.full(n, row, dtype=np.int64), cols,
                                       np.asarray(self._req_pages[row], dtype=np.int64)[cols // p] * p + cols % p]))
            host = torch.from_numpy(np.concatenate(parts, axis=1)) if parts else torch.zeros(3, 0, dtype=torch.int64)
        packed = to_device(host, self.device)
        req_to_token_pool.req_to_token[packed[0], packed[1]] = packed[2].to(torch.int32)
        return packed[2]
