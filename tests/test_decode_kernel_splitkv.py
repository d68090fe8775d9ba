"""The split-KV pick of ``explain_decode_kernel`` against the H200 sweeps that timed it.

Oracles, read with ``csv`` alone (``test_decode_kernel.small_batch``): ``docs/perf/2026-12-03/decode_small_batch.csv``
(``SMALL_KERNEL``: heads 16 / 128 × bs 1, 2, 4, 8 × context 16k-128k, page 64, equal lengths — FA3, FlashMLA and
split-KV *alone* per layer) and ``2026-12-06/h200/decode_whole_step.csv`` (``SMALL``: the same shapes as the
backend's *whole step* with each kernel forced, split-KV's schedule re-planned on the device in the graph). The
built-in table holds the whole-step rows: there split-KV wins at 16 heads, bs 1-8 (all but bs 8, 64k), nowhere at
128 heads. The kernel-alone table (an earlier table) keeps the machinery checked on a second data set.
The winners and margins come from the CSVs, never from the table under test.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from mla_fa3.policy import decode_kernel as kc
from mla_fa3.policy.paths import DecodeKernel

from test_decode_kernel import SMALL, SMALL_KERNEL, SWEEP, lengths_of, small_batch, times_of, winner

FA3, MLA, SKV = DecodeKernel.FA3, DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV
RUN2 = SWEEP.parent / "decode_2026-12-02_run2.csv"
# queries on and between the measured grid: heads, batch, longest context, (None = equal | "skewed")
HEADS = (4, 8, 12, 16, 20, 24, 32, 48, 64, 96, 128)
BATCH = (1, 2, 3, 4, 6, 8, 12, 16, 64, 128)
CONTEXT = (1024, 4096, 8192, 12000, 16384, 24000, 32768, 50000, 65536, 100000, 131072, 200000)
KERNEL_TABLE = kc.table_from_csvs([str(SWEEP), str(SMALL_KERNEL)])  # the table before the whole-step sweep


def _pick(h, bs, ctx, kind="equal", **kw):
    lens = lengths_of(kind, bs, ctx)
    return kc.explain_decode_kernel(h, bs, max(lens), 64, mean_seqlen_k=sum(lens) / bs, **kw)


@pytest.mark.parametrize("oracle,table", [(SMALL, None), (SMALL_KERNEL, KERNEL_TABLE)], ids=["whole_step", "kernel"])
def test_every_small_batch_row_is_within_5pct_of_the_fastest_kernel(oracle, table):
    rows = small_batch(oracle)
    assert len(rows) == 32
    for (h, bs, ctx), t in rows.items():
        times = times_of(t)
        k = _pick(h, bs, ctx, table=table).kernel
        assert times[k] / min(times.values()) <= 1.05, ((h, bs, ctx), k, times)
        assert k is winner(t), ((h, bs, ctx), k, times)  # on the grid the rule is the measured winner
        if k is SKV:  # never picked where it is not measured faster than both others by MIN_GAIN
            assert min(t["fa3"], t["mla"]) / t["skv"] >= kc.MIN_GAIN
    wins = {s for s, t in rows.items() if winner(t) is SKV}
    assert wins and {h for h, _, _ in wins} == {16}  # both: split-KV wins at 16 heads only


def test_the_built_in_table_picks_splitkv_at_16_heads_small_batch_only():
    whole, alone = small_batch()[(16, 1, 16384)], small_batch(SMALL_KERNEL)[(16, 1, 16384)]
    assert min(whole["fa3"], whole["mla"]) / whole["skv"] >= kc.MIN_GAIN  # the whole step: split-KV faster there
    choice = kc.explain_decode_kernel(16, 1, 16384, 64)
    assert choice.kernel is SKV and f"split-KV {whole['skv']:.4g} ms" in choice.reason
    choice = kc.explain_decode_kernel(16, 1, 16384, 64, table=KERNEL_TABLE)
    assert choice.kernel is SKV and f"split-KV {alone['skv']:.4g} ms" in choice.reason
    wins = {s for s, t in small_batch().items() if winner(t) is SKV}
    win_heads, win_bs = {h for h, _, _ in wins}, max(b for _, b, _ in wins)
    for h in (16, 64, 128):
        for bs in BATCH:
            for ctx in CONTEXT:
                for kind in ("equal", "skewed"):
                    k = _pick(h, bs, ctx, kind).kernel
                    if k is SKV:  # next to a measured whole-step win only: within one batch step (they double)
                        assert h in win_heads and bs < 2 * win_bs and ctx >= 8192, (h, bs, ctx, kind)
                    if h >= 64:
                        assert _pick(h, bs, ctx, kind, table=KERNEL_TABLE).kernel is not SKV, (h, bs, ctx, kind)
    assert kc.explain_decode_kernel(16, 1, 16384, 64, allow_splitkv=False).kernel is not SKV
    assert kc.explain_decode_kernel(16, 1, 16384, 64, allow_splitkv=False, table=KERNEL_TABLE).kernel is FA3


def test_splitkv_picks_between_grid_points_stay_near_its_measured_wins():
    """(Kernel-alone table.) Off the grid, split-KV is picked only next to its measured wins (16 heads, bs 1-2,
    16k-32k): within one
    grid step of context and batch, and from 8 to 24 heads (the nearest measured head count is 16; the
    sweep has no 32-head split-KV time, so 24 heads follows 16 where 32 heads has no row at that shape)."""
    wins = {s for s, t in small_batch(SMALL_KERNEL).items() if winner(t) is SKV}
    seen = set()
    for h in HEADS:
        for bs in BATCH:
            for ctx in CONTEXT:
                for kind in ("equal", "skewed"):
                    choice = _pick(h, bs, ctx, kind, table=KERNEL_TABLE)
                    if choice.kernel is SKV:
                        assert 8 <= h <= 24 and bs <= 2 and 8192 <= ctx <= 32768, (h, bs, ctx, choice.reason)
                        assert any(f"heads 16, bs {b}, ctx {c}," in choice.reason for _, b, c in wins)
                        seen.add((h, bs))
    assert {(16, 1), (16, 2), (20, 1)} <= seen and not any(h >= 32 for h, _ in seen)


def test_a_nearest_shape_without_a_splitkv_time_rules_splitkv_out():
    """16 heads bs 1 8k lies midway between 4k (full sweep: no split-KV time) and 16k (split-KV 1.25x faster):
    the unmeasured neighbour is read as no evidence, not as a win (and the reason says so)."""
    choice = kc.explain_decode_kernel(16, 1, 8192, 64)
    assert "heads 16, bs 1, ctx 4096" in choice.reason and "heads 16, bs 1, ctx 16384" in choice.reason
    assert choice.kernel is not SKV and "split-KV not measured at 1 of these 2 shapes" in choice.reason
    # with a split-KV time at 4k too, the same query follows the geometric mean of both gains
    table = tuple(replace(m, splitkv_ms=m.fa3_ms / 1.5) if (m.num_heads, m.batch_size, m.context) == (16, 1, 4096)
                  else m for m in kc.MEASURED)
    assert kc.explain_decode_kernel(16, 1, 8192, 64, table=table).kernel is SKV


@pytest.mark.parametrize("table", [None, KERNEL_TABLE], ids=["built_in", "kernel"])
@pytest.mark.parametrize("sweep", [SWEEP, RUN2], ids=["run1", "run2"])
def test_older_sweeps_pick_splitkv_only_where_the_splitkv_sweeps_measured_it_winning(sweep, table):
    """On the kernel-alone sweeps (no split-KV time), split-KV is picked only at the shapes those sweeps share with
    a split-KV sweep where it measured faster (those rows are not scored: no time to compare)."""
    ev = kc.evaluate_on_csv(str(sweep), table=table)
    oracle = small_batch() if table is None else small_batch(SMALL_KERNEL)
    wins = {(h, b, c) for (h, b, c), t in oracle.items() if winner(t) is SKV}
    picked = {tuple(int(x.split()[1].rstrip(",")) for x in label.split(", ")[:3]) for label in ev.fitted.splitkv_at}
    assert picked and picked <= wins
    assert all(label.endswith("skew 1.00") for label in ev.fitted.splitkv_at)
    assert ev.fitted.unscored == len(picked) and ev.fitted.rows == 180 - len(picked)
    assert ev.fitted.within_5pct >= 0.97 * ev.fitted.rows


@pytest.mark.parametrize("oracle,table", [(SMALL, None), (SMALL_KERNEL, KERNEL_TABLE)], ids=["whole_step", "kernel"])
def test_evaluate_reports_the_small_batch_sweep_and_where_splitkv_is_picked(oracle, table):
    ev = kc.evaluate_on_csv(str(oracle), table=table)
    rows = small_batch(oracle)
    assert ev.fitted.rows == 32 and ev.fitted.unscored == 0 and ev.fitted.within_5pct == 32
    want = {s for s, t in rows.items() if winner(t) is SKV}
    assert ev.fitted.splitkv_picks == len(want) and want
    assert set(ev.fitted.splitkv_at) == {f"heads {h}, bs {b}, ctx {c}, skew 1.00" for h, b, c in want}
    best = [min(times_of(t).values()) for t in rows.values()]
    picked = [times_of(t)[_pick(*s, table=table).kernel] for s, t in rows.items()]
    assert ev.fitted.mean_slowdown == pytest.approx(sum(p / b for p, b in zip(picked, best)) / 32, rel=1e-12)
    if table is None:
        return
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert kc.main(["--from-csv", str(SWEEP), "--from-csv", str(SMALL_KERNEL), "--evaluate", str(SMALL_KERNEL),
                        "--evaluate", str(SWEEP)]) == 0
    out = buf.getvalue()
    assert out.count("rule (table):") == 2 and "split-KV picked (table) at: heads 16, bs 1, ctx 16384" in out
    assert "1 more rows without a split-KV time (not scored)" in out


def test_splitkv_possible_is_never_false_where_the_choice_picks_it():
    for h in HEADS:
        picks = any(_pick(h, bs, ctx, kind, table=KERNEL_TABLE).kernel is SKV
                    for bs in BATCH for ctx in CONTEXT for kind in ("equal", "skewed"))
        assert kc.splitkv_possible(h, KERNEL_TABLE) or not picks, h
        picks = any(_pick(h, bs, ctx, kind).kernel is SKV for bs in BATCH for ctx in CONTEXT for kind in ("equal",))
        assert kc.splitkv_possible(h) or not picks, h
    for table in (None, KERNEL_TABLE):  # whole steps and kernels alone: split-KV wins at 16 heads only
        assert kc.splitkv_possible(16, table) and not kc.splitkv_possible(64, table)
    no_skv = tuple(replace(m, splitkv_ms=None) for m in kc.MEASURED)
    assert not kc.splitkv_possible(16, no_skv) and not kc.splitkv_measured(no_skv) and kc.splitkv_measured()
    slower = tuple(replace(m, splitkv_ms=2 * m.fa3_ms) for m in kc.MEASURED)  # measured, but never faster
    assert kc.splitkv_measured(slower) and not kc.splitkv_possible(16, slower)
    with pytest.raises(ValueError, match="num_heads"):
        kc.splitkv_possible(0)
