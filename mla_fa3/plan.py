"""The step plan: what every layer of one step runs, decided once, before the first layer.

``MLABackend.init_forward_metadata(batch)`` (or its CUDA-graph twins) builds the step's
``AttentionMetadata`` and hands it to :class:`StepPlanner`, which decides everything a layer will run:

    plan(batch, metadata):
        IDLE                                   -> path IDLE (no kernel, no pool access)
        DECODE / DRAFT_DECODE / TARGET_VERIFY  -> path ABSORBED, kernel = decode_kernel setting, or per step
                                                  from policy.decode_kernel (host lengths, page 64 only);
                                                  FLASHMLA -> its tile schedule planned here (ops)
        EXTEND / MIXED / DRAFT_EXTEND          -> policy.prefill_cost picks ABSORBED / MHA_ONESHOT /
                                                  MHA_CHUNKED from host lengths (or the prefill_path
                                                  override); an MHA path gets its PrefillPlan (chunks,
                                                  row split) from prefill_plan.build_prefill_plan
        -> StepPlan(metadata, path, kernel, schedule, prefill, record)

FP8 latent pool (e4m3): every decode-like step runs FlashMLA's FP8 decode (the only kernel that reads
it; page 64, checked when the backend is built); extend-like steps run the MHA prefill, which
dequantizes the rows it reads chunk by chunk, and their decode rows (MIXED) run FlashMLA FP8 with a
schedule planned here for those rows; a step whose rows are all decode rows runs FlashMLA FP8 whole.

Every layer then asks :meth:`StepPlan.route` which (path, kernel) applies to it. The route is a fixed
rule of the plan, not a new decision: layers with softcap, a sliding window or local attention (which
neither FlashMLA nor the MHA prefill model) and layers whose head count differs from the planned one
run the absorbed path on FA3. The :class:`PathRecord` (``explain()``) is written once, with the plan.

The plan knows the batch it was made for: :meth:`StepPlan.check_batch` refuses a forward with another
batch (compared by identity, else by its host lengths: a few CPU ints, never a device value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mla_fa3 import ops
from mla_fa3.batch import ForwardBatch, queries_per_request
from mla_fa3.kv.fp8 import FP8_DTYPE
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.ops import FlashMLASchedule
from mla_fa3.policy.decode_kernel import explain_decode_kernel
from mla_fa3.policy.paths import FLASHMLA_PAGE_SIZE, AttentionPath, DecodeKernel, PrefillOverride
from mla_fa3.policy.prefill_cost import PathDecision
from mla_fa3.prefill_plan import PrefillPlan, PrefillWorkspace, plan_extend

__all__ = ["PathRecord", "StepPlan", "StepPlanner", "DECODE_KERNEL_AUTO", "mean_seqlen"]

DECODE_KERNEL_AUTO = "auto"  # the backend's decode_kernel setting that chooses per step


@dataclass(frozen=True)
class PathRecord:
    """What a step runs and why (``MLABackend.explain()``). Host values only, written once per step."""

    mode: str  # ForwardMode name of the step ("DECODE", "EXTEND", ...)
    path: AttentionPath  # path of the step's plain MLA layers
    kernel: str | None  # "fa3" / "flashmla" for the absorbed path; None when the MLA layers run MHA
    reason: str  # why this path / kernel (policy reasons, overrides, constraints, per-layer rules)
    graph: bool = False  # the metadata views CUDA-graph capture buffers (capture or replay)
    impl: str | None = None  # "fa3" / "reference": the ops implementation the step's kernels run
    kv_dtype: str | None = None  # storage dtype of the latent pool the step reads ("bfloat16", "float8_e4m3fn")
    other_paths: frozenset[AttentionPath] = frozenset()  # paths of the backend's non-MLA layers
    decision: PathDecision | None = None  # the prefill cost model's decision, when one was consulted
    kv_bytes: int | None = None  # latent-cache bytes one MLA layer reads this step (None: unknown, graphs)

    def summary(self) -> str:
        """One line for logs: ``DECODE: absorbed/fa3 (reference) — reason``."""
        kernel = f"/{self.kernel}" if self.kernel else ""
        impl = f" ({self.impl})" if self.impl else ""
        graph = " [graph]" if self.graph else ""
        others = ", also " + ", ".join(sorted(p.value for p in self.other_paths)) if self.other_paths else ""
        kv = f" kv {self.kv_dtype}" if self.kv_dtype else ""
        return f"{self.mode}: {self.path.value}{kernel}{impl}{kv}{graph}{others} — {self.reason}"


@dataclass
class StepPlan:
    """Everything the layers of one step read. Made by :class:`StepPlanner`; ``forward`` only executes it."""

    batch: ForwardBatch | None  # the batch planned for (None: a graph captured from a size alone)
    metadata: AttentionMetadata | None  # None for IDLE
    path: AttentionPath  # of the plain MLA layers
    kernel: DecodeKernel  # absorbed kernel of the plain MLA layers (FA3 for the others)
    num_heads: int | None  # the head count the FlashMLA schedule was planned for
    record: PathRecord
    flashmla_schedule: FlashMLASchedule | None = None  # when kernel is FLASHMLA (of the split rows on an MHA path)
    prefill: PrefillPlan | None = None  # when path is an MHA prefill
    graph_bs: int | None = None  # a CUDA-graph step: its captured size (the padded static batch is its batch)
    _seen: list[ForwardBatch] = field(default_factory=list, repr=False)  # batches already matched

    def route(self, layer: AttentionLayer) -> tuple[AttentionPath, DecodeKernel]:
        """(path, kernel) of ``layer`` in this step: the plan's, unless the layer needs what they lack."""
        plain = layer.logit_cap == 0 and layer.sliding_window < 0 and not layer.use_local_attention
        if not plain:
            return AttentionPath.ABSORBED, DecodeKernel.FA3
        if self.prefill is not None:
            return self.path, self.kernel
        if self.kernel is DecodeKernel.FLASHMLA and layer.num_heads != self.num_heads:
            return AttentionPath.ABSORBED, DecodeKernel.FA3
        return AttentionPath.ABSORBED, self.kernel

    def check_batch(self, batch: ForwardBatch) -> None:
        """Raise ValueError unless ``batch`` is the batch this plan was made for (host values only)."""
        if batch is self.batch or any(batch is b for b in self._seen):
            return
        if self.graph_bs is not None and batch.batch_size == self.graph_bs and self.metadata is not None \
                and batch.forward_mode is self.metadata.mode:
            self._seen.append(batch)  # the graph's static (padded) batch
            return
        planned = self.batch
        if planned is None:  # captured from a size: the mode and size must fit the captured metadata
            md = self.metadata
            if md is not None and batch.forward_mode is md.mode and batch.batch_size <= md.batch_size:
                self._seen.append(batch)
                return
            raise ValueError(f"batch ({batch.forward_mode.name}, {batch.batch_size} requests) does not fit the "
                             f"captured step ({self.record.mode}); replay-update for this batch first")
        if _same_step(planned, batch):
            self._seen.append(batch)
            return
        raise ValueError(f"batch is not the batch this step was planned for ({planned.forward_mode.name}, "
                         f"{planned.batch_size} requests): call init_forward_metadata for it first")


