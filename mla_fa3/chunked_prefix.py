"""MHA prefill over decompressed KV: the new tokens causally, the cached prefix in chunks merged by LSE.

Symbols (``absorb.py``): ``H`` heads, ``r`` = kv_lora_rank, ``d_nope``, ``d_rope``, ``d_v``,
``d_qk = d_nope + d_rope``; a latent row is ``[c_kv (r) | k_rope (d_rope)]``. Request ``b`` has ``p_b``
cached prefix tokens and ``n_b`` new ones (queries ``q [n_b, H, d_qk]``, RoPE applied).

Decompression (per token ``t``, head ``h``): ``k_nope = W_UK[h]·c_kv``, ``v = W_UV[h]·c_kv``,
``k = [k_nope | k_rope]`` (k_rope broadcast over heads), so the layer is ordinary attention with head
dims ``d_qk / d_v`` (192 / 128 for DeepSeek-V3) — cheaper than the absorbed path's ``2r + d_rope``
per score when many queries share the keys.

* one-shot (no prefix): ``o = attn_causal(q, k_new, v_new)`` — one ``flash_attn_varlen_func`` call.
* chunked: the new tokens attend to themselves causally, giving ``(o_0, l_0)``; the prefix tokens of
  the whole batch, concatenated request by request, are cut into chunks of at most ``W`` tokens (the
  workspace budget; a chunk may hold slices of several requests and may end mid-page). Chunk ``i``:
  gather its latent rows from the paged pool (slot ids from ``req_to_token``), decompress, and run
  non-causal varlen attention for the queries of the requests it covers -> ``(o_i, l_i)`` (a request
  of the range with no key in the chunk gets ``l_i = -inf``). The prefix lies entirely before every
  new token, so no mask is needed, and the union of the key sets is exactly the causal set:
      l = ln Σ_i e^{l_i},    o = Σ_i o_i · e^{l_i − l}      (natural log: ``lse.merge_states``)

Plan once per step, run per layer: the step's :class:`PrefillPlan` (``prefill_plan.py``, re-exported
here with :func:`build_prefill_plan` and the rest of the plan) holds the chunks' index tensors;
:func:`forward_mha_prefill` runs one layer with it. Not legal inside a CUDA graph (host loop over
chunks; extend steps are never captured). Memory: every chunk reuses the plan's workspace
(:class:`PrefillWorkspace`, ``W`` tokens of latent rows and assembled K); the per-chunk K_nope / V /
output temporaries are bounded by ``W`` and the step's tokens.

Split steps (MIXED): decode rows run ``absorb.forward_absorbed`` on the plan's sub-metadata
(:class:`RowSplit`) while the other rows run MHA; the outputs come back in batch order.

FP8 latent pool (e4m3 rows, per-tensor scale ``s``): the prefix rows a chunk reads are gathered in e4m3
and dequantized (``float(x8) · s``) into the chunk's workspace — never the whole pool. The new tokens
attend to their own keys as computed (``latent_new``, not rounded to e4m3), as vLLM's and SGLang's MLA
prefills do; read back from the pool (dequantized) only when ``latent_new`` is None. Decode rows of a
split step run FlashMLA's FP8 decode (their own new row read from the cache, quantized).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_fa3 import absorb, ops
from mla_fa3.kv.fp8 import FP8_DTYPE, dequantize_e4m3
from mla_fa3.lse import NaturalLSE, merge_states
from mla_fa3.policy.paths import DecodeKernel
from mla_fa3.prefill_plan import (PrefillPlan, PrefillWorkspace, PrefixChunk, RowSplit, build_prefill_plan,
                                  plan_extend)

__all__ = ["PrefixChunk", "RowSplit", "PrefillWorkspace", "PrefillPlan", "build_prefill_plan", "plan_extend",
           "decompress_latent", "forward_mha_prefill"]


# ---------------------------------------------------------------------------------------------------
# forward


def decompress_latent(latent: Tensor, layer, *, out_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """latent [L, r + d_rope] -> (k [L, H, d_qk] = [W_UK·c_kv | k_rope], v [L, H, d_v] = W_UV·c_kv).

    ``out_k`` (optional, [L, H, d_qk] contiguous) receives k (the chunk workspace).
    """
    dims, w = layer.mla, layer.mla_weights
    r, dn = dims.kv_lora_rank, dims.qk_nope_head_dim
    k_nope, v = absorb.decompress_kv(latent[:, :r], w)
    k = out_k if out_k is not None else latent.new_empty(latent.shape[0], w.num_heads, dims.qk_head_dim)
    k[..., :dn].copy_(k_nope)
    k[..., dn:].copy_(latent[:, None, r:].expand(-1, w.num_heads, -1))
    return k, v


def _flat_rows(kv: Tensor, width: int) -> Tensor:
    """The pool as [slots, width] rows: accepts the layer's paged view [pages, p, 1, width] or flat rows."""
    if kv.shape[-1] != width or kv.dim() not in (2, 4) or (kv.dim() == 4 and kv.shape[2] != 1):
        raise ValueError(f"kv_paged must be [num_pages, page_size, 1, {width}] or [slots, {width}], "
                         f"got {tuple(kv.shape)}")
    try:
        return kv.view(-1, width)
    except RuntimeError:
        raise ValueError(f"kv_paged must be a view of the pool's contiguous rows, got strides {kv.stride()}") from None


