"""``SGLangMLABackend``: mla_fa3 as an SGLang attention backend, over SGLang's own pools (SGLang 0.5.17).

SGLang's DeepSeek model absorbs W_UK and applies W_UV itself; what it asks of an MLA backend is the attention core
in one of two forms, chosen per step by the model (``plugin.handle_attention``):

    absorbed (decode, verify, short extends)  attn_mqa(q_lat [T, H·r], c_kv [T, 1, r], c_kv, fb,
                                                        q_rope=[T, H, d_rope], k_rope=[T, 1, d_rope])
        store [c_kv | k_rope] at fb.out_cache_loc        (our store into SGLang's buffer; FP8: e4m3, scale 1)
        o_lat = absorb.attend_latent(q_lat, q_rope, ...)  (FA3 / FlashMLA / split-KV: the plan's kernel; a draft
                                                          tree: absorb_tree.attend_latent_tree, prefix + tree part)
        -> o_lat [T, H·r]                                 (the model multiplies by W_UV)
    MHA (prefill; the model decompresses K/V and runs the chunked-prefix loop, merging by LSE itself)
        attn_mha(q [T, H, d_nope + d_rope], k [L, H, ..], v [L, H, d_v], fb)
        -> ops.flash_attn_varlen_func: the new tokens causally (or, one-shot, over prefix + new), or
           one prefix chunk non-causally -> o [T, H, d_v] (and lse [T, H], natural log, if fb.mha_return_lse)

The step is planned once, before the first layer: ``init_forward_metadata`` converts SGLang's batch
(``convert.to_mla_batch``) and runs our backend's planner over a ``MetadataBuilder`` that reads SGLang's
``req_to_token`` and an ``MLATokenPool`` that views SGLang's per-layer ``kv_buffer`` (no second pool, no copy).
CUDA graphs follow SGLang's protocol: ``init_cuda_graph_state`` allocates our capture buffers once,
``init_forward_metadata_out_graph(fb, in_capture=True)`` plans the graph of ``fb.batch_size`` requests and
``init_forward_metadata_out_graph(fb)`` before each replay rewrites them in place (host work and copies only; the
page table and the kernel's schedule are re-planned on the device from the live lengths). A DECODE graph, and a
TARGET_VERIFY graph of a chain (EAGLE topk 1), reads its lengths and request rows on the device from SGLang's own
static ``seq_lens`` / ``req_pool_indices`` (the runner rewrites them before each replay; the verify graph adds the k
draft tokens itself; ``graphs.capture.LengthSources``), so its replay update is host checks of ``seq_lens_cpu``
alone: no ForwardBatch conversion, no copy, no launch.

FP8 KV (``--kv-cache-dtype fp8_e4m3``): SGLang's pool stores e4m3 codes as uint8 with scale 1 (its writer ignores
``k_scale``), so the adapter reads it with descale 1 on FlashMLA FP8 or split-KV, in place; prefill takes the MHA
path (the model dequantizes prefix chunks). The pool is never dequantized whole.
"""

from __future__ import annotations

import os

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.verify_mask import VerifyMask
from sglang.srt.speculative.eagle_utils import TreeMaskMode

from mla_fa3 import absorb, absorb_tree, ops
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.graphs.capture import LengthSources
from mla_fa3.integrations.sglang.convert import UnsupportedStepError, host_int32, num_draft_tokens_of, to_mla_batch
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.ops.fp8 import FP8_DTYPE
from mla_fa3.policy.paths import AttentionPath
from mla_fa3.tree import MAX_TREE_TOKENS

__all__ = ["SGLangMLABackend", "DECODE_KERNEL_ENV", "GRAPH_LENGTHS_ENV"]

DECODE_KERNEL_ENV = "MLA_FA3_DECODE_KERNEL"  # 'auto' (default) | 'fa3' | 'flashmla' | 'splitkv'
# 'device' (default): a DECODE graph reads its lengths from SGLang's static buffers; 'host': every replay stages them
GRAPH_LENGTHS_ENV = "MLA_FA3_GRAPH_LENGTHS"


