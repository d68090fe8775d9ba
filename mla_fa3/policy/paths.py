"""The names of what a step can run: one enum for the attention paths, one for the absorbed kernels.

Every layer of the library speaks these names — the cost model returns an :class:`AttentionPath`, the
step plan records one, ``explain()`` reports one — so a path has exactly one name.
"""

from __future__ import annotations

import enum

from mla_fa3.ops import FLASHMLA_PAGE_SIZE

__all__ = ["AttentionPath", "DecodeKernel", "PrefillOverride", "FLASHMLA_PAGE_SIZE", "DECODE_KERNEL_AUTO"]

DECODE_KERNEL_AUTO = "auto"  # the decode_kernel setting that chooses a kernel per step (policy.kernel_choice)


class AttentionPath(enum.Enum):
    """Which compute path serves an MLA layer's rows (or, MHA_FALLBACK, a non-MLA layer)."""

    IDLE = "idle"  # empty batch: no kernel, no pool access
    ABSORBED = "absorbed"  # absorb.forward_absorbed over the latent cache (FA3, FlashMLA or split-KV)
    MHA_ONESHOT = "mha_oneshot"  # chunked_prefix: MHA over the decompressed new tokens (no prefix)
    MHA_CHUNKED = "mha_chunked"  # chunked_prefix: MHA over a prefix decompressed chunk by chunk
    MHA_FALLBACK = "mha_fallback"  # mha_fallback: regular MHA / cross-attention layers

    @property
    def is_mha_prefill(self) -> bool:
        """The MHA prefill of ``chunked_prefix`` (decompressed K/V), one-shot or chunked."""
        return self in (AttentionPath.MHA_ONESHOT, AttentionPath.MHA_CHUNKED)


class DecodeKernel(enum.Enum):
    """Kernel of the absorbed path for decode-like steps (equal q length per request)."""

    FA3 = "fa3"  # sgl-kernel FlashAttention-3 with qv: any page size, any mode (the default)
    FLASHMLA = "flashmla"  # FlashMLA dense decode over the whole latent row: page 64, equal q lengths
    SPLITKV = "splitkv"  # our Triton split-KV kernel over the whole latent row: equal q lengths, small batches


class PrefillOverride(enum.Enum):
    """The backend's ``prefill_path`` setting for extend-like steps."""

    AUTO = "auto"  # the cost model (policy.prefill_cost) picks per step
    ABSORBED = "absorbed"  # every row absorbed
    MHA = "mha"  # the MHA prefill for every non-decode row (decode rows of a MIXED step stay absorbed)

    @classmethod
    def coerce(cls, value: object, name: str = "prefill_path") -> "PrefillOverride":
        if isinstance(value, cls):
            return value
        for member in cls:
            if value == member.value:
                return member
        raise ValueError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}")
