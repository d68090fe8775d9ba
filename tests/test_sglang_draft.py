"""EAGLE's multi-step draft decode on mla_fa3 through SGLang (``integrations/sglang/draft.py``), on the CPU.

The draft step is built as SGLang's EAGLE builds it (``prepare_for_draft``: the draft slots after each prefix in
``req_to_token``, branch-major, ``topk · S`` of them; the draft batch's ``seq_lens`` the committed prefixes; the
worker sets ``out_cache_loc`` to step i's ``bs · topk`` slots before each step): the kit's pools hold the prefixes
and the rows' draft columns (an EXTEND case of ``topk · S`` new tokens per request lays them out), every draft slot
starts as NaN, and step i's layer call stores its new latent rows. Oracle: ``tests/oracle.dense_attention`` (fp64)
of each branch query over the prefix keys (recomputed by the kit's module) plus that branch's own keys of steps
0 .. i, written out here from the tensors the test made. That layout (what each step reads and stores) is checked
against SGLang's own kernels in tests/test_sglang_draft_reads.py.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from tests.oracle import dense_attention
from tests.sglang_world import (D_ROPE, R, ReplayAsEagerRun, case, check_close, kit, kit_fixture, needs_sglang,
                                prefix_latents, runner_like)

pytestmark = needs_sglang

if kit is not None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from mla_fa3.integrations.sglang import draft, plugin
    from mla_fa3.integrations.sglang.adapter import SGLangMLABackend
    from mla_fa3.integrations.sglang.convert import UnsupportedStepError

PREFIXES = (14, 5, 30)
FILL = 1


def _sglang_draft_columns(prefixes, topk: int, steps: int, page_size: int) -> torch.Tensor:
    """[bs, topk, steps] columns of SGLang's draft layout (``speculative/eagle_worker_common.py``,
    ``prepare_for_draft``), written out here: page 1 (or topk 1) contiguous, ``P + j·S + s``; page > 1 with topk > 1
    page-aligned per branch, ``prefix_base + j·num_new_pages·page + last_page + s``."""
    cols = torch.zeros(len(prefixes), topk, steps, dtype=torch.int64)
    for b, P in enumerate(prefixes):
        for j in range(topk):
            for s in range(steps):
                if page_size == 1 or topk == 1:
                    cols[b, j, s] = P + j * steps + s
                else:
                    last_page = P % page_size
                    num_new_pages = (last_page + steps + page_size - 1) // page_size
                    cols[b, j, s] = (P - last_page) + j * num_new_pages * page_size + last_page + s
    return cols


def _draft_world(topk: int, steps: int, *, page_size=1, prefixes=PREFIXES, num_heads=4):
    """The kit's pools with each request's prefix and its draft columns (SGLang's layout for the page size), the
    draft backend over them, and SGLang's draft batch (DECODE with spec_info, seq_lens = the prefixes). Every
    column past a prefix starts as NaN: draft slots before their step writes them, and at page > 1 the holes SGLang
    fills with copies of the prefix tail (which the prefix part reads where they are, in the prefix)."""
    cols = _sglang_draft_columns(prefixes, topk, steps, page_size)
    ends = [int(cols[b].max()) + 1 for b in range(len(prefixes))]
    c = case("EXTEND", prefix_lens=prefixes, extend_lens=tuple(e - P for e, P in zip(ends, prefixes)),
             page_size=page_size, num_heads=num_heads, name=f"draft_t{topk}_s{steps}_p{page_size}")
    fx = kit_fixture(c, max_context_len=256)
    runner = runner_like(fx, server_args=dict(speculative_eagle_topk=topk, speculative_num_steps=steps,
                                              speculative_num_draft_tokens=topk * steps + 1,
                                              speculative_algorithm="EAGLE"))
    backend = draft.SGLangMLAMultiStepDraftBackend(runner, topk, steps)
    bs = len(prefixes)
    table = fx.runner.req_to_token_pool.req_to_token
    rows = fx.forward_batch.req_pool_indices[:bs].long()
    draft_loc = table[rows[:, None, None], cols].long()  # draft_loc[b, j, s]
    for b, (P, e) in enumerate(zip(prefixes, ends)):
        for buf in fx.runner.token_to_kv_pool.kv_buffer:
            buf[table[rows[b], P:e].long()] = float("nan")
    fb = copy.copy(fx.forward_batch)
    fb.forward_mode = SGLangMode.DECODE
    fb.batch_size = bs
    fb.seq_lens = torch.tensor(prefixes, dtype=torch.int32)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    fb.seq_lens_sum = int(sum(prefixes))
    fb.req_pool_indices = rows
    fb.out_cache_loc = draft_loc.reshape(-1)
    fb.positions = None
    fb.spec_info = SimpleNamespace(topk=topk, is_draft_input=lambda: True)
    return fx, backend, fb, draft_loc


def _run_draft(fx, backend, fb, draft_loc, *, seed=0, replay=False):
    """Every step's layer call through ``attn_backends[i]`` (new latent rows stored at step i's slots); returns
    [(out [bs·topk, H, r], oracle fp64, tolerance)] per step."""
    bs, topk, steps = draft_loc.shape
    layer, H, dtype = fx.actual_module.attn_mqa, fx.case.num_heads, fx.runner.dtype
    g = torch.Generator().manual_seed(seed)
    T = bs * topk
    new_c, new_r, results = [], [], []
    with torch.no_grad():
        if replay:
            backend.init_forward_metadata_out_graph(fb)
            backend.init_forward_metadata_in_graph(fb)
        else:
            backend.init_forward_metadata(fb)
        for i in range(steps - 1):
            q_lat = torch.randn(T, H, R, generator=g).to(dtype)
            q_rope = torch.randn(T, H, D_ROPE, generator=g).to(dtype)
            c_kv = torch.randn(T, 1, R, generator=g).to(dtype)
            k_rope = torch.randn(T, 1, D_ROPE, generator=g).to(dtype)
            new_c.append(c_kv[:, 0])
            new_r.append(k_rope[:, 0])
            fb.out_cache_loc = draft_loc[:, :, i].reshape(-1)  # what draft_forward sets before step i
            with forward_context(ForwardContext(attn_backend=backend.attn_backends[i])):
                out = layer(q_lat.reshape(T, H * R), c_kv, c_kv, fb, q_rope=q_rope, k_rope=k_rope)
            oracle = []
            for b, (pc, pr) in enumerate(prefix_latents(fx)):
                for j in range(topk):
                    t = b * topk + j  # branch j of request b: the prefix, then its own keys of steps 0 .. i
                    keys_c = torch.cat([pc.double(), torch.stack([new_c[s][t] for s in range(i + 1)]).double()])
                    keys_r = torch.cat([pr.double(), torch.stack([new_r[s][t] for s in range(i + 1)]).double()])
                    o, _ = dense_attention(q_rope[t:t + 1], keys_r[:, None], keys_c[:, None], qv=q_lat[t:t + 1],
                                           scale=layer.scaling)
                    oracle.append(o)
            oracle = torch.cat(oracle)
            rounding = (oracle.to(dtype).double() - oracle).abs().max().item()
            # a tree step merges two partial outputs (prefix part, tree part), each rounded to the model's dtype
            # before the LSE merge, then rounds the result: one rounding more than a chain step's two
            results.append((out.reshape(T, H, R).double(), oracle, (3 if topk > 1 else 2) * rounding + 1e-5))
    return results


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk,steps", [(2, 3), (4, 4)])
def test_draft_tree_steps_match_the_branch_oracle(topk, steps, page_size):
    """topk branches per request: each step's branch query sees the prefix and its own draft keys — at page 1
    (draft tokens after the prefix) and at page 16 (each branch on its own pages)."""
    fx, backend, fb, draft_loc = _draft_world(topk, steps, page_size=page_size)
    assert len(backend.attn_backends) == steps - 1 and backend.needs_cpu_seq_lens
    for i, result in enumerate(_run_draft(fx, backend, fb, draft_loc)):
        check_close(*result)
        assert backend.attn_backends[i].explain().tree == (topk, topk * steps)


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_chain_topk1(page_size):
    """topk 1: a chain of steps, step i over the prefix and the draft tokens of steps 0 .. i (any page size)."""
    fx, backend, fb, draft_loc = _draft_world(1, 4, page_size=page_size)
    for result in _run_draft(fx, backend, fb, draft_loc):
        check_close(*result)
    assert backend.attn_backends[0].explain().tree is None


def test_draft_tree_is_not_the_whole_draft():
    """Read as if every branch saw every draft key written so far, step 1 would differ: the oracle can fail."""
    fx, backend, fb, draft_loc = _draft_world(2, 3)
    (_, _, _), (out, oracle, tol) = _run_draft(fx, backend, fb, draft_loc)
    check_close(out, oracle, tol)
    other = out.clone()
    other[0::2], other[1::2] = out[1::2], out[0::2]  # branches swapped: each would read the other's keys
    assert (other - oracle).abs().max().item() > 10 * tol


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_capture_then_replay_of_the_draft(page_size):
    """SGLang's protocol on the CPU stand-in: state for 4 requests, capture every step on fill-value rows, then a
    replay of 3 live requests padded to 4: the live branches match the oracle."""
    topk, steps, bs = 2, 3, 4
    prefixes = PREFIXES + (FILL,)
    fx, backend, fb, draft_loc = _draft_world(topk, steps, prefixes=prefixes, page_size=page_size)
    with torch.no_grad():
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * topk)
        cap = copy.copy(fb)
        cap.seq_lens = torch.full((bs,), FILL, dtype=torch.int32)
        cap.seq_lens_cpu = cap.seq_lens.clone()
        backend.init_forward_metadata_out_graph(cap, in_capture=True)
        backend.init_forward_metadata_in_graph(cap)
        assert all(b.explain().graph for b in backend.attn_backends)
    for out, oracle, tol in _run_draft(fx, backend, fb, draft_loc, replay=True):
        check_close(out[: 3 * topk], oracle[: 3 * topk], tol)
    assert all(b.explain().graph for b in backend.attn_backends)



def test_draft_extend_batch_is_refused_by_name():
    """Eagerly and on the CUDA-graph path, where each step plans on SGLang's inner DECODE view of the batch (the
    view keeps the batch's mode as actual_forward_mode): refused before any step is planned."""
    fx, backend, fb, _ = _draft_world(2, 3)
    fb.forward_mode = SGLangMode.DRAFT_EXTEND_V2  # SGLang 0.5.17: the only draft-extend mode
    with pytest.raises(UnsupportedStepError, match="DRAFT_EXTEND runs on the draft-extend backend"):
        backend.init_forward_metadata(fb)
    with torch.no_grad():
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=8)
        with pytest.raises(UnsupportedStepError, match="DRAFT_EXTEND runs on the draft-extend backend"):
            backend.init_forward_metadata_out_graph(fb, in_capture=True)


