"""Boundary checks of the kernel layer: run before any kernel, read only shapes, dtypes and devices.

Nothing here reads tensor values (no ``.item()``, no comparisons of CUDA data), so the checks cost
no device->host sync and are legal while a CUDA graph is being captured. Every error is a
``ValueError`` / ``TypeError`` whose message starts with the offending argument's name, e.g.
``ValueError("page_table must be int32, got torch.int64")``.

Each ``check_*`` validates one op for the implementation that will run it (FA3-only limits — dtypes,
head-dim families, fp8 with qv, FlashMLA's page 64 / 576 / 512 — apply only to ``Impl.FA3``) and
returns the frozen call record of ``calls.py``: the normalized arguments (resolved softmax scale,
batch size, varlen flag, output dtype) that ``fa3.py`` and ``reference.py`` consume. The primitive
checks live in ``_checks.py`` (used as ``chk.<name>``).
"""

from __future__ import annotations

import torch

from . import _checks as chk
from ._checks import (  # noqa: F401  (device_of is part of this module's interface)
    FA3_HALF_DTYPES,
    FA3_HINT,
    FA3_KVCACHE_DTYPES,
    FP8_DTYPES,
    MERGE_FA3_DTYPES,
    device_of,
)
from .calls import FlashMLACall, KVCacheCall, VarlenCall
from .types import (FLASHMLA_HEAD_DIM, FLASHMLA_HEAD_DIM_V, FLASHMLA_PAGE_SIZE, FA3Schedule, FA3ScheduleKey,
                    FlashMLASchedule, Impl)

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------ checks


