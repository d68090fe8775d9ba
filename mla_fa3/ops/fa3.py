"""FlashAttention-3 / FlashMLA / merge_state_v2 from sgl-kernel: the ONLY module that imports ``sgl_kernel``.

Each wrapper takes the validated call record from ``validate.py`` and returns ``(out, lse)`` in the
library's fixed convention: lse float32, **natural log**, shaped ``out.shape[:-1]`` (``[T, H]`` varlen,
``[bs, sq, H]`` batched), ``-inf`` for a row that sees no key. The kernels differ from it in ways
fixed here, with shape-only tensor ops (no device->host sync, legal inside CUDA-graph capture):

* FA3 (``flash_attn_with_kvcache`` / ``flash_attn_varlen_func`` with ``return_softmax_lse=True``)
  returns ``(out, lse, *rest)`` with lse ``[H, T]`` (varlen) or ``[bs, H, sq]`` (batched): transposed
  to token-major here. FA3 always computes lse, so asking for it costs nothing.
* FlashMLA returns ``(out, lse [bs, H, sq])``; its kernels work in base 2 but store ``lse2 / log2(e)``,
  i.e. a natural log (checked in FlashMLA's combine kernel), so no base conversion is needed.
* FA3 and FlashMLA write ``+inf`` as the lse of a row without keys; it is rewritten to ``-inf``.
* ``merge_state_v2`` treats any infinite lse as empty but returns NaN when both sides are empty:
  such rows are rewritten to o 0, lse -inf.
Rows with ``bs == 0`` or no query tokens return empty tensors without launching a kernel.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Tuple

import torch

from .types import FlashMLASchedule, Impl, KernelUnavailableError
from .calls import FlashMLACall, KVCacheCall, VarlenCall

Tensor = torch.Tensor
INSTALL_HINT = (
    'install the GPU extra: pip install "mla-fa3[gpu]" (sglang-kernel 0.4.5, the CUDA 13 build matching '
    "torch 2.11) and run on a Hopper (sm90) GPU; or pass impl='reference'"
)


@functools.lru_cache(maxsize=None)
def import_error() -> Optional[str]:
    """None when ``sgl_kernel.flash_attn`` imports, else the import failure as text (cached)."""
    try:
        import sgl_kernel.flash_attn  # noqa: F401
    except Exception as exc:  # ImportError, or an OSError from a CUDA/torch mismatch
        return f"{type(exc).__name__}: {exc}"
    return None


def unavailable_message(device: torch.device) -> str:
    """Why impl=FA3 cannot run on ``device``, with what to do about it."""
    if device.type != "cuda":
        reason = f"the tensors are on {device}, FA3 needs a CUDA device"
    elif not torch.cuda.is_available():
        reason = "CUDA is not available"
    elif torch.cuda.get_device_capability(device) != (9, 0):
        reason = f"{device} has compute capability {torch.cuda.get_device_capability(device)}, FA3 needs (9, 0)"
    else:
        reason = f"sgl_kernel does not import ({import_error()})"
    return f"FA3 unavailable: {reason}; {INSTALL_HINT}"


def _module(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception as exc:
        raise KernelUnavailableError(f"{name} does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc


def _token_major(lse: Tensor, kernel_shape: tuple, perm: tuple, want: tuple) -> Tensor:
    """Kernel lse (``kernel_shape``) -> ``want`` layout (contiguous), +inf (empty row) -> -inf."""
    if tuple(lse.shape) == kernel_shape:
        lse = lse.permute(*perm)
    elif tuple(lse.shape) != want:
        raise RuntimeError(f"unexpected kernel lse shape {tuple(lse.shape)}, expected {kernel_shape}")
    lse = lse.float().contiguous()
    return lse.masked_fill_(lse == float("inf"), float("-inf"))


def _empty(q: Tensor, dv: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    out = torch.zeros(*q.shape[:-1], dv, dtype=dtype, device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)


def flash_attn_with_kvcache(call: KVCacheCall, *, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """FA3 paged attention -> (out, lse or None)."""
    q, dv = call.q, call.v_cache.shape[3]
    if q.numel() == 0 or call.batch_size == 0:
        return _empty(q, dv, call.out_dtype)
    fa = _module("sgl_kernel.flash_attn")
    res = fa.flash_attn_with_kvcache(
        q, call.k_cache, call.v_cache, qv=call.qv, page_table=call.page_table, cache_seqlens=call.cache_seqlens,
        cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q, q_descale=call.q_descale,
        k_descale=call.k_descale, v_descale=call.v_descale, softmax_scale=call.softmax_scale, causal=call.causal,
        window_size=call.window_size, softcap=call.softcap, num_splits=call.num_splits, return_softmax_lse=True,
    )
    out, lse = res[0], res[1]
    if not return_lse:
        return out, None
    H = q.shape[-2]
    if call.varlen:
        return out, _token_major(lse, (H, q.shape[0]), (1, 0), (q.shape[0], H))
    bs, sq = q.shape[0], q.shape[1]
    return out, _token_major(lse, (bs, H, sq), (0, 2, 1), (bs, sq, H))


def flash_attn_varlen_func(call: VarlenCall, *, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """FA3 varlen attention over contiguous K/V -> (out [T_q, H, d_v], lse [T_q, H] or None)."""
    q = call.q
    if q.shape[0] == 0 or call.batch_size == 0:
        return _empty(q, call.v.shape[2], call.out_dtype)
    fa = _module("sgl_kernel.flash_attn")
    res = fa.flash_attn_varlen_func(
        q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
        softmax_scale=call.softmax_scale, causal=call.causal, window_size=call.window_size, softcap=call.softcap,
        return_softmax_lse=True,
    )
    out, lse = res[0], res[1]
    if not return_lse:
        return out, None
    T, H = q.shape[0], q.shape[1]
    return out, _token_major(lse, (H, T), (1, 0), (T, H))


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """``sgl_kernel.merge_state_v2`` (lse ``[T, H]`` natural log, contiguous) with empty rows fixed."""
    if o_a.shape[0] == 0:
        return o_a.clone(), lse_a.clone()
    sk = _module("sgl_kernel")
    o, lse = sk.merge_state_v2(o_a.contiguous(), lse_a.contiguous(), o_b.contiguous(), lse_b.contiguous())
    empty = torch.isinf(lse_a) & torch.isinf(lse_b)
    o.masked_fill_(empty.unsqueeze(-1), 0.0)
    lse.masked_fill_(empty, float("-inf"))
    return o, lse


@contextlib.contextmanager
def _fp8_flashmla_guard():
    """Some sgl-kernel builds disable FlashMLA's dense FP8 path (NotImplementedError): say so actionably."""
    try:
        yield
    except NotImplementedError as exc:
        raise KernelUnavailableError(
            f"this sgl-kernel build has no dense FP8 FlashMLA ({exc}); sglang-kernel 0.4.5 has it — "
            "or use a bf16 latent cache, or impl='reference'"
        ) from exc


