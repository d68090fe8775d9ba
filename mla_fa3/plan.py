"""The step plan: what every layer of one step runs, decided once, before the first layer.

``MLABackend.init_forward_metadata(batch)`` (or its CUDA-graph twins) builds the step's
``AttentionMetadata`` and hands it to :class:`StepPlanner`, which decides everything a layer will run:

    plan(batch, metadata):
        IDLE                                   -> path IDLE (no kernel, no pool access)
        DECODE / DRAFT_DECODE / TARGET_VERIFY  -> path ABSORBED, kernel = decode_kernel setting, or per step
                                                  from policy.decode_kernel (host lengths, page 64 only);
                                                  the kernel's schedule planned here, once for every
                                                  layer (schedules.KernelSchedules): FLASHMLA's tiles;
                                                  FA3's tiles at bs <= FA3_STEP_SCHEDULE_MAX_BATCH;
                                                  SPLITKV's splits from batch.seq_lens_cpu (host, no sync)
        EXTEND / MIXED / DRAFT_EXTEND          -> policy.prefill_cost picks ABSORBED / MHA_ONESHOT /
                                                  MHA_CHUNKED from host lengths (or the prefill_path
                                                  override); an MHA path gets its PrefillPlan (chunks,
                                                  row split) from prefill_plan.build_prefill_plan
        -> StepPlan(metadata, path, kernel, schedule, splitkv_schedule, prefill, record)

FP8 latent pool (e4m3): every decode-like step runs FlashMLA's FP8 decode (page 64) or split-KV (any page
size), as the backend's kernel choice says (``policy.fp8_decode``); extend-like steps run the MHA prefill,
which dequantizes the rows it reads chunk by chunk, and their decode rows (MIXED) run the kernel that choice
gives for them, with a schedule planned here for those rows; a step whose rows are all decode rows runs it whole.

Every layer then asks :meth:`StepPlan.route` which (path, kernel) applies to it. The route is a fixed
rule of the plan, not a new decision: layers with softcap, a sliding window or local attention (which
neither FlashMLA, split-KV nor the MHA prefill model) and layers whose head count differs from the
planned one run the absorbed path on FA3.

CUDA graphs: a captured step's plan holds its kernel's schedule in fixed tensors, and each replay re-plans it
in place from the live ``cache_seqlens`` (:mod:`mla_fa3.schedules`; a captured SPLITKV schedule, planned with
every request at ``max_context``, has room for any plan of its batch size and is re-planned **on the device**)
— inside the graph's prologue with device metadata, else in the replay update. The :class:`PathRecord`
(``explain()``) is written once, with the plan.

The plan knows the batch it was made for: :meth:`StepPlan.check_batch` refuses a forward with another
batch (compared by identity, else by its host lengths: a few CPU ints, never a device value).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mla_fa3 import ops
from mla_fa3.batch import ForwardBatch
from mla_fa3.graphs.capture import LengthSources
from mla_fa3.ops.fp8 import FP8_DTYPE
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.ops import FA3Schedule, FlashMLASchedule, SplitKVSchedule
from mla_fa3.policy.kernel_choice import DecodeKernelChoice
from mla_fa3.policy.paths import AttentionPath, DecodeKernel, PrefillOverride
from mla_fa3.policy.prefill_cost import PathDecision
from mla_fa3.prefill_plan import PrefillPlan, PrefillWorkspace, plan_extend
from mla_fa3.schedules import KernelSchedules

__all__ = ["PathRecord", "StepPlan", "StepPlanner", "mean_seqlen"]

@dataclass(frozen=True)
class PathRecord:
    """What a step runs and why (``MLABackend.explain()``). Host values only, written once per step."""

    mode: str  # ForwardMode name of the step ("DECODE", "EXTEND", ...)
    path: AttentionPath  # path of the step's plain MLA layers
    kernel: str | None  # "fa3" / "flashmla" / "splitkv" chosen for the absorbed path; None when it runs MHA
    reason: str  # why this path / kernel (policy reasons, overrides, constraints, per-layer rules)
    graph: bool = False  # the metadata views CUDA-graph capture buffers (capture or replay)
    impl: str | None = None  # "fa3" / "reference": the ops implementation the step's kernels run
    kv_dtype: str | None = None  # storage dtype of the latent pool the step reads ("bfloat16", "float8_e4m3fn")
    other_paths: frozenset[AttentionPath] = frozenset()  # paths of the backend's non-MLA layers
    decision: PathDecision | None = None  # the prefill cost model's decision, when one was consulted
    kv_bytes: int | None = None  # latent-cache bytes one MLA layer reads this step (None: unknown, graphs)
    weight_bytes: int | None = None  # W_UK + W_UV bytes one MLA layer reads (None: heads / dims not given)
    num_splits: int | None = None  # split-KV work items (splits) per head tile, when the kernel is splitkv
    tree: tuple[int, int] | None = None  # a tree step's (m queries, n tree keys) per request (mla_fa3.tree)

    @property
    def ran(self) -> str | None:
        """What computed the absorbed path: the chosen kernel ("fa3", "flashmla", "splitkv"), or "reference" where
        the ops' torch reference ran in its place (impl "reference": on a CPU, or asked for); None for MHA."""
        if self.kernel is None:
            return None
        return "reference" if self.impl == "reference" else self.kernel

    def summary(self) -> str:
        """One line for logs: ``DECODE: absorbed/fa3 (reference) — reason``."""
        kernel = f"/{self.kernel}" if self.kernel else ""
        kernel += f" ({self.num_splits} splits)" if self.num_splits is not None else ""
        impl = f" ({self.impl})" if self.impl else ""
        graph = " [graph]" if self.graph else ""
        graph += f" [tree {self.tree[0]}x{self.tree[1]}]" if self.tree else ""
        others = ", also " + ", ".join(sorted(p.value for p in self.other_paths)) if self.other_paths else ""
        kv = f" kv {self.kv_dtype}" if self.kv_dtype else ""
        reads = [f"{name} {n / 2**20:.2f} MiB" for name, n in (("kv", self.kv_bytes), ("weights", self.weight_bytes))
                 if n is not None]
        reads_s = f" [reads per layer: {', '.join(reads)}]" if reads else ""
        return f"{self.mode}: {self.path.value}{kernel}{impl}{kv}{graph}{others}{reads_s} — {self.reason}"


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
    splitkv_schedule: SplitKVSchedule | None = None  # when kernel is SPLITKV
    fa3_schedule: FA3Schedule | None = None  # kernel FA3 on a small decode-like step: its plain layers read it
    prefill: PrefillPlan | None = None  # when path is an MHA prefill
    graph_bs: int | None = None  # a CUDA-graph step: its captured size
    static_batch: ForwardBatch | None = None  # a replayed graph step: the static batch it was captured with
    prologue_pending: bool = False  # device metadata: the graph prologue has not run for this plan yet
    length_sources: LengthSources | None = None  # a DECODE graph reading its lengths on the device (graphs.capture)
    _seen: list[ForwardBatch] = field(default_factory=list, repr=False)  # batches already matched

    def route(self, layer: AttentionLayer) -> tuple[AttentionPath, DecodeKernel]:
        """(path, kernel) of ``layer`` in this step: the plan's, unless the layer needs what they lack."""
        if not layer.is_plain:
            return AttentionPath.ABSORBED, DecodeKernel.FA3
        if self.prefill is not None:
            return self.path, self.kernel
        if self.kernel in (DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV) and layer.num_heads != self.num_heads:
            return AttentionPath.ABSORBED, DecodeKernel.FA3
        return AttentionPath.ABSORBED, self.kernel

    def schedule_for(self, layer: AttentionLayer, kernel: DecodeKernel
                     ) -> FlashMLASchedule | SplitKVSchedule | FA3Schedule | None:
        """The planned schedule ``layer`` reads with ``kernel`` (its :meth:`route`), or None (FA3 plans its own)."""
        if kernel is DecodeKernel.SPLITKV:
            return self.splitkv_schedule
        if kernel is DecodeKernel.FLASHMLA:
            return self.flashmla_schedule
        return self.fa3_schedule if layer.is_plain and layer.num_heads == self.num_heads else None

    def check_batch(self, batch: ForwardBatch) -> None:
        """Raise ValueError unless ``batch`` is the batch this plan was made for (host values only)."""
        if batch is self.batch or any(batch is b for b in self._seen):
            return
        if batch is self.static_batch:  # a replayed graph runs the layers on its static (padded) batch
            return
        if self.graph_bs is not None and self.static_batch is None and self.metadata is not None \
                and batch.batch_size == self.graph_bs and batch.forward_mode is self.metadata.mode:
            self._seen.append(batch)  # captured from a size alone: a padded batch of that size
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
    if a.tree is not b.tree:  # trees: the same object, or equal host copies
        if a.tree is None or b.tree is None or a.tree.mask_cpu is None or b.tree.mask_cpu is None:
            return False
        pairs.append((a.tree.mask_cpu, b.tree.mask_cpu))
    for x, y in pairs:
        if (x is None) != (y is None) or (x is not None and x is not y and not torch.equal(x, y)):
            return False
    return True


