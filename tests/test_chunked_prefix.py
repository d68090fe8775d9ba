"""MHA prefill over decompressed KV (chunked_prefix) and the LSE merge (lse), on CPU with the torch reference.

Every output is compared with the NON-absorbed fp64 oracle (tests/oracle.py through mla_cases.mla_oracle)
on adversarial caches (shuffled pages, NaN in every slot that no sequence owns, stale slot ids past
each sequence in req_to_token), and with the absorbed path on the same inputs.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from oracle import dense_attention
from mla_cases import make_mla_case, mla_oracle, rel_err
from specs import EXT, MIX, PREFILL_RUNS, PREFILL_SPECS, BatchSpec

from mla_fa3 import absorb, ops
from mla_fa3.chunked_prefix import forward_mha_prefill
from mla_fa3.prefill_plan import PrefillWorkspace, build_prefill_plan, plan_extend
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer
from mla_fa3.lse import Base2LSE, NaturalLSE, merge_states
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.policy.paths import AttentionPath

TOL = 2e-5  # fp32 compute vs the fp64 oracle (max abs error relative to max |ref|)


def _setup(spec, cfg, workspace_tokens, *, seed=0, store_new=True):
    case = make_mla_case(spec, cfg, seed=seed)
    if store_new:  # the backend stores the new rows before any path runs
        case.pool.kv_buffer[case.layer.layer_id][case.batch.out_cache_loc] = case.new_latent
    md = MetadataBuilder(case.layout.req_to_token_pool, spec.page_size, "cpu").build(case.batch)
    plan = build_prefill_plan(md, case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices,
                              workspace_tokens, spec.page_size)
    return case, md, plan


def _run(case, md, plan, *, latent=True):
    kv = case.pool.paged(case.layer.layer_id)
    return forward_mha_prefill(case.q, case.new_latent if latent else None, case.layer, md, kv, plan,
                               impl="reference")


@pytest.mark.parametrize("name", list(PREFILL_SPECS))
def test_mha_prefill_matches_oracle_and_absorbed(name):
    spec, (W, cfg) = PREFILL_SPECS[name], PREFILL_RUNS[name]
    case, md, plan = _setup(spec, cfg, W)
    ref = mla_oracle(case)
    out = _run(case, md, plan)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < TOL
    # the same step through the absorbed path: same answer
    absorbed = absorb.forward_absorbed(case.q, case.layer, md, case.pool.paged(case.layer.layer_id), impl="reference")
    assert rel_err(absorbed, ref) < TOL
    # new rows read back from the pool instead of passed in: same answer
    assert rel_err(_run(case, md, plan, latent=False), ref) < TOL
    # one-shot applies exactly when no MHA row has a prefix; chunks stay within the budget
    has_prefix = any(p > 0 for p, n in zip(spec.prefix_lens, spec.extend_lens) if not (n == 1 and p > 0))
    assert plan.path is (AttentionPath.MHA_CHUNKED if has_prefix else AttentionPath.MHA_ONESHOT)
    assert all(0 < ch.num_keys <= W for ch in plan.chunks)
    assert sum(ch.num_keys for ch in plan.chunks) == int(plan.prefix_lens_cpu.sum())


@pytest.mark.parametrize("name", ["prefix_page_border_chunks", "chunk_spans_requests", "mixed_decode_rows_split"])
def test_chunk_budget_does_not_change_the_result(name):
    """chunked (small budgets, mid-page and on page borders) == one chunk over the whole prefix."""
    spec, (_, cfg) = PREFILL_SPECS[name], PREFILL_RUNS[name]
    case, md, whole = _setup(spec, cfg, 4096)
    assert len(whole.chunks) == 1
    ref = mla_oracle(case)
    for W in (spec.page_size, spec.page_size + 5, 2 * spec.page_size, 3 * spec.page_size - 1):
        plan = build_prefill_plan(md, case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices,
                                  W, spec.page_size)
        assert len(plan.chunks) == -(-int(plan.prefix_lens_cpu.sum()) // W)
        assert rel_err(_run(case, md, plan), ref) < TOL


_PREFIXED = [n for n, s in PREFILL_SPECS.items()
             if any(p > 0 and not (e == 1 and s.mode is MIX) for p, e in zip(s.prefix_lens, s.extend_lens))]


@pytest.mark.parametrize("name", _PREFIXED)
def test_one_pass_exactly_when_prefix_and_new_fit_and_same_answer(name):
    """P + N <= W: one causal pass over [prefix_b | new_b] (layout checked against req_to_token); one token
    less of workspace: the chunk loop. Both against the fp64 oracle, new rows passed in or read back."""
    spec, (_, cfg) = PREFILL_SPECS[name], PREFILL_RUNS[name]
    case, md, plan = _setup(spec, cfg, 4096)
    P, N = int(plan.prefix_lens_cpu.sum()), int(plan.extend_lens_cpu.sum())
    ref = mla_oracle(case)
    r2t, rows = case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices
    mha = plan.split.mha_requests.tolist() if plan.split is not None else list(range(len(spec.prefix_lens)))
    for W in (P + N, P + N - 1):
        if W < spec.page_size:
            continue
        plan = build_prefill_plan(md, r2t, rows, W, spec.page_size)
        assert (plan.one_pass is not None) == (W == P + N)
        if plan.one_pass is not None:
            one = plan.one_pass
            want = torch.cat([r2t[rows[b], : spec.prefix_lens[b] + spec.extend_lens[b]].long() for b in mha])
            assert one.slot_ids.tolist() == want.tolist() and one.num_keys == P + N
            lens = [spec.prefix_lens[b] + spec.extend_lens[b] for b in mha]
            assert one.cu_seqlens_k.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
            assert one.max_seqlen_k == max(lens)
            assert one.slot_ids[one.new_rows].tolist() == plan.new_slot_ids.tolist()
        for latent in (True, False):
            assert rel_err(_run(case, md, plan, latent=latent), ref) < TOL


def test_one_pass_uses_the_given_new_rows():
    """latent_new given: the new tokens attend to those rows, not the pool's copy (as the chunk loop does)."""
    spec, (W, cfg) = PREFILL_SPECS["budget_covers_all"], PREFILL_RUNS["budget_covers_all"]
    case, md, plan = _setup(spec, cfg, 4096, store_new=False)  # the pool holds NaN at the new slots
    assert plan.one_pass is not None
    assert rel_err(_run(case, md, plan), mla_oracle(case)) < TOL


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    rnd = random.Random(seed)
    page = rnd.choice([1, 16, 64])
    W = rnd.choice([page, page + rnd.randint(1, 3 * page), 2 * page, 3 * page])
    bs = rnd.randint(1, 4)
    prefix = tuple(rnd.choice([0, rnd.randint(1, W), rnd.randint(W, 3 * W)]) for _ in range(bs))
    extend = tuple(rnd.randint(1, 9) for _ in range(bs))
    mode = MIX if any(n == 1 and p > 0 for p, n in zip(prefix, extend)) else EXT
    if all(n == 1 and p > 0 for p, n in zip(prefix, extend)):
        extend = (extend[0] + 2,) + extend[1:]
    case, md, plan = _setup(BatchSpec(mode, prefix, extend, page_size=page), "tiny", W, seed=seed)
    assert rel_err(_run(case, md, plan), mla_oracle(case)) < TOL


