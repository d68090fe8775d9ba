"""The replay update's host shortcuts against what they replace: the cached decode-kernel choice vs
the policy's own (uncached) choice, once-per-batch checks and host maxima vs the batch's values, the
captured-size lookup after later captures, and the host-time benchmark end to end (CPU)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from mla_cases import follow_up, make_mla_case
from specs import BatchSpec

from mla_fa3 import ops
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.bench import replay_host
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.plan import mean_seqlen
from mla_fa3.policy.kernel_choice import DecodeKernelChoice, batch_bucket, batch_bucket_bounds, bucket_corners, kernel_bucket
from mla_fa3.policy import decode_kernel as kc
from mla_fa3.policy.decode_table import MEASURED, Measured
from mla_fa3.policy.paths import DecodeKernel

from test_backend import backend_for

DEC = ForwardMode.DECODE
CPU = torch.device("cpu")


def _choice(heads: int, kernel="auto", page: int = 64) -> DecodeKernelChoice:
    return DecodeKernelChoice(decode_kernel=kernel, page_size=page, num_heads=heads, kv_fp8=False,
                              whole_row_kernels=True, impl=None, device=CPU)


def _policy(heads: int, bs: int, max_len: int, mean: float | None) -> DecodeKernel:
    """The oracle: the policy's choice for these exact numbers (no cache)."""
    return kc.explain_decode_kernel(heads, bs, max_len, 64, mean_seqlen_k=mean,
                                    allow_splitkv=ops.splitkv_available(CPU)).kernel


def test_cached_kernel_choice_equals_the_policy_at_every_recorded_shape():
    planners: dict[int, DecodeKernelChoice] = {}
    for m in MEASURED:
        p = planners.setdefault(m.num_heads, _choice(m.num_heads))
        mean = None if m.skew == 1.0 else m.skew * m.context
        for _ in range(2):  # the miss, then the hit
            assert p.choose_decode_kernel(m.batch_size, m.context, mean)[0] == \
                _policy(m.num_heads, m.batch_size, m.context, mean), m


def test_cached_kernel_choice_equals_the_policy_for_random_batches_and_decode_runs():
    rng = np.random.default_rng(0)
    for heads in (16, 32, 64, 128):
        p = _choice(heads)
        for _ in range(600):
            bs = int(rng.integers(1, 257))
            ctx = int(2 ** rng.uniform(6, 17.5))
            lens = rng.integers(1, ctx + 1, size=bs)
            lens[0] = ctx
            batch_mean = float(lens.sum()) / bs
            assert p.choose_decode_kernel(bs, ctx, batch_mean)[0] == _policy(heads, bs, ctx, batch_mean)
        # a running batch: every length one longer each step (the bucket hit path, across bucket edges)
        lens = rng.integers(900, 4097, size=64)
        for _ in range(300):
            lens += 1
            mx, mean = int(lens.max()), float(lens.sum()) / lens.size
            assert p.choose_decode_kernel(64, mx, mean)[0] == _policy(heads, 64, mx, mean)


def test_batch_buckets_cover_every_size_once_and_a_shrinking_batch_follows_the_policy():
    seen = []
    for bucket in sorted({batch_bucket(b) for b in range(1, 4097)}):  # (small sizes leave buckets empty)
        lo, hi = batch_bucket_bounds(bucket)
        assert lo <= hi and batch_bucket(lo) == batch_bucket(hi) == bucket
        assert lo == 1 or batch_bucket(lo - 1) < bucket
        seen.extend(range(lo, hi + 1))
    assert seen[:4096] == list(range(1, 4097))  # every size in exactly one bucket (the last runs past 4096)
    p, rng = _choice(16), np.random.default_rng(5)
    lens = rng.integers(1000, 60000, size=128)
    for n in range(128, 0, -1):  # requests finish one by one while the others grow (serving)
        lens[:n] += 1
        mx, mean = int(lens[:n].max()), float(lens[:n].sum()) / n
        assert p.choose_decode_kernel(n, mx, mean)[0] == _policy(16, n, mx, mean)


def test_bucket_corners_lie_in_their_bucket():
    for length in (1, 2, 3, 63, 64, 65, 1000, 4096, 4097, 131071):
        for mean in (None, length * 0.999, length * 0.5, length * 0.0123):
            lb, sb = kernel_bucket(length, mean)
            corners = bucket_corners(lb, sb)
            assert any(m <= length for m, _ in corners) and any(m >= length for m, _ in corners)
            for m, _ in corners:
                assert kernel_bucket(m, None)[0] == lb


def test_cache_follows_a_replaced_table_and_bad_numbers_still_raise(monkeypatch):
    p = _choice(16)
    assert p.choose_decode_kernel(2, 64, 40.0)[0] == _policy(16, 2, 64, 40.0)
    rows = [(1, 64, 0.02, 0.03, 0.01), (4, 128, 0.02, 0.03, 0.012), (64, 128, 0.1, 0.09, 0.2)]
    table = tuple(Measured(16, bs, ctx, fa3_ms=fa3, flashmla_ms=mla, splitkv_ms=skv, source="test")
                  for bs, ctx, fa3, mla, skv in rows)
    monkeypatch.setattr(kc, "MEASURED", table)
    for bs, mx, mean in ((2, 64, 40.0), (64, 128, 100.0), (64, 128, None), (4, 100, 90.0)):
        assert p.choose_decode_kernel(bs, mx, mean)[0] == _policy(16, bs, mx, mean)
    with pytest.raises(ValueError, match="mean_seqlen_k"):
        p.choose_decode_kernel(4, 100, 150.0)
    with pytest.raises(TypeError, match="mean_seqlen_k"):
        p.choose_decode_kernel(4, 100, "50")
    with pytest.raises(TypeError, match="batch_size"):
        p.choose_decode_kernel(4.0, 100, 50.0)


