"""Split schedule of the split-KV MLA decode kernel: a pure-host planner and its graph-safe buffers.

The kernel (``splitkv_triton.py``) cuts the KV of every request into *splits* (contiguous token ranges)
and runs one program per (split, head tile), so that one request at long context still fills every
SM. This module decides the cut from the **host copy** of the lengths (no device->host sync):

    total   = Σ_b L_b                                        (KV tokens of the step)
    target  = max(1, floor(num_sms · waves / head_tiles))    (splits that fill the GPU once)
    chunk0  = round_up(max(min_split_tokens, ceil(total / target)), granule)
    chunk1  = the least multiple of granule in [chunk0, chunk0 + granule · floor(chunk0 / granule / 4)]
              with Σ_b ceil(L_b / chunk1) <= target, if chunk0 gives more splits than that
    chunk   = chunk1 where the rounds' model says its plan ends sooner, else chunk0     (the fit, below;
              ``KernelConfig.fit_splits`` off: chunk0)
    n_b     = ceil(L_b / chunk)                              (0 for an empty request)
    size_b  = round_up(ceil(L_b / n_b), granule)             (<= chunk: near-equal splits)
    splits of b = [s, min(L_b, s + size_b)) for s = 0, size_b, 2·size_b, ...

``granule`` = max(page_size, ``SPLIT_GRANULE``): split starts fall on whole pages and whole key blocks. With
``KernelConfig.even_splits`` the cut is another (``_cut_even``: each request's share of the target in splits a key
block apart, on ``block_n`` starts).
Every token of every request lies in exactly one split, every split holds at most ``chunk`` tokens,
and the number of splits is at most ``target + bs`` (Σ ceil(L_b/chunk0) <= total/chunk0 + bs), which
is the capacity a CUDA-graph schedule reserves for a batch of ``max_batch`` requests.

**The fit.** ``target`` is what the programs' slots hold in the rounds ``waves`` asks for (at two waves of the 16-head
kernel, the 2 programs an SM holds at once: one round). chunk0 alone often gives a few splits more — 16 requests of
64k over 264 slots: chunk0 4032, 17 splits each, 272 programs — and those few then run after the rest, alone on their
SMs, a whole split's time at a rate latency bounds (the H100's kernel-alone figures of 2026-12-07, 16 heads, against
the bytes' time at 3.0 TB/s: 1.24-1.31x at each such shape — bs 16 x 64k, bs 64 x 16k-64k —, 1.09-1.17x at bs 16 x
16k-32k, where 256 splits fit; docs/DECODE_KERNEL.md). So the chunk may grow, by at most a quarter, to the least that
fits: 4096, 16 splits each, 256 programs. It does where a model of the rounds (``rounds_makespan``, in keys) says the
fitted plan ends sooner: the first ``target`` splits in launch order (work rows are in request order) hold the slots
at once, a later split starts when the shortest of them ends — max(first-round longest, first-round shortest +
longest later split) against the fitted plan's longest split. 16 x 64k: 3072 + 3904 = 6976 against 4096, so fitted;
4 x 64k followed by 20 requests of 100 keys: the 12 splits past the target are short ones started early (1024 in
all), so chunk0 stays rather than every long split growing to 1088. Where a quarter cannot fit (many short
requests, one split each), chunk0 stays as well.

Worked example (granule 64, min_split_tokens 128, target 8): lens = [1000, 0, 70]
    total 1070 -> ceil(1070/8) = 134 -> chunk0 192: 6 + 1 = 7 splits <= 8, chunk 192
    b=0: n 6, size round_up(167, 64) = 192 -> [0,192) [192,384) [384,576) [576,768) [768,960) [960,1000)
    b=1: no split;  b=2: n 1, size 128 -> [0,70)
    work = [(0,0,192,0) … (0,960,1000,5), (2,0,70,6)], split_offsets = [0, 6, 6, 7]

Device layout (``SplitKVSchedule``): ``work [capacity, 4] int32`` rows (request, token_start, token_end,
slot) — ``slot`` is the row of the partial-result workspace the split writes, contiguous per request;
``num_work [1] int32`` the live rows; ``split_offsets [max_batch + 1] int32`` the slots of request b
are ``split_offsets[b] : split_offsets[b + 1]``. Rows past ``num_work`` are (0, 0, 0, own index): an
empty range writing a slot nobody reads; offsets past the planned batch repeat ``num_work`` (those
requests have no split: output 0, lse -inf). The kernels read the counts from these buffers, so a
captured graph replays any schedule written into them.

Two ways to write them for a replay, same plan: ``copy_`` of a host plan (a host->device copy), or
**re-planned on the device** from the device lengths (``ops.replan_splitkv_schedule``: ``splitkv_replan.py``) — no
host plan, no host value read, legal inside a CUDA graph, so a captured step plans its own splits from the lengths
it is replayed with (as FlashMLA's schedule is).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .splitkv_config import KernelConfig, choose_config

Tensor = torch.Tensor

SPLIT_GRANULE = 64  # tokens: split boundaries are multiples of this and of the page size
MIN_SPLIT_TOKENS = 128  # no split shorter than this unless the request itself is
DEFAULT_NUM_SMS = 132  # H200; used when the schedule is planned without a CUDA device
MAX_BLOCK_ROWS = 64  # head rows x query tokens one program holds (tl.dot M dimension)
MIN_BLOCK_ROWS = 16  # tl.dot needs M >= 16


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def head_block(num_heads: int, num_q_tokens: int, max_rows: int = MAX_BLOCK_ROWS) -> int:
    """Heads per program: a power of two with ``head_block · next_pow2(sq)`` rows in [16, max_rows] (when possible)."""
    sq_pad = _next_pow2(num_q_tokens)
    block = min(_next_pow2(num_heads), max(1, max_rows // sq_pad))
    return max(block, max(1, MIN_BLOCK_ROWS // sq_pad))


def head_tiles(num_heads: int, num_q_tokens: int, max_rows: int = MAX_BLOCK_ROWS) -> int:
    """Programs per split: ``ceil(H / head_block)``."""
    return -(-num_heads // head_block(num_heads, num_q_tokens, max_rows))


def target_splits(num_sms: int, tiles: int, waves: float) -> int:
    """Splits that give every SM ``waves`` programs: ``max(1, floor(num_sms · waves / tiles))``."""
    return max(1, int(num_sms * waves) // max(1, tiles))


def plan_splits(
    lens: Sequence[int], *, target: int, granule: int, min_split_tokens: int = MIN_SPLIT_TOKENS, even: bool = False,
    fit: bool = True,
) -> Tuple[List[Tuple[int, int, int, int]], List[int], int]:
    """Cut requests of ``lens`` tokens into splits (pure host; see the module docstring; ``even``: the even cut,
    ``KernelConfig.even_splits``; ``fit``: the fit of the chunked cut, ``KernelConfig.fit_splits``).

    Returns (work rows (request, start, end, slot), split_offsets [bs + 1], chunk: the longest split).
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    if granule < 1:
        raise ValueError(f"granule must be >= 1, got {granule}")
    if any(L < 0 for L in lens):
        b = next(b for b, L in enumerate(lens) if L < 0)
        raise ValueError(f"seqlens[{b}] must be >= 0, got {lens[b]}")
    if even:
        work = _cut_even(lens, target, granule, min_split_tokens)
        chunk = max((e - s for _, s, e, _ in work), default=granule)
    else:
        work, chunk = _cut_fitted(lens, target, granule, min_split_tokens, fit)
    counts = [0] * len(lens)
    for b, *_ in work:
        counts[b] += 1
    return work, list(itertools.accumulate(counts, initial=0)), chunk