def test_split_scatters_back_in_batch_order():
    spec, (W, cfg) = PREFILL_SPECS["mixed_decode_rows_split"], PREFILL_RUNS["mixed_decode_rows_split"]
    case, md, plan = _setup(spec, cfg, W)
    split = plan.split
    assert split is not None
    assert split.absorbed_requests.tolist() == [1, 2] and split.mha_requests.tolist() == [0, 3]
    assert split.absorbed_tokens.tolist() == [6, 7]
    assert split.mha_tokens.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12]
    x = torch.arange(13.0).view(13, 1, 1)
    a, b = split.split(x)
    assert torch.equal(split.merge(a, b), x)
    sub = split.absorbed_metadata
    assert sub.batch_size == 2 and sub.max_seqlen_q == 1 and sub.max_seqlen_k == 41
    assert sub.cache_seqlens.tolist() == [4, 41] and sub.cu_seqlens_q.tolist() == [0, 1, 2]


def test_workspace_is_bounded_and_reused():
    spec, (W, cfg) = PREFILL_SPECS["budget_splits_mid_page"], PREFILL_RUNS["budget_splits_mid_page"]
    case, md, plan = _setup(spec, cfg, W)
    _run(case, md, plan)
    ws = plan.workspace
    H, d = case.cfg.num_heads, case.cfg.dims
    # fp32 latent rows + per head [v | k_nope | k_rope]: exactly the byte budget's accounting
    assert ws.nbytes == W * 4 * (d.latent_dim + H * (d.v_head_dim + d.qk_head_dim))
    assert ws.nbytes == PrefillWorkspace.bytes_for(W, H, d, torch.float32)
    held = dict(ws._buffers)
    plan2 = build_prefill_plan(md, case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices, W,
                               spec.page_size, workspace=ws)
    _run(case, md, plan2)
    assert all(ws._buffers[k] is v for k, v in held.items())  # the same buffers, not new ones
    # the first layer validated the step's calls; a second layer reuses them (and the workspace views)
    assert len(plan2.calls) == 1
    (calls,) = plan2.calls.values()
    _run(case, md, plan2)
    assert list(plan2.calls.values()) == [calls]
    assert all(c.kv.data_ptr() == ws._buffers["kv"].data_ptr() for c in calls.chunks)


