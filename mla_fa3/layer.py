"""The per-layer description the backend reads (the role SGLang's ``RadixAttention`` plays).

An :class:`AttentionLayer` says what one attention layer of a model computes, per tensor-parallel
rank; it holds no activations and no cache. The backend reads it on every ``forward`` call:

- ``kind``: :class:`LayerKind` — ``MLA`` (multi-head latent attention over the latent cache, the
  DeepSeek layer), ``MHA`` (ordinary paged attention, GQA/MQA allowed) or ``CROSS`` (non-causal
  attention over an encoder's K/V).
- Symbols for MLA layers (all from the model config, see :class:`MLADims`): ``H`` heads,
  ``r`` = kv_lora_rank (latent width), ``d_nope`` / ``d_rope`` (the two parts of a q/k head),
  ``d_v`` (value head). The cache row of a token is ``[c_kv (r) | k_rope (d_rope)]``, one KV head.
  A query head is ``[q_nope (d_nope) | q_rope (d_rope)]``, so ``head_dim = d_nope + d_rope`` and
  ``v_head_dim = d_v``.
- ``scaling``: the softmax scale applied to q·k (``1/sqrt(d_nope + d_rope)`` times the YaRN
  ``mscale²`` when the model's rope scaling asks for it — the model computes it, the layer carries it).
- ``logit_cap`` (softcap, 0 = off): ``s = cap * tanh(s / cap)`` after scaling.
- ``sliding_window``: left window in tokens, -1 = none; a query at position p sees keys
  ``p - sliding_window .. p`` (the kernels' ``window_size=(sliding_window, 0)``).
- ``mla_weights``: the W_UK / W_UV matrices the absorbed path needs, derived once at load time by
  :meth:`mla_fa3.MLAWeights.from_kv_b_proj` (see :mod:`mla_fa3.absorb` for the math).

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` / ``TypeError`` whose
message starts with the field name.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from mla_fa3.checks import check_int

__all__ = ["LayerKind", "MLADims", "MLAWeights", "AttentionLayer"]


class LayerKind(enum.Enum):
    """What an attention layer computes; the backend dispatches on it."""

    MLA = "mla"  # latent attention over the MLA latent cache (absorbed or MHA-prefill paths)
    MHA = "mha"  # ordinary paged self-attention (GQA / MQA / window / softcap / local)
    CROSS = "cross"  # non-causal attention over encoder K/V (encoder-decoder models)




@dataclass(frozen=True)
class MLADims:
    """The four MLA head dimensions of a model (DeepSeek-V3: 512, 128, 64, 128). All from the config."""

    kv_lora_rank: int  # r: width of the compressed latent c_kv (and of the absorbed query q_lat)
    qk_nope_head_dim: int  # d_nope: non-rotary part of each q/k head
    qk_rope_head_dim: int  # d_rope: rotary part of each q head; width of the shared k_rope
    v_head_dim: int  # d_v: value head width (the layer's output per head)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(getattr(self, name), name)

    @property
    def qk_head_dim(self) -> int:
        """d_nope + d_rope: the width of one query head handed to the backend."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """r + d_rope: the width of one latent cache row ``[c_kv | k_rope]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_proj_shape(self) -> tuple[int, int]:
        """Per-head rows and columns of kv_b_proj: (d_nope + d_v, r); the weight is [H * rows, r]."""
        return self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank


