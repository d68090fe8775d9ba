"""The decode kernels' schedules: planned once per step for every layer, re-planned in place per graph replay.

Three kernels read a schedule that depends on the step's lengths only, so it is planned once, before the first
layer, and every plain MLA layer of the step reads it (:mod:`mla_fa3.plan` decides which kernel runs):

    FLASHMLA  FlashMLASchedule  ops.get_mla_decode_metadata(cache_seqlens, H * sq)   a device kernel
    SPLITKV   SplitKVSchedule   ops.get_splitkv_schedule(host lengths)               host plan, no device read
    FA3       FA3Schedule       ops.get_fa3_schedule(cache_seqlens, page_table, ...)  a device kernel; only at
                                                                                      bs <= FA3_STEP_SCHEDULE_MAX_BATCH

(``H`` the MLA layers' heads, ``sq`` the queries per request: 1, k for TARGET_VERIFY, topk for a tree's draft step.)

A captured CUDA-graph step holds its schedule in fixed tensors; each replay re-plans it from the live
``cache_seqlens`` and copies the new plan into them (``replan_*``): FlashMLA's and FA3's kernels again, split-KV's
on the device (``ops.replan_splitkv_schedule``: one program, no host plan; the capture planned it with every
request at ``max_context``, its ``KernelConfig`` fixed, so it has room for any lengths of its batch size). The re-plans read no host value,
so they run inside the graph's prologue (``MLABackend.graph_prologue``) or in the replay update.
"""

from __future__ import annotations

import torch

from mla_fa3 import ops
from mla_fa3.batch import queries_per_request
from mla_fa3.layer import MLADims
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.ops import FA3Schedule, FlashMLASchedule, SplitKVSchedule
from mla_fa3.policy.decode_kernel import FA3_STEP_SCHEDULE_MAX_BATCH, fa3_num_splits

__all__ = ["KernelSchedules"]


class KernelSchedules:
    """Plans the FlashMLA, split-KV and FA3 schedules of a step with the backend's settings; owned by its planner.

    ``num_heads`` / ``mla_dims``: of the MLA layers (per rank; FlashMLA and split-KV need the heads, FA3's schedule
    the dims as well); ``kv_fp8``: the latent pool holds e4m3 (FlashMLA's FP8 decode, split-KV's e4m3 tiles; no
    FA3 schedule); ``weight_dtype``: the compute dtype, q's (FA3's schedule is planned for it).
    """

    def __init__(self, *, page_size: int, num_heads: int | None, mla_dims: MLADims | None, kv_fp8: bool,
                 weight_dtype: torch.dtype | None, impl: ops.Impl | None, device: torch.device):
        self.page_size = page_size
        self.num_heads = num_heads
        self.mla_dims = mla_dims
        self.kv_fp8 = kv_fp8
        self.weight_dtype = weight_dtype
        self.impl = impl  # the backend's ops implementation (None: the ops global setting at call time)
        self.device = device

    def flashmla_schedule(self, metadata: AttentionMetadata) -> FlashMLASchedule:
        """FlashMLA's tile schedule for the step (a device kernel: eager, or inside a graph's prologue)."""
        sq = queries_per_request(metadata.mode, metadata.num_draft_tokens)
        return ops.get_mla_decode_metadata(metadata.cache_seqlens, self.num_heads * sq, is_fp8=self.kv_fp8,
                                           impl=self.impl)

    def replan_flashmla(self, metadata: AttentionMetadata, into: FlashMLASchedule) -> FlashMLASchedule:
        """A replay's FlashMLA re-plan: the schedule of the live ``metadata``, copied into the captured ``into``."""
        return into.copy_(self.flashmla_schedule(metadata))

    def fa3_schedule(self, metadata: AttentionMetadata) -> FA3Schedule | None:
        """FA3's tile schedule for the step's plain MLA layers (a device kernel: eager, or in a graph's prologue),
        or None where FA3 is better left to plan per call: more than ``FA3_STEP_SCHEDULE_MAX_BATCH`` requests
        (measured slower there), an FP8 pool (FA3 cannot read it), or heads / dims / dtype not given. Its split
        count is the policy's (``fa3_num_splits``); the layers ask FA3 for the same."""
        dims = self.mla_dims
        if metadata.tree is not None:  # the tree's prefix call is not causal; this schedule is planned causal
            return None
        if self.kv_fp8 or self.num_heads is None or dims is None or self.weight_dtype is None \
                or not 0 < metadata.batch_size <= FA3_STEP_SCHEDULE_MAX_BATCH:
            return None
        return ops.get_fa3_schedule(
            metadata.cache_seqlens, metadata.page_table, page_size=self.page_size, num_heads=self.num_heads,
            num_heads_k=1, head_dim=dims.qk_rope_head_dim, head_dim_v=dims.kv_lora_rank, dtype=self.weight_dtype,
            max_seqlen_q=metadata.max_seqlen_q, cu_seqlens_q=metadata.cu_seqlens_q, causal=True,
            num_splits=fa3_num_splits(self.num_heads, metadata.batch_size), impl=self.impl)

    def replan_fa3(self, metadata: AttentionMetadata, into: FA3Schedule) -> FA3Schedule:
        """A replay's FA3 re-plan: the schedule of the live ``metadata``, copied into the captured ``into``."""
        fresh = self.fa3_schedule(metadata)
        if fresh is None:
            raise ValueError("the captured step planned an FA3 schedule that this metadata does not admit")
        return into.copy_(fresh)

    def splitkv_schedule(self, metadata: AttentionMetadata, lens_cpu: torch.Tensor | None) -> SplitKVSchedule:
        """The split-KV schedule of the step, from host lengths (never a device value: no sync).

        ``lens_cpu`` None (a capture): every request at ``max_seqlen_k``, sized for any plan of this batch
        size (a replay re-plans it on the device: :meth:`replan_splitkv`)."""
        sq = queries_per_request(metadata.mode, metadata.num_draft_tokens)
        kw = dict(num_heads=self.num_heads, num_q_tokens=sq, page_size=self.page_size, kv_fp8=self.kv_fp8)
        if lens_cpu is None:
            bs = metadata.batch_size
            return ops.get_splitkv_schedule([max(metadata.max_seqlen_k, 1)] * bs, **kw, device=self.device,
                                            max_batch=bs)
        return ops.get_splitkv_schedule(lens_cpu, **kw, device=self.device)

    def replan_splitkv(self, metadata: AttentionMetadata, into: SplitKVSchedule) -> SplitKVSchedule:
        """A replay's split-KV re-plan: the captured ``into`` planned on the device from the live ``cache_seqlens``
        (one launch, no host value read; inside the graph's prologue or in the replay update)."""
        return ops.replan_splitkv_schedule(metadata.cache_seqlens, into, impl=self.impl)
