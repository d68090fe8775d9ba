"""The split-KV schedule re-planned on the device: the checks of a re-plan and its torch form.

``ops.replan_splitkv_schedule`` writes ``splitkv_plan.plan_splits`` of the DEVICE lengths into a schedule's buffers,
reading no host value, so that a captured CUDA graph plans each replay's splits from the lengths it is replayed with.
``check_replan`` checks its arguments before any kernel; then one Triton program does it
(``splitkv_replan_triton.py``) or, on a CPU or without Triton, ``replan_reference``: the same arithmetic in
fixed-shape tensor ops — Σ L_b, chunk0, the fit (a fixed number of bisection steps, and the rounds' model of both
cuts), per request n_b and size_b, their prefix sum as ``split_offsets``, and work row w belongs to the request b
with off[b] <= w < off[b + 1], split w - off[b] of it; or, with ``KernelConfig.even_splits``, the even cut's
shares and their near-equal splits.
"""

from __future__ import annotations

import torch

from .splitkv_plan import SplitKVSchedule, capacity_for

Tensor = torch.Tensor


def check_replan(seqlens, schedule) -> None:
    """Host checks of a device re-plan (``ops.replan_splitkv_schedule``), before any kernel; values are not read.

    seqlens ``[bs] int32`` on the schedule's device (the step's ``cache_seqlens``; a capture's padding rows
    included), bs <= max_batch and the capacity holds any plan of bs requests (``capacity_for``)."""
    if not isinstance(schedule, SplitKVSchedule):
        raise TypeError(f"schedule must be a SplitKVSchedule (from get_splitkv_schedule), got {type(schedule).__name__}")
    if schedule.target < 1:
        raise ValueError("schedule carries no planner parameters (target): plan it with get_splitkv_schedule")
    if not isinstance(seqlens, torch.Tensor):
        raise TypeError(f"seqlens must be a tensor, got {type(seqlens).__name__}")
    if seqlens.dim() != 1 or seqlens.dtype != torch.int32:
        raise ValueError(f"seqlens must be a 1-D int32 tensor, got {seqlens.dtype} shape {tuple(seqlens.shape)}")
    if seqlens.device != schedule.device:
        raise ValueError(f"seqlens must be on the schedule's device {schedule.device}, got {seqlens.device}")
    bs = seqlens.shape[0]
    if bs > schedule.max_batch:
        raise ValueError(f"seqlens has {bs} requests but the schedule holds at most max_batch={schedule.max_batch}")
    if schedule.capacity < capacity_for(bs, schedule.target):
        raise ValueError(f"the schedule holds {schedule.capacity} splits, a plan of {bs} requests may need "
                         f"{capacity_for(bs, schedule.target)} (target {schedule.target} + bs): allocate it with "
                         "max_batch")


def _cdiv(a: Tensor, b) -> Tensor:
    return torch.div(a + b - 1, b, rounding_mode="floor")


FIT_STEPS = 32  # bisection steps of the device planners' fit: the range holds < 2^32 granules


def _fit_chunk_reference(lens: Tensor, chunk0: Tensor, target: int, granule: int) -> Tensor:
    """``fit_chunk`` in fixed-shape tensor ops (0-d int64 tensors, no host value read): ``FIT_STEPS`` bisection
    steps, each a no-op once the range is one granule wide."""
    def splits(g):
        return _cdiv(lens, g * granule).sum()

    lo = chunk0 // granule
    hi = lo + lo // 4
    search = (splits(lo) > target) & (splits(hi) <= target)
    for _ in range(FIT_STEPS):
        mid = (lo + hi) // 2
        fits = splits(mid) <= target
        live = hi - lo > 1
        lo, hi = torch.where(live & ~fits, mid, lo), torch.where(live & fits, mid, hi)
    return torch.where(search, hi * granule, chunk0)


def _owner_reference(n: Tensor, w: Tensor):
    """(inclusive split counts, owner, k) of rows ``w`` for per-request split counts ``n``: the request b with
    off[b] <= w < off[b + 1], and w's split of it, k = w - off[b]."""
    incl = torch.cumsum(n, 0)
    owner = torch.searchsorted(incl, w, right=True).clamp(max=n.shape[0] - 1)
    return incl, owner, w - (incl - n)[owner]