def check_kvcache(
    q, k_cache, v_cache, *, qv, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, softmax_scale,
    causal, window_size, softcap, k_descale, v_descale, q_descale, num_splits, impl: Impl, schedule=None,
) -> KVCacheCall:
    """Validate ``flash_attn_with_kvcache`` arguments for implementation ``impl`` (FA3 or REFERENCE)."""
    for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        chk.tensor(x, name)
        chk.floating(x, name)
    device = q.device
    if q.dim() not in (3, 4):
        raise ValueError(
            f"q must be 3-D [total_q, H, d] (with cu_seqlens_q) or 4-D [bs, sq, H, d], got shape {tuple(q.shape)}"
        )
    chk.rank(k_cache, "k_cache", 4, "[num_pages, page_size, H_kv, d]")
    chk.rank(v_cache, "v_cache", 4, "[num_pages, page_size, H_kv, d_v]")
    chk.attention_operands(q, k_cache, v_cache, "k_cache", "v_cache", dtype_ref="k_cache")
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(
            f"v_cache must share k_cache's [num_pages, page_size, H_kv] = {tuple(k_cache.shape[:3])}, "
            f"got {tuple(v_cache.shape[:3])}"
        )
    H, d = q.shape[-2], q.shape[-1]
    h_kv, dv = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache head dim must equal q's head dim {d}, got {k_cache.shape[3]}")
    if h_kv == 0 or H % h_kv:
        raise ValueError(f"q heads must be a multiple of k_cache heads H_kv={h_kv}, got H={H}")
    bs, _ = chk.seqlens_and_table(page_table, cache_seqlens, device)
    varlen = q.dim() == 3
    if varlen:
        if cu_seqlens_q is None:
            raise ValueError(
                "cu_seqlens_q is required when q is 3-D [total_q, H, d]; pass q as [bs, sq, H, d] otherwise"
            )
        chk.index_tensor(cu_seqlens_q, "cu_seqlens_q", 1, "[bs + 1]", device)
        if cu_seqlens_q.shape[0] != bs + 1:
            raise ValueError(f"cu_seqlens_q must have bs + 1 = {bs + 1} entries, got {cu_seqlens_q.shape[0]}")
        if max_seqlen_q is None:
            raise ValueError(
                "max_seqlen_q is required with cu_seqlens_q (a host int: the longest request's new tokens)"
            )
        max_seqlen_q = chk.host_int(max_seqlen_q, "max_seqlen_q")
    else:
        if cu_seqlens_q is not None:
            raise ValueError("cu_seqlens_q must be None when q is 4-D [bs, sq, H, d] (batched queries)")
        if q.shape[0] != bs:
            raise ValueError(f"q batch dim must equal len(cache_seqlens) = {bs}, got {q.shape[0]}")
        if max_seqlen_q is not None:
            max_seqlen_q = chk.host_int(max_seqlen_q, "max_seqlen_q")
    if qv is not None:
        chk.tensor(qv, "qv")
        want = tuple(q.shape[:-1]) + (dv,)
        if tuple(qv.shape) != want:
            raise ValueError(f"qv must have shape {want} (q's shape with v_cache's head dim), got {tuple(qv.shape)}")
        chk.same_dtype(qv, "qv", q.dtype, "q")
        chk.same_device(qv, "qv", device, "q")
    scale = chk.scalar(softmax_scale, "softmax_scale", allow_none=True)
    if scale is None:
        scale = float(d + (dv if qv is not None else 0)) ** -0.5
    causal = chk.flag(causal, "causal")
    window = chk.window(window_size)
    cap = chk.softcap(softcap)
    num_splits = chk.host_int(num_splits, "num_splits")
    fp8 = k_cache.dtype in FP8_DTYPES
    k_descale = chk.descale(k_descale, "k_descale", (bs, h_kv), device)
    v_descale = chk.descale(v_descale, "v_descale", (bs, h_kv), device)
    q_descale = chk.descale(q_descale, "q_descale", (bs, h_kv), device)
    chk.descales_fit(
        k_cache.dtype,
        required=((k_descale, "k_descale"), (v_descale, "v_descale")),
        optional=((q_descale, "q_descale"),),
    )
    if impl is Impl.FA3:
        if q.dtype not in FA3_KVCACHE_DTYPES:
            raise ValueError(
                f"q dtype {q.dtype} is not supported by FA3 (needs float16, bfloat16 or float8_e4m3fn){FA3_HINT}"
            )
        if fp8 and qv is not None:
            raise ValueError(
                f"qv is not supported by FA3 with a {k_cache.dtype} cache (HeaddimV > 256 requires fp16/bf16); "
                "use FlashMLA (flash_mla_with_kvcache) for an fp8 latent cache, or impl='reference'"
            )
        chk.fa3_head_dims(d, dv, q.dtype, qv is not None)
        for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (qv, "qv"), (page_table, "page_table")):
            if x is not None:
                chk.last_dim_contiguous(x, name)
    if schedule is not None:
        key = FA3ScheduleKey(
            batch_size=bs, max_seqlen_q=max_seqlen_q if varlen else q.shape[1], varlen=varlen,
            page_table_width=page_table.shape[1], page_size=k_cache.shape[1], num_heads=H, num_heads_k=h_kv,
            head_dim=d, head_dim_v=dv, dtype=q.dtype, causal=causal, window_size=window, softcap=cap > 0,
            num_splits=num_splits)
        _check_fa3_schedule(schedule, key, cache_seqlens, cu_seqlens_q, impl)
    return KVCacheCall(
        q=q, k_cache=k_cache, v_cache=v_cache, qv=qv, page_table=page_table, cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=scale, causal=causal,
        window_size=window, softcap=cap, k_descale=k_descale, v_descale=v_descale, q_descale=q_descale,
        num_splits=num_splits, batch_size=bs, varlen=varlen, out_dtype=chk.out_dtype(q.dtype),
        scheduler_metadata=None if schedule is None else schedule.scheduler_metadata,
    )


def _check_fa3_schedule(schedule, key: FA3ScheduleKey, cache_seqlens, cu_seqlens_q, impl: Impl) -> None:
    """``schedule`` was planned for exactly this call: its implementation, key and length tensors."""
    if not isinstance(schedule, FA3Schedule):
        raise TypeError(f"schedule must be an FA3Schedule (from get_fa3_schedule), got {type(schedule).__name__}")
    if schedule.impl is not impl:
        raise ValueError(f"schedule was planned by {schedule.impl.value}, but this call runs {impl.value}")
    if schedule.key != key:
        diff = [f"{name}={getattr(key, name)!r} (schedule: {getattr(schedule.key, name)!r})"
                for name in FA3ScheduleKey._fields if getattr(key, name) != getattr(schedule.key, name)]
        raise ValueError("schedule was planned for another call: " + ", ".join(diff))
    for name, got, planned in (("cache_seqlens", cache_seqlens, schedule.cache_seqlens),
                               ("cu_seqlens_q", cu_seqlens_q, schedule.cu_seqlens_q)):
        if (got is None) != (planned is None) or (got is not None and got.data_ptr() != planned.data_ptr()):
            raise ValueError(f"{name} is not the tensor the schedule was planned from: a schedule is read with "
                             "the lengths it was planned for (plan it again for these)")


