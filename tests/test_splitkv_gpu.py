"""Split-KV Triton MLA decode on the H200: against the fp64 oracle, the torch reference, FA3 and FlashMLA.

Caches are adversarial: shuffled page ids, ``BAD_PAGE`` in unused page-table entries, and large finite
garbage (``POISON``) in every slot past a sequence's end and in every unused page — finite because FA3 and
FlashMLA read whole pages and multiply the tail by a zero probability (0 · NaN = NaN); our kernel never
loads past ``cache_seqlens``, so garbage that reached its output would show as a large error.
Tolerances come from precision (``test_ops_gpu.check``):
    err(kernel vs fp64 oracle) <= 2 · err(plain torch bf16 attention vs fp64 oracle) + 1e-4
plus cosine >= 0.9999 against the torch reference on the same inputs and LSE within 2e-3 (natural log).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from mla_cases import capture_layer_graph, follow_up, make_mla_case, padded
from ops_cases import BAD_PAGE, check, cosine
from specs import SPECS, BatchSpec

from mla_fa3 import ops
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.ops import Impl, KernelConfig
from mla_fa3.ops import fp8 as fp8_ref
from mla_fa3.ops import splitkv_plan as sp
from mla_fa3.ops.splitkv_config import choose_config

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16, F8 = torch.bfloat16, torch.float8_e4m3fn
R, D_ROPE = 512, 64  # DeepSeek-V3 latent
D = R + D_ROPE
SCALE = (128 + D_ROPE) ** -0.5
POISON = 3.0e3


def build(lens, sq, heads, page, *, fp8=False, seed=0):
    """q [bs, sq, H, 576], kv [pages, page, 1, 576] (poisoned outside the live slots), table, lens, dense, extra.

    fp8 True: e4m3 q and cache with both descales; "kv": an e4m3 cache (descale_k) read with a bf16 q."""
    g = torch.Generator().manual_seed(seed)
    dtype = F8 if fp8 else BF16
    need = [math.ceil(L / page) for L in lens]
    num_pages = sum(need) + 4
    ids = torch.randperm(num_pages, generator=g).tolist()
    poison = torch.finfo(F8).max if fp8 else POISON  # e4m3 has no value as large as 3e3 (it would be NaN)
    kv = torch.full((num_pages, page, 1, D), poison, dtype=dtype)
    table = torch.full((len(lens), max(need + [0]) + 2), BAD_PAGE, dtype=torch.int32)
    dq, dk = (torch.rand(2, generator=g) + 0.5) if fp8 else (torch.ones(1), torch.ones(1))
    dq = dq if fp8 is True else torch.ones(1)
    q = torch.randn(len(lens), sq, heads, D, generator=g).to(F8 if fp8 is True else BF16)
    dense = []
    for b, L in enumerate(lens):
        kv_b = torch.randn(L, 1, D, generator=g).to(dtype)
        rows = kv_b.new_full((need[b] * page, 1, D), poison)
        rows[:L] = kv_b
        pages = [ids.pop() for _ in range(need[b])]
        table[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        if need[b]:
            kv[pages] = rows.view(need[b], page, 1, D)
        dense.append((q[b].float() * dq, kv_b.float() * dk))
    extra = dict(descale_k=dk.view(1).float().to(DEV)) if fp8 else {}
    if fp8 is True:
        extra["descale_q"] = dq.view(1).float().to(DEV)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q.to(DEV), kv.to(DEV), table.to(DEV), lens_t, dense, extra


def _attend(q, kv, dtype):
    """One request, one latent KV head, bottom-right causal, in ``dtype`` on the GPU (no per-head K copies).

    q [n, H, 576], kv [L, 1, 576] -> (out [n, H, 512], lse [n, H]); float64: the oracle, bf16: the
    precision baseline (scores, softmax and P·V each rounded to bf16, like ``test_ops_gpu.torch_lowp``).
    """
    q, kv = q.to(DEV, dtype), kv[:, 0].to(DEV, dtype)
    n, L = q.shape[0], kv.shape[0]
    s = torch.einsum("nhd,ld->hnl", q, kv) * SCALE
    visible = torch.arange(L, device=DEV)[None, :] <= torch.arange(L - n, L, device=DEV)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s.double(), dim=-1).transpose(0, 1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnl,ld->nhd", p, kv[:, :R]).cpu(), lse.cpu()


def oracle_and_lowp(dense):
    """(fp64 out, fp64 lse, torch-bf16 out) stacked over requests, cpu."""
    oracle = [_attend(q_b, kv_b, torch.float64) for q_b, kv_b in dense]
    lowp = [_attend(q_b, kv_b, BF16)[0] for q_b, kv_b in dense]
    return torch.stack([o for o, _ in oracle]), torch.stack([l for _, l in oracle]), torch.stack(lowp)


def run_splitkv(q, kv, table, lens, *, page, schedule=None, config=None, **extra):
    if schedule is None:
        schedule = ops.get_splitkv_schedule(lens.cpu(), num_heads=q.shape[2], num_q_tokens=q.shape[1],
                                            page_size=page, device=DEV, config=config)
    return ops.splitkv_mla_with_kvcache(q, kv, table, lens, head_dim_v=R, schedule=schedule, softmax_scale=SCALE,
                                        causal=True, impl="triton", **extra)


def run_reference(q, kv, table, lens, **extra):
    sched = ops.get_splitkv_schedule(lens.cpu(), num_heads=q.shape[2], page_size=kv.shape[1])
    return ops.splitkv_mla_with_kvcache(q, kv, table, lens, head_dim_v=R, schedule=sched.to(DEV),
                                        softmax_scale=SCALE, causal=True, impl="reference", **extra)


# name -> (lens, sq, heads, page): lengths 0, 1, page ± 1, L < sq, 128k; 16 and 128 heads; verify sq 2 / 4
CASES = {
    "page1_decode_h16": ((1, 2, 63, 65, 1000), 1, 16, 1),
    "page16_decode_h128": ((1, 15, 17, 3000), 1, 128, 16),
    "page64_decode_h16_empty_request": ((0, 1, 63, 64, 65, 5000), 1, 16, 64),
    "page64_verify_sq2_h16": ((2, 63, 65, 4097), 2, 16, 64),
    "page64_verify_sq2_h128": ((2, 129, 3000), 2, 128, 64),
    "page64_verify_sq4_h128": ((4, 65, 2000), 4, 128, 64),
    "page16_verify_sq4_rows_without_keys": ((1, 3, 40), 4, 16, 16),
    "bs1_128k_h16": ((131072,), 1, 16, 64),
    "bs1_128k_h128": ((131072,), 1, 128, 64),
    "bs4_16k_h16_page1": ((16384, 16383, 1, 16385), 1, 16, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_splitkv_matches_oracle_reference_fa3_flashmla(name):
    lens, sq, heads, page = CASES[name]
    q, kv, table, seqlens, dense, _ = build(lens, sq, heads, page)
    out, lse = run_splitkv(q, kv, table, seqlens, page=page)
    assert ops.last_impl() is Impl.TRITON
    assert out.dtype == BF16 and out.shape == (len(lens), sq, heads, R) and lse.shape == out.shape[:-1]
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)
    if min(lens) >= sq:  # FA3 (qv form, any page size) on the same cache
        fa, fa_lse = ops.flash_attn_with_kvcache(
            q[..., R:], kv[..., R:], kv[..., :R], qv=q[..., :R], page_table=table, cache_seqlens=seqlens,
            softmax_scale=SCALE, causal=True, return_lse=True, impl="fa3")
        check(fa, fa_lse, ref_out, ref_lse, lowp, ref_impl)
        assert cosine(out, fa) >= 0.9999
    if page == 64 and sq <= 2 and min(lens) >= sq:  # FlashMLA (page 64 only)
        sched = ops.get_mla_decode_metadata(seqlens, heads * sq, impl="fa3")
        fm, fm_lse = ops.flash_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=sched,
                                                softmax_scale=SCALE, causal=True, return_lse=True, impl="fa3")
        check(fm, fm_lse, ref_out, ref_lse, lowp, ref_impl)
        assert cosine(out, fm) >= 0.9999


# every kernel switch: one page id per block (page >= block_n) or per key, half-precision partials, the tile
# loaded once or twice, 16-key blocks, 16 warps, registers capped; blocks spanning a request's end
SWITCHES = {
    "n16_half_reload": KernelConfig(block_n=16, num_warps=4, num_stages=4, half_partials=True, reload_kv=True),
    "n32_w2_half": KernelConfig(block_n=32, num_warps=2, num_stages=3, waves=3.0, half_partials=True),
    "n64_w16_reload": KernelConfig(block_n=64, num_warps=16, num_stages=2, reload_kv=True),
    "n32_w8_m32_half": KernelConfig(block_n=32, num_warps=8, num_stages=3, max_rows=32, half_partials=True),
    "n32_s2_reg128_half": KernelConfig(block_n=32, num_warps=4, num_stages=2, waves=4.0, half_partials=True,
                                       max_registers=128),
    # q·kᵀ as 2 or 4 independent dots over latent chunks (P·V and the output chunked alike)
    "n32_s3_half_chunks2": KernelConfig(block_n=32, num_stages=3, half_partials=True, latent_chunks=2),
    "n32_s3_half_chunks4": KernelConfig(block_n=32, num_stages=3, half_partials=True, latent_chunks=4),
    "n16_w8_reload_chunks4": KernelConfig(block_n=16, num_warps=8, num_stages=4, reload_kv=True, latent_chunks=4),
    # the next block's page id read ahead under wgmma (128 heads: 64-row programs), and not read ahead under mma.sync
    "n32_w8_s3_prefetch_wide": KernelConfig(block_n=32, num_warps=8, num_stages=3, waves=1.0, prefetch_pages=True),
    "n32_s3_half_no_prefetch": KernelConfig(block_n=32, num_stages=3, half_partials=True, prefetch_pages=False),
}


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_splitkv_kernel_switches(name, page):
    lens, heads = (1, 31, 65, 4097, 127), (128 if "w16" in name or "wide" in name else 16)
    q, kv, table, seqlens, dense, _ = build(lens, 2, heads, page, seed=7)
    out, lse = run_splitkv(q, kv, table, seqlens, page=page, config=SWITCHES[name])
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)


@pytest.mark.parametrize("heads", [16, 128])
def test_splitkv_fp8_latent_with_descales(heads):
    lens, page = (1, 65, 3000), 64
    q, kv, table, seqlens, dense, extra = build(lens, 1, heads, page, fp8=True, seed=3)
    out, lse = run_splitkv(q, kv, table, seqlens, page=page, **extra)
    assert out.dtype == BF16
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens, **extra)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)  # e4m3 -> fp16 is exact: as precise as bf16
    sched = ops.get_mla_decode_metadata(seqlens, heads, is_fp8=True, impl="fa3")
    fm = ops.flash_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                    causal=True, impl="fa3", **extra)
    assert cosine(out, fm) >= 0.999  # FlashMLA runs P·V in e4m3


# an e4m3 cache under < 64 rows (its tile converted to fp16 per dot operand): key blocks of 16 / 32 / 64 over 4 or 8
# warps, e4m3 or bf16 q, one query token or verify with two
E4M3_READS = {
    "n32_w4_bf16q": (KernelConfig(block_n=32, num_stages=3, half_partials=True), "kv", 1),
    "n32_w8_bf16q": (KernelConfig(block_n=32, num_warps=8, num_stages=3, waves=4.0, half_partials=True), "kv", 1),
    "n16_w4_e4m3q": (KernelConfig(block_n=16, num_stages=4), True, 1),
    "n16_w8_e4m3q_verify_sq2": (KernelConfig(block_n=16, num_warps=8, num_stages=4), True, 2),
    "n16_w4_e4m3q_verify_sq2": (KernelConfig(block_n=16, num_warps=4, num_stages=4), True, 2),
    "n64_w8_bf16q_verify_sq2": (KernelConfig(block_n=64, num_warps=8, num_stages=2, waves=1.0), "kv", 2),
    "n32_s2_reg168_bf16q": (KernelConfig(block_n=32, num_stages=2, waves=3.0, half_partials=True, max_registers=168),
                            "kv", 1),
    "n32_w4_bf16q_chunks2": (KernelConfig(block_n=32, num_stages=3, half_partials=True, latent_chunks=2), "kv", 1),
    "n32_w4_bf16q_chunks4_verify_sq2": (KernelConfig(block_n=32, num_stages=3, latent_chunks=4), "kv", 2),
    "n16_w4_e4m3q_chunks4": (KernelConfig(block_n=16, num_stages=4, latent_chunks=4), True, 1),
}


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("name", list(E4M3_READS))
def test_splitkv_e4m3_cache_configs(name, page):
    config, fp8, sq = E4M3_READS[name]
    lens = (sq, page + 1, max(page - 1, sq), 2049, 5000)
    q, kv, table, seqlens, dense, extra = build(lens, sq, 16, page, fp8=fp8, seed=12)
    out, lse = run_splitkv(q, kv, table, seqlens, page=page, config=config, **extra)
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens, **extra)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_splitkv_fp8_cache_bf16_query(heads, page):
    """An e4m3 cache read with a bf16 q (dequantized in registers, q never rounded to e4m3): the fp64 oracle on the
    dequantized cache, with poisoned slots past each end and in unused pages; lengths 1, page ± 1, 3000."""
    lens = (1, page + 1, max(page - 1, 1), 3000)
    q, kv, table, seqlens, dense, extra = build(lens, 1, heads, page, fp8="kv", seed=4)
    assert q.dtype == BF16 and kv.dtype == F8 and set(extra) == {"descale_k"}
    out, lse = run_splitkv(q, kv, table, seqlens, page=page, **extra)
    assert out.dtype == BF16
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens, **extra)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)
    if page == 64:  # FlashMLA refuses a bf16 q on an e4m3 cache, before any kernel
        sched = ops.get_mla_decode_metadata(seqlens, heads, impl="fa3")
        with pytest.raises(ValueError, match="^kv_cache is torch.float8_e4m3fn but q is torch.bfloat16"):
            ops.flash_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                       causal=True, impl="fa3", **extra)


def capture(step):
    """``(graph, step())`` — ``step`` run once on a side stream first (Triton compiles outside the capture), then
    captured in a CUDA graph on the current stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def test_graph_replay_follows_new_lengths_and_schedules():
    """Capture once with a max_batch schedule; replay with new lengths (and a shorter plan) copied in place."""
    max_lens, heads, page = (9000, 4097, 700), 16, 64
    q, kv, table, _, dense_max, _ = build(max_lens, 1, heads, page, seed=5)
    seqlens = torch.tensor(max_lens, dtype=torch.int32, device=DEV)
    sched = ops.get_splitkv_schedule(list(max_lens), num_heads=heads, page_size=page, device=DEV, max_batch=3)
    graph_kw = dict(head_dim_v=R, schedule=sched, softmax_scale=SCALE, causal=True, impl="triton")
    graph, (out, lse) = capture(lambda: ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, **graph_kw))
    for lens, planned in [((9000, 1, 65), 3), ((1, 1, 1), 3), ((0, 4097, 64), 3), ((8000, 64, 700), 2),
                          ((9000, 4097, 700), 3)]:
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        sched.copy_(ops.get_splitkv_schedule(list(lens[:planned]), num_heads=heads, page_size=page,
                                             config=sched.config))
        graph.replay()
        torch.cuda.synchronize()
        dense = [(q_b, kv_b[:L]) for (q_b, kv_b), L in zip(dense_max, lens)]
        ref_out, ref_lse, lowp = oracle_and_lowp(dense)
        eager, eager_lse = run_splitkv(q, kv, table, seqlens, page=page, config=sched.config)
        live = slice(0, planned)
        assert torch.equal(out[live], eager[live]) and torch.equal(lse[live], eager_lse[live])
        ref_impl, _ = run_reference(q, kv, table, seqlens)
        check(out[live], lse[live], ref_out[live], ref_lse[live], lowp[live], ref_impl[live])
        if planned < 3:  # a request past the plan: no split, out 0 and lse -inf
            assert (out[planned:] == 0).all() and torch.isneginf(lse[planned:]).all()


