"""benchmarks/sglang_one_batch.py: the CSV's ``error`` column names why a worker stopped, and each ratio is taken
against fa3 of its own round (CPU; no SGLang needed)."""

from __future__ import annotations

import csv

from benchmarks.sglang_one_batch import _write_csv, failure_line

# the tail of a real worker log (H100, 2026-12-07: SGLang's fa3 backend on an FP8 pool at --mem-fraction-static 0.8)
LOG = """[rank0]:   File "/tmp/site/sglang/srt/layers/attention/flashattention_backend.py", line 1976, in forward_decode
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 30.62 GiB.
[rank0]: During handling of the above exception, another exception occurred:
[rank0]: Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 30.62 GiB.
[rank0]:[W1207 13:11:10.882125194 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called
"""


def test_the_last_exception_line_not_the_exit_warning():
    assert failure_line(LOG) == "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 30.62 GiB."


def test_timeout_then_last_line_then_nothing():
    assert failure_line("step 1\nTIMEOUT") == "TIMEOUT"
    assert failure_line("loading\nKilled") == "Killed"
    assert failure_line("") == ""
    assert len(failure_line("ValueError: " + "x" * 500)) == 200


def test_ratios_are_read_within_a_round(tmp_path):
    rows = [dict(heads=128, kv="auto", backend=b, round=r, bs=1, ctx=32768, decode_ms=ms)
            for r, b, ms in ((0, "fa3", 2.0), (0, "mla_fa3", 1.6), (1, "fa3", 1.5), (1, "mla_fa3", 2.0))]
    rows.append(dict(heads=128, kv="auto", backend="mla_fa3", round=2, bs=1, ctx=32768, error="TIMEOUT"))
    path = tmp_path / "one_batch.csv"
    _write_csv(str(path), rows)
    got = [(r["backend"], r["round"], r["ratio_vs_fa3"]) for r in csv.DictReader(open(path))]
    assert got == [("fa3", "0", "1.0"), ("mla_fa3", "0", "1.25"), ("fa3", "1", "1.0"), ("mla_fa3", "1", "0.75"),
                   ("mla_fa3", "2", "")]
