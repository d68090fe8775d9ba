"""Boundary checks of the warp-specialized Gluon decode kernel (``gluon_decode.py``): its one shape, host values only
(shapes, dtypes, strides, devices; no sync, no triton import), so split-KV can refuse a launch by name before the
kernel module is imported.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import validate
from .splitkv_plan import SplitKVSchedule
from .types import Impl

__all__ = ["HEADS", "MAX_QUERIES", "LATENT", "ROPE", "PAGE", "MAX_ROWS", "check_supported", "unsupported"]

Tensor = torch.Tensor

HEADS = 16  # one program holds every head of a request
MAX_QUERIES = 2  # query tokens per request (causal, bottom-right): wgmma N = HEADS x tokens, accᵀ 4·N registers
LATENT = 512  # r
ROPE = 64  # d_rope
PAGE = 64  # keys per page = keys per tile (BLOCK_N)
MAX_ROWS = 2**31  # TMA coordinates are int32: page_id · 64 must fit


def check_supported(q: Tensor, kv_cache: Tensor, page_table: Tensor, cache_seqlens: Tensor, *,
                    schedule: SplitKVSchedule, softmax_scale: float, q_rope: Optional[Tensor] = None,
                    head_dim_v: int = LATENT, descale_k: Optional[Tensor] = None):
    """The split-KV op's boundary checks (``validate.check_splitkv``), then this kernel's one shape
    (:func:`unsupported`); a ValueError naming the argument otherwise, before any launch. Reads shapes, dtypes,
    strides and devices only (no sync). Returns the validated ``FlashMLACall``."""
    if getattr(q, "dtype", None) in (torch.float8_e4m3fn, torch.float8_e5m2):  # before the FP8-q contract's checks
        raise ValueError(f"q must be bfloat16 for the Gluon decode kernel, got {q.dtype} (an e4m3 q is not supported:"
                         " an e4m3 cache is read with a bf16 q)")
    call = validate.check_splitkv(q, kv_cache, page_table, cache_seqlens, head_dim_v=head_dim_v, schedule=schedule,
                                  softmax_scale=softmax_scale, causal=True, descale_q=None, descale_k=descale_k,
                                  impl=Impl.TRITON, q_rope=q_rope)
    why = unsupported(call, schedule)
    if why is not None:
        raise ValueError(why)
    return call


def unsupported(call, schedule: SplitKVSchedule) -> Optional[str]:
    """Why this kernel cannot run a validated split-KV ``call`` with ``schedule`` (its one shape), or None."""
    q, q_rope, kv_cache = call.q, call.q_rope, call.kv_cache
    sq, H = q.shape[1:3]
    if call.is_fp8:
        return (f"q must be bfloat16 for the Gluon decode kernel, got {q.dtype} (an e4m3 q, FlashMLA's FP8 contract, "
                "is not supported: an e4m3 cache is read with a bf16 q)")
    for x, name in ((q, "q"), (q_rope, "q_rope")):
        if x is not None and x.dtype != torch.bfloat16:
            return f"{name} must be bfloat16 for the Gluon decode kernel (its one shape), got {x.dtype}"
    if kv_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return f"kv_cache must be bfloat16 or float8_e4m3fn for the Gluon decode kernel, got {kv_cache.dtype}"
    if call.head_dim_v != LATENT:
        return f"head_dim_v must be {LATENT} for the Gluon decode kernel, got {call.head_dim_v}"
    if not 1 <= sq <= MAX_QUERIES:
        return (f"q must hold 1 to {MAX_QUERIES} query tokens per request (q.shape[1]) for the Gluon decode kernel "
                f"(wgmma N = heads x tokens <= {HEADS * MAX_QUERIES}: its output accumulator's registers), got {sq}")
    if sq > 1 and not call.causal:
        return (f"causal must be True with {sq} query tokens per request for the Gluon decode kernel (it masks each "
                "token to its causal, bottom-right limit)")
    if sq > 1 and kv_cache.dtype == torch.float8_e4m3fn:
        return (f"q must hold one query token per request over an e4m3 cache for the Gluon decode kernel, got {sq} "
                "(the e4m3 variant at 32 query rows spills registers under triton 3.6)")
    if H != HEADS:
        return f"q must have {HEADS} heads for the Gluon decode kernel (wgmma N = heads), got {H}"
    if tuple(kv_cache.shape[1:]) != (PAGE, 1, LATENT + ROPE):
        return (f"kv_cache must be [num_pages, {PAGE}, 1, {LATENT + ROPE}] for the Gluon decode kernel, got "
                f"{tuple(kv_cache.shape)}")
    D = LATENT + ROPE
    if kv_cache.stride() != (PAGE * D, D, D, 1):
        return (f"kv_cache must be contiguous (the TMA descriptor views it as [num_pages·{PAGE}, {D}]), got strides "
                f"{kv_cache.stride()}")
    if kv_cache.data_ptr() % 16:
        return "kv_cache must start on a 16-byte boundary (TMA)"
    if kv_cache.shape[0] * PAGE >= MAX_ROWS:
        return (f"kv_cache has {kv_cache.shape[0]} pages; the Gluon decode kernel addresses rows with int32 TMA "
                f"coordinates (at most {MAX_ROWS // PAGE - 1} pages)")
    if schedule.granule % PAGE:
        return f"schedule must start splits on whole {PAGE}-key tiles, got granule {schedule.granule}"
    if q.device.type != "cuda":
        return f"q must be on a CUDA device (sm_90) for the Gluon decode kernel, got {q.device}"
    return None
