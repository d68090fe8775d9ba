"""Path choice (path_choice): the cost model replayed on recorded H200 times, overrides, splits, errors, re-fit.

Recorded data (the oracle of the choice tests): ``docs/perf/2026-12-03/run4/prefill_run5.csv`` and the
independent ``prefill_run6.csv`` — H200, DeepSeek-V3 dims, bf16, page 64, workspace budget 512 MiB (per-row
``workspace`` tokens: 47,127 at 16 heads, 6,462 at 128), one request per shape, heads {16, 128} x new
{1k, 4k, 8k} x prefix {16k, 64k, 128k}; eager CUDA-event ms of one layer on the absorbed path and on the
MHA path (one pass or chunk loop); and ``prefill_small_run{1,2}.csv``: new {128, 512} x prefix {0, 8k, 32k},
where the paths cross (run 2 rebuilt from the bench's printed table: its CSV did not come back from the
device). The tests read the CSVs themselves and compare the measured time of the path ``choose_path``
picks with the measured faster one.

Thresholds: auto within 5 % of the faster path on every shape of both sweep runs (reached: 18/18 picked
right in each); on the small shapes, at least 10 of 12 per run (their times are ~0.2 ms and two runs
disagree by up to 20 %); shapes where one path is >= 1.2x faster are always picked right. This is a
regression guard on recorded data, not a timing test: no GPU is used.
"""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mla_fa3.layer import MLADims
from mla_fa3.policy.prefill_fit import (FITTED_CONSTANTS, CostSample, evaluate_choices, evaluate_on_csv, fit_cost_constants, read_samples_csv, summarize)
from mla_fa3.policy.prefill_cost import H200_COSTS, choose_path, decode_rows, estimate_costs_ms
from mla_fa3.policy.paths import AttentionPath

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
W = 8192
PERF = Path(__file__).resolve().parents[1] / "docs" / "perf" / "2026-12-03" / "run4"
RECORDED_CSV = PERF / "prefill_run5.csv"  # the sweep the choice tests replay
REPEAT_CSV = PERF / "prefill_run6.csv"  # an independent run of the same sweep, back to back
SMALL_CSVS = (PERF / "prefill_small_run1.csv", PERF / "prefill_small_run2.csv")  # where the paths cross
FIT_CSVS = (PERF / "prefill_run3.csv", PERF / "prefill_run4.csv", RECORDED_CSV, REPEAT_CSV) + SMALL_CSVS
WITHIN_BEST = 1.05  # auto's measured time / the faster path's, on every recorded shape
CLEAR_WIN = 1.2  # a path this much faster than the other must be picked