def _factory(name, *, draft_name=None, steps=3, topk=2, runner=None, mode="prefill"):
    f = DraftBackendFactory.__new__(DraftBackendFactory)  # SGLang's class; only the fields its methods read
    f.server_args = SimpleNamespace(attention_backend=name, decode_attention_backend=None,
                                    prefill_attention_backend=None, speculative_attention_mode=mode)
    f.draft_model_runner, f.topk, f.speculative_num_steps = runner, topk, steps
    f.draft_attn_backend = draft_name
    return f


def test_hooks_are_registered_once():
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    plugin.register()
    for target, hook in plugin.DRAFT_HOOKS.items():
        assert [h for _, h, _ in HookRegistry._hooks[target]].count(hook) == 1


def test_hook_routes_mla_fa3_to_ours_and_leaves_fa3_alone():
    fx, _, _, _ = _draft_world(2, 3)
    runner = runner_like(fx, server_args=dict(speculative_eagle_topk=2, speculative_num_steps=3,
                                              speculative_num_draft_tokens=7, speculative_algorithm="EAGLE"))
    calls = []
    decode_hook, extend_hook = plugin.DRAFT_HOOKS.values()  # what plugin.register gives SGLang's HookRegistry

    def original(factory, *a, **k):
        calls.append(factory.draft_attn_backend or factory.server_args.attention_backend)
        return "sglang's"

    ours = decode_hook(original, _factory("mla_fa3", runner=runner))
    assert isinstance(ours, draft.SGLangMLAMultiStepDraftBackend) and len(ours.attn_backends) == 2 and not calls
    assert decode_hook(original, _factory("fa3", runner=runner)) == "sglang's" and calls == ["fa3"]
    # --speculative-draft-attention-backend names the draft's backend: SGLang's table
    assert decode_hook(original, _factory("mla_fa3", draft_name="triton")) == "sglang's"
    assert decode_hook(original, _factory("mla_fa3", steps=1)) is None  # as SGLang: no multi-step
    # DRAFT_EXTEND of an mla_fa3 draft: our adapter over the draft's pools, SGLang's table not asked
    n_calls = len(calls)
    made = extend_hook(original, _factory("mla_fa3", runner=runner))
    assert isinstance(made, SGLangMLABackend) and len(calls) == n_calls
    assert made.token_to_kv_pool is runner.token_to_kv_pool
    extend_hook(original, _factory("triton"))
    assert calls[-1] == "triton"


