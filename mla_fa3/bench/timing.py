"""Timing helpers shared by the benchmarks: CUDA events, graph replays, input rotation, ceilings.

Symbols: a *call* is one invocation of the timed function ``fn()``; its time is the median over
``iters`` calls of the elapsed time between two CUDA events recorded around each call, in
milliseconds, after ``warmup`` untimed calls. The median (not the mean) ignores the odd preempted
call. ``time_graph`` captures ``fn`` once in a ``torch.cuda.CUDAGraph`` and times its replays, which
removes the Python / launch overhead that a decode step under graph replay does not pay.

L2: the H200 has a 50 MiB L2 cache. A kernel that reads the same few MiB every call measures L2, not
HBM. ``rotating_inputs`` builds ``n`` copies of the inputs whose total size exceeds the L2 (times a
margin) so that successive calls read cold memory; ``fn`` then takes the copy index.

Roofline ceilings measured on the H200 (shared/device/README.md): streaming reads 4.3 TB/s
(datasheet 4.8), bf16 dense GEMM 790 TFLOP/s. ``Ceilings.time_ms(bytes, flops)`` is the roofline
lower bound ``max(bytes / bandwidth, flops / compute)``.

Nothing here runs on import; every CUDA call is inside a function, so the module imports on CPU.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "Ceilings",
    "Cycler",
    "Progress",
    "h200_ceilings",
    "median_host_us",
    "rotating_inputs",
    "time_cuda",
    "time_graph",
    "L2_BYTES_H200",
    "MIN_CALLS_PER_REPLAY",
    "replay_repeats",
]

L2_BYTES_H200 = 50 * 1024 * 1024  # H200 (GH100) L2 cache size
# Calls of the timed op per CUDA-graph replay, at least: a replay of one or two calls also times the graph's own
# launch (the GPU waits for the host to submit it, and for the graph to start), which a model step of 61 layers
# amortizes. Measured on an H100 (docs/PERFORMANCE.md, "Split-KV: where the time goes"): an empty kernel
# timed as 1 call per replay took 10 µs, as 34 calls per replay 0.9 µs per call.
MIN_CALLS_PER_REPLAY = 16


@dataclass(frozen=True)
class Ceilings:
    """Measured machine ceilings for the roofline model."""

    read_bytes_per_s: float  # streaming HBM read bandwidth, bytes/s
    bf16_flops_per_s: float  # dense bf16 tensor-core GEMM rate, FLOP/s
    name: str = "H200"

    def time_ms(self, nbytes: float, flops: float) -> float:
        """Roofline lower bound in ms: max(bytes / bandwidth, flops / compute)."""
        return 1e3 * max(nbytes / self.read_bytes_per_s, flops / self.bf16_flops_per_s)

    def bound(self, nbytes: float, flops: float) -> str:
        """'memory' or 'compute': which ceiling sets ``time_ms``."""
        return "memory" if nbytes / self.read_bytes_per_s >= flops / self.bf16_flops_per_s else "compute"


def h200_ceilings() -> Ceilings:
    """The H200 ceilings measured on the device (shared/device/README.md): 4.3 TB/s, 790 TFLOP/s."""
    return Ceilings(read_bytes_per_s=4.3e12, bf16_flops_per_s=790e12, name="H200")


def _check_counts(warmup: int, iters: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")


def median_host_us(fn: Callable[[], Any], iters: int, *, warmup: int = 0) -> float:
    """Median wall-clock microseconds of one ``fn()`` on the host (``time.perf_counter`` around each of
    ``iters`` calls, after ``warmup`` untimed calls; no device sync)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _time_host(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """CPU fallback (no CUDA): median wall-clock ms. Lets the benchmark code run in CPU tests."""
    return median_host_us(fn, iters, warmup=warmup) / 1e3


def time_cuda(fn: Callable[[], Any], *, warmup: int = 10, iters: int = 100) -> float:
    """Median milliseconds of ``fn()`` measured with CUDA events on the current stream.

    Each call is bracketed by its own pair of events (all recorded first, one synchronize at the
    end), so the median is over single calls. Without CUDA, falls back to wall-clock time.
    """
    _check_counts(warmup, iters)
    if not torch.cuda.is_available():
        return _time_host(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_graph(
    fn: Callable[[], Any],
    *,
    warmup: int = 10,
    iters: int = 100,
    calls_per_graph: int = 1,
    pool: Any = None,
) -> float:
    """Median milliseconds of one ``fn()`` replayed from a CUDA graph.

    ``fn`` is run twice eagerly on a side stream (lazy inits, autotuning), then captured
    ``calls_per_graph`` times into one graph (more calls amortise the replay launch for very short
    kernels); the result is the median replay time divided by ``calls_per_graph``. ``fn`` must be
    capturable: fixed shapes, no host sync, no allocation whose address changes between calls.
    Without CUDA, times ``fn`` eagerly (CPU tests of the benchmark code).
    """
    _check_counts(warmup, iters)
    if not isinstance(calls_per_graph, int) or calls_per_graph < 1:
        raise ValueError(f"calls_per_graph must be an int >= 1, got {calls_per_graph!r}")
    if not torch.cuda.is_available():
        return _time_host(fn, warmup, iters)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(calls_per_graph):
            fn()
    try:
        return time_cuda(graph.replay, warmup=warmup, iters=iters) / calls_per_graph
    finally:
        del graph


def time_per_call(fn: Callable[[], Any], calls: int, *, warmup: int, iters: int,
                  min_calls: int = MIN_CALLS_PER_REPLAY) -> float:
    """Median milliseconds of one call, ``fn`` making ``calls`` calls (one per rotated input copy): ``time_graph``
    with replays of at least ``min_calls`` calls (``replay_repeats``), divided by ``calls``."""
    return time_graph(fn, warmup=warmup, iters=iters, calls_per_graph=replay_repeats(calls, min_calls)) / calls


def replay_repeats(calls: int, minimum: int = MIN_CALLS_PER_REPLAY) -> int:
    """How many times to capture a fn of ``calls`` calls into one graph (``time_graph``'s ``calls_per_graph``) so
    that a replay holds at least ``minimum`` calls: ``ceil(minimum / calls)``, at least 1."""
    if calls < 1 or minimum < 1:
        raise ValueError(f"calls and minimum must be >= 1, got {calls}, {minimum}")
    return -(-minimum // calls)


def rotating_inputs(
    make: Callable[[int], Any],
    bytes_per_copy: int,
    *,
    l2_bytes: int = L2_BYTES_H200,
    margin: float = 3.0,
    max_copies: int = 64,
    max_total_bytes: int | None = None,
) -> list[Any]:
    """Build enough copies of a benchmark's inputs that cycling through them defeats the L2 cache.

    ``make(i)`` builds copy ``i`` (anything: a tensor, a tuple, a dict); ``bytes_per_copy`` is what
    one call reads. The number of copies is ``ceil(margin * l2_bytes / bytes_per_copy)`` clipped to
    ``[1, max_copies]`` and, when given, to ``max_total_bytes // bytes_per_copy`` (at least 1). A
    copy already much larger than the L2 needs no rotation: one copy is returned.
    """
    if bytes_per_copy <= 0:
        raise ValueError(f"bytes_per_copy must be > 0, got {bytes_per_copy}")
    if max_copies < 1:
        raise ValueError(f"max_copies must be >= 1, got {max_copies}")
    n = math.ceil(margin * l2_bytes / bytes_per_copy)
    n = max(1, min(n, max_copies))
    if max_total_bytes is not None:
        n = max(1, min(n, max_total_bytes // bytes_per_copy))
    return [make(i) for i in range(n)]


class Cycler:
    """Callable that calls ``fn(item)`` on the next item of ``items`` each time (round robin).

    For ``time_cuda``; under ``time_graph`` capture each copy into the graph instead (a replay
    repeats the captured addresses), e.g. ``time_graph(lambda: [fn(x) for x in items],
    ...)`` divided by ``len(items)``.
    """

    def __init__(self, fn: Callable[[Any], Any], items: Sequence[Any]):
        if len(items) == 0:
            raise ValueError("items must not be empty")
        self.fn, self.items, self.i = fn, list(items), 0

    def __call__(self) -> Any:
        item = self.items[self.i]
        self.i = (self.i + 1) % len(self.items)
        return self.fn(item)


class Progress:
    """A tiny progress printer to stderr: ``[  3/120  2.5%  12s eta 4m48s] label``.

    ``with Progress(total) as p: ... p.step("label")``; one line per step (no carriage-return
    tricks, so logs stay readable when stderr is a file). ``quiet=True`` prints nothing.
    """

    def __init__(self, total: int, *, stream=None, quiet: bool = False):
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total, self.done, self.quiet = total, 0, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()

    def step(self, label: str = "") -> None:
        self.done += 1
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.t0
        frac = self.done / self.total if self.total else 1.0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        width = len(str(self.total))
        self.stream.write(
            f"[{self.done:>{width}}/{self.total} {100 * frac:5.1f}% {_fmt_s(elapsed)} eta {_fmt_s(eta)}] {label}\n"
        )
        self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if not self.quiet:
            self.stream.write(f"done: {self.done} steps in {_fmt_s(time.perf_counter() - self.t0)}\n")
            self.stream.flush()


def _fmt_s(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