def test_device_planner_in_a_graph_follows_new_lengths():
    """The Triton planner captured in the graph with the kernel: each replay plans from the lengths it is replayed
    with — exactly ``plan_splits`` of them — and the output matches the reference on the same cache."""
    max_lens, heads, page = (9000, 4097, 700), 16, 64
    q, kv, table, _, dense_max, _ = build(max_lens, 1, heads, page, seed=6)
    seqlens = torch.tensor(max_lens, dtype=torch.int32, device=DEV)
    sched = ops.get_splitkv_schedule(list(max_lens), num_heads=heads, page_size=page, device=DEV, max_batch=3)
    graph_kw = dict(head_dim_v=R, schedule=sched, softmax_scale=SCALE, causal=True, impl="triton")

    def step():
        ops.replan_splitkv_schedule(seqlens, sched, impl="triton")
        return ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, **graph_kw)

    graph, (out, lse) = capture(step)
    for lens in [(9000, 1, 65), (1, 1, 1), (0, 4097, 64), (8000, 64, 700), (9000, 4097, 700)]:
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        work, offsets, _ = sp.plan_splits(list(lens), target=sched.target, granule=sched.granule,
                                          min_split_tokens=sched.min_split_tokens)
        assert sched.num_work.item() == len(work) and sched.split_offsets.tolist() == offsets
        assert sched.work[: len(work)].tolist() == [list(r) for r in work]
        dense = [(q_b, kv_b[:L]) for (q_b, kv_b), L in zip(dense_max, lens)]
        ref_out, ref_lse, lowp = oracle_and_lowp(dense)
        ref_impl, _ = run_reference(q, kv, table, seqlens)
        check(out, lse, ref_out, ref_lse, lowp, ref_impl)