def _same_step(a: ForwardBatch, b: ForwardBatch) -> bool:
    """Two batches describe the same step: mode, sizes, draft fields and every host length agree."""
    if (a.forward_mode, a.batch_size, a.num_tokens, a.num_draft_tokens, a.draft_step) != \
            (b.forward_mode, b.batch_size, b.num_tokens, b.num_draft_tokens, b.draft_step):
        return False
    pairs = [(a.seq_lens_cpu, b.seq_lens_cpu), (a.extend_seq_lens_cpu, b.extend_seq_lens_cpu),
             (a.extend_prefix_lens_cpu, b.extend_prefix_lens_cpu), (a.encoder_lens_cpu, b.encoder_lens_cpu)]
    if a.req_pool_indices_cpu is not None and b.req_pool_indices_cpu is not None:  # rows, when both know them
        pairs.append((a.req_pool_indices_cpu, b.req_pool_indices_cpu))
    for x, y in pairs:
        if (x is None) != (y is None) or (x is not None and x is not y and not torch.equal(x, y)):
            return False
    return True


class StepPlanner:
    """Decides each step's plan from host values; owned by one backend.

    decode_kernel: a :class:`DecodeKernel` or ``DECODE_KERNEL_AUTO``. num_heads / mla_dims: of the MLA
    layers (per rank) — needed by FlashMLA's schedule (heads) and by the prefill cost model (both); without
    them, ``auto`` extend steps take the absorbed path and say so in the record.
    """

    def __init__(self, *, decode_kernel: DecodeKernel | str, page_size: int, num_heads: int | None,
                 mla_dims: MLADims | None, prefill_path: PrefillOverride, workspace_tokens: int,
                 req_to_token: torch.Tensor, impl: ops.Impl | None, device: torch.device,
                 kv_dtype: torch.dtype | None,
                 latent_width: int | None, other_paths: frozenset[AttentionPath]):
        self.decode_kernel = decode_kernel
        self.page_size = page_size
        self.num_heads = num_heads
        self.mla_dims = mla_dims
        self.prefill_path = prefill_path
        self.workspace_tokens = workspace_tokens
        self.req_to_token = req_to_token  # [rows, max_context] int32, device: the ReqToTokenPool's table
        self.impl = impl  # the backend's ops implementation (None: the ops global setting at call time)
        self.device = device
        self.kv_dtype = kv_dtype  # storage dtype of the latent pool
        self.kv_fp8 = kv_dtype == FP8_DTYPE  # e4m3 latent: FlashMLA FP8 decode, MHA prefill (dequantized)
        self.latent_width = latent_width  # r + d_rope of the latent pool (None without one)
        self.other_paths = other_paths
        self._workspace: PrefillWorkspace | None = None  # the MHA prefill's chunk buffers, reused

    # ------------------------------------------------------------------------------ decode kernel
    def choose_decode_kernel(self, batch_size: int, max_seqlen_k: int,
                             mean_seqlen_k: float | None = None) -> tuple[DecodeKernel, str]:
        """The absorbed kernel of a decode-like / verify step (host numbers only; mean None = unknown)."""
        if self.kv_fp8:
            choice = explain_decode_kernel(self.num_heads, max(batch_size, 1), max(max_seqlen_k, 1), self.page_size,
                                           kv_fp8=True)
            return choice.kernel, choice.reason
        if self.decode_kernel != DECODE_KERNEL_AUTO:
            return self.decode_kernel, f"decode_kernel={self.decode_kernel.value} (backend setting)"
        if self.page_size != FLASHMLA_PAGE_SIZE:
            return DecodeKernel.FA3, f"auto: page_size {self.page_size} != {FLASHMLA_PAGE_SIZE} -> FA3"
        choice = explain_decode_kernel(self.num_heads, max(batch_size, 1), max(max_seqlen_k, 1), self.page_size,
                                       mean_seqlen_k=mean_seqlen_k)
        return choice.kernel, f"auto: {choice.reason}"

    def graph_kernels(self) -> tuple[DecodeKernel, ...]:
        """Kernels worth a graph per batch size: both when the choice is per step on page 64, else one."""
        if self.kv_fp8:
            return (DecodeKernel.FLASHMLA,)
        if self.decode_kernel != DECODE_KERNEL_AUTO:
            return (self.decode_kernel,)
        if self.page_size != FLASHMLA_PAGE_SIZE:
            return (DecodeKernel.FA3,)
        return (DecodeKernel.FA3, DecodeKernel.FLASHMLA)

    def flashmla_schedule(self, metadata: AttentionMetadata) -> FlashMLASchedule:
        """FlashMLA's tile schedule for the step (not graph-legal: plan outside, ``copy_`` into a captured one)."""
        sq = queries_per_request(metadata.mode, metadata.num_draft_tokens)
        return ops.get_mla_decode_metadata(metadata.cache_seqlens, self.num_heads * sq, is_fp8=self.kv_fp8,
                                           impl=self.impl)

    # ------------------------------------------------------------------------------ plans
    def plan(self, batch: ForwardBatch, metadata: AttentionMetadata) -> StepPlan:
        """The eager step's plan (every mode)."""
        mode = batch.forward_mode
        if mode.is_idle():
            return StepPlan(batch, None, AttentionPath.IDLE, DecodeKernel.FA3, self.num_heads,
                            self._record(mode.name, AttentionPath.IDLE, None, "empty batch: nothing to compute"))
        if mode.is_extend_like():
            return self._plan_extend(batch, metadata)
        kernel, reason = self.choose_decode_kernel(batch.batch_size, metadata.max_seqlen_k, mean_seqlen(batch))
        return self.decode_plan(batch, metadata, kernel, reason, graph=False)

    def decode_plan(self, batch: ForwardBatch | None, metadata: AttentionMetadata, kernel: DecodeKernel,
                    reason: str, *, graph: bool, schedule: FlashMLASchedule | None = None) -> StepPlan:
        """The plan of a decode-like / verify step on ``kernel`` (eager, captured or replayed).

        ``schedule``: FlashMLA's schedule already planned for this step (a replay's captured one); planned
        here when the kernel is FLASHMLA and none is given."""
        if kernel is DecodeKernel.FLASHMLA:
            schedule = self.flashmla_schedule(metadata) if schedule is None else schedule
            reason += (f"; FA3 for layers with softcap / window / local attention or other than "
                       f"{self.num_heads} heads")
        record = self._record(metadata.mode.name, AttentionPath.ABSORBED, kernel.value, reason, graph=graph,
                              kv_bytes=self._kv_bytes(batch))
        return StepPlan(batch, metadata, AttentionPath.ABSORBED, kernel, self.num_heads, record, schedule,
                        graph_bs=metadata.batch_size if graph else None)

    def _plan_extend(self, batch: ForwardBatch, md: AttentionMetadata) -> StepPlan:
        if self.kv_fp8:
            return self._plan_extend_fp8(batch, md)
        mode = md.mode.name
        absorbed = (AttentionPath.ABSORBED, DecodeKernel.FA3.value)
        if self.prefill_path is PrefillOverride.ABSORBED:
            return self._extend(batch, md, *absorbed, "prefill_path='absorbed' (override)")
        if batch.batch_size == 0 or int(md.extend_lens_cpu.sum()) == 0:
            return self._extend(batch, md, *absorbed, f"{mode} with no new tokens: nothing to compute")
        if self.num_heads is None or self.mla_dims is None:
            return self._extend(batch, md, *absorbed, "prefill_path='auto': the backend was built without "
                                "num_heads / mla_dims, which the prefill cost model needs -> absorbed")
        if self._workspace is None:
            self._workspace = PrefillWorkspace(self.workspace_tokens)
        decision, prefill = plan_extend(md, self.req_to_token, batch.req_pool_indices, num_heads=self.num_heads,
                                        dims=self.mla_dims, workspace_tokens=self.workspace_tokens,
                                        page_size=self.page_size, prefill_path=self.prefill_path,
                                        workspace=self._workspace)
        if prefill is None:
            return self._extend(batch, md, *absorbed, decision.explain(), decision)
        reason = decision.explain() + "; absorbed FA3 for layers with softcap / window / local attention"
        return self._extend(batch, md, decision.path, None, reason, decision, prefill)

    def _plan_extend_fp8(self, batch: ForwardBatch, md: AttentionMetadata) -> StepPlan:
        """Extend-like step over an FP8 pool: MHA rows dequantize chunk by chunk; decode rows FlashMLA FP8."""
        fp8 = "FP8 latent pool: extend rows read it dequantized chunk by chunk (MHA prefill; FA3's absorbed " \
              "kernel cannot read e4m3)"
        if batch.batch_size == 0 or int(md.extend_lens_cpu.sum()) == 0:
            return self._extend(batch, md, AttentionPath.ABSORBED, None, f"{md.mode.name} with no new tokens: "
                                "nothing to compute")
        if self._workspace is None:
            self._workspace = PrefillWorkspace(self.workspace_tokens)
        decision, prefill = plan_extend(md, self.req_to_token, batch.req_pool_indices, num_heads=self.num_heads,
                                        dims=self.mla_dims, workspace_tokens=self.workspace_tokens,
                                        page_size=self.page_size, prefill_path=PrefillOverride.MHA,
                                        workspace=self._workspace)
        flashmla = "decode rows: FlashMLA FP8 (the only kernel that reads e4m3)"
        if prefill is None:  # every row is a decode row (one new token over a prefix)
            schedule = ops.get_mla_decode_metadata(md.cache_seqlens, self.num_heads, is_fp8=True, impl=self.impl)
            return self._extend(batch, md, AttentionPath.ABSORBED, DecodeKernel.FLASHMLA.value,
                                f"{decision.explain()}; {flashmla}", decision, kernel_enum=DecodeKernel.FLASHMLA,
                                schedule=schedule)
        schedule = None
        if prefill.split is not None:
            schedule = ops.get_mla_decode_metadata(prefill.split.absorbed_metadata.cache_seqlens, self.num_heads,
                                                   is_fp8=True, impl=self.impl)
        reason = f"{fp8}; {decision.explain()}" + (f"; {flashmla}" if schedule is not None else "")
        return self._extend(batch, md, decision.path, None, reason, decision, prefill,
                            kernel_enum=DecodeKernel.FLASHMLA, schedule=schedule)

    def _extend(self, batch, md, path, kernel, reason, decision=None, prefill=None, *,
                kernel_enum: DecodeKernel = DecodeKernel.FA3, schedule: FlashMLASchedule | None = None) -> StepPlan:
        record = self._record(md.mode.name, path, kernel, reason, decision=decision, kv_bytes=self._kv_bytes(batch))
        return StepPlan(batch, md, path, kernel_enum, self.num_heads, record, schedule, prefill=prefill)

    def _record(self, mode: str, path: AttentionPath, kernel: str | None, reason: str, **extra) -> PathRecord:
        return PathRecord(mode, path, kernel, reason, impl=ops.resolve_impl(self.impl, self.device).value,
                          kv_dtype=None if self.kv_dtype is None else str(self.kv_dtype).replace("torch.", ""),
                          other_paths=self.other_paths, **extra)

    def _kv_bytes(self, batch: ForwardBatch | None) -> int | None:
        """Latent rows one MLA layer reads this step (each request's keys once), from host lengths."""
        if batch is None or self.kv_dtype is None or self.latent_width is None or batch.seq_lens_cpu is None:
            return None
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return int(batch.seq_lens_cpu.long().sum()) * self.latent_width * elem


def mean_seqlen(batch: ForwardBatch) -> float | None:
    """Mean KV length of the live requests, from the batch's CPU copy (None for an empty batch)."""
    lens = batch.seq_lens_cpu
    if lens is None or not lens.numel():
        return None
    mean = float(lens.float().mean())
    return mean if math.isfinite(mean) else None
