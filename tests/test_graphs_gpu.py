"""CUDA-graph replay on the H200: a smaller live batch than captured equals eager and the fp64 oracle.

Same cases as ``test_graph_runner.py`` (its ``World``), with real CUDA graphs, bf16, DeepSeek-V3 latent
dims (FA3's absorbed kernel exists for d_rope 64 / r 512 only), FA3 through sgl-kernel and FlashMLA at
page 64. Each case: a full round at the largest captured size, the requests freed (pool reuse), then
a smaller live batch over a pool whose stale slots (and the padding slot) hold NaN, replayed with the
metadata replay update and the replay itself under ``torch.cuda.set_sync_debug_mode("error")`` — a
device->host sync anywhere in ``prepare`` / ``replay`` raises.

Accuracy: bf16 inputs and cache, fp32 accumulation in the kernels, vs the fp64 oracle: cosine
similarity >= 0.9995 and max |err| within twice the eager step's own error (plus a bf16 ulp of the
output scale); replay vs eager: the same kernels on the same data at another batch size (FA3 may
split the KV differently), so agreement to a bf16 rounding step.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from test_graph_runner import V3, World, run_round

from mla_fa3.batch import ForwardMode

pytestmark = pytest.mark.gpu

_V3 = dict(dims=V3, heads=16)
SPECS = {
    "decode_p1": dict(mode=ForwardMode.DECODE, page=1, sizes=(2, 4, 8), live=3, **_V3),
    "decode_p16": dict(mode=ForwardMode.DECODE, page=16, sizes=(2, 4, 8), live=3, **_V3),
    "decode_p64": dict(mode=ForwardMode.DECODE, page=64, sizes=(4, 8), live=1, **_V3),
    "verify_k3_p1": dict(mode=ForwardMode.TARGET_VERIFY, page=1, k=3, sizes=(2, 4, 8), live=3, **_V3),
    "verify_k3_p16": dict(mode=ForwardMode.TARGET_VERIFY, page=16, k=3, sizes=(2, 4, 8), live=3, **_V3),
    "verify_k4_p64": dict(mode=ForwardMode.TARGET_VERIFY, page=64, k=4, sizes=(4, 8), live=2, **_V3),
    "draft_3steps_p1": dict(mode=ForwardMode.DRAFT_DECODE, page=1, steps=3, sizes=(2, 4, 8), live=3, **_V3),
    "draft_3steps_p16": dict(mode=ForwardMode.DRAFT_DECODE, page=16, steps=3, sizes=(2, 4, 8), live=3, **_V3),
    "draft_2steps_p64": dict(mode=ForwardMode.DRAFT_DECODE, page=64, steps=2, sizes=(4, 8), live=3, **_V3),
}
FLASHMLA_SPECS = {
    "flashmla_decode_p64": dict(mode=ForwardMode.DECODE, page=64, sizes=(2, 4, 8), live=3, **_V3),
    "flashmla_verify_k2_p64": dict(mode=ForwardMode.TARGET_VERIFY, page=64, k=2, sizes=(4, 8), live=3, **_V3),
    "flashmla_128heads_p64": dict(mode=ForwardMode.DECODE, page=64, sizes=(4, 8), live=2, dims=V3, heads=128),
}
MAX_CONTEXT = 320


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _check_gpu(out, eager, ref, batch):
    assert out.shape == eager.shape == ref.shape
    assert torch.isfinite(out).all(), "replay output has non-finite values (stale NaN slots leaked?)"
    err, err_eager = (out.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
    ulp = ref.abs().max().item() * 2.0 ** -8
    assert _cos(out, ref) >= 0.9995
    assert err <= 2 * err_eager + ulp, (err, err_eager)
    torch.testing.assert_close(out.float(), eager.float(), rtol=2 ** -7, atol=ulp)


def _checked_run(runner):
    """run() with the host-side update and the replay under sync-debug 'error' (any sync raises)."""

    def run(batch, inputs):
        with runner.no_sync_check():
            key = runner.prepare(batch, inputs)
            out = runner.replay(key)
        return out[: batch.num_tokens]

    return run


def _run_case(spec: dict, name: str, decode_kernel: str):
    torch.manual_seed(0)
    world = World(spec, "cuda", torch.bfloat16, seed=zlib.crc32(name.encode()), max_context=MAX_CONTEXT,
                  decode_kernel=decode_kernel, impl="fa3")
    runner = world.runner()
    assert runner.use_graphs
    for bs in spec["sizes"]:
        for step in range(world.steps):
            runner.graph(bs, step)  # one graph per (size, draft step)
    run = _checked_run(runner)
    run_round(world, runner, max(spec["sizes"]), poison=False, check=_check_gpu, longest=True, run=run)
    run_round(world, runner, spec["live"], poison=True, check=_check_gpu, run=run)
    return world


@pytest.mark.parametrize("name", list(SPECS))
def test_fa3_replay_smaller_batch_equals_eager_and_oracle(name):
    _run_case(SPECS[name], name, "fa3")


@pytest.mark.parametrize("name", list(FLASHMLA_SPECS))
def test_flashmla_replay_smaller_batch_equals_eager_and_oracle(name):
    world = _run_case(FLASHMLA_SPECS[name], name, "flashmla")
    assert world.backend.explain().kernel == "flashmla"


def test_replay_tracks_new_lengths_without_recapture():
    """Consecutive replays of one graph at growing lengths follow the metadata (no stale page table)."""
    spec = SPECS["decode_p16"]
    world = World(spec, "cuda", torch.bfloat16, seed=7, max_context=MAX_CONTEXT, impl="fa3")
    runner = world.runner()
    rows = world.start([3, 40, 17])
    for _ in range(20):  # 20 decode steps, crossing page borders
        batch, inputs, latent = world.make_step(rows)
        out = runner.run(batch, inputs).clone()
        world.commit(rows, latent)
        ref = world.oracle(rows, inputs["q"])
        assert _cos(out, ref) >= 0.9995

