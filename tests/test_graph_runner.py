"""GraphRunner on CPU: padding + static buffers + metadata replay equal the eager step and the oracle.

On CPU the runner captures no graph: ``run`` pads the live batch into the static buffers, replays the
backend's captured metadata for the padded size and calls the step eagerly on the static views — the
exact data path a CUDA graph replays. Every case runs a full batch first, frees it (pool reuse), then
a smaller live batch than captured over a pool whose every non-live slot (tails of pages, freed
slots, the padding slot 0) holds NaN, and compares with

* the same step run eagerly (``init_forward_metadata`` + the step on the live batch), and
* the fp64 non-absorbed MLA oracle of ``tests/oracle.py`` (independent of the library).

``World`` (``graph_world.py``) is shared with ``test_graph_runner_gpu.py`` (real CUDA graphs).
"""

from __future__ import annotations

import zlib
from collections import Counter

import pytest
import torch

from graph_world import World, run_round
from op_log import DeviceOpLog
from specs import GRAPH_CPU, GRAPH_SPECS, MLA_CONFIGS

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.graphs.runner import GraphRunner, InputSpec, StaticBuffers, fill_inputs, pad_batch, padded_size
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool


def _check_cpu(out, eager, ref, batch):
    assert out.shape == ref.shape == eager.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device_metadata", [True, False])
@pytest.mark.parametrize("name", GRAPH_CPU)
def test_replay_smaller_batch_after_pool_reuse_equals_eager_and_oracle(name, device_metadata):
    world = World(GRAPH_SPECS[name], "cpu", torch.float32, seed=zlib.crc32(name.encode()))
    runner = world.runner(device_metadata=device_metadata)
    sizes = GRAPH_SPECS[name].sizes
    run_round(world, runner, max(sizes), poison=False, check=_check_cpu, longest=True)  # fills pool, rows, buffers
    run_round(world, runner, GRAPH_SPECS[name].live, poison=True, check=_check_cpu)
    assert padded_size(GRAPH_SPECS[name].live, sizes) >= GRAPH_SPECS[name].live


def test_step_sees_padded_static_buffers():
    """The captured step reads the static views: padding rows write slot 0 and carry zero inputs."""
    spec = GRAPH_SPECS["decode_p16"]
    world = World(spec, "cpu", torch.float32)
    seen = {}

    def step(batch, inputs):
        seen.update(bs=batch.batch_size, loc=batch.out_cache_loc.clone(), q=inputs["q"].clone(),
                    loc_ptr=batch.out_cache_loc.data_ptr())
        return world.forward_fn(batch, inputs)

    runner = GraphRunner(world.backend, step, batch_sizes=spec.sizes, mode=world.mode, max_context=160,
                         input_specs=world.input_specs(), device="cpu")
    full = world.start([9, 3, 30, 2])
    runner.run(*world.make_step(full)[:2])  # leaves non-zero rows 3 in every static buffer
    rows = world.start([5, 17, 40])
    batch, inputs, _ = world.make_step(rows)
    runner.run(batch, inputs)
    assert seen["bs"] == 4 and seen["loc_ptr"] == runner.buffers.out_cache_loc.data_ptr()
    assert torch.equal(seen["loc"][:3], batch.out_cache_loc) and seen["loc"][3] == 0
    assert torch.equal(seen["q"][:3], inputs["q"]) and not seen["q"][3].any()


def test_pad_batch_resets_rows_of_an_earlier_bigger_batch():
    buf = StaticBuffers.allocate(8, 2, {"x": InputSpec((3,), torch.float32)}, "cpu")
    big = ForwardBatch.verify(list(range(8)), [9] * 8, list(range(100, 116)), "cpu", num_draft_tokens=2)
    pad_batch(big, buf, 8)
    small = ForwardBatch.verify([5, 6, 7], [4, 6, 8], [11, 12, 13, 14, 15, 16], "cpu", num_draft_tokens=2)
    pad_batch(small, buf, 4)
    assert buf.req_pool_indices[:4].tolist() == [5, 6, 7, 0]
    assert buf.seq_lens[:4].tolist() == [4, 6, 8, 2] and buf.seq_lens_cpu[:4].tolist() == [4, 6, 8, 2]
    assert buf.out_cache_loc[:8].tolist() == [11, 12, 13, 14, 15, 16, 0, 0]
    assert buf.positions[:8].tolist() == [2, 3, 4, 5, 6, 7, 0, 0]