def get_mla_decode_metadata(cache_seqlens: Tensor, num_q_heads_per_kv: int, *, is_fp8: bool) -> FlashMLASchedule:
    """FlashMLA tile-scheduler metadata for one latent KV head (not legal inside graph capture)."""
    fm = _module("sgl_kernel.flash_mla")
    if is_fp8:
        with _fp8_flashmla_guard():
            meta, splits = fm.get_mla_metadata(cache_seqlens, num_q_heads_per_kv, 1, is_fp8_kvcache=True)
    else:
        meta, splits = fm.get_mla_metadata(cache_seqlens, num_q_heads_per_kv, 1)
    return FlashMLASchedule(impl=Impl.FA3, tile_scheduler_metadata=meta, num_splits=splits, is_fp8=is_fp8)


def flash_mla_with_kvcache(call: FlashMLACall, *, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """FlashMLA dense decode -> (out [bs, sq, H, head_dim_v], lse [bs, sq, H] or None)."""
    q = call.q
    if q.numel() == 0:
        return _empty(q, call.head_dim_v, call.out_dtype)
    fm = _module("sgl_kernel.flash_mla")
    extra = {}
    if call.is_fp8:
        extra = dict(descale_q=call.descale_q, descale_k=call.descale_k, is_fp8_kvcache=True)
    with _fp8_flashmla_guard():
        out, lse = fm.flash_mla_with_kvcache(
            q, call.kv_cache, call.page_table, call.cache_seqlens, call.head_dim_v,
            call.schedule.tile_scheduler_metadata, call.schedule.num_splits,
            softmax_scale=call.softmax_scale, causal=call.causal, **extra,
        )
    out = out.to(call.out_dtype)  # no-op unless out_dtype asked for another dtype than the kernel's
    if not return_lse:
        return out, None
    bs, sq, H = q.shape[0], q.shape[1], q.shape[2]
    return out, _token_major(lse, (bs, H, sq), (0, 2, 1), (bs, sq, H))
