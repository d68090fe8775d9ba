"""The Gluon warp-specialized MLA decode (``ops/gluon_decode.py``, issue 40's spike) on a Hopper GPU.

Its shape: bf16 q and latent cache (or e4m3, below), 16 heads, one query token (two, causal, over a bf16 cache),
r 512 + d_rope 64, page 64. Caches are adversarial: shuffled page ids, ``BAD_PAGE`` in unused page-table entries,
NaN in every slot past a request's end and in every unused page. NaN matters here: the kernel loads whole pages by
TMA, so the tail of a request's last page reaches shared memory and must be masked out of Sᵀ and zeroed before P·V
(0 · NaN = NaN).
Tolerances from precision (``ops_cases.check``): err(kernel vs fp64 oracle) <= 2 · err(torch bf16 vs oracle) + 1e-4,
cosine >= 0.9999 against our Triton split-KV on the same cache, LSE (natural log) within 2e-3.

The e4m3 cache (``kv float8_e4m3fn`` + ``descale_k``, q bf16): the same cases with the pool rounded to e4m3 (NaN
past every end: e4m3fn has NaN), the oracle computed in fp64 over the e4m3 keys times descale_k with q as given
(bf16, never rounded to e4m3), the low-precision baseline in bf16 over the same dequantized keys, and our Triton
split-KV reading the same e4m3 cache with the bf16 q (``descale_k=``).

Skips: no CUDA sm90 (and, via ``conftest``, no sgl_kernel), a triton without Gluon, or a triton older than 3.6
(the Gluon API this kernel is written for). With triton >= 3.6 on the GPU, an import or build error FAILS.
"""

from __future__ import annotations

import math

import pytest
import torch

from ops_cases import BAD_PAGE, check, cosine

from mla_fa3 import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
R, D_ROPE, H, PAGE = 512, 64, 16, 64
D = R + D_ROPE
SCALE = (128 + D_ROPE) ** -0.5


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.fixture(scope="module")
def gd():
    """The kernel module; skipped where it cannot run, imported (errors = failures) where it must."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs a CUDA sm90 GPU")
    version = _triton_version()
    if version is None:
        pytest.skip("triton is not installed")
    if version < (3, 6):
        pytest.skip(f"triton {version} < 3.6: the kernel is written for the Gluon API of 3.6")
    from mla_fa3.ops import gluon_decode  # an ImportError here, with triton >= 3.6 on sm90, is a failure

    return gluon_decode


def build(lens, *, seed=0):
    """q [bs, 1, 16, 576] bf16, kv [pages, 64, 1, 576] (NaN outside the live slots), table, lens, dense rows."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(L / PAGE) for L in lens]
    num_pages = sum(need) + 3
    ids = torch.randperm(num_pages, generator=g).tolist()
    kv = torch.full((num_pages, PAGE, 1, D), float("nan"), dtype=BF16)
    table = torch.full((len(lens), max(need + [0]) + 2), BAD_PAGE, dtype=torch.int32)
    q = torch.randn(len(lens), 1, H, D, generator=g).to(BF16)
    dense = []
    for b, L in enumerate(lens):
        kv_b = torch.randn(L, 1, D, generator=g).to(BF16)
        rows = kv_b.new_full((need[b] * PAGE, 1, D), float("nan"))
        rows[:L] = kv_b
        pages = [ids.pop() for _ in range(need[b])]
        table[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        kv[pages] = rows.view(need[b], PAGE, 1, D)
        dense.append((q[b], kv_b))
    return q.to(DEV), kv.to(DEV), table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), dense


def _attend(q, kv, dtype):
    """One request in ``dtype`` on the GPU: q [1, H, 576], kv [L, 1, 576] -> (out [1, H, 512], lse [1, H])."""
    q, kv = q.to(DEV, dtype), kv[:, 0].to(DEV, dtype)
    s = torch.einsum("nhd,ld->hnl", q, kv) * SCALE
    lse = torch.logsumexp(s.double(), dim=-1).transpose(0, 1)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hnl,ld->nhd", p, kv[:, :R]).cpu(), lse.cpu()


def oracle_and_lowp(dense):
    oracle = [_attend(q_b, kv_b, torch.float64) for q_b, kv_b in dense]
    lowp = [_attend(q_b, kv_b, BF16)[0] for q_b, kv_b in dense]
    return torch.stack([o for o, _ in oracle]), torch.stack([l for _, l in oracle]), torch.stack(lowp)


def schedule_for(lens, **kw):
    return ops.get_splitkv_schedule(list(lens), num_heads=H, page_size=PAGE, device=DEV, **kw)