# --------------------------------------------------------------------------------------------------
# LSE merge


def _attn_state(q, k, v, scale):
    o, lse = dense_attention(q, k, v, scale=scale)
    return o.float(), lse.float()


def test_merging_k_chunks_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(3)
    n, L, H, d = 5, 37, 3, 8
    q, k, v = torch.randn(n, H, d, generator=g), torch.randn(L, H, d, generator=g), torch.randn(L, H, d, generator=g)
    ref, ref_lse = dense_attention(q, k, v, scale=0.3)
    cuts = [0, 4, 5, 19, 30, 37]
    o, lse = _attn_state(q, k[:4], v[:4], 0.3)
    o, lse = o, NaturalLSE(lse)
    for a, b in zip(cuts[1:], cuts[2:]):
        oc, lc = ops.flash_attn_varlen_func(
            q, k[a:b], v[a:b], cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, b - a], dtype=torch.int32), max_seqlen_q=n, max_seqlen_k=b - a,
            softmax_scale=0.3, return_lse=True, impl="reference")
        o, lse = merge_states(o, lse, oc, NaturalLSE(lc), impl="reference")
    assert rel_err(o, ref) < TOL
    assert torch.allclose(lse.value.double(), ref_lse, rtol=1e-6, atol=1e-6)


def test_empty_chunk_state_is_the_identity():
    g = torch.Generator().manual_seed(4)
    o = torch.randn(3, 2, 4, generator=g)
    lse = NaturalLSE(torch.randn(3, 2, generator=g))
    empty = NaturalLSE(torch.full((3, 2), float("-inf")))
    om, lm = merge_states(o, lse, torch.zeros_like(o), empty, impl="reference")
    assert torch.allclose(om, o) and torch.equal(lm.value, lse.value)


def test_lse_base_misuse_is_caught():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(4, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g)
    ref, _ = dense_attention(q, k, v, scale=0.5)
    oa, la = _attn_state(q, k[:7], v[:7], 0.5)
    ob, lb = _attn_state(q, k[7:], v[7:], 0.5)
    lb2 = Base2LSE(lb / math.log(2.0))  # what a kernel computing in exp2 hands back
    with pytest.raises(TypeError, match="lse_b is a Base2LSE.*to_natural"):
        merge_states(oa, NaturalLSE(la), ob, lb2)
    with pytest.raises(TypeError, match="lse_a must be a NaturalLSE"):
        merge_states(oa, la, ob, NaturalLSE(lb))  # a bare tensor: base unknown
    o, _ = merge_states(oa, NaturalLSE(la), ob, lb2.to_natural(), impl="reference")  # explicit conversion
    assert rel_err(o, ref) < TOL
    wrong, _ = merge_states(oa, NaturalLSE(la), ob, NaturalLSE(lb2.value), impl="reference")  # the silent bug
    assert rel_err(wrong, ref) > 1e-2
    with pytest.raises(TypeError, match="float32"):
        NaturalLSE(la.double())


# --------------------------------------------------------------------------------------------------
# named errors


