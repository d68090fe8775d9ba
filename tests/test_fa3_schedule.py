"""FA3's tile schedule planned once per step (``ops.get_fa3_schedule``): checks, the reference, the step plan.

On the CPU the reference plans an empty marker schedule with the same key as FA3's and checks it the same way,
so every refusal below is the one a GPU call gets before any kernel runs. Outputs with a schedule are compared
with the fp64 oracle (the schedule is a scheduling hint: the same attention must come out).
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import follow_up, make_mla_case, mla_oracle, padded, rel_err
from ops_cases import OP_SPECS, build_case, oracle
from specs import MLA_CONFIGS, BatchSpec, MLAConfig

from mla_fa3 import ops
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardMode
from mla_fa3.ops import FA3Schedule, Impl
from mla_fa3.policy.decode_kernel import FA3_STEP_SCHEDULE_MAX_BATCH, fa3_num_splits
from mla_fa3.policy.paths import DecodeKernel


def schedule_of(case, **over) -> FA3Schedule:
    """The schedule of ``case``'s call (the reference's marker on the CPU), any argument overridden."""
    kw, q = case.kwargs, case.q
    args = dict(page_size=case.k_cache.shape[1], num_heads=q.shape[-2], num_heads_k=case.k_cache.shape[2],
                head_dim=q.shape[-1], head_dim_v=case.v_cache.shape[-1], dtype=q.dtype,
                max_seqlen_q=kw.get("max_seqlen_q") or q.shape[1], cu_seqlens_q=kw.get("cu_seqlens_q"),
                causal=kw["causal"], window_size=kw["window_size"], softcap=kw["softcap"], impl="reference")
    args.update(over)
    cache_seqlens, page_table = args.pop("cache_seqlens", kw["cache_seqlens"]), args.pop("page_table", kw["page_table"])
    return ops.get_fa3_schedule(cache_seqlens, page_table, **args)


def call(case, schedule, **over):
    kw = {**case.kwargs, **over}
    return ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **kw, schedule=schedule, return_lse=True,
                                       impl="reference")


@pytest.mark.parametrize("name", ["decode_bs8_mqa", "batched_q", "mla_small", "window_left", "softcap", "page1_shuffled"])
def test_reference_with_schedule_matches_oracle(name):
    case = build_case(OP_SPECS[name])
    sched = schedule_of(case)
    assert sched.impl is Impl.REFERENCE and sched.scheduler_metadata is None
    assert sched.key.varlen == (OP_SPECS[name].sq == 0)
    out, lse = call(case, sched)
    ref_out, ref_lse = oracle(case)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("over, field", [
    (dict(num_heads=16), "num_heads"),
    (dict(head_dim_v=8), "head_dim_v"),
    (dict(max_seqlen_q=2), "max_seqlen_q"),
    (dict(page_size=8), "page_size"),
    (dict(window_size=(4, -1)), "window_size"),
    (dict(softcap=3.0), "softcap"),
    (dict(causal=False), "causal"),
    (dict(num_splits=8), "num_splits"),
    (dict(dtype=torch.bfloat16), "dtype"),
])
def test_schedule_planned_for_another_call_is_refused(over, field):
    case = build_case(OP_SPECS["decode_bs8_mqa"])
    with pytest.raises(ValueError, match=f"planned for another call: .*{field}="):
        call(case, schedule_of(case, **over))


def test_schedule_for_another_page_table_width_is_refused():
    case = build_case(OP_SPECS["decode_bs8_mqa"])
    pt = case.kwargs["page_table"]
    wider = torch.cat([pt, pt[:, :1]], dim=1)
    with pytest.raises(ValueError, match="page_table_width="):
        call(case, schedule_of(case, page_table=wider))


def test_schedule_read_with_other_length_tensors_is_refused():
    case = build_case(OP_SPECS["decode_bs8_mqa"])
    sched = schedule_of(case)
    same_values = case.kwargs["cache_seqlens"].clone()
    with pytest.raises(ValueError, match="cache_seqlens is not the tensor the schedule was planned from"):
        call(case, sched, cache_seqlens=same_values)
    with pytest.raises(ValueError, match="cu_seqlens_q is not the tensor"):
        call(case, sched, cu_seqlens_q=case.kwargs["cu_seqlens_q"].clone())


def test_schedule_type_and_impl_are_checked():
    case = build_case(OP_SPECS["decode_bs1"])
    with pytest.raises(TypeError, match="FA3Schedule"):
        call(case, ops.FlashMLASchedule(impl=Impl.REFERENCE))
    sched = schedule_of(case)
    fake_fa3 = FA3Schedule(impl=Impl.FA3, key=sched.key, cache_seqlens=sched.cache_seqlens,
                           cu_seqlens_q=sched.cu_seqlens_q)
    with pytest.raises(ValueError, match="planned by fa3, but this call runs reference"):
        call(case, fake_fa3)


@pytest.mark.parametrize("over, err, match", [
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(max_seqlen_q=0), ValueError, "max_seqlen_q"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(cache_seqlens=torch.ones(3, dtype=torch.int32)), ValueError, "page_table must have one row per request"),
    (dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), ValueError, "cu_seqlens_q must have bs \\+ 1"),
    (dict(window_size=(1, 2, 3)), TypeError, "window"),
])
def test_planning_arguments_are_checked(over, err, match):
    case = build_case(OP_SPECS["decode_bs8_mqa"])
    with pytest.raises(err, match=match):
        schedule_of(case, **over)


def test_copy_checks_key():
    case = build_case(OP_SPECS["decode_bs8_mqa"])
    a = schedule_of(case)
    assert a.copy_(schedule_of(case)) is a
    with pytest.raises(ValueError, match="planned for"):
        a.copy_(schedule_of(case, num_heads=16))
    with pytest.raises(TypeError):
        a.copy_(object())


# ---------------------------------------------------------------------------------------- the step plan
def _backend(case, **kw) -> MLABackend:
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device=case.layout.device, impl="reference",
                      num_heads=case.cfg.num_heads, mla_dims=case.cfg.dims, **kw)


def _decode_spec(bs: int, mode=ForwardMode.DECODE, k: int = 1, page_size: int = 4) -> BatchSpec:
    return BatchSpec(mode, tuple(3 + (7 * i) % 29 for i in range(bs)), (k,) * bs, page_size=page_size)


@pytest.mark.parametrize("bs, mode, k", [(1, ForwardMode.DECODE, 1), (FA3_STEP_SCHEDULE_MAX_BATCH, ForwardMode.DECODE, 1),
                                         (FA3_STEP_SCHEDULE_MAX_BATCH + 1, ForwardMode.DECODE, 1),
                                         (3, ForwardMode.TARGET_VERIFY, 3)])
def test_small_fa3_decode_steps_plan_the_schedule_once(bs, mode, k):
    case = make_mla_case(_decode_spec(bs, mode, k), "odd_small", seed=bs)
    backend = _backend(case, decode_kernel="fa3")
    backend.init_forward_metadata(case.batch)
    plan = backend.step_plan
    small = bs <= FA3_STEP_SCHEDULE_MAX_BATCH
    assert (plan.fa3_schedule is not None) == small
    assert ("FA3's tile schedule planned once" in backend.explain().reason) == small
    if small:
        assert plan.fa3_schedule.key.max_seqlen_q == k and plan.fa3_schedule.key.batch_size == bs
        assert plan.schedule_for(case.layer, DecodeKernel.FA3) is plan.fa3_schedule
    out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert rel_err(out, mla_oracle(case)) <= 1e-5


@pytest.mark.parametrize("layer_kw", [dict(logit_cap=5.0), dict(sliding_window=6)])
def test_layers_with_softcap_or_window_plan_their_own(layer_kw):
    case = make_mla_case(_decode_spec(3), "odd_small", seed=7, **layer_kw)
    backend = _backend(case, decode_kernel="fa3")
    backend.init_forward_metadata(case.batch)
    assert backend.step_plan.fa3_schedule is not None
    assert backend.step_plan.schedule_for(case.layer, DecodeKernel.FA3) is None
    out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert rel_err(out, mla_oracle(case)) <= 1e-5


@pytest.mark.parametrize("heads, bs, splits", [(128, 1, 48), (128, 2, 48), (128, 3, 0), (16, 1, 0), (256, 2, 48)])
def test_split_count_follows_the_policy_and_reaches_the_kernel(heads, bs, splits):
    """Many heads at one or two requests ask FA3 for few splits; the layers pass the count the schedule was planned
    with (a call asking another count is refused by the ops layer, so the step would fail if they did not)."""
    cfg = MLAConfig(heads, MLA_CONFIGS["tiny"].dims)
    case = make_mla_case(_decode_spec(bs), cfg, seed=heads + bs)
    backend = _backend(case, decode_kernel="fa3")
    backend.init_forward_metadata(case.batch)
    assert backend.step_plan.fa3_schedule.key.num_splits == fa3_num_splits(heads, bs) == splits
    out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert rel_err(out, mla_oracle(case)) <= 1e-5


def test_other_kernels_and_extend_steps_plan_no_fa3_schedule():
    case = make_mla_case(_decode_spec(2, page_size=64), "odd_small", seed=3)
    backend = _backend(case, decode_kernel="flashmla")
    backend.init_forward_metadata(case.batch)
    assert backend.step_plan.fa3_schedule is None and backend.step_plan.flashmla_schedule is not None
    ext = make_mla_case(BatchSpec(ForwardMode.EXTEND, (4, 9), (3, 5), page_size=4), "odd_small", seed=4)
    backend = _backend(ext, decode_kernel="fa3", prefill_path="absorbed")
    backend.init_forward_metadata(ext.batch)
    assert backend.step_plan.fa3_schedule is None


def test_captured_step_replans_its_schedule_in_the_replay_update():
    """A graph step (host replay update) keeps the captured schedule object and re-plans it for each batch."""
    case = make_mla_case(BatchSpec(ForwardMode.DECODE, (40, 3, 77), (1, 1, 1), page_size=16), "tiny", seed=9)
    backend = _backend(case, decode_kernel="fa3")
    backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context)
    backend.init_forward_metadata_capture_cuda_graph(4, ForwardMode.DECODE)
    captured = backend.step_plan.fa3_schedule
    assert captured is not None and captured.key.batch_size == 4
    for i, (lens, requests) in enumerate((((40, 3, 77), [0, 1, 2]), ((60, 30), [2, 0]))):
        step = follow_up(case, ForwardMode.DECODE, lens, (1,) * len(lens), requests=requests, seed=i, pad_to=4)
        backend.init_forward_metadata_replay_cuda_graph(step.batch)
        assert backend.step_plan.fa3_schedule is captured
        out = backend.forward(padded(step.q, 4), padded(step.new_latent, 4), None, step.layer, step.batch)
        assert rel_err(out[:step.q.shape[0]], mla_oracle(step)) <= 1e-5


def test_bench_runs_the_reference_on_the_cpu(tmp_path, capsys, monkeypatch):
    """``bench.fa3_schedule`` on the CPU: one row per shape, the split columns, and every call it makes is MLA
    attention over its scattered pages (each output against the fp64 oracle). The bench's own check (per-step
    output == per-call output) compares the torch reference with itself on the CPU, where the schedule is only
    checked, not used, so it proves nothing here; the oracle does."""
    import csv

    from mla_fa3.bench import fa3_schedule
    from oracle import dense_attention

    calls, real = [], ops.flash_attn_with_kvcache

    def spy(q, k_cache, v_cache, **kw):
        out = real(q, k_cache, v_cache, **kw)
        calls.append((q.clone(), k_cache, v_cache, kw, out.clone()))
        return out

    monkeypatch.setattr(ops, "flash_attn_with_kvcache", spy)
    assert fa3_schedule.main(["--heads", "2", "--batch", "1,3", "--context", "70", "--splits", "2", "--iters", "1",
                              "--quiet", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "fa3_schedule.csv")))
    assert [(r["heads"], r["batch"], r["context"]) for r in rows] == [("2", "1", "70"), ("2", "3", "70")]
    assert all(r["splits_us"].startswith("2:") for r in rows)
    assert "| splits 2 |" in capsys.readouterr().out
    assert {(c[0].shape[0], c[3]["num_splits"], c[3]["schedule"] is None) for c in calls} == \
        {(bs, n, per_call) for bs in (1, 3) for n, per_call in ((0, True), (0, False), (2, False))}
    first = {(c[0].shape[0], c[3]["num_splits"], c[3]["schedule"] is None): c for c in reversed(calls)}
    for q, k_rope, c_kv, kw, out in first.values():
        page, table, lens = k_rope.shape[1], kw["page_table"], kw["cache_seqlens"].tolist()
        for b, L in enumerate(lens):
            rows = torch.cat([torch.arange(p * page, (p + 1) * page) for p in table[b].tolist()])[:L]
            flat = lambda x: x.reshape(-1, *x.shape[2:])[rows]  # noqa: E731 — [L, 1, d] of request b
            ref, _ = dense_attention(q[b:b + 1], flat(k_rope), flat(c_kv), qv=kw["qv"][b:b + 1],
                                     scale=(128 + 64) ** -0.5, causal=True)  # DeepSeek-V3: 1/sqrt(d_nope + d_rope)
            torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-5, rtol=1e-5)