def test_fixed_and_fp8_settings_answer_without_the_table():
    assert _choice(16, DecodeKernel.FLASHMLA).choose_decode_kernel(8, 4096, 100.0)[0] is DecodeKernel.FLASHMLA
    assert _choice(16, "auto", page=16).choose_decode_kernel(8, 4096, 100.0)[0] is DecodeKernel.FA3


def test_batch_checks_once_and_again_after_a_reassignment(monkeypatch):
    calls = []
    real = ForwardBatch.check
    monkeypatch.setattr(ForwardBatch, "check", lambda self: (calls.append(1), real(self))[1])
    batch = ForwardBatch.decode([0, 1, 2], [5, 9, 2], [4, 8, 1], CPU)
    assert len(calls) == 1  # construction
    batch.ensure_checked()
    assert len(calls) == 1
    assert (batch.seq_lens_max, batch.seq_lens_sum) == (9, 16)
    assert mean_seqlen(batch) == pytest.approx(16 / 3)
    batch.seq_lens_cpu = torch.tensor([5, 9, 2], dtype=torch.int64)  # a reassigned field is checked again
    with pytest.raises(TypeError, match="seq_lens_cpu"):
        MetadataBuilder(torch.zeros(4, 64, dtype=torch.int32), 16, CPU).batch_checks.validate(batch)
    batch.seq_lens_cpu = torch.tensor([5, 30, 2], dtype=torch.int32)
    assert batch.seq_lens_max == 30 and batch.seq_lens_sum == 37  # maxima re-read with the checks
    twin = dataclasses.replace(batch, seq_lens_cpu=torch.tensor([1, 1, 1], dtype=torch.int32))
    assert (twin.seq_lens_max, twin.seq_lens_sum) == (1, 3)


def test_default_positions_of_every_mode_match_a_loop():
    prefix, ext = [0, 5, 3, 7], [4, 1, 2, 1]
    loc = list(range(1, 1 + sum(ext)))
    batch = ForwardBatch.extend([0, 1, 2, 3], prefix, ext, loc, CPU)
    want = [p + i for p, n in zip(prefix, ext) for i in range(n)]
    assert batch.positions.tolist() == want
    assert ForwardBatch.decode([0, 1], [7, 3], [6, 2], CPU).positions.tolist() == [6, 2]
    assert ForwardBatch.verify([0, 1], [7, 4], [1, 2, 3, 4, 5, 6], CPU, 3).positions.tolist() == [4, 5, 6, 1, 2, 3]


def test_replay_finds_sizes_captured_after_an_earlier_replay():
    spec = BatchSpec(DEC, (40, 3, 77), (1,) * 3, page_size=16)
    case = make_mla_case(spec, "tiny", seed=9)
    backend = backend_for(case)
    backend.init_cuda_graph_state(8, case.layout.req_to_token_pool.max_context)
    backend.init_forward_metadata_capture_cuda_graph(8, DEC)
    step = follow_up(case, DEC, (40, 3), (1, 1), requests=[0, 1], seed=1)
    assert backend.init_forward_metadata_replay_cuda_graph(step.batch).batch_size == 8
    backend.init_forward_metadata_capture_cuda_graph(2, DEC)
    assert backend.init_forward_metadata_replay_cuda_graph(step.batch).batch_size == 2
    with pytest.raises(ValueError, match="was not captured"):
        backend.init_forward_metadata_replay_cuda_graph(step.batch, bs=4)


def test_replay_host_bench_runs_and_reports_every_component(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert replay_host.main(["--bs", "1,4", "--context", "256", "--iters", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["bs"], r["metadata"]) for r in rows] == [(1, "device"), (4, "device"), (1, "host"), (4, "host")]
    for r in rows:
        for c in (*replay_host.COMPONENTS, "other", "prepare", "batch"):
            assert r[f"{c}_us"] >= 0 or c == "other"
        assert r["prepare_ops"] > 0 and r["kernel"] in ("fa3", "flashmla", "splitkv")
        assert r["prologue_gpu_us"] is None  # measured on CUDA only
    by = {(r["bs"], r["metadata"]): r for r in rows}
    for bs in (1, 4):  # the page-table gather (four ops) left the update for the graph's prologue
        assert by[(bs, "host")]["replay_into_ops"] - by[(bs, "device")]["replay_into_ops"] >= 4
    assert "prepare" in capsys.readouterr().out


def test_every_size_of_a_batch_bucket_follows_the_policy():
    """A bucket is judged at each of its sizes: between two sizes the set of equally-near table shapes can change
    (32 heads, bs 89, 8263 tokens: FA3 while 87, 88 and 90 pick FlashMLA)."""
    for heads, bs, mx in ((32, 89, 8263), (16, 89, 33024)):
        p = _choice(heads)
        for b in range(bs - 3, bs + 4):  # the neighbours first: they fill the bucket's cache entry
            assert p.choose_decode_kernel(b, mx, None)[0] == _policy(heads, b, mx, None), (heads, b, mx)
