"""``benchmarks/splitkv_probe.py`` on a CPU: the launches it wraps (phase 1 and the combine) get stamp buffers of their
grids (phase 1: capacity x head tiles x 4; the combine: output rows x column blocks x 4; int64), two sets per grid
that the steps alternate between, kept for later launches (a graph captured after the first steps replays into them);
both launches are restored after the block; its summary of a step, against figures worked out by hand; and a stamp
buffer of the wrong grid is refused before either launch. The stamps themselves (``%smid``, ``%globaltimer``) are
GPU-only: ``tests/test_splitkv_gpu.py``."""

from __future__ import annotations

import csv
import statistics
from types import SimpleNamespace

import pytest
import torch

from benchmarks.splitkv_probe import SplitKVProbe
from mla_fa3 import ops
from mla_fa3.ops import splitkv_triton
from mla_fa3.ops.splitkv_combine_triton import combine_splits


def test_each_launch_gets_buffers_of_its_grid_alternating_by_step_and_is_restored(monkeypatch):
    seen = []

    def partials(call, schedule, config=None, **kwargs):
        seen.append(("phase1", kwargs["probe"]))
        return "partials"

    def combine(part_o, part_lse2, split_offsets, out, lse, descale_k=None, **kwargs):
        seen.append(("combine", kwargs.get("probe")))

    monkeypatch.setattr(splitkv_triton, "splitkv_partials", partials)
    monkeypatch.setattr(splitkv_triton, "combine_splits", combine)
    sched = ops.get_splitkv_schedule([5000, 70], num_heads=20, page_size=64, num_sms=8, max_batch=3)
    call = SimpleNamespace(q=torch.zeros(2, 1, 20, 8))  # 20 heads, one token: 32-head blocks -> one head tile
    part_o, out = torch.zeros(sched.capacity, 1, 20, 512), torch.zeros(2, 1, 20, 512)  # 40 rows: the narrow tile
    with SplitKVProbe():
        for _ in range(3):
            assert splitkv_triton.splitkv_partials(call, sched) == "partials"
            splitkv_triton.combine_splits(part_o, None, None, out, None, None, pdl=True)
        splitkv_triton.combine_splits(part_o, None, None, out, None)  # no phase 1 before it: not stamped
        splitkv_triton.splitkv_partials(SimpleNamespace(q=torch.zeros(2, 2, 40, 8)), sched)  # 2 tokens x 40 heads
        splitkv_triton.combine_splits(part_o, None, None, out, None, tile=(64, 64))
    assert splitkv_triton.splitkv_partials is partials and splitkv_triton.combine_splits is combine
    kinds = [kind for kind, _ in seen]
    assert kinds == ["phase1", "combine"] * 3 + ["combine", "phase1", "combine"]
    bufs = [p for _, p in seen]
    assert [tuple(p.shape) for p in bufs[:6]] == [(sched.capacity, 1, 4), (40, 16, 4)] * 3  # 32 columns a block
    assert bufs[6] is None
    assert tuple(bufs[7].shape) == (sched.capacity, 2, 4) and tuple(bufs[8].shape) == (40, 8, 4)  # 64 columns
    assert bufs[0] is bufs[4] and bufs[1] is bufs[5], "steps 1 and 3 share a set"
    assert bufs[2] is not bufs[0] and bufs[3] is not bufs[1], "consecutive steps do not"
    assert all(p.dtype == torch.int64 and bool((p == -1).all()) for p in bufs if p is not None)