@pytest.mark.parametrize("fp8", [False, "kv"])
def test_the_even_cut_in_a_graph_reads_what_the_oracle_reads(fp8):
    """``KernelConfig.even_splits``: splits on 32-key blocks (half of them start mid-page), re-planned on the device
    inside a captured graph for each replay's lengths — exactly ``plan_splits(even=True)`` — and the output within the
    oracle's tolerance, over a bf16 and an e4m3 cache (NaN in every slot past each end)."""
    max_lens, heads, page = (70000, 4097, 700, 65), 16, 64
    q, kv, table, _, dense_max, extra = build(max_lens, 1, heads, page, fp8=fp8, seed=21)
    seqlens = torch.tensor(max_lens, dtype=torch.int32, device=DEV)
    config = KernelConfig(block_n=32, num_stages=3, half_partials=True, latent_chunks=2 if fp8 else 4,
                             even_splits=True)
    sched = ops.get_splitkv_schedule(list(max_lens), num_heads=heads, page_size=page, device=DEV, max_batch=4,
                                     config=config, kv_fp8=bool(fp8))
    assert sched.granule == 32
    graph_kw = dict(head_dim_v=R, schedule=sched, softmax_scale=SCALE, causal=True, impl="triton", **extra)

    def step():
        ops.replan_splitkv_schedule(seqlens, sched, impl="triton")
        return ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, **graph_kw)

    graph, (out, lse) = capture(step)
    for lens in [(70000, 4097, 700, 65), (69999, 33, 1, 64)]:  # each request within the pages it was built with
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        work, offsets, _ = sp.plan_splits(list(lens), target=sched.target, granule=32,
                                          min_split_tokens=sched.min_split_tokens, even=True)
        assert sched.work[: len(work)].tolist() == [list(r) for r in work] and sched.split_offsets.tolist() == offsets
        assert any(s % 64 for _, s, _, _ in work)
        dense = [(q_b, kv_b[:L]) for (q_b, kv_b), L in zip(dense_max, lens)]
        ref_out, ref_lse, lowp = oracle_and_lowp(dense)
        ref_impl, _ = run_reference(q, kv, table, seqlens, **extra)
        check(out, lse, ref_out, ref_lse, lowp, ref_impl)


