"""The Gluon MLA decode kernel (``ops/gluon_decode.py``) compiled for sm_90a on the CPU: no GPU needed.

What the design relies on, read off the PTX and the cubin of ``compile_for_hopper()`` (about 2 s):
    wgmma.mma_async        68 = 9 chunks x 4 (Sᵀ, K = 576) + 8 chunks x 4 (accᵀ, 64 keys)  — m64n16k16 bf16
    cp.async.bulk.tensor    9 = the 9 TMA boxes of one key tile (the producer's loop body)
    mbarrier                expect_tx on the ready barrier (9 x 8 KB), try_wait in both partitions, arrive (empty)
    setmaxnreg              the producer warp gives registers back, the consumer warpgroup takes them
    spills                  none (cuobjdump: LOCAL 0, STACK 0; no LDL / STL in the SASS)
The e4m3-cache variant (``compile_for_hopper(kv8=True)``): the same 9 TMA boxes (4 KB each: 36,864 B a tile), 144
``cvt.rn.f16x2.e4m3x2`` (the 64 x 576 tile / 128 threads / 2 per cvt; SASS ``F2FP.F16.E4M3.UNPACK_B``, no F2F), 68
wgmma ``m64n16k16.f32.f16.f16`` reading the converted fp16 tile, no spills; shared memory 205,884 B.
Skipped where triton or its Gluon (Hopper) API is missing, or triton < 3.6 (this kernel's API); checked with
triton 3.6 (the GPU machine's) and 3.9 (this venv's): the TMA load is ``async_copy_global_to_shared`` in 3.6 and
``async_load`` in 3.9, the module picks whichever exists; the TMA's PTX destination is ``shared::cluster`` in 3.6 and
``shared::cta`` in 3.9.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 6):
    pytest.skip(f"triton {triton.__version__} < 3.6: the kernel is written for the Gluon API of 3.6",
                allow_module_level=True)
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="this triton has no Gluon Hopper API")

from mla_fa3 import ops  # noqa: E402
from mla_fa3.ops import gluon_decode as gd  # noqa: E402
from mla_fa3.ops.validate_gluon import unsupported  # noqa: E402


@pytest.fixture(scope="module")
def compiled():
    return gd.compile_for_hopper()


@pytest.fixture(scope="module")
def compiled_fp8():
    return gd.compile_for_hopper(kv8=True)


def _cubin_tools():
    nvidia = os.path.dirname(triton.backends.nvidia.__file__)
    cuobjdump = os.path.join(nvidia, "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip(f"no cuobjdump in {nvidia}/bin")
    return cuobjdump


def _usage_and_sass(kernel):
    cuobjdump = _cubin_tools()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return usage, sass


def _count(text: str, what: str) -> int:
    return len(re.findall(re.escape(what), text))


def test_ptx_has_the_warp_specialized_structure(compiled):
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert _count(ptx, "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == 9 * 4 + 8 * 4
    # the destination space is shared::cluster in 3.6's PTX, shared::cta in 3.9's
    tma = r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global\.mbarrier::complete_tx::bytes"
    assert len(re.findall(tma, ptx)) == 9
    assert _count(ptx, "mbarrier.arrive.expect_tx") == 1  # one per tile: 9 boxes x 64 x 64 x 2 bytes
    assert "73728" in ptx
    assert _count(ptx, "mbarrier.try_wait") >= 2  # ready (consumer) and empty (producer)
    assert _count(ptx, "mbarrier.arrive.shared") >= 1  # the consumer releases a ring slot
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "fence.proxy.async" in ptx  # generic-proxy writes (q, p, the zeroed tail) before wgmma reads them
    assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("variant", ["compiled", "compiled_fp8"])
def test_cubin_has_no_spills(variant, request):
    """No local memory in either variant; 68 wgmma (bf16 or, over an e4m3 cache, fp16 after the tile's one
    conversion per pair of values) and 9 TMA boxes per tile."""
    usage, sass = _usage_and_sass(request.getfixturevalue(variant))
    assert re.search(r"\bLOCAL:0\b", usage) and re.search(r"\bSTACK:0\b", usage), usage
    assert not re.search(r"\b(LDL|STL)\b", sass)
    assert _count(sass, "UTMALDG.2D") == 9
    if variant == "compiled":
        assert _count(sass, "HGMMA.64x16x16.F32.BF16") == 68
    else:
        assert _count(sass, "HGMMA.64x16x16.F32 ") == 68
        assert _count(sass, "F2FP.F16.E4M3.UNPACK_B") == 144 and not re.search(r"\bF2F\.", sass)


def test_e4m3_register_read_feeds_wgmma_from_registers_without_a_staged_tile():
    """``reg_a=True`` (the e4m3 cache): the tile goes from the ring into wgmma's A registers and is converted there
    — 68 wgmma whose A operand is four registers (not a shared-memory descriptor), 17 x 16 conversions per thread
    and tile, no staging tile: a ring of 5 e4m3 tiles (184,320 B) where the staged variant holds 3 and their fp16
    copy, no spills. Every read is 16 contiguous bytes: Sᵀ's K chunks with the contraction index permuted (q stored
    in the same order; 2 loads a chunk, one wgmma in flight while the next chunk converts: 9 waits of 1), P·V's
    value chunks with the latent columns renumbered (4 loads a 16-key step for all 8 chunks, 8 wgmma in flight: 4
    waits of 8) — no 8- or 16-bit shared loads in the key loop, and the reinterpretations move no data (no shuffle
    beyond the softmax's, which the staged variant has too)."""
    kernel = gd.compile_for_hopper(kv8=True, reg_a=True)
    ptx = kernel.asm["ptx"]
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16 \{[^}]*\}, (\S+)", ptx)
    assert len(mma) == 68 and all(a.startswith("{") for a in mma)  # A: a register list
    assert _count(ptx, "cvt.rn.f16x2.e4m3x2") == 17 * 16
    assert _count(ptx, "wgmma.wait_group.sync.aligned 1;") == 9
    assert _count(ptx, "wgmma.wait_group.sync.aligned 8;") == 4
    assert 5 * 9 * 64 * 64 <= kernel.metadata.shared <= 227 * 1024
    usage, sass = _usage_and_sass(kernel)
    assert re.search(r"\bLOCAL:0\b", usage) and re.search(r"\bSTACK:0\b", usage), usage
    assert _count(sass, "HGMMA.64x16x16.F32 ") == 68 and _count(sass, "UTMALDG.2D") == 9
    # 2 x 9 (Sᵀ) + 4 x 4 (P·V) 16-byte loads a tile; one byte load in the whole kernel (outside the loop)
    assert _count(sass, "LDS.U16") == 0 and _count(sass, "LDS.U8") <= 1 and _count(sass, "LDS.128") >= 2 * 9 + 4 * 4
    staged_usage, staged_sass = _usage_and_sass(gd.compile_for_hopper(kv8=True))
    assert _count(sass, "SHFL") == _count(staged_sass, "SHFL") and _count(staged_sass, "LDS.U8") <= 1
    with pytest.raises(ValueError, match="reg_a is the e4m3 cache's read"):
        gd.compile_for_hopper(reg_a=True)


