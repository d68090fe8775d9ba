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
    descale_q: Optional[Tensor]  # (1,) float32 (fp8)
    descale_k: Optional[Tensor]  # (1,) float32 (fp8)
    is_fp8: bool
    out_dtype: torch.dtype