def _check_forward(q, latent_new, layer, kv_paged, plan, kv_scale) -> None:
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (metadata.prefill_plan), got {type(plan).__name__}")
    absorb.check_query(q, layer)
    if layer.sliding_window >= 0 or layer.use_local_attention:
        raise ValueError(f"layer {layer.layer_id}: the MHA prefill path has no sliding window / local "
                         "attention; use the absorbed path")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"q must have the plan's {plan.num_tokens} rows, got {q.shape[0]}")
    width = layer.mla.latent_dim
    for t, name in ((kv_paged, "kv_paged"), (latent_new, "latent_new")):
        if t is None and name == "latent_new":
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name == "kv_paged" and t.dtype == FP8_DTYPE and t.device == q.device:
            if not isinstance(kv_scale, Tensor) or kv_scale.dtype != torch.float32 or kv_scale.numel() != 1 \
                    or kv_scale.device != q.device:
                raise ValueError(f"kv_scale must be the FP8 pool's [1] float32 scale on {q.device}, got {kv_scale!r}")
            continue
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must have q's dtype/device ({q.dtype}, {q.device}), got ({t.dtype}, {t.device})")
    if latent_new is not None and tuple(latent_new.shape) != (plan.num_tokens, width):
        raise ValueError(f"latent_new must be [{plan.num_tokens}, {width}], got {tuple(latent_new.shape)}")
    if plan.cu_seqlens_q.device != q.device:
        raise ValueError(f"plan was built on {plan.cu_seqlens_q.device}, q is on {q.device}")


def _gather(rows: Tensor, slot_ids: Tensor, kv_scale: Tensor | None, dtype, ws: PrefillWorkspace | None = None,
            n: int = 0) -> Tensor:
    """Latent rows at ``slot_ids`` in the compute ``dtype`` (dequantized when the pool is FP8).

    ``ws``: gather into the workspace's first ``n`` rows (the chunk buffers) instead of new tensors."""
    if ws is None:
        got = rows.index_select(0, slot_ids)
        return got if kv_scale is None else dequantize_e4m3(got, kv_scale, dtype)
    raw = ws.buffer("latent", (rows.shape[1],), rows.dtype, rows.device)[:n]
    torch.index_select(rows, 0, slot_ids, out=raw)
    if kv_scale is None:
        return raw
    return dequantize_e4m3(raw, kv_scale, dtype, out=ws.buffer("latent_dq", (rows.shape[1],), dtype, rows.device)[:n])


