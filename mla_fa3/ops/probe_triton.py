"""The timeline stamp split-KV's kernels write when probed (``splitkv_partials(probe=)``, ``combine_splits(probe=)``;
read by ``benchmarks/splitkv_probe.py``): four int64 per program — the SM it ran on, and three ``%globaltimer``
readings in nanoseconds (its start, its first read of what it waited for, its end). CUDA only."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_stamp(Probe, index, t_start, t_first):
    """Row ``index`` of the stamp buffer: (``%smid``, ``t_start``, ``t_first``, now)."""
    stamp = Probe + index.to(tl.int64) * 4
    tl.store(stamp, tl.extra.cuda.smid().to(tl.int64))
    tl.store(stamp + 1, t_start)
    tl.store(stamp + 2, t_first)
    tl.store(stamp + 3, tl.extra.cuda.globaltimer())
