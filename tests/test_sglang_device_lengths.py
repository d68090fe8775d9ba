"""A DECODE graph that reads its lengths on the device from SGLang's static inputs (``graphs.capture.LengthSources``).

SGLang's CUDA-graph runner keeps ``seq_lens`` / ``req_pool_indices`` / ``seq_lens_cpu`` buffers, rewrites them in place
before every replay (padding rows: length 1, row 0) and hands the backend views ``[:bs]`` of the same buffers at
capture and at each replay (``decode_cuda_graph_runner.build_replay_fb_view``). Emulated here on the CPU with the
kit's pools: replays of other lengths and live counts give the fp64 attention over each request's keys, the update
before each replay runs no tensor op beyond views, and what does not fit is refused by name before anything runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.oracle import dense_attention
from tests.sglang_world import (D_ROPE, R, ForwardContext, SGLangMode, case, check_close, forward_context,
                                kit_fixture, needs_sglang, prefix_latents, runner_like)

pytestmark = needs_sglang

if SGLangMode is not None:
    from mla_fa3.integrations.sglang.adapter import GRAPH_LENGTHS_ENV, SGLangMLABackend

BS = 4  # the captured size
VIEWS = ("aten.slice.", "aten.detach.", "aten.view.", "aten.alias.")  # no data moved, no kernel


class _Ops(TorchDispatchMode):
    """The aten ops run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Runner:
    """SGLang's decode graph runner's static inputs for ``BS`` requests of ``k`` new tokens (DECODE: 1; a chain
    TARGET_VERIFY: its k draft tokens) and its replay view of them."""

    def __init__(self, fx, k: int = 1):
        self.fx, self.k = fx, k
        dev = fx.runner.device
        self.seq_lens = torch.ones(BS, dtype=torch.int32, device=dev)
        self.seq_lens_cpu = torch.ones(BS, dtype=torch.int32)
        self.req_pool_indices = torch.zeros(BS, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(BS * k, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(BS * k, dtype=torch.int64, device=dev)
        self.num_padding, self.prefix = 0, []
        # each request's latent rows as the steps leave them (a step stores its new rows at columns prefix + i)
        rows = fx.forward_batch.req_pool_indices.tolist()
        width = fx.runner.req_to_token_pool.req_to_token.shape[1]
        self.latents = {r: tuple(torch.cat([t.cpu(), t.new_zeros(width - t.shape[0], t.shape[1], device="cpu")])
                                 for t in lat) for r, lat in zip(rows, prefix_latents(fx))}

    @property
    def verify(self) -> bool:
        return self.k > 1

    def fill(self, rows: list[int], seqs: list[int]) -> None:
        """``fill_from``: the live rows first, the padded tail reset (length 1, row 0, slot 0). ``seqs``: SGLang's
        ``seq_lens`` — a decode step's new token included, a verify step's draft tokens not."""
        n, k = len(rows), self.k
        req_to_token = self.fx.runner.req_to_token_pool.req_to_token
        self.prefix = [s if self.verify else s - 1 for s in seqs]  # the first new token's column
        for buf in (self.seq_lens, self.seq_lens_cpu):
            buf.fill_(1)
            buf[:n] = torch.tensor(seqs, dtype=torch.int32)
        self.req_pool_indices.zero_()
        self.req_pool_indices[:n] = torch.tensor(rows)
        self.out_cache_loc.zero_()
        self.out_cache_loc[: n * k] = torch.stack([req_to_token[r, p + i].long() for r, p in zip(rows, self.prefix)
                                                   for i in range(k)])
        self.positions.zero_()
        self.positions[: n * k] = torch.tensor([p + i for p in self.prefix for i in range(k)])
        self.num_padding = BS - n

    def view(self, **changes):
        """The batch as the captured graph sees it (the static buffers, padding included)."""
        mode = SGLangMode.TARGET_VERIFY if self.verify else SGLangMode.DECODE
        spec = SimpleNamespace(draft_token_num=self.k, topk=1) if self.verify else None
        fb = dict(batch_size=BS, forward_mode=mode, actual_forward_mode=mode,
                  req_pool_indices=self.req_pool_indices[:BS], seq_lens=self.seq_lens[:BS],
                  seq_lens_cpu=self.seq_lens_cpu[:BS], seq_lens_sum=int(self.seq_lens_cpu.sum()),
                  out_cache_loc=self.out_cache_loc[: BS * self.k], positions=self.positions[: BS * self.k],
                  encoder_lens=None, num_padding=self.num_padding, spec_info=spec)
        return SimpleNamespace(**{**fb, **changes})

    def replay_view(self):
        """The batch SGLang's runner hands the replay update (``build_replay_fb_view``): the static buffers, but the
        live rows' ``out_cache_loc`` only."""
        return self.view(out_cache_loc=self.out_cache_loc[: (BS - self.num_padding) * self.k].clone())


def _captured(c=None, k: int = 1, **kw):
    c = c or case("DECODE", prefix_lens=(40, 17, 64), page_size=16, name="device_lengths")
    fx = kit_fixture(c, runner_batch_size=BS, **kw)
    if k > 1:  # the target model of EAGLE with topk 1: k draft tokens per verify step
        fx.backend = SGLangMLABackend(runner_like(fx, server_args=dict(
            speculative_eagle_topk=1, speculative_num_draft_tokens=k, speculative_algorithm="EAGLE")))
    runner = _Runner(fx, k)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_cuda_graph_state(max_bs=BS, max_num_tokens=BS * k)
        fx.backend.init_forward_metadata_out_graph(runner.view(), in_capture=True)
        fx.backend.init_forward_metadata_in_graph(runner.view())
    return fx, runner


def _inputs(fx, seed, k: int = 1):
    """(q_lat [T, H, r], q_rope [T, H, d_rope], c_kv [T, 1, r], k_rope [T, 1, d_rope]) bf16, T = BS·k."""
    g, H, T = torch.Generator().manual_seed(seed), fx.case.num_heads, BS * k
    shapes = ((T, H, R), (T, H, D_ROPE), (T, 1, R), (T, 1, D_ROPE))
    return tuple(torch.randn(*s, generator=g).to(fx.runner.device, torch.bfloat16) for s in shapes)


def _layer_call(fx, fb, inputs):
    q_lat, q_rope, c_kv, k_rope = inputs
    T, H = q_lat.shape[0], fx.case.num_heads
    return fx.actual_module.attn_mqa(q_lat.reshape(T, H * R), c_kv, c_kv, fb, q_rope=q_rope, k_rope=k_rope)


def _step(fx, runner, fb, seed):
    """The graph's step for the runner's current inputs, run eagerly after the replay update (the in-graph half,
    then the layer); returns (out [live tokens, H, r], the live tokens' fp64 oracle, tolerance)."""
    inputs = _inputs(fx, seed, runner.k)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata_in_graph(fb)
        out = _layer_call(fx, fb, inputs)
    live = (BS - runner.num_padding) * runner.k
    return (out.reshape(BS * runner.k, fx.case.num_heads, R)[:live].cpu().double(), *_oracle(fx, runner, inputs))


def _oracle(fx, runner, inputs):
    """The live tokens' fp64 attention over their keys as the step leaves them (each request's prefix, then its new
    tokens causally), and its tolerance (bf16 output)."""
    q_lat, q_rope, c_kv, k_rope = (t.cpu() for t in inputs)
    layer, k = fx.actual_module.attn_mqa, runner.k
    oracle = []
    for b in range(BS - runner.num_padding):
        pc, pr = runner.latents[int(runner.req_pool_indices[b])]
        p, t = runner.prefix[b], slice(b * k, (b + 1) * k)
        pc[p: p + k], pr[p: p + k] = c_kv[t, 0], k_rope[t, 0]  # the step stores its new rows there
        keys_c, keys_r = pc[: p + k].double(), pr[: p + k].double()
        o, _ = dense_attention(q_rope[t], keys_r[:, None], keys_c[:, None], qv=q_lat[t], scale=layer.scaling,
                               causal=True)
        oracle.append(o)
    oracle = torch.cat(oracle)
    rounding = (oracle.to(torch.bfloat16).double() - oracle).abs().max().item()
    return oracle, 2 * rounding + 1e-5


def _check_metadata(fx, runner):
    """The metadata the graph's layers read, against the runner's buffers and SGLang's req_to_token, brute force."""
    md, p = fx.backend.forward_metadata, fx.runner.page_size
    req_to_token = fx.runner.req_to_token_pool.req_to_token
    extra = runner.k if runner.verify else 0
    seqs, rows = [s + extra for s in runner.seq_lens.tolist()], runner.req_pool_indices.tolist()
    assert md.cache_seqlens.tolist() == seqs
    assert md.cu_seqlens_k.tolist() == [sum(seqs[:b]) for b in range(BS + 1)]
    for b, (row, s) in enumerate(zip(rows, seqs)):
        pages = -(-s // p)
        assert md.page_table[b, :pages].tolist() == [int(req_to_token[row, j * p]) // p for j in range(pages)]


@pytest.mark.parametrize("setting", ["device", "host"])
def test_replays_read_the_runners_rewritten_buffers(monkeypatch, setting):
    """Live counts and lengths change between replays; the runner rewrites its buffers in place, the update before
    each replay runs no tensor op (views only), and the step attends over exactly each live request's keys.
    ``MLA_FA3_GRAPH_LENGTHS=host``: the same answers, every replay staging the lengths instead."""
    monkeypatch.setenv(GRAPH_LENGTHS_ENV, setting)
    fx, runner = _captured()
    device = setting == "device"
    rows = fx.forward_batch.req_pool_indices.tolist()
    full = [p + 1 for p in fx.case.prefix_lens]  # each request's prefix, then the new token
    for i, seqs in enumerate([full, [9, full[1]], [1, 5, 33], [full[2]]]):
        runner.fill(rows[: len(seqs)] if i != 3 else [rows[2]], seqs)
        fb, replay = runner.view(), runner.replay_view()
        with _Ops() as seen:
            fx.backend.init_forward_metadata_out_graph(replay)
        assert ([op for op in seen.ops if not op.startswith(VIEWS)] == []) == device, seen.ops
        check_close(*_step(fx, runner, fb, seed=i))
        assert ("lengths read on the device" in fx.backend.explain().reason) == device
        _check_metadata(fx, runner)


@pytest.mark.parametrize("setting", ["device", "host"])
def test_chain_verify_replays_read_the_runners_rewritten_buffers(monkeypatch, setting):
    """EAGLE's target verify with topk 1 (k = 3 draft tokens a request, SGLang's seq_lens without them): the graph
    adds the drafts itself; each draft token sees its request's prefix and the drafts before it, against fp64."""
    monkeypatch.setenv(GRAPH_LENGTHS_ENV, setting)
    k = 3
    c = case("TARGET_VERIFY", prefix_lens=(40, 17, 60), extend_lens=(k,) * 3, page_size=16, name="verify_lengths")
    fx, runner = _captured(c, k=k)
    device = setting == "device"
    rows = fx.forward_batch.req_pool_indices.tolist()
    for i, (live, seqs) in enumerate([(rows, list(c.prefix_lens)), (rows[:2], [9, 17]), ([rows[2]], [31]),
                                      (rows, [1, 16, 33])]):
        runner.fill(live, seqs)
        fb, replay = runner.view(), runner.replay_view()
        with _Ops() as seen:
            fx.backend.init_forward_metadata_out_graph(replay)
        assert ([op for op in seen.ops if not op.startswith(VIEWS)] == []) == device, seen.ops
        check_close(*_step(fx, runner, fb, seed=i))
        assert fx.backend.explain().mode == "TARGET_VERIFY"
        assert ("lengths read on the device" in fx.backend.explain().reason) == device
        _check_metadata(fx, runner)


def test_a_rebuilt_batch_is_copied_into_the_captured_buffers():
    """A caller that hands other tensors at replay than at capture (the kit's graph runner builds a new batch): their
    values land in the captured ones, which the graph reads, and the answer is the same."""
    fx, runner = _captured()
    rows = fx.forward_batch.req_pool_indices.tolist()
    runner.fill(rows[:2], [12, 18])
    fb = runner.view(seq_lens=runner.seq_lens.clone(), req_pool_indices=runner.req_pool_indices.int())
    captured = runner.seq_lens.clone()
    runner.seq_lens.fill_(1)  # stale: the copy must bring the replay's values in
    fx.backend.init_forward_metadata_out_graph(fb)
    assert torch.equal(runner.seq_lens, captured)
    check_close(*_step(fx, runner, fb, seed=7))


def test_a_verify_graph_of_the_same_size_leaves_the_decode_graph_alone():
    """EAGLE's target model captures TARGET_VERIFY graphs beside the DECODE ones, at the same sizes: the DECODE graph
    of bs 4 still reads its lengths on the device afterwards."""
    fx, runner = _captured()
    verify = runner.view(forward_mode=SGLangMode.TARGET_VERIFY, actual_forward_mode=SGLangMode.TARGET_VERIFY,
                         spec_info=SimpleNamespace(draft_token_num=1, topk=1))
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata_out_graph(verify, in_capture=True)
    assert fx.backend.explain().mode == "TARGET_VERIFY"
    rows = fx.forward_batch.req_pool_indices.tolist()
    runner.fill(rows, [p + 1 for p in fx.case.prefix_lens])
    fx.backend.init_forward_metadata_out_graph(runner.view())
    assert "lengths read on the device" in fx.backend.explain().reason
    check_close(*_step(fx, runner, runner.view(), seed=3))


def test_graph_lengths_setting_is_checked(monkeypatch):
    monkeypatch.setenv(GRAPH_LENGTHS_ENV, "staged")
    with pytest.raises(ValueError, match="MLA_FA3_GRAPH_LENGTHS must be device or host"):
        kit_fixture(case("DECODE", prefix_lens=(3,), name="lengths_setting"))


def test_what_does_not_fit_is_refused_before_anything_runs():
    fx, runner = _captured()
    rows = fx.forward_batch.req_pool_indices.tolist()
    runner.fill(rows[:1], [5])
    runner.seq_lens_cpu[0] = runner.seq_lens[0] = fx.runner.req_to_token_pool.req_to_token.shape[1] + 1
    with pytest.raises(ValueError, match="max_context"):
        fx.backend.init_forward_metadata_out_graph(runner.view())
    runner.fill(rows[:1], [5])
    runner.seq_lens_cpu[0] = 0
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1"):
        fx.backend.init_forward_metadata_out_graph(runner.view())
    runner.fill(rows[:1], [5])
    with pytest.raises(ValueError, match="seq_lens_cpu is None"):
        fx.backend.init_forward_metadata_out_graph(runner.view(seq_lens_cpu=None))
    with pytest.raises(ValueError, match=r"seq_lens must be \[4\]"):
        fx.backend.init_forward_metadata_out_graph(runner.view(seq_lens=runner.seq_lens[:3].clone()))
    assert fx.backend.forward_metadata is None  # a refused update leaves no step behind
    # the graph reads its lengths on the device: the host-staged replay would be ignored by it, so it is refused
    ours = fx.backend.backend
    batch = fx.backend._device_lengths[("DECODE", BS)]
    with pytest.raises(ValueError, match="init_forward_metadata_replay_device_lengths"):
        ours.init_forward_metadata_replay_cuda_graph(batch, bs=BS)


def test_only_decode_graphs_over_device_tables_read_lengths_on_the_device():
    from mla_fa3.batch import ForwardMode
    from mla_fa3.graphs.capture import LengthSources

    fx, runner = _captured()
    ours = fx.backend.backend
    assert ours.reads_lengths_on_device
    src = LengthSources(runner.seq_lens[:2], runner.req_pool_indices[:2])
    with pytest.raises(ValueError, match="DECODE and chain TARGET_VERIFY graphs .* got DRAFT_DECODE"):
        ours.init_forward_metadata_capture_cuda_graph(2, ForwardMode.DRAFT_DECODE, lengths_from=src)
    with pytest.raises(ValueError, match="extra must be 0 for DECODE"):
        ours.init_forward_metadata_capture_cuda_graph(
            2, ForwardMode.DECODE, lengths_from=LengthSources(runner.seq_lens[:2], runner.req_pool_indices[:2], 1))
    with pytest.raises(ValueError, match="extra must be an int >= 0"):
        ours.init_forward_metadata_capture_cuda_graph(
            2, ForwardMode.TARGET_VERIFY,
            lengths_from=LengthSources(runner.seq_lens[:2], runner.req_pool_indices[:2], -1))
    with pytest.raises(ValueError, match=r"seq_lens must be \[3\]"):
        ours.init_forward_metadata_capture_cuda_graph(3, ForwardMode.DECODE, lengths_from=src)
    with pytest.raises(TypeError, match="req_pool_indices must be an int32 / int64"):
        ours.init_forward_metadata_capture_cuda_graph(
            2, ForwardMode.DECODE, lengths_from=LengthSources(runner.seq_lens[:2], runner.seq_lens[:2].float()))
    ours.init_forward_metadata_capture_cuda_graph(2, ForwardMode.DECODE)  # captured without: host replays only
    with pytest.raises(ValueError, match="captured without lengths_from"):
        ours.init_forward_metadata_replay_device_lengths(2, runner.seq_lens_cpu[:2], runner.seq_lens[:2],
                                                         runner.req_pool_indices[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("page", [16, 64])
def test_real_cuda_graph_reads_the_runners_buffers(page, k):
    """The same under a real torch.cuda.graph (FA3 / FlashMLA / split-KV, as the adapter picks): one capture at bs 4
    over the runner's buffers — a DECODE graph, or a chain TARGET_VERIFY graph of 3 draft tokens — then replays of
    other live counts and lengths rewritten in place, each after SGLang's replay update alone."""
    mode = "DECODE" if k == 1 else "TARGET_VERIFY"
    c = case(mode, prefix_lens=(100, 37, 64), extend_lens=() if k == 1 else (k,) * 3, page_size=page, num_heads=16,
             name=f"device_lengths_{page}_{k}")
    fx, runner = _captured(c, k=k, device="cuda", max_context_len=256)
    rows = fx.forward_batch.req_pool_indices.tolist()
    first = [p + 1 for p in c.prefix_lens] if k == 1 else list(c.prefix_lens)  # SGLang's seq_lens of the full step
    static = _inputs(fx, seed=0, k=k)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fx.backend)):
        fx.backend.init_forward_metadata_in_graph(runner.view())
        _layer_call(fx, runner.view(), static)  # warm-up (Triton compiles, FA3 loads); writes the padding slot 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fx.backend.init_forward_metadata_in_graph(runner.view())
            out = _layer_call(fx, runner.view(), static)
        for i, (live, seqs) in enumerate([(rows, first), (rows[:2], [9, first[1]]), ([rows[2]], [first[2]]),
                                          (rows, [1, 20, first[2]])]):
            runner.fill(live, seqs)
            fx.backend.init_forward_metadata_out_graph(runner.replay_view())
            assert "lengths read on the device" in fx.backend.explain().reason
            step = _inputs(fx, seed=i + 1, k=k)
            for dst, src in zip(static, step):
                dst.copy_(src)
            graph.replay()
            got = out.reshape(BS * k, c.num_heads, R)[: len(live) * k].cpu().double()
            check_close(got, *_oracle(fx, runner, step))