def test_padding_resets_only_rows_earlier_runs_filled():
    """A walk of live / padded sizes: every padded view holds the live rows then padding, checked against
    lists; padding rows are reset exactly when an earlier run filled one of them, by copies from the padding
    templates in the same batched copy as the live rows (one ``_foreach_copy_`` per dtype either way)."""
    q, gen = 2, torch.Generator().manual_seed(11)
    buf = StaticBuffers.allocate(8, q, {"x": InputSpec((3,), torch.float32)}, "cpu", seq_len_fill=1)
    steps = [(8, 8), (3, 4), (3, 4), (1, 8), (6, 8), (2, 2), (5, 5), (5, 8), (7, 8), (4, 4), (2, 8), (2, 8)]
    filled: set[int] = set()  # rows some run filled and no run has reset since
    for n, padded in steps:
        rows = torch.randint(1, 20, (n,), generator=gen).tolist()
        seq = torch.randint(q, 90, (n,), generator=gen).tolist()
        loc = torch.randint(1, 500, (n * q,), generator=gen).tolist()
        batch = ForwardBatch.verify(rows, seq, loc, "cpu", num_draft_tokens=q)
        x = torch.randn(n * q, 3, generator=gen)
        log = DeviceOpLog("cpu")
        with log:
            fill_inputs({"x": x}, buf, n * q, padded * q)
            pad_batch(batch, buf, padded)
        stale = filled & set(range(n, padded))
        filled = (filled - set(range(n, padded))) | set(range(n))
        ops = log.device_ops()
        # copies: float inputs, int64 ids, int32 lengths (resets included, a list of one is a plain copy_),
        # and the host copy of seq_lens_cpu — the same count with or without rows to reset
        assert ops["_foreach_copy_"] + ops["copy_"] == 4 and ops["zero_"] == 0, ops
        assert ops["fill_"] == (1 if stale else 0), (n, padded, stale)
        pad = padded - n
        assert buf.req_pool_indices[:padded].tolist() == rows + [0] * pad
        assert buf.seq_lens[:padded].tolist() == seq + [q] * pad == buf.seq_lens_cpu[:padded].tolist()
        assert buf.out_cache_loc[: padded * q].tolist() == loc + [0] * (pad * q)
        assert buf.positions[: padded * q].tolist() == [s - q + j for s in seq for j in range(q)] + [0] * (pad * q)
        assert torch.equal(buf.inputs["x"][: padded * q], torch.cat([x, torch.zeros(pad * q, 3)]))


