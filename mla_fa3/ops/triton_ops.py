"""The ops of our own Triton kernels: split-KV MLA decode, the fused FP8 quantization, the per-head matmul and the
page-table gather.

Same contract as the rest of ``mla_fa3.ops`` (validation before any launch, fixed returns, ``impl=``):
TRITON on CUDA — or on the CPU under ``TRITON_INTERPRET=1`` (tests) — else the torch REFERENCE; triton is
imported only by the kernel modules (``splitkv_kernel_triton.py``, ``splitkv_replan_triton.py``, ``fp8_triton.py``,
``head_matmul_triton.py``, ``page_table_triton.py``, ``tree_attention_triton.py`` — the last one's op is
``tree_attention.py``) and only when
available.
Re-exported by ``mla_fa3.ops``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional, Tuple, Union

import torch

from . import fp8, reference, splitkv_plan, splitkv_replan, validate, validate_fp8, validate_matmul
from .selection import ImplLike, coerce, get_impl, ran
from .splitkv_config import FUSED_PROJECTION_MAX_COLUMNS, FUSED_PROJECTION_MAX_TOKENS, KernelConfig
from .splitkv_plan import SplitKVSchedule
from .types import Impl, KernelUnavailableError

__all__ = ["get_splitkv_schedule", "replan_splitkv_schedule", "splitkv_available", "splitkv_mla_with_kvcache",
           "page_ids_kernel", "gather_page_ids",
           "fp8_fused_available", "store_e4m3", "store_rows", "quantize_query_e4m3", "absorb_query_e4m3",
           "head_matmul", "HEAD_MATMUL_MAX_ROWS"]

Tensor = torch.Tensor


# ------------------------------------------------------------------ split-KV decode (our Triton kernel)
# TRITON (``splitkv_triton.py``, the device planner ``splitkv_replan_triton.py``) on CUDA — or on CPU under
# TRITON_INTERPRET=1 (tests) — else REFERENCE (the FlashMLA reference). FA3 ("the compiled kernels",
# e.g. set_impl('fa3')) means TRITON here.


@functools.lru_cache(maxsize=None)
def _triton_module(which: str):
    """The Triton kernel module ``which`` ("splitkv" | "replan" | "fp8" | "matmul" | "tree" | "pages"), or why it
    does not import (str)."""
    try:
        if which == "splitkv":
            from . import splitkv_triton as module
        elif which == "replan":
            from . import splitkv_replan_triton as module
        elif which == "matmul":
            from . import head_matmul_triton as module
        elif which == "tree":
            from . import tree_attention_triton as module
        elif which == "pages":
            from . import page_table_triton as module
        else:
            from . import fp8_triton as module
    except Exception as exc:  # ImportError (no triton) or a broken triton install
        return f"{type(exc).__name__}: {exc}"
    return module


def _on(device: torch.device):
    """The context a Triton launch on ``device`` runs in. Triton launches on the *current* CUDA device (and its
    current stream), not on its tensors' device as torch's ops and the sgl-kernel wrappers do: a tensor on another
    GPU (layers spread over GPUs in one process) is made current for the launch. No-op on the CPU (the interpreter)
    and when ``device`` is current already."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _splitkv_kernels():
    """The split-KV kernel module, or why it does not import (str)."""
    return _triton_module("splitkv")


def _resolve_triton(impl: Optional[ImplLike], device: torch.device, kernels, what: str) -> Impl:
    """TRITON or REFERENCE for an op whose compiled form is the Triton module ``kernels`` (or why it is missing)."""
    chosen = get_impl() if impl is None else coerce(impl)
    chosen = Impl.TRITON if chosen is Impl.FA3 else chosen
    here = device.type == "cuda" and torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    usable = here and not isinstance(kernels, str)
    if chosen is Impl.AUTO:
        if not usable and device.type == "cuda":  # never a silent fall-back to the reference on a GPU
            raise KernelUnavailableError(f"{what} Triton kernel unavailable on {device}: {kernels}; "
                                         "pass impl='reference' to run the torch reference")
        return Impl.TRITON if usable else Impl.REFERENCE
    if chosen is Impl.TRITON and not usable:
        why = kernels if here else f"the tensors are on {device}, it needs a CUDA device"
        raise KernelUnavailableError(f"{what} Triton kernel unavailable: {why}; pass impl='reference'")
    return chosen


