"""Split-KV MLA decode on the CPU: the host split planner, the graph-safe schedule, the op's boundary checks,
the op (torch reference) against an fp64 oracle, and — when ``triton`` imports — the Triton kernels under
Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess: this file run as a script).

Planner reference (brute force): every token of every request is owned by exactly one split, splits of a
request are contiguous slots in request order, starts fall on the granule (whole pages and key blocks),
no split exceeds ``chunk`` and the count never exceeds ``target + bs`` (the graph capacity).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter, subprocess_env

from ops_cases import build_flashmla, flashmla_oracle, tolerances

from mla_fa3 import ops
from mla_fa3.ops import KernelUnavailableError, SplitKVSchedule, validate
from mla_fa3.ops import splitkv_plan as sp
from mla_fa3.ops.splitkv_config import KernelConfig, choose_config
from mla_fa3.ops.types import Impl

I32 = torch.int32

# ------------------------------------------------------------------------------------------ planner


def fit_by_scan(lens, *, target, granule, min_split_tokens):
    """The planner's chunk by a linear scan (the module docstring's rule, not its bisection): the even share rounded up
    to the granule, or the first chunk up to a quarter (in granules) larger that cuts ``lens`` into <= target
    splits, when the share itself does not, such a chunk exists and the rounds' model says it ends sooner: the first
    ``target`` splits in request order take the slots, the rest wait for the shortest of them."""
    def sizes(chunk):
        out = []
        for L in lens:
            if L:
                n = math.ceil(L / chunk)
                size = granule * math.ceil(math.ceil(L / n) / granule)
                out += [min(size, L - s) for s in range(0, L, size)]
        return out

    def rounds(chunk):
        first, later = sizes(chunk)[:target], sizes(chunk)[target:]
        return max(first + [min(first) + x for x in later]) if first else 0

    g0 = math.ceil(max(min_split_tokens, math.ceil(sum(lens) / target), 1) / granule)
    if sum(math.ceil(L / (g0 * granule)) for L in lens) <= target:
        return g0 * granule
    for g in range(g0 + 1, g0 + g0 // 4 + 1):
        if sum(math.ceil(L / (g * granule)) for L in lens) <= target:
            return g * granule if rounds(g * granule) < rounds(g0 * granule) else g0 * granule
    return g0 * granule


def brute_force_check(lens, work, offsets, chunk, *, target, granule, min_split_tokens, fit=True):
    """Check a plan token by token (independent of the planner's arithmetic); ``fit`` False: the plan without the
    fit, at the even share rounded up to the granule."""
    bs = len(lens)
    assert len(offsets) == bs + 1 and offsets[0] == 0 and offsets[-1] == len(work)
    assert chunk % granule == 0
    chunk0 = granule * math.ceil(max(min_split_tokens, math.ceil(sum(lens) / target), 1) / granule)
    assert chunk == (fit_by_scan(lens, target=target, granule=granule, min_split_tokens=min_split_tokens) if fit
                     else chunk0)
    assert len(work) <= sp.capacity_for(bs, target)
    owners = [[0] * L for L in lens]
    for slot, (b, s, e, w_slot) in enumerate(work):
        assert w_slot == slot, "slot = row index: the workspace row of the split"
        assert offsets[b] <= slot < offsets[b + 1], "a request's splits occupy its slot range"
        assert 0 <= s < e <= lens[b] and e - s <= chunk
        assert s % granule == 0, "splits start on whole pages / key blocks"
        for j in range(s, e):
            owners[b][j] += 1
    for b, own in enumerate(owners):
        assert all(o == 1 for o in own), f"request {b}: every token in exactly one split"
        assert offsets[b + 1] - offsets[b] == (math.ceil(lens[b] / chunk) if lens[b] else 0)


def _plan(lens, target=8, page=16, min_split=128):
    granule = max(page, sp.SPLIT_GRANULE)
    work, offsets, chunk = sp.plan_splits(lens, target=target, granule=granule, min_split_tokens=min_split)
    brute_force_check(lens, work, offsets, chunk, target=target, granule=granule, min_split_tokens=min_split)
    return work, offsets, chunk


PLAN_CASES = {
    "docstring_example": ([1000, 0, 70], 8, 16),
    "one_token": ([1], 132, 64),
    "page_pm1": ([63, 64, 65, 127, 129], 132, 64),
    "page1": ([1, 2, 3, 4097], 66, 1),
    "page128": ([127, 128, 129, 100_000], 132, 128),
    "all_empty": ([0, 0, 0], 132, 16),
    "idle_batch": ([], 132, 64),
    "bs1_128k": ([131072], 132, 64),
    "huge": ([2**31 - 1, 5], 132, 64),
    "skewed": ([131072 >> k for k in range(8)], 132, 64),
    # the fit: 16 x 64k and 64 x 16k over 264 slots (chunk0 4032 gives 272 and 320 splits; 4096 gives 256), and
    # 300 short requests beside a long one (no chunk up to a quarter larger fits: chunk0 stays)
    "fit_bs16_64k": ([65536] * 16, 264, 64),
    "fit_bs64_16k": ([16384] * 64, 264, 64),
    "fit_fails": ([100] * 300 + [131072], 264, 64),
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_planner_brute_force(name):
    lens, target, page = PLAN_CASES[name]
    if name == "huge":  # too many tokens to enumerate: check the arithmetic bounds only
        work, offsets, chunk = sp.plan_splits(lens, target=target, granule=page, min_split_tokens=128)
        assert len(work) <= target + len(lens) and all(e - s <= chunk for _, s, e, _ in work)
        assert [sum(e - s for b2, s, e, _ in work if b2 == b) for b in range(2)] == lens
        return
    _plan(lens, target, page)


def test_planner_random_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.randint(1, 9)
        lens = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 5000)]) for _ in range(bs)]
        _plan(lens, target=rng.randint(1, 140), page=rng.choice([1, 2, 16, 64, 128]), min_split=rng.choice([1, 64, 128]))


def test_planner_fits_the_target_where_a_quarter_more_suffices():
    work, _, chunk = _plan([65536] * 16, target=264, page=64)
    assert chunk == 4096 and len(work) == 256, "16 splits a request, not 17 (272 > 264 slots)"
    work, _, chunk = sp.plan_splits([65536] * 16, target=264, granule=64, fit=False)  # KernelConfig.fit_splits off
    assert chunk == 4032 and len(work) == 272
    assert KernelConfig(fit_splits=False).label().endswith("-nofit") and "fit" not in KernelConfig().label()
    work, _, chunk = _plan([16384] * 64, target=264, page=64)
    assert chunk == 4096 and len(work) == 256
    work, _, chunk = _plan([100] * 300 + [131072], target=264, page=64)
    assert chunk == 640 and len(work) == 300 + 205, "chunk0 (161,072 / 264 -> 640): at 768, still 471 splits"
    # 4 long requests and 20 short: at chunk0 (1024) the 12 splits past 264 are short ones (100 keys), started as
    # soon as the first-round short ones end: 1024 keys in all; the fit (1088) would make every long split longer
    work, _, chunk = _plan([65536] * 4 + [100] * 20, target=264, page=64)
    assert chunk == 1024 and len(work) == 276
    work, _, chunk = _plan([100] * 20 + [65536] * 4, target=264, page=64)  # the long splits last: 12 of them wait
    assert chunk == 1088 and len(work) == 264
    rng = random.Random(3)
    fitted = 0
    for _ in range(60):  # long requests of similar lengths: the chunk grows just enough, never past a quarter
        bs, target = rng.randint(1, 40), rng.randint(40, 300)
        lens = [rng.randint(8000, 20000) for _ in range(bs)]
        work, _, chunk = _plan(lens, target=target, page=64, min_split=128)
        chunk0 = 64 * math.ceil(max(128, math.ceil(sum(lens) / target)) / 64)
        assert chunk0 <= chunk <= chunk0 + 64 * (chunk0 // 64 // 4)
        if chunk > chunk0:
            fitted += 1
            assert len(work) <= target and sum(math.ceil(L / (chunk - 64)) for L in lens) > target
    assert fitted >= 10, fitted


def even_cut_check(lens, work, offsets, chunk, *, target, granule, min_split_tokens):
    """Check an even cut token by token (independent of the planner's arithmetic): every token of a request in
    exactly one of its splits, contiguous slots in request order, starts on the granule; request b has
    n_b = max(1, min(u_b, max(1, L_b // min_split_tokens), target · u_b // U)) splits (u_b its granules) whose
    granule counts differ by at most one, the longer first; ``chunk`` is the longest split."""
    bs = len(lens)
    units = [math.ceil(L / granule) for L in lens]
    assert len(offsets) == bs + 1 and offsets[0] == 0 and offsets[-1] == len(work) <= target + bs
    owners = [[0] * L for L in lens]
    for slot, (b, s, e, w_slot) in enumerate(work):
        assert w_slot == slot and offsets[b] <= slot < offsets[b + 1] and 0 <= s < e <= lens[b] and s % granule == 0
        for j in range(s, e):
            owners[b][j] += 1
    for b, own in enumerate(owners):
        assert all(o == 1 for o in own), f"request {b}: every token in exactly one split"
        n = max(1, min(units[b], max(1, lens[b] // min_split_tokens), target * units[b] // sum(units))) if lens[b] else 0
        assert offsets[b + 1] - offsets[b] == n
        grains = [math.ceil((e - s) / granule) for _, s, e, _ in work[offsets[b]: offsets[b + 1]]]
        assert max(grains, default=0) - min(grains, default=0) <= 1 and grains == sorted(grains, reverse=True)
    assert chunk == max((e - s for _, s, e, _ in work), default=granule)


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_the_even_cut_brute_force(name):
    lens, target, page = PLAN_CASES[name]
    if name == "huge":
        return  # too many tokens to enumerate (the device re-plans check it against the host)
    for granule in (16, 32, 64):
        work, offsets, chunk = sp.plan_splits(lens, target=target, granule=granule, min_split_tokens=128, even=True)
        even_cut_check(lens, work, offsets, chunk, target=target, granule=granule, min_split_tokens=128)


def test_the_even_cut_fills_the_target_with_splits_a_block_apart():
    work, offsets, chunk = sp.plan_splits([65536] * 4, target=264, granule=32, even=True)
    sizes = [e - s for _, s, e, _ in work]
    assert len(work) == 264 and offsets == [0, 66, 132, 198, 264] and chunk == 1024
    assert sorted(set(sizes)) == [992, 1024] and sizes.count(1024) == 8, "65536 = 2 x 1024 + 64 x 992, per request"
    config = choose_config(16, 4, 65536).with_(even_splits=True)
    sched = ops.get_splitkv_schedule([65536] * 4, num_heads=16, page_size=64, num_sms=132, config=config)
    assert sched.granule == config.block_n == 32 and sched.planned_work == 264
    assert config.label().endswith("-e") and "-e" not in choose_config(16, 4, 65536).label()
    rng = random.Random(5)
    for _ in range(100):
        bs, target = rng.randint(1, 12), rng.randint(1, 300)
        lens = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 20000)]) for _ in range(bs)]
        granule = rng.choice([16, 32, 64])
        work, offsets, chunk = sp.plan_splits(lens, target=target, granule=granule, min_split_tokens=128, even=True)
        even_cut_check(lens, work, offsets, chunk, target=target, granule=granule, min_split_tokens=128)


def test_planner_balances_one_long_request_over_the_sms():
    work, _, chunk = _plan([65536], target=132, page=64)
    sizes = [e - s for _, s, e, _ in work]
    assert len(work) == 128 and chunk == 512 and max(sizes) == min(sizes)  # 64k / 132 -> 497 -> 512


def test_planner_docstring_example():
    work, offsets, chunk = _plan([1000, 0, 70], target=8, page=16)
    assert chunk == 192 and offsets == [0, 6, 6, 7]
    assert work[5] == (0, 960, 1000, 5) and work[6] == (2, 0, 70, 6)


def test_head_tiles_cover_128_heads_and_verify():
    assert sp.head_block(16, 1) == 16 and sp.head_tiles(16, 1) == 1
    assert sp.head_block(128, 1) == 64 and sp.head_tiles(128, 1) == 2
    assert sp.head_block(16, 4) == 16 and sp.head_block(128, 4) == 16 and sp.head_tiles(128, 4) == 8
    assert sp.head_block(4, 1) == 16  # tl.dot needs 16 rows: padded heads


# ------------------------------------------------------------------------------------------ schedule buffers


def test_schedule_copy_writes_in_place_and_resets_the_tail():
    big = ops.get_splitkv_schedule([4000, 3000, 10], num_heads=16, page_size=64, num_sms=16, max_batch=4, waves=1)
    assert big.capacity == 16 + 4 and big.max_batch == 4
    work, offsets = big.work, big.split_offsets
    small = ops.get_splitkv_schedule([300], num_heads=16, page_size=64, num_sms=16, waves=1)
    n = small.planned_work
    big.copy_(small)
    assert big.work is work and big.split_offsets is offsets, "buffers stay (graph-captured addresses)"
    assert big.num_work.tolist() == [n] and big.planned_work == n and big.planned_batch == 1
    assert big.work[:n].tolist() == small.work[:n].tolist()
    assert big.work[n:, :3].eq(0).all() and big.work[n:, 3].tolist() == list(range(n, big.capacity))
    assert big.split_offsets.tolist() == [0, n, n, n, n], "requests past the plan get no split"


def test_schedule_capacity_holds_any_batch_up_to_max_batch():
    rng = random.Random(1)
    cap = ops.get_splitkv_schedule([1], num_heads=128, page_size=16, num_sms=132, max_batch=8)
    for _ in range(50):
        lens = [rng.choice([0, 1, 65, rng.randint(1, 200_000)]) for _ in range(rng.randint(1, 8))]
        cap.copy_(ops.get_splitkv_schedule(lens, num_heads=128, page_size=16, num_sms=132, config=cap.config))


def test_config_table_nearest_row_of_the_head_class_and_the_schedule_carries_it():
    table = {(16, 1, 65536): KernelConfig(block_n=16), (16, 8, 4096): KernelConfig(block_n=64),
             (128, 1, 16384): KernelConfig(max_rows=128)}
    assert choose_config(8, 1, 131072, table).block_n == 16  # nearest 16-head row in (log2 bs, log2 ctx)
    assert choose_config(16, 16, 2048, table).block_n == 64
    assert choose_config(64, 8, 4096, table).max_rows == 128  # wide heads: only the 128-head row
    cfg = KernelConfig(block_n=16, max_rows=32, waves=3.0)
    s = ops.get_splitkv_schedule([65536], num_heads=64, page_size=64, num_sms=10, config=cfg)
    assert s.config == cfg and s.planned_work == 10 * 3 // 2  # 64 heads at 32 rows: 2 tiles -> 15 splits
    assert ops.get_splitkv_schedule([65536], num_heads=64, page_size=64, num_sms=10, config=cfg,
                                    waves=1).planned_work == 5
    auto = ops.get_splitkv_schedule([65536], num_heads=16, page_size=64)
    assert auto.config == choose_config(16, 1, 65536)
    with pytest.raises(ValueError, match="^block_n must be"):
        KernelConfig(block_n=128)
    for regs in (100, 48, 256, 128.0):  # not a multiple of 8 in [64, 255] (ptxas' range), or not an int
        with pytest.raises(ValueError, match="^max_registers must be None or a multiple of 8"):
            KernelConfig(max_registers=regs)
    assert KernelConfig(max_registers=128).label().endswith("-reg128") and "reg" not in KernelConfig().label()
    with pytest.raises(TypeError, match="^config must be a KernelConfig"):
        ops.get_splitkv_schedule([5], num_heads=16, page_size=64, config="fast")


def test_an_e4m3_cache_plans_with_the_e4m3_table():
    """``kv_fp8``: the schedule carries E4M3_CONFIG_TABLE's row (the two tables differ in the latent chunks)."""
    from mla_fa3.ops.splitkv_config import CONFIG_TABLE, E4M3_CONFIG_TABLE

    for heads, bs, ctx in [(16, 1, 65536), (16, 4, 16384), (128, 2, 32768)]:
        e4m3 = ops.get_splitkv_schedule([ctx] * bs, num_heads=heads, page_size=64, kv_fp8=True).config
        plain = ops.get_splitkv_schedule([ctx] * bs, num_heads=heads, page_size=64).config
        assert e4m3 == choose_config(heads, bs, ctx, E4M3_CONFIG_TABLE)
        assert plain == choose_config(heads, bs, ctx, CONFIG_TABLE)
    with pytest.raises(TypeError, match="^kv_fp8 must be a bool"):
        ops.get_splitkv_schedule([5], num_heads=16, page_size=64, kv_fp8=1)


@pytest.mark.parametrize("dv,rows,chunks,expect", [
    (512, 16, 4, 4), (512, 16, 2, 2), (512, 32, 4, 4),
    (512, 64, 4, 1),  # wgmma (>= 64 rows): one dot
    (64, 16, 4, 1),  # 16 columns per chunk: too narrow
    (64, 16, 2, 2), (96, 16, 2, 1),  # not a power of two: the tile is padded, chunks would split the padding
    (512, 16, 1, 1)])
def test_latent_chunks_apply_to_whole_narrow_chunks_only(dv, rows, chunks, expect):
    from mla_fa3.ops.splitkv_config import latent_chunks

    assert latent_chunks(KernelConfig(latent_chunks=chunks), dv, rows) == expect
    for bad in (3, 8, 0):
        with pytest.raises(ValueError, match="^latent_chunks must be 1, 2 or 4"):
            KernelConfig(latent_chunks=bad)
    assert KernelConfig(latent_chunks=4).label().endswith("-c4") and "-c" not in KernelConfig().label()


def test_bench_ab_spec_parses_each_field_and_refuses_bad_ones():
    from mla_fa3.bench.splitkv_candidates import ab_text, parse_ab

    def one(field, *values):
        return field, tuple({field: v} for v in values)

    assert parse_ab("latent_chunks") == one("latent_chunks", 1, 2, 4)
    assert parse_ab("latent_chunks=1,2") == one("latent_chunks", 1, 2)
    assert parse_ab("pdl") == one("pdl", True, False) and parse_ab("pdl=off") == one("pdl", False)
    with pytest.raises(ValueError, match="latent_chunks must be 1, 2 or 4"):
        parse_ab("latent_chunks=3")
    assert parse_ab("waves=1,1.5") == one("waves", 1.0, 1.5) and parse_ab("num_stages") == one("num_stages", 2, 3, 4)
    with pytest.raises(ValueError, match="bad num_warps / num_stages / waves"):
        parse_ab("waves=0")
    with pytest.raises(ValueError, match="is not one of"):
        parse_ab("max_rows=16")
    assert parse_ab("combine_tile=rule,64x64,128X32") == one("combine_tile", None, (64, 64), (128, 32))
    with pytest.raises(ValueError, match="two powers of two"):
        parse_ab("combine_tile=48x64")
    with pytest.raises(ValueError, match="SPLITSxCOLUMNS"):
        parse_ab("combine_tile=64")
    assert parse_ab("num_warps=4,8") == one("num_warps", 4, 8)
    assert parse_ab("max_registers=none,168") == one("max_registers", None, 168)
    # variants: several switches changed together, each item naming its fields
    name, variants = parse_ab("num_stages=3+waves=2,num_stages=2+waves=3+max_registers=168")
    assert name == "num_stages+waves+max_registers"
    assert variants == ({"num_stages": 3, "waves": 2.0}, {"num_stages": 2, "waves": 3.0, "max_registers": 168})
    assert [ab_text(v) for v in variants] == ["num_stages=3+waves=2.0", "num_stages=2+waves=3.0+max_registers=168"]
    assert parse_ab("block_n=32,block_n=64+warp_specialized=1+waves=1")[1][1] == dict(block_n=64, warp_specialized=True,
                                                                                     waves=1.0)
    with pytest.raises(ValueError, match="warp_specialized needs block_n 64"):
        parse_ab("warp_specialized=1")  # one switch alone: the default block_n 32
    with pytest.raises(ValueError, match="is not one of"):
        parse_ab("waves=1,max_rows=16+waves=2")
    assert [ab_text(v) for v in parse_ab("combine_tile=rule,64x64")[1]] == ["rule", "64x64"]


def test_the_in_step_ab_sets_the_shapes_table_row_only_inside_its_block():
    """``benchmarks/sglang_backends.py --ab``: inside the block the table row ``choose_config`` reads for the shape is
    the value's (a schedule planned there carries it: its split target is the SMs x waves), other rows and the
    e4m3 table untouched; after it — also after an exception — the row is back."""
    from benchmarks.sglang_backends import table_row_with
    from mla_fa3.ops.splitkv_config import choose_config

    before, wide, e4m3 = choose_config(16, 4, 65536), choose_config(128, 4, 65536), choose_config(16, 4, 65536,
                                                                                                    kv_fp8=True)
    with table_row_with(16, 4, 65536, False, {"waves": 3.0}) as config:
        assert config == before.with_(waves=3.0) and choose_config(16, 4, 65536) == config
        assert choose_config(128, 4, 65536) == wide and choose_config(16, 4, 65536, kv_fp8=True) == e4m3
        sched = ops.get_splitkv_schedule([65536] * 4, num_heads=16, page_size=64, num_sms=100)
        assert sched.config == config and sched.target == 300
    assert choose_config(16, 4, 65536) == before
    with pytest.raises(RuntimeError, match="inside"):
        with table_row_with(16, 4, 65536, False, {"combine_tile": (64, 64), "num_stages": 2}):
            assert choose_config(16, 4, 65536) == before.with_(combine_tile=(64, 64), num_stages=2)
            raise RuntimeError("inside")
    assert choose_config(16, 4, 65536) == before


def test_combine_tile_rule_by_output_rows():
    from mla_fa3.ops.splitkv_config import combine_tile

    assert [combine_tile(r) for r in (1, 63, 64, 127, 128, 4096)] == [(128, 32)] * 2 + [(64, 64)] * 2 + [(16, 64)] * 2


def test_config_combine_tile_is_checked_and_labelled():
    assert KernelConfig(combine_tile=(64, 64)).label().endswith("-t64x64") and "-t" not in KernelConfig().label()
    for bad in ((48, 64), (0, 32), [16, 64], (16.0, 64), (True, 64), (16, 64, 1)):
        with pytest.raises(ValueError, match="combine_tile must be|two powers of two"):
            KernelConfig(combine_tile=bad)


def test_schedule_copy_refuses_what_does_not_fit():
    dst = SplitKVSchedule.empty(max_batch=2, capacity=4)
    with pytest.raises(ValueError, match="^other has 6 splits"):
        dst.copy_(ops.get_splitkv_schedule([768], num_heads=16, page_size=64, num_sms=6))
    with pytest.raises(ValueError, match="^other plans 3 requests"):
        dst.copy_(ops.get_splitkv_schedule([1, 1, 1], num_heads=16, page_size=64))
    with pytest.raises(TypeError, match="^other"):
        dst.copy_(ops.FlashMLASchedule(Impl.REFERENCE))
    assert dst.num_work.tolist() == [0], "a refused copy writes nothing"


# ------------------------------------------------------------------------------------------ device re-plan

REPLAN_CASES = [  # (lens, max_batch, page, num_sms): the host planner's cases, graph-sized schedules
    ([1000, 0, 70], 4, 16, 8), ([1], 1, 64, 132), ([63, 64, 65, 127, 129], 8, 64, 132), ([1, 2, 3, 4097], 4, 1, 66),
    ([127, 128, 129, 100_000], 5, 128, 132), ([0, 0, 0], 3, 16, 132), ([], 2, 64, 132), ([131072], 1, 64, 132),
    ([2**31 - 1, 5], 2, 64, 132), ([131072 >> k for k in range(8)], 16, 64, 132),
    ([65536] * 16, 16, 64, 132), ([16384] * 64, 64, 64, 132), ([100] * 30 + [131072], 31, 64, 13),  # the fit
    ([65536] * 4 + [100] * 20, 24, 64, 132), ([100] * 20 + [65536] * 4, 24, 64, 132),
    ([9000, 12000, 15000, 20000], 4, 16, 7),
]


def _replan_cases(n_random=150):
    rng = random.Random(7)
    yield from REPLAN_CASES
    for _ in range(n_random):
        bs = rng.randint(0, 9)
        lens = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 5000)]) for _ in range(bs)]
        yield lens, bs + rng.randint(0, 3) or 1, rng.choice([1, 2, 16, 64, 128]), rng.randint(1, 140)


def replan_mismatch(lens, max_batch, page, num_sms, impl, even=False, fit=True) -> str | None:
    """Re-plan a graph-sized schedule on the device from ``lens``; None when it holds exactly ``plan_splits(lens)``
    (the brute-force-checked host plan) with idle rows past it and empty requests past ``lens``, else what differs.
    ``even``: a schedule of the even cut (``KernelConfig.even_splits``); ``fit``: ``KernelConfig.fit_splits``."""
    dev = "cpu"
    config = choose_config(16, max(1, max_batch), 65536).with_(even_splits=even, fit_splits=fit)
    sched = ops.get_splitkv_schedule([1] * max_batch, num_heads=16, page_size=page, num_sms=num_sms, max_batch=max_batch,
                                     config=config)
    sched.work.fill_(-5)  # stale values: every entry must be rewritten
    sched.split_offsets.fill_(-5)
    work, offsets, chunk = sp.plan_splits(lens, target=sched.target, granule=sched.granule,
                                          min_split_tokens=sched.min_split_tokens, even=even, fit=fit)
    if sum(lens) < 10**6:  # small enough to enumerate: the host plan itself, token by token
        check = even_cut_check if even else functools.partial(brute_force_check, fit=fit)
        check(lens, work, offsets, chunk, target=sched.target, granule=sched.granule,
              min_split_tokens=sched.min_split_tokens)
    out = ops.replan_splitkv_schedule(torch.tensor(lens, dtype=I32, device=dev), sched, impl=impl)
    n = len(work)
    got = (sched.num_work.tolist(), sched.work.tolist(), sched.split_offsets.tolist())
    want = ([n], [list(r) for r in work] + [[0, 0, 0, w] for w in range(n, sched.capacity)],
            offsets + [n] * (max_batch - len(lens)))
    if out is not sched or got != want or sched.planned_work is not None or sched.planned_batch != len(lens):
        return f"lens {lens} max_batch {max_batch} page {page} sms {num_sms}: got {got}, want {want}"
    return None


def test_device_replan_reference_is_the_host_plan():
    for even, fit in ((False, True), (True, True), (False, False)):
        for lens, max_batch, page, num_sms in _replan_cases():
            assert replan_mismatch(lens, max_batch, page, num_sms, "reference", even, fit) is None


def test_device_replan_is_a_graph_replay_update():
    """Host plan at capture (every request at the longest length), then device re-plans with new lengths: same
    buffers, and a copy_ of a device-planned schedule is refused (its count is a device value)."""
    sched = ops.get_splitkv_schedule([4096] * 3, num_heads=16, page_size=64, num_sms=16, max_batch=3)
    work = sched.work
    ops.replan_splitkv_schedule(torch.tensor([100, 5000], dtype=I32), sched)
    assert sched.work is work and sched.chunk is None and sched.planned_work is None
    assert sched.split_offsets.tolist()[-1] == sched.num_work.item() > 2
    with pytest.raises(ValueError, match="^other was planned on the device"):
        ops.get_splitkv_schedule([1], num_heads=16, page_size=64, num_sms=16, max_batch=3).copy_(sched)


REPLAN_BAD = {
    "not_a_schedule": (lambda s: (torch.ones(2, dtype=I32), ops.FlashMLASchedule(Impl.REFERENCE)), TypeError,
                       "schedule"),
    "no_params": (lambda s: (torch.ones(2, dtype=I32), SplitKVSchedule.empty(max_batch=4, capacity=64)), ValueError,
                  "schedule carries no planner parameters"),
    "not_tensor": (lambda s: ([1, 2], s), TypeError, "seqlens must be a tensor"),
    "int64": (lambda s: (torch.ones(2, dtype=torch.int64), s), ValueError, "seqlens must be a 1-D int32"),
    "rank2": (lambda s: (torch.ones(1, 2, dtype=I32), s), ValueError, "seqlens must be a 1-D int32"),
    "device": (lambda s: (torch.ones(2, dtype=I32, device="meta"), s), ValueError, "seqlens must be on the schedule"),
    "too_many": (lambda s: (torch.ones(5, dtype=I32), s), ValueError, "seqlens has 5 requests"),
    "exact_capacity": (lambda s: (torch.ones(1, dtype=I32), ops.get_splitkv_schedule([70], num_heads=16, page_size=64,
                                                                                      num_sms=16)),
                       ValueError, "the schedule holds 1 splits"),
}


@pytest.mark.parametrize("name", list(REPLAN_BAD))
def test_device_replan_bad_arguments_are_named_and_write_nothing(name):
    make, exc, prefix = REPLAN_BAD[name]
    sched = ops.get_splitkv_schedule([9, 9, 9, 9], num_heads=16, page_size=64, num_sms=16, max_batch=4)
    lens, target = make(sched)
    before = [t.clone() for t in (sched.work, sched.num_work, sched.split_offsets)]
    with pytest.raises(exc, match=f"^{prefix}"):
        ops.replan_splitkv_schedule(lens, target)
    assert all(torch.equal(a, b) for a, b in zip(before, (sched.work, sched.num_work, sched.split_offsets)))


# ------------------------------------------------------------------------------------------ validation

SCHED_BAD = {
    "cuda_like_tensor": (dict(seqlens=torch.ones(2, dtype=I32, device="meta")), ValueError, "seqlens must be a host"),
    "float_tensor": (dict(seqlens=torch.ones(2)), ValueError, "seqlens"),
    "not_ints": (dict(seqlens=[1.5]), TypeError, "seqlens"),
    "negative": (dict(seqlens=[3, -1]), ValueError, r"seqlens\[1\]"),
    "page_not_pow2": (dict(page_size=48), ValueError, "page_size"),
    "heads_zero": (dict(num_heads=0), ValueError, "num_heads"),
    "sq_bool": (dict(num_q_tokens=True), TypeError, "num_q_tokens"),
    "max_batch_small": (dict(max_batch=1), ValueError, "max_batch"),
    "waves": (dict(waves=0), ValueError, "waves"),
    "num_sms": (dict(num_sms=0), ValueError, "num_sms"),
}


@pytest.mark.parametrize("name", list(SCHED_BAD))
def test_schedule_bad_arguments_are_named(name):
    upd, exc, prefix = SCHED_BAD[name]
    kw = dict(seqlens=[5, 7], num_heads=16, page_size=16)
    kw.update(upd)
    with pytest.raises(exc, match=f"^{prefix}"):
        ops.get_splitkv_schedule(kw.pop("seqlens"), **kw)


def _op_args(heads=4, sq=1, lens=(9, 40), page=8, r=32, d_rope=16, dtype=torch.float32, fp8=False, num_sms=4,
             config=None):
    c = dict(lens=lens, sq=sq, heads=heads, r=r, d_rope=d_rope, page=page, fp8=fp8)
    q, kv, table, seqlens, dense, extra = build_flashmla(c, dtype=dtype)
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, num_q_tokens=sq, page_size=page, num_sms=num_sms,
                                     min_split_tokens=8, config=config)
    kw = dict(head_dim_v=r, schedule=sched, softmax_scale=0.2, **extra)
    return c, [q, kv, table, seqlens], kw, dense


