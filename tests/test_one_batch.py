"""benchmarks/sglang_one_batch.py's host code (CPU; no SGLang needed): the CSV's ``error`` column names why a worker
stopped, each ratio is taken against fa3 of its own round, and a large batch's prefill in groups of requests hands
the decode steps the batch one prefill would."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import torch

from benchmarks.sglang_one_batch import GroupedPrefill, _write_csv, failure_line

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
    rows = [dict(heads=128, kv="auto", backend=b, round=r, bs=1, ctx=32768, decode_ms=ms, forward_ms=fw)
            for r, b, ms, fw in ((0, "fa3", 2.0, 0.9), (0, "mla_fa3", 1.6, 0.6), (1, "fa3", 1.5, 1.0),
                                 (1, "mla_fa3", 2.0, 0.8))]
    rows.append(dict(heads=128, kv="auto", backend="mla_fa3", round=2, bs=1, ctx=32768, error="TIMEOUT"))
    path = tmp_path / "one_batch.csv"
    _write_csv(str(path), rows)
    got = [(r["backend"], r["round"], r["ratio_vs_fa3"], r["forward_ratio_vs_fa3"]) for r in csv.DictReader(open(path))]
    assert got == [("fa3", "0", "1.0", "1.0"), ("mla_fa3", "0", "1.25", "1.5"), ("fa3", "1", "1.0", "1.0"),
                   ("mla_fa3", "1", "0.75", "1.25"), ("mla_fa3", "2", "", "")]


class _Batch:
    """A stand-in for SGLang's ScheduleBatch: its requests, merged as ``merge_batch`` does (appended in order)."""

    def __init__(self, reqs):
        self.reqs = list(reqs)

    def merge_batch(self, other):
        self.reqs = self.reqs + other.reqs


def _extend(calls):
    """SGLang's one_batch.extend stand-in: per request a next token (its rid) and a logits row (rid, prompt length)."""
    def extend(reqs, model_runner):
        assert model_runner == "model runner"
        calls.append([r.rid for r in reqs])
        ids = torch.tensor([r.rid for r in reqs])
        logits = torch.tensor([[float(r.rid), float(len(r.origin_input_ids))] for r in reqs])
        return ids, logits, _Batch(reqs)
    return extend


def _reqs(lengths):
    return [SimpleNamespace(rid=i, origin_input_ids=[0] * n) for i, n in enumerate(lengths)]


def test_a_large_batch_is_prefilled_in_groups_under_the_cap():
    calls = []
    runner = GroupedPrefill(SimpleNamespace(torch_runner="model runner"), _extend(calls), max_tokens=100)
    reqs = _reqs([40, 40, 40, 150, 30, 30, 30, 30])
    ids, logits, batch = runner.extend(reqs)
    # brute force: every group within the cap (a longer request alone), consecutive, covering every request once
    assert calls == [[0, 1], [2], [3], [4, 5, 6], [7]]
    for group in calls:
        assert len(group) == 1 or sum(len(reqs[i].origin_input_ids) for i in group) <= 100
    # the decode steps see one batch in request order, with token ids and logits rows in that same order
    assert [r.rid for r in batch.reqs] == list(range(8))
    assert ids.tolist() == list(range(8))
    assert logits[:, 0].tolist() == [float(i) for i in range(8)]
    assert logits[:, 1].tolist() == [40.0, 40.0, 40.0, 150.0, 30.0, 30.0, 30.0, 30.0]


def test_a_batch_that_fits_is_one_extend():
    calls = []
    runner = GroupedPrefill(SimpleNamespace(torch_runner="model runner"), _extend(calls), max_tokens=131072)
    ids, _, batch = runner.extend(_reqs([32768] * 4))
    assert calls == [[0, 1, 2, 3]] and ids.tolist() == [0, 1, 2, 3] and len(batch.reqs) == 4
