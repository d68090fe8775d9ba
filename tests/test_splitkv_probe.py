"""``benchmarks/splitkv_probe.py`` on a CPU: the launch it wraps gets a stamp buffer of the kernel's grid (capacity x
head tiles x 4, int64), one per shape and kept for later launches (a graph captured after the first launch replays
into it), the launch is restored after the block; and its summary of a launch's stamps, against figures worked out
by hand. The stamps themselves (``%smid``, ``%globaltimer``) are GPU-only: ``tests/test_splitkv_gpu.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.splitkv_probe import PhaseOneProbe
from mla_fa3 import ops
from mla_fa3.ops import splitkv_triton


def test_the_launch_gets_one_buffer_per_grid_and_is_restored(monkeypatch):
    seen = []

    def launch(call, schedule, config=None, **kwargs):
        seen.append(kwargs["probe"])
        return "partials"

    monkeypatch.setattr(splitkv_triton, "splitkv_partials", launch)
    sched = ops.get_splitkv_schedule([5000, 70], num_heads=20, page_size=64, num_sms=8, max_batch=3)
    call = SimpleNamespace(q=torch.zeros(2, 1, 20, 8))  # 20 heads, one token: 32-head blocks -> one head tile
    with PhaseOneProbe():
        assert splitkv_triton.splitkv_partials(call, sched) == "partials"
        splitkv_triton.splitkv_partials(call, sched)
        splitkv_triton.splitkv_partials(SimpleNamespace(q=torch.zeros(2, 2, 40, 8)), sched)  # 2 tokens x 40 heads
    assert splitkv_triton.splitkv_partials is launch
    assert [tuple(p.shape) for p in seen] == [(sched.capacity, 1, 4)] * 2 + [(sched.capacity, 2, 4)]
    assert seen[0] is seen[1] and seen[0].dtype == torch.int64 and bool((seen[0] == -1).all())


def test_summary_of_a_launch_worked_out_by_hand(monkeypatch):
    def launch(call, schedule, config=None, **kwargs):
        stamps = kwargs["probe"]
        # (SM, start, first key, end) in ns; work rows 0-2 live (num_work 3), row 3 idle and never written
        stamps[:3, 0] = torch.tensor([[5, 1000, 2000, 11000], [5, 1500, 2500, 9500], [7, 3000, 3500, 13000]])
        return None

    monkeypatch.setattr(splitkv_triton, "splitkv_partials", launch)
    sched = SimpleNamespace(capacity=4, config=ops.KernelConfig(), num_work=torch.tensor([3], dtype=torch.int32))
    with PhaseOneProbe() as probe:
        assert probe.summary() == {}
        splitkv_triton.splitkv_partials(SimpleNamespace(q=torch.zeros(1, 1, 16, 8)), sched)
    assert probe.summary() == dict(
        programs=3, sms=2, max_per_sm=2, sms_with_1=1, sms_with_2=1, sms_with_3_plus=0,
        start_spread_us=2.0,  # starts 0, 0.5, 2.0 µs
        first_key_median_us=1.5, first_key_max_us=2.5,  # 1.0, 1.5, 2.5
        duration_median_us=9.0, duration_max_us=9.5,  # 9.0, 7.0, 9.5
        end_median_us=10.0, end_max_us=12.0, tail_us=2.0)  # ends 10.0, 8.5, 12.0


def test_a_stamp_buffer_of_the_wrong_grid_is_refused_before_the_launch():
    from mla_fa3.ops import Impl, validate

    q, kv = torch.zeros(2, 1, 16, 576), torch.zeros(4, 64, 1, 576)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([100, 7], dtype=torch.int32)
    sched = ops.get_splitkv_schedule([100, 7], num_heads=16, page_size=64, num_sms=8)
    call = validate.check_splitkv(q, kv, table, lens, head_dim_v=512, schedule=sched, softmax_scale=0.1, causal=True,
                                  descale_q=None, descale_k=None, impl=Impl.TRITON)
    bad = (torch.zeros(sched.capacity, 1, 3, dtype=torch.int64), torch.zeros(sched.capacity + 1, 1, 4, dtype=torch.int64),
           torch.zeros(sched.capacity, 1, 4, dtype=torch.int32))
    for probe in bad:
        with pytest.raises(ValueError, match=rf"^probe must be an int64 \[{sched.capacity}, 1, 4\] tensor"):
            splitkv_triton.splitkv_partials(call, sched, probe=probe)