def _kernel_not_torch(chosen: Impl, device: torch.device, kernels, what: str) -> bool:
    """For an op whose torch path is exact and fast (``head_matmul``'s bmm, ``store_rows``' indexed assignment), not a
    slow reference: whether ``chosen`` runs its Triton kernel (``kernels``). TRITON: yes, a named error where it
    cannot; REFERENCE: no; AUTO / FA3: on CUDA where Triton imports (else the torch path, without an error)."""
    if chosen is Impl.TRITON:
        _resolve_triton(chosen, device, kernels, what)
        return True
    return chosen is not Impl.REFERENCE and device.type == "cuda" and not isinstance(kernels, str)


def _resolve_splitkv(impl: Optional[ImplLike], device: torch.device) -> Impl:
    return _resolve_triton(impl, device, _splitkv_kernels(), "split-KV")


def splitkv_available(device: Union[torch.device, str], impl: Optional[ImplLike] = None) -> bool:
    """Whether ``splitkv_mla_with_kvcache`` runs on ``device`` with ``impl`` (the Triton kernel, or the
    reference where that is the choice) — without raising. Host only."""
    try:
        _resolve_splitkv(impl, torch.device(device))
    except (KernelUnavailableError, ValueError):
        return False
    return True


def get_splitkv_schedule(
    seqlens, *, num_heads: int, num_q_tokens: int = 1, page_size: int, device: Union[str, torch.device] = "cpu",
    num_sms: Optional[int] = None, waves: Optional[float] = None, min_split_tokens: int = 128,
    max_batch: Optional[int] = None, config: Optional[KernelConfig] = None, kv_fp8: bool = False,
) -> SplitKVSchedule:
    """Plan the split-KV schedule of one decode step from the HOST lengths (``splitkv_plan.py``); no sync.

    seqlens: the host copy of cache_seqlens (CPU int tensor or ints; a CUDA tensor is refused).
    num_sms defaults to the SM count of ``device`` (of the current GPU for a host plan; 132 without CUDA). With ``max_batch`` the buffers fit
    any batch of <= max_batch requests planned with the same (num_heads, num_q_tokens, num_sms,
    waves). ``config``: the kernel's launch parameters (``KernelConfig``; None: the measured table's choice
    for (num_heads, len(seqlens), max(seqlens)); the e4m3 table's when ``kv_fp8``, the cache being
    ``float8_e4m3fn``) — the schedule carries it to the kernel; ``waves``
    overrides the config's. Not legal inside a CUDA graph: plan and ``SplitKVSchedule.copy_`` outside, then replay —
    or re-plan the captured schedule on the device with ``replan_splitkv_schedule`` (legal inside).
    """
    device = torch.device(device)
    if num_sms is None and torch.cuda.is_available():  # a host plan is for the current GPU
        num_sms = torch.cuda.get_device_properties(device if device.type == "cuda" else None).multi_processor_count
    return splitkv_plan.plan_schedule(
        seqlens, num_heads=num_heads, num_q_tokens=num_q_tokens, page_size=page_size, device=device,
        num_sms=num_sms, waves=waves, min_split_tokens=min_split_tokens, max_batch=max_batch, config=config,
        kv_fp8=kv_fp8,
    )


def replan_splitkv_schedule(cache_seqlens: Tensor, schedule: SplitKVSchedule, *,
                            impl: Optional[ImplLike] = None) -> SplitKVSchedule:
    """Re-plan ``schedule`` in place from the DEVICE lengths: the plan ``get_splitkv_schedule`` makes of the same
    lengths (same target, granule and shortest split: the ones ``schedule`` was planned with), written by the device.

    cache_seqlens ``[bs] int32`` on the schedule's device, bs <= ``schedule.max_batch``; the capacity must hold any
    plan of bs requests (a schedule from ``get_splitkv_schedule(..., max_batch=)``). No host value is read and nothing
    syncs: legal inside a CUDA graph, so a captured step plans its splits from the lengths it is replayed with.
    TRITON: one launch of one program; REFERENCE: fixed-shape tensor ops (``splitkv_replan.replan_reference``). The
    split count then lives on the device only (``planned_work`` / ``chunk`` become None). Returns ``schedule``.
    """
    splitkv_replan.check_replan(cache_seqlens, schedule)
    planner = _triton_module("replan")
    chosen = _resolve_triton(impl, schedule.device, planner, "split-KV planner")
    if chosen is Impl.TRITON:
        with _on(schedule.device):
            planner.replan_schedule(cache_seqlens, schedule)
    else:
        splitkv_replan.replan_reference(cache_seqlens, schedule)
    ran(chosen)
    return schedule


