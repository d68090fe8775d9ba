"""Pure-torch reference of every kernel in ``mla_fa3.ops``: the semantic oracle, on any device.

Math (per request b with L keys and n new queries; query i sits at position p = L - n + i):
    s_ij = scale · (q_i·k_j + qv_i·v_j)                (qv term only with qv: absorbed MLA)
    s_ij = cap · tanh(s_ij / cap)                      (softcap cap > 0, after scaling)
    visible(i, j) = (not causal or j <= p) and (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
    out_i = Σ_j softmax_j(s_i) · v_j,   lse_i = ln Σ_j exp(s_ij)   (-inf and out 0 if nothing is visible)
GQA: query head h reads KV head h // (H / H_kv). FP8 inputs are dequantized as ``x.float() · descale``.

How it computes: fp32 accumulation, one request at a time; keys are streamed in blocks of at most
``KEY_BLOCK`` with an online softmax (running max m, running sum l, accumulator acc), queries in
chunks so that no more than ~``SCORE_BUDGET`` scores exist at once — never a [bs, L, L] tensor.
Only the keys 0..L-1 of a request are gathered, through ``page_table[b, j // page_size]``: unused
page-table entries (garbage ids) and cache slots past L (NaN) are never read.

Not for hot paths: the reference reads ``cache_seqlens`` / ``cu_seqlens`` on the host (a sync on
CUDA), so it cannot be captured in a CUDA graph. Because it reads them anyway, it also checks the
values (lengths vs page-table capacity, page ids in range) and raises ``ValueError`` when they are wrong.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .calls import FlashMLACall, KVCacheCall, VarlenCall

Tensor = torch.Tensor
KEY_BLOCK = 2048  # keys per online-softmax step
SCORE_BUDGET = 1 << 24  # max fp32 scores alive at once (64 MiB)

KVGetter = Callable[[int, int], Tuple[Tensor, Tensor]]  # (j0, j1) -> (k [j1-j0, H_kv, d], v [.., d_v]) fp32


def _attend(
    q: Tensor,
    qv: Optional[Tensor],
    get_kv: KVGetter,
    L: int,
    *,
    h_kv: int,
    dv: int,
    scale: float,
    causal: bool,
    window: Tuple[int, int],
    softcap: float,
) -> Tuple[Tensor, Tensor]:
    """Attention of one request. q [n, H, d] fp32, qv [n, H, d_v] fp32 or None -> (out [n, H, d_v], lse [n, H])."""
    n, H, d = q.shape
    group = H // h_kv
    out = q.new_zeros(n, H, dv)
    lse = q.new_full((n, H), float("-inf"))
    if n == 0:
        return out, lse
    left, right = window
    q_chunk = max(1, SCORE_BUDGET // max(1, H * min(KEY_BLOCK, max(L, 1))))
    for i0 in range(0, n, q_chunk):
        i1 = min(n, i0 + q_chunk)
        nq = i1 - i0
        p_lo, p_hi = L - n + i0, L - n + i1 - 1  # positions of the chunk's first and last query
        k_lo = max(0, p_lo - left) if left >= 0 else 0
        k_hi = L
        if causal:
            k_hi = min(k_hi, p_hi + 1)
        if right >= 0:
            k_hi = min(k_hi, p_hi + right + 1)
        if k_lo >= k_hi:
            continue  # no query of this chunk sees a key: out 0, lse -inf
        # [nq, H, d] -> [H_kv, group * nq, d]: query head h = g * group + r reads KV head g
        qh = q[i0:i1].reshape(nq, h_kv, group, d).permute(1, 2, 0, 3).reshape(h_kv, group * nq, d)
        qvh = None
        if qv is not None:
            qvh = qv[i0:i1].reshape(nq, h_kv, group, dv).permute(1, 2, 0, 3).reshape(h_kv, group * nq, dv)
        pos = torch.arange(p_lo, p_hi + 1, device=q.device).unsqueeze(1)  # [nq, 1]
        m = q.new_full((h_kv, group * nq), float("-inf"))
        l = q.new_zeros(h_kv, group * nq)
        acc = q.new_zeros(h_kv, group * nq, dv)
        for j0 in range(k_lo, k_hi, KEY_BLOCK):
            j1 = min(k_hi, j0 + KEY_BLOCK)
            k, v = get_kv(j0, j1)
            kh, vh = k.permute(1, 0, 2), v.permute(1, 0, 2)  # [H_kv, kb, d], [H_kv, kb, d_v]
            s = torch.bmm(qh, kh.transpose(1, 2))
            if qvh is not None:
                s = s + torch.bmm(qvh, vh.transpose(1, 2))
            s = s * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            key = torch.arange(j0, j1, device=q.device).unsqueeze(0)  # [1, kb]
            visible = torch.ones(nq, j1 - j0, dtype=torch.bool, device=q.device)
            if causal:
                visible &= key <= pos
            if left >= 0:
                visible &= key >= pos - left
            if right >= 0:
                visible &= key <= pos + right
            s = s.view(h_kv, group, nq, j1 - j0).masked_fill(~visible, float("-inf")).view(h_kv, group * nq, -1)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))  # masked keys: exp(-inf) = 0
            alpha = torch.exp(m - m_safe)  # m = -inf (nothing seen yet) -> 0
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.bmm(p, vh)
            m = m_new
        seen = l > 0
        o = torch.where(seen.unsqueeze(-1), acc / torch.where(seen, l, torch.ones_like(l)).unsqueeze(-1), 0.0)
        ls = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), float("-inf"))
        out[i0:i1] = o.view(h_kv, group, nq, dv).permute(2, 0, 1, 3).reshape(nq, H, dv)
        lse[i0:i1] = ls.view(h_kv, group, nq).permute(2, 0, 1).reshape(nq, H)
    return out, lse


def _dequant(x: Tensor, scale: Optional[Tensor]) -> Tensor:
    """x [..., H_kv, d] -> fp32, multiplied by scale [H_kv] when given."""
    x = x.float()
    return x if scale is None else x * scale.view(-1, 1)


def _paged_getter(call: KVCacheCall, b: int, L: int) -> KVGetter:
    page_size = call.k_cache.shape[1]
    num_pages = call.k_cache.shape[0]
    used = -(-L // page_size)
    if used > call.page_table.shape[1]:
        raise ValueError(
            f"cache_seqlens[{b}] = {L} needs {used} pages but page_table has {call.page_table.shape[1]} columns"
        )
    row = call.page_table[b, :used].long()
    if used and bool(((row < 0) | (row >= num_pages)).any()):
        raise ValueError(f"page_table[{b}, :{used}] holds page ids outside [0, {num_pages}) for cache_seqlens {L}")
    k_scale = None if call.k_descale is None else call.k_descale[b].float()
    v_scale = None if call.v_descale is None else call.v_descale[b].float()

    def get(j0: int, j1: int) -> Tuple[Tensor, Tensor]:
        j = torch.arange(j0, j1, device=row.device)
        pages, offs = row[j // page_size], j % page_size
        return _dequant(call.k_cache[pages, offs], k_scale), _dequant(call.v_cache[pages, offs], v_scale)

    return get


def _query(x: Tensor, q_scale: Optional[Tensor], h_kv: int) -> Tensor:
    """[n, H, d] -> fp32, times the per-KV-head q descale [H_kv] (broadcast over each head group)."""
    x = x.float()
    if q_scale is None:
        return x
    n, H, d = x.shape
    return (x.view(n, h_kv, H // h_kv, d) * q_scale.float().view(1, h_kv, 1, 1)).view(n, H, d)


def flash_attn_with_kvcache(call: KVCacheCall) -> Tuple[Tensor, Tensor]:
    """Reference of ``ops.flash_attn_with_kvcache`` -> (out, lse ``out.shape[:-1]`` float32 natural log)."""
    q, h_kv, dv = call.q, call.k_cache.shape[2], call.v_cache.shape[3]
    out = torch.empty(*q.shape[:-1], dv, dtype=call.out_dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    lens = call.cache_seqlens.tolist()
    if call.varlen:
        cu = call.cu_seqlens_q.tolist()
        if cu[0] != 0 or cu[-1] != q.shape[0] or any(a > b for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens_q must rise from 0 to q's {q.shape[0]} tokens, got {cu}")
        rows = [slice(cu[b], cu[b + 1]) for b in range(call.batch_size)]
    else:
        rows = list(range(call.batch_size))
    for b, L in enumerate(lens):
        if L < 0:
            raise ValueError(f"cache_seqlens[{b}] must be >= 0, got {L}")
        q_scale = None if call.q_descale is None else call.q_descale[b]
        qb = _query(q[rows[b]], q_scale, h_kv)
        qvb = None if call.qv is None else _query(call.qv[rows[b]], q_scale, h_kv)
        o, s = _attend(
            qb, qvb, _paged_getter(call, b, L), L, h_kv=h_kv, dv=dv, scale=call.softmax_scale,
            causal=call.causal, window=call.window_size, softcap=call.softcap,
        )
        out[rows[b]] = o.to(call.out_dtype)
        lse[rows[b]] = s
    return out, lse


def flash_attn_varlen_func(call: VarlenCall) -> Tuple[Tensor, Tensor]:
    """Reference of ``ops.flash_attn_varlen_func`` -> (out [T_q, H, d_v], lse [T_q, H] float32 natural log)."""
    q, k, v = call.q, call.k, call.v
    h_kv, dv = k.shape[1], v.shape[2]
    out = torch.empty(q.shape[0], q.shape[1], dv, dtype=call.out_dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    for name, cu, total in (("cu_seqlens_q", cu_q, q.shape[0]), ("cu_seqlens_k", cu_k, k.shape[0])):
        if cu[0] != 0 or cu[-1] != total or any(a > b for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must rise from 0 to the {total} rows of its tensor, got {cu}")
    for b in range(call.batch_size):
        k0, L = cu_k[b], cu_k[b + 1] - cu_k[b]

        def get(j0: int, j1: int, k0: int = k0) -> Tuple[Tensor, Tensor]:
            return k[k0 + j0 : k0 + j1].float(), v[k0 + j0 : k0 + j1].float()

        o, s = _attend(
            q[cu_q[b] : cu_q[b + 1]].float(), None, get, L, h_kv=h_kv, dv=dv, scale=call.softmax_scale,
            causal=call.causal, window=call.window_size, softcap=call.softcap,
        )
        out[cu_q[b] : cu_q[b + 1]] = o.to(call.out_dtype)
        lse[cu_q[b] : cu_q[b + 1]] = s
    return out, lse


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Reference of ``ops.merge_state``: o = Σ_x o_x·e^(lse_x - lse), lse = logaddexp(lse_a, lse_b).

    Stable (max trick). Any infinite LSE marks an empty state (FA3 and FlashMLA write +inf for rows
    without keys), so its o is ignored even when it holds NaN; both empty -> o 0, lse -inf.
    """
    neg_inf = torch.tensor(float("-inf"), device=lse_a.device)
    la = torch.where(torch.isinf(lse_a), neg_inf, lse_a.float())
    lb = torch.where(torch.isinf(lse_b), neg_inf, lse_b.float())
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    live = total > 0
    lse = torch.where(live, m_safe + torch.log(torch.where(live, total, torch.ones_like(total))), neg_inf)
    oa = torch.where((wa > 0).unsqueeze(-1), o_a.float() * wa.unsqueeze(-1), 0.0)
    ob = torch.where((wb > 0).unsqueeze(-1), o_b.float() * wb.unsqueeze(-1), 0.0)
    o = (oa + ob) / torch.where(live, total, torch.ones_like(total)).unsqueeze(-1)
    return o.to(o_a.dtype), lse