OP_BAD = {
    "schedule_type": (lambda a, k: k.update(schedule=ops.FlashMLASchedule(Impl.REFERENCE)), TypeError, "schedule"),
    "q_rank3": (lambda a, k: a.__setitem__(0, a[0][:, 0]), ValueError, "q"),
    "kv_dtype": (lambda a, k: a.__setitem__(1, a[1].double()), ValueError, "kv_cache dtype"),
    "kv_heads": (lambda a, k: a.__setitem__(1, a[1].expand(-1, -1, 2, -1)), ValueError, "kv_cache"),
    "table_int64": (lambda a, k: a.__setitem__(2, a[2].long()), ValueError, "page_table"),
    "seqlens_rows": (lambda a, k: a.__setitem__(3, a[3][:1]), ValueError, "page_table"),
    "head_dim_v_big": (lambda a, k: k.update(head_dim_v=1000), ValueError, "head_dim_v"),
    "scale_none": (lambda a, k: k.update(softmax_scale=None), TypeError, "softmax_scale"),
    "descale_on_bf16": (lambda a, k: k.update(descale_k=torch.ones(1)), ValueError, "descale_k"),
    "causal_int": (lambda a, k: k.update(causal=1), TypeError, "causal"),
    # an e4m3 cache with a float q: descale_k required, descale_q refused, only e4m3 (not e5m2)
    "fp8kv_no_descale_k": (lambda a, k: a.__setitem__(1, a[1].to(torch.float8_e4m3fn)), ValueError, "descale_k is required"),
    "fp8kv_descale_q": (lambda a, k: (a.__setitem__(1, a[1].to(torch.float8_e4m3fn)),
                                      k.update(descale_k=torch.ones(1), descale_q=torch.ones(1))), ValueError, "descale_q"),
    "fp8kv_e5m2": (lambda a, k: (a.__setitem__(1, a[1].to(torch.float8_e5m2)), k.update(descale_k=torch.ones(1))),
                   ValueError, "kv_cache dtype"),
    # the rope part apart: shapes, dtype, and q then holding exactly head_dim_v columns
    "q_rope_with_whole_q": (lambda a, k: k.update(q_rope=a[0][..., 32:]), ValueError, "q must hold head_dim_v"),
    "q_rope_rows": (lambda a, k: (k.update(q_rope=a[0][:1, ..., 32:]), a.__setitem__(0, a[0][..., :32])),
                    ValueError, "q_rope must be"),
    "q_rope_dtype": (lambda a, k: (k.update(q_rope=a[0][..., 32:].double()), a.__setitem__(0, a[0][..., :32])),
                     ValueError, "q_rope dtype"),
    "q_rope_width": (lambda a, k: (k.update(q_rope=a[0][..., 40:]), a.__setitem__(0, a[0][..., :32])),
                     ValueError, "kv_cache head dim"),
}