# ------------------------------------------------------------------ page ids from req_to_token
def page_ids_kernel(device: Union[torch.device, str], impl: Optional[ImplLike] = None) -> bool:
    """Whether ``gather_page_ids``' kernel is the page-table gather on ``device`` under ``impl`` (None: the global
    choice): AUTO / FA3 on CUDA where Triton imports, TRITON (a named error where it cannot run); REFERENCE and
    the CPU: no — the caller's four torch ops (``pages.gather_page_table``), the same values."""
    chosen = get_impl() if impl is None else coerce(impl)
    return _kernel_not_torch(chosen, torch.device(device), _triton_module("pages"), "page-table")


def gather_page_ids(req_to_token: Tensor, rows: Tensor, num_tokens: Tensor, page_size: int, out: Tensor) -> Tensor:
    """``out[b, j] = req_to_token[rows[b], j * page_size] // page_size`` where ``j * page_size < num_tokens[b]``, else
    0 (the padding page): the page table of requests whose regions start at column 0, in one launch (capturable, no
    host value read). A row outside ``req_to_token`` gets zeros (nothing read).

    req_to_token ``[R, W]`` int32 / int64 (last dim contiguous), rows ``[n]`` int32 / int64, num_tokens ``[n]``
    int32 / int64, out ``[n, max_pages]`` int32 (a view is fine: last dim contiguous) with ``(max_pages - 1) *
    page_size < W``; all on one device. The kernel only (on the CPU under TRITON_INTERPRET=1, in tests), a named
    error where it cannot run; ``page_ids_kernel`` says where it is the choice. Returns ``out``."""
    validate.check_page_ids(req_to_token, rows, num_tokens, page_size, out)
    kernels = _triton_module("pages")
    _resolve_triton(Impl.TRITON, out.device, kernels, "page-table")
    with _on(out.device):
        kernels.gather_page_ids(req_to_token, rows, num_tokens, page_size, out)
    return out


