"""Our Triton ops on a GPU that is not the current one (a model whose layers are spread over GPUs in one process):
Triton launches on the current device, so each op makes its tensors' device current for the launch. With the first GPU
current, every op launches its kernels with the second current (a spy on each kernel module's launcher reads the
current device: the results alone could not tell, since with peer access a kernel on the wrong GPU reads the other's
memory), gives its oracle's result there, and leaves the first current. Needs two GPUs; skips with fewer."""

from __future__ import annotations

import pytest
import torch

from ops_cases import check
from test_fp8_quant import _store_inputs, query_inputs, query_oracle, store_oracle
from test_head_matmul import inputs, within_precision
from test_splitkv_gpu import R, SCALE, build, oracle_and_lowp
from test_store_rows import SENTINEL, _inputs, _same, cast_oracle

from mla_fa3 import ops
from mla_fa3.ops import Impl, triton_ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two GPUs")]
D1 = torch.device("cuda", 1)


LAUNCHERS = {"fp8": ("store_rows", "store_e4m3", "quantize_query_e4m3", "absorb_query_e4m3"),
             "matmul": ("head_matmul",), "splitkv": ("splitkv_mla_with_kvcache",), "replan": ("replan_schedule",)}


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """[(launcher, the current device when it was called)], the first GPU current around each test."""
    seen = []
    for which, names in LAUNCHERS.items():
        module = triton_ops._triton_module(which)
        for name in names:
            def spy(*args, _launch=getattr(module, name), _name=name, **kwargs):
                seen.append((_name, torch.cuda.current_device()))
                return _launch(*args, **kwargs)
            monkeypatch.setattr(module, name, spy)
    with torch.cuda.device(0):
        yield seen
        torch.cuda.synchronize(D1)
        assert torch.cuda.current_device() == 0, "an op left another device current"


def launched_on_the_second(seen, *names):
    assert sorted({name for name, _ in seen}) == sorted(names), seen
    assert all(device == 1 for _, device in seen), f"launched with another device current: {seen}"


def test_stores(launches):
    x, buf, _, loc, col0 = _inputs("fp32_to_bf16_latent")
    g_buf = buf.to(D1)
    ops.store_rows(g_buf[:, col0: col0 + x.shape[1]], loc.to(D1), x.to(D1), impl="triton")
    want = torch.full_like(buf, SENTINEL)
    want[loc.long(), col0: col0 + x.shape[1]] = cast_oracle(x, buf.dtype)
    assert _same(g_buf.cpu(), want)

    x, buf, _, loc, s = _store_inputs("bf16_latent_576")  # the out view: the first W columns
    W = x.shape[1]
    want = buf.view(torch.uint8).clone()
    want[loc.long(), :W] = store_oracle(x, float(s))
    g_buf = buf.to(D1)
    ops.store_e4m3(g_buf[:, :W], loc.to(D1), x.to(D1), s.to(D1), impl="triton")
    assert torch.equal(g_buf.view(torch.uint8).cpu(), want)
    launched_on_the_second(launches, "store_rows", "store_e4m3")


def test_fp8_query_and_head_matmul(launches):
    a, b = query_inputs(3, 16, torch.bfloat16, 5)
    q8, descale = ops.quantize_query_e4m3(a.to(D1), b.to(D1), impl="triton")
    codes, s = query_oracle(torch.cat([a, b], dim=-1))
    assert float(descale.cpu()) == s and torch.equal(q8.view(torch.uint8).cpu(), codes)

    x, w = inputs(4, 16, 128, 512, torch.bfloat16, seed=3)
    out = ops.head_matmul(x.to(D1), w.to(D1), impl="triton")
    within_precision(out.cpu(), x, w)

    q_rope = torch.randn(4, 16, 64).to(torch.bfloat16)
    q8, descale = ops.absorb_query_e4m3(x.to(D1), w.to(D1), q_rope.to(D1), impl="triton")
    codes, s = query_oracle(torch.cat([out.cpu(), q_rope], dim=-1))  # the quantization of the kernel's own q_lat
    assert float(descale.cpu()) == s and torch.equal(q8.view(torch.uint8).cpu(), codes)
    launched_on_the_second(launches, "quantize_query_e4m3", "head_matmul", "absorb_query_e4m3")


def test_splitkv_with_the_device_planner(launches):
    lens, heads, page = (5000, 63, 1), 16, 64
    q, kv, table, seqlens, dense, _ = (t.to(D1) if isinstance(t, torch.Tensor) else t
                                       for t in build(lens, 1, heads, page, seed=2))
    sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page, device=D1, max_batch=3)
    ops.replan_splitkv_schedule(seqlens, sched, impl="triton")
    out, lse = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                            causal=True, impl="triton")
    assert ops.last_impl() is Impl.TRITON and out.device == D1
    launched_on_the_second(launches, "replan_schedule", "splitkv_mla_with_kvcache")
    ref_out, ref_lse, lowp = oracle_and_lowp(dense)
    ref_sched = ops.get_splitkv_schedule(list(lens), num_heads=heads, page_size=page).to(D1)
    ref_impl, _ = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, head_dim_v=R, schedule=ref_sched,
                                               softmax_scale=SCALE, causal=True, impl="reference")
    check(out, lse, ref_out, ref_lse, lowp, ref_impl)
