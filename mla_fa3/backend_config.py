"""The backend's configuration, resolved once at construction: its pools, its decode kernel, the FP8 rules.

``resolve_config`` turns ``MLABackend``'s arguments into a :class:`BackendConfig` or raises a named error
before anything is allocated:

- ``kv_pool``: an ``MLATokenPool``, an ``MHATokenPool`` or a tuple of one of each, on the backend's
  device and page size;
- ``decode_kernel``: 'auto' | 'fa3' | 'flashmla' | 'splitkv' | a ``DecodeKernel`` | None (FA3, or
  FlashMLA for an FP8 latent pool); FlashMLA needs page 64; FlashMLA and split-KV read a 512 + 64
  latent row only where compiled kernels run (the torch reference reads any width);
- an FP8 (e4m3) latent pool: read by FlashMLA's FP8 decode and the dequantizing MHA prefill only, so
  page 64, ``num_heads`` and ``mla_dims`` given, no FA3 and no absorbed prefill override.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_fa3 import ops
from mla_fa3.kv.pools import MHATokenPool, MLATokenPool, same_device
from mla_fa3.policy.paths import DECODE_KERNEL_AUTO, FLASHMLA_PAGE_SIZE, DecodeKernel, PrefillOverride

__all__ = ["BackendConfig", "resolve_config"]


@dataclass(frozen=True)
class BackendConfig:
    mla_pool: MLATokenPool | None
    mha_pool: MHATokenPool | None
    decode_kernel: DecodeKernel | str  # a DecodeKernel, or DECODE_KERNEL_AUTO
    kv_fp8: bool  # the latent pool stores e4m3
    whole_row_kernels_fit: bool  # FlashMLA / split-KV can read this latent row (512 + 64, or the reference)


def resolve_config(kv_pool, page_size: int, device: torch.device, decode_kernel, num_heads, mla_dims,
                   prefill_path, impl) -> BackendConfig:
    """The checked configuration of an ``MLABackend`` (module docstring); named errors, nothing allocated."""
    mla_pool, mha_pool = _split_pools(kv_pool)
    for pool in (mla_pool, mha_pool):
        if pool is None:
            continue
        if pool.page_size != page_size:
            raise ValueError(f"page_size {page_size} differs from the pool's page_size {pool.page_size}")
        if not same_device(pool.device, device):
            raise ValueError(f"kv_pool is on {pool.device} but the backend's device is {device}")
    kernel = _coerce_decode_kernel(decode_kernel)
    kv_fp8 = mla_pool is not None and mla_pool.is_fp8
    if kv_fp8:
        _check_fp8_setup(kernel, page_size, num_heads, mla_dims, prefill_path, impl, device)
        kernel = DECODE_KERNEL_AUTO if kernel is None else kernel
    elif kernel is None:
        kernel = DecodeKernel.FA3
    if kernel is DecodeKernel.FLASHMLA and page_size != FLASHMLA_PAGE_SIZE:
        raise ValueError(f"decode_kernel=flashmla needs page_size {FLASHMLA_PAGE_SIZE}, got {page_size}")
    # FlashMLA (and the split-KV kernel) read only a 512 + 64 latent row; the torch reference reads any
    fit = _whole_row_kernels_fit(mla_pool, impl, device)
    if not fit and kernel in (DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV):
        raise ValueError(f"decode_kernel={kernel.value} reads a latent row of "
                         f"{ops.FLASHMLA_HEAD_DIM_V} + {ops.FLASHMLA_HEAD_DIM - ops.FLASHMLA_HEAD_DIM_V} only; the "
                         f"latent pool has {mla_pool.kv_lora_rank} + {mla_pool.qk_rope_head_dim}"
                         + (" (an FP8 pool is read by FlashMLA or split-KV only)" if kv_fp8 else ""))
    if kv_fp8 and not fit:
        raise ValueError(f"an FP8 latent pool is read by FlashMLA's FP8 decode or the split-KV kernel, which take a "
                         f"latent row of {ops.FLASHMLA_HEAD_DIM_V} + {ops.FLASHMLA_HEAD_DIM - ops.FLASHMLA_HEAD_DIM_V} "
                         f"only; the pool has {mla_pool.kv_lora_rank} + {mla_pool.qk_rope_head_dim}")
    return BackendConfig(mla_pool, mha_pool, kernel, kv_fp8, fit)


def _coerce_decode_kernel(value) -> DecodeKernel | str | None:
    if value is None or isinstance(value, DecodeKernel):
        return value
    if isinstance(value, str):
        low = value.lower()
        if low == DECODE_KERNEL_AUTO:
            return DECODE_KERNEL_AUTO
        for k in DecodeKernel:
            if k.value == low:
                return k
    raise ValueError(f"decode_kernel must be 'auto', 'fa3', 'flashmla', 'splitkv' or a DecodeKernel, got {value!r}")



def _whole_row_kernels_fit(pool: MLATokenPool | None, impl, device: torch.device) -> bool:
    """False when the step's kernels are the compiled ones and the latent row is not FlashMLA's 512 + 64."""
    if pool is None or (pool.kv_lora_rank == ops.FLASHMLA_HEAD_DIM_V
                        and pool.kv_lora_rank + pool.qk_rope_head_dim == ops.FLASHMLA_HEAD_DIM):
        return True
    return ops.resolve_impl(impl, device) is ops.Impl.REFERENCE



def _check_fp8_setup(decode_kernel, page_size: int, num_heads, mla_dims, prefill_path, impl, device) -> None:
    """An FP8 latent pool is read by FlashMLA's FP8 decode (page 64), the split-KV kernel (any page size) and the
    (dequantizing) MHA prefill only."""
    if decode_kernel is DecodeKernel.FA3:
        raise ValueError("decode_kernel='fa3' cannot read an FP8 latent pool (FA3: HeaddimV > 256 requires "
                         "fp16/bf16); use decode_kernel='flashmla', 'splitkv', 'auto' or None")
    if page_size != FLASHMLA_PAGE_SIZE:
        if decode_kernel is DecodeKernel.FLASHMLA:
            raise ValueError(f"decode_kernel='flashmla' cannot read an FP8 latent pool of page_size {page_size}: "
                             f"FlashMLA's FP8 decode takes pages of {FLASHMLA_PAGE_SIZE}; use 'splitkv' or 'auto'")
        if not ops.splitkv_available(device, impl):
            raise ValueError(f"page_size must be {FLASHMLA_PAGE_SIZE} for an FP8 latent pool here, got {page_size}: "
                             f"the split-KV kernel, which reads e4m3 at any page size, cannot run on {device} "
                             f"(no Triton), and FlashMLA's FP8 decode takes pages of {FLASHMLA_PAGE_SIZE}")
    if decode_kernel is DecodeKernel.SPLITKV and not ops.splitkv_available(device, impl):
        raise ValueError(f"decode_kernel='splitkv' cannot run on {device} (no Triton); use 'flashmla' or 'auto'")
    if num_heads is None or mla_dims is None:
        raise ValueError("num_heads and mla_dims are required with an FP8 latent pool (FlashMLA's schedule "
                         "and the MHA prefill that extend rows take)")
    if PrefillOverride.coerce(prefill_path) is PrefillOverride.ABSORBED:
        raise ValueError("prefill_path='absorbed' cannot run on an FP8 latent pool: extend rows read it "
                         "dequantized chunk by chunk (MHA prefill); use 'auto' or 'mha'")



def _split_pools(kv_pool) -> tuple[MLATokenPool | None, MHATokenPool | None]:
    """(mla_pool, mha_pool) from one pool or a tuple/list of them."""
    pools = list(kv_pool) if isinstance(kv_pool, (tuple, list)) else [kv_pool]
    mla = [p for p in pools if isinstance(p, MLATokenPool)]
    mha = [p for p in pools if isinstance(p, MHATokenPool)]
    if len(mla) + len(mha) != len(pools) or len(mla) > 1 or len(mha) > 1 or not pools:
        raise TypeError("kv_pool must be an MLATokenPool, an MHATokenPool, or a tuple of one of each, got "
                        f"{[type(p).__name__ for p in pools]}")
    return (mla[0] if mla else None), (mha[0] if mha else None)