@pytest.mark.parametrize("half", [True, False])
def test_discarding_the_partials_changes_no_bit(half):
    """``KernelConfig.discard_partials``: the combine drops the partial lines it read from the L2 once it has read them
    (behind a barrier); the step's out and lse are the same bits as without, step after step in a captured graph
    (a line discarded before some program read it would make them differ), and within the oracle's tolerance."""
    lens, heads, page = (70000, 1, 4097, 65), 16, 64
    q, kv, table, seqlens, dense, extra = build(lens, 1, heads, page, seed=23)
    from mla_fa3.ops.splitkv_combine_triton import discards_partials

    outs = []
    for discard in (False, True):
        config = choose_config(heads, 4, 65536).with_(half_partials=half, discard_partials=discard)
        sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV, config=config)
        kw = dict(head_dim_v=R, schedule=sched, softmax_scale=SCALE, causal=True, impl="triton")
        graph, (out, lse) = capture(lambda: ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, **kw))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs.append((out.clone(), lse.clone()))
    assert discards_partials(torch.empty(8, 1, heads, R, dtype=BF16 if half else torch.float32, device=DEV), 64)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens)
    check(outs[1][0], outs[1][1], ref_out, ref_lse, lowp, ref_impl)


def test_the_device_planner_fits_as_the_host_does():
    """The fit (``splitkv_plan``'s module docstring) compiled for this GPU: captured with the largest batch, each
    replay's Triton plan of long requests (where chunk0 would cut more splits than the target) and of mixed batches
    (where the rounds' model keeps chunk0 or takes the fit) is exactly ``plan_splits`` of the same lengths."""
    cases = [[65536] * 16, [16384] * 64, [65536] * 4 + [100] * 20, [100] * 20 + [65536] * 4, [9000, 12000, 15000, 20000]]
    sched = ops.get_splitkv_schedule([65536] * 64, num_heads=16, page_size=64, device=DEV, max_batch=64)
    seqlens = torch.zeros(64, dtype=torch.int32, device=DEV)
    graph, _ = capture(lambda: ops.replan_splitkv_schedule(seqlens, sched, impl="triton"))
    fitted = 0
    for lens in cases:
        padded = lens + [0] * (64 - len(lens))
        seqlens.copy_(torch.tensor(padded, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        work, offsets, chunk = sp.plan_splits(padded, target=sched.target, granule=sched.granule,
                                              min_split_tokens=sched.min_split_tokens)
        assert sched.num_work.item() == len(work) and sched.split_offsets.tolist() == offsets, lens[:4]
        assert sched.work[: len(work)].tolist() == [list(r) for r in work], lens[:4]
        g = sched.granule
        fitted += chunk != g * -(-max(sched.min_split_tokens, -(-sum(lens) // sched.target)) // g)
    assert fitted >= 2, "no case took the fit"


@pytest.mark.parametrize("fp8", [False, "kv"])
def test_programmatic_dependent_launch_changes_nothing(fp8):
    """With PDL (the table's choice at 16 heads) phase 1 is launched while the kernel before it still runs and the
    combine while phase 1 does. In a graph whose first kernel writes q, every replay — with a new q each time — equals
    the in-order launches bit for bit (a phase 1 that read q before it was written would differ), and the oracle."""
    lens, heads, page = (9000, 1, 4097, 65), 16, 64
    q_src, kv, table, seqlens, dense, extra = build(lens, 1, heads, page, fp8=fp8, seed=8)
    on = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV)
    off = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV,
                                   config=on.config.with_(pdl=False))
    assert on.config.pdl and on.planned_work == off.planned_work > len(lens)
    factor = torch.ones(1, dtype=BF16, device=DEV)
    q = torch.empty_like(q_src)
    kw = dict(head_dim_v=R, softmax_scale=SCALE, causal=True, impl="triton", **extra)

    def step():
        torch.mul(q_src, factor, out=q)  # the kernel before phase 1 writes its q
        return ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=on, **kw)

    graph, (out, lse) = capture(step)
    for f in (1.0, -0.5, 2.0, 1.0):
        factor.fill_(f)
        graph.replay()
        torch.cuda.synchronize()
        in_order, in_order_lse = ops.splitkv_mla_with_kvcache(q_src * factor, kv, table, seqlens, schedule=off, **kw)
        assert torch.equal(out, in_order) and torch.equal(lse, in_order_lse), f"factor {f}"
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q_src, kv, table, seqlens, **extra)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)


