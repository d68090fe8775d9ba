"""The warp-specialized absorbed-MLA decode in Triton's Gluon (issue 40), host side: the op (``gluon_mla_decode``),
its phase 1 on a checked call (``gluon_partials``, what split-KV's ``KernelConfig.warp_specialized`` launches) and
the compilation for sm_90a without a GPU (``compile_for_hopper``, read by the compile tests). The kernel, its
algorithm and its shared-memory budget: ``gluon_decode_kernel.py``; measurements: docs/DECODE_KERNEL.md.

Imported lazily by its users: a CPU install without triton never imports it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_decode_kernel import (CW, NUM_WARPS, PRODUCER_REGS, STAGES, STAGES_FP8, STAGES_FP8_REG,
                                  gluon_mla_decode_kernel)
from .pdl import launch_options, pdl_capable
from .splitkv_combine_triton import combine_splits
from .splitkv_plan import SplitKVSchedule
from .validate_gluon import HEADS, LATENT, PAGE, ROPE, check_supported

Tensor = torch.Tensor
LOG2E = 1.4426950408889634
# the e4m3 read's default variant by query rows (bs x sq): reg_a from 16, the staged tile below. H100, 16 heads, kernel
# alone (docs/perf/2026-12-07/h100-run3/call3_gluon_bench_fp8.txt): reg_a takes 0.88-0.97x the staged read's time at
# bs 16-64 x 16k-64k (its 5-stage ring streams long splits better), 1.24-1.39x at bs 1-4 x 16k and bs 1 x 64k (short
# splits: the conversion in the A registers sits on each step's critical path), 1.00x at bs 4 x 64k
FP8_REG_A_MIN_ROWS = 16


def _kv_layout(kv8: bool = False):
    """The ring's shared layout: one [64 keys, 64 columns] box (TMA writes it). bf16: 128 bytes a row, 128-byte
    swizzle (wgmma reads it); e4m3: 64 bytes a row, 64-byte swizzle (the consumer converts it to bf16)."""
    return gl.NVMMASharedLayout.get_default_for([PAGE, CW], gl.float8e4nv if kv8 else gl.bfloat16)


def _constexprs(num_heads: int = HEADS, kv8: bool = False, pdl: bool = False, sq: int = 1,
                reg_a: bool = False, wait: bool = False) -> dict:
    if reg_a and not kv8:
        raise ValueError("reg_a is the e4m3 cache's read (a bf16 tile goes to wgmma from shared memory)")
    stages = (STAGES_FP8_REG if reg_a else STAGES_FP8) if kv8 else STAGES
    return dict(H=num_heads, SQ=sq, R=LATENT, DR=ROPE, NSTAGES=stages, PRODUCER_NREG=PRODUCER_REGS, KV8=kv8,
                REG_A=reg_a, PDL=pdl, WAIT=wait)


def compile_for_hopper(capability: int = 90, kv8: bool = False, pdl: bool = False, half: bool = False,
                       sq: int = 1, reg_a: bool = False, wait: bool = False):
    """Compile the kernel (``kv8``: the e4m3-cache variant; ``pdl``: it lets its dependents launch; ``half``: bf16
    partial outputs; ``sq``: query tokens per request; ``wait``: launched as a programmatic dependent of the pool
    store, its producer waits for it before the first TMA) for ``GPUTarget("cuda", capability, 32)`` without a
    GPU -> triton's CompiledKernel (``.asm['ttgir' | 'ptx' | 'cubin']``, ``.n_regs`` / ``.n_spills`` where this
    triton fills them in)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    desc = f"tensordesc<{'fp8e4nv' if kv8 else 'bf16'}[{PAGE}, {CW}],{_kv_layout(kv8)!r}>"
    sig = dict(kv_desc=desc, Q="*bf16", QR="*bf16", PageTable="*i32", SeqLens="*i32", Work="*i32", NumWork="*i32",
               PartO="*bf16" if half else "*fp32", PartLse2="*fp32", DescaleK="*fp32")
    for name in ("stride_qb", "stride_qs", "stride_qh", "stride_qrb", "stride_qrs", "stride_qrh", "stride_ptb",
                 "max_pages", "stride_ow", "stride_os", "stride_oh", "stride_lw", "stride_ls"):
        sig[name] = "i32"
    sig["scale_log2"] = "fp32"
    consts = _constexprs(kv8=kv8, pdl=pdl, sq=sq, reg_a=reg_a, wait=wait)
    sig.update({k: "constexpr" for k in consts})
    src = GluonASTSource(fn=gluon_mla_decode_kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=NUM_WARPS))


