"""MLABackend: the attention backend a DeepSeek-style model calls — plan once per step, run per layer.

Per step the engine calls ``init_forward_metadata(batch)`` once (or, under CUDA graphs,
``init_forward_metadata_capture_cuda_graph`` at capture and ``init_forward_metadata_replay_cuda_graph``
before each replay); every layer then calls ``forward(q, k, v, layer, batch)``. The step's plan — the
``AttentionMetadata`` from the one ``MetadataBuilder``, the decode kernel (FA3 / FlashMLA), the
FlashMLA tile schedule, the prefill path — is made once and read by every layer.

MLA layer (``LayerKind.MLA``), symbols of :mod:`mla_fa3.absorb`:
    q      [T, H, d_nope + d_rope]   RoPE applied
    k      [T, r + d_rope]           the new tokens' latent rows [c_kv (normed) | k_rope (roped)], v None
           (or k = c_kv [T, r] and v = k_rope [T, d_rope]); stored at ``batch.out_cache_loc`` first
    out    [T, H, d_v]
Dispatch on ``batch.forward_mode``:
    DECODE, DRAFT_DECODE, TARGET_VERIFY  -> absorbed path (``absorb.forward_absorbed``), FA3 or FlashMLA
    EXTEND, MIXED, DRAFT_EXTEND          -> absorbed path, or the MHA prefill of ``chunked_prefix`` when
                                            ``path_choice`` picks it (dispatch point: ``extend_dispatch``)
    IDLE                                 -> an empty [0, H, d_v] output; no kernel, no pool access
MHA / CROSS layers go to ``mha_fallback.forward`` (dispatch point: ``MLABackend._forward_mha``).

CUDA graphs (DECODE, TARGET_VERIFY, DRAFT_DECODE): ``init_cuda_graph_state`` allocates the builder's
capture buffers once; capture returns metadata that views them and records the kernel baked into the
graph; replay rewrites the buffers in place (``MetadataBuilder.replay``) and re-plans the FlashMLA
schedule into the captured schedule tensors (``FlashMLASchedule.copy_``) — outside the graph, never
inside it. ``forward`` then reads that captured metadata, so the replayed kernels see the new step.

Hot path: ``forward`` checks shapes and dtypes only (no tensor value is read, no device->host sync);
host maxima come from the batch's ``*_cpu`` copies inside the builder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_fa3 import absorb, ops
from mla_fa3.absorb import DecodeKernel
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.explain import AttentionPath, PathRecord
from mla_fa3.extend_dispatch import ExtendDispatch, optional_module
from mla_fa3.layer import AttentionLayer, LayerKind
from mla_fa3.metadata import MetadataBuilder

__all__ = ["MLABackend", "DecodeKernel", "PathRecord", "AttentionPath"]  # + MultiStepDraftBackend (lazy)

FLASHMLA_PAGE_SIZE = 64  # FlashMLA's fixed KV block size
_AUTO = "auto"


def _coerce_decode_kernel(value) -> DecodeKernel | str:
    if isinstance(value, DecodeKernel):
        return value
    if isinstance(value, str):
        low = value.lower()
        if low == _AUTO:
            return _AUTO
        for k in DecodeKernel:
            if k.value == low:
                return k
    raise ValueError(f"decode_kernel must be 'auto', 'fa3', 'flashmla' or a DecodeKernel, got {value!r}")


@dataclass
class _GraphEntry:
    """One captured (mode, bs, k): the metadata viewing the capture buffers and the kernel in the graph."""

    metadata: object  # AttentionMetadata whose tensors are views of the builder's capture buffers
    kernel: DecodeKernel  # the absorbed kernel recorded into the graph
    reason: str


class MLABackend:
    """Attention backend over an MLA latent pool (and optionally an MHA pool for MHA / CROSS layers)."""

    def __init__(self, *, req_to_token_pool, kv_pool, page_size: int, device, decode_kernel="fa3",
                 num_heads: int | None = None, prefill_path: str = _AUTO, prefill_workspace_tokens: int = 8192,
                 attention_chunk_size: int | None = None, impl=None, debug_checks: bool = False):
        """
        kv_pool: an ``MLATokenPool``, an ``MHATokenPool``, or a tuple of both (mixed models).
        decode_kernel: 'fa3' (default), 'flashmla' (page 64 only) or 'auto' (``kernel_choice`` per step).
        num_heads: query heads of the MLA layers (per rank); required for 'flashmla' / 'auto' because the
            FlashMLA schedule is planned once per step, before any layer runs.
        prefill_path: 'auto' | 'absorbed' | 'mha' — override of path_choice for extend-like steps;
        prefill_workspace_tokens: prefix tokens decompressed per chunk by the chunked MHA prefill.
        impl: ``ops`` implementation for every kernel call (None = the ops global setting).
        """
        self.device = torch.device(device)
        self.page_size = page_size
        self.mla_pool, self.mha_pool = _split_pools(kv_pool)
        for pool in (self.mla_pool, self.mha_pool):
            if pool is not None and pool.page_size != page_size:
                raise ValueError(f"page_size {page_size} differs from the pool's page_size {pool.page_size}")
        self.decode_kernel = _coerce_decode_kernel(decode_kernel)
        if self.decode_kernel is DecodeKernel.FLASHMLA and page_size != FLASHMLA_PAGE_SIZE:
            raise ValueError(f"decode_kernel=flashmla needs page_size {FLASHMLA_PAGE_SIZE}, got {page_size}")
        if self.decode_kernel is not DecodeKernel.FA3:
            if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
                kernel = getattr(self.decode_kernel, "value", self.decode_kernel)
                raise ValueError(f"num_heads (the MLA layers' query heads) is required with "
                                 f"decode_kernel={kernel}, got {num_heads!r}")
        self.num_heads = num_heads
        self.impl = impl
        slots = [p.num_slots for p in (self.mla_pool, self.mha_pool) if p is not None]
        # the builder range-checks out_cache_loc and page ids against the pool (on the host for CPU
        # tensors; on a GPU only with debug_checks, since reading device values would sync)
        self.builder = MetadataBuilder(req_to_token_pool, page_size, self.device,
                                       attention_chunk_size=attention_chunk_size, debug_checks=debug_checks,
                                       num_slots=min(slots))
        self.extend = ExtendDispatch(prefill_path, prefill_workspace_tokens, page_size, self.builder.req_to_token, impl)
        self.forward_metadata = None  # the current step's AttentionMetadata (eager or captured)
        self._step_kernel = DecodeKernel.FA3  # absorbed kernel of the current step
        self._record: PathRecord | None = None
        # captured graphs: (mode, bs, k, kernel) -> entry; with decode_kernel='auto' on page 64 both
        # kernels are captured per size and each replay picks one from the live lengths (host ints)
        self._graph: dict[tuple[ForwardMode, int, int, DecodeKernel], _GraphEntry] = {}
        self.graph_kernel: DecodeKernel | None = None  # kernel of the graph the last replay update chose

    # ------------------------------------------------------------------------------ per step
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the step once: metadata (every mode), decode kernel + FlashMLA schedule, prefill path."""
        md = self.builder.build(batch)
        mode = batch.forward_mode
        if mode.is_idle():
            self._step_kernel = DecodeKernel.FA3
            self._record = PathRecord(mode.name, AttentionPath.IDLE, None, "empty batch: nothing to compute")
        elif mode.is_extend_like():
            self._step_kernel = DecodeKernel.FA3
            self._record = self.extend.plan_step(batch, md)
        else:
            sq = batch.num_draft_tokens if mode.is_target_verify() else 1
            kernel, reason = self._choose_decode_kernel(batch.batch_size, md.max_seqlen_k,
                                                        _mean_seqlen(batch))
            if kernel is DecodeKernel.FLASHMLA:
                md.flashmla_schedule = self._plan_flashmla(md, sq)
            self._step_kernel = kernel
            self._record = PathRecord(mode.name, AttentionPath.ABSORBED, kernel.value, reason)
        self.forward_metadata = md

    def _choose_decode_kernel(self, batch_size: int, max_seqlen_k: int,
                              mean_seqlen_k: float | None = None) -> tuple[DecodeKernel, str]:
        """The absorbed kernel of a decode-like / verify step (host numbers only; mean None = unknown)."""
        if self.decode_kernel is not _AUTO:
            return self.decode_kernel, f"decode_kernel={self.decode_kernel.value} (backend setting)"
        if self.page_size != FLASHMLA_PAGE_SIZE:
            return DecodeKernel.FA3, f"auto: page_size {self.page_size} != {FLASHMLA_PAGE_SIZE} -> FA3"
        kc = optional_module("kernel_choice")
        if kc is None:
            return DecodeKernel.FA3, "auto: mla_fa3.kernel_choice unavailable -> FA3"
        args = (self.num_heads, max(batch_size, 1), max(max_seqlen_k, 1), self.page_size)
        choice = kc.explain_decode_kernel(*args, mean_seqlen_k=mean_seqlen_k)
        return choice.kernel, f"auto: {choice.reason}"

    def graph_kernels(self) -> tuple[DecodeKernel, ...]:
        """Kernels worth capturing a graph for, per batch size: both FA3 and FlashMLA when the choice is
        automatic on page 64 (the winner depends on the live lengths' skew), else the one kernel."""
        if self.decode_kernel is not _AUTO:
            return (self.decode_kernel,)
        if self.page_size != FLASHMLA_PAGE_SIZE or optional_module("kernel_choice") is None:
            return (DecodeKernel.FA3,)
        return (DecodeKernel.FA3, DecodeKernel.FLASHMLA)

    def _plan_flashmla(self, md, sq: int):
        return ops.get_mla_decode_metadata(md.cache_seqlens, self.num_heads * sq, impl=self.impl)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayer,
                batch: ForwardBatch, *, save_kv_cache: bool = True) -> torch.Tensor:
        """One layer of the step planned by the last init_forward_metadata / replay. Returns [T, H, d_v]."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        if batch.forward_mode.is_extend_like():
            return self.forward_extend(q, k, v, layer, batch, save_kv_cache=save_kv_cache)
        return self.forward_decode(q, k, v, layer, batch, save_kv_cache=save_kv_cache)

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, *,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """EXTEND / MIXED / DRAFT_EXTEND (IDLE too): absorbed, or the MHA prefill chosen for the step.

        The path choice is the MHA-prefill dispatch point in ``extend_dispatch.ExtendDispatch``.
        """
        md = self._step_metadata(q, layer, batch)
        if md is None or layer.kind is not LayerKind.MLA:
            return self._not_mla(q, k, v, layer, batch, md, save_kv_cache)
        self._store_latent(q, k, v, layer, batch, save_kv_cache)
        latent_new = k if (save_kv_cache and k is not None and v is None) else None
        return self._finish(self.extend.forward(q, latent_new, layer, md, self.mla_pool.paged(layer.layer_id)))

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, *,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """DECODE / DRAFT_DECODE / TARGET_VERIFY (IDLE too): the absorbed path, FA3 or FlashMLA."""
        md = self._step_metadata(q, layer, batch)
        if md is None or layer.kind is not LayerKind.MLA:
            return self._not_mla(q, k, v, layer, batch, md, save_kv_cache)
        self._store_latent(q, k, v, layer, batch, save_kv_cache)
        kernel = self._layer_kernel(layer)
        out = absorb.forward_absorbed(q, layer, md, self.mla_pool.paged(layer.layer_id), kernel=kernel,
                                      impl=self.impl, validate=False)
        return self._finish(out)

    def _not_mla(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, md, save_kv_cache: bool):
        """IDLE (md None): an empty output. Otherwise an MHA / CROSS layer."""
        if md is None:
            return _empty_output(q, layer)
        return self._forward_mha(q, k, v, layer, batch, md, save_kv_cache)

    def _forward_mha(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, md, save_kv_cache: bool):
        """===== DISPATCH POINT (LayerKind.MHA / CROSS): mla_fa3.mha_fallback.forward. ====="""
        if self.mha_pool is None:
            raise ValueError(f"kv_pool has no MHATokenPool for layer {layer.layer_id} (LayerKind.{layer.kind.name})")
        fallback = optional_module("mha_fallback")
        if fallback is None:
            raise NotImplementedError(f"layer {layer.layer_id} is LayerKind.{layer.kind.name}: it needs "
                                      "mla_fa3.mha_fallback, which is not installed")
        out = fallback.forward(q, k, v, layer, batch, md, self.mha_pool, save_kv_cache=save_kv_cache,
                               impl=self.impl)
        if self._record is not None:
            self._record.other_paths.add(AttentionPath.MHA_FALLBACK)
        return self._finish(out)

    # ------------------------------------------------------------------------------ helpers
    def _step_metadata(self, q, layer: AttentionLayer, batch: ForwardBatch):
        """The planned metadata for ``batch`` (None for IDLE), after checks that read no tensor value."""
        if not isinstance(layer, AttentionLayer):
            raise TypeError(f"layer must be an AttentionLayer, got {type(layer).__name__}")
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if batch.forward_mode.is_idle():
            return None
        md = self.forward_metadata
        if md is None:
            raise ValueError("batch: init_forward_metadata (or a CUDA-graph replay) must run before forward")
        if md.mode is not batch.forward_mode:
            raise ValueError(f"batch is {batch.forward_mode.name} but the planned step is {md.mode.name}: "
                             "call init_forward_metadata for this batch first")
        if q.dim() < 1 or q.shape[0] != batch.num_tokens:
            raise ValueError(f"q must have batch.num_tokens = {batch.num_tokens} rows, got shape {tuple(q.shape)}")
        return md

    def _store_latent(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool) -> None:
        """Check an MLA layer call (shapes/dtypes, no sync), then write the new latent rows."""
        self._check_mla_step(q, k, v, layer, save_kv_cache)
        if save_kv_cache and k is not None:
            self._save_latent(layer, batch, k, v)

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
        """Store the new tokens' latent rows at batch.out_cache_loc (whole rows when k is the latent)."""
        if v is None:
            set_latent = getattr(self.mla_pool, "set_latent", None)
            if set_latent is not None:  # one row write instead of two column-sliced ones
                set_latent(layer.layer_id, batch.out_cache_loc, k)
            else:
                r = layer.mla.kv_lora_rank
                self.mla_pool.set_kv(layer.layer_id, batch.out_cache_loc, k[:, :r], k[:, r:])
        else:
            self.mla_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)

    def _layer_kernel(self, layer: AttentionLayer) -> DecodeKernel:
        """The step's kernel, unless this layer needs what FlashMLA lacks (then FA3, noted in explain)."""
        if self._step_kernel is not DecodeKernel.FLASHMLA:
            return DecodeKernel.FA3
        if layer.logit_cap > 0 or layer.sliding_window >= 0 or layer.use_local_attention \
                or layer.num_heads != self.num_heads:
            if self._record is not None and "FA3 for" not in self._record.reason:
                self._record.reason += f"; FA3 for layer {layer.layer_id} (softcap/window/local/heads not FlashMLA's)"
            return DecodeKernel.FA3
        return DecodeKernel.FLASHMLA

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if self._record is not None:
            last = ops.last_impl()
            self._record.impl = last.value if last is not None else None
        return out

    def explain(self) -> PathRecord | None:
        """What the last planned step runs (mode, path, kernel, reason, impl), or None before any step."""
        return self._record

    # ------------------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_context: int, *, max_num_draft_tokens: int = 1,
                              with_encoder: bool = False) -> None:
        """Allocate the capture buffers once (through the builder); call before any capture."""
        self.builder.init_capture_buffers(max_bs, max_context, max_num_draft_tokens=max_num_draft_tokens,
                                          with_encoder=with_encoder, pad_seqlen=self.get_cuda_graph_seq_len_fill_value())
        self._graph.clear()

    def init_forward_metadata_capture_cuda_graph(self, bs, mode: ForwardMode | None = None, *,
                                                 num_draft_tokens: int = 1, kernel: DecodeKernel | None = None):
        """Metadata for capturing a graph of ``bs`` requests in ``mode`` (views of the capture buffers).

        ``kernel``: the absorbed kernel to record (one of :meth:`graph_kernels`); None chooses one for
        ``bs`` at ``max_context``. Capture once per kernel to let each replay pick the faster one.

        ``bs`` may also be the graph's static ``ForwardBatch`` (mode, size and draft tokens are read from
        it; how ``graph_runner.GraphRunner`` calls it). Call OUTSIDE ``torch.cuda.graph(...)``: it may
        plan a FlashMLA schedule, which is not graph-legal. Returns the captured metadata (also the
        backend's current step).
        """
        if isinstance(bs, ForwardBatch):
            batch = bs
            bs, mode, num_draft_tokens = batch.batch_size, batch.forward_mode, max(batch.num_draft_tokens, 1)
        if not isinstance(mode, ForwardMode) or not mode.is_graph_capturable():
            raise ValueError(f"mode must be DECODE, TARGET_VERIFY or DRAFT_DECODE for a CUDA graph, got {mode!r}")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"bs must be an int >= 1, got {bs!r}")
        if kernel is not None and kernel not in self.graph_kernels():
            raise ValueError(f"kernel {kernel} is not one of this backend's graph kernels {self.graph_kernels()}")
        k = num_draft_tokens if mode.is_target_verify() else 1
        md = self.builder.capture(bs, mode, num_draft_tokens=k)
        if kernel is None:
            kernel, reason = self._choose_decode_kernel(bs, md.max_seqlen_k)
        else:
            reason = f"{kernel.value} graph"
        if kernel is DecodeKernel.FLASHMLA:
            md.flashmla_schedule = self._plan_flashmla(md, k)
        self._graph[(mode, bs, k, kernel)] = _GraphEntry(md, kernel, reason)
        self.graph_kernel = kernel
        self._activate(mode, md, kernel, f"{reason} (captured for bs {bs})")
        return md

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_lens of CUDA-graph padding rows: 1 (one key, on the padding page in the builder's tail rows;
        FlashMLA needs >= 1). The padding rows' outputs are discarded."""
        return 1

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, *, bs: int | None = None):
        """Update the captured metadata in place for ``batch`` (live rows; tail reset); returns it.

        ``bs``: the captured batch size to replay (default: the smallest captured one that fits).
        """
        mode = batch.forward_mode
        k = batch.num_draft_tokens if mode.is_target_verify() else 1
        sizes = sorted({b for (m, b, kk, _) in self._graph if m is mode and kk == k})
        if bs is None:
            fitting = [b for b in sizes if b >= batch.batch_size]
            if not fitting:
                raise ValueError(f"batch of {batch.batch_size} requests ({mode.name}, k={k}) fits no captured "
                                 f"batch size {sizes}")
            bs = fitting[0]
        kernels = [kk for kk in DecodeKernel if (mode, bs, k, kk) in self._graph]
        if not kernels:
            raise ValueError(f"bs {bs} was not captured for {mode.name} (k={k}); captured: {sizes}")
        kernel, why = kernels[0], None
        if len(kernels) > 1:  # choose from the live lengths (CPU copies: no sync)
            kernel, why = self._choose_decode_kernel(batch.batch_size, int(batch.seq_lens_cpu.max()),
                                                     _mean_seqlen(batch))
        entry = self._graph[(mode, bs, k, kernel)]
        self.builder.replay(batch, entry.metadata)
        if entry.kernel is DecodeKernel.FLASHMLA:
            entry.metadata.flashmla_schedule.copy_(self._plan_flashmla(entry.metadata, k))
        self.graph_kernel = entry.kernel
        self._activate(mode, entry.metadata, entry.kernel, f"{why or entry.reason} (replay of bs {bs})")
        return entry.metadata

    def _activate(self, mode: ForwardMode, md, kernel: DecodeKernel, reason: str) -> None:
        self.forward_metadata = md
        self._step_kernel = kernel
        self._record = PathRecord(mode.name, AttentionPath.ABSORBED, kernel.value, reason, graph=True)


