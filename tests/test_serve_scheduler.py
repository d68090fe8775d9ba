"""Continuous-batching scheduler, driven without a model: a fake "cache" checks what attention would read.

The simulation writes every scheduled token's id at its slot (``out_cache_loc``) and, for every row,
reads the whole context back through ``req_to_token`` — what the kernels read. A sampled token is a
hash of that context, so a wrong page, a stale slot or a lost token changes every later token. The
oracle is the same hash over the request's own token list, computed one request at a time.
Tokens are resolved one step late (as the serving loop does), so decode rows carry unresolved samples.
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_fa3.batch import ForwardMode
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.serve.scheduler import Request, RequestStatus, Scheduler

VOCAB = 101


def _next_token(context: list[int]) -> int:
    h = 7
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def _alone(prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(max_new):
        t = _next_token(toks)
        out.append(t)
        toks.append(t)
        if t == eos:
            break
    return out


def _simulate(requests, *, num_pages, page_size, max_running, budget, max_context=128, joins=None,
              watermark=0):
    """Drive the scheduler like the serving loop; returns (scheduler, steps) after checking invariants."""
    pool = ReqToTokenPool(max_running, max_context, "cpu")
    alloc = PagedAllocator(num_pages, page_size, "cpu")
    sched = Scheduler(pool, alloc, None, max_running=max_running, token_budget=budget, watermark_pages=watermark)
    cache = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
    joins = joins or {0: list(requests)}
    pending_step, steps, t = None, [], 0
    while t in joins or any(k > t for k in joins) or sched.has_work() or pending_step:
        for r in joins.get(t, []):
            sched.add(r)
        s = sched.schedule() if sched.has_work() else None
        launched = None
        if s is not None:
            assert s.num_tokens <= budget, "token budget exceeded"
            assert len(sched.running) <= max_running
            assert alloc.num_free_pages() >= 0
            assert s.mode is {(True, False): ForwardMode.DECODE, (False, True): ForwardMode.EXTEND,
                              (False, False): ForwardMode.MIXED}[(s.num_prefill_tokens == 0,
                                                                   s.num_decode_rows == 0)]
            loc, k, samples = s.out_cache_loc.tolist(), 0, []
            for row in s.rows:
                req = row.request
                full = req.prompt + req.output + req._sim_pending  # the sim knows unresolved samples
                for j in range(row.start, row.start + row.length):
                    cache[loc[k]] = full[j]
                    k += 1
                end = row.start + row.length
                ctx_slots = pool.req_to_token[req.row, :end].long()
                context = cache[ctx_slots].tolist()
                assert context == full[:end], f"request {req.rid}: the cache does not hold its tokens"
                if row.samples:
                    tok = _next_token(context)
                    req.pending += 1
                    req._sim_pending.append(tok)
                    samples.append((req, tok))
            # no slot is owned twice among running requests
            owned = [p for r in sched.running for p in alloc.request_pages(r.row)]
            assert len(owned) == len(set(owned))
            steps.append(s)
            launched = samples
        if pending_step:  # resolve the previous step (one step late)
            for req, tok in pending_step:
                if req.status is RequestStatus.FINISHED:
                    continue
                req.pending -= 1
                req._sim_pending.pop(0)
                req.output.append(tok)
                if tok == req.eos_token_id:
                    sched.finish(req, "eos")
                elif len(req.output) >= req.max_new_tokens:
                    sched.finish(req, "length")
        pending_step = launched
        t += 1
        assert t < 10_000, "no progress"
    return sched, steps, alloc, pool


def _requests(n, seed, *, max_prompt=30, max_new=12, eos=None):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = Request(rid=i, prompt=[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))],
                    max_new_tokens=rng.randint(1, max_new), eos_token_id=eos)
        r._sim_pending = []
        out.append(r)
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_pages,expect_preemption", [(400, False), (14, True)])
def test_every_request_gets_its_alone_tokens_and_no_page_leaks(page_size, num_pages, expect_preemption):
    pages = num_pages if page_size == 4 else max(num_pages * 4 // page_size, 3)
    reqs = _requests(12, seed=page_size, max_prompt=40 if pages * page_size >= 52 else 10)
    joins = {0: reqs[:4], 3: reqs[4:8], 9: reqs[8:]}
    sched, steps, alloc, pool = _simulate(reqs, num_pages=pages, page_size=page_size, max_running=6, budget=16,
                                          joins=joins)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED
        assert r.output == _alone(r.prompt, r.max_new_tokens, None), f"request {r.rid}"
    assert alloc.num_free_pages() == alloc.num_pages - 1, "pages leaked"
    assert pool.available_size() == pool.size, "request rows leaked"
    assert int(pool.req_to_token.abs().sum()) == 0
    assert {s.mode for s in steps} >= {ForwardMode.DECODE, ForwardMode.MIXED}
    preempted = sum(r.num_preemptions for r in reqs)
    if page_size == 4:
        assert (preempted > 0) == expect_preemption


def test_eos_retires_early_and_frees_pages():
    reqs = _requests(6, seed=3, max_new=20)
    # an EOS that some requests will produce: the 3rd token request 0 would produce alone
    eos = _alone(reqs[0].prompt, 20, None)[2]
    for r in reqs:
        r.eos_token_id = eos
    _, _, alloc, _ = _simulate(reqs, num_pages=30, page_size=4, max_running=3, budget=8)
    for r in reqs:
        assert r.output == _alone(r.prompt, r.max_new_tokens, eos)
    assert reqs[0].finish_reason == "eos" and len(reqs[0].output) <= 3
    assert alloc.num_free_pages() == alloc.num_pages - 1


# ------------------------------------------------------------------------------------ hand-worked schedules
# The schedules below are worked out on paper from the policy in the scheduler's module docstring, one step
# at a time, and written out literally. A step is ``(mode, rows, preempted rids, free pages after the step's
# allocation)``; a row is ``(rid, start, length, what)`` with ``what`` one of "chunk", "chunk*" (a chunk that
# samples) and "decode". Rows are listed chunks first, then decode rows, as ``StepSchedule.rows`` holds them.
# Notation in the derivations: ``nc`` = num_computed, ``total`` = prompt + output (+ pending), ``free`` = free
# pages, ``budget`` = tokens left this step, ``room`` = slots in owned pages past ``nc`` plus free pages.


def _hand_requests(spec):
    """Requests ``rid -> (prompt length, max_new_tokens)``; the token values do not matter to the scheduler."""
    return [Request(rid=rid, prompt=[rid + 1] * n, max_new_tokens=m) for rid, (n, m) in spec.items()]


def _drive(reqs, *, usable_pages, page_size, max_running, budget, watermark=0, late=False):
    """Run the scheduler alone; ``late``: tokens resolve one step late (the serving loop), else at once.

    A sampled token is appended to ``output`` when it resolves; ``max_new_tokens`` reached -> finish.
    """
    pool = ReqToTokenPool(max_running + 1, 64, "cpu")  # a spare row: max_running, not the rows, caps admission
    alloc = PagedAllocator(usable_pages + 1, page_size, "cpu")  # + the padding page 0
    sched = Scheduler(pool, alloc, None, max_running=max_running, token_budget=budget, watermark_pages=watermark)
    for r in reqs:
        sched.add(r)

    def resolve(samplers):
        for req in samplers:
            if req.status is RequestStatus.FINISHED:
                continue
            req.pending -= 1
            req.output.append(100 + len(req.output))
            if len(req.output) >= req.max_new_tokens:
                sched.finish(req, "length")

    trace, prev = [], None
    while sched.has_work() or prev:
        s = sched.schedule() if sched.has_work() else None
        launched = None
        if s is not None:
            rows = [(r.request.rid, r.start, r.length,
                     "decode" if r.is_decode else ("chunk*" if r.samples else "chunk")) for r in s.rows]
            trace.append((s.mode.name, rows, [p.rid for p in s.preempted], alloc.num_free_pages()))
            launched = [r.request for r in s.rows if r.samples]
            for req in launched:
                req.pending += 1
        if late:
            if prev:
                resolve(prev)
            prev = launched
        elif launched:
            resolve(launched)
        assert len(trace) < 50, "no progress"
    assert alloc.num_free_pages() == usable_pages and pool.available_size() == pool.size
    return trace


def test_hand_worked_chunking_preemption_of_the_newest_and_readmission():
    """page 4, 5 usable pages, budget 8, max_running 3, tokens resolved at once.
    R0: prompt 6, 4 new.  R1: prompt 5, 4 new.  R2: prompt 3, 4 new.  R3: prompt 2, 1 new.

    step 1  no decode rows. Admit R0: min(6, budget 8) = 6, room 5*4 = 20 -> 6, samples (6 = total);
            2 pages, free 3, budget 2. Admit R1: min(5, 2) = 2 (chunked), room 12 -> 2; 1 page, free 2,
            budget 0. R2: budget 0 -> stop.                                                    EXTEND
    step 2  R0 decodes (nc 6 = total 7 - 1): slot 6 is on its 2nd page, no new page; budget 7.
            R1 continues: min(3, 7) = 3, room (1+2)*4 - 2 = 10 -> 3, samples; page 2 -> free 1, budget 4.
            Admit R2: min(3, 4) = 3, room 1*4 = 4 -> 3, samples; 1 page, free 0, budget 1.
            R3: 3 running = max_running -> stop.                                                 MIXED
    step 3  R0 (nc 7, slot 7), R1 (nc 5, slot 5), R2 (nc 3, slot 3) all decode inside their pages;
            R3: max_running.                                                                     DECODE
    step 4  decode rows R0 (slot 8: new page), R1 (slot 6: none), R2 (slot 4: new page): 2 pages needed,
            0 free -> preempt the NEWEST running request, R2 (seq 2; its page back, free 1; it goes to
            the HEAD of the queue: [R2, R3]); R0 + R1 need 1 <= 1. R2 (nc 0, total 3 + 2 = 5): room 0
            -> not admitted, and R3 does not overtake it.                                         DECODE
            R0 resolves its 4th token -> finished, its 3 pages back: free 3.
    step 5  R1 decodes (slot 7, in its 2nd page); budget 7. Admit R2 first: it recomputes
            prompt + output = 5 tokens, min(5, 7) = 5, room 3*4 -> 5, samples; 2 pages, free 1, budget 2.
            Admit R3: min(2, 2) = 2, room 4 -> 2, samples; 1 page, free 0.                        MIXED
            R1 resolves its 4th token, R3 its only one -> both finished: free 0 + 2 + 1 = 3.
    step 6  R2 decodes (slot 5, in its 2nd page).                                                 DECODE
    """
    reqs = _hand_requests({0: (6, 4), 1: (5, 4), 2: (3, 4), 3: (2, 1)})
    trace = _drive(reqs, usable_pages=5, page_size=4, max_running=3, budget=8)
    assert trace == [
        ("EXTEND", [(0, 0, 6, "chunk*"), (1, 0, 2, "chunk")], [], 2),
        ("MIXED", [(1, 2, 3, "chunk*"), (2, 0, 3, "chunk*"), (0, 6, 1, "decode")], [], 0),
        ("DECODE", [(0, 7, 1, "decode"), (1, 5, 1, "decode"), (2, 3, 1, "decode")], [], 0),
        ("DECODE", [(0, 8, 1, "decode"), (1, 6, 1, "decode")], [2], 0),
        ("MIXED", [(2, 0, 5, "chunk*"), (3, 0, 2, "chunk*"), (1, 7, 1, "decode")], [], 0),
        ("DECODE", [(2, 5, 1, "decode")], [], 3),
    ]
    assert [r.num_preemptions for r in reqs] == [0, 0, 1, 0]
    assert [len(r.output) for r in reqs] == [4, 4, 4, 1]


def test_hand_worked_watermark_and_max_running():
    """page 4, 6 usable pages, budget 20, max_running 2, watermark 2, tokens resolved at once.
    R0: prompt 8, 3 new.  R1: prompt 9, 2 new.  R2: prompt 2, 2 new.

    step 1  Admit R0 (nothing running: no watermark): min(8, 20) = 8, room 24 -> 8, samples; 2 pages,
            free 4, budget 12. Admit R1: min(9, 12) = 9 but room (4 - watermark 2)*4 = 8 -> 8 (the
            watermark cuts the chunk); 2 pages, free 2. R2: 2 running = max_running -> stop.   EXTEND
    step 2  R0 decodes (slot 8: new page, free 1). R1's last prompt token: room (2+1)*4 - 8 = 4 -> 1,
            samples (slot 8: new page, free 0). R2: max_running.                               MIXED
    step 3  R0 (slot 9) and R1 (slot 9) decode in their 3rd pages.                              DECODE
            R0 and R1 resolve their last tokens: both finished, free 6.
    step 4  Admit R2: 2 tokens, samples.                                                         EXTEND
    step 5  R2 decodes.                                                                          DECODE
    """
    reqs = _hand_requests({0: (8, 3), 1: (9, 2), 2: (2, 2)})
    trace = _drive(reqs, usable_pages=6, page_size=4, max_running=2, budget=20, watermark=2)
    assert trace == [
        ("EXTEND", [(0, 0, 8, "chunk*"), (1, 0, 8, "chunk")], [], 2),
        ("MIXED", [(1, 8, 1, "chunk*"), (0, 8, 1, "decode")], [], 0),
        ("DECODE", [(0, 9, 1, "decode"), (1, 9, 1, "decode")], [], 0),
        ("EXTEND", [(2, 0, 2, "chunk*")], [], 5),
        ("DECODE", [(2, 2, 1, "decode")], [], 5),
    ]


def test_hand_worked_first_request_ignores_the_watermark_and_max_running_caps_admission():
    """Two runs, tokens resolved at once, page 4.

    A: 6 usable pages, budget 20, max_running 2, watermark 2.  R0: prompt 17, 2 new.  R1: prompt 4, 1 new.
       R2: prompt 2, 1 new.
    step 1  Admit R0 (nothing running: no watermark): min(17, 20) = 17, room 6*4 = 24 -> 17, samples;
            5 pages, free 1, budget 3. R1: room (1 - watermark 2 -> 0)*4 = 0 -> stop.           EXTEND
    step 2  R0 decodes (slot 17, in its 5th page). R1: room 0 -> stop.                          DECODE
            R0 resolves its 2nd token -> finished, free 6.
    step 3  Admit R1 (nothing running: no watermark): 4 tokens, samples; 1 page, free 5, budget 16.
            Admit R2: min(2, 16) = 2, room (5 - 2)*4 = 12 -> 2, samples; 1 page, free 4.       EXTEND

    B: 10 usable pages, budget 16, max_running 2, no watermark, 3 request rows. R0, R1, R2: prompt 3, 2 new.
    step 1  Admit R0 (3 tokens, samples; free 9, budget 13) and R1 (free 8, budget 10); R2: 2 running
            = max_running -> stop, though pages, budget and a request row are free.              EXTEND
    step 2  R0, R1 decode (slot 3, in their page); then both finished, free 10.                  DECODE
    step 3  Admit R2.                                                                            EXTEND
    step 4  R2 decodes.                                                                          DECODE
    """
    trace = _drive(_hand_requests({0: (17, 2), 1: (4, 1), 2: (2, 1)}), usable_pages=6, page_size=4,
                   max_running=2, budget=20, watermark=2)
    assert trace == [
        ("EXTEND", [(0, 0, 17, "chunk*")], [], 1),
        ("DECODE", [(0, 17, 1, "decode")], [], 1),
        ("EXTEND", [(1, 0, 4, "chunk*"), (2, 0, 2, "chunk*")], [], 4),
    ]
    trace = _drive(_hand_requests({0: (3, 2), 1: (3, 2), 2: (3, 2)}), usable_pages=10, page_size=4,
                   max_running=2, budget=16)
    assert trace == [
        ("EXTEND", [(0, 0, 3, "chunk*"), (1, 0, 3, "chunk*")], [], 8),
        ("DECODE", [(0, 3, 1, "decode"), (1, 3, 1, "decode")], [], 8),
        ("EXTEND", [(2, 0, 3, "chunk*")], [], 9),
        ("DECODE", [(2, 3, 1, "decode")], [], 9),
    ]


def test_hand_worked_nothing_fits_preempts_the_newest_with_tokens_resolved_late():
    """page 4, 3 usable pages, budget 11, max_running 2, tokens resolved ONE STEP LATE (the serving loop).
    R0: prompt 7, 1 new.  R1: prompt 5, 1 new.

    step 1  Admit R0: 7 tokens, samples (pending 1 = max_new: it will not decode); 2 pages, free 1,
            budget 4. Admit R1: min(5, 4) = 4, room 4 -> 4; its page is full, free 0.          EXTEND
    step 2  (R0's token is still in flight.) No decode rows: R0 has sampled its max_new_tokens, R1 has
            not sampled. R1 continues: room (1+0)*4 - 4 = 0 -> nothing. R0 is not a candidate (pending).
            Nothing scheduled while R1 wants to run -> preempt the NEWEST running request: R1 (its page
            back, free 1) and try again: admit R1 from the head of the queue, min(5, 11) = 5, room 4
            -> 4, the same chunk again; free 0.                                                  EXTEND
            Then step 1 resolves: R0 finished, its 2 pages back: free 2.
    step 3  R1's last prompt token: room (1+2)*4 - 4 = 8 -> 1, samples; a new page, free 1.    EXTEND
    step 4  R1 has sampled its max_new_tokens: nothing to schedule; step 3 resolves, R1 finished.
    """
    reqs = _hand_requests({0: (7, 1), 1: (5, 1)})
    trace = _drive(reqs, usable_pages=3, page_size=4, max_running=2, budget=11, late=True)
    assert trace == [
        ("EXTEND", [(0, 0, 7, "chunk*"), (1, 0, 4, "chunk")], [], 0),
        ("EXTEND", [(1, 0, 4, "chunk")], [1], 0),
        ("EXTEND", [(1, 4, 1, "chunk*")], [], 1),
    ]
    assert [r.num_preemptions for r in reqs] == [0, 1]


def test_add_refuses_what_can_never_run():
    pool, alloc = ReqToTokenPool(2, 32, "cpu"), PagedAllocator(5, 4, "cpu")
    sched = Scheduler(pool, alloc, None, max_running=2, token_budget=8)
    with pytest.raises(ValueError, match="max_context"):
        sched.add(Request(rid=0, prompt=[1] * 30, max_new_tokens=5))
    with pytest.raises(ValueError, match="pages"):
        sched.add(Request(rid=1, prompt=[1] * 14, max_new_tokens=5))  # 19 tokens: 5 pages > 4
    with pytest.raises(ValueError, match="empty"):
        sched.add(Request(rid=2, prompt=[], max_new_tokens=5))
    with pytest.raises(ValueError, match="max_running"):
        Scheduler(pool, alloc, None, max_running=3, token_budget=8)
    sched.add(Request(rid=3, prompt=[1], max_new_tokens=1))
    with pytest.raises(ValueError, match="rid"):
        sched.add(Request(rid=3, prompt=[1], max_new_tokens=1))


def test_alloc_for_requests_equals_one_row_at_a_time():
    """The batched allocation (one scatter) writes what alloc_for_request writes row by row."""
    a_pool, b_pool = ReqToTokenPool(4, 64, "cpu"), ReqToTokenPool(4, 64, "cpu")
    a_pool.alloc(4), b_pool.alloc(4)  # the rows are held: the allocator serves only held rows
    a, b = PagedAllocator(40, 4, "cpu"), PagedAllocator(40, 4, "cpu")
    for rows, starts, counts in [([0, 2, 3], [0, 0, 0], [5, 1, 9]), ([0, 2], [5, 1], [1, 1]),
                                 ([3, 0, 2], [9, 6, 2], [7, 1, 3])]:
        got = a.alloc_for_requests(a_pool, rows, starts, counts)
        want = torch.cat([b.alloc_for_request(b_pool, r, s, n) for r, s, n in zip(rows, starts, counts)])
        assert torch.equal(got, want)
        assert torch.equal(a_pool.req_to_token, b_pool.req_to_token)
    small, small_pool = PagedAllocator(4, 4, "cpu"), ReqToTokenPool(2, 64, "cpu")  # 3 usable pages
    small_pool.alloc(2)
    with pytest.raises(ValueError, match="pages"):
        small.alloc_for_requests(small_pool, [0, 1], [0, 0], [5, 5])  # 4 pages
    assert small.num_free_pages() == 3
    free = a.num_free_pages()
    with pytest.raises(ValueError):
        a.alloc_for_requests(a_pool, [1, 1], [0, 0], [1, 1])
    assert a.num_free_pages() == free
