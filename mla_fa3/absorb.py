"""The absorbed MLA path: attention straight over the latent cache (decode, verify, draft, short extends).

Symbols (all from the model config, never literals): ``T`` new tokens, ``H`` query heads,
``r`` = kv_lora_rank, ``d_nope`` / ``d_rope`` the two parts of a q/k head, ``d_v`` the value head.

Cache, one row per token (one KV head shared by every query head):
    latent(t) = [ c_kv(t) (r) | k_rope(t) (d_rope) ]                  — the "576-wide" row for V3
kv_b_proj, weight ``W [H·(d_nope + d_v), r]``, viewed per head as ``[H, d_nope + d_v, r]``, splits into
    W_UK = W[:, :d_nope, :]   [H, d_nope, r]      k_nope(t, h) = W_UK[h] · c_kv(t)
    W_UV = W[:, d_nope:, :]   [H, d_v, r]         v(t, h)      = W_UV[h] · c_kv(t)
The non-absorbed (MHA) attention of a query ``q(h) = [q_nope(h) | q_rope(h)]`` scores
    s(t, h) = scale · (q_nope(h)·k_nope(t, h) + q_rope(h)·k_rope(t))
and since ``q_nope·(W_UK c_kv) = (q_nope W_UK)·c_kv`` the up-projection can be absorbed into the query:
    q_lat(h) = q_nope(h) · W_UK[h]                       [H, r]        (``absorb_query``)
    s(t, h)  = scale · (q_lat(h)·c_kv(t) + q_rope(h)·k_rope(t))
    o_lat(h) = Σ_t softmax_t(s(·, h)) · c_kv(t)          [H, r]
    o(h)     = W_UV[h] · o_lat(h) = o_lat(h) · W_UVᵀ[h]  [H, d_v]       (``project_output``)
Every step is exact algebra, so the absorbed output equals the MHA one up to rounding. The kernel sees
one KV head of width r + d_rope: FA3 gets ``q = q_rope``, ``k_cache = k_rope`` view, ``v_cache = c_kv``
view, ``qv = q_lat`` (``score = (q·k + qv·v) · scale``); FlashMLA and split-KV get ``q = [q_lat | q_rope]``
over the whole row with ``v = row[..., :r]``. The cache views are slices of the pool's paged buffer: no copies.

FP8 latent cache (``kv_paged`` e4m3, per-tensor scale ``s_kv``): only FlashMLA reads it (FA3 refuses
an e4m3 ``v_cache`` wider than 256). Per step the 576-wide query is quantized on the device with its
own scale ``s_q = absmax / 448`` (``ops.absorb_query_e4m3``: the absorption with q_lat's and the q_rope slice's
absmax partials fused in, then the quantization — two launches on CUDA; no host sync), and FlashMLA computes
    s(t, h) = scale · (s_q · q8(h)) · (s_kv · latent8(t)),    o_lat(h) = Σ_t softmax · s_kv · c_kv8(t)
with ``descale_q = s_q``, ``descale_k = s_kv``. The pool is never dequantized.

Weights are stored in the layouts the per-head matmuls (``ops.head_matmul``: a weight-streaming Triton launch at
decode sizes, ``torch.bmm`` over heads above) want: ``w_uk [H, d_nope, r]`` and ``w_uv [H, r, d_v]`` (= W_UVᵀ per
head), both contiguous.
"""

from __future__ import annotations


import torch

from mla_fa3 import ops
from mla_fa3.layer import AttentionLayer, MLADims, MLAWeights
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.ops.fp8 import FP8_DTYPE
from mla_fa3.policy.paths import DecodeKernel


__all__ = [
    "split_query",
    "absorb_query",
    "project_output",
    "decompress_kv",
    "forward_absorbed",
    "attend_latent",
    "attend_prefix",
    "check_query",
]