class SGLangMLABackend(AttentionBackend):
    """SGLang ``AttentionBackend`` running mla_fa3's planner, kernel choice and ops (see the module docstring)."""

    needs_cpu_seq_lens = True  # every step is planned from host lengths

    def __init__(self, model_runner):
        _refuse_unsupported(model_runner)
        pool = model_runner.token_to_kv_pool
        # what SGLang reads off the active backend (model_executor/forward_context.py and the DeepSeek model)
        self.token_to_kv_pool, self.req_to_token_pool = pool, model_runner.req_to_token_pool
        self.device = torch.device(model_runner.device)
        self.page_size = int(model_runner.page_size)
        self.kv_lora_rank, self.qk_rope_head_dim = int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)
        self.start_layer = int(getattr(pool, "start_layer", 0) or 0)
        self.kv_fp8 = pool.dtype == FP8_DTYPE
        server_args = model_runner.server_args
        self.num_draft_tokens = int(getattr(server_args, "speculative_num_draft_tokens", 0) or 0)
        self.topk = int(getattr(server_args, "speculative_eagle_topk", 0) or 0)
        cfg = model_runner.model_config
        self.num_heads = int(cfg.get_num_attention_heads(_attn_tp_size(model_runner)))
        self.mla_pool = _view_pool(pool, self.page_size, model_runner.dtype, self.device)
        req_to_token = model_runner.req_to_token_pool.req_to_token
        # the absorbed problem is MLA with identity up-projections (d_nope = d_v = r: q_lat and o_lat live in the
        # latent space); the model decides MHA or absorbed per step, so a floating pool plans every extend absorbed
        # (an FP8 pool's extend steps build metadata only: they run MHA)
        self.latent_dims = MLADims(self.kv_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.kv_lora_rank)
        self.backend = MLABackend(req_to_token_pool=req_to_token, kv_pool=self.mla_pool, page_size=self.page_size,
                                  device=self.device, decode_kernel=_decode_kernel_setting(self.kv_fp8),
                                  num_heads=self.num_heads, mla_dims=self.latent_dims,
                                  prefill_path="auto" if self.kv_fp8 else "absorbed")
        self.max_context = int(req_to_token.shape[1])
        # EAGLE with topk > 1 writes each verify step's draft trees here, k x k per request (QLEN_ONLY: no prefix
        # columns; SGLang's build_eagle_verify_input takes the target backend's verify_mask), read by convert.verify_tree
        self._verify_mask = None
        if self.topk > 1 and self.num_draft_tokens:
            rows, k = int(req_to_token.shape[0]), self.num_draft_tokens
            self._verify_mask = VerifyMask(buffer=torch.ones(rows * k * k, dtype=torch.bool, device=self.device),
                                           mode=TreeMaskMode.QLEN_ONLY, max_bs=rows, is_read=True)
        self._layers: dict[int, AttentionLayer] = {}
        # (SGLang's mode name, bs) -> the converted capture batch of a graph reading its lengths on the device
        self._device_lengths: dict[tuple[str, int], ForwardBatch] = {}
        self.graph_lengths = _graph_lengths_setting()
        self._step: tuple[ForwardBatch, AttentionMetadata | None] | None = None  # (our batch, its metadata)

    # ------------------------------------------------------------------------------ per step
    def init_forward_metadata(self, forward_batch) -> None:
        """Plan an eager step: our batch, metadata, path, kernel and schedule (host work; no sync)."""
        self._step = None
        batch = self._convert(forward_batch)
        if self.kv_fp8 and batch.forward_mode is ForwardMode.DRAFT_EXTEND:
            raise UnsupportedStepError("a DRAFT_EXTEND_V2 batch of unequal windows over the FP8 latent cache: no "
                                       "absorbed kernel of mla_fa3 reads e4m3 with unequal query lengths (SGLang's "
                                       "fixed window, one width per batch, is served)")
        if self.kv_fp8 and batch.forward_mode.is_extend_like():
            # an FP8 prefill runs the MHA path (plugin.handle_attention): its varlen calls need the metadata only
            self.backend.step_plan = None
            md = self.backend.builder.build(batch)
        else:
            self.backend.init_forward_metadata(batch)
            md = self.backend.step_plan.metadata
        self._step = (batch, md)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Our capture buffers, once, for up to ``max_bs`` requests at the pool's whole context. With device
        metadata: the page table and the kernel's schedule are derived inside the graph
        (:meth:`init_forward_metadata_in_graph`), so a replay's host update is one host->device copy and checks."""
        self.backend.init_cuda_graph_state(max_bs, self.max_context,
                                           max_num_draft_tokens=max(self.num_draft_tokens, 1), device_metadata=True)
        self._device_lengths.clear()

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """The graph-recordable half of a captured step (SGLang runs it inside ``graph.capture()``; each replay
        re-runs it): the page table from ``req_to_token`` and the FlashMLA / split-KV / FA3 schedule from the live
        lengths, fixed shapes, no host value read (``MLABackend.graph_prologue``). A no-op for eager steps."""
        plan = self.backend.step_plan
        if plan is not None and plan.graph_bs is not None and self.backend.device_metadata:
            self.backend.graph_prologue()  # every call: inside a capture it must be recorded, even after a warm-up

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Capture: plan the graph of ``forward_batch.batch_size`` requests over the capture buffers. Replay (and
        only replay reaches here otherwise: eager steps call :meth:`init_forward_metadata`): rewrite them for the
        live, padded batch and re-plan the kernel's schedule from its lengths."""
        self._step = None
        if not in_capture and self._replay_device_lengths(forward_batch):
            return
        batch = self._convert(forward_batch)
        mode = batch.forward_mode
        if mode.is_idle():  # a data-parallel rank with nothing this step: no kernel reads the metadata
            self.backend.init_forward_metadata(batch)
            self._step = (batch, None)
            return
        if not mode.is_graph_capturable():
            raise UnsupportedStepError(f"CUDA graphs of {mode.name} steps are not served by mla_fa3 (DECODE, "
                                       "TARGET_VERIFY and DRAFT_EXTEND_V2's fixed window are); disable prefill CUDA "
                                       "graphs")
        if in_capture:
            bs = batch.batch_size
            extra = self._lengths_extra(forward_batch)
            sources = None
            if extra is not None and self.graph_lengths == "device" and self.backend.reads_lengths_on_device:
                sources = LengthSources(forward_batch.seq_lens[:bs], forward_batch.req_pool_indices[:bs], extra)
            md = self.backend.init_forward_metadata_capture_cuda_graph(
                bs, mode, num_draft_tokens=max(batch.num_draft_tokens, 1),
                tree_shape=None if batch.tree is None else batch.tree.shape, lengths_from=sources)
            key = (forward_batch.forward_mode.name, bs)  # this size's graph of this mode, captured again
            self._device_lengths.pop(key, None)
            if sources is not None:
                self._device_lengths[key] = batch
        else:
            md = self.backend.init_forward_metadata_replay_cuda_graph(batch, bs=batch.batch_size)
        self._step = (batch, md)

    def _lengths_extra(self, fb) -> int | None:
        """What a graph of ``fb``'s kind adds to SGLang's ``seq_lens`` when it reads them on the device: 0 for a target
        DECODE, k for a chain TARGET_VERIFY (SGLang's verify lengths exclude the k draft tokens); None for the
        graphs that stage their lengths at every replay (trees, the draft model's steps)."""
        name = getattr(fb.forward_mode, "name", None)
        spec = getattr(fb, "spec_info", None)
        if name == "DECODE":
            return 0 if spec is None else None
        if name == "TARGET_VERIFY" and int(getattr(spec, "topk", 1) or 1) <= 1:
            return num_draft_tokens_of(fb, self.num_draft_tokens)
        return None

    def _replay_device_lengths(self, fb) -> bool:
        """The replay update of a graph that reads its lengths on the device (captured so): host checks of
        ``seq_lens_cpu`` and the kernel's choice; False (nothing done) for every other replay."""
        bs = int(fb.batch_size)
        captured = self._device_lengths.get((getattr(fb.forward_mode, "name", None), bs))
        if captured is None:
            return False
        extra = self._lengths_extra(fb)
        k = max(captured.num_draft_tokens, 1)
        if extra is None or (captured.forward_mode is ForwardMode.TARGET_VERIFY and extra != k):
            return False  # not the captured kind: the staged replay names what does not fit
        seq_cpu = fb.seq_lens_cpu
        if not isinstance(seq_cpu, torch.Tensor) or seq_cpu.device.type != "cpu":
            seq_cpu = host_int32(seq_cpu, "seq_lens_cpu", bs)  # a list, or None / a device tensor: a named error
        padding = int(getattr(fb, "num_padding", 0) or 0)
        md = self.backend.init_forward_metadata_replay_device_lengths(
            bs, seq_cpu[:bs], fb.seq_lens[:bs], fb.req_pool_indices[:bs], num_requests=bs - padding,
            mode=captured.forward_mode, num_draft_tokens=k)
        self._step = (captured, md)
        return True

    def _convert(self, forward_batch) -> ForwardBatch:
        return to_mla_batch(forward_batch, device=self.device, num_draft_tokens=self.num_draft_tokens,
                            verify_mask=None if self._verify_mask is None else self._verify_mask.buffer)

    @property
    def verify_mask(self) -> VerifyMask | None:
        """Where SGLang's EAGLE (topk > 1) writes each verify step's draft trees: QLEN_ONLY, k x k per request."""
        return self._verify_mask

    @property
    def forward_metadata(self) -> AttentionMetadata | None:
        """The current step's metadata (our ``AttentionMetadata``), None before a step."""
        return None if self._step is None else self._step[1]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.backend.get_cuda_graph_seq_len_fill_value()

    def explain(self):
        """What the last planned step runs and why (:class:`mla_fa3.plan.PathRecord`), or None."""
        return self.backend.explain()

    # ------------------------------------------------------------------------------ per layer
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, q_rope=None, k_rope=None,
                       **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, q_rope=None, k_rope=None,
                       **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs)

    def _forward(self, q, k, v, layer, fb, save_kv_cache, q_rope, k_rope, extra):
        unknown = sorted(n for n, val in extra.items() if val is not None)
        if unknown:
            raise UnsupportedStepError(f"mla_fa3 does not take {unknown} (sinks, descales, score_mod, sparse indices "
                                       "...): this model needs another SGLang backend")
        if self._step is None:
            raise ValueError("forward_batch: init_forward_metadata (or a CUDA-graph update) must run before forward")
        batch, md = self._step
        H = int(layer.tp_q_head_num)
        if batch.forward_mode.is_idle():
            return q.new_empty(0, H * int(layer.v_head_dim))
        if _is_mha_call(fb):
            return self._forward_mha(q, k, v, layer, fb, md, save_kv_cache)
        return self._forward_absorbed(q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope)

    def _forward_absorbed(self, q, k, layer, fb, batch: ForwardBatch, save_kv_cache, q_rope, k_rope):
        """The absorbed core: store the new latent rows, then o_lat = softmax(q_lat·c_kv + q_rope·k_rope) · c_kv."""
        r, dr, H = self.kv_lora_rank, self.qk_rope_head_dim, int(layer.tp_q_head_num)
        T = batch.num_tokens
        if int(layer.v_head_dim) != r or int(layer.qk_head_dim) != r + dr:
            raise ValueError(f"layer {layer.layer_id}: the absorbed call needs head_dim {r + dr} and v_head_dim {r} "
                             f"(the latent pool's), got {layer.qk_head_dim} and {layer.v_head_dim}")
        if q_rope is None:  # one [T, H·(r + d_rope)] query: the two parts are views
            q3 = q.reshape(T, H, r + dr)
            q_lat, q_rope = q3[..., :r], q3[..., r:]
        else:
            q_lat, q_rope = q.reshape(T, H, r), q_rope.reshape(T, H, dr)
        lid = self._pool_layer(layer)
        stored = save_kv_cache and k is not None
        if stored:
            loc = fb.out_cache_loc  # SGLang's own tensor: under CUDA graphs, the static buffer each replay rewrites
            if k_rope is None:
                self.mla_pool.set_latent(lid, loc, k.reshape(T, r + dr))
            else:
                self.mla_pool.set_kv(lid, loc, k.reshape(T, r), k_rope.reshape(T, dr))
        plan = self.backend.step_plan
        if plan is None:  # an FP8 extend step: no absorbed kernel reads e4m3 with unequal query lengths
            raise UnsupportedStepError("an absorbed extend over the FP8 latent cache: mla_fa3 routes FP8 prefill to "
                                       "the MHA path (plugin.handle_attention); this call bypassed it")
        if plan.prologue_pending:  # its page table / schedule would be stale: refuse, loudly
            raise RuntimeError("a CUDA-graph step's page table and schedule are derived in "
                               "init_forward_metadata_in_graph: run it (inside the graph, or after a replay update "
                               "when running the layers eagerly) before the layers")
        ours = self._layer(layer, lid)
        path, kernel = plan.route(ours)
        if path is not AttentionPath.ABSORBED:
            raise RuntimeError(f"the step was planned for {path.name}, not the absorbed path")
        pool, scale = self.mla_pool.paged(lid), self.mla_pool.layer_scale(lid)
        schedule = plan.schedule_for(ours, kernel)
        if plan.metadata.tree is None:  # no launch between the store and the kernel: its prologue may overlap the store
            o_lat = absorb.attend_latent(q_lat, q_rope, ours, plan.metadata, pool, kernel=kernel, schedule=schedule,
                                         kv_scale=scale, follows_store=stored)
        else:
            o_lat = absorb_tree.attend_latent_tree(q_lat, q_rope, ours, plan.metadata, pool, kernel=kernel,
                                                   schedule=schedule, kv_scale=scale)
        return o_lat.reshape(T, H * r)

    def _forward_mha(self, q, k, v, layer, fb, md: AttentionMetadata, save_kv_cache):
        """One MHA call of the model's prefill: new tokens causally (bottom-right), or one prefix chunk."""
        if save_kv_cache and k is not None:
            raise ValueError("save_kv_cache must be False on the MHA path: the model stores the latent itself "
                             "(the pool holds [c_kv | k_rope] rows, not decompressed K/V)")
        H, d, dv = int(layer.tp_q_head_num), int(layer.qk_head_dim), int(layer.v_head_dim)
        q, k, v = q.reshape(-1, H, d), k.reshape(-1, H, d), v.reshape(-1, H, dv)
        if fb.attn_attend_prefix_cache:
            i = fb.prefix_chunk_idx
            cu_k, max_k, causal = fb.prefix_chunk_cu_seq_lens[i], int(fb.prefix_chunk_max_seq_lens[i]), False
        elif getattr(fb, "mha_one_shot", False):
            cu_k, max_k, causal = md.cu_seqlens_k, md.max_seqlen_k, True
        else:
            cu_k, max_k, causal = md.cu_seqlens_q, md.max_seqlen_q, True
        out, lse = ops.flash_attn_varlen_func(q, k.to(q.dtype), v.to(q.dtype), cu_seqlens_q=md.cu_seqlens_q,
                                              cu_seqlens_k=cu_k.to(torch.int32), max_seqlen_q=md.max_seqlen_q,
                                              max_seqlen_k=max_k, softmax_scale=float(layer.scaling),
                                              causal=causal, return_lse=True)
        return (out, lse) if fb.mha_return_lse else out

    # ------------------------------------------------------------------------------ layers
    def _pool_layer(self, layer) -> int:
        lid = int(layer.layer_id) - self.start_layer
        if not 0 <= lid < self.mla_pool.num_layers:
            raise ValueError(f"layer.layer_id {layer.layer_id} is outside this rank's pool layers "
                             f"[{self.start_layer}, {self.start_layer + self.mla_pool.num_layers})")
        return lid

    def _layer(self, layer, lid: int) -> AttentionLayer:
        """Our description of SGLang's absorbed ``RadixAttention``: MLA with identity up-projections (q_lat and
        o_lat live in the latent space: d_nope = d_v = r), built once per layer."""
        ours = self._layers.get(lid)
        if ours is None:
            ours = AttentionLayer.mla_layer(lid, int(layer.tp_q_head_num), self.latent_dims,
                                            float(layer.scaling), logit_cap=float(layer.logit_cap or 0.0),
                                            sliding_window=_window(layer))
            self._layers[lid] = ours
        return ours


