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
  :meth:`mla_fa3.absorb.MLAWeights.from_kv_b_proj` (see :mod:`mla_fa3.absorb` for the math).

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` / ``TypeError`` whose
message starts with the field name.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from mla_fa3.absorb import MLAWeights

__all__ = ["LayerKind", "MLADims", "AttentionLayer"]


class LayerKind(enum.Enum):
    """What an attention layer computes; the backend dispatches on it."""

    MLA = "mla"  # latent attention over the MLA latent cache (absorbed or MHA-prefill paths)
    MHA = "mha"  # ordinary paged self-attention (GQA / MQA / window / softcap / local)
    CROSS = "cross"  # non-causal attention over encoder K/V (encoder-decoder models)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class MLADims:
    """The four MLA head dimensions of a model (DeepSeek-V3: 512, 128, 64, 128). All from the config."""

    kv_lora_rank: int  # r: width of the compressed latent c_kv (and of the absorbed query q_lat)
    qk_nope_head_dim: int  # d_nope: non-rotary part of each q/k head
    qk_rope_head_dim: int  # d_rope: rotary part of each q head; width of the shared k_rope
    v_head_dim: int  # d_v: value head width (the layer's output per head)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_positive_int(name, getattr(self, name))

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
            _check_positive_int(name, getattr(self, name))
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
                raise TypeError(f"mla_weights must be an absorb.MLAWeights, got {type(self.mla_weights).__name__}")
            self.mla_weights.check_matches(self.num_heads, self.mla)

    @property
    def is_cross_attention(self) -> bool:
        return self.kind is LayerKind.CROSS

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