def split_query(q: torch.Tensor, dims: MLADims) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, d_nope + d_rope] -> (q_nope [T, H, d_nope], q_rope [T, H, d_rope]) as views."""
    return q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)


def absorb_query(q_nope: torch.Tensor, w: MLAWeights, *, out: torch.Tensor | None = None, impl=None) -> torch.Tensor:
    """q_lat[t, h] = q_nope[t, h] · W_UK[h]: q_nope [T, H, d_nope] -> q_lat [T, H, r] (``ops.head_matmul``: one
    weight-streaming Triton launch at decode batch sizes, one bmm over heads above).

    ``out`` (optional, [T, H, r] possibly a strided view) receives the result in place.
    """
    return ops.head_matmul(q_nope, w.w_uk, out=out, impl=impl)


def project_output(o_lat: torch.Tensor, w: MLAWeights, *, impl=None) -> torch.Tensor:
    """o[t, h] = o_lat[t, h] · W_UVᵀ[h]: o_lat [T, H, r] -> o [T, H, d_v] contiguous (``ops.head_matmul``)."""
    return ops.head_matmul(o_lat, w.w_uv, impl=impl)


def decompress_kv(c_kv: torch.Tensor, w: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The MHA path's up-projection: c_kv [L, r] -> (k_nope [L, H, d_nope], v [L, H, d_v]), contiguous.

    k_nope[t, h] = W_UK[h] · c_kv[t] and v[t, h] = W_UV[h] · c_kv[t] — two plain GEMMs over the rows.
    """
    L, H = c_kv.shape[0], w.num_heads
    k_nope = torch.matmul(c_kv, w.w_uk.view(H * w.qk_nope_head_dim, w.kv_lora_rank).t())
    v = torch.empty(L, H, w.v_head_dim, dtype=c_kv.dtype, device=c_kv.device)
    torch.matmul(c_kv.unsqueeze(0), w.w_uv, out=v.transpose(0, 1))  # [H, L, d_v] written as [L, H, d_v]
    return k_nope.view(L, H, w.qk_nope_head_dim), v


def check_query(q: torch.Tensor, layer: AttentionLayer) -> None:
    """Shape/dtype checks of an MLA query against its layer (no tensor values are read: no sync)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if layer.mla is None or layer.mla_weights is None:
        raise ValueError(f"layer {layer.layer_id}: an MLA layer needs mla dims and mla_weights (MLAWeights.from_kv_b_proj)")
    want = (layer.num_heads, layer.mla.qk_head_dim)
    if q.dim() != 3 or tuple(q.shape[1:]) != want:
        raise ValueError(f"q must be [T, {want[0]}, {want[1]}] (T, H, d_nope + d_rope) for layer "
                         f"{layer.layer_id}, got {tuple(q.shape)}")
    if q.dtype != layer.mla_weights.dtype:
        raise TypeError(f"q dtype {q.dtype} must match layer {layer.layer_id}'s mla_weights dtype {layer.mla_weights.dtype}")
    if q.device != layer.mla_weights.device:
        raise ValueError(f"q is on {q.device} but layer {layer.layer_id}'s mla_weights are on {layer.mla_weights.device}")


def _kernel_tables(layer: AttentionLayer, metadata):
    """(cu_seqlens_q, max_seqlen_q, cache_seqlens, page_table): the layer's view of the step metadata."""
    if layer.use_local_attention:
        local = getattr(metadata, "local", None)
        if local is None:
            raise ValueError(f"layer {layer.layer_id} uses local attention but metadata.local is None "
                             "(build the backend with attention_chunk_size)")
        return local.cu_seqlens_q, local.max_seqlen_q, local.cache_seqlens, local.page_table
    return metadata.cu_seqlens_q, metadata.max_seqlen_q, metadata.cache_seqlens, metadata.page_table


def forward_absorbed(q: torch.Tensor, layer: AttentionLayer, metadata: AttentionMetadata, kv_paged: torch.Tensor, *,
                     kernel: DecodeKernel = DecodeKernel.FA3,
                     schedule: ops.FlashMLASchedule | ops.SplitKVSchedule | ops.FA3Schedule | None = None,
                     kv_scale: torch.Tensor | None = None, impl=None, validate: bool = True) -> torch.Tensor:
    """Absorbed MLA attention of one layer for one step: q [T, H, d_nope + d_rope] -> o [T, H, d_v].

    ``kv_paged``: the layer's latent pool as pages, ``[num_pages, page_size, 1, r + d_rope]``
    (``MLATokenPool.paged(layer_id)``); the new tokens' rows must already be written.
    ``metadata``: the step's ``AttentionMetadata`` (cu_seqlens_q / max_seqlen_q / cache_seqlens /
    page_table). ``schedule``: the step's kernel schedule — FlashMLA's tile schedule for ``kernel=FLASHMLA`` (page
    size 64), the ``SplitKVSchedule`` for ``kernel=SPLITKV`` (any page size); both need equal q lengths
    per request (T = batch_size · max_seqlen_q) — the step plan decides when they apply. For ``kernel=FA3`` an
    ``FA3Schedule`` planned for this layer's calls (``ops.get_fa3_schedule``: the step plan's, for its plain
    layers; FA3 is asked for the split count it was planned with), or None (FA3 plans per call); any other schedule
    is ignored by FA3. An e4m3
    ``kv_paged`` needs ``kernel=FLASHMLA`` (a schedule planned with ``is_fp8=True``; q quantized to e4m3) or
    ``kernel=SPLITKV`` (q kept in its dtype, the cache dequantized in registers), and ``kv_scale``, the
    layer's [1] float32 scale (``MLATokenPool.layer_scale``).
    """
    if validate:
        check_query(q, layer)
    fp8 = _check_fp8_read(kernel, kv_paged, kv_scale, layer)
    dims, w = layer.mla, layer.mla_weights
    q_nope, q_rope = split_query(q, dims)
    if kernel is DecodeKernel.SPLITKV:
        return _splitkv_projected(q_nope, q_rope, layer, metadata, kv_paged, schedule, kv_scale if fp8 else None, impl)
    if kernel is DecodeKernel.FLASHMLA:
        o_lat = _flashmla_latent(q_nope, q_rope, layer, metadata, kv_paged, schedule, kv_scale if fp8 else None, impl)
        return project_output(o_lat, w, impl=impl)
    o_lat = _fa3_latent(absorb_query(q_nope, w, impl=impl), q_rope, layer, metadata, kv_paged, schedule, impl)
    return project_output(o_lat, w, impl=impl)


