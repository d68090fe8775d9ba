"""The kernel layer of mla_fa3: one dispatch point for every attention kernel.

Each public op validates its inputs (``validate.py``: dtypes, ranks, shapes, devices, argument
combinations — never tensor values, so no GPU sync), then runs either

* ``Impl.FA3``       — FlashAttention-3 / FlashMLA / merge_state_v2 from sgl-kernel (``fa3.py``,
                       the only module that imports ``sgl_kernel``), or
* ``Impl.REFERENCE`` — the pure-torch reference (``reference.py``): fp32 accumulation, any device.

``Impl.AUTO`` (the default) picks FA3 on CUDA tensors and REFERENCE on any other device. On a CUDA
device where FA3 cannot run (no sm90, sgl_kernel missing or built for another torch) AUTO raises
``FA3UnavailableError`` saying why, instead of silently running the slow reference; pass
``impl="reference"`` to run the reference on a GPU on purpose. The per-call ``impl=`` argument overrides the global choice
(``set_impl`` / ``use_impl``); ``last_impl()`` says which implementation the most recent call ran.

Symbols: T new query tokens of a batch (token-major, request by request), bs requests, H query heads,
H_kv KV heads (H % H_kv == 0, query head h reads KV head h // (H / H_kv)), d the q/k head dim, d_v the
v head dim, L_b = cache_seqlens[b] keys of request b, n_b its new query tokens.
Attention of request b, query i (position p = L_b - n_b + i, i.e. causal is bottom-right aligned):
    s_j = scale · (q_i·k_j + qv_i·v_j)          (qv term only when qv is given: absorbed MLA)
    s_j = softcap · tanh(s_j / softcap)         (softcap > 0)
    key j visible iff (not causal or j <= p) and (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
    out_i = Σ_j softmax(s)_j · v_j,   lse_i = ln Σ_j exp(s_j)   (natural log; -inf and out 0 if no key)
Returns are fixed: ``out``, or ``(out, lse)`` with ``return_lse=True``; lse is float32, natural log
(``LSE_BASE``), shaped ``out.shape[:-1]``.

CUDA graphs: validation and dispatch are host-only, and the FA3 paths of flash_attn_with_kvcache,
flash_attn_varlen_func, merge_state and flash_mla_with_kvcache never sync, so they can be captured.
get_mla_decode_metadata and get_fa3_schedule are device kernels too (plan inside the graph, or outside and
``copy_`` into the captured schedule).
The reference reads lengths on the host and is never capturable. ``set_impl`` / ``last_impl`` are
process-wide state (not per thread).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _checks as chk, fa3, reference, validate
from .calls import MergeCall, VarlenCall
from .fa3 import FA3UnavailableError
from .selection import (ImplLike, coerce_impl, fa3_available, get_impl, last_impl, ran, resolve,
                        resolve_impl, set_impl, use_impl)
from .splitkv_config import KernelConfig
from .splitkv_plan import SplitKVSchedule
from .tree_attention import tree_attention
from .triton_ops import (HEAD_MATMUL_MAX_ROWS, absorb_query_e4m3, fp8_fused_available, gather_page_ids,
                         get_splitkv_schedule, head_matmul, page_ids_kernel, quantize_query_e4m3,
                         replan_splitkv_schedule,
                         splitkv_available, splitkv_mla_with_kvcache, store_e4m3, store_rows)
from .types import (
    FLASHMLA_HEAD_DIM,
    FLASHMLA_HEAD_DIM_V,
    FLASHMLA_PAGE_SIZE,
    LN2,
    LSE_BASE,
    FA3Schedule,
    FA3ScheduleKey,
    FlashMLASchedule,
    Impl,
    KernelUnavailableError,
    lse_base2_to_natural,
    lse_natural_to_base2,
)

__all__ = [
    "Impl",
    "KernelUnavailableError",
    "FA3UnavailableError",
    "FlashMLASchedule",
    "FA3Schedule",
    "FA3ScheduleKey",
    "LSE_BASE",
    "FLASHMLA_PAGE_SIZE",
    "FLASHMLA_HEAD_DIM",
    "FLASHMLA_HEAD_DIM_V",
    "LN2",
    "lse_base2_to_natural",
    "lse_natural_to_base2",
    "set_impl",
    "get_impl",
    "use_impl",
    "last_impl",
    "coerce_impl",
    "resolve_impl",
    "fa3_available",
    "flash_attn_with_kvcache",
    "get_fa3_schedule",
    "flash_attn_varlen_func",
    "merge_state",
    "prepare_flash_attn_varlen",
    "run_flash_attn_varlen",
    "prepare_merge_state",
    "run_merge_state",
    "get_mla_decode_metadata",
    "flash_mla_with_kvcache",
    "SplitKVSchedule",
    "KernelConfig",
    "get_splitkv_schedule",
    "replan_splitkv_schedule",
    "splitkv_available",
    "splitkv_mla_with_kvcache",
    "fp8_fused_available",
    "store_e4m3",
    "store_rows",
    "gather_page_ids",
    "page_ids_kernel",
    "quantize_query_e4m3",
    "absorb_query_e4m3",
    "head_matmul",
    "HEAD_MATMUL_MAX_ROWS",
    "tree_attention",
]

Tensor = torch.Tensor

def _run_attention(chosen: Impl, name: str, args, return_lse: bool):
    """Run attention op ``name`` of the chosen implementation on validated ``args``; the fixed return."""
    if chosen is Impl.FA3:
        out, lse = getattr(fa3, name)(args, return_lse=return_lse)
    else:
        out, lse = getattr(reference, name)(args)
    ran(chosen)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    qv: Optional[Tensor] = None,
    page_table: Tensor,
    cache_seqlens: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    num_splits: int = 0,
    schedule: Optional[FA3Schedule] = None,
    return_lse: bool = False,
    impl: Optional[ImplLike] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of new queries over a paged KV cache (FA3 ``flash_attn_with_kvcache``).

    q: ``[T, H, d]`` with ``cu_seqlens_q [bs+1] int32`` and ``max_seqlen_q`` (host int), or ``[bs, sq, H, d]``.
    k_cache ``[num_pages, page_size, H_kv, d]``, v_cache ``[num_pages, page_size, H_kv, d_v]`` (may be
    views of one latent buffer); page_table ``[bs, max_pages] int32`` page ids (entries past
    ``ceil(L_b / page_size)`` are never read); cache_seqlens ``[bs] int32`` = L_b (prefix + new).
    qv: like q with head dim d_v (absorbed MLA: score adds qv·v). softmax_scale defaults to
    ``(d + d_v if qv else d) ** -0.5``. window_size (left, right), -1 = unbounded. softcap > 0 caps
    scores after scaling. k/v/q_descale ``[bs, H_kv] float32`` dequantize an e4m3 cache / q.
    num_splits is a kernel hint (0 = heuristic), ignored by the reference. ``schedule``: FA3's tile schedule
    planned once for a step's calls (:func:`get_fa3_schedule`) instead of FA3's scheduler kernel in every call;
    refused (ValueError) unless planned for this very call (implementation, shape key, length tensors); the
    reference checks it the same way and computes as without it.
    Returns out (q's shape with d_v; q's dtype, bf16 for fp8 inputs), or (out, lse) — lse float32,
    natural log, ``out.shape[:-1]``.
    """
    chosen = resolve(impl, validate.device_of(q, "q"))
    args = validate.check_kvcache(
        q, k_cache, v_cache, qv=qv, page_table=page_table, cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, k_descale=k_descale,
        v_descale=v_descale, q_descale=q_descale, num_splits=num_splits, impl=chosen, schedule=schedule,
    )
    return _run_attention(chosen, "flash_attn_with_kvcache", args, return_lse)


