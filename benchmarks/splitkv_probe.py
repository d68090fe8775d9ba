"""Split-KV phase 1's program timeline inside whatever runs it: which SM each program ran on, when it started, when
it issued its first key load, when it ended (``splitkv_partials(probe=)``: ``%smid`` and ``%globaltimer`` stamps).

    with PhaseOneProbe() as probe:     # every phase-1 launch in the block writes its stamps (graphs captured in the
        ...build, capture, replay...   # block keep writing them on every replay)
    print(probe.summary())             # of the last launch: programs per SM, start spread, time to the first key,
                                       # duration, tail

Used by ``benchmarks/sglang_backends.py --probe``. The launch is wrapped (``splitkv_triton.splitkv_partials``, which
``splitkv_mla_with_kvcache`` calls) for the duration of the block, so SGLang's step runs unchanged but for the four
stores per program. GPU only (the interpreter has no timer).
"""

from __future__ import annotations

import statistics

import torch


class PhaseOneProbe:
    """Stamps of every split-KV phase-1 launch made inside the ``with`` block (one buffer per capacity and head-tile
    count, allocated on the first launch of that shape, so that a CUDA graph captured later reuses it)."""

    def __init__(self):
        self._buffers: dict = {}
        self._last = None  # (stamps, schedule) of the latest launch
        self._real = None

    def __enter__(self) -> "PhaseOneProbe":
        from mla_fa3.ops import splitkv_triton
        from mla_fa3.ops.splitkv_plan import head_tiles

        real = splitkv_triton.splitkv_partials

        def probed(call, schedule, config=None, **kwargs):
            cfg = schedule.config if config is None else config
            heads, sq = call.q.shape[2], call.q.shape[1]
            shape = (schedule.capacity, head_tiles(heads, sq, cfg.max_rows), 4)
            key = (shape, call.q.device)
            if key not in self._buffers:
                self._buffers[key] = torch.full(shape, -1, dtype=torch.int64, device=call.q.device)
            self._last = (self._buffers[key], schedule)
            return real(call, schedule, config, probe=self._buffers[key], **kwargs)

        self._real, splitkv_triton.splitkv_partials = real, probed
        return self

    def __exit__(self, *exc) -> None:
        from mla_fa3.ops import splitkv_triton

        splitkv_triton.splitkv_partials = self._real

    def summary(self) -> dict:
        """The latest launch's timeline (µs from its first program's start), or {} when none ran: programs, SMs used,
        programs per SM (max, and how many SMs ran 1 / 2 / 3+), start spread, first key load (median, max), duration
        from the first key load (median, max), end (median, max) and tail (max - median end)."""
        if self._last is None:
            return {}
        stamps, schedule = self._last
        if stamps.is_cuda:
            torch.cuda.synchronize(stamps.device)
        live = stamps[: int(schedule.num_work.item())].reshape(-1, 4).cpu()
        live = live[live[:, 0] >= 0]
        if live.shape[0] == 0:
            return {}
        sm, start, keys, end = (live[:, i] for i in range(4))
        t0 = int(start.min())
        us = lambda t: (t - t0).double() / 1e3  # noqa: E731
        per_sm = torch.bincount(sm)
        per_sm = per_sm[per_sm > 0]
        ends = us(end)
        return dict(programs=int(live.shape[0]), sms=int(per_sm.numel()), max_per_sm=int(per_sm.max()),
                    sms_with_1=int((per_sm == 1).sum()), sms_with_2=int((per_sm == 2).sum()),
                    sms_with_3_plus=int((per_sm >= 3).sum()),
                    start_spread_us=round(float(us(start).max()), 2),
                    first_key_median_us=round(statistics.median(us(keys).tolist()), 2),
                    first_key_max_us=round(float(us(keys).max()), 2),
                    duration_median_us=round(statistics.median((end - keys).double().div(1e3).tolist()), 2),
                    duration_max_us=round(float((end - keys).double().max() / 1e3), 2),
                    end_median_us=round(statistics.median(ends.tolist()), 2), end_max_us=round(float(ends.max()), 2),
                    tail_us=round(float(ends.max()) - statistics.median(ends.tolist()), 2))