def attend_latent(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: AttentionLayer, metadata: AttentionMetadata,
                  kv_paged: torch.Tensor, *, kernel: DecodeKernel = DecodeKernel.FA3,
                  schedule: ops.FlashMLASchedule | ops.SplitKVSchedule | ops.FA3Schedule | None = None,
                  kv_scale: torch.Tensor | None = None, impl=None, follows_store: bool = False) -> torch.Tensor:
    """The absorbed attention core, for an engine whose model absorbs W_UK and applies W_UV itself (SGLang's
    DeepSeek): q_lat [T, H, r] and q_rope [T, H, d_rope] (any strides with a contiguous last dim, e.g. the two
    slices of one [T, H, r + d_rope] query) -> o_lat [T, H, r] = Σ_t softmax_t(s) · c_kv(t), with s as in the
    module docstring. Kernels, schedules and the FP8 rules are those of :func:`forward_absorbed`; ``layer`` gives
    heads, scale, softcap and window (its ``mla_weights`` are not read). On an FP8 pool read by FlashMLA, the
    576-wide query is quantized per step on the device (``ops.quantize_query_e4m3``); split-KV reads q as it is.
    ``follows_store``: the caller just stored this step's latent rows into ``kv_paged`` (its last launch), so that
    split-KV may read its prologue while the store runs (``ops.splitkv_mla_with_kvcache``); other kernels ignore it.
    """
    if layer.mla is None:
        raise ValueError(f"layer {layer.layer_id}: attend_latent needs an MLA layer (mla dims)")
    r, T, H = layer.mla.kv_lora_rank, q_lat.shape[0], layer.num_heads
    want = ((T, H, r), (T, H, layer.mla.qk_rope_head_dim))
    if q_lat.dim() != 3 or tuple(q_lat.shape) != want[0] or q_rope.dim() != 3 or tuple(q_rope.shape) != want[1]:
        raise ValueError(f"q_lat and q_rope must be {list(want[0])} and {list(want[1])} (T, H, r / d_rope) for "
                         f"layer {layer.layer_id}, got {tuple(q_lat.shape)} and {tuple(q_rope.shape)}")
    fp8 = _check_fp8_read(kernel, kv_paged, kv_scale, layer)
    if kernel is DecodeKernel.FA3:
        return _fa3_latent(q_lat, q_rope, layer, metadata, kv_paged, schedule, impl)
    bs, sq = _check_whole_row(kernel, q_lat, layer, metadata, schedule)
    kv_scale = kv_scale if fp8 else None
    if kernel is DecodeKernel.SPLITKV:
        return _splitkv(q_lat, q_rope, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, impl,
                        follows_store=follows_store)
    if fp8:
        q_cat, q_scale = ops.quantize_query_e4m3(q_lat, q_rope, impl=impl)
    else:
        q_cat, q_scale = torch.cat([q_lat, q_rope], dim=-1), None
    return _flashmla(q_cat, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, q_scale, q_lat.dtype, impl)