def test_summary_of_two_steps_worked_out_by_hand(monkeypatch):
    stamps = {}  # what the fake launches write: the step's phase-1 rows (live ones) and every combine row

    def partials(call, schedule, config=None, **kwargs):
        kwargs["probe"][: stamps["phase1"].shape[0], 0] = stamps["phase1"]

    def combine(part_o, part_lse2, split_offsets, out, lse, descale_k=None, **kwargs):
        kwargs["probe"].view(-1, 4)[:] = stamps["combine"]

    monkeypatch.setattr(splitkv_triton, "splitkv_partials", partials)
    monkeypatch.setattr(splitkv_triton, "combine_splits", combine)
    # 2 requests of 100 and 60 keys (D = 576, bf16: 1152 bytes a key); work rows 0-2 live (num_work 3), row 3 idle:
    # (request 0, keys 0-64), (0, 64-128: 36 of them below the length), (1, 0-64: 60)
    work = torch.tensor([[0, 0, 64, 0], [0, 64, 128, 1], [1, 0, 64, 2], [0, 0, 0, 3]], dtype=torch.int32)
    sched = SimpleNamespace(capacity=4, config=ops.KernelConfig(), num_work=torch.tensor([3], dtype=torch.int32),
                            work=work)
    call = SimpleNamespace(q=torch.zeros(2, 1, 16, 8), cache_seqlens=torch.tensor([100, 60], dtype=torch.int32),
                           kv_cache=torch.zeros(3, 64, 1, 576, dtype=torch.bfloat16))
    out, part_o = torch.zeros(2, 1, 16, 512), torch.zeros(4, 1, 16, 512)  # 32 rows: 16 column blocks
    steps = [  # (SM, start, first key / first read, end) in ns
        # step 1: only its combine's last end matters (the gap): 500 ns
        dict(phase1=torch.tensor([[1, 0, 10, 90]] * 3),
             combine=torch.tensor([[1, 100, 200, 300]] * 511 + [[2, 100, 200, 500]])),
        dict(phase1=torch.tensor([[5, 1000, 2000, 11000], [5, 1500, 2500, 9500], [7, 3000, 3500, 13000]]),
             combine=torch.tensor([[9, 11500, 13500, 14000]] * 300 + [[9, 11600, 13400, 14500]] * 212)),
    ]
    with SplitKVProbe() as probe:
        assert probe.summary() == {}
        for step in steps:
            stamps.update(step)
            splitkv_triton.splitkv_partials(call, sched)
            splitkv_triton.combine_splits(part_o, None, None, out, None)
    assert probe.summary() == dict(
        programs=3, sms=2, max_per_sm=2, sms_with_1=1, sms_with_2=1, sms_with_3_plus=0,
        start_spread_us=2.0,  # starts 0, 0.5, 2.0 µs
        first_key_median_us=1.5, first_key_max_us=2.5,  # 1.0, 1.5, 2.5
        duration_median_us=9.0, duration_max_us=9.5,  # 9.0, 7.0, 9.5
        end_median_us=10.0, end_max_us=12.0, tail_us=2.0,  # ends 10.0, 8.5, 12.0
        keys_max=64, read_mb=0.18, read_tb_s=0.018,  # 64 + 36 + 60 = 160 keys x 1152 B = 184,320 B in 10.5 µs: 0.0176
        combine_programs=512, combine_start_us=10.5, combine_read_us=12.4, combine_read_median_us=12.5,
        combine_end_us=13.5, handoff_us=0.4, combine_us=1.1, step_us=13.5,
        gap_us=0.5)  # step 1's last combine end (500 ns) to step 2's first start (1000 ns)
    rows = probe.timeline()
    assert [r["phase"] for r in rows] == ["phase1"] * 3 + ["combine"] * 512 + ["combine_before"] * 512
    assert rows[1] == dict(phase="phase1", row=1, block=0, request=0, keys=36, sm=5, start_us=0.5, first_us=1.5,
                           end_us=8.5)
    assert rows[2]["request"] == 1 and rows[2]["keys"] == 60
    # the combine's rows in (output row, column block) order: 16 heads x 16 blocks a request
    assert rows[3 + 300] == dict(phase="combine", row=18, block=12, request=1, keys="", sm=9, start_us=10.6,
                                 first_us=12.4, end_us=13.5)
    assert rows[-1]["end_us"] == -0.5 and rows[-1]["request"] == 1


def test_stamp_buffers_of_the_wrong_grid_are_refused_before_the_launch():
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
    part_o, part_lse2 = torch.zeros(sched.capacity, 1, 16, 512), torch.zeros(sched.capacity, 1, 16)
    out, lse = torch.full((2, 1, 16, 512), 7.0), torch.full((2, 1, 16), 7.0)
    for probe in (torch.zeros(32, 8, 4, dtype=torch.int64), torch.zeros(32, 16, 4, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"^probe must be an int64 \[32, 16, 4\] tensor"):
            combine_splits(part_o, part_lse2, sched.split_offsets, out, lse, probe=probe)
    assert bool((out == 7.0).all()) and bool((lse == 7.0).all()), "nothing launched"


def test_per_sm_sums_the_work_and_the_ends_by_sm_worked_out_by_hand(tmp_path, capsys):
    from benchmarks.splitkv_probe import main, per_sm

    def row(sm, keys, first, end, phase="phase1"):
        return dict(phase=phase, sm=sm, keys=keys, first_us=first, end_us=end)

    # SM 0: two programs (1000 + 1000 keys), last end 20 µs; SM 1: one of 1000, ends 11; SM 2: two (1000 + 500), 16
    rows = [row(0, 1000, 1.0, 19.0), row(0, 1000, 2.0, 20.0), row(1, 1000, 1.0, 11.0), row(2, 1000, 1.5, 16.0),
            row(2, 500, 1.5, 8.0), row(9, "", 0.0, 99.0, phase="combine")]
    got = per_sm(rows, row_bytes=1000)
    # keys per SM 2000, 1000, 1500 (mean 1500), ends 20, 11, 16 (mean 47/3): slope = (500·(13/3) + 500·(14/3)) / 500000
    # = 0.009 µs a key; r² = slope² · sxx / syy = 40.5 / (18.78 + 21.78 + 0.11) = 0.996
    assert got == dict(sms=3, sm_keys_min=1000, sm_keys_median=1500, sm_keys_max=2000, end_sm1_us=11.0,
                       end_sm2_us=18.0, end_us_per_kkey=9.0, end_fit_r2=0.996,
                       program_gb_s=round(statistics.median([1000e3 / 18 / 1e3, 1000e3 / 18 / 1e3, 1000e3 / 10 / 1e3,
                                                            1000e3 / 14.5 / 1e3, 500e3 / 6.5 / 1e3]), 2))
    assert per_sm([row(9, "", 0.0, 1.0, phase="combine")]) == {}
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["heads", "bs", "ctx", "kv", "round", "value", "phase", "sm", "keys",
                                          "first_us", "end_us"])
        w.writeheader()
        for value in ("1.0", "2.0"):
            for r in rows:
                w.writerow(dict(heads=16, bs=4, ctx=32768, kv="bf16", round=0, value=value, **r))
    assert main([str(path), "--row-bytes", "1000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("heads=16,bs=4,ctx=32768,kv=bf16,round=0,value=2.0: sms=3,")
