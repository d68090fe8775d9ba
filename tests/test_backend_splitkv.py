"""The backend's third decode kernel, split-KV (``decode_kernel='splitkv'``), on CPU (reference impl) vs the fp64
non-absorbed oracle: decode / verify / draft on page 16 and 64, its split schedule planned from the host
lengths and named by ``explain()``, CUDA-graph-style capture then replay with new lengths copied into the
captured schedule, and ``decode_kernel='auto'`` picking it only where the measured table says it wins.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mla_cases import follow_up, make_mla_case, mla_oracle, padded, rel_err
from specs import SPECS, BatchSpec

from mla_fa3.batch import ForwardMode
from mla_fa3.ops import SplitKVSchedule
from mla_fa3.ops import splitkv_plan as sp
from mla_fa3.policy import decode_kernel as kc
from mla_fa3.policy.decode_table import Measured
from mla_fa3.policy.paths import DecodeKernel

from test_backend import TOL, backend_for, run_step

DEC, VER, DRAFT = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE
SKV = DecodeKernel.SPLITKV


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("spec_name", ["small_decode", "decode_page64_long", "verify_k2_page64", "draft_decode"])
def test_splitkv_decode_kernel_matches_oracle(spec_name, page):
    spec = SPECS[spec_name]
    spec = BatchSpec(spec.mode, spec.prefix_lens, spec.extend_lens, page_size=page)
    case = make_mla_case(spec, "tiny", seed=4)
    out, backend = run_step(case, decode_kernel="splitkv")
    rec, plan = backend.explain(), backend.step_plan
    assert rec.kernel == "splitkv" and isinstance(plan.splitkv_schedule, SplitKVSchedule)
    assert plan.flashmla_schedule is None
    lens = case.batch.seq_lens_cpu.tolist()
    assert plan.splitkv_schedule.planned_batch == len(lens) and rec.num_splits == plan.splitkv_schedule.planned_work
    assert sum(1 for L in lens if L) <= rec.num_splits and f"({rec.num_splits} splits)" in rec.summary()
    assert rel_err(out, mla_oracle(case)) <= TOL


def test_splitkv_step_falls_back_to_fa3_for_a_softcapped_layer():
    case = make_mla_case(BatchSpec(DEC, (10, 70), (1, 1), page_size=16), "tiny", seed=4, logit_cap=4.0)
    out, backend = run_step(case, decode_kernel="splitkv")
    assert "FA3 for layers with softcap" in backend.explain().reason
    assert rel_err(out, mla_oracle(case)) <= TOL


@pytest.mark.parametrize("device_metadata", [False, True])
@pytest.mark.parametrize("mode,k", [(DEC, 1), (VER, 3), (DRAFT, 1)])
def test_splitkv_graph_capture_then_replay_with_new_lengths(mode, k, device_metadata):
    """Capture at bs 4 (schedule sized for any lengths), replay smaller batches: each replay re-plans the captured
    schedule's buffers (same tensors) on the device from the live lengths — in the replay update, or in the graph's
    prologue with device metadata — into exactly the host planner's plan of those lengths, and the output matches
    the oracle."""
    spec = BatchSpec(mode, (40, 3, 77), (k,) * 3, page_size=16)
    case = make_mla_case(spec, "tiny", seed=9)
    backend = backend_for(case, decode_kernel="splitkv")
    backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context, max_num_draft_tokens=k,
                                  device_metadata=device_metadata)
    backend.init_forward_metadata_capture_cuda_graph(4, mode, num_draft_tokens=k)
    captured = backend.step_plan.splitkv_schedule
    assert captured.max_batch == 4 and backend.explain().graph
    work = captured.work
    for prefix, requests, seed in (((40, 3, 77), [0, 1, 2], 0), ((60, 30), [2, 0], 1), ((2,), [1], 2)):
        step = follow_up(case, mode, prefix, (k,) * len(prefix), requests=requests, seed=seed, pad_to=4)
        backend.init_forward_metadata_replay_cuda_graph(step.batch)
        if device_metadata:
            backend.graph_prologue()  # what the captured graph runs before its layers
        plan = backend.step_plan
        assert plan.splitkv_schedule is captured and captured.work is work, "replay writes the captured buffers"
        assert captured.planned_batch == step.batch.batch_size  # the padded batch (padding rows: 1 key each)
        rec = backend.explain()
        assert rec.num_splits is None and "splits planned on the device" in rec.reason
        lens = step.batch.seq_lens_cpu.tolist()
        want, offsets, _ = sp.plan_splits(lens, target=captured.target, granule=captured.granule,
                                          min_split_tokens=captured.min_split_tokens)
        n = len(want)
        assert captured.num_work.tolist() == [n] and n >= len(prefix)
        assert captured.work[:n].tolist() == [list(row) for row in want]
        assert captured.split_offsets.tolist() == offsets
        out = backend.forward(padded(step.q, 4 * k), padded(step.new_latent, 4 * k), None, step.layer, step.batch)
        T = step.q.shape[0]
        assert rel_err(out[:T], mla_oracle(step)) <= TOL


def _table_with_splitkv(heads):
    """A measured table where split-KV wins at bs 1-4 up to 1k tokens and loses at bs 64 (times invented)."""
    rows = [(1, 64, 0.02, 0.03, 0.01), (4, 128, 0.02, 0.03, 0.012), (64, 128, 0.1, 0.09, 0.2)]
    return tuple(Measured(heads, bs, ctx, fa3_ms=fa3, flashmla_ms=mla, splitkv_ms=skv, source="test")
                 for bs, ctx, fa3, mla, skv in rows)


def test_auto_picks_splitkv_only_where_measured_and_captures_its_graph(monkeypatch):
    spec = BatchSpec(DEC, (40, 3, 77), (1,) * 3, page_size=64)
    case = make_mla_case(spec, "tiny", seed=9)
    H = case.cfg.num_heads
    backend = backend_for(case, decode_kernel="auto")
    # the built-in table has split-KV times at 16 heads only, out of the choice's reach at 4 heads: no
    # split-KV graph is captured, and these 4-head steps of < 100 tokens run FA3
    assert kc.splitkv_measured() and not kc.splitkv_possible(H)
    assert backend.graph_kernels() == (DecodeKernel.FA3, DecodeKernel.FLASHMLA)
    out, _ = run_step(case, backend)
    assert backend.explain().kernel == "fa3" and "no measured shape" in backend.explain().reason
    monkeypatch.setattr(kc, "MEASURED", tuple(replace(m, splitkv_ms=None) for m in kc.MEASURED))
    assert SKV not in backend.graph_kernels(), "a table without split-KV times: never captured"
    monkeypatch.setattr(kc, "MEASURED", _table_with_splitkv(H))
    assert backend.graph_kernels() == (DecodeKernel.FA3, DecodeKernel.FLASHMLA, SKV)
    out, _ = run_step(case, backend)
    assert backend.explain().kernel == "splitkv" and "split-KV" in backend.explain().reason
    assert rel_err(out, mla_oracle(case)) <= TOL
    backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context)
    for kernel in backend.graph_kernels():
        backend.init_forward_metadata_capture_cuda_graph(4, DEC, kernel=kernel)
    step = follow_up(case, DEC, (40, 3, 77), (1,) * 3, requests=[0, 1, 2], seed=3, pad_to=4)
    backend.init_forward_metadata_replay_cuda_graph(step.batch)
    assert backend.graph_kernel is SKV
    out = backend.forward(padded(step.q, 4), padded(step.new_latent, 4), None, step.layer, step.batch)
    assert rel_err(out[:3], mla_oracle(step)) <= TOL


def test_splitkv_setting_is_named_and_needs_num_heads():
    case = make_mla_case("small_decode", "tiny", seed=1)
    with pytest.raises(ValueError, match="^num_heads .* decode_kernel=splitkv"):
        backend_for(case, decode_kernel="splitkv", num_heads=None)
    with pytest.raises(ValueError, match="^decode_kernel must be 'auto', 'fa3', 'flashmla', 'splitkv'"):
        backend_for(case, decode_kernel="split")
