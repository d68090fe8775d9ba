"""Every point where mla_fa3 touches SGLang (0.5.17), each with the SGLang file it targets — one file to review for
the next SGLang release.

``register`` is the general plugin SGLang loads from the entry-point group ``sglang.srt.plugins``
(``srt/plugins/__init__.py:load_plugins``, run in the scheduler, the engine, ``launch_server`` and the data-parallel
controller); it is idempotent. After it, ``--attention-backend mla_fa3`` is a choice like ``fa3``:

    srt/layers/attention/attention_registry.py   register_attention_backend("mla_fa3") -> create_backend
    srt/server_args.py                           add_attention_backend_choices (the CLI accepts the name),
                                                 add_chunked_prefix_cache_attention_backend (prefix chunks on MHA)
    srt/models/deepseek_common/utils.py          FORWARD_ABSORB_CORE_ATTENTION_BACKENDS: the model hands us
                                                 q_lat [T, H, r] and q_rope apart (not one 576-wide query)
    srt/models/deepseek_common/                  AttentionBackendRegistry.register("mla_fa3", handle_attention): the
      attention_backend_handler.py               form of each DeepSeek step; MHA_ONE_SHOT_SUPPORTED_BACKENDS: the
                                                 one-shot MHA prefill (prefix + new tokens in one call) is served

What the adapter reads of SGLang (``adapter.py``, ``convert.py``), by file:

    srt/layers/attention/base_attn_backend.py    AttentionBackend: the hooks SGLangMLABackend implements
    srt/model_executor/model_runner.py           ModelRunner: device, page_size, dtype, model_config, server_args,
                                                 token_to_kv_pool, req_to_token_pool, use_mla_backend, tp sizes
    srt/mem_cache/memory_pool.py                 MLATokenToKVPool.kv_buffer ([size + page, 1, r + d_rope] per
                                                 layer; FP8 as uint8), kv_lora_rank, qk_rope_head_dim, start_layer;
                                                 ReqToTokenPool.req_to_token ([rows, context] int32)
    srt/model_executor/forward_batch_info.py     ForwardBatch: forward_mode, batch_size, req_pool_indices, seq_lens(
                                                 _cpu), out_cache_loc, positions, extend_(prefix|seq)_lens(_cpu),
                                                 spec_info (draft_token_num, topk, custom_mask, positions), the MHA
                                                 prefill's
                                                 attn_attend_prefix_cache, mha_return_lse, mha_one_shot, prefix_chunk_*
    srt/layers/radix_attention.py                RadixAttention: layer_id, tp_q_head_num, qk_head_dim, v_head_dim,
                                                 scaling, logit_cap, sliding_window_size
    srt/model_executor/forward_context.py        what it reads off the active backend: token_to_kv_pool,
                                                 req_to_token_pool, forward_metadata
    srt/layers/attention/verify_mask.py          VerifyMask: the buffer EAGLE (topk > 1) writes draft trees into,
    srt/speculative/eagle_utils.py                 TreeMaskMode.QLEN_ONLY (k x k per request) or FULL_MASK
    srt/speculative/eagle_worker_common.py         (build_eagle_verify_input takes the target backend's verify_mask)
    srt/speculative/draft_utils.py               DraftBackendFactory, through srt/plugins/hook_registry.py (AROUND
                                                 hooks, applied by load_plugins): create_decode_backend of a draft
                                                 resolving to mla_fa3 -> draft.SGLangMLAMultiStepDraftBackend;
                                                 create_draft_extend_backend of one -> SGLangMLABackend
                                                 (draft.route_draft_decode / route_draft_extend; other names: the
                                                 original). --speculative-draft-attention-backend overrides both
    srt/model_executor/forward_batch_info.py     build_inner_fb_view: the DECODE view each draft step plans on
    srt/speculative/eagle_worker_common.py       prepare_for_draft's draft layout (draft.draft_columns: contiguous
                                                 at page 1, page-aligned per branch at page > 1 with topk > 1)
    srt/speculative/eagle_draft_extend_cuda_     DRAFT_EXTEND_V2's replay view (convert.draft_extend_widths: no
      graph_runner.py                            extend_seq_lens_cpu on the batch; spec_info.extend_seq_lens_cpu,
                                                 spec_info.num_tokens_per_req)
    srt/model_executor/runner/decode_cuda_       the capture batch's seq_lens / req_pool_indices are views of the
      graph_runner.py (capture_one_shape,        runner's static buffers, rewritten in place (fill_from: padding rows
      build_replay_fb_view),                     length 1, row 0, slot 0) before every replay, and the replay view
      srt/model_executor/cuda_graph_buffer_      hands the same views, seq_lens_cpu padded alike, out_cache_loc of
      registry.py (fill_from)                    the live rows only: the DECODE and chain TARGET_VERIFY graphs read
                                                 their lengths there (adapter: LengthSources; MLA_FA3_GRAPH_LENGTHS=
                                                 host stages them instead); convert pads out_cache_loc with slot 0
"""

