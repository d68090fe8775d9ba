"""Contracts of the top-level modules (backend, absorb, batch, ...) that the mutation pass found unchecked
(docs/MUTATION.md): named errors at the boundary, before any kernel runs (DESIGN's hard rules), and values worked
by hand.
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import make_mla_case

from mla_fa3.absorb import attend_latent
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool


@pytest.fixture(scope="module")
def case():
    return make_mla_case("small_decode", "odd_small", seed=1)


def test_attend_latent_refuses_a_q_rope_of_another_width(case):
    layer, T = case.layer, 3
    H, r, dr = layer.num_heads, layer.mla.kv_lora_rank, layer.mla.qk_rope_head_dim
    q_lat = torch.zeros(T, H, r)
    with pytest.raises(ValueError, match="q_lat and q_rope must be"):
        attend_latent(q_lat, torch.zeros(T, H, dr + 1), layer, None, None)
    with pytest.raises(ValueError, match="q_lat and q_rope must be"):
        attend_latent(q_lat, torch.zeros(T, H + 1, dr), layer, None, None)


def test_backend_refuses_mla_dims_of_another_type(case):
    with pytest.raises(TypeError, match="mla_dims must be an MLADims, got tuple"):
        MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=case.spec.page_size,
                   device=case.layout.device, impl="reference", num_heads=case.layer.num_heads, mla_dims=(512, 64))


def test_flashmla_cannot_read_an_fp8_pool_off_page_64():
    pool = MLATokenPool(1, 8, 16, 32, 16, torch.bfloat16, "cpu", kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="decode_kernel='flashmla' cannot read an FP8 latent pool of page_size 16"):
        MLABackend(req_to_token_pool=ReqToTokenPool(2, 64, "cpu"), kv_pool=pool, page_size=16, device="cpu",
                   impl="reference", num_heads=4, decode_kernel="flashmla")


def test_extend_batch_refuses_lengths_of_different_counts():
    # [1] + [2, 3, 4] would broadcast silently: the lengths must be per request, one each
    with pytest.raises(ValueError, match="prefix_lens and extend_lens must have the same length, got 1 and 3"):
        ForwardBatch.extend([0, 1, 2], [1], [2, 3, 4], list(range(9)), "cpu")


def test_extend_positions_hand_worked():
    # prefixes 2 and 0, new 3 and 1: positions 2, 3, 4 then 0; seq_lens 5 and 1
    b = ForwardBatch.extend([0, 1], [2, 0], [3, 1], [10, 11, 12, 13], "cpu")
    assert b.positions.tolist() == [2, 3, 4, 0]
    assert b.seq_lens_cpu.tolist() == [5, 1]


def test_check_real_contract():
    import math

    from mla_fa3.checks import check_real

    assert check_real(3, "x") == 3.0 and isinstance(check_real(3, "x"), float)
    assert check_real(0.0, "x") == 0.0 and check_real(-2.5, "x") == -2.5
    assert check_real(0.5, "x", positive=True) == 0.5
    for bad, positive in ((math.inf, False), (math.nan, False), (0.0, True), (-1.0, True)):
        with pytest.raises(ValueError, match="x must be a finite number"):
            check_real(bad, "x", positive=positive)
    with pytest.raises(TypeError, match="x must be a real number, got bool"):
        check_real(True, "x")


def _draft(case, num_steps=3):
    from mla_fa3.draft_backend import MultiStepDraftBackend

    return MultiStepDraftBackend(num_steps, req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                                 page_size=case.spec.page_size, device=case.layout.device, impl="reference")


def test_draft_step_index_is_in_range(case):
    draft = _draft(case)
    assert draft.step(0) is draft.backends[0] and draft.step(2) is draft.backends[2]
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match=r"i must be a draft step in \[0, 3\)"):
            draft.step(bad)


def test_draft_step_i_advances_lengths_and_positions_by_i(case):
    draft = _draft(case)
    base = ForwardBatch.draft_decode([0, 1], [5, 9], [20, 21], "cpu", step=0)  # positions 4 and 8
    got = draft.step_batch(base, 2, out_cache_loc=torch.tensor([30, 31]))
    assert got.draft_step == 2
    assert got.seq_lens_cpu.tolist() == [7, 11] and got.positions.tolist() == [6, 10]
    assert got.out_cache_loc.tolist() == [30, 31]


@pytest.mark.parametrize("scaling", [0.0, -0.1, float("inf"), float("nan")])
def test_layer_scaling_must_be_positive_and_finite(case, scaling):
    import dataclasses

    with pytest.raises(ValueError, match="scaling must be a positive finite float"):
        dataclasses.replace(case.layer, scaling=scaling)
    assert dataclasses.replace(case.layer, scaling=1e-3).scaling == 1e-3


@pytest.mark.parametrize("kernel", ["flashmla", "splitkv"])
def test_a_layer_of_another_head_count_falls_back_to_fa3(case, kernel):
    # FlashMLA / split-KV schedules are planned for the plan's head count: another count reads with FA3
    import dataclasses

    from mla_fa3.plan import StepPlan
    from mla_fa3.policy.paths import AttentionPath, DecodeKernel

    H = case.layer.num_heads
    plan = StepPlan(batch=None, metadata=None, path=AttentionPath.ABSORBED, kernel=DecodeKernel(kernel), num_heads=H,
                    record=None)
    assert plan.route(case.layer) == (AttentionPath.ABSORBED, DecodeKernel(kernel))
    other = dataclasses.replace(case.layer, num_heads=2 * H, mla_weights=None)
    assert plan.route(other) == (AttentionPath.ABSORBED, DecodeKernel.FA3)


def test_prefill_graph_bind_reads_the_live_plan_and_never_writes_it():
    from mla_fa3.prefill_graph import PrefillGraphs
    from test_prefill_graph import _plans

    case, _, (first, live, _) = _plans("budget_splits_mid_page", W=None, n=3)
    for t in (live.prefix_slot_ids, live.new_slot_ids):
        t.copy_(t.flip(0))  # a relocated cache: the live step's slots differ from the captured step's
    want = [live.prefix_slot_ids.clone(), live.new_slot_ids.clone()]
    shape = PrefillGraphs()._new_shape(("k",), case.q, None, case.layer, first)
    assert not torch.equal(shape.plan.prefix_slot_ids, want[0])
    shape.bind(live)
    assert torch.equal(live.prefix_slot_ids, want[0]) and torch.equal(live.new_slot_ids, want[1])
    assert torch.equal(shape.plan.prefix_slot_ids, want[0]) and torch.equal(shape.plan.new_slot_ids, want[1])


def test_kv_accuracy_report_gives_one_gap_line_per_fp8_run():
    from mla_fa3.hf_compare.validate import PositionScores
    from mla_fa3.kv_accuracy import CacheComparison, CacheRun, format_comparison

    ref = torch.tensor([1, 2, 3, 4, 5, 6])  # transformers' argmax; rows 3..5 are decode rows
    decode = torch.tensor([False, False, False, True, True, True])

    def scores(ours):
        return PositionScores(torch.tensor(ours), ref, torch.ones(6, dtype=torch.float64), decode)

    runs = [CacheRun("fp32 cache", "auto", scores([1, 2, 3, 4, 5, 6]), None),
            CacheRun("fp8, scale 1.0", "fp8", scores([1, 2, 0, 4, 0, 6]), [[1.0]]),  # misses rows 2 and 4
            CacheRun("fp8, calibrated", "fp8", scores([1, 2, 3, 4, 5, 0]), [[0.5]])]  # misses row 5
    text = format_comparison(CacheComparison(runs, "tiny_v3", torch.float32, 16, (0,), (3,), 3, None))
    gaps = [line for line in text.splitlines() if line.startswith("  ") and " all +" in line]
    assert [line.split("  ")[1].strip() for line in gaps] == ["fp8, scale 1.0", "fp8, calibrated"]
    # b = rows only the reference gets right: 2 (one prefill, one decode) and 1 (decode); gap = b / 6 rows
    assert "all +33.33" in gaps[0] and "(b 2, c 0)" in gaps[0] and "all +16.67" in gaps[1]
    assert "prefill +0.00" in gaps[1] and "decode +33.33" in gaps[1]


@pytest.mark.parametrize("scale", [None, torch.ones(1, dtype=torch.float64), torch.ones(2)])
def test_mha_prefill_over_an_fp8_pool_needs_its_one_float32_scale(scale):
    from mla_fa3.chunked_prefix import _check_forward
    from test_prefill_graph import _plans

    case, _, (plan,) = _plans("budget_splits_mid_page", n=1)
    kv = case.pool.kv_buffer[case.layer.layer_id].to(torch.float8_e4m3fn)  # an FP8 pool's rows
    kv_paged = kv.view(-1, case.spec.page_size, 1, kv.shape[-1])
    _check_forward(case.q, None, case.layer, kv_paged, plan, torch.ones(1))  # the right scale passes
    with pytest.raises(ValueError, match=r"kv_scale must be the FP8 pool's \[1\] float32 scale"):
        _check_forward(case.q, None, case.layer, kv_paged, plan, scale)


def test_a_prefix_that_fits_the_workspace_runs_one_attention_call(monkeypatch):
    # the one-pass layout (PrefillPlan.one_pass): prefix and new keys decompressed together, one causal call, no merge
    from mla_fa3 import chunked_prefix
    from specs import PREFILL_RUNS, PREFILL_SPECS
    from test_chunked_prefix import _run, _setup

    spec, (_, cfg) = PREFILL_SPECS["budget_covers_all"], PREFILL_RUNS["budget_covers_all"]
    case, md, plan = _setup(spec, cfg, 4096)
    assert plan.one_pass is not None and plan.chunks  # chunks are planned too: the one pass replaces them
    calls = {"attn": 0, "merge": 0}
    attn, merge = chunked_prefix.ops.run_flash_attn_varlen, chunked_prefix.ops.run_merge_state

    def count(key, fn):
        def wrapped(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(chunked_prefix.ops, "run_flash_attn_varlen", count("attn", attn))
    monkeypatch.setattr(chunked_prefix.ops, "run_merge_state", count("merge", merge))
    _run(case, md, plan)
    assert calls == {"attn": 1, "merge": 0}


def test_a_verify_mask_error_names_the_first_token_that_does_not_see_itself():
    import numpy as np

    from mla_fa3.tree import DraftTreeError, check_verify_mask

    mask = np.array([[[True, False], [True, False]], [[False, False], [True, True]]])  # (0, 1) and (1, 0) fail
    with pytest.raises(DraftTreeError, match=r"tree.mask\[0, 1, 1\] is False: draft token 1 of request 0"):
        check_verify_mask(mask)


def test_a_draft_tree_reads_its_shape_from_the_mask():
    from mla_fa3.tree import DraftTree

    tree = DraftTree(mask=torch.tensor([[[True, False, True], [True, True, False]]]), verify=False)
    assert (tree.batch_size, tree.num_queries, tree.num_keys, tree.shape) == (1, 2, 3, (2, 3))


def test_forward_absorbed_tree_checks_q_by_default(case):
    from mla_fa3.absorb_tree import forward_absorbed_tree

    d, H = case.layer.mla, case.layer.num_heads
    bad = torch.zeros(3, H + 1, d.qk_nope_head_dim + d.qk_rope_head_dim)
    with pytest.raises(ValueError, match="q must be"):
        forward_absorbed_tree(bad, case.layer, None, None)


def test_a_tree_step_refuses_a_window_of_zero_tokens(case):
    """sliding_window 0 is a window (each query sees only its own position), not "none" (-1): a tree step, whose
    positions differ per branch, refuses it like any other window."""
    import dataclasses

    from mla_fa3.absorb_tree import check_tree_layer
    from mla_fa3.tree import DraftTreeError

    check_tree_layer(case.layer)  # no window: runs
    with pytest.raises(DraftTreeError, match="sliding-window"):
        check_tree_layer(dataclasses.replace(case.layer, sliding_window=0))


def test_a_verify_mask_error_names_the_first_token_that_sees_a_later_one():
    import numpy as np

    from mla_fa3.tree import DraftTree, DraftTreeError, check_verify_mask

    eye = np.eye(3, dtype=bool)
    first, second = eye.copy(), eye.copy()
    first[0, 2] = True  # token 0 of request 0 sees token 2
    second[1, 2] = True  # token 1 of request 1 sees token 2
    with pytest.raises(DraftTreeError, match=r"tree.mask\[0, 0, 2\] is True: draft token 0 of request 0"):
        check_verify_mask(np.stack([first, second]))
    one_key = DraftTree(mask=torch.ones(2, 1, 1, dtype=torch.bool), verify=False)  # n = 1 tree key is a tree
    assert one_key.shape == (1, 1)


def test_host_ints_refuses_a_string_and_a_scalar_by_name():
    from mla_fa3.host import host_ints

    assert host_ints((3, 0, 7), "lens") == [3, 0, 7]
    with pytest.raises(TypeError, match="lens must be a sequence of ints, got str"):
        host_ints("12", "lens")  # iterable, but not a sequence of ints: never ['1', '2']
    with pytest.raises(TypeError, match="lens must be a sequence of ints, got int"):
        host_ints(5, "lens")


def test_batch_rows_from_zero_to_the_last_are_in_range_without_a_pool():
    """Without a ReqToTokenPool the row check is the range [0, rows of req_to_token): both ends are rows."""
    from mla_fa3.batch_checks import BatchChecks

    checks = BatchChecks(torch.zeros(4, 8, dtype=torch.int32), None, 1, torch.device("cpu"), num_slots=None,
                         debug_checks=False)
    checks.check_rows(None, torch.tensor([0, 3]))  # row 0 and the last row: valid
    for bad in ([-1, 2], [1, 4]):
        with pytest.raises(ValueError, match=r"req_pool_indices must be in \[0, 4\)"):
            checks.check_rows(None, torch.tensor(bad))


def test_draft_mask_needs_a_branch_and_tree_positions_need_a_fitting_host_mask():
    """``sglang_draft_mask`` refuses topk 0 (a draft step has at least one branch); ``tree_positions`` gives no
    positions (None: the batch check names the misfit) for a device-only mask or one of another batch size, and
    prefix + depth otherwise (written out here: tree [-1, 0, 0, 1] over a prefix of 5 -> depths 0, 1, 1, 2)."""
    from mla_fa3.tree import DraftTree, DraftTreeError, sglang_draft_mask, tree_positions

    with pytest.raises(DraftTreeError, match="topk must be an int >= 1"):
        sglang_draft_mask(1, 0, 3, 0)
    host = DraftTree.from_parents([[-1, 0, 0, 1]], "cpu")
    seq = torch.tensor([5 + 4], dtype=torch.int32)
    assert tree_positions(seq, host).tolist() == [5, 6, 6, 7]
    device_only = DraftTree(mask=host.mask, mask_cpu=None)
    assert tree_positions(seq, device_only) is None
    assert tree_positions(torch.tensor([9, 9], dtype=torch.int32), host) is None