def test_hook_applied_by_sglang_routes_the_factory():
    """After HookRegistry.apply_hooks (what load_plugins runs), SGLang's own factory method returns ours."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    fx, _, _, _ = _draft_world(2, 3)
    runner = runner_like(fx, server_args=dict(speculative_eagle_topk=2, speculative_num_steps=3,
                                              speculative_num_draft_tokens=7, speculative_algorithm="EAGLE"))
    runner.model_config.hf_config = SimpleNamespace()  # read by SGLang's conv-sidecar check
    HookRegistry.apply_hooks()
    made = _factory("mla_fa3", runner=runner).create_decode_backend()
    assert isinstance(made, draft.SGLangMLAMultiStepDraftBackend)


@pytest.fixture
def kit_draft_runner(monkeypatch):
    """SGLang's attention kit's EAGLE draft runner module, ready for the CPU: SGLang's EAGLEDraftCudaGraphRunner with
    its replay run eagerly (:class:`tests.sglang_world.ReplayAsEagerRun`), the kit's seeding without its CUDA
    generator, no graph-capture context."""
    from tools.import_placeholders import install

    install(("setproctitle", "uvicorn", "fastapi"))  # imported by SGLang's scheduler module, never called here
    import sglang.srt.speculative.eagle_draft_cuda_graph_runner as graph_runner
    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_runner as dr

    @contextlib.contextmanager
    def seeded_rng(seed, *, device):  # the kit's, without its CUDA generator
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            yield
        finally:
            torch.random.set_rng_state(state)

    @contextlib.contextmanager
    def one_rank_capture():
        yield SimpleNamespace(stream=None)

    monkeypatch.setattr(graph_runner, "resolve_decode_backend", ReplayAsEagerRun)
    monkeypatch.setattr(dr, "_seeded_rng", seeded_rng)
    monkeypatch.setattr(dr, "_single_rank_graph_capture", one_rank_capture)
    return dr


@pytest.mark.parametrize("topk,page_size", [(2, 1), (1, 16)])
def test_kit_draft_graph_runner_on_the_cpu(kit_draft_runner, topk, page_size):
    """SGLang's attention kit's EAGLE draft case through SGLang's own EAGLEDraftCudaGraphRunner on our backend (the
    GPU test's case: prefixes 14, 5, 30, captured for 4 requests, replayed for 3), the graph replay run eagerly: the
    kit asserts the replay's draft tokens, scores and parents equal its eager run's. Our own reference kernels on the
    CPU; the GPU runs the real graphs (tests/test_sglang_gpu.py)."""
    from tests.sglang_world import TESTCASE

    c = case("DECODE", prefix_lens=PREFIXES, page_size=page_size, name=f"draft_mla_fa3_{topk}_{page_size}")
    kit_draft_runner.run_mla_eagle_draft_cuda_graph_runner_case(TESTCASE, c, topk=topk, speculative_num_steps=3,
                                                                speculative_num_draft_tokens=4 if topk > 1 else 3,
                                                                kv_lora_rank=R, qk_rope_head_dim=D_ROPE,
                                                                device="cpu", dtype=torch.bfloat16)


def test_draft_probe_guard_follows_the_pool_through_the_kit_case(kit_draft_runner):
    """tools/draft_graph_probe.py --guard on the CPU (the GPU run is the probe's point: this checks the tool before
    device time is spent on it, and what it checks of us): every store of the kit's model leaves exactly the rows it
    was given at its slots and nothing else; nothing changes the pool between two stores; our draft forwards change
    no row (the model stores, not the backend); the eager run and the replay store the same rows at the same slots.
    Oracle: snapshots of SGLang's own pool buffers, compared row by row."""
    from tools import draft_graph_probe as probe

    found = probe.guard()
    assert found["kit"] == "passed"
    # the eager run: 2 prefix stores and 2 draft steps; the replay: the same 2, 2 capture steps (every slot the
    # padding slot 0), the prefix stored again before the replay, its 2 draft steps
    assert found["stores"] == 11 and found["forwards"] == 6
    assert found["compared"] == 5  # the replay's prefix (3) and draft (2) stores against the eager run's
    assert found["stored_off"] == 0.0
    assert (found["outside"], found["between"], found["ours"], found["given_off"]) == ([], [], [], [])
