"""Continuous batching: which tokens of which requests run in the next step, and where their KV goes.

A request is its token list ``tokens = prompt + output`` (``output`` grows by one greedy token per
step that samples it) and ``num_computed``, the tokens whose latent rows are in the KV cache. A
step processes, for some requests, the next tokens ``tokens[num_computed : num_computed + n]``:

- a **decode row** (``n = 1``): the request's last token, sampled by the previous step, not yet cached;
- a **prefill chunk** (``n >= 1``): part of a prompt (or of ``prompt + output`` after a preemption).

The row whose chunk reaches the end of the known tokens **samples**: its last position's logits give
the request's next token. One step, as :meth:`Scheduler.schedule` builds it::

    budget = token_budget
    decode rows: every running request whose only uncached token is its last one, oldest first;
        pages for them (a page when a row crosses a page border); while the free pages do not
        cover them: preempt the NEWEST running request (free its pages and row, put it back at
        the head of the queue; it recomputes ``prompt + output`` later)        -> budget -= rows
    prefill chunks: running requests still prefilling, then waiting requests in arrival order
        (admission: a free request row, < max_running running, free pages for the chunk plus
        ``watermark_pages``), each chunk = min(its uncached tokens, budget left, what the pages hold)
    nothing scheduled but requests running: preempt the newest one and try again (progress: a
        single request always fits the pool, checked when it is added)
    mode = DECODE (decode rows only) | EXTEND (chunks only) | MIXED (both); rows: chunks, then decode rows

Greedy tokens are resolved one step late by the serving loop (``mla_fa3.serve.loop``): a request's
``pending`` counts tokens sampled by steps whose results have not reached the host yet. The
scheduler never needs them: a decode row's input is the previous step's sample, on the device.
:meth:`Scheduler.finish` retires a request (EOS or ``max_new_tokens``) and frees its pages at once —
the device work that still reads them was launched earlier on the same stream, so it runs first.

Pages are the allocator's (``kv.allocator.PagedAllocator``); freed pages are zeroed in the KV pool
(``clear_pages``: kernels read whole pages). Nothing here reads a device value.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from torch import Tensor

from mla_fa3.batch import ForwardMode
from mla_fa3.checks import check_int
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool

__all__ = ["RequestStatus", "Request", "ScheduledRow", "StepSchedule", "Scheduler"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: holds no pages)
    RUNNING = "running"  # holds a request row and the pages of its cached tokens
    FINISHED = "finished"  # EOS or max_new_tokens reached; holds nothing


@dataclass(eq=False)
class Request:
    """One generation request and its progress (host values only)."""

    rid: int  # caller's id (unique per scheduler)
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | frozenset[int] | None = None  # one id or several (generation_config)
    arrival: float = 0.0  # seconds on the serving clock (metrics)
    output: list[int] = field(default_factory=list)  # resolved greedy tokens
    num_computed: int = 0  # tokens of prompt + output (+ pending) whose KV is cached
    pending: int = 0  # tokens sampled by launched steps, not yet on the host
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None  # ReqToTokenPool row while RUNNING
    num_preemptions: int = 0
    finish_reason: str | None = None  # "eos" | "length"
    seq: int = -1  # admission order (set by Scheduler.add): "newest" = largest
    pending_index: int = -1  # row of the last launched step's sampled tokens holding this request's
    forced: list[int] | None = None  # teacher forcing (validation): new token k is forced[k], not the argmax

    @property
    def total_len(self) -> int:
        """Known tokens: prompt + resolved output + pending samples."""
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def sampled(self) -> int:
        """New tokens sampled so far (resolved or pending)."""
        return len(self.output) + self.pending

    def token(self, j: int) -> int:
        """Token ``j`` of ``prompt + output`` (host)."""
        n = len(self.prompt)
        return self.prompt[j] if j < n else self.output[j - n]


@dataclass
class ScheduledRow:
    """One request's part of a step: tokens ``start .. start + length - 1``."""

    request: Request
    start: int  # = the row's cached prefix
    length: int  # new tokens this step
    samples: bool  # its last token's logits give the request's next token
    is_decode: bool  # a decode row (the request's last sampled token), not a prefill chunk
    from_device: bool  # its input is the previous step's sample, not yet on the host