@pytest.mark.parametrize("name", list(OP_BAD))
def test_op_bad_arguments_are_named(name):
    mutate, exc, prefix = OP_BAD[name]
    _, args, kw, _ = _op_args()
    mutate(args, kw)
    with pytest.raises(exc, match=f"^{prefix}"):
        ops.splitkv_mla_with_kvcache(*args, **kw)


def test_triton_only_checks_run_before_any_kernel():
    _, args, kw, _ = _op_args()
    q, kv, table, lens = args
    run = lambda **upd: validate.check_splitkv(q, kv, table, lens, **dict(kw, **upd), causal=True,  # noqa: E731
                                               descale_q=None, descale_k=None, impl=Impl.TRITON)
    run()
    with pytest.raises(ValueError, match="^schedule holds at most max_batch=1"):
        run(schedule=ops.get_splitkv_schedule([9], num_heads=4, page_size=8))
    with pytest.raises(ValueError, match="^schedule must be on q's device"):
        run(schedule=kw["schedule"].to("meta"))
    with pytest.raises(ValueError, match="^head_dim_v must be <"):
        run(head_dim_v=q.shape[-1])


def test_impl_choice_on_cpu():
    _, args, kw, _ = _op_args()
    out, lse = ops.splitkv_mla_with_kvcache(*args, **kw)
    assert ops.last_impl() is Impl.REFERENCE and lse.dtype == torch.float32
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(KernelUnavailableError, match="split-KV Triton kernel unavailable"):
            ops.splitkv_mla_with_kvcache(*args, **kw, impl="triton")
    with pytest.raises(ValueError, match="^impl='triton' runs only the ops of our Triton kernels"):
        ops.flash_mla_with_kvcache(*args, **dict(kw, schedule=ops.FlashMLASchedule(Impl.REFERENCE)), causal=True,
                                   impl="triton")


