"""The pure-torch reference of ``mla_fa3.ops`` against the fp64 oracle (``tests/oracle.py``).

One named table of cases (``SPECS``) drives every paged-attention test; each case is built with an
adversarial cache: SHUFFLED page ids, NaN in every cache slot outside a request's first L tokens
(tails of last pages, spare pages, padding page 0) and a huge out-of-range id (2**30) in every unused
page-table entry. The oracle sees only the dense per-request K/V that the builder wrote into the pages.
``build_case`` is shared with ``tests/test_ops_gpu.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

from oracle import dense_attention

from mla_fa3 import ops
from mla_fa3.ops import reference

BAD_PAGE = 2**30  # unused page-table entries: reading one would raise / fault


@dataclass(frozen=True)
class Spec:
    """One paged-attention case. q is varlen ``[T, H, d]`` unless ``sq > 0`` (batched ``[bs, sq, H, d]``)."""

    lens: tuple  # cache_seqlens L_b (prefix + new)
    new: Optional[tuple] = None  # varlen new tokens n_b per request (None: 1 each, i.e. decode)
    sq: int = 0  # > 0: batched queries, sq per request
    heads: int = 4
    kv_heads: int = 4
    d: int = 16  # q/k head dim (d_rope for mla)
    dv: int = 16  # v head dim (kv_lora_rank for mla)
    page_size: int = 16
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float = 0.0
    mla: bool = False  # absorbed MLA: one latent cache [.., 1, dv + d] viewed as v = [..., :dv], k = [..., dv:]
    dtype: torch.dtype = torch.float32
    fp8: bool = False  # e4m3 q/k/v with random per-(request, kv head) descales
    scale: Optional[float] = None  # None: the op's default ((d + dv) ** -0.5 with qv, else d ** -0.5)
    q_gain: float = 1.0  # larger scores (softcap cases)


SPECS = {
    "decode_bs1": Spec(lens=(37,)),
    "decode_bs8_mqa": Spec(lens=(1, 5, 16, 17, 31, 32, 33, 60), heads=8, kv_heads=1),
    "decode_bs64": Spec(lens=tuple(1 + (7 * i) % 45 for i in range(64)), heads=2, kv_heads=1, d=8, dv=8),
    "decode_empty_cache": Spec(lens=(0, 9)),
    "extend_no_prefix": Spec(lens=(5, 17, 33), new=(5, 17, 33)),
    "extend_with_prefix": Spec(lens=(20, 41, 9), new=(7, 3, 9)),
    "extend_noncausal": Spec(lens=(20, 13), new=(4, 13), causal=False),
    "batched_q": Spec(lens=(9, 30, 3), sq=3),
    "batched_q_longer_than_cache": Spec(lens=(2, 6), sq=4),  # rows before position 0 see no key
    "page1_shuffled": Spec(lens=(11, 4), new=(3, 4), page_size=1),
    "page64": Spec(lens=(70, 130), new=(5, 1), page_size=64),
    "gqa": Spec(lens=(25, 40), new=(6, 2), heads=8, kv_heads=2, page_size=4),
    "window_left": Spec(lens=(40, 23), new=(6, 23), window=(8, -1), page_size=4),
    "window_both_noncausal": Spec(lens=(30,), new=(5,), causal=False, window=(3, 2), page_size=8),
    "softcap": Spec(lens=(33, 12), new=(4, 12), softcap=5.0, q_gain=4.0, page_size=8),
    "mla_small": Spec(lens=(19, 40), new=(1, 3), heads=4, kv_heads=1, d=8, dv=32, mla=True, scale=0.2),
    "mla_default_scale": Spec(lens=(10, 21), new=(2, 21), heads=2, kv_heads=1, d=8, dv=24, mla=True),
    "mla_deepseek_dims": Spec(lens=(70, 5), new=(1, 5), heads=16, kv_heads=1, d=64, dv=512, mla=True,
                              page_size=64, scale=192**-0.5),
    "bf16_gqa_extend": Spec(lens=(30, 8), new=(5, 8), heads=4, kv_heads=2, dtype=torch.bfloat16),
    "bf16_mla": Spec(lens=(33,), new=(2,), heads=4, kv_heads=1, d=16, dv=64, mla=True, dtype=torch.bfloat16),
    "fp8_decode": Spec(lens=(20, 7), heads=4, kv_heads=2, fp8=True),
}


@dataclass
class Case:
    spec: Spec
    kwargs: dict  # arguments of ops.flash_attn_with_kvcache besides q, k_cache, v_cache
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    dense: list  # per request (q_b, qv_b, k_b, v_b): dequantized values the op sees, fp32, cpu
    scale: float


def _quant(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn) if dtype is torch.float8_e4m3fn else x.to(dtype)


# Kernels read whole pages: the slots past a sequence's end inside its last page are multiplied by a
# zero probability, so they must be finite (the pools start zeroed and hold only written rows). On a GPU
# that tail is poisoned with large finite garbage instead of NaN: reading it still ruins the result.
STALE_FINITE = 3.0e3


def build_case(spec: Spec, *, device="cpu", dtype: Optional[torch.dtype] = None, seed: int = 0) -> Case:
    """Random case for ``spec``; ``dtype`` overrides ``spec.dtype`` (e.g. bf16 for the GPU tests).

    Every unused slot is NaN, except on CUDA the tail of each sequence's last page (``STALE_FINITE``).
    """
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float8_e4m3fn if spec.fp8 else (dtype or spec.dtype)
    bs, ps = len(spec.lens), spec.page_size
    new = (spec.sq,) * bs if spec.sq else (spec.new or (1,) * bs)
    h_kv = 1 if spec.mla else spec.kv_heads
    need = [math.ceil(L / ps) for L in spec.lens]
    num_pages = 1 + sum(need) + 3  # page 0 = padding, 3 spare pages, all NaN
    ids = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # shuffled page ids
    table = torch.full((bs, max(need + [0]) + 2), BAD_PAGE, dtype=torch.int32)
    nan = float("nan")
    if spec.mla:
        latent = torch.full((num_pages, ps, 1, spec.dv + spec.d), nan, dtype=dtype)
        v_cache, k_cache = latent[..., : spec.dv], latent[..., spec.dv :]
    else:
        k_cache = torch.full((num_pages, ps, h_kv, spec.d), nan, dtype=dtype)
        v_cache = torch.full((num_pages, ps, h_kv, spec.dv), nan, dtype=dtype)
    descale = (0.5 + torch.rand(bs, h_kv, 3, generator=g)) if spec.fp8 else None  # k, v, q
    dense, q_rows, qv_rows = [], [], []
    for b, (L, n) in enumerate(zip(spec.lens, new)):
        k_b = _quant(torch.randn(L, h_kv, spec.d, generator=g), dtype)
        v_b = _quant(torch.randn(L, h_kv, spec.dv, generator=g), dtype)
        q_b = _quant(spec.q_gain * torch.randn(n, spec.heads, spec.d, generator=g), dtype)
        qv_b = _quant(torch.randn(n, spec.heads, spec.dv, generator=g), dtype) if spec.mla else None
        for i in range(need[b]):  # write the request's pages one by one
            page, lo, hi = ids.pop(), i * ps, min(L, (i + 1) * ps)
            table[b, i] = page
            if torch.device(device).type == "cuda":
                k_cache[page, hi - lo :] = STALE_FINITE
                v_cache[page, hi - lo :] = STALE_FINITE
            k_cache[page, : hi - lo] = k_b[lo:hi]
            v_cache[page, : hi - lo] = v_b[lo:hi]
        kf, vf, qf = k_b.float(), v_b.float(), q_b.float()
        if descale is not None:
            group = spec.heads // h_kv
            kf, vf = kf * descale[b, :, 0, None], vf * descale[b, :, 1, None]
            qf = qf * descale[b, :, 2].repeat_interleave(group)[:, None]
        dense.append((qf, None if qv_b is None else qv_b.float(), kf, vf))
        q_rows.append(q_b)
        qv_rows.append(qv_b)
    q = torch.stack(q_rows) if spec.sq else torch.cat(q_rows)
    qv = None if not spec.mla else (torch.stack(qv_rows) if spec.sq else torch.cat(qv_rows))
    cu = torch.tensor([0] + list(new), dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = spec.scale if spec.scale is not None else (spec.d + (spec.dv if spec.mla else 0)) ** -0.5
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    kwargs = dict(
        qv=to(qv), page_table=to(table), cache_seqlens=to(torch.tensor(spec.lens, dtype=torch.int32)),
        softmax_scale=spec.scale, causal=spec.causal, window_size=spec.window, softcap=spec.softcap,
    )
    if not spec.sq:
        kwargs.update(cu_seqlens_q=to(cu), max_seqlen_q=max(new))
    if descale is not None:
        kwargs.update(k_descale=to(descale[..., 0].contiguous()), v_descale=to(descale[..., 1].contiguous()),
                      q_descale=to(descale[..., 2].contiguous()))
    if spec.mla:
        k_cache, v_cache = latent.to(device)[..., spec.dv :], latent.to(device)[..., : spec.dv]
    else:
        k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    return Case(spec, kwargs, q.to(device), k_cache, v_cache, dense, scale)


def oracle(case: Case):
    """fp64 (out, lse) in the op's layout (``[T, H, dv]`` / ``[bs, sq, H, dv]``), cpu."""
    s = case.spec
    outs, lses = [], []
    for q_b, qv_b, k_b, v_b in case.dense:
        o, l = dense_attention(q_b, k_b, v_b, scale=case.scale, causal=s.causal, window=s.window,
                               softcap=s.softcap, qv=qv_b)
        outs.append(o)
        lses.append(l)
    if s.sq:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses)


