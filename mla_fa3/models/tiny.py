"""Tiny embedded DeepSeek configs (no downloads) and random HF checkpoints built from them.

``TINY_CONFIGS`` holds transformers config kwargs, one entry per model family the tests and
``mla-fa3 validate`` exercise:

- ``tiny_v3``: DeepSeek-V3 layout — q_lora, sigmoid routing with ``e_score_correction_bias``,
  ``noaux_tc`` group-limited top-k (4 groups, 2 kept), shared expert, YaRN rope scaling with
  mscale != mscale_all_dim (so both the cos/sin factor and the softmax-scale factor are exercised);
- ``tiny_v2``: DeepSeek-V2 layout — no q_lora (plain ``q_proj``), softmax routing,
  ``group_limited_greedy``, no rope scaling;
- ``v3_mla_dims``: the real DeepSeek-V3 MLA head dims (r 512, d_nope 128, d_rope 64, d_v 128,
  q_lora 1536) with 16 heads (a V3 rank under TP 8) and a small hidden size, 1 dense + 1 MoE layer.

:func:`random_hf_model` builds transformers' own model (eager attention, float32) and fills every
weight from a seeded generator at scales that give O(1) activations and well-separated logits.
:func:`save_hf_checkpoint` writes ``config.json`` + ``model.safetensors`` through ``save_pretrained``
(DeepSeek's per-expert tensor names), and a tiny tokenizer (:func:`tiny_tokenizer`: word level,
lower-cased, split on whitespace, one id per word of ``TOKENIZER_WORDS`` then ``w<i>`` fillers up to
the vocabulary size, with a chat template) so that text prompts work — all built here, no downloads.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

__all__ = ["TINY_CONFIGS", "TOKENIZER_WORDS", "hf_config", "random_hf_model", "randomize_", "save_hf_checkpoint",
           "tiny_tokenizer", "transformers_bars_off"]

TOKENIZER_SPECIALS = ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>")  # ids 0 .. 4
TOKENIZER_WORDS = ("the", "a", "of", "and", "to", "is", "in", "it", "that", "hello", "world", "attention",
                   "latent", "cache", "page", "token", "model", "deep", "seek", "head", "query", "key",
                   "value", "fast", "kernel", "what", "why", "how", "tell", "me", "about", "you", "i",
                   "write", "story", "once", "upon", "time", "there", "was")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

_YARN = {"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 0.707}

def _tiny_configs() -> dict[str, dict]:
    """The three entries: the tiny DeepSeek-V3 layout, and each other family as its changes to it."""
    tiny_v3 = dict(
        model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=256, rope_scaling=_YARN, rms_norm_eps=1e-6,
    )
    tiny_v2 = dict(
        tiny_v3, model_type="deepseek_v2", q_lora_rank=None, v_head_dim=32, n_shared_experts=2,
        num_experts_per_tok=3, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        norm_topk_prob=False, rope_scaling={"rope_type": "default", "rope_theta": 10000.0},
    )
    v3_mla_dims = dict(
        tiny_v3, vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=16, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=2, topk_group=1,
        rope_scaling=dict(_YARN, mscale_all_dim=1.0),
    )
    return {"tiny_v3": tiny_v3, "tiny_v2": tiny_v2, "v3_mla_dims": v3_mla_dims}


TINY_CONFIGS: dict[str, dict] = _tiny_configs()


def hf_config(name_or_kwargs, **overrides):
    """A transformers DeepseekV2Config / DeepseekV3Config (eager attention) from a TINY_CONFIGS entry."""
    import transformers

    kw = copy.deepcopy(TINY_CONFIGS[name_or_kwargs] if isinstance(name_or_kwargs, str) else name_or_kwargs)
    kw.update(overrides)
    model_type = kw.pop("model_type")
    cls = transformers.DeepseekV3Config if model_type == "deepseek_v3" else transformers.DeepseekV2Config
    # ``rope_scaling`` (with rope_theta inside) is read by transformers 4 and converted into
    # ``rope_parameters`` by transformers 5.
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])  # HF's MLA repeat_kv group count
    cfg = cls(**kw)
    cfg.eos_token_id = None  # greedy runs of a fixed length: no early stop on a random token
    cfg._attn_implementation = "eager"
    return cfg


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter and buffer of an HF (or our) DeepSeek model from ``torch.Generator(seed)``.

    Matrices ``[..., out, in]``: N(0, 1/in) (unit-variance outputs); embeddings N(0, 1); RMSNorm weights
    U(0.5, 1.5); ``e_score_correction_bias`` N(0, 0.1²) (so it changes the selection); other vectors
    N(0, 0.02²). Names are visited in sorted order, so the fill does not depend on module order.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if not t.is_floating_point():
                continue
            if name.endswith("e_score_correction_bias"):
                v = torch.randn(t.shape, generator=g) * 0.1
            elif "norm" in name.rsplit(".", 2)[-2]:
                v = torch.rand(t.shape, generator=g) + 0.5
            elif "embed_tokens" in name:
                v = torch.randn(t.shape, generator=g)
            elif t.dim() >= 2:
                v = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
            else:
                v = torch.randn(t.shape, generator=g) * 0.02
            t.copy_(v.to(t.dtype))
    return model


def random_hf_model(name_or_kwargs="tiny_v3", seed: int = 0, **overrides):
    """transformers' DeepseekV{2,3}ForCausalLM in float32, eager attention, seeded random weights."""
    import transformers

    cfg = hf_config(name_or_kwargs, **overrides)
    torch.manual_seed(seed)
    # the class directly: the Auto* lookup imports every model module (seconds)
    cls = transformers.DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3" else transformers.DeepseekV2ForCausalLM
    model = cls(cfg).to(torch.float32)
    return randomize_(model.eval(), seed)


def tiny_tokenizer(vocab_size: int):
    """A word-level ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` ids (specials, words, fillers)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_words = list(TOKENIZER_SPECIALS) + list(TOKENIZER_WORDS)
    vocab_words += [f"w{i}" for i in range(max(0, vocab_size - len(vocab_words)))]
    vocab = {w: i for i, w in enumerate(vocab_words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=list(TOKENIZER_SPECIALS[3:]),
                                   chat_template=CHAT_TEMPLATE)


@contextlib.contextmanager
def transformers_bars_off():
    """transformers' progress bars ("Loading weights", "Writing model shards") off inside the block; its
    setting before the block is restored after it."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def save_hf_checkpoint(model, path: str, *, tokenizer: bool = True) -> str:
    """``save_pretrained`` as safetensors (config.json + model.safetensors), plus the tiny tokenizer
    of the model's vocabulary size unless ``tokenizer=False``; returns ``path``."""
    with transformers_bars_off():  # no "Writing model shards" bar in CLI output
        model.save_pretrained(path)
    if tokenizer:
        tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path
