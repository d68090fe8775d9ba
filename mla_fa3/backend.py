"""MLABackend: the attention backend a DeepSeek-style model calls — plan once per step, run per layer.

The step, as the engine and the model drive it:

    backend.init_forward_metadata(batch)               # once per step (or the CUDA-graph twins below)
        metadata = MetadataBuilder.build(batch)        #   metadata.py: page table, cu_seqlens, host maxima
        plan     = StepPlanner.plan(batch, metadata)   #   plan.py: path, kernel, FlashMLA schedule, chunks
    for layer in model.layers:
        o = backend.forward(q, latent, None, layer, batch)
            plan.check_batch(batch); checks of shapes and dtypes (no tensor value read: no sync)
            store the new latent rows at batch.out_cache_loc                 (kv/pools.py)
            path, kernel = plan.route(layer); schedule = plan.schedule_for(layer, kernel)
            ABSORBED     -> absorb.forward_absorbed(q, layer, metadata, pool, kernel, schedule)
                            (a tree step: absorb_tree.forward_absorbed_tree — prefix + tree part, LSE merge)
            MHA_ONESHOT / MHA_CHUNKED -> chunked_prefix.forward_mha_prefill(q, latent, layer, metadata,
                                                                             pool, plan.prefill)
            MHA / CROSS layers        -> mha_fallback.forward(...)
            IDLE                      -> an empty [0, H, d_v] output; no kernel, no pool access

Checked before anything is written (``batch_checks.BatchChecks.validate``, run by the builder; host values
only): every row of the batch is held in the ``ReqToTokenPool`` and ``seq_lens`` stay within the tokens
allocated to it, on every path; ``out_cache_loc`` slots are the request's own (``req_to_token``) and
distinct — on the host for CPU tensors, on a GPU only with ``debug_checks=True`` (reading device values
syncs). ``forward`` with a batch other than the planned one raises (``StepPlan.check_batch``).

Empty batches: IDLE, and an EXTEND / MIXED / DRAFT_EXTEND batch with no requests (or no new tokens),
work on every ``prefill_path`` ('absorbed', 'auto', 'mha'): the plan is the absorbed path ("no new
tokens: nothing to compute"), ``forward`` returns an empty ``[0, H, d_v]`` output, nothing is written
and a retry plans the same.

MLA layer (``LayerKind.MLA``), symbols of :mod:`mla_fa3.absorb`:
    q      [T, H, d_nope + d_rope]   RoPE applied
    k      [T, r + d_rope]           the new tokens' latent rows [c_kv (normed) | k_rope (roped)], v None
           (or k = c_kv [T, r] and v = k_rope [T, d_rope]); stored at ``batch.out_cache_loc`` first
    out    [T, H, d_v]

FP8 latent pool (``MLATokenPool(kv_dtype=torch.float8_e4m3fn)``): rows are quantized as they are stored
(per-layer scale), decode-like steps run FlashMLA's FP8 decode (q quantized per step on the device; page
64) or the split-KV kernel (q kept in its dtype; any page size) — ``policy.fp8_decode``; extend rows read the
latent dequantized chunk by chunk (MHA prefill); the pool is never dequantized whole. It needs the MLA
layers' ``num_heads`` / ``mla_dims``, and off page 64 a split-KV kernel that runs here (checked here, before
any kernel runs); layers with softcap, a window, local attention or another head count cannot read it.

CUDA graphs (DECODE, TARGET_VERIFY, DRAFT_DECODE; ``decode_graphs.DecodeGraphs``): ``init_cuda_graph_state``
allocates the builder's capture buffers once; ``init_forward_metadata_capture_cuda_graph`` plans a step over views of
them and records the kernel baked into the graph; ``init_forward_metadata_replay_cuda_graph`` rewrites the
buffers in place (``MetadataBuilder.replay``) and re-plans the FlashMLA, split-KV or FA3 schedule into the
captured schedule tensors from the live device lengths — in the replay update, or inside the graph itself
(``graph_prologue``) when ``init_cuda_graph_state(device_metadata=True)``; a DECODE graph captured with
``lengths_from`` reads its lengths from the engine's own buffers and is replayed by
``init_forward_metadata_replay_device_lengths`` (host checks alone).
"""