@pytest.mark.parametrize("kv8", [False, True])
def test_half_partials_variant_stores_bf16_partial_outputs(kv8, compiled, compiled_fp8):
    """``half=True`` (``KernelConfig.half_partials``): the partial outputs are rounded to bf16 and stored as 16-bit
    values (the fp32 variant stores none); the LSE stays fp32; no spills."""
    plain = (compiled_fp8 if kv8 else compiled).asm["ptx"]
    kernel = gd.compile_for_hopper(kv8=kv8, half=True)
    ptx = kernel.asm["ptx"]
    assert not re.search(r"st\.global(\.\w+)*\.b16", plain)
    assert re.search(r"st\.global(\.\w+)*\.b16", ptx) and "cvt.rn.bf16" in ptx
    assert _count(ptx, "wgmma.mma_async") == 68
    usage, _ = _usage_and_sass(kernel)
    assert re.search(r"\bLOCAL:0\b", usage) and re.search(r"\bSTACK:0\b", usage), usage


@pytest.mark.parametrize("kv8", [False, True])
def test_pdl_variant_signals_its_dependents_once_after_the_key_loop(kv8, compiled, compiled_fp8):
    """``pdl=True``: one ``griddepcontrol.launch_dependents`` after the key loop (the combine, launched next as a
    programmatic dependent, starts early and waits for the whole grid); without it none. Same wgmma / TMA
    structure, still no spills."""
    plain = (compiled_fp8 if kv8 else compiled).asm["ptx"]
    kernel = gd.compile_for_hopper(kv8=kv8, pdl=True)
    ptx = kernel.asm["ptx"]
    assert _count(plain, "griddepcontrol") == 0
    assert _count(ptx, "griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in ptx
    # after the loop: the launch_dependents comes after the last wgmma of the kernel
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.rindex("wgmma.mma_async")
    assert _count(ptx, "wgmma.mma_async") == _count(plain, "wgmma.mma_async") == 68
    usage, sass = _usage_and_sass(kernel)
    assert re.search(r"\bLOCAL:0\b", usage) and re.search(r"\bSTACK:0\b", usage), usage


@pytest.mark.parametrize("kv8", [False, True])
def test_after_the_store_the_producer_waits_for_it_before_its_first_tma(kv8):
    """``wait=True`` (``gluon_partials(follows_store=True)`` with PDL: launched as a programmatic dependent of the pool
    store): one ``griddepcontrol.wait``, before the first TMA box — the producer's; the rest of the kernel (the
    consumer's q loads, the dots) unchanged; still no spills."""
    kernel = gd.compile_for_hopper(kv8=kv8, pdl=True, wait=True)
    ptx = kernel.asm["ptx"]
    assert _count(ptx, "griddepcontrol.wait") == 1 and _count(ptx, "griddepcontrol.launch_dependents") == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.tensor")
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    regs = [line for line in lines[:wait] if "setmaxnreg" in line]
    assert regs and "setmaxnreg.dec" in regs[-1], "the wait is not in the producer (the partition that gives up registers)"
    assert _count(ptx, "cp.async.bulk.tensor") == 9 and _count(ptx, "wgmma.mma_async") == 68
    usage, _ = _usage_and_sass(kernel)
    assert re.search(r"\bLOCAL:0\b", usage) and re.search(r"\bSTACK:0\b", usage), usage


def test_two_query_tokens_widen_wgmma_n_to_32_rows():
    """``sq=2`` (MTP verify, a one-token draft): the query rows (token, head) are wgmma's N = 32; the same 68 wgmma
    (m64n32k16) and 9 TMA boxes, the causal limit per row, q and P in 16 KB / 4 KB more shared memory. No spills
    under triton 3.6 (the GPU machine's; 3.9 spills this variant, 3.6 spills the e4m3 one at 32 rows, which the
    launch refuses)."""
    kernel = gd.compile_for_hopper(sq=2)
    ptx = kernel.asm["ptx"]
    assert _count(ptx, "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 68
    assert kernel.metadata.shared <= 227 * 1024
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) == (3, 6):
        usage, sass = _usage_and_sass(kernel)
        assert re.search(r"\bLOCAL:0\b", usage) and re.search(r"\bSTACK:0\b", usage), usage
        assert not re.search(r"\b(LDL|STL)\b", sass)


def test_other_shapes_raise_a_named_value_error_before_any_launch():
    lens = [65, 130]
    q = torch.randn(2, 1, 16, 576).bfloat16()
    kv = torch.randn(8, 64, 1, 576).bfloat16()
    table = torch.zeros(2, 4, dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    sched = ops.get_splitkv_schedule(lens, num_heads=16, page_size=64)
    cases = {
        "^q must have 16 heads": dict(q=q[:, :, :8]),
        "^q must hold 1 to 2 query tokens": dict(q=q.expand(2, 3, 16, 576),
                                                 sched=ops.get_splitkv_schedule(lens, num_heads=16, page_size=64,
                                                                                num_q_tokens=3)),
        "^q must hold one query token per request over an e4m3 cache": dict(
            q=q.expand(2, 2, 16, 576), kv=kv.to(torch.float8_e4m3fn), descale_k=torch.ones(1),
            sched=ops.get_splitkv_schedule(lens, num_heads=16, page_size=64, num_q_tokens=2, kv_fp8=True)),
        r"^kv_cache must be \[num_pages, 64, 1, 576\]": dict(kv=kv.view(16, 32, 1, 576)),
        "^kv_cache must be contiguous": dict(kv=kv.transpose(0, 1).contiguous().transpose(0, 1)),
        "^q must be bfloat16": dict(q=q.half(), kv=kv.half()),
        "^q must be on a CUDA device": dict(),  # everything else fits: the device is the last check
    }
    for message, change in cases.items():
        args = dict(q=q, kv=kv, sched=sched, descale_k=None)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            gd.gluon_mla_decode(args["q"], args["kv"], table, seqlens, schedule=args["sched"], softmax_scale=0.1,
                                descale_k=args["descale_k"])


def test_split_kv_launch_switch_refuses_what_the_kernel_does_not_run():
    """``KernelConfig.warp_specialized`` routes split-KV's phase 1 to this kernel: the config refuses settings the
    kernel ignores, and the launch refuses a shape outside the kernel's one (here: 128 heads) or a fused projection,
    by name, before anything runs."""
    from mla_fa3.ops import splitkv_triton
    from mla_fa3.ops.splitkv_config import KernelConfig
    from mla_fa3.ops.validate import check_splitkv

    ws = KernelConfig(block_n=64, waves=1.0, warp_specialized=True)
    assert ws.label().endswith("-ws")
    assert KernelConfig(block_n=64, waves=4.0, half_partials=True, warp_specialized=True).label().endswith("-h-ws")
    for bad in (dict(block_n=32), dict(fused_projection=True)):
        with pytest.raises(ValueError, match="warp_specialized needs block_n 64"):
            KernelConfig(**{**dict(block_n=64, waves=1.0, warp_specialized=True), **bad})
    lens = [65, 130]
    kv = torch.randn(8, 64, 1, 576).bfloat16()
    table = torch.zeros(2, 4, dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    two = ops.get_splitkv_schedule(lens, num_heads=16, page_size=64, num_q_tokens=2, config=ws)
    call = check_splitkv(torch.randn(2, 2, 16, 576).bfloat16(), kv, table, seqlens, head_dim_v=512, schedule=two,
                         softmax_scale=0.1, causal=False, descale_q=None, descale_k=None, impl=ops.Impl.TRITON,
                         q_rope=None)
    with pytest.raises(ValueError, match="causal must be True with 2 query tokens"):
        splitkv_triton.splitkv_mla_with_kvcache(call, two)
    for heads, w_uv, message in ((128, None, "q must have 16 heads"), (16, torch.zeros(16, 512, 128).bfloat16(),
                                                                        "output projection is not fused")):
        sched = ops.get_splitkv_schedule(lens, num_heads=heads, page_size=64, config=ws)
        call = check_splitkv(torch.randn(2, 1, heads, 576).bfloat16(), kv, table, seqlens, head_dim_v=512,
                             schedule=sched, softmax_scale=0.1, causal=True, descale_q=None, descale_k=None,
                             impl=ops.Impl.TRITON, q_rope=None)
        with pytest.raises(ValueError, match=message):
            splitkv_triton.splitkv_mla_with_kvcache(call, sched, w_uv=w_uv)


def test_fp8_variant_converts_the_tile_and_runs_fp16_wgmma(compiled_fp8):
    ptx = compiled_fp8.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert _count(ptx, "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16") == 9 * 4 + 8 * 4
    assert _count(ptx, "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == 0
    tma = r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global\.mbarrier::complete_tx::bytes"
    assert len(re.findall(tma, ptx)) == 9
    assert _count(ptx, "mbarrier.arrive.expect_tx") == 1 and "36864" in ptx  # 9 boxes x 64 x 64 x 1 byte
    assert _count(ptx, "cvt.rn.f16x2.e4m3x2") == 64 * 576 // 128 // 2  # the tile, once: 144 per thread
    assert _count(ptx, "cvt.bf16.f16") == 0
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert _count(ptx, "fence.proxy.async") >= 3  # q, the converted tile, P
    assert compiled_fp8.metadata.shared <= 227 * 1024


def test_unsupported_takes_an_e4m3_cache_with_a_bf16_q_and_refuses_an_e4m3_q():
    from mla_fa3.ops.validate import check_splitkv

    lens = [65, 130]
    kv = torch.randn(8, 64, 1, 576).to(torch.float8_e4m3fn)
    table = torch.zeros(2, 4, dtype=torch.int32)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    one = torch.ones(1)
    sched = ops.get_splitkv_schedule(lens, num_heads=16, page_size=64)
    call = check_splitkv(torch.randn(2, 1, 16, 576).bfloat16(), kv, table, seqlens, head_dim_v=512, schedule=sched,
                         softmax_scale=0.1, causal=True, descale_q=None, descale_k=one, impl=ops.Impl.TRITON)
    assert call.kv_fp8 and not call.is_fp8
    assert unsupported(call, sched).startswith("q must be on a CUDA device")  # everything else fits
    with pytest.raises(ValueError, match="^q must be on a CUDA device"):
        gd.gluon_mla_decode(call.q, kv, table, seqlens, schedule=sched, softmax_scale=0.1, descale_k=one)
    with pytest.raises(ValueError, match="descale_k is required"):
        gd.gluon_mla_decode(call.q, kv, table, seqlens, schedule=sched, softmax_scale=0.1)
    sched8 = sched
    call8 = check_splitkv(torch.randn(2, 1, 16, 576).to(torch.float8_e4m3fn), kv, table, seqlens, head_dim_v=512,
                          schedule=sched8, softmax_scale=0.1, causal=True, descale_q=one, descale_k=one,
                          impl=ops.Impl.TRITON)
    assert unsupported(call8, sched8).startswith("q must be bfloat16")
    assert "e4m3 q" in unsupported(call8, sched8)
