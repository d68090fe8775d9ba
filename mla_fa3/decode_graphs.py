"""DecodeGraphs: the CUDA-graph steps of an :class:`~mla_fa3.backend.MLABackend` — capture, the replay updates and
the in-graph prologue of decode-like steps (DECODE, TARGET_VERIFY, DRAFT_DECODE).

    init_state(max_bs, max_context, device_metadata)   the builder's capture buffers, once
    capture(bs, mode, kernel, lengths_from)            a step's plan over views of them; the kernel baked into the
                                                       graph recorded by (mode, bs, shape, kernel)
    replay(batch)                                      the captured size that fits and its kernel; the buffers
                                                       rewritten in place (MetadataBuilder.replay: one host->device
                                                       copy), the kernel's schedule re-planned — here, or in the
                                                       graph (prologue) with device metadata
    replay_device_lengths(bs, seq_lens_cpu, ...)       a DECODE or chain TARGET_VERIFY graph that reads its lengths
                                                       from the engine's own static buffers
                                                       (graphs.capture.LengthSources): host checks
    prologue(plan)                                     inside the graph, before the layers: lengths (device
                                                       lengths), page table, the kernel's schedule

Each returns the step's :class:`~mla_fa3.plan.StepPlan`; the backend makes it the current step. Host work only,
except the prologue (tensor ops on fixed shapes, graph-legal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_fa3.batch import ForwardBatch, ForwardMode, queries_per_request
from mla_fa3.checks import check_int
from mla_fa3.graphs.capture import LengthSources, check_bound_lengths
from mla_fa3.graphs.captured import CapturedGraphs, graph_shape
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.plan import StepPlan, StepPlanner, mean_seqlen
from mla_fa3.policy.paths import DecodeKernel

__all__ = ["DecodeGraphs"]


@dataclass
class _GraphEntry:
    """One captured (mode, bs, k, kernel): the plan over the capture buffers' views."""

    plan: StepPlan
    reason: str
    replay_plan: StepPlan | None = None  # lengths read on the device: the one plan every replay reuses