def splitkv_mla_with_kvcache(
    q: Tensor, kv_cache: Tensor, page_table: Tensor, cache_seqlens: Tensor, *, head_dim_v: int,
    schedule: SplitKVSchedule, softmax_scale: float, causal: bool = True, descale_q: Optional[Tensor] = None,
    descale_k: Optional[Tensor] = None, q_rope: Optional[Tensor] = None, w_uv: Optional[Tensor] = None,
    impl: Optional[ImplLike] = None, follows_store: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Split-KV MLA decode: the contract of ``flash_mla_with_kvcache`` for any power-of-two page size.

    q ``[bs, sq, H, D]`` (q_lat | q_rope), kv_cache ``[num_pages, page_size, 1, D]`` read in place,
    page_table ``[bs, max_pages] int32``, cache_seqlens ``[bs] int32``, schedule from
    ``get_splitkv_schedule`` planned from the same lengths (the kernel never reads past
    cache_seqlens; a request past the plan's batch gets out 0, lse -inf). FP8: e4m3 q and cache
    with descale_q / descale_k (1,) float32, output bf16; or an e4m3 cache with descale_k read by a
    bf16 / fp16 / fp32 q (no descale_q): the tile is converted in registers, q is not rounded to e4m3 (a
    bf16 q enters fp16 dots after an exact power-of-two rescale: see ``splitkv_triton.py``), the output has
    q's dtype. ``q_rope`` ``[bs, sq, H, D - head_dim_v]``: the query's rope part given apart (any
    strides with a contiguous last dim, e.g. a slice of the model's q); q then holds only the first
    ``head_dim_v`` columns — the kernel reads both where they lie, nothing is concatenated. Returns (out ``[bs, sq, H,
    head_dim_v]`` — ``[bs, sq, H, N]`` with ``w_uv`` — and lse ``[bs, sq, H]`` float32, **natural log**). TRITON
    never syncs: capturable.

    ``w_uv`` ``[H, head_dim_v, N]`` (the output's dtype, last dim contiguous): MLA's output projection applied
    too — out is then ``[bs, sq, H, N]`` = ``head_matmul(o_lat, w_uv)`` of the attention's o_lat (rounded to the
    output dtype; fp32 sums): ``head_matmul`` after the combine, or inside the combine with TRITON and the
    schedule's ``KernelConfig.fused_projection`` (up to ``FUSED_PROJECTION_MAX_TOKENS`` query tokens and
    ``FUSED_PROJECTION_MAX_COLUMNS`` columns; off by default: one launch less, measured slower).

    ``follows_store``: the caller's word that the launch just before this call on the stream is the store of the
    new latent rows into ``kv_cache`` (``store_rows`` / ``store_e4m3``), so that the kernel may read its prologue
    (schedule, lengths, page table, q: all written before the store began) while the store runs. Same results;
    TRITON on sm_90+ only (``splitkv_triton.splitkv_partials``).
    """
    chosen = _resolve_splitkv(impl, validate.device_of(q, "q"))
    call = validate.check_splitkv(
        q, kv_cache, page_table, cache_seqlens, head_dim_v=head_dim_v, schedule=schedule,
        softmax_scale=softmax_scale, causal=causal, descale_q=descale_q, descale_k=descale_k, impl=chosen,
        q_rope=q_rope,
    )
    if w_uv is not None:
        validate_matmul.check_output_projection(w_uv, q.shape[2], head_dim_v, call.out_dtype, q.device)
    bs, sq = q.shape[:2]
    fused = (w_uv is not None and chosen is Impl.TRITON and schedule.config.fused_projection
             and bs * sq <= FUSED_PROJECTION_MAX_TOKENS and w_uv.shape[2] <= FUSED_PROJECTION_MAX_COLUMNS)
    if chosen is Impl.TRITON:
        with _on(q.device):
            out, lse = _splitkv_kernels().splitkv_mla_with_kvcache(call, schedule, w_uv=w_uv if fused else None,
                                                                   follows_store=follows_store)
    else:
        out, lse = reference.flash_mla_with_kvcache(call)
    ran(chosen)
    if w_uv is not None and not fused:
        H = q.shape[2]
        out = head_matmul(out.view(bs * sq, H, head_dim_v), w_uv, impl=Impl.AUTO if chosen is Impl.TRITON else chosen)
        out = out.view(bs, sq, H, w_uv.shape[2])
    return out, lse


# ------------------------------------------------------------------ FP8 quantization (fused Triton kernels)
# TRITON (``fp8_triton.py``) on CUDA — or on CPU under TRITON_INTERPRET=1 (tests) — else REFERENCE
# (``fp8.py``, a few torch kernels, any device); FA3 means TRITON here, as for split-KV. Same results bit
# for bit. Neither syncs nor allocates outside torch's allocator: both can be captured in a CUDA graph.


def _fp8_kernels():
    """The fused FP8 kernel module, or why it does not import (str)."""
    return _triton_module("fp8")


def fp8_fused_available(device: Union[torch.device, str], impl: Optional[ImplLike] = None) -> bool:
    """Whether ``store_e4m3`` / ``quantize_query_e4m3`` run on ``device`` with ``impl`` (without raising). Host only.
    (``store_rows`` has a path wherever torch runs: see its docstring.)"""
    try:
        _resolve_triton(impl, torch.device(device), _fp8_kernels(), "FP8 quantization")
    except (KernelUnavailableError, ValueError):
        return False
    return True


def store_e4m3(out: Tensor, loc: Tensor, x: Tensor, scale: Tensor, *, rest: Optional[Tensor] = None,
               impl: Optional[ImplLike] = None) -> None:
    """Quantize rows and scatter them into an e4m3 cache: ``out[loc[t]] = e4m3(clamp(x[t] / scale, ±448))``.

    out ``[S, W]`` float8_e4m3fn (a view is fine: e.g. columns of a pool buffer; last dim contiguous),
    loc ``[T]`` int64/int32 on out's device (values are not checked: the caller's; TRITON skips a slot outside
    [0, S), REFERENCE raises IndexError), x ``[T, W]`` float
    (last dim contiguous), scale ``[1]`` float32 on the device. x / scale in fp32; NaN -> 0, ±inf and
    overflow -> ±448 (``fp8.quantize_e4m3``). ``rest`` ``[T, W - W1]`` (x then ``[T, W1]``, the same dtype): the
    row is ``[x | rest]`` — a latent row's c_kv and k_rope stored by one launch. TRITON: one launch; T = 0 writes
    nothing.
    """
    chosen = _resolve_triton(impl, validate.device_of(out, "out"), _fp8_kernels(), "FP8 quantization")
    validate_fp8.check_store_e4m3(out, loc, x, scale, rest)
    if chosen is Impl.TRITON:
        with _on(out.device):
            _fp8_kernels().store_e4m3(out, loc, x, scale, rest)
    elif x.shape[0]:
        out[loc] = fp8.quantize_e4m3(_whole_rows(x, rest), scale)
    ran(chosen)


def _whole_rows(x: Tensor, rest: Optional[Tensor]) -> Tensor:
    return x if rest is None else torch.cat([x, rest], dim=-1)


def store_rows(out: Tensor, loc: Tensor, x: Tensor, *, rest: Optional[Tensor] = None,
               impl: Optional[ImplLike] = None) -> None:
    """Scatter rows into a float cache: ``out[loc[t]] = x[t]`` cast to out's dtype (round to nearest even) — a float
    latent pool's store, as ``store_e4m3`` is an e4m3 pool's (its kernel, the quantization left out).

    out ``[S, W]`` float32 / float16 / bfloat16 (a view is fine: e.g. columns of a pool buffer; last dim contiguous),
    loc ``[T]`` int64/int32 on out's device, any stride (a column of a slot table: SGLang's EAGLE draft steps; values
    are not checked: the caller's; no two alike; the kernel skips a slot outside [0, S), the indexed assignment raises
    IndexError), x ``[T, W]`` float32 / float16 / bfloat16 (last
    dim contiguous); ``rest`` as ``store_e4m3``'s (the row ``[x | rest]``). TRITON: one launch, where torch's
    indexed assignment (the same bytes) costs 3-4 µs at decode sizes on an H100; T = 0 writes nothing. Capturable.

    AUTO / FA3: the kernel on CUDA, torch's indexed assignment elsewhere (TRITON_INTERPRET=1 included) or where
    Triton does not import — the exact path the kernel replaces, not a slow reference, so unlike ``store_e4m3``
    nothing raises there (as ``head_matmul``); TRITON: the kernel (on CPU only under TRITON_INTERPRET=1, in tests;
    a named error elsewhere — a global ``set_impl('triton')`` then refuses a CPU pool's store); REFERENCE: the indexed
    assignment. Not recorded by ``last_impl()`` (as ``head_matmul``).
    """
    chosen = get_impl() if impl is None else coerce(impl)
    kernel = _kernel_not_torch(chosen, validate.device_of(out, "out"), _fp8_kernels(), "the pool store")
    validate_fp8.check_store_rows(out, loc, x, rest)
    if kernel:
        with _on(out.device):
            _fp8_kernels().store_rows(out, loc, x, rest)
    elif x.shape[0]:
        out[loc] = _whole_rows(x, rest).to(out.dtype)


def quantize_query_e4m3(q_a: Tensor, q_b: Tensor, *, impl: Optional[ImplLike] = None) -> Tuple[Tensor, Tensor]:
    """Per-step dynamic e4m3 quantization of the query ``q = [q_a | q_b]`` given as its two parts.

    q_a ``[T, H, DA]``, q_b ``[T, H, DB]`` (same float dtype and device; any strides with a contiguous
    last dim, e.g. q_lat and a slice of the model's q). Returns (q8 ``[T, H, DA + DB]`` e4m3
    contiguous, descale ``[1]`` float32) with ``descale = max(absmax(q), 2^-100) / 448`` and
    ``q8 = e4m3(q / descale)`` (``fp8.quantize_e4m3_dynamic``; T = 0: descale 1). TRITON: two launches,
    and q is never concatenated in its own dtype.
    """
    chosen = _resolve_triton(impl, validate.device_of(q_a, "q_a"), _fp8_kernels(), "FP8 quantization")
    validate_fp8.check_quantize_query(q_a, q_b)
    if chosen is Impl.TRITON:
        with _on(q_a.device):
            out = _fp8_kernels().quantize_query_e4m3(q_a, q_b)
    else:
        out = fp8.quantize_e4m3_dynamic(torch.cat([q_a, q_b], dim=-1))
    ran(chosen)
    return out


def absorb_query_e4m3(q_nope: Tensor, w_uk: Tensor, q_rope: Tensor, *,
                      impl: Optional[ImplLike] = None) -> Tuple[Tensor, Tensor]:
    """The FP8 query of the absorbed step: ``q_lat = head_matmul(q_nope, w_uk)``, then ``quantize_query_e4m3(q_lat,
    q_rope)`` — the same result, in two launches instead of three where the per-head matmul runs in Triton: the
    absmax partials of q_lat and q_rope come out of the matmul's launch.

    q_nope ``[T, H, K]``, w_uk ``[H, K, R]``, q_rope ``[T, H, DB]`` (one float dtype and device, last dims
    contiguous). Returns (q8 ``[T, H, R + DB]`` e4m3 contiguous, descale ``[1]`` float32)."""
    validate_fp8.check_absorb_query(q_nope, w_uk, q_rope)
    if _head_matmul_in_triton(q_nope, impl):
        chosen = _resolve_triton(impl, q_nope.device, _fp8_kernels(), "FP8 quantization")
        with _on(q_nope.device):
            out = _fp8_kernels().absorb_query_e4m3(q_nope, w_uk, q_rope)
        ran(chosen)
        return out
    return quantize_query_e4m3(head_matmul(q_nope, w_uk, impl=impl), q_rope, impl=impl)


# ------------------------------------------------------------------ per-head matmul (MLA's two projections)
# AUTO and FA3 ("the compiled kernels"): the Triton kernel (``head_matmul_triton.py``) on CUDA for 1 <= T <=
# HEAD_MATMUL_MAX_ROWS, else ``torch.bmm`` over heads — cuBLAS on a GPU, the exact and fast path the kernel
# replaces at decode sizes, not a slow reference (so a Triton that does not import falls back to it). TRITON: the
# kernel, for 1..64 rows (its one tile; on CPU only under TRITON_INTERPRET=1, in tests). REFERENCE: bmm.


def _matmul_kernels():
    """The per-head matmul kernel module, or why it does not import (str)."""
    return _triton_module("matmul")


HEAD_MATMUL_MAX_ROWS = 16  # rows up to which AUTO / FA3 run the Triton kernel; H200, 128 heads: cuBLAS faster at 32


def _head_matmul_in_triton(x: Tensor, impl: Optional[ImplLike]) -> bool:
    """Whether ``head_matmul`` of ``x`` runs the Triton kernel; a named error where TRITON is asked for and cannot
    run (unavailable here, or more rows than the kernel's one tile)."""
    chosen = get_impl() if impl is None else coerce(impl)
    kernels = _matmul_kernels()
    if not _kernel_not_torch(chosen, x.device, kernels, "per-head matmul"):
        return False
    T = x.shape[0]
    if chosen is Impl.TRITON:
        if T > kernels.MAX_ROWS:
            raise ValueError(f"impl='triton': the per-head matmul kernel takes at most {kernels.MAX_ROWS} rows, got "
                             f"{T}; use impl='auto' (cuBLAS's bmm above {HEAD_MATMUL_MAX_ROWS} rows)")
        return T >= 1
    return 1 <= T <= HEAD_MATMUL_MAX_ROWS


def head_matmul(x: Tensor, w: Tensor, *, out: Optional[Tensor] = None, impl: Optional[ImplLike] = None) -> Tensor:
    """``out[t, h] = x[t, h] @ w[h]``: x ``[T, H, K]``, w ``[H, K, N]``, out ``[T, H, N]`` (given: written in place,
    any strides with a contiguous last dim, e.g. a slice of a wider buffer; else allocated contiguous). One float
    dtype and device; fp32 accumulation, rounded once to the dtype. MLA's absorption ``q_nope · W_UK`` and output
    projection ``o_lat · W_UVᵀ`` (``absorb.py``).

    AUTO / FA3: one Triton launch streaming w once on CUDA when 1 <= T <= ``HEAD_MATMUL_MAX_ROWS`` (decode batches),
    else ``torch.bmm`` (cuBLAS on a GPU); TRITON: the kernel for 1..64 rows; REFERENCE: bmm. Never syncs: capturable.
    Not recorded by ``last_impl()``, which keeps telling the step's attention kernel (the projection runs after it)."""
    validate_matmul.check_head_matmul(x, w, out)
    triton_kernel = _head_matmul_in_triton(x, impl)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
    if triton_kernel:
        with _on(x.device):
            _matmul_kernels().head_matmul(x, w, out)
    else:
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    return out
