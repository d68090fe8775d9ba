"""benchmarks/sglang_one_batch.py: the CSV's ``error`` column names why a worker stopped (CPU; no SGLang needed)."""

from __future__ import annotations

from benchmarks.sglang_one_batch import failure_line

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
