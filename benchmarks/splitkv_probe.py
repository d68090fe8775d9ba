"""Split-KV's timeline inside whatever runs it: for each program of phase 1, the SM it ran on, when it started, when it
issued its first key load and when it ended (``splitkv_partials(probe=)``); for each program of the combine, its SM,
start, first read of a partial (after its wait for phase 1) and end (``combine_splits(probe=)``). ``%smid`` and
``%globaltimer`` stamps.

    with SplitKVProbe() as probe:      # every split-KV step in the block writes its stamps (graphs captured in the
        ...build, capture, replay...   # block keep writing them on every replay)
    print(probe.summary())             # of the last step, and the gap from the step before it

Used by ``benchmarks/sglang_backends.py --probe``. Both launches are wrapped (``splitkv_triton.splitkv_partials`` and
``splitkv_triton.combine_splits``, which ``splitkv_mla_with_kvcache`` calls) for the duration of the block, so
SGLang's step runs unchanged but for four stores per program. The steps alternate between two sets of buffers, so
that in a graph of many layers the last two layers' stamps survive: the summary's ``gap_us`` is the time from the
previous layer's last combine program to this layer's first phase-1 program (the next layer's store and launches).
GPU only (the interpreter has no timer).

``python benchmarks/splitkv_probe.py OUT.probe_raw.csv`` reads the stamps ``sglang_backends.py --probe`` kept and
prints, per timed step, how phase 1's work and its end spread over the SMs (``per_sm``): whether an SM's last end
follows the keys it read (each SM streaming at its own rate: a plan that evens the keys per SM would shorten the
step) or not (the card's bandwidth shared: only the total counts).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch


def _live(stamps: torch.Tensor) -> torch.Tensor:
    rows = stamps.reshape(-1, 4).cpu()
    return rows[rows[:, 0] >= 0]


class SplitKVProbe:
    """Stamps of every split-KV step (phase 1 and its combine) made inside the ``with`` block: two sets of buffers per
    grid, the steps alternating between them, both allocated at the first step of that grid (so that a CUDA graph
    captured later reuses them)."""

    def __init__(self):
        self._buffers: dict = {}
        self._steps: list = []  # the latest two steps: dicts of call, schedule, phase-1 and combine stamps
        self._launches = 0
        self._pending = None  # the step whose phase 1 was launched last, until its combine is
        self._real = None

    def __enter__(self) -> "SplitKVProbe":
        from mla_fa3.ops import splitkv_triton
        from mla_fa3.ops.splitkv_combine_triton import combine_grid
        from mla_fa3.ops.splitkv_plan import head_tiles

        real_partials, real_combine = splitkv_triton.splitkv_partials, splitkv_triton.combine_splits

        def partials(call, schedule, config=None, **kwargs):
            cfg = schedule.config if config is None else config
            heads, sq = call.q.shape[2], call.q.shape[1]
            shape = (schedule.capacity, head_tiles(heads, sq, cfg.max_rows), 4)
            key = ("phase1", shape, call.q.device, self._launches % 2)
            self._launches += 1
            self._allocate(key)
            self._pending = dict(call=call, schedule=schedule, phase1=self._buffers[key])
            self._steps = (self._steps + [self._pending])[-2:]
            return real_partials(call, schedule, config, probe=self._buffers[key], **kwargs)

        def combine(part_o, part_lse2, split_offsets, out, lse, descale_k=None, **kwargs):
            step, self._pending = self._pending, None
            if step is None:  # not after a probed phase 1 (the warp-specialized kernel's): not stamped
                return real_combine(part_o, part_lse2, split_offsets, out, lse, descale_k, **kwargs)
            bs, sq, heads = out.shape[:3]
            shape = combine_grid(bs * sq * heads, part_o.shape[3], kwargs.get("tile")) + (4,)
            key = ("combine", shape, out.device, (self._launches - 1) % 2)  # the set of the phase 1 just launched
            self._allocate(key)
            step["combine"] = self._buffers[key]
            return real_combine(part_o, part_lse2, split_offsets, out, lse, descale_k, probe=self._buffers[key],
                                **kwargs)

        self._real = (real_partials, real_combine)
        splitkv_triton.splitkv_partials, splitkv_triton.combine_splits = partials, combine
        return self

    def _allocate(self, key) -> None:
        """Both sets of a grid's buffers at its first step (before any capture that follows it), filled with -1."""
        if key not in self._buffers:
            for parity in (0, 1):
                self._buffers[key[:3] + (parity,)] = torch.full(key[1], -1, dtype=torch.int64, device=key[2])

    def __exit__(self, *exc) -> None:
        from mla_fa3.ops import splitkv_triton

        splitkv_triton.splitkv_partials, splitkv_triton.combine_splits = self._real

    def summary(self) -> dict:
        """The latest step's timeline, µs from its first phase-1 program's start ({} when none ran):

        phase 1 — programs, SMs used, programs per SM (max, and how many SMs ran 1 / 2 / 3+), start spread, first key
        load (median, max), duration from the first key load (median, max), end (median, max), tail (max - median
        end); ``keys_max`` (the most keys a program read), ``read_mb`` (the step's cache bytes, each key once) and
        ``read_tb_s`` (those bytes over the time from the median first key load to the last end);
        the combine — ``combine_programs``, its first start, its first and median read (after its wait), its last end;
        ``handoff_us`` (phase 1's last end to the combine's first read) and ``combine_us`` (its first read to its last
        end); ``step_us`` (the first phase-1 start to the last combine end);
        ``gap_us``: the previous step's last combine end to this one's first phase-1 start (absent for a single step).
        """
        if not self._steps:
            return {}
        step = self._steps[-1]
        if step["phase1"].is_cuda:
            torch.cuda.synchronize(step["phase1"].device)
        live = _live(step["phase1"][: int(step["schedule"].num_work.item())])
        if live.shape[0] == 0:
            return {}
        sm, start, keys, end = (live[:, i] for i in range(4))
        t0 = int(start.min())
        us = lambda t: (t - t0).double() / 1e3  # noqa: E731
        per_sm = torch.bincount(sm)
        per_sm = per_sm[per_sm > 0]
        ends = us(end)
        out = dict(programs=int(live.shape[0]), sms=int(per_sm.numel()), max_per_sm=int(per_sm.max()),
                   sms_with_1=int((per_sm == 1).sum()), sms_with_2=int((per_sm == 2).sum()),
                   sms_with_3_plus=int((per_sm >= 3).sum()),
                   start_spread_us=round(float(us(start).max()), 2),
                   first_key_median_us=round(statistics.median(us(keys).tolist()), 2),
                   first_key_max_us=round(float(us(keys).max()), 2),
                   duration_median_us=round(statistics.median((end - keys).double().div(1e3).tolist()), 2),
                   duration_max_us=round(float((end - keys).double().max() / 1e3), 2),
                   end_median_us=round(statistics.median(ends.tolist()), 2), end_max_us=round(float(ends.max()), 2),
                   tail_us=round(float(ends.max()) - statistics.median(ends.tolist()), 2))
        out.update(_bytes(step["call"], step["schedule"], ends.max() - statistics.median(us(keys).tolist())))
        if "combine" in step:
            comb = _live(step["combine"])
            if comb.shape[0]:
                read0 = float(us(comb[:, 2]).min())
                last = float(us(comb[:, 3]).max())
                out.update(combine_programs=int(comb.shape[0]), combine_start_us=round(float(us(comb[:, 1]).min()), 2),
                           combine_read_us=round(read0, 2),
                           combine_read_median_us=round(statistics.median(us(comb[:, 2]).tolist()), 2),
                           combine_end_us=round(last, 2), handoff_us=round(read0 - float(ends.max()), 2),
                           combine_us=round(last - read0, 2), step_us=round(last, 2))
        if len(self._steps) == 2 and "combine" in self._steps[0]:
            prev = _live(self._steps[0]["combine"])
            if prev.shape[0]:
                out["gap_us"] = round((t0 - int(prev[:, 3].max())) / 1e3, 2)
        return out


    def timeline(self) -> list:
        """The latest step's stamps, one dict per program, µs from its first phase-1 program's start ([] when none
        ran): ``phase`` (``phase1``; ``combine``; ``combine_before``: the previous step's combine), ``row`` (phase 1: the
        work row; the combine: the output row b·sq·H + i·H + h), ``block`` (the head tile; the column block),
        ``request``, ``keys`` (phase 1: the keys its split read), ``sm``, ``start_us``, ``first_us`` (first key load;
        first read of a partial) and ``end_us`` — what ``sglang_backends.py --probe`` writes to ``OUT.probe_raw.csv``
        for questions the summary does not answer."""
        if not self._steps:
            return []
        step = self._steps[-1]
        if step["phase1"].is_cuda:
            torch.cuda.synchronize(step["phase1"].device)
        sched = step["schedule"]
        n = int(sched.num_work.item())
        stamps = step["phase1"][:n].cpu()
        if not bool((stamps[..., 0] >= 0).any()):
            return []
        t0 = int(stamps[..., 1][stamps[..., 0] >= 0].min())
        work, keys = _keys(step["call"], sched)
        rows = []

        def add(phase, stamps, row, block, request, keys):
            if stamps[0] >= 0:
                rows.append(dict(phase=phase, row=row, block=block, request=request, keys=keys, sm=int(stamps[0]),
                                 **{f"{k}_us": round((int(stamps[i]) - t0) / 1e3, 3)
                                    for i, k in ((1, "start"), (2, "first"), (3, "end"))}))

        for w in range(n):
            for tile in range(stamps.shape[1]):
                add("phase1", stamps[w, tile].tolist(), w, tile, int(work[w, 0]), int(keys[w]))
        per_request = step["call"].q.shape[1] * step["call"].q.shape[2]  # sq·H output rows a request
        for phase, s in (("combine", step), ("combine_before", self._steps[0] if len(self._steps) == 2 else {})):
            if "combine" in s:
                comb = s["combine"].cpu()
                for r in range(comb.shape[0]):
                    for vb in range(comb.shape[1]):
                        add(phase, comb[r, vb].tolist(), r, vb, r // per_request, "")
        return rows


def _keys(call, schedule):
    """(the live work rows, the keys each reads: start .. min(end, its request's length)), on the host."""
    work = schedule.work[: int(schedule.num_work.item())].cpu().to(torch.int64)
    lens = call.cache_seqlens.cpu().to(torch.int64)
    return work, (torch.minimum(work[:, 2], lens[work[:, 0]]) - work[:, 1]).clamp(min=0)


def _bytes(call, schedule, window_us) -> dict:
    """``keys_max``, ``read_mb`` and ``read_tb_s`` of a step (see ``SplitKVProbe.summary``): each live work row reads
    its keys (``_keys``) of D columns."""
    work, keys = _keys(call, schedule)
    n = work.shape[0]
    kv = call.kv_cache
    total = int(keys.sum()) * kv.shape[-1] * kv.element_size()
    window = float(window_us)
    return dict(keys_max=int(keys.max()) if n else 0, read_mb=round(total / 1e6, 2),
                read_tb_s=round(total / (window * 1e6), 3) if window > 0 else float("nan"))


LABELS = ("heads", "bs", "ctx", "kv", "round", "value")  # the columns sglang_backends.py --probe puts first


def per_sm(rows, row_bytes: int = 1152) -> dict:
    """Phase 1's stamps (``SplitKVProbe.timeline`` rows; others ignored) summed up per SM: the keys an SM read
    (``sm_keys_min`` / ``_median`` / ``_max``), the median last end of the SMs that ran 1 and 2 programs
    (``end_sm1_us`` / ``end_sm2_us``), the least-squares line of an SM's last end on its keys (``end_us_per_kkey``,
    ``end_fit_r2``: near 1 when each SM streams at its own rate) and the median program's rate from its first key
    load to its end (``program_gb_s``, ``row_bytes`` a key)."""
    sms: dict = {}
    rates = []
    for r in rows:
        if r["phase"] != "phase1":
            continue
        keys, first, end = int(r["keys"]), float(r["first_us"]), float(r["end_us"])
        n, k, e = sms.get(int(r["sm"]), (0, 0, float("-inf")))
        sms[int(r["sm"])] = (n + 1, k + keys, max(e, end))
        if end > first:
            rates.append(keys * row_bytes / (end - first) / 1e3)
    if not sms:
        return {}
    keys = [k for _, k, _ in sms.values()]
    ends = [e for _, _, e in sms.values()]
    out = dict(sms=len(sms), sm_keys_min=min(keys), sm_keys_median=statistics.median(keys), sm_keys_max=max(keys))
    for count in (1, 2):
        group = [e for n, _, e in sms.values() if n == count]
        if group:
            out[f"end_sm{count}_us"] = round(statistics.median(group), 2)
    mk, me = statistics.fmean(keys), statistics.fmean(ends)
    sxx = sum((k - mk) ** 2 for k in keys)
    if sxx > 0:
        slope = sum((k - mk) * (e - me) for k, e in zip(keys, ends)) / sxx
        syy = sum((e - me) ** 2 for e in ends)
        out["end_us_per_kkey"] = round(slope * 1e3, 4)
        out["end_fit_r2"] = round(slope * slope * sxx / syy, 3) if syy > 0 else 1.0
    if rates:
        out["program_gb_s"] = round(statistics.median(rates), 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="per-SM summary of the stamps sglang_backends.py --probe kept")
    p.add_argument("raw", help="OUT.probe_raw.csv")
    p.add_argument("--row-bytes", type=int, default=1152, help="bytes a key (576 bf16: 1152; an e4m3 pool: 576)")
    a = p.parse_args(argv)
    with open(a.raw, newline="") as f:
        rows = list(csv.DictReader(f))
    steps: dict = {}
    for r in rows:
        steps.setdefault(tuple(r.get(k, "") for k in LABELS), []).append(r)
    for label, group in steps.items():
        print(",".join(f"{k}={v}" for k, v in zip(LABELS, label) if v) + ": " +
              ", ".join(f"{k}={v}" for k, v in per_sm(group, a.row_bytes).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
