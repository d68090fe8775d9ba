"""The tree part of a speculative tree step: each query row over the draft tokens its tree mask shows it.

Symbols: ``bs`` requests, ``m`` query rows and ``n`` tree keys per request (``n <= 64``: the tree part is
tiny), ``H`` heads, ``r`` = kv_lora_rank, ``d_rope``, ``D = r + d_rope`` the latent row. For query row i of
request b (token-major row ``t = b*m + i``) and its visible keys ``V = {j : mask[b, i, j]}``:

    row_j   = kv[key_slots[b, j]]  (· kv_scale for an e4m3 cache)        = [c_kv_j (r) | k_rope_j (d_rope)]
    s_j     = scale · (q_lat[t]·c_kv_j + q_rope[t]·k_rope_j)            (softcap·tanh(s/softcap) if softcap > 0)
    out[t]  = Σ_{j∈V} softmax(s)_j · c_kv_j      [H, r]
    lse[t]  = ln Σ_{j∈V} exp(s_j)               [H] float32, natural log (-inf, out 0 when V is empty)

— the absorbed MLA state over the tree keys. ``prior=(o_P, lse_P)`` (the prefix part's state: a disjoint key set)
merges it in the same call — ``lse = ln(e^lse_P + e^lse_T)``, ``out = e^(lse_P - lse)·o_P + e^(lse_T - lse)·out_T``,
rounded once — and returns the state over the union (what a tree step needs; no separate merge).

Two implementations, one contract (``impl=``, as the other kernels of ``mla_fa3.ops``):

- TRITON (``tree_attention_triton.py``): one launch, the (row, head) pairs of a request as the M dimension of a tile,
  the dots in q's dtype with fp32 accumulation, P rounded to q's dtype before P·V (as FA3 and FlashMLA do). AUTO and
  FA3 ("the compiled kernels") run it on CUDA wherever Triton imports; TRITON asks for it (on the CPU only under
  ``TRITON_INTERPRET=1``, in tests; a named error elsewhere).
- REFERENCE, plain torch on every device (AUTO's choice off CUDA or without Triton): gather the ``bs·n`` rows once,
  fp32 scores ``[bs, m, H, n]`` under the mask, fp32 softmax and sums, the output rounded once to q's dtype.

Neither reads a host value (graph-capturable). Keys no query of their request sees are never used (the reference
zeroes them, the kernel does not load them), so garbage there (a future draft step's slot, a poisoned row) cannot
reach the output through ``0 · NaN``. The tests compare both with an fp64 oracle that builds the whole
causal-plus-tree mask itself.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _checks as chk
from .fp8 import FP8_DTYPE
from .selection import ImplLike, coerce, get_impl
from .triton_ops import _kernel_not_torch, _on, _triton_module
from .types import Impl

__all__ = ["tree_attention"]

Tensor = torch.Tensor


def tree_attention(q_lat: Tensor, q_rope: Tensor, kv: Tensor, key_slots: Tensor, mask: Tensor, *,
                   softmax_scale: float, softcap: float = 0.0, kv_scale: Optional[Tensor] = None,
                   prior: Optional[Tuple[Tensor, Tensor]] = None,
                   impl: Optional[ImplLike] = None) -> Tuple[Tensor, Tensor]:
    """(out [T, H, r] in q_lat's dtype, lse [T, H] float32 natural log) of the tree part (module docstring), merged
    with ``prior`` = (o [T, H, r] floating, lse [T, H] float32 natural log; any strides) when given.

    q_lat ``[T, H, r]``, q_rope ``[T, H, d_rope]`` (any strides), kv ``[num_slots, r + d_rope]`` — the layer's
    latent rows (``MLATokenPool.kv_buffer[layer]``, or the paged view flattened), key_slots ``[bs, n]`` int64
    pool slots of each request's tree keys, mask ``[bs, m, n]`` bool with ``T = bs · m``; ``kv_scale`` [1]
    float32 for an e4m3 ``kv`` (required then). Checks read shapes, dtypes and devices only. ``impl``: module
    docstring (not recorded by ``last_impl()``, which keeps telling the step's prefix kernel).
    """
    _check(q_lat, q_rope, kv, key_slots, mask, softmax_scale, softcap, kv_scale)
    _check_prior(prior, q_lat)
    chosen = get_impl() if impl is None else coerce(impl)
    kernels = _triton_module("tree")
    if _kernel_not_torch(chosen, q_lat.device, kernels, "tree attention"):
        if mask.shape[2] > kernels.MAX_KEYS:
            if chosen is Impl.TRITON:
                raise ValueError(f"impl='triton': the tree kernel takes at most {kernels.MAX_KEYS} tree keys per "
                                 f"request, got {mask.shape[2]}")
        else:
            with _on(q_lat.device):
                return kernels.tree_attention(q_lat, q_rope, kv, key_slots, mask, softmax_scale=softmax_scale,
                                              softcap=softcap, kv_scale=kv_scale, prior=prior)
    return _tree_attention_torch(q_lat, q_rope, kv, key_slots, mask, softmax_scale=softmax_scale, softcap=softcap,
                                 kv_scale=kv_scale, prior=prior)


def _tree_attention_torch(q_lat, q_rope, kv, key_slots, mask, *, softmax_scale, softcap, kv_scale, prior=None):
    """The REFERENCE form (module docstring)."""
    bs, m, n = mask.shape
    T, H, r = q_lat.shape
    rows = kv.index_select(0, key_slots.reshape(-1)).view(bs, n, kv.shape[1]).float()
    if kv_scale is not None:
        rows = rows * kv_scale
    rows = rows.masked_fill(~mask.any(dim=1).unsqueeze(-1), 0.0)  # keys no query sees: never read
    c_kv, k_rope = rows[..., :r], rows[..., r:]
    ql = q_lat.reshape(bs, m, H, r).float()
    qr = q_rope.reshape(bs, m, H, q_rope.shape[-1]).float()
    s = (torch.einsum("bmhr,bnr->bmhn", ql, c_kv) + torch.einsum("bmhd,bnd->bmhn", qr, k_rope)) * softmax_scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [bs, m, H]
    p = torch.exp(s - lse.unsqueeze(-1))
    p = p.masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)  # a row with no visible key: out 0, lse -inf
    out = torch.einsum("bmhn,bnr->bmhr", p, c_kv).reshape(T, H, r)
    lse = lse.reshape(T, H)
    if prior is not None:  # fp32 merge with the prior state, one rounding below
        o_p, lse_p = prior[0].float(), prior[1]
        top = torch.maximum(lse, lse_p)
        top = top.masked_fill(torch.isneginf(top), 0.0)
        w_t, w_p = torch.exp(lse - top), torch.exp(lse_p - top)
        tot = w_t + w_p
        inv = torch.where(tot > 0, 1.0 / tot.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        out = out * (w_t * inv).unsqueeze(-1) + o_p * (w_p * inv).unsqueeze(-1)
        lse = torch.where(tot > 0, top + torch.log(tot.clamp_min(torch.finfo(torch.float32).tiny)), float("-inf"))
    return out.to(q_lat.dtype), lse


def _check_prior(prior, q_lat: Tensor) -> None:
    if prior is None:
        return
    if not isinstance(prior, tuple) or len(prior) != 2:
        raise TypeError(f"prior must be None or a tuple (o, lse), got {type(prior).__name__}")
    o, lse = prior
    chk.tensor(o, "prior's o")
    chk.tensor(lse, "prior's lse")
    if tuple(o.shape) != tuple(q_lat.shape) or not o.dtype.is_floating_point:
        raise ValueError(f"prior's o must be a floating [T, H, r] = {list(q_lat.shape)} tensor, got {o.dtype} "
                         f"{tuple(o.shape)}")
    if tuple(lse.shape) != tuple(q_lat.shape[:2]) or lse.dtype != torch.float32:
        raise ValueError(f"prior's lse must be a [T, H] = {list(q_lat.shape[:2])} float32 tensor, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    for x, name in ((o, "prior's o"), (lse, "prior's lse")):
        if x.device != q_lat.device:
            raise ValueError(f"{name} must be on q_lat's device {q_lat.device}, got {x.device}")


def _check(q_lat, q_rope, kv, key_slots, mask, softmax_scale, softcap, kv_scale) -> None:
    for x, name in ((q_lat, "q_lat"), (q_rope, "q_rope"), (kv, "kv"), (key_slots, "key_slots"), (mask, "mask")):
        chk.tensor(x, name)
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_lat and q_rope must be [T, H, r] and [T, H, d_rope], got {tuple(q_lat.shape)} and "
                         f"{tuple(q_rope.shape)}")
    if not q_lat.dtype.is_floating_point or q_rope.dtype != q_lat.dtype:
        raise TypeError(f"q_lat and q_rope must share one floating dtype, got {q_lat.dtype} and {q_rope.dtype}")
    r, dr = q_lat.shape[2], q_rope.shape[2]
    if kv.dim() != 2 or kv.shape[1] != r + dr:
        raise ValueError(f"kv must be [num_slots, r + d_rope = {r + dr}], got {tuple(kv.shape)}")
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise TypeError(f"mask must be a [bs, m, n] bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    bs, m, n = mask.shape
    if key_slots.dtype != torch.int64 or tuple(key_slots.shape) != (bs, n):
        raise ValueError(f"key_slots must be [bs, n] = [{bs}, {n}] int64, got {key_slots.dtype} "
                         f"{tuple(key_slots.shape)}")
    if q_lat.shape[0] != bs * m:
        raise ValueError(f"q_lat must have bs * m = {bs * m} rows (mask [bs, m, n]), got {q_lat.shape[0]}")
    for x, name in ((q_rope, "q_rope"), (kv, "kv"), (key_slots, "key_slots"), (mask, "mask")):
        if x.device != q_lat.device:
            raise ValueError(f"{name} must be on q_lat's device {q_lat.device}, got {x.device}")
    if kv.dtype == FP8_DTYPE:
        if kv_scale is None:
            raise ValueError("kv_scale is None: an e4m3 kv needs its per-tensor scale")
    elif not kv.dtype.is_floating_point:
        raise TypeError(f"kv must be a floating or e4m3 tensor, got {kv.dtype}")
    if kv_scale is not None and (kv_scale.dtype != torch.float32 or kv_scale.numel() != 1
                                 or kv_scale.device != q_lat.device):
        raise ValueError(f"kv_scale must be a [1] float32 tensor on {q_lat.device}, got {kv_scale.dtype} "
                         f"{tuple(kv_scale.shape)} on {kv_scale.device}")
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0, got {softcap!r}")