@pytest.mark.parametrize("device_metadata", [True, False])
def test_prepare_device_ops_without_reading_the_device(device_metadata):
    """Steady-state decode prepare on the ``meta`` device (the CUDA path, no data: a host read of a device
    value raises): one batched copy of the live rows per dtype (float inputs, int64 ids, int32 lengths:
    ``_foreach_copy_``'s one-launch fast path takes one dtype) and one host->device copy of the metadata; with
    ``device_metadata=False`` (the SGLang protocol) also the four page-table ops — no padding reset, no
    other device op. With device metadata the page table is derived by the graph's prologue: tensor ops
    on fixed shapes, no copy from the host."""
    dims, heads, page, ctx = MLA_CONFIGS["tiny"].dims, 4, 16, 256
    req_pool = ReqToTokenPool(9, ctx, "meta")
    req_pool.claim(list(range(9)), ctx)  # a layout the test owns (the meta device holds no values)
    pool = MLATokenPool(1, 2 + 8 * ctx // page, page, dims.kv_lora_rank, dims.qk_rope_head_dim, torch.float32, "meta")
    backend = MLABackend(req_to_token_pool=req_pool, kv_pool=pool, page_size=page, device="meta",
                         decode_kernel="fa3", num_heads=heads)
    specs = {"q": InputSpec((heads, dims.qk_head_dim), torch.float32),
             "latent": InputSpec((dims.latent_dim,), torch.float32)}
    runner = GraphRunner(backend, lambda batch, inputs: None, batch_sizes=[4, 8], mode=ForwardMode.DECODE,
                         max_context=ctx, input_specs=specs, device="meta", use_graphs=False,
                         device_metadata=device_metadata)
    batch = ForwardBatch.decode([3, 1, 7, 2, 5, 8], [40, 17, 256, 3, 99, 120], list(range(1, 7)), "meta")
    inputs = {name: torch.empty(6, *spec.shape, device="meta") for name, spec in specs.items()}
    runner.prepare(batch, inputs)
    log = DeviceOpLog()
    with log:
        assert runner.prepare(batch, inputs) == (8, 0, None)
    assert log.host_to_device_copies() == 1
    table_ops = Counter(index_select=1, lt=1, floor_divide_=1, mul=1)
    if not device_metadata:
        assert log.device_ops() == Counter(_foreach_copy_=3, copy_=1) + table_ops
        return
    assert backend.builder.capture_buffers.device_tables
    assert log.device_ops() == Counter(_foreach_copy_=3, copy_=1)
    prologue = DeviceOpLog()
    with prologue:
        backend.graph_prologue()
    assert prologue.host_to_device_copies() == 0
    assert prologue.device_ops() == table_ops


def test_oversize_batch_and_overlong_context_raise_before_writing():
    spec = GRAPH_SPECS["decode_p16"]
    world = World(spec, "cpu", torch.float32)
    runner = world.runner()
    before = {k: getattr(runner.buffers, k).clone() for k in ("out_cache_loc", "seq_lens", "req_pool_indices")}
    d = world.dims

    def inputs(T):
        return {"q": torch.zeros(T, world.heads, d.qk_head_dim), "latent": torch.zeros(T, d.latent_dim)}

    too_many = ForwardBatch.decode(list(range(9)), [3] * 9, list(range(16, 25)), "cpu")
    with pytest.raises(ValueError, match="batch_size 9 exceeds the largest captured batch size 8"):
        runner.run(too_many, inputs(9))
    too_long = ForwardBatch.decode([0, 1], [5, 161], [16, 17], "cpu")
    with pytest.raises(ValueError, match="max_context"):
        runner.run(too_long, inputs(2))
    ok = ForwardBatch.decode([0, 1], [5, 6], [16, 17], "cpu")
    with pytest.raises(ValueError, match=r"inputs\['q'\] must have shape"):
        runner.run(ok, {"q": torch.zeros(3, world.heads, d.qk_head_dim), "latent": torch.zeros(2, d.latent_dim)})
    with pytest.raises(TypeError, match=r"inputs\['latent'\] must be torch.float32"):
        runner.run(ok, {"q": torch.zeros(2, world.heads, d.qk_head_dim), "latent": torch.zeros(2, d.latent_dim,
                                                                                               dtype=torch.float64)})
    with pytest.raises(ValueError, match="inputs must have exactly the keys"):
        runner.run(ok, {"q": torch.zeros(2, world.heads, d.qk_head_dim)})
    verify = ForwardBatch.verify([0], [5], [16, 17], "cpu", num_draft_tokens=2)
    with pytest.raises(ValueError, match="forward_mode must be DECODE"):
        runner.run(verify, inputs(2))
    for k, v in before.items():
        assert torch.equal(getattr(runner.buffers, k), v), k


def test_constructor_rejects_bad_arguments():
    world = World(GRAPH_SPECS["decode_p1"], "cpu", torch.float32)
    common = dict(max_context=64, device="cpu", input_specs=world.input_specs())
    with pytest.raises(ValueError, match="mode must be"):
        GraphRunner(world.backend, world.forward_fn, batch_sizes=[2], mode=ForwardMode.EXTEND, **common)
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphRunner(world.backend, world.forward_fn, batch_sizes=[0, 2], mode=ForwardMode.DECODE, **common)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        GraphRunner(world.backend, world.forward_fn, batch_sizes=[2], mode=ForwardMode.TARGET_VERIFY,
                    num_draft_tokens=0, **common)
    with pytest.raises(ValueError, match="use_graphs needs a CUDA device"):
        GraphRunner(world.backend, world.forward_fn, batch_sizes=[2], mode=ForwardMode.DECODE, use_graphs=True,
                    **common)


def test_runner_keeps_one_graph_per_kernel_and_replays_the_one_the_backend_picks(monkeypatch):
    """decode_kernel='auto' on page 64: the runner captures FA3, FlashMLA and split-KV per size (under the
    kernel-alone table, where split-KV wins at 16 heads); each run replays the kernel the backend chose from
    the live lengths, and the answer matches the fp64 oracle."""
    from pathlib import Path

    from mla_cases import follow_up, make_mla_case, mla_oracle, rel_err
    from specs import BatchSpec

    from mla_fa3.policy import decode_kernel as kernel_choice
    from mla_fa3.absorb import DecodeKernel

    perf = Path(__file__).resolve().parents[1] / "docs" / "perf"
    monkeypatch.setattr(kernel_choice, "MEASURED", kernel_choice.table_from_csvs(
        [str(perf / "decode_2026-12-02_run1.csv"), str(perf / "2026-12-03" / "decode_small_batch.csv")]))

    spec = BatchSpec(ForwardMode.DECODE, (40, 3, 77), (1, 1, 1), page_size=64)
    case = make_mla_case(spec, "deepseek_v3", seed=5)
    H = case.cfg.num_heads
    backend = MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=64,
                         device="cpu", decode_kernel="auto", num_heads=H, impl="reference")
    specs = {"q": InputSpec((H, case.cfg.dims.qk_head_dim), torch.float32),
             "latent": InputSpec((case.cfg.dims.latent_dim,), torch.float32)}
    runner = GraphRunner(backend, lambda b, x: backend.forward(x["q"], x["latent"], None, case.layer, b),
                         batch_sizes=[4], mode=ForwardMode.DECODE, max_context=case.layout.req_to_token_pool.max_context,
                         input_specs=specs, device="cpu", use_graphs=False)
    kernels = (DecodeKernel.FA3, DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV)
    assert set(runner._batches) == {(4, 0, k) for k in kernels}
    for prefix, requests in (((40, 3, 77), [0, 1, 2]), ((70, 35), [2, 0])):
        step = follow_up(case, ForwardMode.DECODE, prefix, (1,) * len(prefix), requests=requests, seed=1)
        out = runner.run(step.batch, {"q": step.q, "latent": step.new_latent})
        lens = [p + 1 for p in prefix]
        want = kernel_choice.explain_decode_kernel(H, len(lens), max(lens), 64,
                                                   mean_seqlen_k=sum(lens) / len(lens)).kernel
        assert backend.graph_kernel is want
        assert rel_err(out, mla_oracle(step)) <= 1e-5