def check_against_the_pool(out, lse, q, kv, table, seqlens, lens, extra):
    """``out`` / ``lse`` of q over the pool's rows as they are now (an e4m3 pool descaled): the fp64 oracle's, within
    the precision tolerance, and the torch reference's."""
    page, flat = kv.shape[1], kv.view(-1, D).cpu()
    scale = extra["descale_k"].cpu() if "descale_k" in extra else 1.0
    dense = []
    for b, L in enumerate(lens):
        keys = torch.arange(L)
        at = table[b].cpu()[keys // page].long() * page + keys % page
        dense.append((q[b].float().cpu(), flat[at].float().unsqueeze(1) * scale))
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens, **extra)
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)


@pytest.mark.parametrize("fp8", [False, "kv"])
def test_a_prologue_read_while_the_store_runs_sees_the_stored_rows(fp8):
    """``follows_store``: phase 1 reads its schedule row, lengths, q and first page ids while the pool store before
    it still runs (the store lets it launch at its start), and waits for the store only before its key tiles. In a
    graph of [write q, store each request's newest row, split-KV], every replay — new q and new rows each time —
    equals the in-order launches bit for bit and the fp64 oracle over the pool's rows as stored (a phase 1 that read
    a row or q too early would differ)."""
    lens, heads, page = (9000, 1, 4097, 65), 16, 64
    q_src, kv, table, seqlens, _, extra = build(lens, 1, heads, page, fp8=fp8, seed=11)
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV)
    off = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV,
                                   config=sched.config.with_(pdl=False))
    assert sched.config.pdl
    slots = torch.tensor([int(table[b, (L - 1) // page]) * page + (L - 1) % page for b, L in enumerate(lens)],
                         dtype=torch.int64, device=DEV)
    flat = kv.view(-1, D)
    rows = torch.empty(len(lens), D, dtype=BF16, device=DEV)
    factor = torch.ones(1, dtype=BF16, device=DEV)
    q = torch.empty_like(q_src)
    kw = dict(head_dim_v=R, softmax_scale=SCALE, causal=True, impl="triton", **extra)

    def step():
        torch.mul(q_src, factor, out=q)
        if fp8:
            ops.store_e4m3(flat, slots, rows, extra["descale_k"], impl="triton")
        else:
            ops.store_rows(flat, slots, rows, impl="triton")
        return ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=sched, follows_store=True, **kw)

    g = torch.Generator(device=DEV).manual_seed(12)
    rows.copy_(torch.randn(rows.shape, generator=g, device=DEV))
    graph, (out, lse) = capture(step)
    for f in (1.0, -0.5, 2.0):
        factor.fill_(f)
        rows.copy_(torch.randn(rows.shape, generator=g, device=DEV) * f)
        graph.replay()
        torch.cuda.synchronize()
        in_order, in_order_lse = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=off, **kw)
        assert torch.equal(out, in_order) and torch.equal(lse, in_order_lse), f"replay {f}"
        stored = flat[slots].float() * (extra["descale_k"] if fp8 else 1.0)
        want = rows.float() if not fp8 else fp8_ref.dequantize_e4m3(
            fp8_ref.quantize_e4m3(rows, extra["descale_k"]), extra["descale_k"], torch.float32)
        assert torch.equal(stored, want)  # the store wrote this replay's rows
        check_against_the_pool(out, lse, q, kv, table, seqlens, lens, extra)


@triton.jit
def _slow_store_kernel(Flat, Slots, Rows, spin_ns, D_: tl.constexpr, BLOCK: tl.constexpr):
    """A pool store that lets its dependents launch at its start (as ``ops.store_rows`` does) and then spins for
    ``spin_ns`` before it writes row i of ``Rows`` to slot ``Slots[i]`` of ``Flat`` [slots, D_] (any dtype)."""
    tl.extra.cuda.gdc_launch_dependents()
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < spin_ns:
        t = tl.extra.cuda.globaltimer()
    i = tl.program_id(0)
    slot = tl.load(Slots + i).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    tl.store(Flat + slot * D_ + cols, tl.load(Rows + i * D_ + cols, mask=cols < D_), mask=cols < D_)


@pytest.mark.parametrize("ws", [False, True], ids=["triton", "warp_specialized"])
@pytest.mark.parametrize("sq,fp8", [(1, False), (2, False), (1, "kv")])
def test_a_slow_store_is_waited_for_before_the_keys(sq, fp8, ws):
    """``follows_store`` with a store that takes 20 ms (launched before split-KV, letting it launch at its start):
    phase 1 reads its prologue while the store spins and must wait for it before its key tiles — the Triton kernel's
    programs, or the warp-specialized kernel's producer warp before its first TMA. The output is the fp64 oracle's
    over the rows as stored and equals the in-order launches bit for bit; a phase 1 that read a newest row before the
    store wrote it would see the old row there (a different one)."""
    lens, heads, page = (9000, 1, 4097, 65, 96), 16, 64
    q, kv, table, seqlens, _, extra = build(lens, sq, heads, page, fp8=fp8, seed=13)
    config = choose_config(heads, len(lens), max(lens), kv_fp8=bool(fp8))
    if ws:
        config = config.with_(block_n=64, waves=1.0, warp_specialized=True)
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, num_q_tokens=sq, page_size=page, device=DEV,
                                     config=config)
    off = ops.get_splitkv_schedule(list(lens), num_heads=heads, num_q_tokens=sq, page_size=page, device=DEV,
                                   config=sched.config.with_(pdl=False))
    assert sched.config.pdl and sched.planned_work > 2 * len(lens)
    # row b·sq + i of `rows` is key L_b - sq + i of request b; the store writes those >= 0
    keys = [(b, L - sq + i) for b, L in enumerate(lens) for i in range(sq)]
    live = [j for j, (_, p) in enumerate(keys) if p >= 0]
    slots = torch.tensor([int(table[b, p // page]) * page + p % page for b, p in (keys[j] for j in live)],
                         dtype=torch.int64, device=DEV)
    flat = kv.view(-1, D)
    g = torch.Generator().manual_seed(14)
    rows = torch.randn(len(keys), D, generator=g)
    rows = (fp8_ref.quantize_e4m3(rows, extra["descale_k"].cpu()) if fp8 else rows.to(BF16)).to(DEV)
    new = rows[live].contiguous()
    as_int = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t.view(torch.int16))  # the rows' bits
    assert (as_int(flat[slots]) != as_int(new)).any(1).all()  # every old row differs from its new one
    kw = dict(head_dim_v=R, softmax_scale=SCALE, causal=True, impl="triton", **extra)
    ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=sched, follows_store=True, **kw)  # compiled
    torch.cuda.synchronize()
    _slow_store_kernel[(len(live),)](as_int(flat), slots, as_int(new), 20_000_000, D_=D, BLOCK=1024,
                                     launch_pdl=False)
    out, lse = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=sched, follows_store=True, **kw)
    torch.cuda.synchronize()
    assert torch.equal(as_int(flat[slots]), as_int(new))  # the store wrote them
    in_order, in_order_lse = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=off, **kw)
    assert torch.equal(out, in_order) and torch.equal(lse, in_order_lse)
    check_against_the_pool(out, lse, q, kv, table, seqlens, lens, extra)


