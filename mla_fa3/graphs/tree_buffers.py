"""CUDA-graph buffers of a tree step's tree part: one set per tree shape ``(m, n)``, viewed ``[:bs]`` per graph.

A graph of a tree step is captured for a fixed batch size and a fixed tree shape (m queries, n tree keys per
request); its prefix metadata lives in the ordinary :class:`~mla_fa3.graphs.capture.CaptureBuffers` (with
``cache_seqlens`` = the prefixes), its tree part here:

- ``mask [max_bs, m, n]`` bool: the live requests' masks ``[:live]`` (a device->device copy of the batch's
  tree), padding requests ``[live:bs]`` the *padding tree* (every query sees tree key 0 only);
- ``key_slots [max_bs, n]`` int64: ``req_to_token[row_b, prefix_b + j]`` for the live requests (gathered on the
  device from the prefixes just written to ``cache_seqlens``), slot 0 (the padding page) for padding requests.

Both are rewritten whole over ``[:bs]`` at every replay, so no earlier, larger batch leaks into a smaller one.
A replay update runs these few device ops from the host (never inside the graph); no device value is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.tree import MAX_TREE_TOKENS, DraftTreeError, TreeMetadata, tree_key_slots

__all__ = ["TreeBuffers"]


@dataclass
class TreeBuffers:
    max_bs: int
    num_queries: int  # m
    num_keys: int  # n
    mask: Tensor  # [max_bs, m, n] bool, device
    key_slots: Tensor  # [max_bs, n] int64, device
    pad_mask: Tensor  # [max_bs, m, n] bool, device — the padding tree (key 0 only), copied from

    @classmethod
    def allocate(cls, max_bs: int, shape: tuple[int, int], device: torch.device) -> "TreeBuffers":
        m, n = shape
        for value, name in ((m, "tree queries (m)"), (n, "tree keys (n)")):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TREE_TOKENS:
                raise DraftTreeError(f"{name} must be an int in [1, {MAX_TREE_TOKENS}], got {value!r}")
        pad = torch.zeros(max_bs, m, n, dtype=torch.bool, device=device)
        pad[:, :, 0] = True
        buf = cls(max_bs=max_bs, num_queries=m, num_keys=n, mask=pad.clone(),
                  key_slots=torch.zeros(max_bs, n, dtype=torch.int64, device=device), pad_mask=pad)
        return buf

    @classmethod
    def for_capture(cls, registry: dict, capture_buffers, mode: ForwardMode, num_draft_tokens: int,
                    shape: object) -> "TreeBuffers":
        """The buffers of tree shape ``shape`` = (m, n) from ``registry`` (allocated there on first use, sized by
        ``capture_buffers.max_bs``), after checking the shape against the mode and ``num_draft_tokens``."""
        if mode not in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE):
            raise DraftTreeError(f"a tree graph is TARGET_VERIFY or DRAFT_DECODE, got {mode.name}")
        if not isinstance(shape, tuple) or len(shape) != 2 or shape[0] != num_draft_tokens or (
                mode is ForwardMode.TARGET_VERIFY and shape[1] != shape[0]):
            raise DraftTreeError(f"tree_shape must be (m, n) with m = num_draft_tokens = {num_draft_tokens} (and n = m "
                                 f"for TARGET_VERIFY), got {shape!r}")
        if capture_buffers.with_encoder:
            raise DraftTreeError("a tree step has no cross-attention form: capture buffers with_encoder=False")
        if shape not in registry:
            registry[shape] = cls.allocate(capture_buffers.max_bs, shape, capture_buffers.packed.device)
        return registry[shape]

    def views(self, bs: int) -> TreeMetadata:
        """The captured graph's tree metadata: views ``[:bs]``, reset to the padding tree."""
        self.mask[:bs].copy_(self.pad_mask[:bs])
        self.key_slots[:bs].zero_()
        return TreeMetadata(num_queries=self.num_queries, num_keys=self.num_keys, mask=self.mask[:bs],
                            key_slots=self.key_slots[:bs])

    def replay(self, batch: ForwardBatch, bs: int, req_to_token: Tensor, prefix_lens: Tensor) -> None:
        """Write ``batch``'s tree into ``[:bs]`` (``prefix_lens``: its live prefixes on the device, [live])."""
        tree, live = batch.tree, batch.batch_size
        if tree is None or tree.shape != (self.num_queries, self.num_keys):
            got = "no tree" if tree is None else f"a tree of shape {tree.shape}"
            raise DraftTreeError(f"batch.tree must have the captured shape (m, n) = ({self.num_queries}, "
                                 f"{self.num_keys}), got {got}")
        if live:
            self.mask[:live].copy_(tree.mask)
            tree_key_slots(req_to_token, batch.req_pool_indices, prefix_lens, self.num_keys,
                           out=self.key_slots[:live], columns=batch.tree_key_columns)
        if bs > live:
            self.mask[live:bs].copy_(self.pad_mask[live:bs])
            self.key_slots[live:bs].zero_()
