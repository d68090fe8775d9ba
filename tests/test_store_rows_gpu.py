"""``ops.store_rows`` on the GPU: the Triton kernel (AUTO on CUDA) gives the cast oracle's bytes for every case of
``test_store_rows.py`` (fp32 -> bf16 ties and overflow, fp16 / fp32 outputs, column views of a wider buffer, each rows
per program of the rule), replays from a CUDA graph with new rows and slots copied in, and a bf16 latent pool stores
through it exactly as the CPU pool does."""

from __future__ import annotations

import pytest
import torch

from test_splitkv_gpu import capture
from test_store_rows import CASES, SENTINEL, _inputs, _same, cast_oracle

from mla_fa3 import ops
from mla_fa3.kv.pools import MLATokenPool

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_gives_the_oracle_bytes(name):
    x, buf, _, loc, col0 = _inputs(name)
    want = torch.full_like(buf, SENTINEL)
    for t in range(x.shape[0]):
        want[int(loc[t]), col0: col0 + x.shape[1]] = cast_oracle(x[t], buf.dtype)
    g_buf = buf.to(DEV)
    ops.store_rows(g_buf[:, col0: col0 + x.shape[1]], loc.to(DEV), x.to(DEV))
    torch.cuda.synchronize()
    assert _same(g_buf.cpu(), want), f"{name}: {(g_buf.cpu().float() != want.float()).sum()} elements differ"


def test_graph_replays_with_new_rows_and_slots():
    T, W, S = 8, 576, 64
    buf = torch.full((S, W), SENTINEL, dtype=torch.bfloat16, device=DEV)
    x = torch.zeros(T, W, dtype=torch.float32, device=DEV)
    loc = torch.zeros(T, dtype=torch.int64, device=DEV)
    graph, _ = capture(lambda: ops.store_rows(buf, loc, x))
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        new_x = torch.randn(T, W, generator=g) * 10
        new_loc = torch.randperm(S, generator=g)[:T]
        buf.fill_(SENTINEL)
        x.copy_(new_x)
        loc.copy_(new_loc)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.full((S, W), SENTINEL, dtype=torch.bfloat16)
        want[new_loc] = cast_oracle(new_x, torch.bfloat16)
        assert _same(buf.cpu(), want), f"replay {seed}"


@pytest.mark.parametrize("dtype,x_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16)])
def test_latent_pool_stores_as_on_the_cpu(dtype, x_dtype):
    """The pool's rows in its dtype, from rows of the same or another float dtype (cast in the store)."""
    pools = {d: MLATokenPool(2, 8, 16, 512, 64, dtype, d) for d in ("cpu", DEV)}
    g = torch.Generator().manual_seed(7)
    latent = (torch.randn(5, 576, generator=g) * 3).to(x_dtype)
    c_kv, k_rope = torch.randn(3, 512, generator=g).to(x_dtype), torch.randn(3, 64, generator=g).to(x_dtype)
    for d, pool in pools.items():
        pool.set_latent(1, torch.tensor([0, 17, 127, 64, 3]), latent.to(d))
        pool.set_kv(0, torch.tensor([9, 1, 100]), c_kv.to(d), k_rope.to(d))
    for layer in (0, 1):
        assert torch.equal(pools[DEV].kv_buffer[layer].cpu(), pools["cpu"].kv_buffer[layer])


def test_slots_outside_the_buffer_are_not_written():
    """A slot < 0 or >= S (the caller's to check; the pools do on the host or with debug_checks) is skipped by the
    kernel: the guard bands around the buffer keep their sentinel, the rows with good slots are stored."""
    S, W = 40, 576
    wide = torch.full((3 * S, W), SENTINEL, dtype=torch.bfloat16, device=DEV)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, W, generator=g)
    loc = torch.tensor([-1, 0, S, 7, S + 100, 39, -50, 20])
    ops.store_rows(wide[S: 2 * S], loc.to(DEV), x.to(DEV))
    torch.cuda.synchronize()
    got = wide.cpu()
    assert (got[:S] == SENTINEL).all() and (got[2 * S:] == SENTINEL).all(), "written past the buffer"
    good = (loc >= 0) & (loc < S)
    want = torch.full((S, W), SENTINEL, dtype=torch.bfloat16)
    want[loc[good]] = cast_oracle(x[good], torch.bfloat16)
    assert _same(got[S: 2 * S], want)