def test_import_does_not_need_triton():
    code = ("import sys; sys.modules['triton'] = None; import mla_fa3.ops.triton_ops as o; "
            "assert isinstance(o._splitkv_kernels(), str) and isinstance(o._triton_module('replan'), str); "
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# ------------------------------------------------------------------------------------------ op vs oracle

# (lens, sq, heads, page, fp8): lengths 0, 1, page ± 1, L < sq (a query row that sees no key); fp8 True: e4m3 q
# and cache (FlashMLA's contract), "kv": an e4m3 cache read with q in its own dtype (dequantized in registers)
OP_CASES = {
    "decode_page8": ((9, 40, 0, 1), 1, 4, 8, False),
    "verify_sq2_page1": ((1, 17, 33), 2, 4, 1, False),
    "verify_sq4_heads20": ((15, 16, 17, 3), 4, 20, 16, False),
    "fp8_page16": ((33, 5), 1, 4, 16, True),
    "fp8kv_page1_verify_sq2": ((1, 17, 33), 2, 4, 1, "kv"),
    "fp8kv_page64_pm1": ((63, 65, 0), 1, 4, 64, "kv"),
}


def _check_vs_oracle(c, dense, out, lse, scale=0.2, dtype=torch.float32):
    scale = c.get("scale", scale)
    ref_out, ref_lse = flashmla_oracle(c, dense, scale)
    atol, rtol, lse_atol = tolerances(dtype, c.get("fp8", False) is True)  # an e4m3 cache alone: exact in fp32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys: lse -inf"
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_reference_matches_fp64_oracle(name):
    lens, sq, heads, page, fp8 = OP_CASES[name]
    c, args, kw, dense = _op_args(heads=heads, sq=sq, lens=lens, page=page, fp8=fp8)
    out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, impl="reference")
    _check_vs_oracle(c, dense, out, lse)


