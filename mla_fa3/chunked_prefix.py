"""MHA prefill over decompressed KV: the new tokens causally, the cached prefix in chunks merged by LSE.

Symbols (``absorb.py``): ``H`` heads, ``r`` = kv_lora_rank, ``d_nope``, ``d_rope``, ``d_v``,
``d_qk = d_nope + d_rope``; a latent row is ``[c_kv (r) | k_rope (d_rope)]``. Request ``b`` has ``p_b``
cached prefix tokens and ``n_b`` new ones (queries ``q [n_b, H, d_qk]``, RoPE applied).

Decompression (per token ``t``, head ``h``): ``k_nope = W_UK[h]·c_kv``, ``v = W_UV[h]·c_kv``,
``k = [k_nope | k_rope]`` (k_rope broadcast over heads), so the layer is ordinary attention with head
dims ``d_qk / d_v`` (192 / 128 for DeepSeek-V3) — cheaper than the absorbed path's ``2r + d_rope``
per score when many queries share the keys.

* one-shot (no prefix): ``o = attn_causal(q, k_new, v_new)`` — one ``flash_attn_varlen_func`` call.
* one pass (prefix and new tokens fit the workspace together, ``P + N <= W``): each request's keys laid out
  ``[prefix_b | new_b]``, one causal call with bottom-right alignment (query ``i`` sees keys ``j <= p_b + i``)
  — exactly the causal set, no merge (``prefill_plan.OnePass``).
* chunked: the new tokens attend to themselves causally, giving ``(o_0, l_0)``; the prefix tokens of
  the whole batch, concatenated request by request, are cut into chunks of at most ``W`` tokens (the
  workspace budget; a chunk may hold slices of several requests and may end mid-page). Chunk ``i``:
  gather its latent rows from the paged pool (slot ids from ``req_to_token``), decompress, and run
  non-causal varlen attention for the queries of the requests it covers -> ``(o_i, l_i)`` (a request
  of the range with no key in the chunk gets ``l_i = -inf``). The prefix lies entirely before every
  new token, so no mask is needed, and the union of the key sets is exactly the causal set:
      l = ln Σ_i e^{l_i},    o = Σ_i o_i · e^{l_i − l}      (natural log: ``lse.merge_states``)

The step, written out (plan once per step in ``prefill_plan``; per layer, ``forward_mha_prefill``)::

    calls = plan.calls[layer config] or validate every call once (first layer of the step)
    kv_new = decompress(latent_new)                       # one GEMM + one rope copy into [N, H, d_v + d_qk]
    o, l = attn_causal(q, k_new, v_new)                   # validated call, this layer's q
    for chunk in plan.chunks:                             # ceil(P / W) chunks; W from the byte budget
        lat = rows[chunk.slot_ids]                         # index_select into the workspace
        kv  = decompress(lat)                              # one GEMM writes [v | k_nope], one copy k_rope
        o_c, l_c = attn(q[chunk.q_lo:chunk.q_hi], kv[..., d_v:], kv[..., :d_v])   # non-causal
        o, l = merge(o, l, o_c, l_c)                       # on the chunk's query rows

Decompression layout: per token and head the workspace row is ``[v (d_v) | k_nope (d_nope) | k_rope
(d_rope)]``, so ``k = row[d_v:]`` and ``v = row[:d_v]`` are views with a contiguous last dim (FA3's
only stride rule) and the GEMM ``c_kv · [W_UVᵀ | W_UKᵀ]`` (``MLAWeights.w_vk``, one batched matmul over
heads) writes both in place; k_rope (shared by the heads) is broadcast into its slice by one
expand-copy — FA3 needs K's head dim contiguous, so the 64 rope columns exist once per head.

Host work per layer and chunk: an index_select, a GEMM, a copy, a q slice and two pre-validated calls
(``ops.prepare_* / run_*``: every shape/dtype/device check runs once per step, in the first layer, for
every chunk; later layers only swap in their q). No host read of a device value, no allocation by
this module (the ops allocate their outputs). Capturable: ``prefill_graph.PrefillGraphs`` captures the MHA
rows of a repeated shape and replays them (``graphs=``). The merges skip FA3's both-empty-row rewrite: the
running state starts from the causal pass, so every row has a key. Memory: the plan's workspace (``W`` tokens of latent and ``[v | k]`` rows) and, per
step, the new tokens' ``[v | k]`` rows.

Split steps (MIXED): decode rows run ``absorb.forward_absorbed`` on the plan's sub-metadata
(:class:`RowSplit`) while the other rows run MHA; the outputs come back in batch order.

FP8 latent pool (e4m3 rows, per-tensor scale ``s``): the prefix rows a chunk reads are gathered in e4m3
and dequantized (``float(x8) · s``) into the chunk's workspace — never the whole pool. The new tokens
attend to their own keys as computed (``latent_new``, not rounded to e4m3), as vLLM's and SGLang's MLA
prefills do; read back from the pool (dequantized) only when ``latent_new`` is None. Decode rows of a
split step run FlashMLA's FP8 decode (their own new row read from the cache, quantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_fa3 import absorb, ops
from mla_fa3.ops.calls import MergeCall, VarlenCall
from mla_fa3.layer import AttentionLayer
from mla_fa3.ops.fp8 import FP8_DTYPE, dequantize_e4m3
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.policy.paths import DecodeKernel
from mla_fa3.prefill_graph import PrefillGraphs
from mla_fa3.prefill_plan import PrefillPlan

__all__ = ["decompress_latent", "forward_mha_prefill"]


# ---------------------------------------------------------------------------------------------------
# forward


def decompress_latent(latent: Tensor, layer, *, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """latent [L, r + d_rope] -> (k [L, H, d_qk] = [W_UK·c_kv | k_rope], v [L, H, d_v] = W_UV·c_kv).

    Both are views of one ``[L, H, d_v + d_qk]`` buffer laid out ``[v | k_nope | k_rope]`` per head
    (``out``, e.g. the workspace's; else a new one): one batched GEMM with ``MLAWeights.w_vk`` writes
    ``[v | k_nope]``, one expand-copy broadcasts k_rope.
    """
    dims = layer.mla
    buf = out if out is not None else latent.new_empty(latent.shape[0], layer.num_heads, dims.v_head_dim + dims.qk_head_dim)
    _Decompress(latent, buf, layer.num_heads, dims).run(layer.mla_weights.w_vk)
    return buf[..., dims.v_head_dim:], buf[..., :dims.v_head_dim]


class _Decompress:
    """The views one decompression reads and writes, made once (per chunk and step) and run per layer."""

    __slots__ = ("c_kv", "gemm_out", "rope_src", "rope_dst")

    def __init__(self, latent: Tensor, buf: Tensor, H: int, dims):
        r, L, vk = dims.kv_lora_rank, latent.shape[0], dims.v_head_dim + dims.qk_nope_head_dim
        self.c_kv = latent[:, :r].unsqueeze(0).expand(H, L, r)  # stride-0 batch: no copy
        self.gemm_out = buf[..., :vk].transpose(0, 1)  # [H, L, d_v + d_nope] written as [L, H, .]
        self.rope_src, self.rope_dst = _rope_broadcast(latent[:, r:], buf[..., vk:], H)

    def run(self, w_vk: Tensor) -> None:
        torch.bmm(self.c_kv, w_vk, out=self.gemm_out)
        self.rope_dst.copy_(self.rope_src)


def _rope_broadcast(src: Tensor, dst: Tensor, H: int) -> tuple[Tensor, Tensor]:
    """(source, destination) views of the k_rope broadcast ``dst[l, h] = src[l]``, as 8-byte words if they allow.

    torch's strided copy costs per element (index arithmetic), not per byte: copying the 64 bf16 rope
    columns as 16 int64 words moves the same bytes in a quarter of the elements (measured on the H200:
    the bf16 copy ran at ~1 TB/s and took 9 % of the 128-head prefill). Bit-exact; views whose strides or
    offset do not allow the reinterpretation keep their dtype.
    """
    try:
        src8, dst8 = src.view(torch.int64), dst.view(torch.int64)
    except RuntimeError:
        src8, dst8 = src, dst
    return src8[:, None].expand(src8.shape[0], H, src8.shape[1]), dst8


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
        raise TypeError(f"plan must be a PrefillPlan (the step plan's prefill), got {type(plan).__name__}")
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


@dataclass(frozen=True)
class _ChunkCalls:
    """One prefix chunk's buffers and validated calls for one layer configuration."""

    latent: Tensor  # [num_keys, r + d_rope] workspace view: the gathered latent rows (pool dtype)
    latent_dq: Tensor | None  # [num_keys, r + d_rope] workspace view: them dequantized (FP8 pool), else None
    kv: Tensor  # [num_keys, H, d_v + d_qk] workspace view: [v | k_nope | k_rope]
    decompress: _Decompress  # latent -> kv
    q_rows: slice  # the chunk's q rows (q_lo:q_hi)
    attn: VarlenCall  # non-causal attention of the chunk's q rows over kv (q swapped per layer)
    merge: MergeCall  # merge of the chunk's state into the running one on rows q_lo:q_hi
    whole: bool  # the chunk's q rows are all the MHA rows (merge the whole state, no row slices)


@dataclass(frozen=True)
class _OnePassCalls:
    """The one-pass layout's buffers and its single causal call (``PrefillPlan.one_pass``)."""

    latent: Tensor  # [P + N, r + d_rope] workspace view: every key's latent row (pool dtype)
    latent_dq: Tensor | None  # [P + N, r + d_rope] workspace view: them dequantized (FP8 pool), else None
    decompress: _Decompress  # (latent_dq or latent) -> the workspace's [v | k] rows
    attn: VarlenCall  # causal (bottom-right) attention of the MHA rows over [prefix_b | new_b]


@dataclass(frozen=True)
class _LayerCalls:
    """Every call of one layer configuration in this step, validated once (first layer)."""

    impl: ops.Impl  # resolved: FA3 or REFERENCE
    latent_new: Tensor | None  # [N, r + d_rope]: the new rows read back from the pool (pool dtype; None in one pass)
    latent_new_dq: Tensor | None  # [N, r + d_rope]: them dequantized (FP8 pool), else None
    kv_new: Tensor | None  # [N, H, d_v + d_qk]: the new tokens' [v | k] (None in one pass)
    attn_new: VarlenCall | None  # causal attention of the MHA rows over their own tokens (None in one pass)
    chunks: tuple[_ChunkCalls, ...]  # empty in one pass
    one_pass: _OnePassCalls | None


def _layer_calls(plan: PrefillPlan, q: Tensor, layer, rows: Tensor, impl) -> _LayerCalls:
    """The step's validated calls for ``layer``'s configuration: cached on the plan, built by its first layer."""
    dims = layer.mla
    key = (q.shape, q.dtype, q.device, rows.dtype, dims, layer.scaling, layer.logit_cap,
           ops.coerce_impl(impl) or ops.get_impl())
    calls = plan.calls.get(key)
    if calls is not None:
        return calls
    N, H, dv, dqk = q.shape[0], layer.num_heads, dims.v_head_dim, dims.qk_head_dim
    common = dict(softmax_scale=layer.scaling, softcap=layer.logit_cap, impl=impl)
    if plan.one_pass is not None:
        calls = plan.calls[key] = _one_pass_calls(plan, q, layer, rows, common)
        return calls
    new_dq = q.new_empty(N, rows.shape[1]) if rows.dtype == FP8_DTYPE else None
    kv_new = q.new_empty(N, H, dv + dqk)
    chosen, attn_new = ops.prepare_flash_attn_varlen(
        q, kv_new[..., dv:], kv_new[..., :dv], cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_q,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_q, causal=True, **common)
    chunks = []
    if plan.chunks:
        ws = plan.workspace
        lat_buf = ws.buffer("latent", (rows.shape[1],), rows.dtype, rows.device)
        dq_buf = ws.buffer("latent_dq", (rows.shape[1],), q.dtype, q.device) if rows.dtype == FP8_DTYPE else None
        kv_buf = ws.buffer("kv", (H, dv + dqk), q.dtype, q.device)
        lse = torch.empty(N, H, dtype=torch.float32, device=q.device)
        o = q.new_empty(N, H, dv)
    for ch in plan.chunks:
        kv = kv_buf[: ch.num_keys]
        q_c = q[ch.q_lo: ch.q_hi]
        _, attn = ops.prepare_flash_attn_varlen(
            q_c, kv[..., dv:], kv[..., :dv], cu_seqlens_q=ch.cu_seqlens_q, cu_seqlens_k=ch.cu_seqlens_k,
            max_seqlen_q=ch.max_seqlen_q, max_seqlen_k=ch.max_seqlen_k, causal=False, **common)
        o_c, lse_c = o[ch.q_lo: ch.q_hi], lse[ch.q_lo: ch.q_hi]
        merge = ops.prepare_merge_state(o_c, lse_c, o_c, lse_c, impl=impl, a_nonempty=True)  # every row sees itself
        lat = lat_buf[: ch.num_keys]
        dq = None if dq_buf is None else dq_buf[: ch.num_keys]
        chunks.append(_ChunkCalls(lat, dq, kv, _Decompress(lat if dq is None else dq, kv, H, dims),
                                  slice(ch.q_lo, ch.q_hi), attn, merge, ch.q_lo == 0 and ch.q_hi == N))
    calls = plan.calls[key] = _LayerCalls(chosen, rows.new_empty(N, rows.shape[1]), new_dq, kv_new, attn_new,
                                          tuple(chunks), None)
    return calls


def _one_pass_calls(plan: PrefillPlan, q: Tensor, layer, rows: Tensor, common) -> _LayerCalls:
    """The validated single call of the one-pass layout over the workspace's first ``P + N`` rows."""
    one, dims, H = plan.one_pass, layer.mla, layer.num_heads
    dv, dqk = dims.v_head_dim, dims.qk_head_dim
    ws = plan.workspace
    lat = ws.buffer("latent", (rows.shape[1],), rows.dtype, rows.device)[: one.num_keys]
    dq = ws.buffer("latent_dq", (rows.shape[1],), q.dtype, q.device)[: one.num_keys] if rows.dtype == FP8_DTYPE \
        else None
    kv = ws.buffer("kv", (H, dv + dqk), q.dtype, q.device)[: one.num_keys]
    chosen, attn = ops.prepare_flash_attn_varlen(
        q, kv[..., dv:], kv[..., :dv], cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=one.cu_seqlens_k,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=one.max_seqlen_k, causal=True, **common)
    calls = _OnePassCalls(lat, dq, _Decompress(lat if dq is None else dq, kv, H, dims), attn)
    return _LayerCalls(chosen, None, None, None, None, (), calls)  # the new rows come with every key


def _mha_rows(q: Tensor, latent: Tensor | None, layer, rows: Tensor, plan: PrefillPlan, kv_scale, impl) -> Tensor:
    """The MHA rows: causal attention over the new tokens, then every prefix chunk merged in.

    An FP8 pool (``kv_scale`` given): each chunk's gathered rows are dequantized into the workspace —
    never the whole pool; the step's own new tokens use their fresh (unquantized) rows when given.

    The LSEs here come straight from ``ops`` (natural log, ``ops.LSE_BASE``) and go straight back to
    ``ops.run_merge_state``; ``lse.merge_states`` is the typed form of the same merge for other callers.
    """
    calls = _layer_calls(plan, q, layer, rows, impl)
    if calls.one_pass is not None:
        return _one_pass(q, latent, layer, rows, plan, calls, kv_scale)
    if latent is None:
        latent = torch.index_select(rows, 0, plan.new_slot_ids, out=calls.latent_new)
        if kv_scale is not None:
            latent = dequantize_e4m3(latent, kv_scale, q.dtype, out=calls.latent_new_dq)
    decompress_latent(latent, layer, out=calls.kv_new)
    o, lse = ops.run_flash_attn_varlen(calls.impl, calls.attn_new.with_q(q))
    w_vk = layer.mla_weights.w_vk
    for ch, c in zip(plan.chunks, calls.chunks):
        torch.index_select(rows, 0, ch.slot_ids, out=c.latent)
        if kv_scale is not None:
            dequantize_e4m3(c.latent, kv_scale, q.dtype, out=c.latent_dq)
        c.decompress.run(w_vk)
        if c.whole:
            o_c, lse_c = ops.run_flash_attn_varlen(calls.impl, c.attn.with_q(q))
            o, lse = ops.run_merge_state(c.merge, o, lse, o_c, lse_c)
            continue
        o_c, lse_c = ops.run_flash_attn_varlen(calls.impl, c.attn.with_q(q[c.q_rows]))
        rows_o, rows_lse = o[c.q_rows], lse[c.q_rows]
        o_m, lse_m = ops.run_merge_state(c.merge, rows_o, rows_lse, o_c, lse_c)
        rows_o.copy_(o_m)
        rows_lse.copy_(lse_m)
    return o


def _one_pass(q: Tensor, latent: Tensor | None, layer, rows: Tensor, plan: PrefillPlan, calls: _LayerCalls,
              kv_scale) -> Tensor:
    """Every key of the step gathered as ``[prefix_b | new_b]``, decompressed once, one causal attention.

    The new tokens' rows come from ``latent`` when given (an FP8 pool: their unquantized values), else
    from the pool with the prefix.
    """
    c = calls.one_pass
    torch.index_select(rows, 0, plan.one_pass.slot_ids, out=c.latent)
    keys = c.latent if kv_scale is None else dequantize_e4m3(c.latent, kv_scale, q.dtype, out=c.latent_dq)
    if latent is not None:
        keys.index_copy_(0, plan.one_pass.new_rows, latent)
    c.decompress.run(layer.mla_weights.w_vk)
    return ops.run_flash_attn_varlen(calls.impl, c.attn.with_q(q))[0]


def forward_mha_prefill(q: Tensor, latent_new: Tensor | None, layer: AttentionLayer, metadata: AttentionMetadata,
                        kv_paged: Tensor, plan: PrefillPlan, *, kv_scale: Tensor | None = None,
                        absorbed_kernel: DecodeKernel = DecodeKernel.FA3,
                        schedule: ops.FlashMLASchedule | ops.SplitKVSchedule | None = None,
                        impl=None, graphs: PrefillGraphs | None = None) -> Tensor:
    """One MLA layer of an extend-like step on the MHA path: q [T, H, d_qk] -> o [T, H, d_v], batch order.

    latent_new ``[T, r + d_rope]``: the step's new latent rows (None: read them back from the pool at
    the plan's slots — they must be stored already). kv_paged: the layer's latent pool,
    ``MLATokenPool.paged(layer_id)`` ``[pages, page_size, 1, r + d_rope]`` (or flat ``[slots, r + d_rope]``).
    plan: the step's :class:`PrefillPlan`. Decode rows of a split step run ``absorb.forward_absorbed``
    on the plan's sub-metadata with ``absorbed_kernel`` (and its ``schedule`` for those rows: FlashMLA's or split-KV's);
    outputs come back in batch order. An FP8 (e4m3) pool needs ``kv_scale`` ([1] float32:
    ``MLATokenPool.layer_scale``); its prefix rows are dequantized chunk by chunk. graphs: a
    :class:`~mla_fa3.prefill_graph.PrefillGraphs` replays the MHA rows from a CUDA graph when the step's
    shape repeats (same result; eager otherwise).
    """
    _check_forward(q, latent_new, layer, kv_paged, plan, kv_scale)
    if kv_paged.dtype != FP8_DTYPE:
        kv_scale = None
    rows = _flat_rows(kv_paged, layer.mla.latent_dim)
    split = plan.split
    if split is None:
        if graphs is not None:
            return graphs.run(_mha_rows, q, latent_new, layer, rows, plan, kv_scale, impl)
        return _mha_rows(q, latent_new, layer, rows, plan, kv_scale, impl)
    q_mha, q_abs = split.split(q)
    lat_mha = None if latent_new is None else latent_new.index_select(0, split.mha_tokens)
    o_mha = _mha_rows(q_mha, lat_mha, layer, rows, plan, kv_scale, impl)
    paged = rows.view(-1, plan.page_size, 1, rows.shape[1])
    o_abs = absorb.forward_absorbed(q_abs, layer, split.absorbed_metadata, paged, kernel=absorbed_kernel,
                                    schedule=schedule, kv_scale=kv_scale, impl=impl, validate=False)
    return split.merge(o_mha, o_abs)