from __future__ import annotations

from functools import partial

from sglang.srt import server_args
from sglang.srt.layers.attention import attention_registry
from sglang.srt.models.deepseek_common import attention_backend_handler as handlers
from sglang.srt.models.deepseek_common import utils as deepseek_utils
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from mla_fa3.integrations.sglang import draft
from mla_fa3.integrations.sglang.adapter import SGLangMLABackend

__all__ = ["BACKEND_NAME", "DRAFT_HOOKS", "register", "create_backend", "handle_attention"]

BACKEND_NAME = "mla_fa3"
_FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"
DRAFT_HOOKS = {f"{_FACTORY}.create_decode_backend": partial(draft.route_draft_decode, backend_name=BACKEND_NAME),
               f"{_FACTORY}.create_draft_extend_backend": partial(draft.route_draft_extend, backend_name=BACKEND_NAME)}


def create_backend(model_runner) -> SGLangMLABackend:
    """The registry's factory: SGLang calls it with its ``ModelRunner`` (target model, each rank)."""
    return SGLangMLABackend(model_runner)


def handle_attention(attn, forward_batch) -> AttnForwardMethod:
    """The form a DeepSeek attention layer computes this step. SGLang's own rule for FA-style backends
    (``_handle_attention_backend``: MHA for a prefill without a prefix or over a prefix past
    ``chunked_prefix_cache_threshold``, one shot when prefix + new tokens fit, absorbed MLA otherwise), except that
    a prefill over an FP8 latent cache always takes MHA: our absorbed kernels read e4m3 only with equal query
    lengths per request (decode, verify)."""
    if attn.kv_cache_dtype == "fp8_e4m3" and forward_batch.forward_mode.is_extend_without_speculative():
        if handlers._support_mha_one_shot(attn, forward_batch, BACKEND_NAME):
            return AttnForwardMethod.MHA_ONE_SHOT
        return AttnForwardMethod.MHA_CHUNKED_KV
    return handlers._handle_attention_backend(attn, forward_batch, BACKEND_NAME)


def _add_once(names: list, name: str, add) -> None:
    if name not in names:
        add(name)


def register() -> None:
    """Make ``mla_fa3`` an SGLang attention backend (idempotent; see the module docstring for each point)."""
    attention_registry.register_attention_backend(BACKEND_NAME)(create_backend)
    _add_once(server_args.ATTENTION_BACKEND_CHOICES, BACKEND_NAME,
              lambda n: server_args.add_attention_backend_choices([n]))
    _add_once(server_args.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS, BACKEND_NAME,
              server_args.add_chunked_prefix_cache_attention_backend)
    _add_once(deepseek_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS, BACKEND_NAME,
              deepseek_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.append)
    _add_once(handlers.MHA_ONE_SHOT_SUPPORTED_BACKENDS, BACKEND_NAME, handlers.MHA_ONE_SHOT_SUPPORTED_BACKENDS.append)
    handlers.AttentionBackendRegistry.register(BACKEND_NAME, handle_attention)
    for target, hook in DRAFT_HOOKS.items():  # load_plugins applies them (HookRegistry.apply_hooks) after us
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)
