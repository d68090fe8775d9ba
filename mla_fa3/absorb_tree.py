"""The absorbed path of a speculative tree step (EAGLE with topk > 1): prefix part + tree part, merged by LSE.

Symbols of :mod:`mla_fa3.absorb` and :mod:`mla_fa3.tree`: request ``b`` has ``m`` query rows, a prefix of
``P_b`` committed tokens and ``n`` tree keys (the last n tokens of its row) with ``mask [bs, m, n]``. Query row
``t`` of request b attends to the key set  prefix(b) ∪ {tree key j : mask[b, i, j]}, split in two disjoint parts:

    o_P, lse_P = attend_prefix(q_lat, q_rope)          # the step's decode kernel, m rows per request over the
                                                       # P_b prefix keys, no causal mask (FA3 / FlashMLA /
                                                       # split-KV; an FP8 pool read as the kernel reads it)
    o_lat, _   = ops.tree_attention(q_lat, q_rope, kv, key_slots, mask, prior=(o_P, lse_P))
                                                       # the tree keys (masked, n <= 64: one Triton launch on
                                                       # CUDA, torch elsewhere) merged with the prefix state in
                                                       # the same call: o = Σ o_i·e^(lse_i − lse), lse = ln Σ e^lse_i
    o          = o_lat · W_UVᵀ                         # project_output

The metadata of a tree step is the prefix's (``cache_seqlens = seq_lens − n``, ``max_seqlen_q = m``), so the
step plan's FlashMLA / split-KV schedule is planned for exactly this prefix call; FA3 plans per call (its step
schedule is planned causal). Every prefix holds >= 1 token (checked with the batch), so ``lse_P`` is finite.
Layers with a sliding window or local attention have no tree form here and raise ``DraftTreeError``.
"""

from __future__ import annotations

import torch

from mla_fa3 import ops
from mla_fa3.absorb import absorb_query, attend_prefix, check_query, project_output, split_query
from mla_fa3.layer import AttentionLayer
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.ops.fp8 import FP8_DTYPE
from mla_fa3.policy.paths import DecodeKernel
from mla_fa3.tree import DraftTreeError

__all__ = ["forward_absorbed_tree", "attend_latent_tree", "check_tree_layer"]


def check_tree_layer(layer: AttentionLayer) -> None:
    """Layers a tree step cannot run raise ``DraftTreeError`` (before anything is stored)."""
    if layer.sliding_window >= 0 or layer.use_local_attention:
        raise DraftTreeError(f"layer {layer.layer_id}: a tree step has no sliding-window / local-attention form "
                             "(the window is relative to positions that differ per branch)")


def forward_absorbed_tree(q: torch.Tensor, layer: AttentionLayer, metadata: AttentionMetadata, kv_paged: torch.Tensor,
                          *, kernel: DecodeKernel = DecodeKernel.FA3, schedule=None, kv_scale: torch.Tensor | None = None,
                          impl=None, validate: bool = True) -> torch.Tensor:
    """One MLA layer of a tree step: q [T, H, d_nope + d_rope] -> o [T, H, d_v] (arguments of
    ``absorb.forward_absorbed``; ``metadata.tree`` set)."""
    if validate:
        check_query(q, layer)
    w = layer.mla_weights
    q_nope, q_rope = split_query(q, layer.mla)
    o_lat = attend_latent_tree(absorb_query(q_nope, w, impl=impl), q_rope, layer, metadata, kv_paged, kernel=kernel,
                               schedule=schedule, kv_scale=kv_scale, impl=impl)
    return project_output(o_lat, w, impl=impl)


def attend_latent_tree(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: AttentionLayer, metadata: AttentionMetadata,
                       kv_paged: torch.Tensor, *, kernel: DecodeKernel = DecodeKernel.FA3, schedule=None,
                       kv_scale: torch.Tensor | None = None, impl=None) -> torch.Tensor:
    """The tree step's absorbed core: q_lat [T, H, r], q_rope [T, H, d_rope] -> o_lat [T, H, r] (module docstring);
    for engines that absorb W_UK and apply W_UV themselves, as ``absorb.attend_latent``."""
    tree = metadata.tree
    if tree is None:
        raise DraftTreeError("metadata.tree is None: the step was not planned from a batch with a tree")
    check_tree_layer(layer)
    D = kv_paged.shape[-1]
    try:
        kv_rows = kv_paged.view(-1, D)  # the pool's rows by slot (no copy)
    except RuntimeError as e:
        raise ValueError(f"kv_paged must be a view of contiguous latent rows [num_pages, page_size, 1, {D}]") from e
    o_p, lse_p = attend_prefix(q_lat, q_rope, layer, metadata, kv_paged, kernel=kernel, schedule=schedule,
                               kv_scale=kv_scale, impl=impl)
    fp8 = kv_paged.dtype == FP8_DTYPE
    o, _ = ops.tree_attention(q_lat, q_rope, kv_rows, tree.key_slots, tree.mask, softmax_scale=layer.scaling,
                              softcap=layer.logit_cap, kv_scale=kv_scale if fp8 else None, prior=(o_p, lse_p),
                              impl=impl)
    return o