class StepPlanner:
    """Decides each step's plan from host values; owned by one backend.

    decode_kernel: a :class:`DecodeKernel` or ``policy.paths.DECODE_KERNEL_AUTO``. num_heads / mla_dims: of the MLA
    layers (per rank) — needed by FlashMLA's schedule (heads) and by the prefill cost model (both); without
    them, ``auto`` extend steps take the absorbed path and say so in the record.
    """

    def __init__(self, *, decode_kernel: DecodeKernel | str, page_size: int, num_heads: int | None,
                 mla_dims: MLADims | None, prefill_path: PrefillOverride, workspace_tokens: int,
                 req_to_token: torch.Tensor, impl: ops.Impl | None, device: torch.device,
                 kv_dtype: torch.dtype | None, latent_width: int | None, other_paths: frozenset[AttentionPath],
                 weight_dtype: torch.dtype | None = None, whole_row_kernels: bool = True):
        self.page_size = page_size
        self.num_heads = num_heads
        self.mla_dims = mla_dims
        self.prefill_path = prefill_path
        self.workspace_tokens = workspace_tokens
        self.req_to_token = req_to_token  # [rows, max_context] int32, device: the ReqToTokenPool's table
        self.impl = impl  # the backend's ops implementation (None: the ops global setting at call time)
        self.device = device
        self.kv_dtype = kv_dtype  # storage dtype of the latent pool
        self.kv_fp8 = kv_dtype == FP8_DTYPE  # e4m3 latent: FlashMLA FP8 / split-KV decode, MHA prefill (dequantized)
        self.latent_width = latent_width  # r + d_rope of the latent pool (None without one)
        self.other_paths = other_paths
        self._workspace: PrefillWorkspace | None = None  # the MHA prefill's chunk buffers, reused
        # the decode kernel of decode-like steps: the setting, or auto's cached per-step choice
        self.kernel_choice = DecodeKernelChoice(decode_kernel=decode_kernel, page_size=page_size, num_heads=num_heads,
                                                kv_fp8=self.kv_fp8, whole_row_kernels=whole_row_kernels, impl=impl,
                                                device=device)
        # the FlashMLA / split-KV / FA3 schedules of the kernel chosen, planned for the step (and re-planned per replay)
        self.schedules = KernelSchedules(page_size=page_size, num_heads=num_heads, mla_dims=mla_dims,
                                         kv_fp8=self.kv_fp8, weight_dtype=weight_dtype, impl=impl, device=device)
        self._impl_names: dict = {}  # ops implementation setting -> the implementation's name (_impl_name)
        self._kv_itemsize = None if kv_dtype is None else kv_dtype.itemsize
        self._kv_dtype_name = None if kv_dtype is None else str(kv_dtype).replace("torch.", "")
        # W_UK [H, d_nope, r] and W_UV [H, r, d_v]: read by every MLA layer (absorption / projection, or
        # the MHA prefill's decompression), in the compute dtype
        self._weight_bytes = None if num_heads is None or mla_dims is None or weight_dtype is None else (
            num_heads * mla_dims.kv_lora_rank * (mla_dims.qk_nope_head_dim + mla_dims.v_head_dim)
            * weight_dtype.itemsize)

    # ------------------------------------------------------------------------------ plans
    def plan(self, batch: ForwardBatch, metadata: AttentionMetadata) -> StepPlan:
        """The eager step's plan (every mode)."""
        mode = batch.forward_mode
        if mode.is_idle():
            return StepPlan(batch, None, AttentionPath.IDLE, DecodeKernel.FA3, self.num_heads,
                            self._record(mode.name, AttentionPath.IDLE, None, "empty batch: nothing to compute"))
        if mode.is_extend_like():
            return self._plan_extend(batch, metadata)
        kernel, reason = self.kernel_choice.choose_decode_kernel(batch.batch_size, metadata.max_seqlen_k,
                                                                 mean_seqlen(batch))
        return self.decode_plan(batch, metadata, kernel, reason, graph=False)

    def decode_plan(self, batch: ForwardBatch | None, metadata: AttentionMetadata, kernel: DecodeKernel,
                    reason: str, *, graph: bool,
                    schedule: FlashMLASchedule | SplitKVSchedule | FA3Schedule | None = None,
                    static_batch: ForwardBatch | None = None) -> StepPlan:
        """The plan of a decode-like / verify step on ``kernel`` (eager, captured or replayed).

        ``schedule``: the kernel's schedule already planned for this step (a replay's captured one, its new
        plan copied in); planned here when the kernel is FLASHMLA / SPLITKV and none is given (a captured
        SPLITKV graph: sized for any lengths of its batch size); FA3's own on a small step
        (:meth:`KernelSchedules.fa3_schedule`).
        ``static_batch``: a replay's capture batch."""
        splits = None
        if kernel in (DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV):
            reason += (f"; FA3 for layers with softcap / window / local attention or other than "
                       f"{self.num_heads} heads")
        if kernel is DecodeKernel.FLASHMLA and schedule is None:
            schedule = self.schedules.flashmla_schedule(metadata)
        if kernel is DecodeKernel.SPLITKV:
            if schedule is None:
                schedule = self.schedules.splitkv_schedule(metadata, None if graph else metadata.cache_seqlens_cpu)
            if graph:  # the count is a device value: the graph re-plans its splits from the lengths it runs with
                reason += "; splits planned on the device from the live lengths"
            else:
                splits = schedule.planned_work
        if kernel is DecodeKernel.FA3:
            if schedule is None:
                schedule = self.schedules.fa3_schedule(metadata)
            if schedule is not None:
                reason += "; FA3's tile schedule planned once for the step's layers"
        tree = metadata.tree
        if tree is not None:
            reason += (f"; tree of {tree.num_queries} queries x {tree.num_keys} keys per request: the prefix on "
                       f"{kernel.value} (no causal mask), then the tree part merged into it by LSE "
                       "(ops.tree_attention: one Triton launch on CUDA, torch elsewhere)")
        record = self._record(metadata.mode.name, AttentionPath.ABSORBED, kernel.value, reason, graph=graph,
                              kv_bytes=self._kv_bytes(batch), num_splits=splits,
                              tree=None if tree is None else (tree.num_queries, tree.num_keys))
        flashmla = schedule if kernel is DecodeKernel.FLASHMLA else None
        splitkv = schedule if kernel is DecodeKernel.SPLITKV else None
        fa3 = schedule if kernel is DecodeKernel.FA3 else None
        return StepPlan(batch, metadata, AttentionPath.ABSORBED, kernel, self.num_heads, record, flashmla,
                        splitkv_schedule=splitkv, fa3_schedule=fa3, graph_bs=metadata.batch_size if graph else None,
                        static_batch=static_batch)

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
        decision, prefill = self._prefill_plan(batch, md, self.prefill_path)
        if prefill is None:
            return self._extend(batch, md, *absorbed, decision.explain(), decision)
        reason = decision.explain() + "; absorbed FA3 for layers with softcap / window / local attention"
        return self._extend(batch, md, decision.path, None, reason, decision, prefill)

    def _prefill_plan(self, batch: ForwardBatch, md: AttentionMetadata, override: PrefillOverride):
        """The prefill cost model's decision and, for an MHA path, its chunks (the workspace reused)."""
        if self._workspace is None:
            self._workspace = PrefillWorkspace(self.workspace_tokens)
        return plan_extend(md, self.req_to_token, batch.req_pool_indices, num_heads=self.num_heads,
                           dims=self.mla_dims, workspace_tokens=self.workspace_tokens, page_size=self.page_size,
                           prefill_path=override, workspace=self._workspace)

    def _plan_extend_fp8(self, batch: ForwardBatch, md: AttentionMetadata) -> StepPlan:
        """Extend-like step over an FP8 pool: MHA rows dequantize chunk by chunk; decode rows (one new token over a
        prefix) on the decode kernel the backend's choice gives for them (FlashMLA FP8 or split-KV)."""
        fp8 = "FP8 latent pool: extend rows read it dequantized chunk by chunk (MHA prefill; FA3's absorbed " \
              "kernel cannot read e4m3)"
        if batch.batch_size == 0 or int(md.extend_lens_cpu.sum()) == 0:
            return self._extend(batch, md, AttentionPath.ABSORBED, None, f"{md.mode.name} with no new tokens: "
                                "nothing to compute")
        decision, prefill = self._prefill_plan(batch, md, PrefillOverride.MHA)
        if prefill is None:  # every row is a decode row (one new token over a prefix)
            kernel, schedule, why = self._fp8_decode_rows(md)
            return self._extend(batch, md, AttentionPath.ABSORBED, kernel.value, f"{decision.explain()}; {why}",
                                decision, kernel_enum=kernel, schedule=schedule)
        # no decode rows: no absorbed kernel runs; the plan names the one that reads this pool
        kernel, schedule, why = self.kernel_choice.pool_reader(), None, None
        if prefill.split is not None:
            kernel, schedule, why = self._fp8_decode_rows(prefill.split.absorbed_metadata)
        reason = f"{fp8}; {decision.explain()}" + (f"; {why}" if why else "")
        return self._extend(batch, md, decision.path, None, reason, decision, prefill, kernel_enum=kernel,
                            schedule=schedule)

    def _fp8_decode_rows(self, md: AttentionMetadata) -> tuple[DecodeKernel, FlashMLASchedule | SplitKVSchedule, str]:
        """(kernel, its schedule, why) for the decode rows of an extend-like step on an FP8 pool (host lengths)."""
        lens = md.cache_seqlens_cpu
        mean = float(lens.sum()) / md.batch_size if lens is not None and md.batch_size else None
        kernel, why = self.kernel_choice.choose_decode_kernel(md.batch_size, md.max_seqlen_k, mean)
        if kernel is DecodeKernel.SPLITKV:
            schedule = self.schedules.splitkv_schedule(md, lens)
        else:
            schedule = self.schedules.flashmla_schedule(md)  # an FP8 pool: FlashMLA's FP8 decode
        return kernel, schedule, f"decode rows: {why}"

    def _extend(self, batch, md, path, kernel, reason, decision=None, prefill=None, *,
                kernel_enum: DecodeKernel = DecodeKernel.FA3,
                schedule: FlashMLASchedule | SplitKVSchedule | None = None) -> StepPlan:
        record = self._record(md.mode.name, path, kernel, reason, decision=decision, kv_bytes=self._kv_bytes(batch))
        splitkv = schedule if isinstance(schedule, SplitKVSchedule) else None
        flashmla = None if splitkv is not None else schedule
        return StepPlan(batch, md, path, kernel_enum, self.num_heads, record, flashmla, splitkv_schedule=splitkv,
                        prefill=prefill)

    def _record(self, mode: str, path: AttentionPath, kernel: str | None, reason: str, **extra) -> PathRecord:
        return PathRecord(mode, path, kernel, reason, impl=self._impl_name(),
                          kv_dtype=self._kv_dtype_name, weight_bytes=self._weight_bytes,
                          other_paths=self.other_paths, **extra)

    def _impl_name(self) -> str:
        """The ops implementation the step's kernels run, cached per setting (as ``_splitkv_usable``)."""
        key = ops.get_impl() if self.impl is None else self.impl
        hit = self._impl_names.get(key)
        if hit is None:
            hit = self._impl_names[key] = ops.resolve_impl(self.impl, self.device).value
        return hit

    def _kv_bytes(self, batch: ForwardBatch | None) -> int | None:
        """Latent rows one MLA layer reads this step (each request's keys once), from host lengths."""
        if batch is None or self.kv_dtype is None or self.latent_width is None or batch.seq_lens_cpu is None:
            return None
        return batch.seq_lens_sum * self.latent_width * self._kv_itemsize


def mean_seqlen(batch: ForwardBatch) -> float | None:
    """Mean KV length of the live requests, from the batch's CPU copy (None for an empty batch)."""
    if batch.seq_lens_cpu is None or not batch.batch_size:
        return None
    return batch.seq_lens_sum / batch.batch_size  # host ints read once per batch (ForwardBatch.check)