from __future__ import annotations

import torch

from mla_fa3 import absorb, absorb_tree, chunked_prefix, mha_fallback, ops
from mla_fa3.backend_config import resolve_config
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.checks import check_int
from mla_fa3.decode_graphs import DecodeGraphs
from mla_fa3.graphs.capture import LengthSources
from mla_fa3.layer import AttentionLayer, LayerKind, MLADims
from mla_fa3.metadata import AttentionMetadata, MetadataBuilder
from mla_fa3.plan import PathRecord, StepPlan, StepPlanner
from mla_fa3.policy.paths import AttentionPath, DecodeKernel, PrefillOverride
from mla_fa3.prefill_graph import PrefillGraphs
from mla_fa3.prefill_plan import PREFILL_WORKSPACE_BYTES, workspace_tokens_for_bytes
from mla_fa3.tree import DraftTreeError

__all__ = ["MLABackend"]


class MLABackend:
    """Attention backend over an MLA latent pool (and optionally an MHA pool for MHA / CROSS layers)."""

    def __init__(self, *, req_to_token_pool, kv_pool, page_size: int, device, decode_kernel=None,
                 num_heads: int | None = None, mla_dims: MLADims | None = None, prefill_path: str = "auto",
                 prefill_workspace_bytes: int = PREFILL_WORKSPACE_BYTES, prefill_workspace_tokens: int | None = None,
                 attention_chunk_size: int | None = None, impl=None, prefill_graph_shapes: int = 0,
                 debug_checks: bool = False):
        """
        kv_pool: an ``MLATokenPool``, an ``MHATokenPool``, or a tuple of both (mixed models).
        decode_kernel: 'fa3', 'flashmla' (page 64 only), 'splitkv' (the Triton split-KV kernel; any page
            size) or 'auto' (``policy.decode_kernel`` per step); None (default) = 'fa3', or 'auto' for an
            FP8 latent pool (``policy.fp8_decode``: FlashMLA FP8 or split-KV; 'fa3' with an FP8 pool is an error).
        num_heads: query heads of the MLA layers (per rank); required for 'flashmla' / 'auto' because the
            FlashMLA schedule is planned once per step, before any layer runs.
        mla_dims: the MLA layers' :class:`MLADims`; with ``num_heads`` they let the prefill cost model
            choose a path for extend steps (without them 'auto' extend steps run absorbed, as explained).
        prefill_path: 'auto' | 'absorbed' | 'mha' — override of the prefill cost model for extend-like steps;
        prefill_workspace_bytes: device memory of the chunked MHA prefill's workspace (default 512 MiB); the
            prefix tokens decompressed per chunk follow from it and the head count
            (``prefill_plan.workspace_tokens_for_bytes``: ~47k tokens at 16 heads, ~6.4k at 128, V3 dims bf16).
        prefill_workspace_tokens: an explicit tokens-per-chunk override of that budget (tests, benchmarks).
        impl: ``ops`` implementation for every kernel call (None = the ops global setting).
        prefill_graph_shapes: > 0 replays the MHA prefill of each layer from a CUDA graph when a step's
            lengths repeat, keeping graphs for at most this many shapes (``prefill_graph.PrefillGraphs``:
            captured the second time a shape is seen; split steps, CPU and the reference run eagerly).
            0 (default): eager. ``prefill_graphs.stats`` counts captures and replays.
        """
        self.device = torch.device(device)
        self.page_size = check_int(page_size, "page_size")
        cfg = resolve_config(kv_pool, self.page_size, self.device, decode_kernel, num_heads, mla_dims,
                             prefill_path, impl)
        self.mla_pool, self.mha_pool, self.decode_kernel = cfg.mla_pool, cfg.mha_pool, cfg.decode_kernel
        self.kv_fp8, self.whole_row_kernels_fit = cfg.kv_fp8, cfg.whole_row_kernels_fit
        if num_heads is not None or self.decode_kernel is not DecodeKernel.FA3:
            kernel = getattr(self.decode_kernel, "value", self.decode_kernel)
            if num_heads is None:
                raise ValueError(f"num_heads (the MLA layers' query heads) is required with decode_kernel={kernel}")
            check_int(num_heads, "num_heads")
        if mla_dims is not None and not isinstance(mla_dims, MLADims):
            raise TypeError(f"mla_dims must be an MLADims, got {type(mla_dims).__name__}")
        override = PrefillOverride.coerce(prefill_path)
        if override is PrefillOverride.MHA and (num_heads is None or mla_dims is None):
            raise ValueError("prefill_path='mha' needs num_heads and mla_dims (the MHA prefill's cost model)")
        check_int(prefill_workspace_bytes, "prefill_workspace_bytes")
        if prefill_workspace_tokens is not None:
            if check_int(prefill_workspace_tokens, "prefill_workspace_tokens") < page_size:
                raise ValueError(f"prefill_workspace_tokens must be >= page_size {page_size}, got {prefill_workspace_tokens}")
        elif num_heads is not None and mla_dims is not None and self.mla_pool is not None:
            prefill_workspace_tokens = workspace_tokens_for_bytes(num_heads, mla_dims, prefill_workspace_bytes,
                                                                  self.mla_pool.dtype, page_size=page_size)
        else:  # no MHA prefill without heads and dims: the value is never used
            prefill_workspace_tokens = page_size
        self.prefill_workspace_tokens = prefill_workspace_tokens
        shapes = check_int(prefill_graph_shapes, "prefill_graph_shapes", 0)
        self.prefill_graphs = PrefillGraphs(shapes) if shapes else None  # CUDA graphs of repeating MHA prefills
        self.num_heads = num_heads
        self.impl = ops.coerce_impl(impl)
        ops.resolve_impl(self.impl, self.device)  # FA3 asked where it cannot run: a named error now
        slots = [p.num_slots for p in (self.mla_pool, self.mha_pool) if p is not None]
        # the builder range-checks out_cache_loc and page ids against the pool (on the host for CPU
        # tensors; on a GPU only with debug_checks, since reading device values would sync)
        self.builder = MetadataBuilder(req_to_token_pool, page_size, self.device,
                                       attention_chunk_size=attention_chunk_size, debug_checks=debug_checks,
                                       num_slots=min(slots))
        pool = self.mla_pool
        self.planner = StepPlanner(
            decode_kernel=self.decode_kernel, page_size=page_size, num_heads=num_heads, mla_dims=mla_dims,
            prefill_path=override, workspace_tokens=prefill_workspace_tokens, req_to_token=self.builder.req_to_token,
            impl=self.impl, device=self.device, kv_dtype=None if pool is None else pool.kv_dtype,
            latent_width=None if pool is None else pool.kv_lora_rank + pool.qk_rope_head_dim,
            other_paths=frozenset({AttentionPath.MHA_FALLBACK}) if self.mha_pool is not None else frozenset(),
            weight_dtype=None if pool is None else pool.dtype, whole_row_kernels=self.whole_row_kernels_fit)
        self.step_plan: StepPlan | None = None  # the current step's plan (eager, captured or replayed)
        self.graphs = DecodeGraphs(self.builder, self.planner)  # the captured decode-like steps
        self.graph_kernel: DecodeKernel | None = None  # kernel of the graph the last capture / replay update chose

    @property
    def forward_metadata(self) -> AttentionMetadata | None:
        """The current step's metadata (None before the first step and for IDLE)."""
        return None if self.step_plan is None else self.step_plan.metadata

    def graph_kernels(self) -> tuple[DecodeKernel, ...]:
        """Kernels worth capturing a graph for, per batch size (both on page 64 with 'auto')."""
        return self.planner.kernel_choice.graph_kernels()

    def explain(self) -> PathRecord | None:
        """What the last planned step runs (mode, path, kernel, reason, impl), or None before any step."""
        return None if self.step_plan is None else self.step_plan.record

    # ------------------------------------------------------------------------------ per step
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the step once: metadata (every mode), then path, kernel, FlashMLA schedule, prefill chunks."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        self.step_plan = None  # a step that fails to plan leaves no stale plan behind
        self.step_plan = self.planner.plan(batch, self.builder.build(batch))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayer,
                batch: ForwardBatch, *, save_kv_cache: bool = True) -> torch.Tensor:
        """One layer of the step planned by the last init_forward_metadata / replay. Returns [T, H, d_v]."""
        plan = self._plan_for(q, layer, batch)
        if plan.path is AttentionPath.IDLE:
            return torch.empty(0, layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
        tree = plan.metadata is not None and plan.metadata.tree is not None
        if tree and layer.kind is not LayerKind.MLA:
            raise DraftTreeError(f"layer {layer.layer_id} (LayerKind.{layer.kind.name}): a tree step runs MLA layers "
                                 "only (the MHA fallback has no tree form)")
        if tree:
            absorb_tree.check_tree_layer(layer)
        if layer.kind is not LayerKind.MLA:
            if self.mha_pool is None:
                raise ValueError(f"kv_pool has no MHATokenPool for layer {layer.layer_id} (LayerKind.{layer.kind.name})")
            return mha_fallback.forward(q, k, v, layer, batch, plan.metadata, self.mha_pool,
                                        save_kv_cache=save_kv_cache, impl=self.impl)
        self._check_mla_step(q, k, v, layer, save_kv_cache)
        if self.kv_fp8:
            _check_fp8_layer(layer, plan)
        if save_kv_cache and k is not None:
            self._save_latent(layer, batch, k, v)
        if self.kv_fp8 and q.shape[0] == 0:  # no rows: no kernel (FlashMLA needs a planned schedule)
            return q.new_empty(0, layer.num_heads, layer.v_head_dim)
        kv_paged = self.mla_pool.paged(layer.layer_id)
        kv_scale = self.mla_pool.layer_scale(layer.layer_id)  # None for a floating pool
        path, kernel = plan.route(layer)
        schedule = plan.schedule_for(layer, kernel)
        if path.is_mha_prefill:
            latent_new = k if (save_kv_cache and k is not None and v is None) else None
            return chunked_prefix.forward_mha_prefill(q, latent_new, layer, plan.metadata, kv_paged, plan.prefill,
                                                      kv_scale=kv_scale, absorbed_kernel=kernel,
                                                      schedule=schedule, impl=self.impl, graphs=self.prefill_graphs)
        attend = absorb_tree.forward_absorbed_tree if tree else absorb.forward_absorbed
        return attend(q, layer, plan.metadata, kv_paged, kernel=kernel, schedule=schedule, kv_scale=kv_scale,
                      impl=self.impl, validate=False)

    # ------------------------------------------------------------------------------ checks and store
    def _plan_for(self, q, layer: AttentionLayer, batch: ForwardBatch) -> StepPlan:
        """The current plan, after checks that read no tensor value (no sync)."""
        if not isinstance(layer, AttentionLayer):
            raise TypeError(f"layer must be an AttentionLayer, got {type(layer).__name__}")
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        plan = self.step_plan
        if plan is None:
            raise ValueError("batch: init_forward_metadata (or a CUDA-graph replay) must run before forward")
        if plan.record.mode != batch.forward_mode.name:
            raise ValueError(f"batch is {batch.forward_mode.name} but the planned step is {plan.record.mode}: "
                             "call init_forward_metadata for this batch first")
        plan.check_batch(batch)
        if plan.prologue_pending:  # its page table / FlashMLA schedule would be stale: refuse, loudly
            raise RuntimeError("this CUDA-graph step's metadata is derived on the device: graph_prologue() must run "
                               "(be captured) before its layers — GraphRunner does it; init_cuda_graph_state("
                               "device_metadata=False) for engines that capture their graphs themselves")
        if q.dim() < 1 or q.shape[0] != batch.num_tokens:
            raise ValueError(f"q must have batch.num_tokens = {batch.num_tokens} rows, got shape {tuple(q.shape)}")
        return plan

    def _check_mla_step(self, q, k, v, layer: AttentionLayer, save_kv_cache: bool) -> None:
        """Shape/dtype checks of an MLA layer call (no sync)."""
        if self.mla_pool is None:
            raise ValueError(f"kv_pool has no MLATokenPool for MLA layer {layer.layer_id}")
        absorb.check_query(q, layer)
        pool = self.mla_pool
        if q.dtype != pool.dtype:
            raise TypeError(f"q dtype {q.dtype} must match the latent pool dtype {pool.dtype}")
        if layer.mla.kv_lora_rank != pool.kv_lora_rank or layer.mla.qk_rope_head_dim != pool.qk_rope_head_dim:
            raise ValueError(f"layer {layer.layer_id} has r={layer.mla.kv_lora_rank}, d_rope={layer.mla.qk_rope_head_dim} "
                             f"but the latent pool has {pool.kv_lora_rank}, {pool.qk_rope_head_dim}")
        if not 0 <= layer.layer_id < pool.num_layers:
            raise ValueError(f"layer.layer_id {layer.layer_id} is outside the latent pool's {pool.num_layers} layers")
        if not save_kv_cache or k is None:
            if v is not None and k is None:
                raise ValueError("v must be None when k is None")
            return
        T, r, dr = q.shape[0], layer.mla.kv_lora_rank, layer.mla.qk_rope_head_dim
        parts = (("k", k, r + dr),) if v is None else (("k", k, r), ("v", v, dr))
        for name, t, width in parts:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != (T, width):
                what = "latent [c_kv | k_rope]" if v is None else ("c_kv" if name == "k" else "k_rope")
                raise ValueError(f"{name} must be the {what} of shape [{T}, {width}], got {tuple(t.shape)}")
            if t.dtype != pool.dtype:
                raise TypeError(f"{name} dtype {t.dtype} must match the latent pool dtype {pool.dtype}")

    def _save_latent(self, layer: AttentionLayer, batch: ForwardBatch, k, v) -> None:
        """Store the new tokens' latent rows at batch.out_cache_loc (one row write when k is the latent)."""
        if v is None:
            self.mla_pool.set_latent(layer.layer_id, batch.out_cache_loc, k)
        else:
            self.mla_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)

    # ------------------------------------------------------------------------------ CUDA graphs (decode_graphs.py)
    @property
    def device_metadata(self) -> bool:
        """Whether captured graphs derive their page table and schedule themselves (:meth:`graph_prologue`)."""
        return self.graphs.device_metadata

    @property
    def reads_lengths_on_device(self) -> bool:
        """Whether a DECODE capture may take ``lengths_from`` (device metadata over device-derived page tables)."""
        return self.graphs.reads_lengths_on_device

    def init_cuda_graph_state(self, max_bs: int, max_context: int, *, max_num_draft_tokens: int = 1,
                              with_encoder: bool = False, device_metadata: bool = False) -> None:
        """Allocate the capture buffers once (through the builder); call before any capture.

        ``device_metadata``: the caller runs :meth:`graph_prologue` inside every captured graph, before
        its layers (``graphs.runner.GraphRunner`` does): the page table (where the buffers allow it) and
        the FlashMLA schedule are then derived on the device by the graph itself, and a replay update
        is one host->device copy plus host checks. Without it the replay update writes them."""
        self.graphs.init_state(max_bs, max_context, max_num_draft_tokens=max_num_draft_tokens,
                               with_encoder=with_encoder, device_metadata=device_metadata,
                               pad_seqlen=self.get_cuda_graph_seq_len_fill_value())

    def graph_prologue(self) -> None:
        """Device work of the captured / replayed step that runs inside its CUDA graph, before the layers
        (with ``init_cuda_graph_state(device_metadata=True)``): the lengths when the graph reads them on the
        device, the page table from ``req_to_token`` and the FlashMLA, split-KV or FA3 schedule from the live
        lengths. Fixed shapes, no host value read."""
        self.graphs.prologue(self.step_plan)

    def init_forward_metadata_capture_cuda_graph(self, bs, mode: ForwardMode | None = None, *,
                                                 num_draft_tokens: int = 1, kernel: DecodeKernel | None = None,
                                                 tree_shape: tuple[int, int] | None = None,
                                                 lengths_from: LengthSources | None = None):
        """Plan a graph of ``bs`` requests in ``mode`` over views of the capture buffers; returns its metadata.

        ``kernel``: the absorbed kernel to record (one of :meth:`graph_kernels`); None chooses one for
        ``bs`` at ``max_context``. Capture once per kernel to let each replay pick the faster one.
        ``bs`` may also be the graph's static ``ForwardBatch`` (mode, size and draft tokens are read from
        it; how ``graphs.runner.GraphRunner`` calls it). ``tree_shape`` (m, n): a tree step's graph (a static batch
        with a tree gives its shape), replayed only by batches whose tree has that shape. Call OUTSIDE
        ``torch.cuda.graph(...)``: it plans on the host (the kernel choice, the split-KV schedule) and allocates the
        captured FlashMLA schedule. ``lengths_from``: a DECODE or chain TARGET_VERIFY graph that reads its lengths
        and rows from these device tensors (the engine's static inputs, rewritten before each replay:
        ``graphs.capture``), replayed by
        :meth:`init_forward_metadata_replay_device_lengths` (needs :attr:`reads_lengths_on_device`).
        """
        plan = self.graphs.capture(bs, mode, num_draft_tokens=num_draft_tokens, kernel=kernel, tree_shape=tree_shape,
                                   lengths_from=lengths_from)
        self.graph_kernel, self.step_plan = plan.kernel, plan
        return plan.metadata

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_lens of CUDA-graph padding rows: 1 (one key, on the padding page in the builder's tail rows;
        FlashMLA needs >= 1). The padding rows' outputs are discarded."""
        return 1

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, *, bs: int | None = None):
        """Update the captured metadata in place for ``batch`` (live rows; tail reset); returns it.

        ``bs``: the captured batch size to replay (default: the smallest captured one that fits).
        """
        self.step_plan = None  # a failed update leaves no stale plan behind
        plan = self.graphs.replay(batch, bs)
        self.graph_kernel, self.step_plan = plan.kernel, plan
        return plan.metadata

    def init_forward_metadata_replay_device_lengths(self, bs: int, seq_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                                                    req_pool_indices: torch.Tensor, *,
                                                    num_requests: int | None = None,
                                                    mode: ForwardMode = ForwardMode.DECODE,
                                                    num_draft_tokens: int = 1) -> AttentionMetadata:
        """The replay update of the ``mode`` graph of ``bs`` (DECODE, or TARGET_VERIFY of ``num_draft_tokens`` as a
        chain) captured with ``lengths_from``: host checks of ``seq_lens_cpu`` ([bs], padding included, as the
        sources count them) and the kernel's choice among those captured for ``bs`` (from the first
        ``num_requests`` live lengths); nothing is staged, copied or launched when ``seq_lens`` /
        ``req_pool_indices`` are the tensors the graph was captured with (SGLang's runner). Other tensors (a caller
        that rebuilds its batch) have their values copied into those, two device copies. Returns the metadata."""
        self.step_plan = None
        plan = self.graphs.replay_device_lengths(bs, seq_lens_cpu, seq_lens, req_pool_indices, num_requests, mode,
                                                 num_draft_tokens)
        self.graph_kernel, self.step_plan = plan.kernel, plan
        return plan.metadata


def _check_fp8_layer(layer: AttentionLayer, plan: StepPlan) -> None:
    """The layers the FP8 readers (FlashMLA FP8, split-KV, the MHA prefill) cannot serve raise (before anything
    is stored)."""
    if not layer.is_plain:
        raise ValueError(f"layer {layer.layer_id}: an FP8 latent pool is read by FlashMLA FP8, split-KV and the MHA "
                         "prefill only, which have no softcap / sliding window / local attention")
    if plan.num_heads is not None and layer.num_heads != plan.num_heads:
        raise ValueError(f"layer {layer.layer_id} has {layer.num_heads} heads but the FP8 step was planned for "
                         f"num_heads={plan.num_heads} (the decode kernel's schedule depends on it)")
