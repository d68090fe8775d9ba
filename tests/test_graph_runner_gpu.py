"""CUDA-graph replay on the H200: a smaller live batch than captured equals eager and the fp64 oracle.

The cases of ``test_graph_runner.py`` (``graph_world.World``), with real CUDA graphs, bf16, DeepSeek-V3 latent
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

from graph_world import World, run_round
from specs import GRAPH_FLASHMLA, GRAPH_GPU, GRAPH_SPECS, GraphSpec

pytestmark = pytest.mark.gpu

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


def _run_case(spec: GraphSpec, name: str, decode_kernel: str, device_metadata: bool = True):
    torch.manual_seed(0)
    world = World(spec, "cuda", torch.bfloat16, cfg="deepseek_v3", seed=zlib.crc32(name.encode()),
                  max_context=MAX_CONTEXT, decode_kernel=decode_kernel, impl="fa3")
    runner = world.runner(device_metadata=device_metadata)
    assert runner.device_metadata == device_metadata
    assert runner.use_graphs
    for bs in spec.sizes:
        for step in range(world.steps):
            runner.graph(bs, step)  # one graph per (size, draft step)
    run = _checked_run(runner)
    run_round(world, runner, max(spec.sizes), poison=False, check=_check_gpu, longest=True, run=run)
    run_round(world, runner, spec.live, poison=True, check=_check_gpu, run=run)
    return world


@pytest.mark.parametrize("device_metadata", [True, False])
@pytest.mark.parametrize("name", GRAPH_GPU)
def test_fa3_replay_smaller_batch_equals_eager_and_oracle(name, device_metadata):
    _run_case(GRAPH_SPECS[name], name, "fa3", device_metadata)


@pytest.mark.parametrize("device_metadata", [True, False])
@pytest.mark.parametrize("name", GRAPH_FLASHMLA)
def test_flashmla_replay_smaller_batch_equals_eager_and_oracle(name, device_metadata):
    """With device metadata FlashMLA's schedule is re-planned inside the graph (get_mla_metadata captured)."""
    world = _run_case(GRAPH_SPECS[name], name, "flashmla", device_metadata)
    assert world.backend.explain().kernel == "flashmla"


@pytest.mark.parametrize("device_metadata", [True, False])
@pytest.mark.parametrize("name", GRAPH_GPU)
def test_splitkv_replay_smaller_batch_equals_eager_and_oracle(name, device_metadata):
    """Split-KV's schedule is re-planned on the device from the live lengths: inside the graph with device metadata
    (the Triton planner captured), else by one launch in the replay update — under the no-sync check either way
    (that the replays' plans are exactly the host planner's: ``test_backend_splitkv.py``)."""
    _run_case(GRAPH_SPECS[name], name, "splitkv", device_metadata)


def test_replay_tracks_new_lengths_without_recapture():
    """Consecutive replays of one graph at growing lengths follow the metadata (no stale page table)."""
    spec = GRAPH_SPECS["decode_p16"]
    world = World(spec, "cuda", torch.bfloat16, cfg="deepseek_v3", seed=7, max_context=MAX_CONTEXT, impl="fa3")
    runner = world.runner()
    rows = world.start([3, 40, 17])
    for _ in range(20):  # 20 decode steps, crossing page borders
        batch, inputs, latent = world.make_step(rows)
        out = runner.run(batch, inputs).clone()
        world.commit(rows, latent)
        ref = world.oracle(rows, inputs["q"])
        assert _cos(out, ref) >= 0.9995