def _plan_args(name="budget_splits_mid_page"):
    spec, (W, cfg) = PREFILL_SPECS[name], PREFILL_RUNS[name]
    case, md, _ = _setup(spec, cfg, W)
    return case, md, case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices, spec.page_size


def test_workspace_smaller_than_a_page():
    case, md, r2t, rows, page = _plan_args()
    with pytest.raises(ValueError, match="workspace_tokens must be at least one page"):
        build_prefill_plan(md, r2t, rows, page - 1, page)
    with pytest.raises(TypeError, match="workspace_tokens must be an int"):
        build_prefill_plan(md, r2t, rows, 16.0, page)


def test_prefix_longer_than_the_pool_row():
    case, md, r2t, rows, page = _plan_args()
    with pytest.raises(ValueError, match="prefix_lens.*exceed what req_to_token holds"):
        build_prefill_plan(md, r2t[:, :40], rows, 32, page)
    empty = ReqToTokenPool(r2t.shape[0], r2t.shape[1], "cpu").req_to_token  # rows never filled: padding slots
    with pytest.raises(ValueError, match="prefix_lens: req_to_token holds a padding-page slot"):
        build_prefill_plan(md, empty, rows, 32, page)


def test_prefix_disagrees_with_seq_lens():
    case, md, r2t, rows, page = _plan_args()
    bad = md.prefix_lens_cpu.clone()
    bad[0] += 1
    md.prefix_lens_cpu = bad
    with pytest.raises(ValueError, match="prefix_lens disagree with seq_lens"):
        build_prefill_plan(md, r2t, rows, 32, page)


def test_bad_forward_inputs():
    spec, (W, cfg) = PREFILL_SPECS["budget_splits_mid_page"], PREFILL_RUNS["budget_splits_mid_page"]
    case, md, plan = _setup(spec, cfg, W)
    kv = case.pool.paged(case.layer.layer_id)
    with pytest.raises(ValueError, match="q must be"):
        forward_mha_prefill(case.q[:, :, :-1], case.new_latent, case.layer, md, kv, plan)
    with pytest.raises(ValueError, match="q must have the plan's"):
        forward_mha_prefill(case.q[:-1], case.new_latent[:-1], case.layer, md, kv, plan)
    with pytest.raises(ValueError, match="latent_new must be"):
        forward_mha_prefill(case.q, case.new_latent[:, :-1], case.layer, md, kv, plan)
    with pytest.raises(ValueError, match="kv_paged must be"):
        forward_mha_prefill(case.q, case.new_latent, case.layer, md, kv[..., :-1], plan)
    with pytest.raises(TypeError, match="plan must be a PrefillPlan"):
        forward_mha_prefill(case.q, case.new_latent, case.layer, md, kv, None)
    w = case.layer
    windowed = AttentionLayer.mla_layer(w.layer_id, w.num_heads, w.mla, w.scaling, mla_weights=w.mla_weights,
                                        sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        forward_mha_prefill(case.q, case.new_latent, windowed, md, kv, plan)


def test_plan_needs_an_mha_row():
    spec = BatchSpec(MIX, (5, 9), (1, 1))
    case = make_mla_case(spec, "tiny")
    md = MetadataBuilder(case.layout.req_to_token_pool, 16, "cpu").build(case.batch)
    with pytest.raises(ValueError, match="no row needs the MHA path"):
        build_prefill_plan(md, case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices, 16, 16)


def test_plan_extend_chooses_then_plans():
    spec, (W, cfg) = PREFILL_SPECS["mixed_decode_rows_split"], PREFILL_RUNS["mixed_decode_rows_split"]
    case, md, _ = _setup(spec, cfg, W)
    r2t, rows = case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices
    H, d = case.cfg.num_heads, case.cfg.dims
    decision, plan = plan_extend(md, r2t, rows, num_heads=H, dims=d, workspace_tokens=W, page_size=16,
                                 prefill_path="absorbed")
    assert decision.path is AttentionPath.ABSORBED and plan is None
    decision, plan = plan_extend(md, r2t, rows, num_heads=H, dims=d, workspace_tokens=W, page_size=16,
                                 prefill_path="mha")
    assert decision.path is plan.path is AttentionPath.MHA_CHUNKED
    assert decision.num_decode_rows == 2 and decision.split and plan.split is not None
    assert decision.num_chunks == len(plan.chunks)
    out = forward_mha_prefill(case.q, case.new_latent, case.layer, md, case.pool.paged(case.layer.layer_id), plan,
                              impl="reference")
    assert rel_err(out, mla_oracle(case)) < TOL
    with pytest.raises(ValueError, match="workspace_tokens must be at least one page"):
        plan_extend(md, r2t, rows, num_heads=H, dims=d, workspace_tokens=8, page_size=16)


# --------------------------------------------------------------------------------------------------
# the byte budget through the backend, the fused decompression, the pre-validated calls


def test_backend_derives_the_workspace_from_bytes():
    from mla_fa3.backend import MLABackend
    from mla_fa3.prefill_plan import workspace_tokens_for_bytes
    case = make_mla_case(BatchSpec(EXT, (40, 0), (3, 2)), "tiny")
    H, d = case.cfg.num_heads, case.cfg.dims
    common = dict(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=16, device="cpu",
                  num_heads=H, mla_dims=d, prefill_path="mha")
    budget = 100_000
    be = MLABackend(prefill_workspace_bytes=budget, **common)
    assert be.prefill_workspace_tokens == workspace_tokens_for_bytes(H, d, budget, torch.float32) == budget // (
        4 * (d.latent_dim + H * (d.v_head_dim + d.qk_head_dim)))
    be.init_forward_metadata(case.batch)
    plan = be.step_plan.prefill
    assert plan.workspace_tokens == be.prefill_workspace_tokens
    assert PrefillWorkspace.bytes_for(plan.workspace_tokens, H, d, torch.float32) <= budget
    assert MLABackend(prefill_workspace_tokens=32, **common).prefill_workspace_tokens == 32  # explicit override
    with pytest.raises(ValueError, match="budget_bytes .* at least one page"):
        MLABackend(prefill_workspace_bytes=1000, **common)