@dataclass
class StepSchedule:
    """What the next step runs: rows (prefill chunks first, then decode rows) and their slots."""

    mode: ForwardMode  # DECODE | EXTEND | MIXED
    rows: list[ScheduledRow]
    out_cache_loc: Tensor  # [T] int64, device — slots of the rows' tokens, row after row
    preempted: list[Request]  # requests preempted while scheduling this step

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.rows)

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for r in self.rows if r.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_rows


class Scheduler:
    """Continuous batching over one ReqToTokenPool + PagedAllocator (+ the KV pool whose pages it zeroes).

    Args:
        req_to_token_pool, allocator, kv_pool: the step's tables and pages (``kv_pool`` may be None:
            freed pages are then not zeroed — only for tests of the bookkeeping).
        max_running: most requests holding pages at once (<= the ReqToTokenPool rows).
        token_budget: most new tokens per step (decode rows count 1 each).
        watermark_pages: free pages a NEW request must leave for the running ones to grow into.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedAllocator,
                 kv_pool: MLATokenPool | None, *, max_running: int, token_budget: int,
                 watermark_pages: int = 0):
        self.req_to_token_pool, self.allocator, self.kv_pool = req_to_token_pool, allocator, kv_pool
        self.page_size = allocator.page_size
        self.max_running = check_int(max_running, "max_running", 1, req_to_token_pool.size)
        self.token_budget = check_int(token_budget, "token_budget")
        self.watermark_pages = check_int(watermark_pages, "watermark_pages", 0)
        self.max_context = req_to_token_pool.max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (oldest first)
        self.finished: list[Request] = []
        self._seq = 0
        self._rids: set[int] = set()

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue a request; ValueError (naming the field) when it could never run here."""
        self.check(request)
        request.status, request.seq = RequestStatus.WAITING, self._seq
        self._seq += 1
        self._rids.add(request.rid)
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """ValueError / TypeError (naming the field) when ``request`` could never run here."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, got {type(request).__name__}")
        if request.rid in self._rids:
            raise ValueError(f"request.rid {request.rid} is already queued or running")
        if not request.prompt:
            raise ValueError(f"request.prompt of request {request.rid} is empty")
        check_int(request.max_new_tokens, "request.max_new_tokens")
        if request.forced is not None and len(request.forced) < request.max_new_tokens:
            raise ValueError(f"request.forced of request {request.rid} holds {len(request.forced)} tokens, fewer "
                             f"than max_new_tokens {request.max_new_tokens}")
        need = len(request.prompt) + request.max_new_tokens
        if need > self.max_context:
            raise ValueError(f"request.prompt of request {request.rid}: {len(request.prompt)} tokens + "
                             f"max_new_tokens {request.max_new_tokens} exceed max_context {self.max_context}")
        pages = -(-need // self.page_size)
        if pages > self.allocator.num_pages - 1:
            raise ValueError(f"request.prompt of request {request.rid}: {need} tokens need {pages} pages, more "
                             f"than the pool's {self.allocator.num_pages - 1}")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Retire ``request`` (EOS / length): free its pages and row; it leaves the queues."""
        if request.status is RequestStatus.RUNNING:
            self._release(request)
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self._rids.discard(request.rid)
        self.finished.append(request)

    def _release(self, request: Request) -> None:
        freed = self.allocator.free_request(self.req_to_token_pool, request.row)
        if self.kv_pool is not None:
            self.kv_pool.clear_pages(freed)  # kernels read whole pages: freed pages hold zeros
        self.req_to_token_pool.free(request.row)
        request.row = None

    def _preempt(self, request: Request) -> None:
        """Free the request's pages; it goes back to the head of the queue and recomputes its tokens."""
        self._release(request)
        self.running.remove(request)
        request.status, request.num_computed = RequestStatus.WAITING, 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ one step
    def _pages_for(self, request: Request, end: int) -> int:
        have = len(self.allocator.request_pages(request.row)) if request.row is not None else 0
        return max(0, -(-end // self.page_size) - have)

    def schedule(self) -> StepSchedule | None:
        """Pick and allocate the next step (module docstring); None when nothing can run now."""
        preempted: list[Request] = []
        while True:
            rows = self._try_schedule(preempted)
            if rows or not any(self._wants_to_run(r) for r in self.running):
                break
            victim = max(self.running, key=lambda r: r.seq)  # nothing fits: free the newest
            self._preempt(victim)
            preempted.append(victim)
        if not rows:
            return None
        chunks = [r for r in rows if not r.is_decode]
        decode = [r for r in rows if r.is_decode]
        rows = chunks + decode
        loc = self.allocator.alloc_for_requests(self.req_to_token_pool, [r.request.row for r in rows],
                                                [r.start for r in rows], [r.length for r in rows])
        for r in rows:
            r.request.num_computed = r.start + r.length
        mode = ForwardMode.DECODE if not chunks else (ForwardMode.MIXED if decode else ForwardMode.EXTEND)
        return StepSchedule(mode=mode, rows=rows, out_cache_loc=loc, preempted=preempted)

    def _try_schedule(self, preempted: list[Request]) -> list[ScheduledRow]:
        p, budget = self.page_size, self.token_budget
        free = self.allocator.num_free_pages()
        # decode rows: running requests whose only uncached token is the last one
        while True:
            decode = [r for r in self.running if r.num_computed == r.total_len - 1 and r.sampled > 0
                      and r.sampled < r.max_new_tokens][:budget]
            need = sum(self._pages_for(r, r.num_computed + 1) for r in decode)
            if need <= free:
                break
            victim = max(self.running, key=lambda r: r.seq)
            self._preempt(victim)
            preempted.append(victim)
            free = self.allocator.num_free_pages()
        rows = [ScheduledRow(r, r.num_computed, 1, True, True, r.pending > 0) for r in decode]
        budget -= len(decode)
        free -= need
        # prefill chunks of running requests, then admission of waiting ones
        in_rows = {id(r) for r in decode}
        candidates = [r for r in self.running if id(r) not in in_rows and r.pending == 0
                      and r.num_computed < r.total_len]
        for r in candidates:
            if budget <= 0:
                break
            n = self._chunk(r, budget, free)
            if n:
                free -= self._pages_for(r, r.num_computed + n)
                rows.append(ScheduledRow(r, r.num_computed, n, r.num_computed + n == r.total_len, False, False))
                budget -= n
        admitted = []
        for r in list(self.waiting):
            if budget <= 0 or len(self.running) + len(admitted) >= self.max_running:
                break
            if r.pending:  # preempted with a sample still in flight: its tokens are not all known yet
                continue
            if self.req_to_token_pool.available_size() - len(admitted) < 1:
                break
            n = self._chunk(r, budget, free - (self.watermark_pages if self.running or admitted else 0))
            if not n:
                break  # first come, first served: a later request does not overtake
            admitted.append(r)
            free -= -(-n // p)
            rows.append(ScheduledRow(r, 0, n, n == r.total_len, False, False))
            budget -= n
        for r in admitted:
            self.waiting.remove(r)
            r.row = self.req_to_token_pool.alloc(1)[0]
            r.status = RequestStatus.RUNNING
            self.running.append(r)
        self.running.sort(key=lambda r: r.seq)
        return rows

    @staticmethod
    def _wants_to_run(r: Request) -> bool:
        """Has uncached tokens and may still sample (a request at max_new_tokens only awaits its tokens)."""
        return r.num_computed < r.total_len and r.sampled < r.max_new_tokens

    def _chunk(self, r: Request, budget: int, free_pages: int) -> int:
        """Tokens of ``r``'s next prefill chunk that the budget and ``free_pages`` allow."""
        start = r.num_computed
        n = min(r.total_len - start, budget)
        have = len(self.allocator.request_pages(r.row)) if r.row is not None else 0
        room = (have + max(free_pages, 0)) * self.page_size - start  # slots left in owned + free pages
        return max(0, min(n, room))
