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


def test_admission_never_exceeds_the_pool_and_newest_is_preempted():
    reqs = _requests(5, seed=9, max_prompt=8, max_new=20)
    for r in reqs:
        r.prompt = r.prompt[:4] + [1] * (8 - len(r.prompt[:4]))  # 8-token prompts, 20 new: 28 tokens, 7 pages
        r.max_new_tokens = 20
    sched, steps, alloc, _ = _simulate(reqs, num_pages=11, page_size=4, max_running=5, budget=64)
    # 10 usable pages: two 8-token prompts fit (2 pages each) but not their growth to 7 pages each
    assert sum(r.num_preemptions for r in reqs) > 0
    first_victim = next(s.preempted[0] for s in steps if s.preempted)
    running_then = [r for r in reqs if r.seq <= first_victim.seq]
    assert first_victim.seq == max(r.seq for r in running_then)
    for r in reqs:
        assert r.output == _alone(r.prompt, 20, None)


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
