"""The split-KV schedule planned on the device: one Triton program (``triton`` is imported only by the kernel modules).

``replan_schedule`` writes ``splitkv_plan.plan_splits`` of the DEVICE lengths into a schedule's buffers — the work
rows ``(request, start, end, slot)``, their count and the per-request split offsets — reading no host value, so a
captured CUDA graph plans each replay's splits from the lengths it is replayed with. Its torch form (the same math in
fixed-shape tensor ops) is ``splitkv_replan.replan_reference``; ``ops.replan_splitkv_schedule`` checks the arguments
(``splitkv_replan.check_replan``) and picks one of the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .splitkv_plan import SplitKVSchedule, _next_pow2

Tensor = torch.Tensor


@triton.jit
def _cut(lens, chunk, granule):
    """Per request: split count n_b, split size and the inclusive / exclusive prefix sums of n_b at ``chunk``."""
    n = ((lens + chunk - 1) // chunk).to(tl.int32)
    size = ((lens + tl.maximum(n, 1) - 1) // tl.maximum(n, 1) + granule - 1) // granule * granule
    incl = tl.cumsum(n, 0)
    return n, size, incl, incl - n


@triton.jit
def _owner(w, incl, excl, offs_b):
    """(owner, its one-hot [rows, requests], k) of work rows ``w``: the request b with off[b] <= w < off[b + 1], and
    w's split of it, k = w - off[b]."""
    owner = tl.sum((incl[None, :] <= w[:, None]).to(tl.int32), 1)
    pick = offs_b[None, :] == owner[:, None]
    return owner, pick, (w - _at(pick, excl)).to(tl.int64)


@triton.jit
def _at(pick, values):
    """``values[owner]`` of each row (``_owner``'s one-hot)."""
    return tl.sum(tl.where(pick, values[None, :], 0), 1)


@triton.jit
def _rows(w, lens, size, incl, excl, offs_b):
    """(owner, start, end) of work rows ``w`` for a cut (``_cut``)."""
    owner, pick, k = _owner(w, incl, excl, offs_b)
    size_w = _at(pick, size)
    start = k * size_w
    return owner, start, tl.minimum(_at(pick, lens), start + size_w)


@triton.jit
def _rows_even(w, lens, units, n, incl, excl, granule, offs_b):
    """(owner, start, end) of work rows ``w`` for the even cut (``splitkv_plan._cut_even``): split k of request b
    covers granules k·q + min(k, r) .. + q + (k < r), q, r = divmod(u_b, n_b)."""
    owner, pick, k = _owner(w, incl, excl, offs_b)
    u_w = _at(pick, units)
    n_w = tl.maximum(_at(pick, n), 1).to(tl.int64)
    q = u_w // n_w
    r = u_w % n_w
    g0 = k * q + tl.minimum(k, r)
    g1 = g0 + q + (k < r).to(tl.int64)
    return owner, g0 * granule, tl.minimum(_at(pick, lens), g1 * granule)


