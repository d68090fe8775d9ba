"""DeepSeek-V2 / V3 (and V3-architecture models: R1, Kimi-K2) with attention through the MLA backend.

Symbols (all from the config, never constants): ``D`` hidden size, ``H`` heads, ``r`` kv_lora_rank,
``d_nope`` / ``d_rope`` / ``d_v`` head dims, ``q_r`` q_lora_rank (None = no query compression),
``T`` new tokens of the step (token-major, request by request).

One decoder layer (pre-norm residual)::

    x   = input_layernorm(h)
    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))  or  q_proj(x)           [T, H, d_nope + d_rope]
    c_kv | k_pe = kv_a_proj_with_mqa(x)                                   [T, r] | [T, d_rope]
    c_kv = kv_a_layernorm(c_kv);  q_pe, k_pe = RoPE(q_pe, k_pe, positions)  (models/rope.py)
    o   = backend.forward(q, [c_kv | k_pe], None, layer, batch)           [T, H, d_v]
    h   = h + o_proj(o)
    h   = h + MLP(post_attention_layernorm(h))    dense for the first ``first_k_dense_replace`` layers,
                                                  MoE after (models/moe.py)

``kv_b_proj`` [H (d_nope + d_v), r] is never applied here: the backend absorbs it (W_UK, W_UV from
``mla_fa3.absorb``, derived once by :meth:`DeepseekForCausalLM.prepare_attention`) or decompresses the
latent with it for MHA prefill. The latent ``[c_kv | k_pe]`` is what the KV cache stores.
Softmax scale: ``(d_nope + d_rope) ** -0.5``, times YaRN ``mscale(s, mscale_all_dim)**2``.
RMSNorm: ``w * (x / sqrt(mean(x²) + eps))`` computed in float32, cast back before the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mla_fa3.batch import ForwardBatch
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.models.moe import MLP, MoE
from mla_fa3.models.rope import RopeScaling, RotaryEmbedding, softmax_scale

__all__ = ["DeepseekConfig", "RMSNorm", "MLAAttention", "DecoderLayer", "DeepseekForCausalLM"]

_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


@dataclass(frozen=True)
class DeepseekConfig:
    """Every dimension and routing setting of a DeepSeek-V2/V3 model (read from the HF config)."""

    model_type: str  # "deepseek_v2" | "deepseek_v3" (kimi_k2 is read as deepseek_v3)
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # dense MLP width
    num_hidden_layers: int  # decoder layers (MTP layers beyond it are not part of the model)
    num_attention_heads: int  # H
    q_lora_rank: int | None  # q_r; None = a plain q_proj
    kv_lora_rank: int  # r
    qk_nope_head_dim: int  # d_nope
    qk_rope_head_dim: int  # d_rope
    v_head_dim: int  # d_v
    moe_intermediate_size: int  # I: width of one routed / shared expert
    n_routed_experts: int  # E (0 = dense model)
    n_shared_experts: int
    num_experts_per_tok: int  # K
    n_group: int  # G expert groups (1 = no grouping)
    topk_group: int  # Kg groups kept per token
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    scoring_func: str  # "softmax" (V2) | "sigmoid" (V3)
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int  # layers 0 .. k-1 use the dense MLP
    moe_layer_freq: int  # MoE on layers i >= k with i % freq == 0
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool  # bias on q_a_proj, kv_a_proj_with_mqa and o_proj (HF)
    mlp_bias: bool  # bias on the dense / shared MLP projections (HF V2 option)
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeScaling
    rope_interleave: bool  # checkpoint rotary layout: interleaved pairs (DeepSeek) or rotate-half
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers (ignored)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_dims(self) -> MLADims:
        return MLADims(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self.qk_head_dim, self.rope)

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @classmethod
    def from_hf(cls, hf_config) -> "DeepseekConfig":
        """From a transformers config object or a ``config.json`` dict."""
        if isinstance(hf_config, dict):
            c = dict(hf_config)
        elif hasattr(hf_config, "to_dict"):
            c = hf_config.to_dict()
        else:
            raise TypeError(f"hf_config must be a transformers config or a dict, got {type(hf_config).__name__}")
        model_type = c.get("model_type")
        if model_type is None:  # never guessed: a config of another architecture would load as V3
            raise ValueError(f"hf_config.model_type is required, one of {_MODEL_TYPES}")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"hf_config.model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
        v3 = model_type != "deepseek_v2"

        def need(key):
            if c.get(key) is None:
                raise ValueError(f"hf_config.{key} is required, missing from the config")
            return c[key]

        rope_params = c.get("rope_parameters") or c.get("rope_scaling")
        rope = RopeScaling.from_dict(rope_params, theta=c.get("rope_theta", 10000.0),
                                     max_position_embeddings=need("max_position_embeddings"))
        n_routed = c.get("n_routed_experts") or 0
        n_group = c.get("n_group") or 1
        default_method = "noaux_tc" if v3 else "greedy"
        cfg = cls(
            model_type="deepseek_v2" if not v3 else "deepseek_v3",
            vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"), num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=need("num_attention_heads"), q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
            moe_intermediate_size=c.get("moe_intermediate_size") or 0, n_routed_experts=n_routed,
            n_shared_experts=c.get("n_shared_experts") or 0,
            num_experts_per_tok=c.get("num_experts_per_tok") or 0, n_group=n_group,
            topk_group=c.get("topk_group") or n_group,
            topk_method=c.get("topk_method") or default_method,
            scoring_func=c.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            norm_topk_prob=bool(c.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=c.get("first_k_dense_replace") or 0,
            moe_layer_freq=c.get("moe_layer_freq") or 1, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            hidden_act=c.get("hidden_act", "silu"), attention_bias=bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c["max_position_embeddings"], rope=rope,
            rope_interleave=bool(c.get("rope_interleave", True)),
            num_nextn_predict_layers=c.get("num_nextn_predict_layers") or 0,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method must be greedy, group_limited_greedy or noaux_tc, got {self.topk_method!r}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group "
                                 f"({self.n_group})")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in 1..n_group={self.n_group}, got {self.topk_group}")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..{self.n_routed_experts}, "
                                 f"got {self.num_experts_per_tok}")
            if self.topk_method == "noaux_tc" and self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ValueError(f"n_group ({self.n_group}) must leave >= 2 experts per group for noaux_tc "
                                 f"(group score = sum of the top-2), got {self.n_routed_experts} experts")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")


class RMSNorm(nn.Module):
    """``weight * normalize(x)``, the normalisation in float32 (HF DeepSeek semantics). weight [n]."""

    def __init__(self, n: int, eps: float = 1e-6, *, dtype=None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLAAttention(nn.Module):
    """MLA projections around the backend call. Parameter names and shapes are HF's."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, rope: RotaryEmbedding, *, dtype=None, device=None):
        super().__init__()
        self.cfg, self.layer_id, self.rope = cfg, layer_id, rope
        H, D, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        kw = dict(dtype=dtype, device=device)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * cfg.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, **kw)  # eps 1e-6, like HF and DeepSeek
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, **kw)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, D, bias=bias, **kw)
        self.attn: AttentionLayer | None = None  # built by prepare_attention() after the weights are loaded

    def prepare_attention(self) -> AttentionLayer:
        """(Re)derive the backend's layer description (W_UK / W_UV from kv_b_proj); call after loading."""
        self.attn = AttentionLayer.mla_layer(self.layer_id, self.cfg.num_attention_heads, self.cfg.mla_dims,
                                             self.cfg.softmax_scale, kv_b_proj_weight=self.kv_b_proj.weight.detach())
        return self.attn

    def forward(self, x: Tensor, positions: Tensor, batch: ForwardBatch, backend) -> Tensor:
        """x [T, D] -> [T, D]."""
        if self.attn is None:
            raise RuntimeError("MLAAttention.prepare_attention() must run after the weights are loaded")
        cfg, T = self.cfg, x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe)
        q = torch.cat([q_nope, q_pe], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)
        out = backend.forward(q, latent, None, self.attn, batch)
        return self.o_proj(out.reshape(T, cfg.num_attention_heads * cfg.v_head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, rope: RotaryEmbedding, *, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.self_attn = MLAAttention(cfg, layer_id, rope, **kw)
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoE(cfg, **kw)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)

    def forward(self, h: Tensor, positions: Tensor, batch: ForwardBatch, backend) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, batch, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Body(nn.Module):
    """``model.*`` of the HF layout: embed_tokens, layers, norm."""

    def __init__(self, cfg: DeepseekConfig, rope: RotaryEmbedding, *, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class DeepseekForCausalLM(nn.Module):
    """The causal LM. Parameter names follow HF (``model.layers.{i}.self_attn.q_a_proj.weight`` ...),
    except the routed experts, stacked as ``mlp.w_gate_up`` / ``mlp.w_down`` (see models/loader.py)."""

    def __init__(self, cfg: DeepseekConfig, *, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, interleaved=cfg.rope_interleave).to(device)
        self.model = _Body(cfg, self.rotary, dtype=dtype, device=device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self.kv_scales: list[float] | None = None  # per-layer FP8 latent-cache scales (from the checkpoint)
        self.tie_weights()

    def tie_weights(self) -> None:
        """lm_head shares embed_tokens' weight when the config ties them (re-run after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def prepare_attention(self) -> list[AttentionLayer]:
        """Derive every layer's backend description (W_UK / W_UV); the loader calls it after loading."""
        return [layer.self_attn.prepare_attention() for layer in self.model.layers]

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, batch: ForwardBatch, backend, *,
                logit_rows: Tensor | None = None) -> Tensor:
        """input_ids [T] int, positions [T] int64 -> logits [T, V] (or [len(logit_rows), V]).

        ``logit_rows`` (int64 [n], device) selects the rows to project onto the vocabulary, e.g. each
        request's last token in a prefill; ``backend.init_forward_metadata(batch)`` must have run.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must be 1-D of the same length, got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids must hold batch.num_tokens = {batch.num_tokens} tokens, "
                             f"got {input_ids.shape[0]}")
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, positions, batch, backend)
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        return self.lm_head(self.model.norm(h))