def get_fa3_schedule(
    cache_seqlens: Tensor,
    page_table: Tensor,
    *,
    page_size: int,
    num_heads: int,
    num_heads_k: int,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    max_seqlen_q: int,
    cu_seqlens_q: Optional[Tensor] = None,
    causal: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    impl: Optional[ImplLike] = None,
) -> FA3Schedule:
    """Plan FA3's tile schedule once for the ``flash_attn_with_kvcache`` calls of one step (every layer).

    FA3 otherwise launches its scheduler kernel (per-request split counts from the live lengths) in every
    call. The arguments describe those calls: ``page_table`` (its width; FA3's paged max_seqlen_k is width x
    ``page_size``), q's heads / head dims / dtype, ``max_seqlen_q`` (q's dim 1 when batched) with
    ``cu_seqlens_q`` for varlen q, ``num_heads_k`` (1 for MLA's latent head), causal / window / softcap and
    ``num_splits`` as the calls pass them. One kernel reading ``cache_seqlens`` on the device (no host read):
    legal inside a CUDA graph. The reference returns an empty marker schedule with the same key.
    """
    chosen = resolve(impl, validate.device_of(cache_seqlens, "cache_seqlens"))
    key = validate.check_fa3_schedule_plan(
        cache_seqlens, page_table, cu_seqlens_q, page_size=page_size, num_heads=num_heads, num_heads_k=num_heads_k,
        head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype, max_seqlen_q=max_seqlen_q, causal=causal,
        window_size=window_size, softcap=softcap, num_splits=num_splits)
    meta = fa3.get_fa3_schedule(key, cache_seqlens, cu_seqlens_q) if chosen is Impl.FA3 else None
    ran(chosen)
    return FA3Schedule(impl=chosen, key=key, cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
                       scheduler_metadata=meta)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    impl: Optional[ImplLike] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Variable-length attention over contiguous K/V (FA3 ``flash_attn_varlen_func``).

    q ``[T_q, H, d]``, k ``[T_k, H_kv, d]``, v ``[T_k, H_kv, d_v]``; request b owns q rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and k/v rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (int32,
    ``[bs+1]``); causal is bottom-right aligned. softmax_scale defaults to ``d ** -0.5``.
    Returns out ``[T_q, H, d_v]``, or (out, lse ``[T_q, H]`` float32 natural log).
    """
    chosen = resolve(impl, validate.device_of(q, "q"))
    args = validate.check_varlen(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, impl=chosen,
    )
    return _run_attention(chosen, "flash_attn_varlen_func", args, return_lse)


def merge_state(
    o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor, impl: Optional[ImplLike] = None
) -> Tuple[Tensor, Tensor]:
    """Merge two partial attention states over disjoint key sets (natural-log LSEs).

    o_a, o_b ``[T, H, d]``; lse_a, lse_b ``[T, H]`` float32 natural log. Returns (o, lse) with
    ``lse = logaddexp(lse_a, lse_b)`` and ``o = o_a·e^(lse_a-lse) + o_b·e^(lse_b-lse)``; a row with both
    LSEs -inf gives o 0, lse -inf. o has o_a's dtype, lse is float32.
    """
    chosen = resolve(impl, validate.device_of(o_a, "o_a"))
    validate.check_merge(o_a, lse_a, o_b, lse_b, impl=chosen)
    backend = fa3 if chosen is Impl.FA3 else reference
    out = backend.merge_state(o_a, lse_a, o_b, lse_b)
    ran(chosen)
    return out


# ----------------------------------------------------------------------- validated once, run many times
# A plan that runs the same call shape in every layer (the chunked prefill) validates it once through the
# public checks (``prepare_*``) and runs the returned record per layer (``run_*``): the record fixes the
# implementation and every checked property; ``VarlenCall.with_q`` swaps in the layer's q after
# re-checking its shape, dtype, device and stride. Public callers keep the ops above.


def prepare_flash_attn_varlen(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              impl: Optional[ImplLike] = None) -> Tuple[Impl, VarlenCall]:
    """Validate a :func:`flash_attn_varlen_func` call (same checks, same errors) without running it."""
    chosen = resolve(impl, validate.device_of(q, "q"))
    return chosen, validate.check_varlen(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, impl=chosen)


def run_flash_attn_varlen(chosen: Impl, call: VarlenCall) -> Tuple[Tensor, Tensor]:
    """Run a call from :func:`prepare_flash_attn_varlen` -> (out, lse natural log): no re-validation."""
    if not isinstance(call, VarlenCall) or not isinstance(chosen, Impl):
        raise TypeError("call must be the (Impl, VarlenCall) of prepare_flash_attn_varlen")
    return _run_attention(chosen, "flash_attn_varlen_func", call, True)


def prepare_merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor,
                        impl: Optional[ImplLike] = None, *, a_nonempty: bool = False) -> MergeCall:
    """Validate a :func:`merge_state` signature (same checks, same errors) for :func:`run_merge_state`.

    a_nonempty: the caller guarantees that every row of state a has keys (finite ``lse_a``), so no row is
    empty on both sides; FA3 then skips its both-empty rewrite (four elementwise kernels). The reference
    is exact either way. A row of a that is empty under this promise gives NaN on FA3.
    """
    chosen = resolve(impl, validate.device_of(o_a, "o_a"))
    validate.check_merge(o_a, lse_a, o_b, lse_b, impl=chosen)
    return MergeCall(impl=chosen, o_shape=tuple(o_a.shape), dtype=o_a.dtype,
                     a_nonempty=chk.flag(a_nonempty, "a_nonempty"))


def run_merge_state(call: MergeCall, o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`merge_state` on tensors of a validated signature (their o shapes and dtype are re-checked)."""
    if o_a.shape != call.o_shape or o_b.shape != call.o_shape or o_a.dtype != call.dtype or o_b.dtype != call.dtype:
        raise ValueError(f"o_a / o_b must be {call.o_shape} {call.dtype} (the validated merge), got "
                         f"{tuple(o_a.shape)} {o_a.dtype} / {tuple(o_b.shape)} {o_b.dtype}")
    if call.impl is Impl.FA3:
        out = fa3.merge_state(o_a, lse_a, o_b, lse_b, a_nonempty=call.a_nonempty)
    else:
        out = reference.merge_state(o_a, lse_a, o_b, lse_b)
    ran(call.impl)
    return out