@dataclass(frozen=True)
class MLAWeights:
    """W_UK / W_UV of one MLA layer, derived ONCE from kv_b_proj (at load), in bmm-ready layouts."""

    w_uk: torch.Tensor  # [H, d_nope, r], contiguous, model dtype, device of the model
    w_uv: torch.Tensor  # [H, r, d_v], contiguous (W_UVᵀ per head), same dtype/device as w_uk

    def __post_init__(self) -> None:
        for name in ("w_uk", "w_uv"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{name} must be 3-D [H, ., .], got shape {tuple(t.shape)}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
        uk, uv = self.w_uk, self.w_uv
        if uk.shape[0] != uv.shape[0] or uk.shape[2] != uv.shape[1]:
            raise ValueError(
                f"w_uv must be [H, r, d_v] matching w_uk [H, d_nope, r] = {tuple(uk.shape)}, got {tuple(uv.shape)}"
            )
        if uk.dtype != uv.dtype or uk.device != uv.device:
            raise ValueError(f"w_uv must have w_uk's dtype/device ({uk.dtype}, {uk.device}), got ({uv.dtype}, {uv.device})")

    # sizes and dtype read off the weights: w_uk [H, d_nope, r], w_uv [H, r, d_v]
    num_heads = property(lambda self: self.w_uk.shape[0], doc="H")
    qk_nope_head_dim = property(lambda self: self.w_uk.shape[1], doc="d_nope")
    kv_lora_rank = property(lambda self: self.w_uk.shape[2], doc="r")
    v_head_dim = property(lambda self: self.w_uv.shape[2], doc="d_v")
    dtype = property(lambda self: self.w_uk.dtype, doc="the weights' dtype")

    @property
    def w_vk(self) -> torch.Tensor:
        """[H, r, d_v + d_nope] contiguous: per head ``[W_UVᵀ | W_UKᵀ]``, the MHA prefill's decompression weight.

        One batched GEMM ``c_kv [L, r] · w_vk[h]`` gives each head's ``[v | k_nope]`` row (written straight
        into the attention's K/V buffer, ``chunked_prefix.decompress_latent``). Built on first use and
        cached on these weights (as many bytes as kv_b_proj; never built by decode-only serving).
        """
        w = self.__dict__.get("_w_vk")
        if w is None:
            w = torch.cat([self.w_uv, self.w_uk.transpose(1, 2)], dim=2).contiguous()
            object.__setattr__(self, "_w_vk", w)
        return w

    @property
    def device(self) -> torch.device:
        return self.w_uk.device

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, dims: MLADims, *, num_heads: int | None = None,
                       dtype: torch.dtype | None = None) -> MLAWeights:
        """Split a ``kv_b_proj`` weight ``[H·(d_nope + d_v), r]`` (nn.Linear layout) into W_UK / W_UV.

        ``num_heads`` (optional) is checked against the weight's row count; ``dtype`` casts the result
        (e.g. a bf16 model whose loader dequantized FP8 weights to fp32).
        """
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        if not weight.is_floating_point() or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"weight must be a dequantized float tensor (fp32/bf16/fp16), got {weight.dtype}")
        rows_per_head, r = dims.kv_b_proj_shape
        if weight.dim() != 2 or weight.shape[1] != r or weight.shape[0] % rows_per_head:
            raise ValueError(
                f"weight must be [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank] = [H * {rows_per_head}, {r}], "
                f"got {tuple(weight.shape)}"
            )
        heads = weight.shape[0] // rows_per_head
        if num_heads is not None and heads != num_heads:
            raise ValueError(f"weight has {heads} heads of {rows_per_head} rows, num_heads says {num_heads}")
        w = weight.detach().view(heads, rows_per_head, r)
        if dtype is not None:
            w = w.to(dtype)
        d_nope = dims.qk_nope_head_dim
        w_uk = w[:, :d_nope, :].contiguous()  # [H, d_nope, r]
        w_uv = w[:, d_nope:, :].transpose(1, 2).contiguous()  # [H, r, d_v]
        return cls(w_uk=w_uk, w_uv=w_uv)

    def check_matches(self, num_heads: int, dims: MLADims) -> None:
        """Raise ValueError unless these weights fit a layer of ``num_heads`` heads with ``dims``."""
        want_uk = (num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank)
        want_uv = (num_heads, dims.kv_lora_rank, dims.v_head_dim)
        if tuple(self.w_uk.shape) != want_uk or tuple(self.w_uv.shape) != want_uv:
            raise ValueError(
                f"mla_weights must have w_uk {want_uk} and w_uv {want_uv} for this layer, got "
                f"{tuple(self.w_uk.shape)} and {tuple(self.w_uv.shape)}"
            )

    def to(self, *args, **kwargs) -> MLAWeights:
        """A copy moved/cast like ``Tensor.to`` (layouts kept contiguous)."""
        return MLAWeights(w_uk=self.w_uk.to(*args, **kwargs).contiguous(),
                          w_uv=self.w_uv.to(*args, **kwargs).contiguous())