def _is_mha_call(fb) -> bool:
    """The model's MHA prefill marks its calls by setting ``attn_attend_prefix_cache`` (SGLang's fa3 test too)."""
    return getattr(fb, "attn_attend_prefix_cache", None) is not None and \
        not fb.forward_mode.is_target_verify() and not fb.forward_mode.is_draft_extend_v2()


def _window(layer) -> int:
    w = getattr(layer, "sliding_window_size", -1)
    return -1 if w is None or w < 0 else int(w)


def _attn_tp_size(model_runner) -> int:
    """Heads are split over the attention tensor-parallel ranks: each rank sees H / tp and the whole latent cache."""
    for name in ("attn_tp_size", "tp_size"):
        size = getattr(model_runner, name, None)
        if size:
            return int(size)
    return 1


def _decode_kernel_setting(kv_fp8: bool) -> str | None:
    """``MLA_FA3_DECODE_KERNEL`` or the default: 'auto' (the measured choice per step; FP8: its own 'auto')."""
    value = os.environ.get(DECODE_KERNEL_ENV, "auto").strip().lower()
    if value not in ("auto", "fa3", "flashmla", "splitkv"):
        raise ValueError(f"{DECODE_KERNEL_ENV} must be auto, fa3, flashmla or splitkv, got {value!r}")
    if kv_fp8 and value == "fa3":
        raise ValueError(f"{DECODE_KERNEL_ENV}=fa3 cannot read the FP8 latent cache (FA3 refuses an e4m3 latent): "
                         "use auto, flashmla or splitkv")
    return None if kv_fp8 and value == "auto" else value


