"""Embedded model configs for planning and serving benchmarks (HF config dicts; no downloads).

- ``deepseek_v3``: DeepSeek-V3 / R1 (671B): 61 layers, hidden 7168, 128 heads, MLA r 512 / d_nope 128 /
  d_rope 64 / d_v 128, q_lora 1536, 256 routed experts (8 per token) + 1 shared, first 3 layers dense.
- ``deepseek_v3_tp8``: one rank of it under tensor parallelism 8 — 16 heads, MLP / expert widths and
  vocabulary divided by 8 (the KV cache is NOT divided: every rank holds the whole latent cache).

:func:`bench_config` gives a DeepSeek-V3-attention model with few layers for ``bench serve``: the
real MLA dims and head count (16 or 128), small dense MLPs so random weights build in seconds.
``tiny``: the CPU smoke model (``models.tiny.TINY_CONFIGS['tiny_v3']``).
"""

from __future__ import annotations

import copy

from mla_fa3.models.deepseek import DeepseekConfig
from mla_fa3.models.tiny import TINY_CONFIGS

__all__ = ["MODEL_CONFIGS", "model_config", "bench_config"]

_YARN_V3 = {"rope_type": "yarn", "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
           moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
           kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
           n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
           norm_topk_prob=True, first_k_dense_replace=3, max_position_embeddings=163840, rope_theta=10000.0,
           rope_scaling=_YARN_V3, rms_norm_eps=1e-6)

MODEL_CONFIGS: dict[str, dict] = {
    "deepseek_v3": _V3,
    "deepseek_v3_tp8": dict(_V3, num_attention_heads=16, intermediate_size=18432 // 8,
                            moe_intermediate_size=2048 // 8, vocab_size=129280 // 8),
    "tiny": TINY_CONFIGS["tiny_v3"],
    **TINY_CONFIGS,
}


def model_config(name: str, *, num_layers: int | None = None) -> DeepseekConfig:
    """``MODEL_CONFIGS[name]`` as a DeepseekConfig (``num_layers`` overrides the layer count)."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"config must be one of {sorted(MODEL_CONFIGS)}, got {name!r}")
    raw = copy.deepcopy(MODEL_CONFIGS[name])
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
        raw["first_k_dense_replace"] = min(raw.get("first_k_dense_replace", 0), num_layers)
    return DeepseekConfig.from_hf(raw)


def bench_config(num_heads: int = 16, num_layers: int = 4) -> DeepseekConfig:
    """DeepSeek-V3 attention (r 512, 128/64/128, q_lora 1536, ``num_heads`` heads) with ``num_layers`` dense
    layers of hidden size 7168 (MLP width 18432 / 8) and a 16k vocabulary: the attention and the
    projections around it are V3's, the rest is small enough for random weights."""
    raw = dict(_V3, num_attention_heads=num_heads, num_hidden_layers=num_layers, n_routed_experts=0,
               first_k_dense_replace=num_layers, intermediate_size=18432 // 8, vocab_size=16384)
    return DeepseekConfig.from_hf(raw)