def attend_prefix(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: AttentionLayer, metadata: AttentionMetadata,
                  kv_paged: torch.Tensor, *, kernel: DecodeKernel = DecodeKernel.FA3,
                  schedule: ops.FlashMLASchedule | ops.SplitKVSchedule | ops.FA3Schedule | None = None,
                  kv_scale: torch.Tensor | None = None, impl=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix part of a tree step: every query row of request b over all ``cache_seqlens[b]`` keys, with no
    causal mask -> (o_lat [T, H, r], lse [T, H] float32 natural log). One call of the step's decode kernel with
    ``max_seqlen_q`` query rows per request (FA3 varlen q; FlashMLA / split-KV ``[bs, sq, ...]``), schedules and
    FP8 rules as :func:`attend_latent` (a FlashMLA / split-KV schedule planned for these lengths and rows)."""
    fp8 = _check_fp8_read(kernel, kv_paged, kv_scale, layer)
    if kernel is DecodeKernel.FA3:
        return _fa3_latent(q_lat, q_rope, layer, metadata, kv_paged, schedule, impl, causal=False, return_lse=True)
    bs, sq = _check_whole_row(kernel, q_lat, layer, metadata, schedule)
    kv_scale = kv_scale if fp8 else None
    if kernel is DecodeKernel.SPLITKV:
        return _splitkv(q_lat, q_rope, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, impl, causal=False,
                        return_lse=True)
    if fp8:
        q_cat, q_scale = ops.quantize_query_e4m3(q_lat, q_rope, impl=impl)
    else:
        q_cat, q_scale = torch.cat([q_lat, q_rope], dim=-1), None
    return _flashmla(q_cat, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, q_scale, q_lat.dtype, impl,
                     causal=False, return_lse=True)


def _check_fp8_read(kernel: DecodeKernel, kv_paged: torch.Tensor, kv_scale, layer: AttentionLayer) -> bool:
    """Whether ``kv_paged`` is an e4m3 cache, after refusing the reads it cannot take (named errors, no kernel run)."""
    fp8 = kv_paged.dtype == FP8_DTYPE
    if fp8 and kernel not in (DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV):
        raise ValueError(f"kernel must be FLASHMLA or SPLITKV for an FP8 latent cache (layer {layer.layer_id}): FA3 "
                         f"cannot read an e4m3 latent (HeaddimV > 256 requires fp16/bf16), got {kernel}")
    if fp8 and kv_scale is None:
        raise ValueError(f"kv_scale is None: the FP8 latent cache of layer {layer.layer_id} needs its "
                         "per-tensor scale (MLATokenPool.layer_scale)")
    return fp8


def _fa3_latent(q_lat, q_rope, layer, metadata, kv_paged, schedule, impl, *, causal=True, return_lse=False):
    """o_lat [T, H, r] through FA3 with ``qv``: q = q_rope over the k_rope view, qv = q_lat over the c_kv view
    (with ``return_lse``: (o_lat, lse [T, H]))."""
    r = layer.mla.kv_lora_rank
    cu_seqlens_q, max_seqlen_q, cache_seqlens, page_table = _kernel_tables(layer, metadata)
    schedule = schedule if isinstance(schedule, ops.FA3Schedule) else None
    return ops.flash_attn_with_kvcache(
        q_rope, kv_paged[..., r:], kv_paged[..., :r], qv=q_lat,
        page_table=page_table, cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        softmax_scale=layer.scaling, causal=causal, window_size=layer.window_size,
        softcap=layer.logit_cap, num_splits=0 if schedule is None else schedule.key.num_splits, schedule=schedule,
        return_lse=return_lse, impl=impl,
    )


def _check_whole_row(kernel, q_nope, layer, metadata, schedule) -> tuple[int, int]:
    """(bs, sq) of a FlashMLA / split-KV step, after the checks both share (named errors before any kernel)."""
    name = kernel.value.upper()
    if schedule is None:
        raise ValueError(f"schedule is None: plan the {name} schedule once per step (the step plan does) "
                         f"before running the {name} decode kernel")
    if not layer.is_plain:
        raise ValueError(f"layer {layer.layer_id}: {name} has no softcap / window / local attention; use FA3")
    T = q_nope.shape[0]
    bs, sq = metadata.batch_size, metadata.max_seqlen_q
    if T != bs * sq:
        raise ValueError(f"q has {T} tokens but {name} needs batch_size * max_seqlen_q = {bs} * {sq} "
                         "(equal query length per request)")
    return bs, sq


def _splitkv_projected(q_nope, q_rope, layer, metadata, kv_paged, schedule, kv_scale, impl) -> torch.Tensor:
    """o [T, H, d_v] through split-KV: q_lat absorbed into its own buffer, q_rope read in place from the model's q
    (no concatenation), the output projection W_UV applied by the op (``ops.splitkv_mla_with_kvcache(w_uv=)``: the
    per-head matmul after its combine, or inside the combine with ``KernelConfig.fused_projection``). An FP8 cache
    adds ``descale_k`` only (q is never rounded to e4m3)."""
    bs, sq = _check_whole_row(DecodeKernel.SPLITKV, q_nope, layer, metadata, schedule)
    w = layer.mla_weights
    return _splitkv(absorb_query(q_nope, w, impl=impl), q_rope, bs, sq, layer, metadata, kv_paged, schedule,
                    kv_scale, impl, w_uv=w.w_uv)


def _splitkv(q_lat, q_rope, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, impl, w_uv=None, *, causal=True,
             return_lse=False, follows_store=False):
    """The split-KV call of a checked step: o [T, H, r] (o_lat), or [T, H, d_v] projected by ``w_uv``; q_lat and
    q_rope read where they lie; ``kv_scale`` (FP8 cache) is the only descale. ``return_lse``: (o, lse [T, H])."""
    T, H = q_lat.shape[0], layer.num_heads
    r, width = layer.mla.kv_lora_rank, layer.mla.latent_dim
    descales = {} if kv_scale is None else dict(descale_k=kv_scale)
    o, lse = ops.splitkv_mla_with_kvcache(q_lat.reshape(bs, sq, H, r), kv_paged, metadata.page_table,
                                          metadata.cache_seqlens, head_dim_v=r, schedule=schedule,
                                          softmax_scale=layer.scaling, causal=causal,
                                          q_rope=q_rope.reshape(bs, sq, H, width - r), w_uv=w_uv, impl=impl,
                                          follows_store=follows_store, **descales)
    o = o.view(T, H, o.shape[-1])
    return (o, lse.view(T, H)) if return_lse else o


def _flashmla_latent(q_nope, q_rope, layer, metadata, kv_paged, schedule, kv_scale, impl) -> torch.Tensor:
    """o_lat [T, H, r] through FlashMLA: q = [q_lat | q_rope] over the whole latent row, v = row[..., :r]. q is read
    whole: q_lat is absorbed straight into its slice of q_cat (one launch) and q_rope written by one copy;
    ``kv_scale`` given (FP8 cache): ``ops.absorb_query_e4m3`` writes the e4m3 ``[q_lat | q_rope]`` and its descale
    (per step, on the device); the kernel gets both descales; its output (bf16) is cast back to q's dtype."""
    bs, sq = _check_whole_row(DecodeKernel.FLASHMLA, q_nope, layer, metadata, schedule)
    T, H = q_nope.shape[0], layer.num_heads
    r, width = layer.mla.kv_lora_rank, layer.mla.latent_dim
    q_scale = None
    if kv_scale is not None:
        q_cat, q_scale = ops.absorb_query_e4m3(q_nope, layer.mla_weights.w_uk, q_rope, impl=impl)
    else:
        q_cat = torch.empty(T, H, width, dtype=q_nope.dtype, device=q_nope.device)
        absorb_query(q_nope, layer.mla_weights, out=q_cat[..., :r], impl=impl)
        q_cat[..., r:].copy_(q_rope)
    return _flashmla(q_cat, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, q_scale, q_nope.dtype, impl)


def _flashmla(q_cat, bs, sq, layer, metadata, kv_paged, schedule, kv_scale, q_scale, out_dtype, impl, *, causal=True,
              return_lse=False):
    """The FlashMLA call of a checked step on the whole-row query ``q_cat`` [T, H, r + d_rope] -> o_lat [T, H, r]
    (``return_lse``: (o_lat, lse [T, H])); an FP8 cache passes both descales (``q_scale``: the query's, per step)."""
    T, H, width = q_cat.shape
    r = layer.mla.kv_lora_rank
    descales = {} if kv_scale is None else dict(descale_k=kv_scale, descale_q=q_scale)
    o = ops.flash_mla_with_kvcache(q_cat.view(bs, sq, H, width), kv_paged, metadata.page_table,
                                   metadata.cache_seqlens, head_dim_v=r, schedule=schedule,
                                   softmax_scale=layer.scaling, causal=causal, out_dtype=out_dtype,
                                   return_lse=return_lse, impl=impl, **descales)
    if return_lse:
        return o[0].view(T, H, r), o[1].view(T, H)
    return o.view(T, H, r)
