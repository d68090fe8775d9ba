"""Shared types of the kernel layer: implementation enum, errors, the FlashMLA and FA3 schedules, LSE base.

LSE convention (every op of ``mla_fa3.ops``): the log-sum-exp of the scaled (and soft-capped) scores
of a query row, ``lse = ln(sum_j exp(s_j))`` — **natural log** (``LSE_BASE == "e"``), float32, laid out
as the output's shape without its last dim (``[T, H]`` for varlen q, ``[bs, sq, H]`` for batched q).
A row that sees no key has ``lse = -inf`` and output 0. Kernels that produce a base-2 LSE
(``log2(sum_j 2^(s_j·log2 e))``) must be converted with :func:`lse_base2_to_natural` before merging.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

LSE_BASE = "e"  # every LSE returned or accepted by mla_fa3.ops is a natural logarithm
LN2 = math.log(2.0)
FLASHMLA_PAGE_SIZE = 64  # FlashMLA's paged KV cache has a fixed block size of 64 tokens
FLASHMLA_HEAD_DIM = 576  # r + d_rope, the only q/k head dim FlashMLA (and the split-KV kernel) supports
FLASHMLA_HEAD_DIM_V = 512  # r, the only v head dim FlashMLA supports


def lse_base2_to_natural(lse2: torch.Tensor) -> torch.Tensor:
    """Convert a base-2 LSE (log2 of the sum of exponentials) to the natural-log convention: ``lse2 · ln 2``."""
    return lse2 * LN2


def lse_natural_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`lse_base2_to_natural`: ``lse / ln 2``."""
    return lse / LN2


class Impl(enum.Enum):
    """Which implementation runs an op. AUTO picks FA3 on a CUDA sm90 device with sgl_kernel, else REFERENCE.

    TRITON runs only the split-KV ops and the FP8 quantization ops (AUTO picks it there on CUDA when triton
    imports).
    """

    AUTO = "auto"
    FA3 = "fa3"
    REFERENCE = "reference"
    TRITON = "triton"  # our own Triton kernels (split-KV decode only)


class KernelUnavailableError(RuntimeError):
    """impl=FA3 was requested but FA3 cannot run here (no sgl_kernel, no CUDA sm90 device, CPU tensors)."""


@dataclass
class FlashMLASchedule:
    """FlashMLA tile-scheduler plan of one decode step, built by ``get_mla_decode_metadata``.

    Plan once per step, reuse in every layer. For CUDA graphs keep the captured schedule and call
    :meth:`copy_` with a freshly planned one before each replay (same shapes: same batch size).
    """

    impl: Impl  # FA3 or REFERENCE: which implementation planned it (REFERENCE = empty marker)
    tile_scheduler_metadata: Optional[torch.Tensor] = None  # [num_sm_parts, 8] int32, cuda (FA3 only)
    num_splits: Optional[torch.Tensor] = None  # [bs + 1] int32, cuda (FA3 only)
    is_fp8: bool = False  # planned for an fp8 (e4m3) latent cache

    def copy_(self, other: "FlashMLASchedule") -> "FlashMLASchedule":
        """Write ``other``'s plan into this schedule's tensors in place (graph-safe replay update)."""
        if not isinstance(other, FlashMLASchedule):
            raise TypeError(f"other must be a FlashMLASchedule, got {type(other).__name__}")
        if other.impl != self.impl or other.is_fp8 != self.is_fp8:
            raise ValueError(
                f"other was planned for impl={other.impl.value}, is_fp8={other.is_fp8}; "
                f"this schedule is impl={self.impl.value}, is_fp8={self.is_fp8}"
            )
        for name in ("tile_scheduler_metadata", "num_splits"):
            dst, src = getattr(self, name), getattr(other, name)
            if dst is None or src is None:
                continue
            if dst.shape != src.shape:
                raise ValueError(f"other.{name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)
        return self


class FA3ScheduleKey(NamedTuple):
    """The host-side shape of the ``flash_attn_with_kvcache`` calls an :class:`FA3Schedule` serves.

    FA3 checks only the size of the scheduler metadata it is given; a schedule planned for another head
    count, page-table width, query length or window would be read as if it fitted. The ops layer compares
    every call's key with its schedule's before any kernel runs (a tuple: cheap to build and compare per call)."""

    batch_size: int
    max_seqlen_q: int  # new query tokens per request (q's dim 1 batched; max_seqlen_q varlen)
    varlen: bool  # q [T, H, d] with cu_seqlens_q
    page_table_width: int  # pages per request row; FA3's max_seqlen_k = page_table_width * page_size
    page_size: int
    num_heads: int
    num_heads_k: int
    head_dim: int  # q / k head dim (d_rope for absorbed MLA)
    head_dim_v: int  # v head dim (r for absorbed MLA)
    dtype: torch.dtype  # q / cache dtype
    causal: bool
    window_size: tuple  # (left, right), -1 = unbounded
    softcap: bool  # softcap > 0
    num_splits: int  # the split count asked of FA3 (0 = its heuristic); calls must ask the same


@dataclass
class FA3Schedule:
    """FA3's tile-scheduler metadata for one step, built by ``get_fa3_schedule``: planned once, read by every
    layer's ``flash_attn_with_kvcache`` in place of the scheduler kernel FA3 otherwise launches per call.

    It holds the ``cache_seqlens`` (and ``cu_seqlens_q``) it was planned from: a call must pass those very
    tensors. CUDA graphs: keep the captured schedule and :meth:`copy_` a fresh plan into it before each replay
    (or plan inside the graph). The reference plans an empty marker (``scheduler_metadata`` None) and checks
    the same key."""

    impl: Impl  # FA3 or REFERENCE (empty marker)
    key: FA3ScheduleKey
    cache_seqlens: torch.Tensor  # [bs] int32: the lengths planned from
    cu_seqlens_q: Optional[torch.Tensor] = None  # [bs + 1] int32 with varlen q
    scheduler_metadata: Optional[torch.Tensor] = None  # int32, cuda (FA3 only)

    def copy_(self, other: "FA3Schedule") -> "FA3Schedule":
        """Write ``other``'s plan into this schedule's tensor in place (graph-safe replay update)."""
        if not isinstance(other, FA3Schedule):
            raise TypeError(f"other must be an FA3Schedule, got {type(other).__name__}")
        if other.impl != self.impl or other.key != self.key:
            raise ValueError(f"other was planned for {other.impl.value} {other.key}; this schedule is "
                             f"{self.impl.value} {self.key}")
        dst, src = self.scheduler_metadata, other.scheduler_metadata
        if dst is not None and src is not None:
            if dst.shape != src.shape:
                raise ValueError(f"other.scheduler_metadata has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)
        return self
