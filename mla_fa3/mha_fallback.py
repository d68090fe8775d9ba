"""The generic path: regular (GQA / MQA) self-attention and cross-attention layers over the MHA pool.

Models mix MLA layers with ordinary attention layers, and encoder-decoder models need
cross-attention; this module serves ``LayerKind.MHA`` and ``LayerKind.CROSS`` layers with the SAME
per-step :class:`~mla_fa3.metadata.AttentionMetadata` the MLA paths read, through one kernel call:
``ops.flash_attn_with_kvcache`` over the paged :class:`~mla_fa3.kv.MHATokenPool`.

Symbols (one layer): ``H`` query heads, ``H_kv`` KV heads (``H % H_kv == 0``; query head ``h`` reads
KV head ``h // (H / H_kv)``: GQA, MQA when ``H_kv = 1``), ``d`` q/k head dim, ``d_v`` v head dim,
``scale`` = ``layer.scaling``, ``cap`` = ``layer.logit_cap``, ``W`` = ``layer.sliding_window``,
``C`` = the builder's ``attention_chunk_size``. Request ``b`` has ``n_b`` new tokens (queries) and
``L_b`` = ``seq_lens[b]`` KV tokens after they are written; its query ``i`` sits at absolute position
``p = L_b - n_b + i`` (bottom-right alignment, every mode: extend with or without prefix, decode,
target-verify, draft decode, mixed).

Self-attention (``LayerKind.MHA``), for key position ``j``:
    s_j = scale · q_p·k_j;   s_j = cap · tanh(s_j / cap)  when cap > 0
    visible(p, j) = j <= p                                 (causal)
                and (W < 0  or  j >= p - W)                (sliding window)
                and (not local  or  floor(j / C) == floor(p / C))   (local / chunked attention)
    out_p = Σ_visible softmax(s)_j · v_j       (a row that sees nothing gives 0)
Sliding window, precisely: ``W`` counts the keys BEFORE the current token; the current token is
always visible, so a query sees ``min(W + 1, p + 1)`` keys ``p-W .. p`` (FA3's
``window_size=(W, 0)``); ``W = 0`` sees only itself, ``W = -1`` is no window. A Hugging Face config
whose ``sliding_window = S`` counts the current token (``q_idx - kv_idx < S``) maps to ``W = S - 1``.
Local attention runs as the builder's *virtual batch* (``metadata.local``): every (request, chunk)
pair becomes one request whose keys start at the chunk border, so plain bottom-right causal attention
inside it is exactly the rule above; a window combines with it unchanged (it is relative).

Cross-attention (``LayerKind.CROSS``): request ``b``'s queries attend to all ``E_b`` =
``encoder_lens[b]`` encoder tokens, non-causal, no window, no chunking:
    out_i = Σ_{j < E_b} softmax(s)_j · v_j      (E_b = 0 gives 0)
The encoder K/V live in the first ``ceil(E_b / p) * p`` columns of the request's ``req_to_token``
row (``metadata.encoder``: page table, lens, cu_seqlens_k); any number of requests with different
encoder lengths. ``k``/``v`` given to a CROSS layer are encoder K/V, stored at
``batch.encoder_out_cache_loc`` first; a self-attention layer stores its new ``k``/``v`` at
``batch.out_cache_loc`` first.

FP8 (pool ``kv_dtype=float8_e4m3fn``): the pool stores ``k8 = k / k_scale`` (per layer, per tensor),
the kernel reads ``k = k8 · k_descale`` with ``k_descale = k_scale`` expanded (a view, no copy) to
FA3's ``[bs, H_kv]`` float32, same for v. FA3 requires q in e4m3 too: ``q8 = q / q_scale`` with a
dynamic ``q_scale = max|q| / 448`` computed on the device (no host sync, legal in a CUDA graph) and
passed as ``q_descale`` — per request and KV head when every request has the same number of queries
(decode, draft decode, target-verify), else one per-tensor scale (see :func:`quantize_query`). FA3
returns bf16; the output is cast back to q's dtype.
Softcap, window, local and cross-attention all work with FP8 (FA3 builds e4m3 kernels with softcap
and paged KV); FA3's e4m3 kernels need ``d`` and ``d_v`` multiples of 16 and at most 256 — other
head dims raise ``ValueError`` here, on every device, rather than only on the GPU. The descales are
expanded views of the pool's per-layer ``[1]`` scale tensors (no allocation per layer); only
``q_descale`` is computed per layer, since q changes from layer to layer.

Graph safety / sync: :func:`forward` reads shapes and host ints only (``max_seqlen_q`` of the
metadata); it never reads a device value, so DECODE / TARGET_VERIFY / DRAFT_DECODE steps can be
captured. Every check runs before the pool write and the kernel, and raises ``ValueError`` /
``TypeError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from mla_fa3 import ops
from mla_fa3.batch import ForwardBatch
from mla_fa3.kv.pools import FP8_E4M3_MAX, MHATokenPool, same_device
from mla_fa3.layer import AttentionLayer, LayerKind
from mla_fa3.metadata import AttentionMetadata

__all__ = ["forward", "KVRegion", "select_region", "check_layer", "quantize_query", "FP8_MAX_HEAD_DIM"]

FP8_MAX_HEAD_DIM = 256  # FA3's e4m3 kernels: q/k and v head dims at most 256 ...
FP8_HEAD_DIM_ALIGN = 16  # ... and multiples of 16 (16-byte rows of e4m3)
_Q_SCALE_FLOOR = 1e-12  # q_scale floor: an all-zero q quantizes to zeros, not NaN


@dataclass(frozen=True)
class KVRegion:
    """Which keys a layer reads this step: one page table and its lengths (views of the metadata)."""

    page_table: Tensor  # [n, max_pages] int32, device — page ids (n = bs, or virtual requests for local)
    cache_seqlens: Tensor  # [n] int32, device — keys per (virtual) request
    cu_seqlens_q: Tensor  # [n+1] int32, device — queries per (virtual) request, cumulated
    max_seqlen_q: int  # host int — longest query run of one (virtual) request
    causal: bool  # True for self-attention, False for cross-attention
    window_size: tuple[int, int]  # FA3's (left, right); (-1, -1) = none


def check_layer(layer: AttentionLayer, metadata: AttentionMetadata, pool: MHATokenPool) -> None:
    """Named errors for what ``layer`` asks and this path (or the pool / metadata) cannot do."""
    if not isinstance(layer, AttentionLayer):
        raise TypeError(f"layer must be an AttentionLayer, got {type(layer).__name__}")
    if layer.kind not in (LayerKind.MHA, LayerKind.CROSS):
        raise ValueError(f"layer.kind must be LayerKind.MHA or LayerKind.CROSS for mha_fallback, got "
                         f"LayerKind.{layer.kind.name} (layer {layer.layer_id})")
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    if not isinstance(pool, MHATokenPool):
        raise TypeError(f"pool must be an MHATokenPool, got {type(pool).__name__}")
    if layer.kind is LayerKind.CROSS:
        # AttentionLayer rejects these at construction; fields can be reassigned, so check again.
        if layer.sliding_window >= 0:
            raise ValueError(f"layer.sliding_window must be -1 for a CROSS layer (cross-attention sees every "
                             f"encoder token), got {layer.sliding_window} (layer {layer.layer_id})")
        if layer.use_local_attention:
            raise ValueError(f"layer.use_local_attention must be False for a CROSS layer (no chunking over "
                             f"encoder tokens) (layer {layer.layer_id})")
    if not 0 <= layer.layer_id < pool.num_layers:
        raise ValueError(f"layer.layer_id must be in [0, {pool.num_layers}) (the pool's layers), got {layer.layer_id}")
    for name, want, got in (("num_kv_heads", pool.num_kv_heads, layer.num_kv_heads),
                            ("head_dim", pool.head_dim, layer.head_dim),
                            ("v_head_dim", pool.v_head_dim, layer.v_head_dim)):
        if want != got:
            raise ValueError(f"layer.{name} must equal the pool's {name} {want}, got {got} "
                             f"(layer {layer.layer_id})")
    if pool.page_size != metadata.page_size:
        raise ValueError(f"metadata.page_size must equal the pool's page_size {pool.page_size}, "
                         f"got {metadata.page_size}")
    if pool.is_fp8:
        for name, dim in (("head_dim", layer.head_dim), ("v_head_dim", layer.v_head_dim)):
            if dim > FP8_MAX_HEAD_DIM or dim % FP8_HEAD_DIM_ALIGN:
                raise ValueError(f"layer.{name} must be a multiple of {FP8_HEAD_DIM_ALIGN} and <= {FP8_MAX_HEAD_DIM} "
                                 f"with an FP8 (e4m3) KV cache (FA3's fp8 kernels), got {dim} (layer {layer.layer_id})")


def select_region(layer: AttentionLayer, metadata: AttentionMetadata) -> KVRegion:
    """The keys of ``layer`` this step: the decoder pages, the local virtual batch or the encoder pages."""
    if layer.kind is LayerKind.CROSS:
        enc = metadata.encoder
        if enc is None:
            raise ValueError(f"metadata.encoder is None but layer {layer.layer_id} is a CROSS layer: build the "
                             "step from a batch with encoder_lens")
        return KVRegion(enc.page_table, enc.cache_seqlens, metadata.cu_seqlens_q, metadata.max_seqlen_q,
                        causal=False, window_size=(-1, -1))
    window = layer.window_size
    if layer.use_local_attention:
        local = metadata.local
        if local is None:
            raise ValueError(f"metadata.local is None but layer {layer.layer_id} uses local attention: build "
                             "the metadata with MetadataBuilder(..., attention_chunk_size=C)")
        return KVRegion(local.page_table, local.cache_seqlens, local.cu_seqlens_q, local.max_seqlen_q,
                        causal=True, window_size=window)
    return KVRegion(metadata.page_table, metadata.cache_seqlens, metadata.cu_seqlens_q, metadata.max_seqlen_q,
                    causal=True, window_size=window)


def _check_tensor(x: object, name: str, shape: tuple[int, ...], rows_from: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} ({rows_from} rows, the layer's heads and "
                         f"head dim), got {list(x.shape)}")
    return x


def _check_inputs(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer: AttentionLayer,
                  batch: ForwardBatch, pool: MHATokenPool, save_kv_cache: bool) -> Optional[Tensor]:
    """Shape/dtype checks of q, k, v against the layer and batch. Returns the store location (or None)."""
    if not isinstance(batch, ForwardBatch):
        raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
    H, h_kv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    _check_tensor(q, "q", (batch.num_tokens, H, d), rows_from="batch.num_tokens")
    if q.dtype == torch.float8_e4m3fn or q.dtype == torch.float8_e5m2:
        raise TypeError(f"q must be in the model's dtype (it is quantized here for an FP8 cache), got {q.dtype}")
    if not same_device(q.device, pool.device):
        raise ValueError(f"q must be on the KV pool's device {pool.device}, got {q.device}")
    if not pool.is_fp8 and q.dtype != pool.kv_dtype:
        raise TypeError(f"q dtype must match the KV pool's dtype {pool.kv_dtype}, got {q.dtype}")
    if (k is None) != (v is None):
        raise ValueError(f"k and v must be given together (or both None), got k={'None' if k is None else 'tensor'}, "
                         f"v={'None' if v is None else 'tensor'}")
    if k is None or not save_kv_cache:
        return None
    if layer.kind is LayerKind.CROSS:
        loc = batch.encoder_out_cache_loc
        if loc is None:
            raise ValueError("batch.encoder_out_cache_loc is None but encoder k/v were given to a CROSS layer "
                             "(pass k=v=None when the encoder K/V are already cached)")
        rows, what = loc.shape[0], "len(batch.encoder_out_cache_loc)"
    else:
        loc, rows, what = batch.out_cache_loc, batch.num_tokens, "batch.num_tokens"
    _check_tensor(k, "k", (rows, h_kv, d), rows_from=what)
    _check_tensor(v, "v", (rows, h_kv, dv), rows_from=what)
    return loc


def quantize_query(q: Tensor, num_rows: int, num_kv_heads: int, *,
                   uniform: bool = False) -> tuple[Tensor, Tensor]:
    """e4m3 query for an FP8 cache: ``q8 = q / q_scale`` with ``q_scale = max|q| / 448`` (on the device).

    ``uniform=True`` (every one of the ``num_rows`` requests owns ``T / num_rows`` consecutive query
    rows: decode, draft decode, target-verify) takes the max per request and KV-head group, so
    ``q_descale[b, g]`` is request b's own scale (precision per request; a padding row of a CUDA
    graph cannot spoil the live rows' scale). Otherwise one per-tensor scale, expanded.
    Returns ``(q8 [T, H, d] float8_e4m3fn, q_descale [num_rows, H_kv] float32)``; no host sync.
    """
    T, H, d = q.shape
    qf = q.float()
    if uniform and num_rows and T % num_rows == 0:
        per = T // num_rows
        grouped = qf.view(num_rows, per, num_kv_heads, H // num_kv_heads, d)
        q_scale = (grouped.abs().amax(dim=(1, 3, 4)) / FP8_E4M3_MAX).clamp_(min=_Q_SCALE_FLOOR)  # [rows, H_kv]
        q8 = (grouped / q_scale.view(num_rows, 1, num_kv_heads, 1, 1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return q8.to(torch.float8_e4m3fn).view(T, H, d), q_scale
    q_scale = (qf.abs().amax() / FP8_E4M3_MAX).clamp_(min=_Q_SCALE_FLOOR).reshape(1, 1)
    q8 = (qf / q_scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q8, q_scale.expand(num_rows, num_kv_heads)


def forward(q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer: AttentionLayer, batch: ForwardBatch,
            metadata: AttentionMetadata, pool: MHATokenPool, *, save_kv_cache: bool = True,
            impl: ops.Impl | str | None = None) -> Tensor:
    """One MHA or CROSS layer of the step planned in ``metadata``. Returns ``out [T, H, d_v]`` (q's dtype).

    q ``[T, H, d]`` (RoPE applied; T = ``batch.num_tokens``). MHA: ``k [T, H_kv, d]``, ``v [T, H_kv, d_v]``
    are the new tokens' K/V, written at ``batch.out_cache_loc`` first (quantized for an FP8 pool).
    CROSS: ``k``/``v`` ``[E_new, H_kv, d / d_v]`` are encoder K/V written at
    ``batch.encoder_out_cache_loc`` first, or None when already cached. ``save_kv_cache=False`` skips
    the write. ``impl`` forces the kernel implementation (None = ``ops``' global choice).
    """
    check_layer(layer, metadata, pool)
    loc = _check_inputs(q, k, v, layer, batch, pool, save_kv_cache)
    if batch.batch_size == 0 or metadata.batch_size == 0:  # IDLE: nothing to attend, nothing to store
        return q.new_zeros(0, layer.num_heads, layer.v_head_dim)
    region = select_region(layer, metadata)
    if loc is not None:
        pool.set_kv(layer.layer_id, loc, k, v)
    num_rows = region.page_table.shape[0]
    k_descale, v_descale = pool.descales(layer.layer_id, num_rows)
    q_in, q_descale = q, None
    if pool.is_fp8:
        # one query run per (virtual) request of equal length: decode-like always (a local virtual
        # batch of a decode step has one row per request), verify unless split at chunk borders
        mode, local = metadata.mode, layer.use_local_attention
        uniform = mode.is_decode_like() or (mode.is_target_verify() and not local)
        q_in, q_descale = quantize_query(q, num_rows, layer.num_kv_heads, uniform=uniform)
    out = ops.flash_attn_with_kvcache(
        q_in, pool.k_paged(layer.layer_id), pool.v_paged(layer.layer_id),
        page_table=region.page_table, cache_seqlens=region.cache_seqlens, cu_seqlens_q=region.cu_seqlens_q,
        max_seqlen_q=region.max_seqlen_q, softmax_scale=layer.scaling, causal=region.causal,
        window_size=region.window_size, softcap=layer.logit_cap, k_descale=k_descale, v_descale=v_descale,
        q_descale=q_descale, impl=impl,
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)
