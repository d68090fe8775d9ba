"""Independent fp64 oracles for the tests: dense attention with explicit masks, non-absorbed MLA.

Written from the definitions, sharing no code with the library, one request at a time.

Dense attention for one request with n queries over L keys (the n queries are the last n positions):
    s[h, i, j] = scale * (q[i,h]·k[j,g(h)] + qv[i,h]·v[j,g(h)])     (qv term only for MLA)
    s = softcap * tanh(s / softcap)                                 (when softcap > 0)
    query i sits at position p = L - n + i; key j is visible iff
        (not causal or j <= p) and (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
    out = softmax(s) · v, lse = logsumexp(s) (natural log; -inf and out 0 when nothing is visible)
"""

from __future__ import annotations

import torch


def visible_mask(n: int, L: int, *, causal: bool, window=(-1, -1)) -> torch.Tensor:
    """[n, L] bool mask of the keys each of the n last-position queries sees (bottom-right aligned)."""
    pos = torch.arange(L - n, L).unsqueeze(1)  # [n, 1]
    key = torch.arange(L).unsqueeze(0)  # [1, L]
    mask = torch.ones(n, L, dtype=torch.bool)
    if causal:
        mask &= key <= pos
    left, right = window
    if left >= 0:
        mask &= key >= pos - left
    if right >= 0:
        mask &= key <= pos + right
    return mask


def dense_attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, qv=None, mask=None):
    """fp64 attention of one request. q [n, H, dq], k [L, Hkv, dq], v [L, Hkv, dv], qv [n, H, dv].

    Inputs may live on any device; the oracle computes on the CPU.
    Returns (out [n, H, dv] fp64 cpu, lse [n, H] fp64 cpu, natural log).
    """
    q, k, v = q.detach().cpu().double(), k.detach().cpu().double(), v.detach().cpu().double()
    n, H, _ = q.shape
    L, Hkv, _ = k.shape
    group = H // Hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k)
    if qv is not None:
        s = s + torch.einsum("nhd,lhd->hnl", qv.detach().cpu().double(), v)
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if mask is None:
        mask = visible_mask(n, L, causal=causal, window=window)
    s = s.masked_fill(~mask.cpu().unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, n]
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hnl,lhd->nhd", p, v)
    return out, lse.transpose(0, 1).contiguous()


def mla_nonabsorbed(q, c_kv, k_rope, kv_b_proj_weight, *, qk_nope_head_dim, v_head_dim, scale, causal=True):
    """Non-absorbed MLA for one request, fp64: decompress c_kv through kv_b_proj into per-head K and V.

    q [n, H, d_nope + d_rope] (RoPE applied), c_kv [L, r], k_rope [L, d_rope],
    kv_b_proj_weight [H * (d_nope + d_v), r]. Returns (out [n, H, d_v], lse [n, H]).
    """
    n, H, _ = q.shape
    L = c_kv.shape[0]
    c_kv, k_rope = c_kv.detach().cpu(), k_rope.detach().cpu()
    w = kv_b_proj_weight.detach().cpu().double().view(H, qk_nope_head_dim + v_head_dim, -1)
    kv = torch.einsum("lr,hdr->lhd", c_kv.double(), w)  # [L, H, d_nope + d_v]
    k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]
    k = torch.cat([k_nope, k_rope.double().unsqueeze(1).expand(L, H, -1)], dim=-1)
    return dense_attention(q, k, v, scale=scale, causal=causal)