def _mean_seqlen(batch: ForwardBatch) -> float | None:
    """Mean KV length of the live requests, from the batch's CPU copy (None for an empty batch)."""
    lens = batch.seq_lens_cpu
    return float(lens.float().mean()) if lens is not None and lens.numel() else None


def _empty_output(q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """IDLE: [0, H, d_v] in q's dtype/device; touches no kernel and no pool."""
    return torch.empty(0, layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)


def _split_pools(kv_pool):
    """(mla_pool, mha_pool) from one pool or a tuple/list of them (recognized by their views)."""
    pools = list(kv_pool) if isinstance(kv_pool, (tuple, list)) else [kv_pool]
    mla = [p for p in pools if hasattr(p, "c_kv_paged")]
    mha = [p for p in pools if hasattr(p, "k_paged")]
    if len(mla) + len(mha) != len(pools) or len(mla) > 1 or len(mha) > 1 or not pools:
        raise TypeError("kv_pool must be an MLATokenPool, an MHATokenPool, or a tuple of one of each, got "
                        f"{[type(p).__name__ for p in pools]}")
    return (mla[0] if mla else None), (mha[0] if mha else None)


def __getattr__(name: str):
    """``MultiStepDraftBackend`` lives in ``draft_backend`` (which imports this module); re-exported lazily."""
    if name == "MultiStepDraftBackend":
        from mla_fa3.draft_backend import MultiStepDraftBackend

        return MultiStepDraftBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