def run_triton(q, kv, table, seqlens, sched):
    return ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                        causal=True, impl="triton")


# lengths 1, page ± 1, a page exactly, 4097 (a one-key last tile), 64k; bs 1 / 3 / 8
CASES = {
    "bs1_64k": (65536,),
    "bs1_one_key": (1,),
    "bs3_short_and_4097": (63, 64, 4097),
    "bs8_mixed": (1, 63, 64, 65, 4097, 65536, 2, 130),
}
# the planner's default split (one wave of CTAs) and many short splits per request (64-token granule)
PLANS = {"default": dict(waves=1.0), "many_splits": dict(waves=8.0, min_split_tokens=64)}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(CASES))
def test_gluon_matches_oracle_and_triton_splitkv(gd, name, plan):
    lens = CASES[name]
    q, kv, table, seqlens, dense = build(lens, seed=len(lens))
    sched = schedule_for(lens, **PLANS[plan])
    if plan == "many_splits" and max(lens) > 128:
        assert sched.planned_work > len(lens)  # some request really is cut in several splits
    out, lse = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
    torch.cuda.synchronize()
    assert out.dtype == BF16 and out.shape == (len(lens), 1, H, R) and lse.shape == (len(lens), 1, H)
    tri, tri_lse = run_triton(q, kv, table, seqlens, schedule_for(lens))
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    check(out, lse, ref_out, ref_lse, lowp, tri)  # finite, precision rule, cosine vs Triton, LSE vs oracle
    assert cosine(out, tri) >= 0.9999
    assert (lse - tri_lse).abs().max().item() <= 2e-3


def test_gluon_is_bitwise_repeatable_and_q_rope_apart_is_the_same(gd):
    lens = (65, 4097, 65536)
    q, kv, table, seqlens, _ = build(lens, seed=11)
    sched = schedule_for(lens)
    a = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
    b = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
    c = gd.gluon_mla_decode(q[..., :R], kv, table, seqlens, schedule=sched, softmax_scale=SCALE,
                            q_rope=q[..., R:].clone())
    for x, y in ((a, b), (a, c)):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_gluon_replays_in_a_cuda_graph(gd):
    """Captured once (the TMA descriptor is a by-value kernel parameter: it stays valid while the pool does)."""
    lens = (4097, 700)
    q, kv, table, seqlens, _ = build(lens, seed=5)
    sched = schedule_for(lens)
    eager = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager[0], captured[0]) and torch.equal(eager[1], captured[1])