def _graph_lengths_setting() -> str:
    """``MLA_FA3_GRAPH_LENGTHS``: 'device' (default: SGLang's DECODE graphs read their lengths from SGLang's static
    buffers, the replay update is host checks alone) or 'host' (every replay stages them: one copy and the batch's
    conversion, for a runner that does not rewrite its buffers in place)."""
    value = os.environ.get(GRAPH_LENGTHS_ENV, "device").strip().lower()
    if value not in ("device", "host"):
        raise ValueError(f"{GRAPH_LENGTHS_ENV} must be device or host, got {value!r}")
    return value


def _view_pool(pool, page_size: int, dtype: torch.dtype, device: torch.device) -> MLATokenPool:
    """An ``MLATokenPool`` over SGLang's ``MLATokenToKVPool.kv_buffer`` (one [size + page, 1, r + d_rope] buffer per
    layer; slot 0 is SGLang's padding slot as it is ours): views, no copy. An FP8 pool's uint8 bytes are viewed as
    e4m3 with scale 1, as SGLang's writer stores them."""
    fp8 = pool.dtype == FP8_DTYPE
    buffers = []
    for b in pool.kv_buffer:
        rows = b.view(b.shape[0], -1)
        buffers.append(rows.view(FP8_DTYPE) if fp8 else rows)
    slots = buffers[0].shape[0]
    if slots % page_size:
        raise ValueError(f"token_to_kv_pool has {slots} slots per layer, not a multiple of page_size {page_size}")
    return MLATokenPool(len(buffers), slots // page_size, page_size, int(pool.kv_lora_rank),
                        int(pool.qk_rope_head_dim), dtype, device, kv_dtype=FP8_DTYPE if fp8 else None,
                        kv_buffers=buffers)