@triton.jit
def _makespan(lens, chunk, granule, target, capacity, offs_b, BLOCK_W: tl.constexpr):
    """``splitkv_plan.rounds_makespan`` of the cut at ``chunk``: over its rows in ``BLOCK_W`` blocks, the first
    round's longest and shortest split and the longest later one."""
    n, size, incl, excl = _cut(lens, chunk, granule)
    num = tl.sum(n, 0)
    first_max = tl.zeros([], tl.int64)
    first_min = tl.full([], 2**62, tl.int64)
    later_max = tl.full([], -1, tl.int64)
    for w0 in range(0, capacity, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        owner, start, end = _rows(w, lens, size, incl, excl, offs_b)
        sizes = end - start
        first = (w < num) & (w < target)
        later = (w < num) & (w >= target)
        first_max = tl.maximum(first_max, tl.max(tl.where(first, sizes, 0), 0))
        first_min = tl.minimum(first_min, tl.min(tl.where(first, sizes, 2**62), 0))
        later_max = tl.maximum(later_max, tl.max(tl.where(later, sizes, -1), 0))
    return tl.where(later_max >= 0, tl.maximum(first_max, first_min + later_max), first_max)


@triton.jit
def _splitkv_plan_kernel(
    SeqLens, Work, NumWork, SplitOffsets, bs, capacity, max_batch, target, granule, min_split,
    BS_PAD: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr, FIT: tl.constexpr,
):
    """One program: ``plan_splits`` of the device lengths into the schedule's buffers (``replan_reference``'s math;
    ``EVEN``: the even cut)."""
    offs_b = tl.arange(0, BS_PAD)
    lens = tl.maximum(tl.load(SeqLens + offs_b, mask=offs_b < bs, other=0), 0).to(tl.int64)  # rows >= bs: no split
    if EVEN:
        units = (lens + granule - 1) // granule
        share = target * units // tl.maximum(tl.sum(units, 0), 1)
        n = tl.minimum(tl.minimum(units, tl.maximum(lens // tl.maximum(min_split, 1), 1)), share)
        n = tl.where(lens > 0, tl.maximum(n, 1), 0).to(tl.int32)
        incl = tl.cumsum(n, 0)
    else:
        n, size, incl, _ = _cut(lens, _fitted_chunk(lens, target, granule, min_split, capacity, offs_b, BLOCK_W, FIT),
                                granule)
    num = tl.sum(n, 0)
    tl.store(NumWork, num)
    tl.store(SplitOffsets, 0)
    tl.store(SplitOffsets + 1 + offs_b, incl, mask=offs_b < max_batch)  # past bs: incl = num (no split)
    for w0 in range(0, capacity, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        if EVEN:
            owner, start, end = _rows_even(w, lens, units, n, incl, incl - n, granule, offs_b)
        else:
            owner, start, end = _rows(w, lens, size, incl, incl - n, offs_b)
        live = w < num
        row = Work + w.to(tl.int64) * 4
        ok = w < capacity
        tl.store(row, tl.where(live, owner, 0), mask=ok)
        tl.store(row + 1, tl.where(live, start, 0).to(tl.int32), mask=ok)
        tl.store(row + 2, tl.where(live, end, 0).to(tl.int32), mask=ok)
        tl.store(row + 3, w, mask=ok)


@triton.jit
def _fitted_chunk(lens, target, granule, min_split, capacity, offs_b, BLOCK_W: tl.constexpr, FIT: tl.constexpr):
    """The chunked cut's chunk: chunk0, or (``FIT``) the fit's chunk1 where it ends sooner by the rounds' model
    (``splitkv_plan.fit_chunk`` / ``rounds_makespan``)."""
    total = tl.sum(lens, 0)
    chunk = tl.maximum((total + target - 1) // target, tl.maximum(min_split, 1))
    chunk = (chunk + granule - 1) // granule * granule
    if FIT:
        lo = chunk // granule
        hi = lo + lo // 4
        if (tl.sum((lens + lo * granule - 1) // (lo * granule), 0) > target) & \
                (tl.sum((lens + hi * granule - 1) // (hi * granule), 0) <= target):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                fits = tl.sum((lens + mid * granule - 1) // (mid * granule), 0) <= target
                lo, hi = tl.where(fits, lo, mid), tl.where(fits, mid, hi)
            if _makespan(lens, hi * granule, granule, target, capacity, offs_b, BLOCK_W) < \
                    _makespan(lens, chunk, granule, target, capacity, offs_b, BLOCK_W):
                chunk = hi * granule
    return chunk


def replan_schedule(seqlens: Tensor, schedule: SplitKVSchedule) -> None:
    """Re-plan ``schedule`` from the device ``seqlens`` (checked by ``splitkv_replan.check_replan``): one launch, no
    host value read, capturable. The host records become the device plan's (``chunk`` / ``planned_work`` None)."""
    bs_pad = max(16, _next_pow2(max(schedule.max_batch, seqlens.shape[0], 1)))
    _splitkv_plan_kernel[(1,)](
        seqlens, schedule.work, schedule.num_work, schedule.split_offsets, seqlens.shape[0], schedule.capacity,
        schedule.max_batch, schedule.target, schedule.granule, schedule.min_split_tokens,
        BS_PAD=bs_pad, BLOCK_W=max(16, min(128, 4096 // bs_pad)), EVEN=schedule.config.even_splits,
        FIT=schedule.config.fit_splits, num_warps=4,
    )
    schedule.chunk, schedule.planned_work, schedule.planned_batch = None, None, seqlens.shape[0]