def test_decompress_latent_layout_matches_the_definition():
    from mla_fa3.chunked_prefix import decompress_latent
    case = make_mla_case(BatchSpec(EXT, (0,), (9,)), "odd_small")
    d, H, lat = case.cfg.dims, case.cfg.num_heads, case.new_latent
    k, v = decompress_latent(lat, case.layer)
    w = case.kv_b_proj.double().view(H, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    c = lat[:, : d.kv_lora_rank].double()
    k_nope = torch.einsum("hnr,lr->lhn", w[:, : d.qk_nope_head_dim], c)
    v_ref = torch.einsum("hvr,lr->lhv", w[:, d.qk_nope_head_dim:], c)
    rope = lat[:, None, d.kv_lora_rank:].double().expand(-1, H, -1)
    assert rel_err(k, torch.cat([k_nope, rope], -1)) < 1e-5 and rel_err(v, v_ref) < 1e-5
    assert k.stride(-1) == v.stride(-1) == 1 and k.data_ptr() == v.data_ptr() + 4 * d.v_head_dim  # one buffer


def test_prevalidated_calls_keep_the_boundary_checks():
    q, k, v = torch.randn(5, 2, 8), torch.randn(7, 1, 8), torch.randn(7, 1, 8)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="k dtype must match q dtype"):
        ops.prepare_flash_attn_varlen(q, k.double(), v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                      max_seqlen_k=7, impl="reference")
    impl, call = ops.prepare_flash_attn_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                               max_seqlen_k=7, impl="reference")
    q2 = torch.randn(5, 2, 8)
    o, lse = ops.run_flash_attn_varlen(impl, call.with_q(q2))
    o_ref, lse_ref = ops.flash_attn_varlen_func(q2, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5,
                                                max_seqlen_k=7, return_lse=True, impl="reference")
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    for bad in (torch.randn(4, 2, 8), q2.double(), torch.randn(5, 2, 16)[..., ::2]):
        with pytest.raises(ValueError, match="q must match the validated call's q"):
            call.with_q(bad)
    merge = ops.prepare_merge_state(o, lse, o, lse, impl="reference")
    with pytest.raises(ValueError, match="o_a / o_b must be"):
        ops.run_merge_state(merge, o[:3], lse[:3], o[:3], lse[:3])
    with pytest.raises(ValueError, match="lse_b must be float32"):
        ops.prepare_merge_state(o, lse, o, lse.double(), impl="reference")