def test_the_probe_stamps_every_live_program_and_changes_no_bit():
    """``splitkv_partials(probe=)`` (the timeline ``benchmarks/splitkv_probe.py`` reads): every live program's row holds
    an SM of this GPU and start <= first key load <= end, ``%globaltimer`` nanoseconds within the launch's wall time;
    idle rows stay as they were; the partials are the same bits as without it."""
    from mla_fa3.ops import splitkv_triton as kt
    from mla_fa3.ops import validate

    lens, heads, page = (9000, 1, 4097, 65), 16, 64
    q, kv, table, seqlens, _, extra = build(lens, 1, heads, page, seed=15)
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV, max_batch=6)
    call = validate.check_splitkv(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                  causal=True, descale_q=None, descale_k=None, impl=Impl.TRITON)
    probe = torch.full((sched.capacity, 1, 4), -7, dtype=torch.int64, device=DEV)
    plain_o, plain_lse = kt.splitkv_partials(call, sched)
    torch.cuda.synchronize()
    before = time.time_ns()
    part_o, part_lse = kt.splitkv_partials(call, sched, probe=probe)
    torch.cuda.synchronize()
    wall = time.time_ns() - before
    n = sched.planned_work
    assert n < sched.capacity and torch.equal(part_o[:n], plain_o[:n]) and torch.equal(part_lse[:n], plain_lse[:n])
    stamps = probe.cpu()
    assert bool((stamps[n:] == -7).all()), "an idle program wrote its row"
    sm, start, keys, end = (stamps[:n, 0, i] for i in range(4))
    assert bool(((sm >= 0) & (sm < torch.cuda.get_device_properties(DEV).multi_processor_count)).all())
    assert bool(((start <= keys) & (keys <= end)).all()) and int(end.max() - start.min()) <= wall
    with pytest.raises(ValueError, match=r"^probe must be an int64 \["):
        kt.splitkv_partials(call, sched, probe=probe[:, :, :3])