def test_gluon_refuses_other_shapes_before_any_launch(gd):
    q, kv, table, seqlens, _ = build((65,))
    sched = schedule_for((65,))
    with pytest.raises(ValueError, match="^q must have 16 heads"):
        gd.gluon_mla_decode(q[:, :, :8].contiguous(), kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
    with pytest.raises(ValueError, match="^q must be bfloat16"):
        gd.gluon_mla_decode(q.half(), kv.half(), table, seqlens, schedule=sched, softmax_scale=SCALE)


def test_split_kv_with_the_warp_specialized_switch_runs_this_kernel(gd):
    """``ops.splitkv_mla_with_kvcache`` with a schedule planned under ``KernelConfig(warp_specialized=True)``: phase 1
    is this kernel (the same bits as ``gluon_mla_decode``), the answer the oracle's, in a CUDA graph too."""
    from mla_fa3.ops.splitkv_config import KernelConfig

    lens = CASES["bs8_mixed"]
    q, kv, table, seqlens, dense = build(lens, seed=3)
    ws = schedule_for(lens, config=KernelConfig(block_n=64, waves=1.0, warp_specialized=True))
    out, lse = run_triton(q, kv, table, seqlens, ws)
    direct, _ = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=ws, softmax_scale=SCALE)
    assert torch.equal(out, direct)
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    check(out, lse, ref_out, ref_lse, lowp, run_triton(q, kv, table, seqlens, schedule_for(lens))[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _ = run_triton(q, kv, table, seqlens, ws)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out)


@pytest.mark.parametrize("waves", [0.5, 2.0, 4.0])
def test_split_kv_switch_with_half_partials_and_other_waves_matches_the_oracle(gd, waves):
    """``KernelConfig(warp_specialized=True, half_partials=True, waves=...)``: bf16 partial outputs (one more rounding
    per split) and fewer / more programs than SMs; the answer stays within the precision rule of the fp64 oracle and
    agrees with the fp32-partials launch of the same schedule (cosine), the LSE to fp32 rounding (it is not halved)."""
    from mla_fa3.ops.splitkv_config import KernelConfig

    lens = CASES["bs8_mixed"]
    q, kv, table, seqlens, dense = build(lens, seed=11)
    half = schedule_for(lens, config=KernelConfig(block_n=64, waves=waves, half_partials=True, warp_specialized=True))
    full = schedule_for(lens, config=KernelConfig(block_n=64, waves=waves, warp_specialized=True))
    out, lse = run_triton(q, kv, table, seqlens, half)
    out32, lse32 = run_triton(q, kv, table, seqlens, full)
    # phase 1 alone: the bf16 partials are the fp32 ones rounded once (the same arithmetic before the store)
    call = gd.check_supported(q, kv, table, seqlens, schedule=half, softmax_scale=SCALE)
    p16, l16 = gd.gluon_partials(call, half, half=True)
    p32, l32 = gd.gluon_partials(call, half)
    slots = half.work.view(-1, 4)[: int(half.num_work.item()), 3].long()  # the slots the live rows write
    assert p16.dtype == BF16 and p32.dtype == torch.float32
    assert torch.equal(p16[slots], p32[slots].to(BF16)) and torch.equal(l16[slots], l32[slots])
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    check(out, lse, ref_out, ref_lse, lowp, out32)
    assert cosine(out, out32) >= 0.9999
    assert (lse - lse32).abs().max().item() <= 1e-5


@pytest.mark.parametrize("waves", [1.0, 8.0])
def test_two_query_tokens_per_request_are_causal_and_match_the_oracle(gd, waves):
    """sq = 2 (MTP verify, a one-token draft) through split-KV's ``warp_specialized`` switch: the rows (token j,
    head h) are wgmma's N; token j of a request of L keys sees the first L - 1 + j (causal, bottom-right), so the
    request of one key gives token 0 no key (0, lse -inf). One wave and many 64-key splits (a split past token 0's
    limit holds no key for that row), against the fp64 oracle and our Triton split-KV; bitwise repeatable."""
    from mla_fa3.ops.splitkv_config import KernelConfig

    lens = (1, 2, 63, 64, 65, 4097, 65536)
    _, kv, table, seqlens, dense = build(lens, seed=23)
    q = torch.randn(len(lens), 2, H, D, generator=torch.Generator().manual_seed(24)).to(BF16)
    ref_out, ref_lse, lowp = [], [], []
    for b, (L, (_, kv_b)) in enumerate(zip(lens, dense)):
        rows = [(q[b, j:j + 1], kv_b[: L - 1 + j]) for j in range(2)]
        exact = [_attend(q_j, k_j, torch.float64) for q_j, k_j in rows]
        ref_out.append(torch.cat([o for o, _ in exact]))
        ref_lse.append(torch.cat([lse for _, lse in exact]))
        lowp.append(torch.cat([_attend(q_j, k_j, BF16)[0] for q_j, k_j in rows]))
    q = q.to(DEV)
    extra = dict(min_split_tokens=64) if waves > 1 else {}
    ws = schedule_for(lens, num_q_tokens=2, config=KernelConfig(block_n=64, waves=waves, warp_specialized=True),
                      **extra)
    if waves > 1:
        assert ws.planned_work > len(lens)
    out, lse = run_triton(q, kv, table, seqlens, ws)
    again, _ = run_triton(q, kv, table, seqlens, ws)
    # the same q laid out token-minor ([bs, H, 2, D] transposed: stride(1) = D, not H·D), its rope part apart
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    rope_t = q[..., R:].transpose(1, 2).contiguous().transpose(1, 2)
    apart = ops.splitkv_mla_with_kvcache(q_t[..., :R], kv, table, seqlens, head_dim_v=R, schedule=ws,
                                         softmax_scale=SCALE, causal=True, impl="triton", q_rope=rope_t)
    torch.cuda.synchronize()
    assert q_t.stride(1) == D and rope_t.stride(1) == D_ROPE
    assert out.shape == (len(lens), 2, H, R) and lse.shape == (len(lens), 2, H)
    assert torch.equal(out, again) and torch.equal(out, apart[0]) and torch.equal(lse, apart[1])
    tri, _ = run_triton(q, kv, table, seqlens, schedule_for(lens, num_q_tokens=2))
    check(out, lse, torch.stack(ref_out), torch.stack(ref_lse), torch.stack(lowp), tri)
    assert torch.isneginf(lse[0, 0]).all() and (out[0, 0] == 0).all()  # L = 1: token 0 sees no key


# ---- the e4m3 cache, read with the bf16 q ----------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn
DESCALE = 0.4375  # the cache's per-tensor scale: not a power of two, so a missed or doubled descale shows


def build_fp8(lens, *, seed=0):
    """``build``'s cache rounded to e4m3 (NaN stays NaN) + descale_k [1]; dense rows = e4m3 keys · descale_k."""
    q, kv, table, seqlens, dense = build(lens, seed=seed)
    kv8 = (kv.float() / DESCALE).to(E4M3)
    descale = torch.tensor([DESCALE], dtype=torch.float32, device=DEV)
    rows8 = []
    for (q_b, kv_b), L, b in zip(dense, lens, range(len(lens))):
        pages = table[b, : math.ceil(L / PAGE)].long()
        k8 = kv8[pages].reshape(-1, 1, D)[:L]
        rows8.append((q_b, (k8.double() * DESCALE).cpu()))
    return q, kv8, table, seqlens, descale, rows8


def oracle_and_lowp_fp8(dense):
    oracle = [_attend(q_b, k_b, torch.float64) for q_b, k_b in dense]
    lowp = [_attend(q_b, k_b, BF16)[0] for q_b, k_b in dense]  # bf16 over the dequantized keys
    return torch.stack([o for o, _ in oracle]), torch.stack([l for _, l in oracle]), torch.stack(lowp)


def run_triton_fp8(q, kv, table, seqlens, descale, lens):
    sched = schedule_for(lens, kv_fp8=True)
    return ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                        causal=True, impl="triton", descale_k=descale)