class DecodeGraphs:
    """The captured decode-like steps of one backend over its builder's capture buffers (see the module doc)."""

    def __init__(self, builder: MetadataBuilder, planner: StepPlanner):
        self.builder, self.planner = builder, planner
        self.device_metadata = False  # graphs derive their page table / schedule themselves (prologue)
        # (mode, bs, k, kernel) -> entry; with decode_kernel='auto' on page 64 both kernels are captured per size
        # and each replay picks one from the live lengths (host ints)
        self._captured: CapturedGraphs[_GraphEntry] = CapturedGraphs(tuple(DecodeKernel))

    def init_state(self, max_bs: int, max_context: int, *, max_num_draft_tokens: int, with_encoder: bool,
                   device_metadata: bool, pad_seqlen: int) -> None:
        self.builder.init_capture_buffers(max_bs, max_context, max_num_draft_tokens=max_num_draft_tokens,
                                          with_encoder=with_encoder, pad_seqlen=pad_seqlen,
                                          device_tables=device_metadata)
        self.device_metadata = bool(device_metadata)
        self._captured.clear()

    @property
    def reads_lengths_on_device(self) -> bool:
        """Whether a DECODE capture may take ``lengths_from`` (device metadata over device-derived page tables)."""
        buf = self.builder.capture_buffers
        return self.device_metadata and buf is not None and buf.device_tables

    def prologue(self, plan: StepPlan | None) -> None:
        """The device work of a captured / replayed step, inside its graph before the layers: its lengths (when it
        reads them on the device), the page table from ``req_to_token`` and the FlashMLA, split-KV or FA3 schedule
        from the live lengths. Fixed shapes, no host value read."""
        if plan is None or plan.graph_bs is None:
            raise RuntimeError("graph_prologue runs on a captured or replayed step (init_forward_metadata_"
                               "capture_cuda_graph / _replay_cuda_graph first)")
        if not self.device_metadata:
            raise RuntimeError("graph_prologue needs init_cuda_graph_state(..., device_metadata=True)")
        self.builder.derive_tables(plan.metadata, plan.length_sources)
        self._replan(plan)
        plan.prologue_pending = False

    def _replan(self, plan: StepPlan) -> None:
        """The kernel's schedule of a captured ``plan`` re-planned in place from the lengths in its metadata."""
        schedules, md = self.planner.schedules, plan.metadata
        if plan.flashmla_schedule is not None:
            schedules.replan_flashmla(md, plan.flashmla_schedule)
        if plan.splitkv_schedule is not None:
            schedules.replan_splitkv(md, plan.splitkv_schedule)
        if plan.fa3_schedule is not None:
            schedules.replan_fa3(md, plan.fa3_schedule)

    def _kernel(self, bs: int, kernels: list, num_requests: int, max_len: int,
                mean_len: float | None) -> tuple[DecodeKernel, str | None]:
        """(kernel, why) among the ``kernels`` captured for ``bs``: the first, or — several captured — the one the
        live lengths choose (host values: no sync); ``why`` None for the first without a choice."""
        if len(kernels) == 1:
            return kernels[0], None
        kernel, why = self.planner.kernel_choice.choose_decode_kernel(num_requests, max_len, mean_len)
        if kernel not in kernels:
            kernel, why = kernels[0], f"{why}; {kernel.value} not captured for bs {bs} -> {kernels[0].value}"
        return kernel, why

    def capture(self, bs, mode: ForwardMode | None, *, num_draft_tokens: int, kernel: DecodeKernel | None,
                tree_shape: tuple[int, int] | None, lengths_from: LengthSources | None) -> StepPlan:
        """The plan of a graph of ``bs`` requests (or of the static ``ForwardBatch`` ``bs``) in ``mode``
        (``MLABackend.init_forward_metadata_capture_cuda_graph`` says what each argument does)."""
        batch = None
        if isinstance(bs, ForwardBatch):
            batch = bs
            bs, mode, num_draft_tokens = batch.batch_size, batch.forward_mode, max(batch.num_draft_tokens, 1)
            tree_shape = None if batch.tree is None else batch.tree.shape
        if not isinstance(mode, ForwardMode) or not mode.is_graph_capturable():
            raise ValueError(f"mode must be DECODE, TARGET_VERIFY or DRAFT_DECODE for a CUDA graph, got {mode!r}")
        check_int(bs, "bs")
        kernels = self.planner.kernel_choice.graph_kernels()
        if kernel is not None and kernel not in kernels:
            raise ValueError(f"kernel {kernel} is not one of this backend's graph kernels {kernels}")
        k = queries_per_request(mode, num_draft_tokens)
        if lengths_from is not None:
            if mode not in _DEVICE_LENGTH_MODES or tree_shape is not None or not self.device_metadata:
                raise ValueError("lengths_from: DECODE and chain TARGET_VERIFY graphs with device metadata "
                                 f"(init_cuda_graph_state(device_metadata=True)) only, got {mode.name}"
                                 f"{' with a tree' if tree_shape is not None else ''}")
            lengths_from.check(self.builder.capture_buffers, bs)
            if mode is ForwardMode.DECODE and lengths_from.extra:
                raise ValueError(f"lengths_from.extra must be 0 for DECODE (one new token, in seq_lens), got "
                                 f"{lengths_from.extra}")
        md = self.builder.capture(bs, mode, num_draft_tokens=k, tree_shape=tree_shape)
        k = graph_shape(k, tree_shape)
        if kernel is None:
            kernel, reason = self.planner.kernel_choice.choose_decode_kernel(bs, md.max_seqlen_k)
        else:
            reason = f"{kernel.value} graph"
        plan = self.planner.decode_plan(batch, md, kernel, f"{reason} (captured for bs {bs})", graph=True)
        plan.prologue_pending = self.device_metadata
        plan.length_sources = lengths_from
        self._captured.add(mode, bs, k, kernel, _GraphEntry(plan, reason))
        return plan

    def replay(self, batch: ForwardBatch, bs: int | None) -> StepPlan:
        """The captured metadata updated in place for ``batch`` (live rows; tail reset), on the captured size that
        fits (or ``bs``) and, where several were captured for it, the kernel the live lengths choose."""
        mode = batch.forward_mode
        k = graph_shape(queries_per_request(mode, batch.num_draft_tokens), None if batch.tree is None else batch.tree.shape)
        bs, kernels = self._captured.kernels_for(mode, k, batch.batch_size, bs)
        kernel, why = self._kernel(bs, kernels, batch.batch_size, batch.seq_lens_max, mean_seqlen(batch))
        entry = self._captured.get(mode, bs, k, kernel)
        if entry.plan.length_sources is not None:
            raise ValueError(f"the {mode.name} graph of bs {bs} reads its lengths on the device (captured with "
                             "lengths_from): replay it with init_forward_metadata_replay_device_lengths")
        md = entry.plan.metadata
        self.builder.replay(batch, md)
        if not self.device_metadata:  # else re-planned in the graph (prologue), from the live device lengths
            self._replan(entry.plan)
        plan = self.planner.decode_plan(batch, md, kernel, f"{why or entry.reason} (replay of bs {bs})",
                                        graph=True, schedule=_captured_schedule(entry.plan),
                                        static_batch=entry.plan.batch)
        plan.prologue_pending = self.device_metadata  # the graph's prologue runs it; an eager run must call it
        return plan

    def replay_device_lengths(self, bs: int, seq_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                              req_pool_indices: torch.Tensor, num_requests: int | None, mode: ForwardMode,
                              num_draft_tokens: int) -> StepPlan:
        """The replay update of the DECODE / chain TARGET_VERIFY graph of ``bs`` captured with ``lengths_from``
        (``MLABackend.init_forward_metadata_replay_device_lengths``)."""
        if mode not in _DEVICE_LENGTH_MODES:
            raise ValueError(f"lengths read on the device: DECODE and TARGET_VERIFY graphs only, got {mode!r}")
        k = queries_per_request(mode, num_draft_tokens)
        bs, kernels = self._captured.kernels_for(mode, k, bs, bs)
        kernel, why = kernels[0], None
        n = bs if num_requests is None else num_requests
        if len(kernels) > 1 and n:  # the lengths the graph will run with: the sources' plus their extra
            extra = self._captured.get(mode, bs, k, kernels[0]).plan.length_sources
            extra = 0 if extra is None else extra.extra
            live = seq_lens_cpu[:n]
            kernel, why = self._kernel(bs, kernels, n, int(live.max()) + extra, float(live.sum()) / n + extra)
        entry = self._captured.get(mode, bs, k, kernel)
        sources = entry.plan.length_sources
        if sources is None:
            raise ValueError(f"the {mode.name} graph of bs {bs} was captured without lengths_from: replay it with "
                             "init_forward_metadata_replay_cuda_graph")
        check_bound_lengths(self.builder.capture_buffers, bs, seq_lens_cpu, sources.extra)
        if not sources.same_as(seq_lens, req_pool_indices):
            for name, src, dst in (("seq_lens", seq_lens, sources.seq_lens),
                                   ("req_pool_indices", req_pool_indices, sources.req_pool_indices)):
                if src.shape != dst.shape or src.device != dst.device:
                    raise ValueError(f"{name} must be [{bs}] on {dst.device} (the graph's batch), got "
                                     f"{tuple(src.shape)} on {src.device}")
            sources.seq_lens.copy_(seq_lens)
            sources.req_pool_indices.copy_(req_pool_indices)
        plan = entry.replay_plan
        if plan is None or why is not None:
            plan = self.planner.decode_plan(None, entry.plan.metadata, kernel, f"{why or entry.reason} (replay of bs "
                                            f"{bs}; lengths read on the device)", graph=True,
                                            schedule=_captured_schedule(entry.plan))
            plan.length_sources = sources
            if why is None:
                entry.replay_plan = plan
        plan.prologue_pending = True  # the graph's prologue derives the lengths; an eager run must call it
        return plan


_DEVICE_LENGTH_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)  # the graphs lengths_from serves (no tree)


def _captured_schedule(plan: StepPlan):
    """The kernel schedule a captured graph's plan holds (re-planned on the device by its prologue), or None."""
    return next((s for s in (plan.flashmla_schedule, plan.splitkv_schedule, plan.fa3_schedule) if s is not None), None)