def _refuse_unsupported(model_runner) -> None:
    """What SGLang could ask that mla_fa3 does not serve: a named error now, never a wrong answer later."""
    if not getattr(model_runner, "use_mla_backend", False):
        raise ValueError("--attention-backend mla_fa3 serves MLA models (DeepSeek-V2/V3/R1, Kimi-K2); this model's "
                         "attention is not MLA")
    sa = model_runner.server_args
    k = int(getattr(sa, "speculative_num_draft_tokens", 0) or 0)
    if k > MAX_TREE_TOKENS:
        raise ValueError(f"--speculative-num-draft-tokens {k}: mla_fa3 verifies at most {MAX_TREE_TOKENS} draft "
                         "tokens per request")
    pool = model_runner.token_to_kv_pool
    for name in ("kv_buffer", "kv_lora_rank", "qk_rope_head_dim"):
        if not hasattr(pool, name):
            raise ValueError(f"token_to_kv_pool ({type(pool).__name__}) has no {name}: mla_fa3 reads SGLang's "
                             "MLATokenToKVPool (one [size + page, 1, r + d_rope] buffer per layer)")
    if getattr(pool, "use_dsa", False):
        raise ValueError("DeepSeek sparse attention (DSA/NSA) pools are not served by mla_fa3 (use --attention-backend dsa)")
    if pool.dtype not in (torch.bfloat16, torch.float16, FP8_DTYPE):
        raise ValueError(f"--kv-cache-dtype: mla_fa3 reads bf16/fp16 or fp8_e4m3 latent caches, got {pool.dtype}")
    page = int(model_runner.page_size)
    if page < 1 or page & (page - 1):
        raise ValueError(f"--page-size must be a power of two for mla_fa3, got {page}")
    for name in ("attention_chunk_size", "sliding_window_size"):
        if getattr(model_runner, name, None):
            raise ValueError(f"{name} is set: mla_fa3's SGLang backend serves full causal MLA layers")
    if int(getattr(model_runner, "attn_cp_size", 1) or 1) > 1:
        raise ValueError("attention context parallelism is not served by mla_fa3")
    dcp = int(getattr(sa, "dcp_size", 1) or 1)
    if dcp > 1:
        raise ValueError(f"--dcp-size {dcp}: decode context parallelism is not served by mla_fa3")
