"""FA3 with its tile schedule planned once (``ops.get_fa3_schedule``) on the H200: the same attention as without.

The schedule only replaces the scheduler kernel FA3 launches in every call, so a call with it must return
exactly what the same call without it returns (bitwise: same splits, same kernels) and meet the precision
bound of ``test_ops_gpu.py`` against the fp64 oracle. Cases: the named op table, and DeepSeek-V3 latent dims
at 16 / 128 heads with pages 1 / 16 / 64, one or two query tokens, lengths 1, page +- 1 and up to 5000, every
unused slot poisoned; several calls on one schedule (FA3's tile counter must be reset between them); and a
CUDA graph that plans the schedule inside the graph and replays with new lengths.
"""

from __future__ import annotations

import pytest
import torch

from ops_cases import OP_SPECS, Spec, build_case, check, oracle
from test_ops_gpu import GPU_SPECS, _lowp_case
from test_splitkv_gpu import capture

from mla_fa3 import ops
from mla_fa3.ops import Impl

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


def _schedule(case, impl="fa3", num_splits=0) -> ops.FA3Schedule:
    kw, q = case.kwargs, case.q
    return ops.get_fa3_schedule(
        kw["cache_seqlens"], kw["page_table"], page_size=case.k_cache.shape[1], num_heads=q.shape[-2],
        num_heads_k=case.k_cache.shape[2], head_dim=q.shape[-1], head_dim_v=case.v_cache.shape[-1], dtype=q.dtype,
        max_seqlen_q=kw.get("max_seqlen_q") or q.shape[1], cu_seqlens_q=kw.get("cu_seqlens_q"), causal=kw["causal"],
        window_size=kw["window_size"], softcap=kw["softcap"], num_splits=num_splits, impl=impl)


def _same_with_and_without(case, calls: int = 3, num_splits: int = 0):
    args = (case.q, case.k_cache, case.v_cache)
    kw = dict(case.kwargs, num_splits=num_splits, return_lse=True, impl="fa3")
    out0, lse0 = ops.flash_attn_with_kvcache(*args, **kw)
    sched = _schedule(case, num_splits=num_splits)
    assert sched.impl is Impl.FA3 and sched.scheduler_metadata is not None and sched.scheduler_metadata.is_cuda
    for _ in range(calls):
        out, lse = ops.flash_attn_with_kvcache(*args, **kw, schedule=sched)
        assert torch.equal(out, out0) and torch.equal(lse, lse0), "a planned schedule changed FA3's result"
    return out, lse


@pytest.mark.parametrize("name", GPU_SPECS)
def test_op_table_with_schedule_equals_without_and_the_oracle(name):
    case = build_case(OP_SPECS[name], device=DEV, dtype=BF16)
    out, lse = _same_with_and_without(case)
    ref_impl, _ = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True,
                                              impl="reference")
    check(out, lse, *oracle(case), _lowp_case(case), ref_impl)


def _latent_spec(heads: int, page: int, k: int, lens: tuple) -> Spec:
    return Spec(lens=lens, new=(k,) * len(lens), heads=heads, kv_heads=1, d=64, dv=512, mla=True, page_size=page,
                scale=192 ** -0.5)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("k", [1, 2])
def test_deepseek_latent_with_schedule_equals_without_and_the_oracle(heads, page, k):
    lens = (k, page + 1, max(page - 1, k), 5000, 2049)[: 5 if heads == 16 else 3]
    case = build_case(_latent_spec(heads, page, k, lens), device=DEV, dtype=BF16, seed=heads + page + k)
    out, lse = _same_with_and_without(case)
    ref_impl, _ = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True,
                                              impl="reference")
    check(out, lse, *oracle(case), _lowp_case(case), ref_impl)


@pytest.mark.parametrize("bs", [1, 2])
def test_split_cap_with_schedule_equals_without_and_the_oracle(bs):
    """The backend's split count at 128 heads, bs <= 2 (policy.decode_kernel.fa3_num_splits), planned and asked."""
    from mla_fa3.policy.decode_kernel import fa3_num_splits

    splits = fa3_num_splits(128, bs)
    assert splits > 0
    case = build_case(_latent_spec(128, 64, 1, (5000, 64)[:bs]), device=DEV, dtype=BF16, seed=bs)
    out, lse = _same_with_and_without(case, num_splits=splits)
    ref_impl, _ = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True,
                                              impl="reference")
    check(out, lse, *oracle(case), _lowp_case(case), ref_impl)


def test_schedule_planned_inside_a_graph_follows_new_lengths():
    """Plan + three calls captured once; each replay with other lengths equals eager FA3 without a schedule."""
    bs, heads, page, cap = 4, 128, 64, 4096
    spec = _latent_spec(heads, page, 1, (cap,) * bs)
    case = build_case(spec, device=DEV, dtype=BF16, seed=5)
    lens = case.kwargs["cache_seqlens"]
    args = (case.q, case.k_cache, case.v_cache)

    def step():
        sched = _schedule(case)
        return [ops.flash_attn_with_kvcache(*args, **case.kwargs, schedule=sched, impl="fa3") for _ in range(3)]

    graph, outs = capture(step)
    for new in ([1, 64, 65, 4096], [4000, 3, 129, 2], [2048] * 4):
        lens.copy_(torch.tensor(new, dtype=torch.int32))  # the cache holds valid rows up to cap for every request
        graph.replay()
        want = ops.flash_attn_with_kvcache(*args, **case.kwargs, impl="fa3")
        for out in outs:
            assert torch.equal(out, want), f"graph replay with lengths {new} differs from eager FA3"