def test_the_combine_probe_stamps_every_program_and_changes_no_bit():
    """``combine_splits(probe=)``, launched as the op launches it (a programmatic dependent of phase 1 where the GPU
    has them): every program's row holds an SM of this GPU and start <= first read <= end within the wall time of
    the two launches, its first read after phase 1's last program ended; out and lse are the same bits as without."""
    from mla_fa3.ops import splitkv_triton as kt
    from mla_fa3.ops import validate
    from mla_fa3.ops.pdl import pdl_capable
    from mla_fa3.ops.splitkv_combine_triton import combine_grid, combine_splits

    lens, heads, page = (9000, 1, 4097, 65), 16, 64
    q, kv, table, seqlens, _, extra = build(lens, 1, heads, page, seed=16)
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV, max_batch=6)
    call = validate.check_splitkv(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                  causal=True, descale_q=None, descale_k=None, impl=Impl.TRITON)
    pdl = sched.config.pdl and pdl_capable(q.device)
    outs = []
    for stamped in (False, True):
        probe1 = torch.full((sched.capacity, 1, 4), -1, dtype=torch.int64, device=DEV)
        probe2 = torch.full(combine_grid(len(lens) * heads, R) + (4,), -7, dtype=torch.int64, device=DEV)
        out = torch.empty(len(lens), 1, heads, R, dtype=q.dtype, device=DEV)
        lse = torch.empty(len(lens), 1, heads, device=DEV)
        torch.cuda.synchronize()
        before = time.time_ns()
        part_o, part_lse2 = kt.splitkv_partials(call, sched, probe=probe1)
        combine_splits(part_o, part_lse2, sched.split_offsets, out, lse, pdl=pdl, probe=probe2 if stamped else None)
        torch.cuda.synchronize()
        wall = time.time_ns() - before
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    stamps = probe2.reshape(-1, 4).cpu()
    sm, start, read, end = (stamps[:, i] for i in range(4))
    assert bool(((sm >= 0) & (sm < torch.cuda.get_device_properties(DEV).multi_processor_count)).all())
    assert bool(((start <= read) & (read <= end)).all())
    first = int(probe1[: sched.planned_work].reshape(-1, 4)[:, 1].min())
    assert int(end.max()) - first <= wall
    assert int(read.min()) >= int(probe1[: sched.planned_work].reshape(-1, 4)[:, 3].max()), "read before phase 1 ended"