def get_mla_decode_metadata(
    cache_seqlens: Tensor, num_q_heads_per_kv: int, *, is_fp8: bool = False, impl: Optional[ImplLike] = None
) -> FlashMLASchedule:
    """Plan FlashMLA's tile schedule for one decode step (once per step, reused by every layer).

    cache_seqlens ``[bs] int32``; num_q_heads_per_kv = H · sq / H_kv (H · sq for MLA's single latent
    head). One kernel on the current stream reading ``cache_seqlens`` on the device (no host read), its
    outputs new tensors: legal inside a CUDA graph (it then allocates from the graph's pool), which is how
    ``MLABackend.graph_prologue`` re-plans each replay; or plan outside and ``FlashMLASchedule.copy_`` into
    the schedule captured with the graph. The reference returns an empty marker schedule.
    """
    chosen = resolve(impl, validate.device_of(cache_seqlens, "cache_seqlens"))
    validate.check_mla_metadata(cache_seqlens, num_q_heads_per_kv, is_fp8=is_fp8)
    if chosen is Impl.FA3:
        schedule = fa3.get_mla_decode_metadata(cache_seqlens, num_q_heads_per_kv, is_fp8=is_fp8)
    else:
        schedule = FlashMLASchedule(impl=Impl.REFERENCE, is_fp8=is_fp8)
    ran(chosen)
    return schedule


