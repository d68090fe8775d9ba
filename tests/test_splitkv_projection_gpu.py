"""Split-KV with MLA's output projection fused into its combine (``ops.splitkv_mla_with_kvcache(w_uv=)``) on the GPU.

The fused path is a switch, off by default (``KernelConfig.fused_projection``): every fused call here plans its
schedule with the measured table's config for the shape, the switch turned on (``_fused``); the unfused path is the
same table config as it ships. The combine's programs of one (request, token, head) row each project their block of
o_lat's columns; the last of them to arrive (a per-row counter, zeroed by phase 1) sums the shares in order. What can go wrong there — a share read
before it is visible, a counter left from another call — shows as a wrong row, so every case checks every row:
against the fp64 oracle (attention, then ``o_lat @ w_uv[h]`` in fp64) with the precision-derived tolerance of the
split-KV GPU tests, against the unfused path (the combine, then ``ops.head_matmul``), and bit for bit across
repeated calls and graph replays. Caches are poisoned past each sequence's end (``test_splitkv_gpu.build``).
"""

from __future__ import annotations

import pytest
import torch

from ops_cases import cosine
from test_splitkv_gpu import BF16, DEV, R, build, capture, oracle_and_lowp, run_splitkv

from mla_fa3 import ops
from mla_fa3.ops import Impl, KernelConfig
from mla_fa3.ops.splitkv_config import FUSED_PROJECTION_MAX_TOKENS, choose_config

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu
D_V = 128  # DeepSeek-V3's value head


def _w_uv(heads: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, R, D_V, generator=g) / R ** 0.5).to(BF16).to(DEV)


def _fused(heads: int, lens, fp8=False) -> KernelConfig:
    """The table's config for the shape (what a schedule planned without one gets) with the projection fused in."""
    return choose_config(heads, len(lens), max(lens), kv_fp8=fp8 == "kv").with_(fused_projection=True)


def _projected(o_lat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o_lat [bs, sq, H, R] -> [bs, sq, H, D_V] in o_lat's dtype (fp64 oracle, or bf16 rounded like the op)."""
    return torch.einsum("bshr,hrn->bshn", o_lat.double(), w.double().cpu()).to(o_lat.dtype)


def _check(out, want64, lowp64, plain):
    """out: the fused op; want64: the oracle; lowp64: torch bf16 attention, projected; plain: the unfused op."""
    assert torch.isfinite(out).all(), "a row holds NaN/inf (a share summed before it was written?)"
    err = (out.double().cpu() - want64).abs().max().item()
    err_lowp = (lowp64 - want64).abs().max().item()
    assert err <= 2 * err_lowp + 1e-3, f"fused error {err:.3g} > 2 x torch-bf16 error {err_lowp:.3g}"
    assert cosine(out, plain) >= 0.9999
    # the unfused path rounds the same o_lat to bf16 and sums in another order: within bf16's rounding of the output
    torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2 ** -7)


# name -> (lens, sq, heads, page, fp8): every request count up to the fused limit, verify, page 1 / 16 / 64, an empty
# request, 128 heads (the wide combine tile), an e4m3 cache read by a bf16 q
CASES = {
    "h16_bs1_64k": ((65536,), 1, 16, 64, False),
    "h16_bs4_page1_mixed": ((1, 63, 65, 16384), 1, 16, 1, False),
    "h16_bs8_page16_empty": ((0, 1, 17, 100, 1000, 4097, 9000, 20000), 1, 16, 16, False),
    "h16_verify_sq2": ((2, 65, 4097), 2, 16, 64, False),
    "h128_bs2": ((3000, 16384), 1, 128, 64, False),
    "h128_verify_sq4": ((4, 2000), 4, 128, 64, False),
    "h16_e4m3_cache_bs2": ((33, 20000), 1, 16, 64, "kv"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_projection_matches_oracle_and_unfused_path(name):
    lens, sq, heads, page, fp8 = CASES[name]
    assert len(lens) * sq <= FUSED_PROJECTION_MAX_TOKENS
    q, kv, table, seqlens, dense, extra = build(lens, sq, heads, page, fp8=fp8)
    w = _w_uv(heads)
    fused = _fused(heads, lens, fp8)
    out, lse = run_splitkv(q, kv, table, seqlens, page=page, w_uv=w, config=fused, **extra)
    assert ops.last_impl() is Impl.TRITON and out.shape == (len(lens), sq, heads, D_V) and out.dtype == BF16
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    plain, plain_lse = run_splitkv(q, kv, table, seqlens, page=page, w_uv=w,
                                   config=fused.with_(fused_projection=False), **extra)
    _check(out, _projected(ref_out, w), _projected(lowp.double(), w), plain)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~finite)
    assert (lse.cpu()[finite].double() - ref_lse[finite]).abs().max() <= 2e-3
    for _ in range(3):  # the shares are summed in column-block order whoever arrives last: bit for bit every time
        again, again_lse = run_splitkv(q, kv, table, seqlens, page=page, w_uv=w, config=fused, **extra)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


def test_more_tokens_than_the_limit_run_the_projection_after_the_combine():
    lens = tuple(range(100, 100 + 300 * (FUSED_PROJECTION_MAX_TOKENS + 1), 300))
    q, kv, table, seqlens, dense, _ = build(lens, 1, 16, 64, seed=4)
    w = _w_uv(16)
    out, _ = run_splitkv(q, kv, table, seqlens, page=64, w_uv=w, config=_fused(16, lens))
    ref_out, _, lowp = oracle_and_lowp(dense)
    o_lat, _ = run_splitkv(q, kv, table, seqlens, page=64)
    _check(out, _projected(ref_out, w), _projected(lowp.double(), w), ops.head_matmul(
        o_lat.view(-1, 16, R), w).view(out.shape))


def test_graph_of_many_layers_replays_with_new_lengths():
    """Twenty fused calls in one CUDA graph (as a model's layers: each call's counters are scratch phase 1 zeroes),
    replayed with new lengths copied into the captured schedule: every call's output is the eager op's (the same
    schedule, so fused too), bit for bit."""
    max_lens, heads, page, layers = (9000, 4097, 700), 16, 64, 20
    q, kv, table, _, _, _ = build(max_lens, 1, heads, page, seed=5)
    seqlens = torch.tensor(max_lens, dtype=torch.int32, device=DEV)
    sched = ops.get_splitkv_schedule(list(max_lens), num_heads=heads, page_size=page, device=DEV, max_batch=3,
                                     config=_fused(heads, max_lens))
    assert sched.config.fused_projection
    ws = [_w_uv(heads, seed=s) for s in range(layers)]
    kw = dict(head_dim_v=R, schedule=sched, softmax_scale=0.1, causal=True, impl="triton")
    graph, outs = capture(lambda: [ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, w_uv=w, **kw)[0] for w in ws])
    for lens in ((9000, 1, 65), (1, 1, 1), (0, 4097, 64), (9000, 4097, 700)):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        sched.copy_(ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, config=sched.config))
        graph.replay()
        torch.cuda.synchronize()
        for w, out in zip(ws, outs):
            eager, _ = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, w_uv=w, **kw)
            assert torch.equal(out, eager), f"lengths {lens}"