@dataclass
class AttentionLayer:
    """One attention layer as the backend sees it (per tensor-parallel rank)."""

    layer_id: int  # index into the KV pools (0 .. num_layers - 1)
    kind: LayerKind
    num_heads: int  # H: query heads on this rank
    num_kv_heads: int  # KV heads on this rank (MLA: 1 — the latent is shared by all heads)
    head_dim: int  # q/k head width (MLA: d_nope + d_rope)
    v_head_dim: int  # v / output head width (MLA: d_v)
    scaling: float  # softmax scale applied to q·k (before the softcap)
    logit_cap: float = 0.0  # softcap, 0 = off
    sliding_window: int = -1  # left window in tokens, -1 = none
    use_local_attention: bool = False  # chunked (local) attention through metadata.local
    mla: MLADims | None = None  # required for LayerKind.MLA, None otherwise
    mla_weights: MLAWeights | None = None  # W_UK / W_UV of this layer (MLA), derived once at load

    def __post_init__(self) -> None:
        if isinstance(self.layer_id, bool) or not isinstance(self.layer_id, int):
            raise TypeError(f"layer_id must be an int, got {type(self.layer_id).__name__}")
        if self.layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {self.layer_id}")
        if not isinstance(self.kind, LayerKind):
            raise TypeError(f"kind must be a LayerKind, got {self.kind!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            check_int(getattr(self, name), name)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads, got {self.num_heads} and {self.num_kv_heads}"
            )
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, (int, float)):
            raise TypeError(f"scaling must be a float, got {type(self.scaling).__name__}")
        if not (math.isfinite(self.scaling) and self.scaling > 0):
            raise ValueError(f"scaling must be a positive finite float, got {self.scaling}")
        if not (math.isfinite(self.logit_cap) and self.logit_cap >= 0):
            raise ValueError(f"logit_cap must be >= 0 (0 = off), got {self.logit_cap}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int):
            raise TypeError(f"sliding_window must be an int, got {type(self.sliding_window).__name__}")
        if self.sliding_window < -1:
            raise ValueError(f"sliding_window must be -1 (none) or >= 0, got {self.sliding_window}")
        if self.kind is LayerKind.CROSS and (self.sliding_window >= 0 or self.use_local_attention):
            raise ValueError("sliding_window / use_local_attention are not defined for a CROSS layer")
        if self.kind is LayerKind.MLA:
            self._check_mla()
        elif self.mla is not None or self.mla_weights is not None:
            raise ValueError(f"mla / mla_weights are only for LayerKind.MLA layers, got kind {self.kind.name}")

    def _check_mla(self) -> None:
        if not isinstance(self.mla, MLADims):
            raise TypeError(f"mla must be an MLADims for a LayerKind.MLA layer, got {self.mla!r}")
        if self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 for an MLA layer (one latent head), got {self.num_kv_heads}")
        if self.head_dim != self.mla.qk_head_dim:
            raise ValueError(
                f"head_dim must equal qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim} "
                f"for an MLA layer, got {self.head_dim}"
            )
        if self.v_head_dim != self.mla.v_head_dim:
            raise ValueError(f"v_head_dim must equal mla.v_head_dim = {self.mla.v_head_dim}, got {self.v_head_dim}")
        if self.mla_weights is not None:
            if not isinstance(self.mla_weights, MLAWeights):
                raise TypeError(f"mla_weights must be an MLAWeights, got {type(self.mla_weights).__name__}")
            self.mla_weights.check_matches(self.num_heads, self.mla)

    @property
    def is_cross_attention(self) -> bool:
        return self.kind is LayerKind.CROSS

    @property
    def is_plain(self) -> bool:
        """No softcap, sliding window or local attention: what FlashMLA, split-KV, the FP8 readers and FA3's step
        schedule serve (other layers run the absorbed path on FA3, planning per call)."""
        return self.logit_cap == 0 and self.sliding_window < 0 and not self.use_local_attention

    @property
    def window_size(self) -> tuple[int, int]:
        """The kernels' (left, right) window: (sliding_window, 0) or (-1, -1) when there is none."""
        return (self.sliding_window, 0) if self.sliding_window >= 0 else (-1, -1)

    @classmethod
    def mla_layer(cls, layer_id: int, num_heads: int, dims: MLADims, scaling: float, *,
                  kv_b_proj_weight=None, mla_weights: MLAWeights | None = None, logit_cap: float = 0.0,
                  sliding_window: int = -1, use_local_attention: bool = False) -> "AttentionLayer":
        """An MLA layer; W_UK / W_UV come from ``mla_weights`` or are derived from ``kv_b_proj_weight``."""
        if kv_b_proj_weight is not None:
            if mla_weights is not None:
                raise ValueError("kv_b_proj_weight and mla_weights are exclusive: give one")
            mla_weights = MLAWeights.from_kv_b_proj(kv_b_proj_weight, dims, num_heads=num_heads)
        return cls(layer_id=layer_id, kind=LayerKind.MLA, num_heads=num_heads, num_kv_heads=1,
                   head_dim=dims.qk_head_dim, v_head_dim=dims.v_head_dim, scaling=scaling,
                   logit_cap=logit_cap, sliding_window=sliding_window,
                   use_local_attention=use_local_attention, mla=dims, mla_weights=mla_weights)