@pytest.mark.parametrize("reg_a", [False, True], ids=["staged", "reg_a"])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(CASES))
def test_gluon_fp8_cache_matches_oracle_and_triton_splitkv(gd, name, plan, reg_a):
    """Both e4m3 reads: the tile staged as fp16 in shared memory, and converted in wgmma's A registers."""
    lens = CASES[name]
    q, kv, table, seqlens, descale, dense = build_fp8(lens, seed=len(lens) + 100)
    sched = schedule_for(lens, **PLANS[plan])
    out, lse = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE, descale_k=descale,
                                   reg_a=reg_a)
    torch.cuda.synchronize()
    assert out.dtype == BF16 and out.shape == (len(lens), 1, H, R) and lse.shape == (len(lens), 1, H)
    tri, tri_lse = run_triton_fp8(q, kv, table, seqlens, descale, lens)
    ref_out, ref_lse, lowp = oracle_and_lowp_fp8(dense)
    check(out, lse, ref_out, ref_lse, lowp, tri)
    assert cosine(out, tri) >= 0.9999
    assert (lse - tri_lse).abs().max().item() <= 2e-3


def test_gluon_fp8_is_bitwise_repeatable_and_goes_through_split_kv_the_same(gd):
    """Repeatable to the bit; split-KV's ``warp_specialized`` switch on the e4m3 cache gives the same bits as
    ``gluon_mla_decode`` (descale_k applied once, by the combine, on both paths)."""
    from mla_fa3.ops.splitkv_config import KernelConfig

    lens = (1, 63, 64, 65, 4097, 65536)
    q, kv, table, seqlens, descale, dense = build_fp8(lens, seed=17)
    sched = schedule_for(lens)
    a = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE, descale_k=descale)
    b = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE, descale_k=descale)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ws = schedule_for(lens, config=KernelConfig(block_n=64, waves=1.0, warp_specialized=True), kv_fp8=True)
    via = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=ws, softmax_scale=SCALE,
                                       causal=True, impl="triton", descale_k=descale)
    direct = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=ws, softmax_scale=SCALE, descale_k=descale)
    assert torch.equal(via[0], direct[0]) and torch.equal(via[1], direct[1])
    ref_out, ref_lse, lowp = oracle_and_lowp_fp8(dense)
    check(a[0], a[1], ref_out, ref_lse, lowp, run_triton_fp8(q, kv, table, seqlens, descale, lens)[0])
    r1, r2 = (gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE, descale_k=descale,
                                  reg_a=True) for _ in range(2))
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    # the register read: repeatable to the bit too, and held to the oracle (not to the staged read's bits)
    check(r1[0], r1[1], ref_out, ref_lse, lowp, run_triton_fp8(q, kv, table, seqlens, descale, lens)[0])


def test_gluon_refuses_an_e4m3_q(gd):
    q, kv, table, seqlens, descale, _ = build_fp8((65,))
    sched = schedule_for((65,))
    with pytest.raises(ValueError, match="^q must be bfloat16"):
        gd.gluon_mla_decode(q.to(E4M3), kv, table, seqlens, schedule=sched, softmax_scale=SCALE)
