"""Paged-attention cases for the ``mla_fa3.ops`` tests: a named table and adversarial paged caches.

``OP_SPECS`` drives every paged-attention test; each case is built with an adversarial cache: SHUFFLED
page ids, NaN in every cache slot outside a request's first L tokens (tails of last pages, spare pages,
padding page 0) and a huge out-of-range id (2**30) in every unused page-table entry. The oracle sees
only the dense per-request K/V that the builder wrote into the pages. ``FLASHMLA`` / ``build_flashmla``
do the same for FlashMLA's paged latent cache. Shared by ``test_ops.py`` and ``test_ops_gpu.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from oracle import dense_attention

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


OP_SPECS = {
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


# ------------------------------------------------------------------------------- FlashMLA


FLASHMLA = {
    "decode_deepseek": dict(lens=(70, 1, 130), sq=1, heads=16, r=512, d_rope=64, page=64),
    "mtp_sq2_small": dict(lens=(9, 40), sq=2, heads=4, r=32, d_rope=16, page=8),
    "fp8_small": dict(lens=(33, 5), sq=1, heads=4, r=32, d_rope=16, page=16, fp8=True),
    "fp8kv_small": dict(lens=(33, 5, 64), sq=2, heads=4, r=32, d_rope=16, page=16, fp8="kv"),
}


def build_flashmla(c: dict, *, device="cpu", dtype=torch.float32, seed=0):
    """q [bs, sq, H, r + d_rope], kv_cache [pages, page, 1, r + d_rope] (NaN outside used slots), dense oracle inputs.

    ``c["fp8"]``: True — e4m3 q and cache with descales (FlashMLA's FP8 contract); "kv" — an e4m3 cache with its
    descale_k and q in ``dtype`` (the split-KV kernel's read); the oracle sees the dequantized values."""
    g = torch.Generator().manual_seed(seed)
    fp8 = c.get("fp8", False)
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    q_dtype = torch.float8_e4m3fn if fp8 is True else dtype
    ps, D, bs = c["page"], c["r"] + c["d_rope"], len(c["lens"])
    need = [math.ceil(L / ps) for L in c["lens"]]
    ids = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    kv = torch.full((sum(need) + 3, ps, 1, D), float("nan"), dtype=kv_dtype)
    table = torch.full((bs, max(need) + 1), BAD_PAGE, dtype=torch.int32)
    dq, dk = (torch.rand(2, generator=g) + 0.5) if fp8 else (torch.ones(1), torch.ones(1))
    dq = dq if fp8 is True else torch.ones(1)
    q = _quant(torch.randn(bs, c["sq"], c["heads"], D, generator=g), q_dtype)
    dense = []
    for b, L in enumerate(c["lens"]):
        kv_b = _quant(torch.randn(L, 1, D, generator=g), kv_dtype)
        for i in range(need[b]):
            page = ids.pop()
            table[b, i] = page
            kv[page, : min(L, (i + 1) * ps) - i * ps] = kv_b[i * ps : (i + 1) * ps]
        dense.append((q[b].double() * dq.double(), kv_b.double() * dk.double()))
    extra = {}
    if fp8:
        extra = dict(descale_k=dk.view(1).float().to(device))
        if fp8 is True:
            extra["descale_q"] = dq.view(1).float().to(device)
    return q.to(device), kv.to(device), table.to(device), torch.tensor(c["lens"], dtype=torch.int32, device=device), \
        dense, extra


def flashmla_oracle(c: dict, dense, scale):
    outs, lses = zip(*[dense_attention(q_b, kv_b, kv_b[..., : c["r"]], scale=scale, causal=True) for q_b, kv_b in dense])
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------- kernel-vs-oracle check (GPU tests)
LSE_ATOL = 2e-3

def cosine(a, b) -> float:
    a, b = a.double().flatten().cpu(), b.double().flatten().cpu()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def check(out, lse, ref_out, ref_lse, lowp_out, impl_out, *, min_cos=0.9999, lse_atol=LSE_ATOL):
    """out/lse: kernel; ref_*: fp64 oracle (cpu); lowp_out: torch bf16 baseline; impl_out: torch reference."""
    assert torch.isfinite(out).all(), "kernel output holds NaN/inf (read a NaN slot past a sequence?)"
    err = (out.double().cpu() - ref_out).abs().max().item()
    err_pt = (lowp_out.double() - ref_out).abs().max().item() if lowp_out is not None else err
    assert err <= 2 * err_pt + 1e-4, f"kernel error {err:.3g} > 2 x torch-{out.dtype} error {err_pt:.3g}"
    assert cosine(out, impl_out) >= min_cos
    lse, ref_lse = lse.double().cpu(), ref_lse
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys must have lse -inf"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() <= lse_atol