# ------------------------------------------------------------------------------------------ Triton interpreter

# No case runs a bf16 dot: the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584, not
# supported there). A bf16 q over an e4m3 cache enters the dots in fp16; bf16 caches run on the GPU tests.
INTERPRETER_CASES = {  # name -> (lens, sq, heads, page, dtype, fp8, padded graph-style schedule[, num_sms])
    "fp32_page8_empty_and_one": ((9, 40, 0, 1), 1, 4, 8, "float32", False, False),
    "fp16_page1_verify_sq2": ((1, 17, 33), 2, 4, 1, "float16", False, False),
    "fp16_two_head_tiles_sq4": ((15, 16, 17, 3), 4, 20, 16, "float16", False, False),
    "fp32_page64_pm1_padded": ((63, 65, 129), 1, 4, 64, "float32", False, True),
    "fp8_page16": ((33, 5), 1, 4, 16, "float32", True, False),
    "fp32_40_splits_one_request": ((2500, 70), 1, 4, 16, "float32", False, False, 64),  # > COMBINE_WIDE's 16
    "fp32_143_splits_narrow_combine": ((9000, 70), 1, 4, 16, "float32", False, False, 256),  # > COMBINE_NARROW's 128
    "fp32_80_rows_79_splits_mid_combine": ((5000, 300, 70, 9), 1, 20, 16, "float32", False, False, 256),  # > 64 a load
    "fp32_40_splits_combine_tile_4x16": ((2500, 70), 1, 4, 16, "float32", False, False, 64),  # the config's tile
    # the one-page-per-block fast path (page >= block_n), blocks spanning a request's end, and the switches
    "fp32_page64_block64_spans_end": ((63, 64, 65, 200), 1, 4, 64, "float32", False, False),
    "fp16_page32_verify_sq3_half_reload": ((31, 32, 97), 3, 4, 32, "float16", False, True),
    "fp8_page64_block16_reload": ((70, 129), 1, 4, 64, "float32", True, False),
    "fp32_page16_block64_gather": ((100, 30), 2, 4, 16, "float32", False, False),
    # an e4m3 cache read with q in its own dtype: fp32 (vs the fp64 oracle at fp32 tolerance), fp16, page 1 / 64
    "fp8kv_fp32_page16_verify_sq2": ((33, 5, 1), 2, 4, 16, "float32", "kv", False),
    "fp8kv_fp16_page64_padded_reload": ((70, 129), 1, 4, 64, "float16", "kv", True),
    "fp8kv_fp32_page1_many_splits": ((700, 3), 1, 20, 1, "float32", "kv", False, 64),
    # the production read: a bf16 q over an e4m3 cache (fp16 dots after a power-of-two rescale of q), q of any size
    "fp8kv_bf16_page16": ((33, 5, 64), 1, 4, 16, "bfloat16", "kv", False),
    "fp8kv_bf16_q_times_1e5": ((33, 5, 64), 1, 4, 16, "bfloat16", "kv", False),
    "fp8kv_bf16_q_times_1e-6": ((33, 5, 64), 2, 4, 16, "bfloat16", "kv", False),
    # q·kᵀ over latent chunks (KernelConfig.latent_chunks; a wider latent so that each chunk holds >= 32 columns)
    "fp32_r128_chunks4_verify_sq2": ((40, 97, 1), 2, 4, 16, "float32", False, False),
    "fp16_r64_chunks2_padded": ((63, 65, 129), 1, 4, 64, "float16", False, True),
    "fp8_r128_chunks4": ((33, 70), 1, 4, 16, "float32", True, False),
    "fp8kv_bf16_r128_chunks2_reload": ((33, 70, 5), 1, 4, 16, "bfloat16", "kv", False),
    # the even cut (KernelConfig.even_splits): splits on 32-key blocks, so half of them start mid-page (page 64), re-
    # planned on the device; a page below the block (16: a page id per key); an e4m3 cache read with a bf16 q
    "fp32_page64_even_block32_padded": ((2500, 70, 129), 1, 4, 64, "float32", False, True, 16),
    "fp16_page16_even_verify_sq2": ((700, 33, 1), 2, 4, 16, "float16", False, False, 16),
    "fp8kv_bf16_page64_even": ((2500, 70), 1, 4, 64, "bfloat16", "kv", False, 16),
}
LATENT_WIDTH = {"fp32_r128_chunks4_verify_sq2": 128, "fp16_r64_chunks2_padded": 64, "fp8_r128_chunks4": 128,
                "fp8kv_bf16_r128_chunks2_reload": 128}  # r of the case (default 32)