def _mha_rows(q: Tensor, latent: Tensor | None, layer, rows: Tensor, plan: PrefillPlan, kv_scale, impl) -> Tensor:
    """The MHA rows: causal attention over the new tokens, then every prefix chunk merged in."""
    if latent is None:  # the new rows as stored (dequantized for an FP8 pool)
        latent = _gather(rows, plan.new_slot_ids, kv_scale, q.dtype)
    k, v = decompress_latent(latent, layer)
    common = dict(softmax_scale=layer.scaling, softcap=layer.logit_cap, return_lse=True, impl=impl)
    o, lse = ops.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_q, max_seqlen_q=plan.max_seqlen_q,
        max_seqlen_k=plan.max_seqlen_q, causal=True, **common)
    if not plan.chunks:
        return o
    lse = NaturalLSE(lse)
    ws, H = plan.workspace, layer.num_heads
    k_buf = ws.buffer("k", (H, layer.mla.qk_head_dim), q.dtype, q.device)
    del k, v
    for ch in plan.chunks:
        lat = _gather(rows, ch.slot_ids, kv_scale, q.dtype, ws, ch.num_keys)
        kc, vc = decompress_latent(lat, layer, out_k=k_buf[: ch.num_keys])
        o_c, lse_c = ops.flash_attn_varlen_func(
            q[ch.q_lo: ch.q_hi], kc, vc, cu_seqlens_q=ch.cu_seqlens_q, cu_seqlens_k=ch.cu_seqlens_k,
            max_seqlen_q=ch.max_seqlen_q, max_seqlen_k=ch.max_seqlen_k, causal=False, **common)
        if ch.q_lo == 0 and ch.q_hi == q.shape[0]:
            o, lse = merge_states(o, lse, o_c, NaturalLSE(lse_c), impl=impl)
        else:
            o_m, lse_m = merge_states(o[ch.q_lo: ch.q_hi], NaturalLSE(lse.value[ch.q_lo: ch.q_hi]), o_c,
                                      NaturalLSE(lse_c), impl=impl)
            o[ch.q_lo: ch.q_hi] = o_m
            lse.value[ch.q_lo: ch.q_hi] = lse_m.value
    return o


def forward_mha_prefill(q: Tensor, latent_new: Tensor | None, layer, metadata, kv_paged: Tensor,
                        plan: PrefillPlan | None = None, *, kv_scale: Tensor | None = None,
                        absorbed_kernel: DecodeKernel = DecodeKernel.FA3, schedule: ops.FlashMLASchedule | None = None,
                        impl=None) -> Tensor:
    """One MLA layer of an extend-like step on the MHA path: q [T, H, d_qk] -> o [T, H, d_v], batch order.

    latent_new ``[T, r + d_rope]``: the step's new latent rows (None: read them back from the pool at
    the plan's slots — they must be stored already). kv_paged: the layer's latent pool,
    ``MLATokenPool.paged(layer_id)`` ``[pages, page_size, 1, r + d_rope]`` (or flat ``[slots, r + d_rope]``).
    plan: the step's :class:`PrefillPlan` (default ``metadata.prefill_plan``). Decode rows of a split
    step run ``absorb.forward_absorbed`` on the plan's sub-metadata with ``absorbed_kernel`` (and
    FlashMLA's ``schedule`` for those rows); outputs come back in batch order. An FP8 (e4m3) pool needs
    ``kv_scale`` ([1] float32: ``MLATokenPool.layer_scale``); its prefix rows are dequantized per chunk.
    """
    plan = getattr(metadata, "prefill_plan", None) if plan is None else plan
    _check_forward(q, latent_new, layer, kv_paged, plan, kv_scale)
    if kv_paged.dtype != FP8_DTYPE:
        kv_scale = None
    rows = _flat_rows(kv_paged, layer.mla.latent_dim)
    split = plan.split
    if split is None:
        return _mha_rows(q, latent_new, layer, rows, plan, kv_scale, impl)
    q_mha, q_abs = split.split(q)
    lat_mha = None if latent_new is None else latent_new.index_select(0, split.mha_tokens)
    o_mha = _mha_rows(q_mha, lat_mha, layer, rows, plan, kv_scale, impl)
    paged = rows.view(-1, plan.page_size, 1, rows.shape[1])
    o_abs = absorb.forward_absorbed(q_abs, layer, split.absorbed_metadata, paged, kernel=absorbed_kernel,
                                    schedule=schedule, kv_scale=kv_scale, impl=impl, validate=False)
    return split.merge(o_mha, o_abs)