def flash_mla_with_kvcache(
    q: Tensor,
    kv_cache: Tensor,
    page_table: Tensor,
    cache_seqlens: Tensor,
    *,
    head_dim_v: int,
    schedule: FlashMLASchedule,
    softmax_scale: float,
    causal: bool,
    descale_q: Optional[Tensor] = None,
    descale_k: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    return_lse: bool = False,
    impl: Optional[ImplLike] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """FlashMLA dense decode over the 576-wide latent cache (one KV head, page 64 for FA3).

    q ``[bs, sq, H, D]`` (D = r + d_rope = 576: q_lat | q_rope), kv_cache ``[num_pages, page_size, 1, D]``
    (c_kv | k_rope), page_table ``[bs, max_pages] int32``, cache_seqlens ``[bs] int32``.
    score = scale · q·kv (all D), value = kv[..., :head_dim_v]. ``causal`` has no default (sgl-kernel's
    is False, ours was True: code ported either way must say which; bottom-right aligned when True,
    and it only matters for sq > 1). Other differences from sgl-kernel: docs/SGL_KERNEL_DIFFERENCES.md.
    FP8: e4m3 q and cache with descale_q / descale_k of shape (1,) float32 (schedule planned with
    is_fp8=True); output bf16. An e4m3 cache with a bf16 / fp16 / fp32 q (descale_k only) is the split-KV
    kernel's read (``splitkv_mla_with_kvcache``): the reference runs it, FlashMLA refuses it before any kernel. ``out_dtype`` (a float dtype) overrides the output dtype (FlashMLA's
    output is cast; the reference rounds its fp32 result once). Returns out ``[bs, sq, H, head_dim_v]``,
    or (out, lse ``[bs, sq, H]``).
    """
    chosen = resolve(impl, validate.device_of(q, "q"))
    args = validate.check_flash_mla(
        q, kv_cache, page_table, cache_seqlens, head_dim_v=head_dim_v, schedule=schedule,
        softmax_scale=softmax_scale, causal=causal, descale_q=descale_q, descale_k=descale_k,
        out_dtype=out_dtype, impl=chosen,
    )
    return _run_attention(chosen, "flash_mla_with_kvcache", args, return_lse)