Q_SCALE = {"fp8kv_bf16_q_times_1e5": 1e5, "fp8kv_bf16_q_times_1e-6": 1e-6}  # q multiplied by this (oracle too)
INTERPRETER_CONFIGS = {  # name -> KernelConfig fields (others: the table's choice)
    "fp32_page64_block64_spans_end": dict(block_n=64),
    "fp16_page32_verify_sq3_half_reload": dict(block_n=32, half_partials=True, reload_kv=True),
    "fp8_page64_block16_reload": dict(block_n=16, reload_kv=True),
    "fp8kv_fp16_page64_padded_reload": dict(block_n=16, reload_kv=True, half_partials=True),
    "fp32_page16_block64_gather": dict(block_n=64, num_stages=3),
    "fp32_r128_chunks4_verify_sq2": dict(latent_chunks=4),
    "fp16_r64_chunks2_padded": dict(latent_chunks=2, half_partials=True),
    "fp8_r128_chunks4": dict(latent_chunks=4, block_n=16),
    "fp8kv_bf16_r128_chunks2_reload": dict(latent_chunks=2, reload_kv=True),
    "fp32_40_splits_combine_tile_4x16": dict(combine_tile=(4, 16)),
    "fp32_page64_even_block32_padded": dict(block_n=32, even_splits=True),
    "fp16_page16_even_verify_sq2": dict(block_n=32, even_splits=True),
    "fp8kv_bf16_page64_even": dict(block_n=32, even_splits=True),
}


