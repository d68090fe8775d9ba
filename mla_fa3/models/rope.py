"""Rotary position embedding of DeepSeek MLA (the ``d_rope`` part of q and k), with YaRN scaling.

Symbols: ``d = qk_rope_head_dim`` (rotary width), ``theta`` = rope base, ``p`` = absolute position.

Frequencies, one per pair of rotary dims (``i = 0 .. d/2 - 1``)::

    inv_freq[i] = theta ** (-2i / d)                                  (plain RoPE)

YaRN (``rope_scaling.type == "yarn"``, factor ``s``, ``original_max_position_embeddings`` ``L0``,
``beta_fast``, ``beta_slow``) blends interpolated and extrapolated frequencies with a linear ramp
over the pair index, between the dims that complete ``beta_fast`` and ``beta_slow`` turns in ``L0``::

    dim(b)   = d * ln(L0 / (2 pi b)) / (2 ln theta)
    lo, hi   = max(floor(dim(beta_fast)), 0), min(ceil(dim(beta_slow)), d - 1)
    ramp[i]  = clamp((i - lo) / (hi - lo), 0, 1)
    inv_freq = inv_freq / s * ramp + inv_freq * (1 - ramp)

and scales both cos and sin by the *attention factor* ``a`` (``mscale(s, m) = 0.1 m ln s + 1`` for
``s > 1``, else 1)::

    a = attention_factor  if given,  else  mscale(s, mscale) / mscale(s, mscale_all_dim)
        when both are set,  else  mscale(s, 1)

The softmax scale of MLA is ``1 / sqrt(d_nope + d_rope)``, times ``mscale(s, mscale_all_dim)**2``
when a scaled RoPE with ``mscale_all_dim`` is configured (see :func:`softmax_scale`).

Layout. DeepSeek checkpoints rotate *interleaved pairs* ``(x0, x1), (x2, x3), ...`` (HF's
``rope_interleave=True`` for V3, the complex-number form of V2): pair ``i`` is
``(x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin)`` at angle ``p * inv_freq[i]``.
We write the rotated pairs de-interleaved, ``[all first members | all second members]`` (like HF V3);
q and k share that permutation, so every q.k product — all attention ever reads — is unchanged.
``interleaved=False`` is the rotate-half layout (pairs ``(x[i], x[i + d/2])``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["RopeScaling", "RotaryEmbedding", "yarn_mscale", "softmax_scale"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE settings read from the HF config (``rope_parameters`` / legacy ``rope_scaling``)."""

    rope_type: str = "default"  # "default" or "yarn"
    theta: float = 10000.0  # rope base
    factor: float = 1.0  # YaRN context extension factor s
    original_max_position_embeddings: int = 4096  # L0: context length of pre-training
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # 0 = not set
    attention_factor: float | None = None  # explicit cos/sin scale (overrides the mscale ratio)
    truncate: bool = True  # floor/ceil the YaRN correction range (HF default)

    @classmethod
    def from_dict(cls, params: dict | None, *, theta: float, max_position_embeddings: int) -> "RopeScaling":
        """From HF ``rope_parameters`` (or a legacy ``rope_scaling`` dict plus ``rope_theta``)."""
        if params is None:
            return cls(theta=float(theta))
        if not isinstance(params, dict):
            raise TypeError(f"rope_scaling must be a dict or None, got {type(params).__name__}")
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        theta = float(params.get("rope_theta", theta))
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type != "yarn":
            raise ValueError(f"rope_scaling type must be 'default' or 'yarn', got {rope_type!r}")
        orig = params.get("original_max_position_embeddings")
        if orig is None:
            raise ValueError("rope_scaling.original_max_position_embeddings is required for yarn")
        factor = params.get("factor")
        if factor is None:  # HF: ratio of the extended to the original context
            factor = max_position_embeddings / orig
        attention_factor = params.get("attention_factor")
        return cls(rope_type="yarn", theta=theta, factor=float(factor),
                   original_max_position_embeddings=int(orig),
                   beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                   mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                   attention_factor=None if attention_factor is None else float(attention_factor),
                   truncate=bool(params.get("truncate", True)))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: RopeScaling) -> float:
    """MLA softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(s, mscale_all_dim) ** 2`` under YaRN."""
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def _inv_freq_and_attention_factor(dim: int, rope: RopeScaling) -> tuple[Tensor, float]:
    """[dim/2] float32 inverse frequencies and the cos/sin attention factor (module docstring)."""
    base_freq = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / base_freq
    if rope.rope_type == "default":
        return inv_freq, 1.0
    s = rope.factor
    if rope.attention_factor is not None:
        attn = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn = yarn_mscale(s, rope.mscale) / yarn_mscale(s, rope.mscale_all_dim)
    else:
        attn = yarn_mscale(s)

    def corr_dim(turns: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    lo, hi = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp  # weight of the unscaled frequency
    inv_freq = (1.0 / (s * base_freq)) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attn)


class RotaryEmbedding(nn.Module):
    """RoPE for the ``d_rope`` slices of q [T, H, d] and k [T, d]; cos/sin computed per call from positions.

    ``inv_freq`` is a float32 buffer [d/2]; angles are computed in float32 and the result cast back to
    the input dtype (as HF does).
    """

    def __init__(self, dim: int, rope: RopeScaling, *, interleaved: bool = True) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"dim (qk_rope_head_dim) must be even, got {dim}")
        inv_freq, attn = _inv_freq_and_attention_factor(dim, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [d/2] float32
        self.attention_factor = attn
        self.interleaved = interleaved
        self.dim, self.scaling = dim, rope

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in place (after ``Module.to_empty`` left it uninitialised)."""
        with torch.no_grad():
            self.inv_freq.copy_(_inv_freq_and_attention_factor(self.dim, self.scaling)[0])

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] int -> (cos, sin) [T, d/2] float32, already scaled by the attention factor."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, ..., d] -> rotated [T, ..., d] (de-interleaved output layout; see module docstring)."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        c, s = cos.view(shape), sin.view(shape)
        x1f, x2f = x1.float(), x2.float()
        out = torch.cat([x1f * c - x2f * s, x2f * c + x1f * s], dim=-1)
        return out.to(x.dtype)

    def forward(self, positions: Tensor, q_pe: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """q_pe [T, H, d], k_pe [T, d], positions [T] -> (q_pe, k_pe) rotated, same shapes and dtypes."""
        cos, sin = self.cos_sin(positions)
        return self.rotate(q_pe, cos, sin), self.rotate(k_pe, cos, sin)