def gluon_partials(call, schedule: SplitKVSchedule, *, pdl: bool = False, half: bool = False,
                   reg_a: Optional[bool] = None, follows_store: bool = False) -> Tuple[Tensor, Tensor]:
    """Phase 1 on a call ``check_supported`` passed -> (part_o [capacity, sq, H, r] float32 — bf16 with ``half``:
    half the workspace traffic, one more rounding per split —, part_lse2 [capacity, sq, H] float32, base 2): the
    workspace ``combine_splits`` reads (slot s: split s's normalized output and LSE).
    ``pdl``: each program signals ``griddepcontrol.launch_dependents`` once its key loop is done, so that a combine
    launched next with ``pdl=True`` starts early (it waits for this whole grid before reading the partials).

    An e4m3 cache (``call.kv_fp8``): ``call.descale_k`` is folded into the scores here; the partial outputs are NOT
    scaled by it — the combine applies it (``combine_splits(..., call.descale_k)``, as split-KV's launch does).
    ``reg_a`` (e4m3 only; None: from ``FP8_REG_A_MIN_ROWS`` query rows on): the tile converted in wgmma's A
    registers instead of staged as fp16 in shared memory. ``follows_store`` (with ``pdl``; the caller's word, as
    ``splitkv_triton.splitkv_partials``'): the launch just before is the pool store of the rows this call reads, which
    lets its dependents launch at its start; the kernel is then launched as one, and its producer waits for the store
    before the first TMA while the prologue (schedule row, length, page ids, q) runs beside it."""
    q, kv = call.q, call.kv_cache
    kv8 = bool(call.kv_fp8)
    if reg_a is None:
        reg_a = q.shape[0] * q.shape[1] >= FP8_REG_A_MIN_ROWS
    reg_a = kv8 and bool(reg_a)
    q_rope = q[..., LATENT:] if call.q_rope is None else call.q_rope
    sq, H, cap = q.shape[1], q.shape[2], schedule.capacity
    part_o = torch.empty(cap, sq, H, LATENT, dtype=torch.bfloat16 if half else torch.float32, device=q.device)
    part_lse2 = torch.empty(cap, sq, H, dtype=torch.float32, device=q.device)
    rows = kv.view(kv.shape[0] * PAGE, LATENT + ROPE)
    desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [PAGE, CW], _kv_layout(kv8))
    with torch.cuda.device(q.device):  # triton launches on the current device
        gluon_mla_decode_kernel[(cap,)](
            desc, q, q_rope, call.page_table, call.cache_seqlens, schedule.work, schedule.num_work, part_o, part_lse2,
            call.descale_k if kv8 else part_lse2,  # any float32 pointer: read only with an e4m3 cache
            q.stride(0), q.stride(1), q.stride(2), q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
            call.page_table.stride(0), call.page_table.shape[1],
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse2.stride(0), part_lse2.stride(1),
            call.softmax_scale * LOG2E, **_constexprs(H, kv8, pdl, sq, reg_a, wait=pdl and follows_store),
            num_warps=NUM_WARPS, **launch_options(pdl and follows_store),
        )
    return part_o, part_lse2


def gluon_mla_decode(q: Tensor, kv_cache: Tensor, page_table: Tensor, cache_seqlens: Tensor, *,
                     schedule: SplitKVSchedule, softmax_scale: float, q_rope: Optional[Tensor] = None,
                     head_dim_v: int = LATENT, descale_k: Optional[Tensor] = None,
                     half_partials: bool = False, reg_a: Optional[bool] = None) -> Tuple[Tensor, Tensor]:
    """The decode step of ``ops.splitkv_mla_with_kvcache`` for this kernel's shapes -> (out [bs, sq, 16, 512]
    bf16, lse [bs, sq, 16] float32, natural log; a row without keys: 0, -inf). sq = 2: causal, bottom-right (token
    j of a request of L keys sees the first L - 1 + j), bf16 cache only.

    q ``[bs, sq, 16, 576]`` bf16 (q_lat | q_rope), or q ``[bs, sq, 16, 512]`` with ``q_rope [bs, sq, 16, 64]`` apart
    (any strides, contiguous last dims); kv_cache ``[num_pages, 64, 1, 576]`` bf16 contiguous, read in place;
    page_table ``[bs, max_pages] int32``; cache_seqlens ``[bs] int32``; ``schedule`` from
    ``ops.get_splitkv_schedule`` (page_size 64) planned from the same lengths. Phase 1 here, then our combine (two
    launches, no sync; the tensor descriptor is built on the host per call). Anything else: a ValueError first.

    kv_cache may be ``torch.float8_e4m3fn`` with ``descale_k [1] float32`` (its per-tensor scale; required then),
    read with the bf16 q (q never rounded to e4m3): phase 1 folds descale_k into the scores, the combine into the
    output — once each, as ``ops.splitkv_mla_with_kvcache`` does. ``half_partials``: the partial outputs in bf16
    (``KernelConfig.half_partials``). ``reg_a``: the e4m3 read's variant (``gluon_partials``)."""
    call = check_supported(q, kv_cache, page_table, cache_seqlens, schedule=schedule, softmax_scale=softmax_scale,
                           q_rope=q_rope, head_dim_v=head_dim_v, descale_k=descale_k)
    bs, sq, H = q.shape[:3]
    out = torch.empty(bs, sq, H, LATENT, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(bs, sq, H, dtype=torch.float32, device=q.device)
    if bs == 0:
        return out, lse
    pdl = pdl_capable(q.device)
    part_o, part_lse2 = gluon_partials(call, schedule, pdl=pdl, half=half_partials, reg_a=reg_a)
    with torch.cuda.device(q.device):
        combine_splits(part_o, part_lse2, schedule.split_offsets, out, lse,
                       call.descale_k if call.kv_fp8 else None, pdl=pdl,  # the e4m3 scale on the output, once
                       tile=schedule.config.combine_tile, discard=schedule.config.discard_partials)
    return out, lse
