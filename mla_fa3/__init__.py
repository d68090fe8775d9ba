"""mla_fa3: multi-head latent attention (MLA) backend for DeepSeek-style models.

Built on FlashAttention-3 (sgl-kernel) on Hopper GPUs, with a pure-torch reference of every kernel
that runs anywhere (see ``mla_fa3.ops``). ``docs/ARCHITECTURE.md`` maps the modules.
"""

__version__ = "0.1.0"