def check_fa3_schedule_plan(cache_seqlens, page_table, cu_seqlens_q, *, page_size, num_heads, num_heads_k, head_dim,
                            head_dim_v, dtype, max_seqlen_q, causal, window_size, softcap, num_splits) -> FA3ScheduleKey:
    """Validate ``get_fa3_schedule`` arguments; the key of the calls the schedule will serve."""
    device = device_of(cache_seqlens, "cache_seqlens")
    bs, width = chk.seqlens_and_table(page_table, cache_seqlens, device)
    if cu_seqlens_q is not None:
        chk.index_tensor(cu_seqlens_q, "cu_seqlens_q", 1, "[bs + 1]", device)
        if cu_seqlens_q.shape[0] != bs + 1:
            raise ValueError(f"cu_seqlens_q must have bs + 1 = {bs + 1} entries, got {cu_seqlens_q.shape[0]}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (q's), got {dtype!r}")
    return FA3ScheduleKey(
        batch_size=bs, max_seqlen_q=chk.host_int(max_seqlen_q, "max_seqlen_q", minimum=1),
        varlen=cu_seqlens_q is not None, page_table_width=width,
        page_size=chk.host_int(page_size, "page_size", minimum=1),
        num_heads=chk.host_int(num_heads, "num_heads", minimum=1),
        num_heads_k=chk.host_int(num_heads_k, "num_heads_k", minimum=1),
        head_dim=chk.host_int(head_dim, "head_dim", minimum=1), head_dim_v=chk.host_int(head_dim_v, "head_dim_v", minimum=1),
        dtype=dtype, causal=chk.flag(causal, "causal"), window_size=chk.window(window_size),
        softcap=chk.softcap(softcap) > 0, num_splits=chk.host_int(num_splits, "num_splits"))


def check_varlen(
    q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
    softcap, impl: Impl,
) -> VarlenCall:
    """Validate ``flash_attn_varlen_func`` arguments for implementation ``impl``."""
    for x, name, layout in ((q, "q", "[T_q, H, d]"), (k, "k", "[T_k, H_kv, d]"), (v, "v", "[T_k, H_kv, d_v]")):
        chk.tensor(x, name)
        chk.floating(x, name)
        chk.rank(x, name, 3, layout)
    device = q.device
    chk.attention_operands(q, k, v, "k", "v", dtype_ref="q")
    H, d = q.shape[1], q.shape[2]
    if k.shape[2] != d:
        raise ValueError(f"k head dim must equal q's head dim {d}, got {k.shape[2]}")
    if tuple(v.shape[:2]) != tuple(k.shape[:2]):
        raise ValueError(f"v must share k's [T_k, H_kv] = {tuple(k.shape[:2])}, got {tuple(v.shape[:2])}")
    h_kv = k.shape[1]
    if h_kv == 0 or H % h_kv:
        raise ValueError(f"q heads must be a multiple of k heads H_kv={h_kv}, got H={H}")
    for x, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        chk.index_tensor(x, name, 1, "[bs + 1]", device)
        if x.shape[0] < 1:
            raise ValueError(f"{name} must have bs + 1 >= 1 entries, got 0")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k must have as many entries as cu_seqlens_q ({cu_seqlens_q.shape[0]}), "
            f"got {cu_seqlens_k.shape[0]}"
        )
    max_seqlen_q = chk.host_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = chk.host_int(max_seqlen_k, "max_seqlen_k")
    scale = chk.scalar(softmax_scale, "softmax_scale", allow_none=True)
    if scale is None:
        scale = float(d) ** -0.5
    causal = chk.flag(causal, "causal")
    window = chk.window(window_size)
    cap = chk.softcap(softcap)
    if impl is Impl.FA3:
        if q.dtype not in FA3_HALF_DTYPES:
            raise ValueError(f"q dtype {q.dtype} is not supported by FA3 varlen (needs float16 or bfloat16){FA3_HINT}")
        chk.fa3_head_dims(d, v.shape[2], q.dtype, False)
        for x, name in ((q, "q"), (k, "k"), (v, "v")):
            chk.last_dim_contiguous(x, name)
    return VarlenCall(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal, window_size=window, softcap=cap,
        batch_size=cu_seqlens_q.shape[0] - 1, out_dtype=chk.out_dtype(q.dtype),
    )