def _apart(q: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_lat contiguous, q_rope as a strided slice of a wider tensor, like the model's q) from a whole q."""
    d_rope = q.shape[-1] - r
    wide = torch.full((*q.shape[:3], d_rope + 7), float("nan"), dtype=q.dtype)
    wide[..., 3: 3 + d_rope] = q[..., r:]
    return q[..., :r].contiguous(), wide[..., 3: 3 + d_rope]



def test_sweep_prints_a_config_table_that_pastes_back_to_the_same_configs():
    """``bench.splitkv.config_table`` writes the ``CONFIG_TABLE`` literal to paste into splitkv_config.py: every field
    of each winner, so a field added later (as ``max_registers`` was) cannot be dropped on the way."""
    from types import SimpleNamespace

    from mla_fa3.bench.splitkv import config_table

    winners = {"a": KernelConfig(block_n=16, num_warps=8, num_stages=4, waves=3.0, half_partials=True, pdl=False),
               "b": KernelConfig(block_n=64, max_rows=128, reload_kv=True, max_registers=168)}
    best = {(16, 1, 65536): SimpleNamespace(variant="a", splitkv_us=30.5),
            (128, 4, 32768): SimpleNamespace(variant="b", splitkv_us=91.0)}
    ns = {"KernelConfig": KernelConfig}
    exec(config_table(best, winners), ns)
    assert ns["CONFIG_TABLE"] == {(16, 1, 65536): winners["a"], (128, 4, 32768): winners["b"]}
    exec(config_table(best, winners, fp8=True), ns)  # the e4m3 sweep prints the e4m3 table
    assert ns["E4M3_CONFIG_TABLE"] == ns["CONFIG_TABLE"]

def test_op_with_the_rope_part_apart_matches_the_oracle():
    c, args, kw, dense = _op_args(heads=4, sq=2, lens=(1, 17, 33), page=1)
    q_lat, q_rope = _apart(args[0], c["r"])
    assert q_rope.stride(-1) == 1 and not q_rope.is_contiguous()
    out, lse = ops.splitkv_mla_with_kvcache(q_lat, *args[1:], **kw, q_rope=q_rope, impl="reference")
    _check_vs_oracle(c, dense, out, lse)


def combine_case() -> None:
    """The combine alone (``splitkv_combine_triton.combine_splits``, fp32) against the fp64 formula. Request 0: 150
    splits, so two 128-split loads of the narrow tile (three with 64 splits per load), whose maximum LSE sits in the
    last load while the earlier ones still weigh 2^-3 of it (the running maximum must rescale what it summed), empty
    splits (-inf) among them, all LSEs near 2^200 (past fp32's range unless the maximum is subtracted); request 1: no
    split; request 2: only empty splits. The same with the tiles ``bench.splitkv_phases --combine-tiles`` compares: 64
    splits per load, all 150 in one load (8 warps), 16 x 16, one split per load over 64 columns (24 of them masked); a
    tile that is not two powers of two is refused."""
    from mla_fa3.ops.splitkv_combine_triton import combine_splits

    g = torch.Generator().manual_seed(11)
    sq, H, dv, counts = 2, 3, 40, (150, 0, 5)  # 3 * 2 * 3 = 18 output rows < 64: the narrow tile; 40 columns, masked
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=I32)
    slots = int(offsets[-1])
    part_o = torch.randn(slots, sq, H, dv, generator=g)
    lse2 = 200.0 + torch.randn(slots, sq, H, generator=g) + 3.0 * (torch.arange(slots) >= 128).view(-1, 1, 1)
    lse2[::7] = float("-inf")
    lse2[150:] = float("-inf")
    for tile in (None, (64, 32), (256, 32), (16, 16), (1, 64)):
        out = torch.full((len(counts), sq, H, dv), float("nan"))
        lse = torch.full((len(counts), sq, H), float("nan"))
        combine_splits(part_o, lse2, offsets, out, lse, tile=tile)
        for b in range(len(counts)):
            l, o = lse2[offsets[b]: offsets[b + 1]].double() * math.log(2.0), part_o[offsets[b]: offsets[b + 1]].double()
            if not torch.isfinite(l).any():
                assert (out[b] == 0).all() and torch.isneginf(lse[b]).all(), f"tile {tile}, request {b}: no live split"
                continue
            want = (torch.softmax(l, dim=0)[..., None] * o).sum(0)
            torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5, msg=f"tile {tile}, request {b}")
            torch.testing.assert_close(lse[b].double(), torch.logsumexp(l, dim=0), atol=1e-4, rtol=1e-6)
    with pytest.raises(ValueError, match="two powers of two"):
        combine_splits(part_o, lse2, offsets, out, lse, tile=(48, 32))


def phases_case() -> None:
    """Phase 1 alone (``splitkv_partials``) and then the combine, launched apart as ``bench.splitkv_phases`` times
    them, give the op's output bit for bit; the partials of a split hold its keys' attention (the fp64 oracle over
    the split's range) and the slots past ``num_work`` are never read (a NaN poured there changes nothing)."""
    from mla_fa3.ops import splitkv_triton as kt
    from mla_fa3.ops.splitkv_combine_triton import combine_splits

    c, args, kw, dense = _op_args(heads=4, lens=(150, 40), page=16, dtype=torch.float32)
    sched = kw["schedule"]
    call = validate.check_splitkv(*args, head_dim_v=kw["head_dim_v"], schedule=sched, softmax_scale=0.2, causal=True,
                                  descale_q=None, descale_k=None, impl=Impl.TRITON)
    out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, impl="triton")
    part_o, part_lse2 = kt.splitkv_partials(call, sched)
    n = sched.planned_work
    assert n >= 3 and part_o.shape == (sched.capacity, 1, 4, 32) and part_lse2.shape == (sched.capacity, 1, 4)
    for b, s0, s1, slot in sched.work[:n].tolist():  # each split: softmax over its own keys
        q_b, kv_b = dense[b][0], dense[b][1][:, 0]  # [sq, H, D], [L, D]
        scores = 0.2 * torch.einsum("ihd,jd->ihj", q_b, kv_b[s0:s1])
        want = torch.einsum("ihj,jd->ihd", torch.softmax(scores, -1), kv_b[s0:s1, :32])
        torch.testing.assert_close(part_o[slot].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(part_lse2[slot].double(), torch.logsumexp(scores, -1) / math.log(2.0),
                                   atol=1e-5, rtol=1e-6)
    part_o[n:], part_lse2[n:] = float("nan"), float("nan")
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    combine_splits(part_o, part_lse2, sched.split_offsets, out2, lse2)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    with pytest.raises(ValueError, match="splitkv_partials needs"):
        kt.splitkv_partials(dataclasses.replace(call, q=call.q[:0]), sched)


def combine_tile_case() -> None:
    """A config's ``combine_tile`` is the tile the op's combine runs with (the rule's when None): a spy on the
    combine the launch calls records it; the output is the oracle's either way."""
    from mla_fa3.ops import splitkv_triton as kt

    seen = []
    real = kt.combine_splits

    def spy(*args, **kw):
        seen.append(kw.get("tile"))
        return real(*args, **kw)

    kt.combine_splits = spy
    try:
        for tile in ((2, 16), None):
            c, args, kw, dense = _op_args(heads=4, lens=(300, 40), page=16, config=KernelConfig(combine_tile=tile))
            out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, impl="triton")
            _check_vs_oracle(c, dense, out, lse)
    finally:
        kt.combine_splits = real
    assert seen == [(2, 16), None], seen


