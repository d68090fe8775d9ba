"""``benchmarks/stream_read.py``'s read kernel under Triton's CPU interpreter (this file as a script in a subprocess).

Oracle: torch's wrapping int32 sum of the buffer. The kernel sums what it reads, so a chunk skipped or read twice by
the static split or by the atomic counter of the dynamic one changes the sum (random data). The dynamic variant must
also leave its counters at zero, so that a second call (a graph replay) reads everything again.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

# (chunks in the buffer, programs, dynamic, grain): fewer chunks than programs, uneven splits, grains that overrun
CASES = [(7, 3, False, 1), (2, 5, False, 1), (9, 4, True, 1), (9, 4, True, 4), (3, 6, True, 2), (1, 1, True, 3)]


def _check(chunks: int, programs: int, dynamic: bool, grain: int) -> None:
    import stream_read as sr

    g = torch.Generator().manual_seed(chunks * 100 + programs)
    x = torch.randint(-2 ** 31, 2 ** 31 - 1, (chunks * sr.CHUNK,), dtype=torch.int32, generator=g)
    run = sr.StreamRead(programs, dynamic, grain, device="cpu")
    for call in range(2):
        got, want = sr.wrapped_sum(run(x)), sr.wrapped_sum(x)
        assert got == want, f"call {call}: kernel sum {got}, torch {want}"
        assert run.counter.tolist() == [0, 0], f"call {call}: counters left at {run.counter.tolist()}"


def _interpreter_run() -> dict:
    return run_cases([(f"{c}", lambda c=c: _check(*c)) for c in CASES])


def test_every_chunk_is_read_exactly_once():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__, timeout=300) == {}


def test_bad_buffers_are_refused_before_the_launch():
    pytest.importorskip("triton")
    import stream_read as sr

    run = sr.StreamRead(2, False, device="cpu")
    for bad in (torch.zeros(sr.CHUNK, dtype=torch.float32), torch.zeros(sr.CHUNK + 1, dtype=torch.int32),
                torch.zeros(2, sr.CHUNK, dtype=torch.int32)):
        with pytest.raises(ValueError, match="int32"):
            run(bad)
    with pytest.raises(ValueError, match="programs and grain"):
        sr.StreamRead(0, True, device="cpu")


def test_stamp_stats_reads_the_tail_and_rates():
    import stream_read as sr

    # three programs: ends at 10, 12 and 20 µs after a common start, 2 / 2 / 4 chunks of 64 KB
    stamps = torch.tensor([[0, 10_000, 0, 2], [0, 12_000, 1, 2], [1_000, 20_000, 2, 4]])
    st = sr.stamp_stats(stamps, 65536)
    assert st["span_us"] == 20.0 and st["start_spread_us"] == 1.0 and st["tail_us"] == 8.0
    assert st["chunks_min"] == 2 and st["chunks_max"] == 4
    rates = [2 * 65536 / 10_000e-9 / 1e12, 2 * 65536 / 12_000e-9 / 1e12, 4 * 65536 / 19_000e-9 / 1e12]
    assert st["sm_tb_s_min"] == pytest.approx(3 * min(rates)) and st["sm_tb_s_max"] == pytest.approx(3 * max(rates))


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