def _rows_reference(lens: Tensor, chunk: Tensor, granule: int, w: Tensor):
    """``_cut`` at ``chunk`` as tensors over the row indices ``w``: (owner, start, end — of every row, live or not —,
    the live count [1], the per-request inclusive split counts)."""
    n = _cdiv(lens, chunk)
    size = _cdiv(_cdiv(lens, n.clamp(min=1)), granule) * granule
    incl, owner, k = _owner_reference(n, w)
    start = k * size[owner]
    return owner, start, torch.minimum(lens[owner], start + size[owner]), incl[-1:], incl


def _rows_even_reference(lens: Tensor, target: int, granule: int, min_split: int, w: Tensor):
    """``_cut_even`` as tensors over the row indices ``w`` (``_rows_reference``'s outputs)."""
    units = _cdiv(lens, granule)
    share = target * units // units.sum().clamp(min=1)
    n = torch.where(lens > 0, torch.minimum(torch.minimum(units, (lens // max(min_split, 1)).clamp(min=1)), share)
                    .clamp(min=1), 0)
    incl, owner, k = _owner_reference(n, w)
    q, r = units // n.clamp(min=1), units % n.clamp(min=1)
    g0 = k * q[owner] + torch.minimum(k, r[owner])
    g1 = g0 + q[owner] + (k < r[owner]).to(torch.int64)
    return owner, g0 * granule, torch.minimum(lens[owner], g1 * granule), incl[-1:], incl


def _makespan_reference(owner, start, end, num, incl, w: Tensor, target: int) -> Tensor:
    """``rounds_makespan`` of the rows (``_rows_reference``), as a 0-d tensor."""
    del owner, incl
    sizes = end - start
    live = w < num
    first, later = live & (w < target), live & (w >= target)
    big = torch.iinfo(torch.int64).max
    first_max = torch.where(first, sizes, 0).max()
    first_min = torch.where(first, sizes, big).min()
    later_max = torch.where(later, sizes, 0).max()
    return torch.where(later.any(), torch.maximum(first_max, first_min + later_max), first_max)


def replan_reference(seqlens: Tensor, schedule: SplitKVSchedule) -> SplitKVSchedule:
    """``plan_splits`` of the device lengths written into ``schedule`` by tensor ops on fixed shapes (no host value
    read: graph-legal on a GPU); the torch form of the Triton planner (``splitkv_replan_triton.replan_schedule``).
    Negative lengths plan as 0. Checked by :func:`check_replan` first (the op does it)."""
    dev, cap, mb = schedule.device, schedule.capacity, schedule.max_batch
    lens = seqlens.to(torch.int64).clamp(min=0)
    bs = lens.shape[0]
    w = torch.arange(cap, dtype=torch.int64, device=dev)
    offsets = torch.zeros(mb + 1, dtype=torch.int64, device=dev)
    work = torch.zeros(cap, 4, dtype=torch.int64, device=dev)
    work[:, 3] = w
    if bs:
        g, target = schedule.granule, schedule.target
        if schedule.config.even_splits:
            owner, start, end, num, incl = _rows_even_reference(lens, target, g, schedule.min_split_tokens, w)
        else:
            chunk0 = _cdiv(_cdiv(lens.sum(), target).clamp(min=max(schedule.min_split_tokens, 1)), g) * g
            owner, start, end, num, incl = _rows_reference(lens, chunk0, g, w)
            if schedule.config.fit_splits:
                fitted = _rows_reference(lens, _fit_chunk_reference(lens, chunk0, target, g), g, w)
                take = _makespan_reference(*fitted, w, target) < _makespan_reference(owner, start, end, num, incl, w,
                                                                                     target)
                owner, start, end, num, incl = (torch.where(take, b, a)
                                                for a, b in zip((owner, start, end, num, incl), fitted))
        offsets[1 : bs + 1] = incl
        offsets[bs + 1 :] = num
        live = w < num
        work[:, 0] = torch.where(live, owner, 0)
        work[:, 1] = torch.where(live, start, 0)
        work[:, 2] = torch.where(live, end, 0)
        schedule.num_work.copy_(num)
    else:
        schedule.num_work.zero_()
    schedule.work.copy_(work)
    schedule.split_offsets.copy_(offsets)
    schedule.chunk, schedule.planned_work, schedule.planned_batch = None, None, bs
    return schedule
