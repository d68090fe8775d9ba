"""DeepSeek-V2/V3 models on the MLA backend, their HF checkpoint loader and the tiny embedded configs.

- :mod:`mla_fa3.models.deepseek` — ``DeepseekConfig`` (from the HF config), ``DeepseekForCausalLM``;
  attention through ``MLABackend`` (q [T, H, d_nope + d_rope] and the latent [T, r + d_rope]).
- :mod:`mla_fa3.models.rope` / :mod:`mla_fa3.models.moe` — RoPE with YaRN; dense MLP and routed MoE.
- :mod:`mla_fa3.models.loader` — checkpoint dir -> model (shards, HF names, FP8 block dequant via
  :mod:`mla_fa3.models.fp8`); ``CheckpointError`` names the offending tensor.
- :mod:`mla_fa3.models.tiny` — tiny configs and seeded random transformers checkpoints (no downloads).
"""

from mla_fa3.models.deepseek import DeepseekConfig, DeepseekForCausalLM
from mla_fa3.models.loader import CheckpointError, load_model

__all__ = ["DeepseekConfig", "DeepseekForCausalLM", "CheckpointError", "load_model"]