def _recorded(path=RECORDED_CSV) -> dict[str, dict]:
    """The CSV's rows by name ``h{heads}_n{new}_p{prefix}``, read here (not through the cost model)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for r in rows:
        H, n, p = int(r["heads"]), int(r["new"]), int(r["prefix"])
        mha = AttentionPath.MHA_CHUNKED if p else AttentionPath.MHA_ONESHOT
        out[f"h{H}_n{n}_p{p}"] = dict(heads=H, new=n, prefix=p, workspace=int(r["workspace"]),
                                      ms={AttentionPath.ABSORBED: float(r["absorbed_ms"]), mha: float(r["mha_ms"])})
    return out


RECORDED = _recorded()
REPEATED = _recorded(REPEAT_CSV)


def _pick(row, constants=H200_COSTS):
    return choose_path([row["prefix"]], [row["new"]], num_heads=row["heads"], dims=V3,
                       workspace_tokens=row["workspace"], constants=constants)


def test_the_recorded_sweep_is_complete():
    for rec in (RECORDED, REPEATED):
        assert len(rec) == 18
        assert {r["heads"] for r in rec.values()} == {16, 128}
        assert {r["prefix"] for r in rec.values()} == {16384, 65536, 131072}


@pytest.mark.parametrize("run,name", [(1, n) for n in RECORDED] + [(2, n) for n in REPEATED])
def test_auto_is_within_5pct_of_the_faster_recorded_path(run, name):
    row = (RECORDED if run == 1 else REPEATED)[name]
    d = _pick(row)
    best = min(row["ms"].values())
    assert d.path in row["ms"], f"{name}: picked {d.path.value}, which does not apply"
    assert row["ms"][d.path] / best <= WITHIN_BEST, f"{name}: {d.explain()}; measured {row['ms']}"
    assert d.requested == "auto" and d.path.value in d.reason
    assert d.num_chunks == (-(-row["prefix"] // row["workspace"]) if d.path is AttentionPath.MHA_CHUNKED else 0)


def test_clear_wins_are_always_picked():
    clear = {k: r for k, r in RECORDED.items() if max(r["ms"].values()) / min(r["ms"].values()) >= CLEAR_WIN}
    assert len(clear) >= 15  # most of the sweep: the guard is not vacuous
    for name, row in clear.items():
        faster = min(row["ms"], key=row["ms"].get)
        assert _pick(row).path is faster, f"{name}: measured {row['ms']}"


def test_evaluate_on_csv_replays_each_recorded_row():
    evals = evaluate_on_csv(RECORDED_CSV, V3)
    assert len(evals) == len(RECORDED)
    right = 0
    for e in evals:
        s = e.sample
        row = RECORDED[f"h{s.num_heads}_n{s.extend_lens[0]}_p{s.prefix_lens[0]}"]
        assert dict(e.measured_ms) == row["ms"]
        assert e.best is min(row["ms"], key=row["ms"].get)
        assert e.chosen is _pick(row).path
        assert e.chosen_over_best == pytest.approx(row["ms"][e.chosen] / min(row["ms"].values()), rel=1e-12)
        right += e.chosen is e.best
    assert summarize(evals).startswith(f"auto picked the faster path on {right}/{len(RECORDED)} shapes")


def test_model_tracks_the_kernel_bound_recorded_shapes():
    """>= 5 ms the kernels dominate: modelled within 10 % of the median of the four sweep runs (below, host
    launch noise dominates — no per-shape claim there; one run alone has outliers, e.g. absorbed at 16 heads,
    1024 over 128k: 6.48 ms in run 5, 7.13-7.27 ms in runs 3, 4 and 6)."""
    runs = [_recorded(p) for p in FIT_CSVS[:4]]
    checked = 0
    for name, row in RECORDED.items():
        model = estimate_costs_ms([row["prefix"]], [row["new"]], num_heads=row["heads"], dims=V3,
                                  workspace_tokens=row["workspace"])
        for path in row["ms"]:
            ms = sorted(r[name]["ms"][path] for r in runs)[1:3]
            ms = sum(ms) / 2
            if ms >= 5.0:
                assert model[path] == pytest.approx(ms, rel=0.10), f"{name} {path.value}"
                checked += 1
        assert model[AttentionPath.MHA_ONESHOT if row["prefix"] else AttentionPath.MHA_CHUNKED] == math.inf
    assert checked >= 25


@pytest.mark.parametrize("path", SMALL_CSVS, ids=["small_run1", "small_run2"])
def test_auto_on_the_small_recorded_shapes(path):
    """Where the paths cross (0.15-7 ms): at least 10 of 12 within 5 % of the faster; a miss only on a step of
    < 0.3 ms, and every shape with a >= 1.2x clear winner except the noisiest (128 heads, 128 new, no prefix)."""
    evals = evaluate_on_csv(path, V3)
    assert len(evals) == 12
    misses = [e for e in evals if e.chosen_over_best > WITHIN_BEST]
    assert len(misses) <= 2, summarize(evals)
    assert all(min(e.measured_ms.values()) < 0.3 for e in misses), summarize(evals)


def test_h200_costs_are_the_fit_of_the_recorded_csv():
    """H200_COSTS is fit_cost_constants on the recorded runs (FIT_CSVS): re-fitting lands on its constants,
    and every recorded choice of both sweep runs stays right with the re-fitted constants."""
    fitted = fit_cost_constants([s for p in FIT_CSVS for s in read_samples_csv(p)], V3)
    for name in FITTED_CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(H200_COSTS, name), rel=0.01), name
    for rec in (RECORDED, REPEATED):
        for name, row in rec.items():
            assert row["ms"][_pick(row, fitted).path] / min(row["ms"].values()) <= WITHIN_BEST, name


@pytest.mark.parametrize("train", ["heads_16", "prefix_16k_128k"])
def test_fit_on_half_the_sweep_picks_right_on_the_other_half(train):
    """Generalisation: constants fitted on half the recorded shapes stay within 5 % on the held-out half."""
    keep = {"heads_16": lambda r: r["heads"] == 16, "prefix_16k_128k": lambda r: r["prefix"] in (16384, 131072)}[train]
    def sample(r):
        mha = next(ms for path, ms in r["ms"].items() if path.is_mha_prefill)
        return CostSample(r["heads"], (r["prefix"],), (r["new"],), r["workspace"], r["ms"][AttentionPath.ABSORBED], mha)
    fitted = fit_cost_constants([sample(r) for r in RECORDED.values() if keep(r)], V3)
    for name, row in RECORDED.items():
        if not keep(row):
            assert row["ms"][_pick(row, fitted).path] / min(row["ms"].values()) <= WITHIN_BEST, name


def test_override_is_respected():
    d = choose_path([32768], [4096], num_heads=128, dims=V3, workspace_tokens=W, prefill_path="absorbed")
    assert d.path is AttentionPath.ABSORBED and "override" in d.reason
    d = choose_path([65536], [512], num_heads=16, dims=V3, workspace_tokens=W, prefill_path="mha")
    assert d.path is AttentionPath.MHA_CHUNKED and "override" in d.reason and d.num_chunks == 8
    d = choose_path([0, 0], [64, 3], num_heads=16, dims=V3, workspace_tokens=W, prefill_path="mha")
    assert d.path is AttentionPath.MHA_ONESHOT and d.num_chunks == 0
    with pytest.raises(ValueError, match="prefill_path must be one of"):
        choose_path([0], [4], num_heads=16, dims=V3, workspace_tokens=W, prefill_path="fast")


def test_no_prefix_long_prompt_is_oneshot_mha():
    d = choose_path(torch.tensor([0, 0], dtype=torch.int32), torch.tensor([4096, 2048], dtype=torch.int32),
                    num_heads=128, dims=V3, workspace_tokens=W)
    assert d.path is AttentionPath.MHA_ONESHOT
    assert d.costs_ms[AttentionPath.MHA_CHUNKED] == math.inf


def test_mixed_step_decode_rows_stay_absorbed():
    prefix, extend = [32768, 900, 0, 5000], [4096, 1, 7, 1]
    assert decode_rows(prefix, extend) == [False, True, False, True]
    d = choose_path(prefix, extend, num_heads=128, dims=V3, workspace_tokens=W)
    assert d.path is AttentionPath.MHA_CHUNKED and d.num_decode_rows == 2 and d.split
    # the decode rows' absorbed cost is charged to the MHA option too
    alone = estimate_costs_ms([32768, 0], [4096, 7], num_heads=128, dims=V3, workspace_tokens=W)
    assert d.costs_ms[AttentionPath.MHA_CHUNKED] > alone[AttentionPath.MHA_CHUNKED]
    only_decode = choose_path([10, 20], [1, 1], num_heads=16, dims=V3, workspace_tokens=W, prefill_path="mha")
    assert only_decode.path is AttentionPath.ABSORBED and not only_decode.split
    verify = choose_path([100, 200], [4, 4], num_heads=16, dims=V3, workspace_tokens=W, decode_like=True)
    assert verify.path is AttentionPath.ABSORBED and "decode-like" in verify.reason


def test_smaller_workspace_costs_more_chunks():
    a = estimate_costs_ms([65536], [512], num_heads=16, dims=V3, workspace_tokens=65536)
    b = estimate_costs_ms([65536], [512], num_heads=16, dims=V3, workspace_tokens=1024)
    assert b[AttentionPath.MHA_CHUNKED] > a[AttentionPath.MHA_CHUNKED]
    assert b[AttentionPath.ABSORBED] == a[AttentionPath.ABSORBED]


def test_host_overlap_bounds():
    """p = 1 adds host to device time, a large p takes the larger; p = 2 lies between."""
    shape = dict(num_heads=16, dims=V3, workspace_tokens=W)
    got = {p: estimate_costs_ms([8192], [512], constants=replace(H200_COSTS, host_overlap_p=p), **shape)
           for p in (1.0, 2.0, 64.0)}
    for path in (AttentionPath.ABSORBED, AttentionPath.MHA_CHUNKED):
        assert got[1.0][path] > got[2.0][path] > got[64.0][path]
    # 8 new tokens, no prefix: ~0.1 us of device work under tens of us of launches -> ~ the host time for any p
    for p in (1.0, 2.0, 64.0):
        tiny = estimate_costs_ms([0], [8], constants=replace(H200_COSTS, host_overlap_p=p), **shape)
        assert tiny[AttentionPath.ABSORBED] == pytest.approx(H200_COSTS.absorbed_fixed_us * 1e-3, rel=0.02)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="prefix_lens and extend_lens must have the same length"):
        choose_path([1, 2], [3], num_heads=16, dims=V3, workspace_tokens=W)
    with pytest.raises(ValueError, match="extend_lens must be >= 0"):
        choose_path([1], [-3], num_heads=16, dims=V3, workspace_tokens=W)
    with pytest.raises(TypeError, match="prefix_lens must be a 1-D integer tensor"):
        choose_path(torch.tensor([1.0]), [3], num_heads=16, dims=V3, workspace_tokens=W)
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        choose_path([1], [3], num_heads=0, dims=V3, workspace_tokens=W)
    with pytest.raises(ValueError, match="workspace_tokens must be an int >= 1"):
        choose_path([1], [3], num_heads=16, dims=V3, workspace_tokens=0)
    with pytest.raises(ValueError, match="copy_tbps must be > 0"):
        replace(H200_COSTS, copy_tbps=0.0)
    with pytest.raises(ValueError, match="host_overlap_p must be >= 1"):
        replace(H200_COSTS, host_overlap_p=0.5)
    with pytest.raises(TypeError, match="constants must be a CostConstants"):
        choose_path([1], [3], num_heads=16, dims=V3, workspace_tokens=W, constants={"hbm_tbps": 4})
    with pytest.raises(ValueError, match="names must be a non-empty subset"):
        fit_cost_constants(read_samples_csv(RECORDED_CSV)[:4], V3, names=("num_sms",))
    with pytest.raises(ValueError, match="no measured time"):
        fit_cost_constants([CostSample(16, (0,), (64,), W, None, None)], V3)
    other = tmp_path / "decode.csv"
    other.write_text("batch,context,ms\n1,2,3\n")
    with pytest.raises(ValueError, match="not a prefill bench CSV"):
        read_samples_csv(other)


def test_fit_recovers_a_different_machine():
    """Samples timed on a machine 20 % slower in attention and GEMMs, with other host costs: the fit
    started at H200_COSTS recovers the constants and predicts every sample."""
    truth = replace(H200_COSTS, mha_attn_tflops=0.8 * H200_COSTS.mha_attn_tflops,
                    absorbed_attn_tflops=0.8 * H200_COSTS.absorbed_attn_tflops,
                    gemm_tflops=0.8 * H200_COSTS.gemm_tflops, chunk_overhead_us=150.0, mha_fixed_us=120.0,
                    absorbed_fixed_us=60.0)
    shapes = [(16, [8192], [512]), (128, [32768], [4096]), (16, [0], [4096]), (128, [65536], [128]),
              (16, [65536], [8192]), (128, [0], [256]), (16, [0, 0], [100, 300]), (128, [4096, 0], [64, 2048]),
              (128, [0], [8192]), (16, [16384], [64])]
    samples = []
    for H, p, n in shapes:
        c = estimate_costs_ms(p, n, num_heads=H, dims=V3, workspace_tokens=W, constants=truth)
        mha = c[AttentionPath.MHA_CHUNKED] if any(p) else c[AttentionPath.MHA_ONESHOT]
        samples.append(CostSample(H, tuple(p), tuple(n), W, absorbed_ms=c[AttentionPath.ABSORBED], mha_ms=mha))
    only_mha = estimate_costs_ms([2048], [1024], num_heads=16, dims=V3, workspace_tokens=W, constants=truth)
    samples.append(CostSample(16, (2048,), (1024,), W, absorbed_ms=None, mha_ms=only_mha[AttentionPath.MHA_CHUNKED]))
    fitted = fit_cost_constants(samples, V3)
    for name in FITTED_CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.03), name
    for e in evaluate_choices(samples, V3, constants=fitted):
        for path, ms in e.measured_ms.items():
            assert e.modelled_ms[path] == pytest.approx(ms, rel=0.01)
    assert len(evaluate_choices(samples, V3, constants=fitted)) == len(samples) - 1  # one path only: skipped