def flash_mla_with_kvcache(call: FlashMLACall) -> Tuple[Tensor, Tensor]:
    """Reference of ``ops.flash_mla_with_kvcache``: paged attention with k = kv, v = kv[..., :head_dim_v].

    Same math as ``flash_attn_with_kvcache`` with q = q[..., r:], k_cache = k_rope, qv = q[..., :r],
    v_cache = c_kv (score over all 576 dims); FP8 descales (1,) apply to every request and head.
    """
    bs = call.q.shape[0]
    expand = None if call.descale_k is None else call.descale_k.view(1, 1).expand(bs, 1)
    q_scale = None if call.descale_q is None else call.descale_q.view(1, 1).expand(bs, 1)
    q = call.q if call.q_rope is None else torch.cat([call.q, call.q_rope], dim=-1)
    inner = KVCacheCall(
        q=q, k_cache=call.kv_cache, v_cache=call.kv_cache[..., : call.head_dim_v], qv=None,
        page_table=call.page_table, cache_seqlens=call.cache_seqlens, cu_seqlens_q=None, max_seqlen_q=None,
        softmax_scale=call.softmax_scale, causal=call.causal, window_size=(-1, -1), softcap=0.0,
        k_descale=expand, v_descale=expand, q_descale=q_scale, num_splits=0, batch_size=bs, varlen=False,
        out_dtype=call.out_dtype,
    )
    return flash_attn_with_kvcache(inner)