def plan_past_the_lengths_case() -> None:
    """A schedule planned from longer lengths than the kernel reads (a stale host plan): splits start past each
    request's length and past the page table's width, whose unused entries hold BAD_PAGE. Only keys < L_b are loaded
    and only their page ids read: the output is the oracle's, on the one-page-per-block path and the gather path."""
    for page in (16, 4):
        cfg = KernelConfig(block_n=16)
        c, args, kw, dense = _op_args(heads=4, lens=(9, 40, 20), page=page, config=cfg)
        kw["schedule"] = ops.get_splitkv_schedule([300, 300, 300], num_heads=4, num_q_tokens=1, page_size=page,
                                                  num_sms=4, min_split_tokens=8, config=cfg)
        width = args[2].shape[1] * page
        assert any(s0 >= width for _, s0, _, _ in kw["schedule"].work[: kw["schedule"].planned_work].tolist())
        out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, impl="triton")
        _check_vs_oracle(c, dense, out, lse)


def _interpreter_run() -> dict:
    """Run every INTERPRETER_CASE through ops.splitkv_mla_with_kvcache(impl='triton'); returns failures (or {})."""
    failures = {}
    for name, (lens, sq, heads, page, dtype, fp8, padded, *sms) in INTERPRETER_CASES.items():
        dt = getattr(torch, dtype)
        cfg = KernelConfig(**INTERPRETER_CONFIGS[name]) if name in INTERPRETER_CONFIGS else None
        c, args, kw, dense = _op_args(heads=heads, sq=sq, lens=lens, page=page, dtype=dt, fp8=fp8,
                                      num_sms=(sms or [4])[0], config=cfg, r=LATENT_WIDTH.get(name, 32))
        if name in Q_SCALE:  # a q far outside fp16's range (or deep in its subnormals): the rescale keeps it exact
            args[0] = (args[0].double() * Q_SCALE[name]).to(dt)
            dense = [(args[0][b].double(), kv_b) for b, (_, kv_b) in enumerate(dense)]
            kw["softmax_scale"] = 0.2 / Q_SCALE[name]
        if padded:  # graph style: capacity for more requests, tail rows idle, an extra unplanned request, the
            # schedule re-planned on the device (the Triton planner) from the lengths the kernel reads
            big = ops.get_splitkv_schedule([1], num_heads=heads, num_q_tokens=sq, page_size=page, num_sms=4,
                                           max_batch=len(lens) + 1, config=kw["schedule"].config, min_split_tokens=8)
            kw["schedule"] = ops.replan_splitkv_schedule(args[3], big, impl="triton")
        try:
            out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, impl="triton")
            assert ops.last_impl() is Impl.TRITON
            assert out.dtype == (torch.bfloat16 if fp8 is True else dt)
            _check_vs_oracle(dict(c, scale=kw["softmax_scale"]), dense, out, lse, dtype=dt)
            ref, _ = ops.splitkv_mla_with_kvcache(*args, **kw, impl="reference")
            atol, rtol, _ = tolerances(torch.float16 if dt is torch.float16 else dt, fp8 is True)  # fp16: ~2**-11
            torch.testing.assert_close(out.float(), ref.float(), atol=atol / 4 if dt is torch.float16 else atol, rtol=rtol)
            if fp8 is not True:  # the rope part given apart (a strided slice of a wider tensor): the same result
                q_lat, q_rope = _apart(args[0], c["r"])
                out2, lse2 = ops.splitkv_mla_with_kvcache(q_lat, *args[1:], **kw, q_rope=q_rope, impl="triton")
                assert torch.equal(out2, out) and torch.equal(lse2, lse)
        except Exception as exc:  # report every case, not only the first
            failures[name] = f"{type(exc).__name__}: {exc}"
    failures.update(run_cases((("combine_running_maximum", combine_case), ("phases_apart", phases_case),
                               ("combine_tile_of_the_config", combine_tile_case),
                               ("plan_past_the_lengths", plan_past_the_lengths_case))))

    def replan_agrees(case):
        why = replan_mismatch(*(case if len(case) > 4 else case + ("triton",)))
        assert ops.last_impl() is Impl.TRITON and why is None, why

    failures.update(run_cases((f"replan_{i}", lambda c=case: replan_agrees(c))  # the Triton planner vs the host plan
                              for i, case in enumerate(_replan_cases(n_random=40))))
    failures.update(run_cases((f"replan_even_{i}", lambda c=case: replan_agrees(c + ("triton", True)))
                              for i, case in enumerate(_replan_cases(n_random=20))))
    failures.update(run_cases((f"replan_nofit_{i}", lambda c=case: replan_agrees(c + ("triton", False, False)))
                              for i, case in enumerate(REPLAN_CASES)))
    return failures


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__) == {}


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)


def test_a_config_whose_blocks_straddle_the_schedules_splits_is_refused():
    """An even-cut schedule starts splits on 32-key blocks; launched with 64-key blocks, a block would cross a split's
    start (and a 64-key page): a named error before the launch, which writes nothing."""
    pytest.importorskip("triton")
    from mla_fa3.ops import splitkv_triton as kt

    c, args, kw, _ = _op_args(heads=16, lens=(3000, 70), page=64, dtype=torch.float32)
    config = choose_config(16, 2, 3000).with_(even_splits=True)
    sched = ops.get_splitkv_schedule([3000, 70], num_heads=16, page_size=64, num_sms=8, config=config)
    assert sched.granule == 32 and any(s % 64 for _, s, _, _ in sched.work[: sched.planned_work].tolist())
    call = validate.check_splitkv(*args, head_dim_v=kw["head_dim_v"], schedule=sched, softmax_scale=0.2, causal=True,
                                  descale_q=None, descale_k=None, impl=Impl.TRITON)
    with pytest.raises(ValueError, match="^the schedule's splits start on multiples of 32 keys, not of the config's "
                                         "block_n 64"):
        kt.splitkv_partials(call, sched, config.with_(block_n=64))


def test_the_combine_discards_only_whole_lines_of_its_own():
    """``KernelConfig.discard_partials``: a partial row's column block may be dropped from the L2 only where it is whole
    128-byte lines no other program reads (``whole_lines``), and only on CUDA (``discards_partials``)."""
    from mla_fa3.ops.splitkv_combine_triton import discards_partials, whole_lines

    base = torch.empty(4 * 1024 * 1024 + 128, dtype=torch.uint8)
    shift = (-base.data_ptr()) % 128

    def part(shape, dtype, offset=0):  # a workspace view whose first byte lies `offset` bytes past a 128-byte line
        return base[shift + offset:].view(dtype)[: math.prod(shape)].view(shape)

    assert whole_lines(part((8, 1, 16, 512), torch.bfloat16), 64)  # 64 bf16 = 128 bytes
    assert whole_lines(part((8, 1, 16, 512), torch.float32), 64)  # 256 bytes: two lines
    assert not whole_lines(part((8, 1, 16, 512), torch.bfloat16), 32)  # 64 bytes: half a line, shared with a neighbour
    assert not whole_lines(part((8, 1, 16, 512), torch.bfloat16, offset=64), 64)  # the workspace off a line
    assert not whole_lines(part((8, 1, 16, 40), torch.float32), 32)  # r = 40: the last block is cut short
    assert not whole_lines(part((8, 1, 16, 520), torch.bfloat16), 64)  # rows 1040 bytes apart: off the lines
    assert whole_lines(part((8, 1, 16, 1024), torch.bfloat16)[..., :512], 64)  # a wider row, still on its lines
    assert not discards_partials(part((8, 1, 16, 512), torch.bfloat16), 64), "CPU tensors: never"
    config = KernelConfig(discard_partials=True)
    assert config.label().endswith("-d") and "-d" not in KernelConfig().label()