def _cut_fitted(lens: Sequence[int], target: int, granule: int, min_split_tokens: int, fit: bool = True):
    """(work rows, chunk) of the chunked cut: at chunk0, or (``fit``) at the fit's chunk1 where ``rounds_makespan``
    says that plan ends sooner (module docstring)."""
    chunk = -(-max(min_split_tokens, -(-sum(lens) // target), 1) // granule) * granule
    work = _cut(lens, chunk, granule)
    fitted = fit_chunk(lens, chunk, target, granule) if fit else chunk
    if fitted != chunk:
        other = _cut(lens, fitted, granule)
        if rounds_makespan([e - s for _, s, e, _ in other], target) < \
                rounds_makespan([e - s for _, s, e, _ in work], target):
            return other, fitted
    return work, chunk


def _cut(lens: Sequence[int], chunk: int, granule: int) -> List[Tuple[int, int, int, int]]:
    """The work rows of ``lens`` cut at ``chunk`` (``n_b`` near-equal splits of ``size_b`` each, in request order)."""
    work: List[Tuple[int, int, int, int]] = []
    for b, L in enumerate(lens):
        if L:
            n = -(-L // chunk)
            size = -(-(-(-L // n)) // granule) * granule
            for s in range(0, L, size):
                work.append((b, s, min(L, s + size), len(work)))
    return work


def _cut_even(lens: Sequence[int], target: int, granule: int, min_split_tokens: int) -> List[Tuple[int, int, int, int]]:
    """The even cut: request b (u_b = ceil(L_b / granule) granules of the U in all) gets n_b = floor(target · u_b / U)
    splits, at least 1, at most u_b and at most L_b / min_split_tokens (at least 1), of q or q + 1 granules (q, r =
    divmod(u_b, n_b): the first r take q + 1) — every split of the step within a granule of the others where the
    lengths allow, as many in all as the target (up to the rounding down, and one for each request too short for its
    share)."""
    units = [-(-L // granule) for L in lens]
    total = sum(units)
    work: List[Tuple[int, int, int, int]] = []
    for b, (L, u) in enumerate(zip(lens, units)):
        if L:
            n = max(1, min(u, max(1, L // min_split_tokens), target * u // total))
            q, r = divmod(u, n)
            for k in range(n):
                g0 = k * q + min(k, r)
                work.append((b, g0 * granule, min(L, (g0 + q + (k < r)) * granule), len(work)))
    return work


def rounds_makespan(sizes: Sequence[int], target: int) -> int:
    """The fit's model of a plan's time, in keys: the first ``target`` splits (in launch order) take the slots at
    once; a later one starts when the first slot frees (the shortest of them ends) — max(first-round max,
    first-round min + the longest later split); a plan within the target is its longest split."""
    if not sizes:
        return 0
    first, later = sizes[:target], sizes[target:]
    return max(max(first), min(first) + max(later)) if later else max(first)


def fit_chunk(lens: Sequence[int], chunk0: int, target: int, granule: int) -> int:
    """chunk1 of the fit (module docstring): the least multiple of ``granule`` in [chunk0, chunk0 + granule ·
    floor(chunk0 / granule / 4)] that cuts ``lens`` into at most ``target`` splits, where chunk0 does not and one does;
    else ``chunk0`` — by bisection on the split count, which only falls as the chunk grows (``splitkv_replan`` and
    the Triton planner run the same steps). ``plan_splits`` then takes it where ``rounds_makespan`` says so."""
    def splits(g):  # splits of a chunk of g granules
        return sum(-(-L // (g * granule)) for L in lens)

    lo = chunk0 // granule
    hi = lo + lo // 4
    if splits(lo) <= target or splits(hi) > target:
        return chunk0
    while hi - lo > 1:  # splits(lo) > target >= splits(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if splits(mid) <= target else (mid, hi)
    return hi * granule


def capacity_for(max_batch: int, target: int) -> int:
    """Work rows a schedule needs for any batch of <= ``max_batch`` requests planned with ``target``."""
    return max(1, target + max_batch)


@dataclass
class SplitKVSchedule:
    """The split schedule of one decode step, in buffers the kernels read (see the module docstring).

    Plan once per step (``ops.get_splitkv_schedule``), reuse in every layer. For CUDA graphs allocate
    one schedule with ``max_batch`` / capacity for the largest batch, capture with it, and before each
    replay ``copy_`` a freshly planned schedule into it (host->device copies only, no sync).
    """

    work: Tensor  # [capacity, 4] int32 (request, token_start, token_end, slot), kernel device
    num_work: Tensor  # [1] int32, live rows of ``work``
    split_offsets: Tensor  # [max_batch + 1] int32, slots of request b: [off[b], off[b+1])
    chunk: Optional[int]  # host: the most tokens one split holds (planning record; None: planned on the device)
    planned_work: Optional[int]  # host: live rows of the last host plan written (None: planned on the device)
    planned_batch: int  # host: requests of the last plan written
    config: KernelConfig = KernelConfig()  # host: launch parameters the split count was planned for
    target: int = 0  # host: the planner's target splits (0: unknown, the schedule cannot be re-planned on the device)
    granule: int = SPLIT_GRANULE  # host: split starts are multiples of this
    min_split_tokens: int = MIN_SPLIT_TOKENS  # host: the planner's shortest split

    @property
    def capacity(self) -> int:
        return self.work.shape[0]

    @property
    def max_batch(self) -> int:
        return self.split_offsets.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.work.device

    @classmethod
    def empty(cls, *, max_batch: int, capacity: int, device: Union[str, torch.device] = "cpu",
              config: KernelConfig = KernelConfig(), **params) -> "SplitKVSchedule":
        """An all-idle schedule (no split) with room for ``capacity`` work rows and ``max_batch`` requests."""
        if max_batch < 0 or capacity < 1:
            raise ValueError(f"max_batch must be >= 0 and capacity >= 1, got {max_batch}, {capacity}")
        work = torch.zeros(capacity, 4, dtype=torch.int32, device=device)
        work[:, 3] = torch.arange(capacity, dtype=torch.int32, device=device)
        return cls(
            work=work, num_work=torch.zeros(1, dtype=torch.int32, device=device),
            split_offsets=torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
            chunk=0, planned_work=0, planned_batch=0, config=config, **params,
        )

    @classmethod
    def from_plan(
        cls, work: Sequence[Tuple[int, int, int, int]], offsets: Sequence[int], chunk: int, *,
        device: Union[str, torch.device] = "cpu", max_batch: Optional[int] = None, capacity: Optional[int] = None,
        config: KernelConfig = KernelConfig(), **params,
    ) -> "SplitKVSchedule":
        """Buffers holding a host plan (``plan_splits``), sized exactly or for ``max_batch`` / ``capacity``.

        ``params``: the planner's ``target`` / ``granule`` / ``min_split_tokens`` (what a device re-plan reuses)."""
        bs, n = len(offsets) - 1, len(work)
        host = cls.empty(max_batch=bs, capacity=max(1, n), device="cpu", config=config, **params)
        if n:
            host.work[:n] = torch.tensor(work, dtype=torch.int32)
        host.num_work.fill_(n)
        host.split_offsets.copy_(torch.tensor(offsets, dtype=torch.int32))
        host.chunk, host.planned_work, host.planned_batch = chunk, n, bs
        if max_batch is None and capacity is None:
            return host.to(device)
        out = cls.empty(max_batch=bs if max_batch is None else max_batch, capacity=capacity or max(1, n), device=device,
                        config=config, **params)
        return out.copy_(host)

    def to(self, device: Union[str, torch.device]) -> "SplitKVSchedule":
        """These buffers on ``device`` (host->device copies are asynchronous: no stream sync on the hot path)."""
        return SplitKVSchedule(
            work=self.work.to(device, non_blocking=True), num_work=self.num_work.to(device, non_blocking=True),
            split_offsets=self.split_offsets.to(device, non_blocking=True), chunk=self.chunk,
            planned_work=self.planned_work, planned_batch=self.planned_batch, config=self.config,
            target=self.target, granule=self.granule, min_split_tokens=self.min_split_tokens,
        )

    def copy_(self, other: "SplitKVSchedule") -> "SplitKVSchedule":
        """Write ``other``'s plan into these buffers in place (graph-safe replay update); refuse what does not fit.

        The launch ``config`` and planner parameters stay this schedule's (a captured graph replays the kernels it
        captured)."""
        if not isinstance(other, SplitKVSchedule):
            raise TypeError(f"other must be a SplitKVSchedule, got {type(other).__name__}")
        if other.planned_work is None:
            raise ValueError("other was planned on the device (its split count is a device value); copy_ takes a "
                             "host plan (get_splitkv_schedule) — re-plan on the device with replan_splitkv_schedule")
        n, bs = other.planned_work, other.planned_batch
        if n > self.capacity:
            raise ValueError(
                f"other has {n} splits but this schedule holds at most {self.capacity}; allocate it for a larger "
                "batch (capacity = target splits + max_batch) or plan with fewer waves"
            )
        if bs > self.max_batch:
            raise ValueError(f"other plans {bs} requests but this schedule holds at most max_batch={self.max_batch}")
        self.work[:n].copy_(other.work[:n], non_blocking=True)
        if n < self.capacity:
            self.work[n:, :3].zero_()
            self.work[n:, 3].copy_(torch.arange(n, self.capacity, dtype=torch.int32), non_blocking=True)
        self.num_work.fill_(n)
        self.split_offsets[: bs + 1].copy_(other.split_offsets[: bs + 1], non_blocking=True)
        self.split_offsets[bs + 1 :].fill_(n)
        self.chunk, self.planned_work, self.planned_batch = other.chunk, n, bs
        return self


def plan_schedule(
    seqlens, *, num_heads: int, num_q_tokens: int = 1, page_size: int, device: Union[str, torch.device] = "cpu",
    num_sms: Optional[int] = None, waves: Optional[float] = None, min_split_tokens: int = MIN_SPLIT_TOKENS,
    max_batch: Optional[int] = None, config: Optional[KernelConfig] = None, kv_fp8: bool = False,
) -> SplitKVSchedule:
    """Validate the host arguments, plan (``plan_splits``) and build the schedule (``ops.get_splitkv_schedule``).

    ``config`` None: ``choose_config(num_heads, len(seqlens), max(seqlens), kv_fp8=kv_fp8)``; ``waves`` None: the
    config's."""
    from . import _checks as chk

    if isinstance(seqlens, torch.Tensor):
        if seqlens.device.type != "cpu":
            raise ValueError(f"seqlens must be a host (CPU) copy of the lengths, got a tensor on {seqlens.device}")
        if seqlens.dim() != 1 or seqlens.is_floating_point() or seqlens.dtype == torch.bool:
            raise ValueError(f"seqlens must be a 1-D integer tensor, got {seqlens.dtype} shape {tuple(seqlens.shape)}")
        seqlens = seqlens.tolist()
    if not isinstance(seqlens, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in seqlens):
        raise TypeError(f"seqlens must be a CPU int tensor or a sequence of ints, got {type(seqlens).__name__}")
    for name, x in (("num_heads", num_heads), ("num_q_tokens", num_q_tokens), ("page_size", page_size)):
        chk.host_int(x, name, minimum=1)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if max_batch is not None and chk.host_int(max_batch, "max_batch") < len(seqlens):
        raise ValueError(f"max_batch must be >= len(seqlens) = {len(seqlens)}, got {max_batch}")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(config).__name__}")
    if not isinstance(kv_fp8, bool):
        raise TypeError(f"kv_fp8 must be a bool, got {type(kv_fp8).__name__}")
    if config is None:
        config = choose_config(num_heads, max(1, len(seqlens)), max(list(seqlens) + [1]), kv_fp8=kv_fp8)
    if waves is not None:
        if isinstance(waves, bool) or not isinstance(waves, (int, float)) or not waves > 0:
            raise ValueError(f"waves must be a positive number, got {waves!r}")
        config = config.with_(waves=float(waves))
    chk.host_int(min_split_tokens, "min_split_tokens", minimum=1)
    num_sms = DEFAULT_NUM_SMS if num_sms is None else chk.host_int(num_sms, "num_sms", minimum=1)
    # the warp-specialized kernel holds every (token, head) row of a request in one program: one head tile
    tiles = 1 if config.warp_specialized else head_tiles(num_heads, num_q_tokens, config.max_rows)
    target = target_splits(num_sms, tiles, config.waves)
    granule = split_granule(config, page_size)
    work, offsets, chunk = plan_splits(seqlens, target=target, granule=granule, min_split_tokens=min_split_tokens,
                                       even=config.even_splits, fit=config.fit_splits)
    capacity = None if max_batch is None else capacity_for(max_batch, target)
    return SplitKVSchedule.from_plan(work, offsets, chunk, device=device, max_batch=max_batch, capacity=capacity,
                                     config=config, target=target, granule=granule, min_split_tokens=min_split_tokens)


def split_granule(config: KernelConfig, page_size: int) -> int:
    """Split starts are multiples of this: ``max(page_size, SPLIT_GRANULE)``, or with ``config.even_splits`` the key
    block (``block_n``: a block then still lies in one page of >= block_n keys, and the warp-specialized kernel's
    block is its 64-key tile)."""
    return config.block_n if config.even_splits else max(page_size, SPLIT_GRANULE)