def check_merge(o_a, lse_a, o_b, lse_b, *, impl: Impl) -> None:
    """Validate ``merge_state`` arguments: o_* ``[T, H, d]`` same shape/dtype, lse_* ``[T, H]`` float32."""
    for x, name in ((o_a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b")):
        chk.tensor(x, name)
    device = o_a.device
    chk.rank(o_a, "o_a", 3, "[T, H, d]")
    chk.floating(o_a, "o_a")
    if tuple(o_b.shape) != tuple(o_a.shape):
        raise ValueError(f"o_b must have o_a's shape {tuple(o_a.shape)}, got {tuple(o_b.shape)}")
    chk.same_dtype(o_b, "o_b", o_a.dtype, "o_a")
    want = tuple(o_a.shape[:2])
    for x, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape [T, H] = {want}, got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (natural-log LSE), got {x.dtype}")
    for x, name in ((lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b")):
        chk.same_device(x, name, device, "o_a")
    if impl is Impl.FA3:
        if o_a.dtype not in MERGE_FA3_DTYPES:
            raise ValueError(
                f"o_a dtype {o_a.dtype} is not supported by merge_state_v2 (float32/float16/bfloat16){FA3_HINT}"
            )
        pack = 16 // o_a.element_size()
        if o_a.shape[2] % pack:
            raise ValueError(
                f"o_a head dim must be a multiple of {pack} for merge_state_v2, got {o_a.shape[2]}{FA3_HINT}"
            )


def check_mla_metadata(cache_seqlens, num_q_heads_per_kv, *, is_fp8) -> None:
    """Validate ``get_mla_decode_metadata`` arguments."""
    chk.index_tensor(cache_seqlens, "cache_seqlens", 1, "[bs]", device_of(cache_seqlens, "cache_seqlens"))
    chk.host_int(num_q_heads_per_kv, "num_q_heads_per_kv", minimum=1)
    chk.flag(is_fp8, "is_fp8")


def check_flash_mla(
    q, kv_cache, page_table, cache_seqlens, *, head_dim_v, schedule, softmax_scale, causal, descale_q, descale_k,
    impl: Impl, out_dtype=None, q_rope=None,
) -> FlashMLACall:
    """Validate ``flash_mla_with_kvcache`` arguments for implementation ``impl``.

    ``q_rope`` (the split-KV op only): the query's rope part given apart, ``[bs, sq, H, D - head_dim_v]``; q then
    holds the first ``head_dim_v`` columns. Not with an e4m3 q, nor for FlashMLA (it reads q whole)."""
    for x, name in ((q, "q"), (kv_cache, "kv_cache")):
        chk.tensor(x, name)
        chk.floating(x, name)
    device = q.device
    chk.rank(q, "q", 4, "[bs, sq, H, D]" if q_rope is None else "[bs, sq, H, head_dim_v]")
    chk.rank(kv_cache, "kv_cache", 4, "[num_pages, page_size, 1, D]")
    chk.same_device(kv_cache, "kv_cache", device, "q")
    # an e4m3 cache is read either with an e4m3 q (FlashMLA's FP8 decode: descale_q and descale_k) or with q in
    # its own float dtype (the split-KV kernel dequantizes the cache in registers: descale_k only)
    kv_fp8 = kv_cache.dtype in FP8_DTYPES
    q_fp8 = q.dtype in FP8_DTYPES
    if not (kv_fp8 and not q_fp8):
        chk.same_dtype(kv_cache, "kv_cache", q.dtype, "q")
    D = q.shape[3]
    if q_rope is not None:
        chk.tensor(q_rope, "q_rope")
        chk.rank(q_rope, "q_rope", 4, "[bs, sq, H, D - head_dim_v]")
        chk.same_device(q_rope, "q_rope", device, "q")
        chk.same_dtype(q_rope, "q_rope", q.dtype, "q")
        if q.dtype in FP8_DTYPES:
            raise ValueError(f"q_rope must be None with a {q.dtype} q (an e4m3 query is given whole)")
        if tuple(q_rope.shape[:3]) != tuple(q.shape[:3]):
            raise ValueError(f"q_rope must be [bs, sq, H, *] = {tuple(q.shape[:3])} like q, got {tuple(q_rope.shape)}")
        if q.shape[3] != head_dim_v:
            raise ValueError(f"q must hold head_dim_v = {head_dim_v} columns when q_rope is given apart, got "
                             f"{q.shape[3]}")
        D = q.shape[3] + q_rope.shape[3]
    if kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache must have one (latent) KV head, got {kv_cache.shape[2]}")
    if kv_cache.shape[3] != D:
        raise ValueError(f"kv_cache head dim must equal q's head dim {D}, got {kv_cache.shape[3]}")
    head_dim_v = chk.host_int(head_dim_v, "head_dim_v", minimum=1)
    if head_dim_v > D:
        raise ValueError(f"head_dim_v must be <= q's head dim {D}, got {head_dim_v}")
    bs, _ = chk.seqlens_and_table(page_table, cache_seqlens, device)
    if q.shape[0] != bs:
        raise ValueError(f"q batch dim must equal len(cache_seqlens) = {bs}, got {q.shape[0]}")
    if not isinstance(schedule, FlashMLASchedule):
        raise TypeError(
            f"schedule must be a FlashMLASchedule (from get_mla_decode_metadata), got {type(schedule).__name__}"
        )
    scale = chk.scalar(softmax_scale, "softmax_scale")
    causal = chk.flag(causal, "causal")
    fp8 = q_fp8
    descale_q = chk.descale(descale_q, "descale_q", (1,), device)
    descale_k = chk.descale(descale_k, "descale_k", (1,), device)
    if kv_fp8 and not q_fp8:
        if kv_cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} with a {q.dtype} q: only a float8_e4m3fn cache is read "
                             "with q in its own dtype")
        if descale_k is None:
            raise ValueError(f"descale_k is required with a {kv_cache.dtype} kv_cache (pass ones for unit scale)")
        if descale_q is not None:
            raise ValueError(f"descale_q is only valid with a float8 q, got {q.dtype} (the e4m3 cache's scale is "
                             "descale_k)")
    else:
        chk.descales_fit(q.dtype, required=((descale_q, "descale_q"), (descale_k, "descale_k")), optional=())
    if schedule.is_fp8 != fp8:
        raise ValueError(f"schedule was planned with is_fp8={schedule.is_fp8} but q is {q.dtype}")
    if out_dtype is not None and out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}")
    if impl is Impl.FA3:
        if q_rope is not None:
            raise ValueError("q_rope must be None for FlashMLA, which reads q whole ([bs, sq, H, D])")
        if kv_fp8 and not q_fp8:
            raise ValueError(f"kv_cache is {kv_cache.dtype} but q is {q.dtype}: FlashMLA's FP8 decode reads an e4m3 "
                             "cache with an e4m3 q only (ops.quantize_query_e4m3); the split-KV kernel "
                             f"(ops.splitkv_mla_with_kvcache) reads it with q in its own dtype{FA3_HINT}")
        if schedule.impl is not Impl.FA3 or schedule.tile_scheduler_metadata is None:
            raise ValueError("schedule was planned by the reference; plan it with impl='fa3' for FlashMLA")
        if q.dtype not in FA3_HALF_DTYPES + (torch.float8_e4m3fn,):
            raise ValueError(f"q dtype {q.dtype} is not supported by FlashMLA (bf16, fp16 or float8_e4m3fn){FA3_HINT}")
        if kv_cache.shape[1] != FLASHMLA_PAGE_SIZE:
            raise ValueError(
                f"kv_cache page size must be {FLASHMLA_PAGE_SIZE} for FlashMLA, got {kv_cache.shape[1]}{FA3_HINT}"
            )
        if D != FLASHMLA_HEAD_DIM or head_dim_v != FLASHMLA_HEAD_DIM_V:
            raise ValueError(
                f"head_dim_v / q head dim must be {FLASHMLA_HEAD_DIM_V} / {FLASHMLA_HEAD_DIM} for FlashMLA, "
                f"got {head_dim_v} / {D}{FA3_HINT}"
            )
        for x, name in ((q, "q"), (kv_cache, "kv_cache"), (page_table, "page_table")):
            chk.last_dim_contiguous(x, name)
    return FlashMLACall(
        q=q, kv_cache=kv_cache, page_table=page_table, cache_seqlens=cache_seqlens, head_dim_v=head_dim_v,
        schedule=schedule, softmax_scale=scale, causal=causal, descale_q=descale_q, descale_k=descale_k,
        is_fp8=fp8, kv_fp8=kv_fp8, out_dtype=chk.out_dtype(q.dtype) if out_dtype is None else out_dtype,
        q_rope=q_rope,
    )


SPLITKV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def check_splitkv(
    q, kv_cache, page_table, cache_seqlens, *, head_dim_v, schedule, softmax_scale, causal, descale_q, descale_k,
    impl: Impl, q_rope=None,
) -> FlashMLACall:
    """Validate ``splitkv_mla_with_kvcache``: the FlashMLA contract (any page size) plus the schedule's fit."""
    from .splitkv_plan import SplitKVSchedule

    if not isinstance(schedule, SplitKVSchedule):
        raise TypeError(
            f"schedule must be a SplitKVSchedule (from get_splitkv_schedule), got {type(schedule).__name__}"
        )
    marker = FlashMLASchedule(impl=Impl.REFERENCE, is_fp8=getattr(q, "dtype", None) in FP8_DTYPES)
    call = check_flash_mla(
        q, kv_cache, page_table, cache_seqlens, head_dim_v=head_dim_v, schedule=marker,
        softmax_scale=softmax_scale, causal=causal, descale_q=descale_q, descale_k=descale_k, impl=Impl.REFERENCE,
        q_rope=q_rope,
    )
    if impl is Impl.TRITON:
        if q.dtype not in SPLITKV_DTYPES:
            raise ValueError(f"q dtype {q.dtype} is not supported by the split-KV kernel (bf16, fp16, fp32, e4m3)")
        if head_dim_v == kv_cache.shape[3]:
            raise ValueError(f"head_dim_v must be < q's head dim {kv_cache.shape[3]} for the split-KV kernel (rope part)")
        for x, name in ((q, "q"), (q_rope, "q_rope"), (kv_cache, "kv_cache"), (page_table, "page_table")):
            if x is not None:
                chk.last_dim_contiguous(x, name)
        if schedule.device != q.device:
            raise ValueError(f"schedule must be on q's device {q.device}, got {schedule.device}")
        if q.shape[0] > schedule.max_batch:
            raise ValueError(f"schedule holds at most max_batch={schedule.max_batch} requests, q has {q.shape[0]}")
    return call


def check_page_ids(req_to_token, rows, num_tokens, page_size, out) -> None:
    """Validate ``gather_page_ids``: req_to_token [R, W], rows / num_tokens [n] (int32 / int64), out [n, max_pages]
    int32 with (max_pages - 1) * page_size < W, one device, last dims contiguous; page_size a positive int."""
    device = chk.device_of(out, "out")
    chk.rank(out, "out", 2, "[n, max_pages]")
    chk.int32(out, "out")
    p = chk.host_int(page_size, "page_size", minimum=1)
    for x, name, ndim, layout in ((req_to_token, "req_to_token", 2, "[R, W]"), (rows, "rows", 1, "[n]"),
                                  (num_tokens, "num_tokens", 1, "[n]")):
        chk.tensor(x, name)
        chk.rank(x, name, ndim, layout)
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
        chk.same_device(x, name, device, "out")
    for x, name in ((rows, "rows"), (num_tokens, "num_tokens")):
        if x.shape[0] != out.shape[0]:
            raise ValueError(f"{name} must have out's {out.shape[0]} rows, got {x.shape[0]}")
    for x, name in ((req_to_token, "req_to_token"), (out, "out"), (rows, "rows"), (num_tokens, "num_tokens")):
        chk.last_dim_contiguous(x, name, kernel="the page-table")  # rows / num_tokens: read as unit-stride vectors
    if out.shape[1] and (out.shape[1] - 1) * p >= req_to_token.shape[1]:
        raise ValueError(f"out's {out.shape[1]} pages of {p} reach past req_to_token's {req_to_token.shape[1]} "
                         "columns")
