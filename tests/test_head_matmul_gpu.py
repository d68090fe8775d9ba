"""``ops.head_matmul`` and ``ops.absorb_query_e4m3`` on the GPU (sm_90): the Triton kernel in bf16 at DeepSeek-V3's
projection shapes against the fp64 oracle, the fused FP8 query bit for bit against the full quantization of the
kernel's own q_lat, and both replayed from a CUDA graph with new inputs (programmatic dependent launches captured)."""

from __future__ import annotations

import pytest
import torch

from test_head_matmul import close_to_fp64, inputs, quantized_oracle, within_precision

from mla_fa3 import ops

pytestmark = pytest.mark.gpu
BF16, DEV = torch.bfloat16, "cuda"
SHAPES = [(t, h, k, n) for t in (1, 2, 4, ops.HEAD_MATMUL_MAX_ROWS) for h in (16, 128)
          for k, n in ((128, 512), (512, 128))]


def on_gpu(x, w):
    return x.to(DEV), w.to(DEV)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_the_oracle_and_cublas(shape):
    x, w = on_gpu(*inputs(*shape, BF16, seed=sum(shape)))
    out = ops.head_matmul(x, w)  # AUTO on CUDA: the Triton kernel at these rows
    torch.cuda.synchronize()
    within_precision(out.cpu(), x.cpu(), w.cpu())
    cublas = ops.head_matmul(x, w, impl="reference")
    assert float((out.float() - cublas.float()).abs().max()) <= float(cublas.float().abs().max()) * 2 ** -7


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("rows", [1, 4, ops.HEAD_MATMUL_MAX_ROWS])
def test_absorbed_fp8_query_equals_the_full_quantization(heads, rows):
    x, w = on_gpu(*inputs(rows, heads, 128, 512, BF16, seed=rows))
    q_rope = (torch.randn(rows, heads, 192, device=DEV) * 0.5).to(BF16)[..., 128:]
    q8, d = ops.absorb_query_e4m3(x, w, q_rope)
    r8, rd = quantized_oracle(ops.head_matmul(x, w), q_rope)
    assert torch.equal(d, rd)
    assert torch.equal(q8.view(torch.uint8), r8.view(torch.uint8))
    close_to_fp64(q8.cpu(), d.cpu(), x.cpu(), w.cpu(), q_rope.cpu())


@pytest.mark.parametrize("rows", [ops.HEAD_MATMUL_MAX_ROWS + 1, 64, 200])
def test_rows_past_the_limit_and_a_strided_out(rows):
    """AUTO above HEAD_MATMUL_MAX_ROWS runs cuBLAS, TRITON the kernel up to 64 rows; both into a strided out view."""
    x, w = on_gpu(*inputs(rows, 16, 128, 512, BF16, seed=rows))
    buf = torch.zeros(rows, 16, 512 + 32, dtype=BF16, device=DEV)
    ops.head_matmul(x, w, out=buf[..., 16: 16 + 512])
    within_precision(buf[..., 16: 16 + 512].cpu(), x.cpu(), w.cpu())
    assert not buf[..., :16].any() and not buf[..., 16 + 512:].any()
    if rows <= 64:
        within_precision(ops.head_matmul(x, w, impl="triton").cpu(), x.cpu(), w.cpu())
    else:
        with pytest.raises(ValueError, match="at most 64 rows"):
            ops.head_matmul(x, w, impl="triton")


def test_graph_replay_with_new_inputs():
    x, w = on_gpu(*inputs(4, 128, 128, 512, BF16, seed=1))
    wv = (torch.randn(128, 512, 128, device=DEV) / 512 ** 0.5).to(BF16)
    q_rope = torch.zeros(4, 128, 64, device=DEV, dtype=BF16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q8, d = ops.absorb_query_e4m3(x, w, q_rope)  # compile outside the capture
        o = ops.head_matmul(ops.head_matmul(x, w), wv)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            q8, d = ops.absorb_query_e4m3(x, w, q_rope)
            o = ops.head_matmul(ops.head_matmul(x, w), wv)
    torch.cuda.synchronize()
    for seed in (2, 3):
        nx, _ = on_gpu(*inputs(4, 128, 128, 512, BF16, seed=seed))
        x.copy_(nx)
        q_rope.copy_((torch.randn(4, 128, 64, device=DEV) * seed).to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        r8, rd = quantized_oracle(ops.head_matmul(x, w), q_rope)
        assert torch.equal(d, rd) and torch.equal(q8.view(torch.uint8), r8.view(torch.uint8))
        assert torch.equal(o, ops.head_matmul(ops.head_matmul(x, w), wv))