@pytest.mark.parametrize("fp8", [False, "kv"])
def test_combine_tiles_agree_with_the_oracle(fp8):
    """The combine with each tile ``bench.splitkv_phases --combine-tiles`` times (one split per load up to every split
    in one load over 8 warps, 16 to 64 columns) over phase 1's partials of a 16-head step with uneven lengths: every
    tile's out and LSE within the oracle tolerance (the tiles change only the order of the fp32 sums)."""
    from mla_fa3.ops import splitkv_triton as kt
    from mla_fa3.ops import validate
    from mla_fa3.ops.splitkv_combine_triton import combine_splits

    lens, heads, page = (70000, 1, 4097, 65), 16, 64
    q, kv, table, seqlens, dense, extra = build(lens, 1, heads, page, fp8=fp8, seed=9)
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=DEV, kv_fp8=bool(fp8))
    call = validate.check_splitkv(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                  causal=True, descale_q=extra.get("descale_q"), descale_k=extra.get("descale_k"),
                                  impl=Impl.TRITON)
    part_o, part_lse2 = kt.splitkv_partials(call, sched)
    assert int(sched.split_offsets[1]) > 128  # request 0's splits take several loads of every tile but the widest
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_impl, _ = run_reference(q, kv, table, seqlens, **extra)
    for tile in ((1, 64), (16, 64), (64, 32), (128, 32), (256, 32), (256, 16), (64, 64)):
        out = torch.full((len(lens), 1, heads, R), float("nan"), dtype=call.out_dtype, device=DEV)
        lse = torch.full((len(lens), 1, heads), float("nan"), device=DEV)
        combine_splits(part_o, part_lse2, sched.split_offsets, out, lse, call.descale_k if fp8 else None, tile=tile)
        check(out, lse, ref_out, ref_lse, lowp, ref_impl)


# ------------------------------------------------------------------------------------------ through the backend

@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("spec_name", ["small_decode", "decode_page64_long", "verify_k2_page64", "draft_decode"])
@pytest.mark.parametrize("cfg_name", ["deepseek_v3", "deepseek_v3_h128"])
def test_backend_splitkv_step_vs_oracle_and_fa3(spec_name, cfg_name, page):
    """MLABackend(decode_kernel='splitkv') on the H200: the Triton kernel runs, the step matches the fp64 oracle
    within the torch-bf16 error, and FA3's step on the same inputs."""
    from test_backend_gpu import MIN_COSINE, backend_for, check_precision

    s = SPECS[spec_name]
    spec = BatchSpec(s.mode, s.prefix_lens, s.extend_lens, page_size=page)
    outs = {}
    for kernel in ("fa3", "splitkv"):
        case = make_mla_case(spec, cfg_name, dtype=BF16, device=DEV, seed=3)
        backend = backend_for(case, decode_kernel=kernel, num_heads=case.cfg.num_heads)
        backend.init_forward_metadata(case.batch)
        out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
        assert ops.last_impl() is (Impl.TRITON if kernel == "splitkv" else Impl.FA3)
        assert backend.explain().kernel == kernel
        check_precision(out, case)
        outs[kernel] = out.double()
    assert torch.nn.functional.cosine_similarity(outs["fa3"].flatten(), outs["splitkv"].flatten(), dim=0) >= MIN_COSINE


def test_backend_splitkv_graph_replay_and_no_sync():
    """A real CUDA graph of backend.forward on split-KV: replays with new lengths (the captured schedule re-planned
    on the device in the replay update) match the oracle; the eager planning + forward never syncs."""
    from test_backend_gpu import backend_for, check_precision

    k, cap = 1, 4
    spec = BatchSpec(ForwardMode.DECODE, (40, 3, 1500), (k,) * 3, page_size=64)
    case = make_mla_case(spec, "deepseek_v3", dtype=BF16, device=DEV, seed=5)
    d, H = case.cfg.dims, case.cfg.num_heads
    eager = backend_for(case, decode_kernel="splitkv", num_heads=H)
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager.init_forward_metadata(case.batch)
        out = eager.forward(case.q, case.new_latent, None, case.layer, case.batch)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    check_precision(out, case)
    backend = backend_for(case, decode_kernel="splitkv", num_heads=H)
    backend.init_cuda_graph_state(cap, case.layout.req_to_token_pool.max_context)
    q_buf = torch.zeros(cap * k, H, d.qk_head_dim, dtype=BF16, device=DEV)
    lat_buf = torch.zeros(cap * k, d.latent_dim, dtype=BF16, device=DEV)
    loc_buf = torch.zeros(cap * k, dtype=torch.int64, device=DEV)
    static = ForwardBatch.decode([0] * cap, [1] * cap, loc_buf, DEV)
    graph, out_buf = capture_layer_graph(backend, case.layer, q_buf, lat_buf, static)
    for step in (follow_up(case, ForwardMode.DECODE, (40, 3, 1500), (k,) * 3, requests=[0, 1, 2], seed=0, pad_to=cap),
                 follow_up(case, ForwardMode.DECODE, (1400, 30), (k, k), requests=[2, 0], seed=1, pad_to=cap)):
        backend.init_forward_metadata_replay_cuda_graph(step.batch)
        assert "splits planned on the device" in backend.explain().reason
        q_buf.copy_(padded(step.q, cap * k))
        lat_buf.copy_(padded(step.new_latent, cap * k))
        loc_buf.copy_(step.batch.out_cache_loc)
        graph.replay()
        check_precision(out_buf[: step.q.shape[0]].clone(), step)