def tolerances(dtype: torch.dtype, fp8: bool = False):
    """(out atol, out rtol, lse atol): fp32 compute vs fp64; low-precision outputs add their rounding."""
    if dtype is torch.float32 and not fp8:
        return 2e-5, 1e-5, 2e-5
    return 2e-2, 8e-3, 1e-4  # bf16 output rounding (2**-8 relative) on values up to ~3


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Force several online-softmax key blocks and query chunks per request."""
    monkeypatch.setattr(reference, "KEY_BLOCK", 5)
    monkeypatch.setattr(reference, "SCORE_BUDGET", 64)


def _check(case: Case, out, lse):
    ref_out, ref_lse = oracle(case)
    atol, rtol, lse_atol = tolerances(case.spec.dtype, case.spec.fp8)
    assert out.dtype == (torch.bfloat16 if case.spec.fp8 else case.q.dtype)
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:-1]
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


@pytest.mark.parametrize("name", list(SPECS))
def test_kvcache_reference_matches_oracle(name, tiny_blocks):
    case = build_case(SPECS[name])
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True,
                                           impl="reference")
    assert ops.last_impl() is ops.Impl.REFERENCE
    _check(case, out, lse)


@pytest.mark.parametrize("name", ["extend_with_prefix", "mla_small", "window_left"])
def test_kvcache_default_blocks(name):
    case = build_case(SPECS[name], seed=1)
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True)
    _check(case, out, lse)


def test_rows_without_keys_are_zero_with_neg_inf_lse():
    case = build_case(SPECS["batched_q_longer_than_cache"])
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True)
    # request 0: L = 2, sq = 4 -> query positions -2, -1 see nothing under causal
    assert torch.isneginf(lse[0, :2]).all() and (out[0, :2] == 0).all()
    assert torch.isfinite(lse[0, 2:]).all()
    out1 = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs)
    torch.testing.assert_close(out1, out, atol=0, rtol=0)  # return_lse=False: out alone


def test_lse_helpers_convert_bases():
    x = torch.tensor([0.0, 1.5, -3.0, float("-inf")])
    base2 = x / math.log(2)
    torch.testing.assert_close(ops.lse_base2_to_natural(base2), x)
    torch.testing.assert_close(ops.lse_natural_to_base2(x), base2)
    assert ops.LSE_BASE == "e"


# ------------------------------------------------------------------------------- varlen_func


VARLEN = {
    "causal_mixed": dict(q_lens=(4, 1, 9), k_lens=(10, 6, 9), heads=4, kv_heads=2, d=24, dv=16, causal=True),
    "noncausal": dict(q_lens=(3, 5), k_lens=(7, 2), heads=2, kv_heads=2, d=16, dv=16, causal=False),
    "window_softcap": dict(q_lens=(6,), k_lens=(20,), heads=2, kv_heads=1, d=8, dv=8, causal=True,
                           window=(5, -1), softcap=3.0),
    "empty_request": dict(q_lens=(0, 3), k_lens=(4, 3), heads=2, kv_heads=1, d=8, dv=8, causal=True),
}


@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen_reference_matches_oracle(name, tiny_blocks):
    c = dict(VARLEN[name])
    g = torch.Generator().manual_seed(3)
    window, softcap = c.get("window", (-1, -1)), c.get("softcap", 0.0)
    qs = [torch.randn(n, c["heads"], c["d"], generator=g) for n in c["q_lens"]]
    ks = [torch.randn(n, c["kv_heads"], c["d"], generator=g) for n in c["k_lens"]]
    vs = [torch.randn(n, c["kv_heads"], c["dv"], generator=g) for n in c["k_lens"]]
    cu = lambda lens: torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)  # noqa: E731
    out, lse = ops.flash_attn_varlen_func(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_seqlens_q=cu(c["q_lens"]), cu_seqlens_k=cu(c["k_lens"]),
        max_seqlen_q=max(c["q_lens"]), max_seqlen_k=max(c["k_lens"]), causal=c["causal"], window_size=window,
        softcap=softcap, return_lse=True,
    )
    refs = [dense_attention(q, k, v, scale=c["d"] ** -0.5, causal=c["causal"], window=window, softcap=softcap)
            for q, k, v in zip(qs, ks, vs)]
    torch.testing.assert_close(out.double(), torch.cat([r[0] for r in refs]), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.cat([r[1] for r in refs]), atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- merge_state


def _partial(q, k, v, mask, scale):
    return dense_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_state_equals_attention_over_union(dtype):
    g = torch.Generator().manual_seed(5)
    n, L, H, d = 6, 23, 3, 16
    q, k, v = torch.randn(n, H, d, generator=g), torch.randn(L, H, d, generator=g), torch.randn(L, H, d, generator=g)
    full = torch.ones(n, L, dtype=torch.bool)
    in_a = torch.rand(n, L, generator=g) < 0.5  # a random split of every row's keys
    in_a[0] = True  # row 0: every key in A, B empty
    o_a, l_a = _partial(q, k, v, in_a, 0.3)
    o_b, l_b = _partial(q, k, v, ~in_a, 0.3)
    o_ref, l_ref = _partial(q, k, v, full, 0.3)
    o, lse = ops.merge_state(o_a.to(dtype), l_a.float(), o_b.to(dtype), l_b.float())
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (n, H)
    atol = 2e-5 if dtype is torch.float32 else 1.5e-2
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse.double(), l_ref, atol=2e-5, rtol=1e-5)


def test_merge_state_empty_states():
    o_a = torch.tensor([[[1.0, 2.0]], [[float("nan"), 0.0]], [[5.0, 5.0]], [[3.0, 4.0]]])
    o_b = torch.tensor([[[float("nan"), 7.0]], [[1.0, -1.0]], [[6.0, 6.0]], [[9.0, 9.0]]])
    inf = float("inf")
    lse_a = torch.tensor([[0.5], [-inf], [-inf], [inf]])  # +inf = an empty row as FA3 writes it
    lse_b = torch.tensor([[-inf], [2.0], [-inf], [1.0]])
    o, lse = ops.merge_state(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o, torch.tensor([[[1.0, 2.0]], [[1.0, -1.0]], [[0.0, 0.0]], [[9.0, 9.0]]]))
    torch.testing.assert_close(lse, torch.tensor([[0.5], [2.0], [-inf], [1.0]]))


def test_chunked_prefix_pattern_through_ops(tiny_blocks):
    """Prefix keys (non-causal) and new keys (causal) attended separately, merged = causal attention over all."""
    g = torch.Generator().manual_seed(6)
    P, n, H, d, dv = 11, 5, 2, 16, 8
    q = torch.randn(n, H, d, generator=g)
    k, v = torch.randn(P + n, H, d, generator=g), torch.randn(P + n, H, dv, generator=g)
    one = lambda x: torch.tensor([0, x], dtype=torch.int32)  # noqa: E731
    o_p, l_p = ops.flash_attn_varlen_func(q, k[:P], v[:P], cu_seqlens_q=one(n), cu_seqlens_k=one(P), max_seqlen_q=n,
                                          max_seqlen_k=P, softmax_scale=0.25, return_lse=True)
    o_n, l_n = ops.flash_attn_varlen_func(q, k[P:], v[P:], cu_seqlens_q=one(n), cu_seqlens_k=one(n), max_seqlen_q=n,
                                          max_seqlen_k=n, softmax_scale=0.25, causal=True, return_lse=True)
    o, lse = ops.merge_state(o_p, l_p, o_n, l_n)
    o_ref, l_ref = dense_attention(q, k, v, scale=0.25, causal=True)
    torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), l_ref, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- FlashMLA


FLASHMLA = {
    "decode_deepseek": dict(lens=(70, 1, 130), sq=1, heads=16, r=512, d_rope=64, page=64),
    "mtp_sq2_small": dict(lens=(9, 40), sq=2, heads=4, r=32, d_rope=16, page=8),
    "fp8_small": dict(lens=(33, 5), sq=1, heads=4, r=32, d_rope=16, page=16, fp8=True),
}


def build_flashmla(c: dict, *, device="cpu", dtype=torch.float32, seed=0):
    """q [bs, sq, H, r + d_rope], kv_cache [pages, page, 1, r + d_rope] (NaN outside used slots), dense oracle inputs."""
    g = torch.Generator().manual_seed(seed)
    fp8 = c.get("fp8", False)
    dtype = torch.float8_e4m3fn if fp8 else dtype
    ps, D, bs = c["page"], c["r"] + c["d_rope"], len(c["lens"])
    need = [math.ceil(L / ps) for L in c["lens"]]
    ids = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    kv = torch.full((sum(need) + 3, ps, 1, D), float("nan"), dtype=dtype)
    table = torch.full((bs, max(need) + 1), BAD_PAGE, dtype=torch.int32)
    dq, dk = (torch.rand(2, generator=g) + 0.5) if fp8 else (torch.ones(1), torch.ones(1))
    q = _quant(torch.randn(bs, c["sq"], c["heads"], D, generator=g), dtype)
    dense = []
    for b, L in enumerate(c["lens"]):
        kv_b = _quant(torch.randn(L, 1, D, generator=g), dtype)
        for i in range(need[b]):
            page = ids.pop()
            table[b, i] = page
            kv[page, : min(L, (i + 1) * ps) - i * ps] = kv_b[i * ps : (i + 1) * ps]
        dense.append((q[b].float() * dq, kv_b.float() * dk))
    extra = dict(descale_q=dq.view(1).float().to(device), descale_k=dk.view(1).float().to(device)) if fp8 else {}
    return q.to(device), kv.to(device), table.to(device), torch.tensor(c["lens"], dtype=torch.int32, device=device), \
        dense, extra


def flashmla_oracle(c: dict, dense, scale):
    outs, lses = zip(*[dense_attention(q_b, kv_b, kv_b[..., : c["r"]], scale=scale, causal=True) for q_b, kv_b in dense])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("name", list(FLASHMLA))
def test_flash_mla_reference_matches_oracle(name, tiny_blocks):
    c = FLASHMLA[name]
    q, kv, table, lens, dense, extra = build_flashmla(c)
    fp8 = bool(extra)
    sched = ops.get_mla_decode_metadata(lens, c["heads"] * c["sq"], is_fp8=fp8)
    assert isinstance(sched, ops.FlashMLASchedule) and sched.impl is ops.Impl.REFERENCE
    scale = (128 + c["d_rope"]) ** -0.5
    out, lse = ops.flash_mla_with_kvcache(q, kv, table, lens, head_dim_v=c["r"], schedule=sched, softmax_scale=scale,
                                          causal=True, return_lse=True, **extra)
    assert out.shape == (len(c["lens"]), c["sq"], c["heads"], c["r"]) and lse.shape == out.shape[:-1]
    ref_out, ref_lse = flashmla_oracle(c, dense, scale)
    atol, rtol, lse_atol = tolerances(torch.float32, fp8)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


def test_flash_mla_reference_equals_split_qv_form():
    """FlashMLA over the 576 row == flash_attn_with_kvcache with q = q[..., r:], qv = q[..., :r] on views."""
    c = FLASHMLA["mtp_sq2_small"]
    q, kv, table, lens, _, _ = build_flashmla(c, seed=2)
    r = c["r"]
    sched = ops.get_mla_decode_metadata(lens, c["heads"] * c["sq"])
    a = ops.flash_mla_with_kvcache(q, kv, table, lens, head_dim_v=r, schedule=sched, softmax_scale=0.1, causal=True)
    b = ops.flash_attn_with_kvcache(q[..., r:], kv[..., r:], kv[..., :r], qv=q[..., :r], page_table=table,
                                    cache_seqlens=lens, softmax_scale=0.1, causal=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_schedule_copy_updates_in_place():
    dst = ops.FlashMLASchedule(ops.Impl.FA3, torch.zeros(4, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    src = replace(dst, tile_scheduler_metadata=torch.ones(4, 8, dtype=torch.int32),
                  num_splits=torch.arange(3, dtype=torch.int32))
    buf = dst.tile_scheduler_metadata
    dst.copy_(src)
    assert dst.tile_scheduler_metadata is buf and (buf == 1).all()
    assert dst.num_splits.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="other"):
        dst.copy_(replace(src, is_fp8=True))


def test_idle_batch_returns_empty():
    q = torch.randn(0, 4, 16)
    cache = torch.randn(2, 4, 2, 16)
    out, lse = ops.flash_attn_with_kvcache(
        q, cache, cache, page_table=torch.zeros(0, 1, dtype=torch.int32), cache_seqlens=torch.zeros(0, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32), max_seqlen_q=0, return_lse=True,
    )
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_reference_scores_stay_bounded(monkeypatch):
    """Online softmax in blocks: every product is [H_kv, group * q_chunk, <= max(key_block, d_v)], never [L, L]."""
    monkeypatch.setattr(reference, "KEY_BLOCK", 8)
    monkeypatch.setattr(reference, "SCORE_BUDGET", 256)
    sizes, bmm = [], torch.bmm

    def spy(a, b, **kw):
        out = bmm(a, b, **kw)
        sizes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "bmm", spy)
    case = build_case(Spec(lens=(96,), new=(96,), heads=4, kv_heads=2, page_size=8))
    out, lse = ops.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs, return_lse=True)
    # scores [H_kv, group * q_chunk, key_block] = [2, 2 * 8, 8] with q_chunk = 256 // (4 * 8); P.V [2, 16, dv = 16]
    assert sizes and max(n for _, n, _ in sizes) <= 16 and max(k for _, _, k in sizes) <= 16  # L = 96
    _check(case, out, lse)
