"""Validated call records: what ``validate.py`` hands to ``fa3.py`` and ``reference.py``.

Each record holds one op's arguments after the boundary checks, normalized (softmax scale resolved,
batch size and varlen flag derived, output dtype fixed: q's dtype, bf16 for fp8 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .types import FlashMLASchedule

Tensor = torch.Tensor


@dataclass(frozen=True)
class KVCacheCall:
    """Validated arguments of ``flash_attn_with_kvcache`` (see ``mla_fa3.ops`` for their meaning)."""

    q: Tensor  # [T, H, d] (varlen) or [bs, sq, H, d] (batched); same device as everything below
    k_cache: Tensor  # [num_pages, page_size, H_kv, d]
    v_cache: Tensor  # [num_pages, page_size, H_kv, d_v]
    qv: Optional[Tensor]  # like q with head dim d_v, q's dtype, or None
    page_table: Tensor  # [bs, max_pages] int32 page ids
    cache_seqlens: Tensor  # [bs] int32, keys per request (prefix + new)
    cu_seqlens_q: Optional[Tensor]  # [bs+1] int32 (varlen) or None (batched)
    max_seqlen_q: Optional[int]  # host int with cu_seqlens_q
    softmax_scale: float  # resolved: default (d + d_v if qv else d) ** -0.5
    causal: bool
    window_size: Tuple[int, int]  # (left, right), -1 = unbounded
    softcap: float  # 0 = off
    k_descale: Optional[Tensor]  # [bs, H_kv] float32 (fp8 cache)
    v_descale: Optional[Tensor]  # [bs, H_kv] float32 (fp8 cache)
    q_descale: Optional[Tensor]  # [bs, H_kv] float32 (fp8 q), optional
    num_splits: int
    batch_size: int
    varlen: bool  # True: q [T, H, d] with cu_seqlens_q
    out_dtype: torch.dtype  # q's dtype, bf16 for fp8 inputs
    scheduler_metadata: Optional[Tensor] = None  # FA3's tile schedule planned for this call (FA3Schedule), or None


@dataclass(frozen=True)
class VarlenCall:
    """Validated arguments of ``flash_attn_varlen_func``."""

    q: Tensor  # [T_q, H, d]
    k: Tensor  # [T_k, H_kv, d]
    v: Tensor  # [T_k, H_kv, d_v]
    cu_seqlens_q: Tensor  # [bs+1] int32
    cu_seqlens_k: Tensor  # [bs+1] int32
    max_seqlen_q: int  # host
    max_seqlen_k: int  # host
    softmax_scale: float  # resolved: default d ** -0.5
    causal: bool
    window_size: Tuple[int, int]
    softcap: float
    batch_size: int
    out_dtype: torch.dtype

    def with_q(self, q: Tensor) -> "VarlenCall":
        """This validated call with another ``q`` of the same shape, dtype, device and last stride.

        For callers that run one validated call per layer (the chunked prefill): a q that differs in
        any of those raises ``ValueError``, so nothing the boundary checks enforce is skipped.
        """
        old = self.q
        if q.shape != old.shape or q.dtype != old.dtype or q.device != old.device or q.stride(-1) != old.stride(-1):
            raise ValueError(f"q must match the validated call's q ({tuple(old.shape)}, {old.dtype}, {old.device}, "
                             f"last stride {old.stride(-1)}), got ({tuple(q.shape)}, {q.dtype}, {q.device}, "
                             f"last stride {q.stride(-1)})")
        new = object.__new__(VarlenCall)  # a field-for-field copy (copy.copy is ~30x slower on a frozen record)
        new.__dict__.update(self.__dict__)
        new.__dict__["q"] = q
        return new


@dataclass(frozen=True)
class MergeCall:
    """A validated ``merge_state`` signature: run with tensors of these shapes (``ops.run_merge_state``)."""

    impl: object  # the Impl (FA3 / REFERENCE) resolved when it was validated
    o_shape: Tuple[int, ...]  # [T, H, d] of o_a and o_b (lse_a / lse_b: [T, H] float32)
    dtype: torch.dtype  # of o_a and o_b
    # the caller guarantees every row of state a has keys (finite lse_a): FA3 skips the both-empty rewrite
    a_nonempty: bool = False


@dataclass(frozen=True)
class FlashMLACall:
    """Validated arguments of ``flash_mla_with_kvcache``."""

    q: Tensor  # [bs, sq, H, D]
    kv_cache: Tensor  # [num_pages, page_size, 1, D]
    page_table: Tensor  # [bs, max_pages] int32
    cache_seqlens: Tensor  # [bs] int32
    head_dim_v: int  # value = kv[..., :head_dim_v]
    schedule: FlashMLASchedule
    softmax_scale: float
    causal: bool
    descale_q: Optional[Tensor]  # (1,) float32 (e4m3 q)
    descale_k: Optional[Tensor]  # (1,) float32 (e4m3 cache)
    is_fp8: bool  # q (and so the cache) is e4m3: FlashMLA's FP8 decode
    out_dtype: torch.dtype
    kv_fp8: bool = False  # the cache is e4m3 (with is_fp8 False: q in its own dtype, split-KV / reference only)
    q_rope: Optional[Tensor] = None  # [bs, sq, H, D - head_dim_v]: the rope part apart (q = its first head_dim_v)