def test_device_metadata_falls_back_to_host_tables_where_the_buffers_do_not_allow_them(monkeypatch):
    """Past DEVICE_TABLES_MAX_ENTRIES (or with an encoder / local attention) the page table is written by the
    replay update while the graph prologue still runs: the same outputs as the eager step and the oracle."""
    import mla_fa3.metadata as metadata_mod

    monkeypatch.setattr(metadata_mod, "DEVICE_TABLES_MAX_ENTRIES", 4)  # any real buffer is larger
    name = "decode_p16"
    world = World(GRAPH_SPECS[name], "cpu", torch.float32, seed=zlib.crc32(name.encode()))
    runner = world.runner(device_metadata=True)
    assert runner.device_metadata and world.backend.device_metadata
    assert not world.backend.builder.capture_buffers.device_tables
    run_round(world, runner, max(GRAPH_SPECS[name].sizes), poison=False, check=_check_cpu, longest=True)
    run_round(world, runner, GRAPH_SPECS[name].live, poison=True, check=_check_cpu)


def test_a_prepare_that_fails_after_queueing_its_copies_leaves_the_padding_marks_as_they_were(monkeypatch):
    """Copies are queued, then run at once: if a check fails in between, the rows they would have reset must
    still count as stale, so the next run resets them (no stale input row survives into a padding row)."""
    from mla_fa3.graphs import runner as runner_mod

    spec = GRAPH_SPECS["decode_p16"]
    world = World(spec, "cpu", torch.float32)
    runner = world.runner()
    rows = world.start([9, 3, 30, 2])
    runner.run(*world.make_step(rows)[:2])  # fills rows 0-3 of every static buffer
    marks = bytes(runner.buffers.live_rows), bytes(runner.buffers.live_tokens)
    small = world.start([5])
    batch, inputs, _ = world.make_step(small)

    def failing_pad(*a, **k):
        raise ValueError("a check after fill_inputs queued its copies")

    monkeypatch.setattr(runner_mod, "pad_batch", failing_pad)
    with pytest.raises(ValueError, match="queued its copies"):
        runner.prepare(batch, inputs)
    assert (bytes(runner.buffers.live_rows), bytes(runner.buffers.live_tokens)) == marks
    monkeypatch.undo()
    runner.run(batch, inputs)  # 1 request, padded to 2: row 1 (filled by the first run) must be padding again
    buf = runner.buffers
    assert padded_size(1, spec.sizes) == 2
    assert not buf.inputs["q"][1].any() and buf.seq_lens[1].item() == buf.seq_len_fill
    assert buf.req_pool_indices[1].item() == buf.pad_req_index and buf.out_cache_loc[1].item() == 0
