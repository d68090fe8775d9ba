"""MLABackend / MultiStepDraftBackend input checking: named errors raised before any kernel runs.

Each bad call must raise ``ValueError`` / ``TypeError`` whose message names the argument, leave the
latent pool untouched and run no kernel (the kernel entry points are patched to fail the test).
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import follow_up, make_batch, make_layout, make_mla_case, mla_oracle, padded, rel_err
from specs import BatchSpec

from mla_fa3 import ops
from mla_fa3.policy.paths import DecodeKernel
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend
from mla_fa3.kv.pools import MLATokenPool

DEC = ForwardMode.DECODE


def backend_for(case, **kw) -> MLABackend:
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device=case.layout.device, impl="reference", **kw)


@pytest.fixture()
def ready():
    case = make_mla_case("small_decode", "odd_small", seed=1)
    backend = backend_for(case)
    backend.init_forward_metadata(case.batch)
    return case, backend


def _bad_calls(case):
    d, H, T = case.cfg.dims, case.cfg.num_heads, 3
    q, lat, L, b = case.q, case.new_latent, case.layer, case.batch
    return {
        "q heads": ((torch.randn(T, H + 1, d.qk_head_dim), lat, None, L, b), ValueError, "q must be"),
        "q width": ((torch.randn(T, H, d.qk_head_dim - 1), lat, None, L, b), ValueError, "q must be"),
        "q rows": ((q[:2], lat[:2], None, L, b), ValueError, "q must have batch.num_tokens"),
        "q dtype": ((q.double(), lat, None, L, b), TypeError, "q dtype"),
        "latent width": ((q, lat[:, :-1], None, L, b), ValueError, "k must be the latent"),
        "latent dtype": ((q, lat.half(), None, L, b), TypeError, "k dtype"),
        "c_kv width": ((q, lat[:, :5], lat[:, 5:], L, b), ValueError, "k must be the c_kv"),
        "k_rope width": ((q, lat[:, : d.kv_lora_rank], lat[:, : d.kv_lora_rank], L, b), ValueError, "v must be the k_rope"),
        "layer type": ((q, lat, None, "layer", b), TypeError, "layer must be"),
        "batch type": ((q, lat, None, L, None), TypeError, "batch must be"),
    }


@pytest.mark.parametrize("what", ["q heads", "q width", "q rows", "q dtype", "latent width", "latent dtype",
                                  "c_kv width", "k_rope width", "layer type", "batch type"])
def test_forward_named_errors(ready, monkeypatch, what):
    case, backend = ready
    args, exc, msg = _bad_calls(case)[what]
    monkeypatch.setattr(ops, "flash_attn_with_kvcache", lambda *a, **k: pytest.fail("kernel ran"))
    before = case.pool.kv_buffer[case.layer.layer_id].clone()
    with pytest.raises(exc, match=msg):
        backend.forward(*args)
    assert torch.equal(case.pool.kv_buffer[case.layer.layer_id].nan_to_num(7.0), before.nan_to_num(7.0))


def test_forward_before_planning_and_mode_mismatch(ready):
    case, _ = ready
    fresh = backend_for(case)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        fresh.forward(case.q, case.new_latent, None, case.layer, case.batch)
    ext = make_batch(case.layout, ForwardMode.EXTEND, [5, 17, 33], [1, 1, 1])
    fresh.init_forward_metadata(ext)
    with pytest.raises(ValueError, match="planned step is EXTEND"):
        fresh.forward(case.q, case.new_latent, None, case.layer, case.batch)


def test_layer_without_weights_and_pool_mismatch(ready):
    case, backend = ready
    from mla_fa3.layer import AttentionLayer
    bare = AttentionLayer.mla_layer(1, case.cfg.num_heads, case.cfg.dims, 0.2)
    with pytest.raises(ValueError, match="mla_weights"):
        backend.forward(case.q, case.new_latent, None, bare, case.batch)
    far = AttentionLayer.mla_layer(7, case.cfg.num_heads, case.cfg.dims, 0.2, mla_weights=case.layer.mla_weights)
    with pytest.raises(ValueError, match="layer_id"):
        backend.forward(case.q, case.new_latent, None, far, case.batch)


def test_constructor_named_errors():
    layout = make_layout([5], 16)
    pool = MLATokenPool(1, layout.num_pages, 16, 8, 4, torch.float32, "cpu")
    kw = dict(req_to_token_pool=layout.req_to_token_pool, kv_pool=pool, page_size=16, device="cpu")
    with pytest.raises(ValueError, match="page_size 64"):
        MLABackend(**kw, decode_kernel="flashmla", num_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        MLABackend(**kw, decode_kernel="auto")
    with pytest.raises(ValueError, match="decode_kernel"):
        MLABackend(**kw, decode_kernel="flash")
    with pytest.raises(ValueError, match="prefill_path"):
        MLABackend(**kw, prefill_path="fast")
    with pytest.raises(TypeError, match="kv_pool"):
        MLABackend(**{**kw, "kv_pool": object()})
    with pytest.raises(ValueError, match="page_size"):
        MLABackend(**{**kw, "page_size": 1})
    with pytest.raises(ValueError, match="num_steps"):
        MultiStepDraftBackend(0, **kw)
    backend = MLABackend(**kw)
    assert backend.decode_kernel is DecodeKernel.FA3 and backend.explain() is None
    backend.init_cuda_graph_state(2, 32)
    with pytest.raises(ValueError, match="mode must be"):
        backend.init_forward_metadata_capture_cuda_graph(2, ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="bs must be"):
        backend.init_forward_metadata_capture_cuda_graph(0, DEC)


def test_pool_tuple_and_mha_layer_needs_an_mha_pool():
    from mla_fa3.kv.pools import MHATokenPool
    from mla_fa3.layer import AttentionLayer, LayerKind
    case = make_mla_case("small_decode", "tiny")
    backend = backend_for(case)
    backend.init_forward_metadata(case.batch)
    mha = AttentionLayer(layer_id=0, kind=LayerKind.MHA, num_heads=4, num_kv_heads=2, head_dim=8,
                         v_head_dim=8, scaling=0.3)
    q = torch.randn(3, 4, 8)
    with pytest.raises(ValueError, match="MHATokenPool"):
        backend.forward(q, torch.randn(3, 2, 8), torch.randn(3, 2, 8), mha, case.batch)
    mha_pool = MHATokenPool(1, case.layout.num_pages, 16, 2, 8, 8, torch.float32, "cpu")
    both = MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=(mha_pool, case.pool),
                      page_size=16, device="cpu")
    assert both.mla_pool is case.pool and both.mha_pool is mha_pool
    with pytest.raises(TypeError, match="kv_pool"):
        MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=(case.pool, case.pool),
                   page_size=16, device="cpu")


def test_backend_range_checks_slots_and_pages_against_the_pool_before_any_kernel():
    """The builder knows the pool size: a slot past the pool (in out_cache_loc or in the request's
    req_to_token row) is a named error at planning time, and nothing is written."""
    case = make_mla_case("small_decode", "tiny", seed=3)
    backend = backend_for(case)
    bad = case.batch
    bad.out_cache_loc = bad.out_cache_loc.clone()
    bad.out_cache_loc[0] = case.pool.num_slots + 5
    with pytest.raises(ValueError, match="out_cache_loc"):
        backend.init_forward_metadata(bad)
    case = make_mla_case("small_decode", "tiny", seed=3)
    row = case.layout.rows[0]
    case.layout.req_to_token_pool.req_to_token[row, 0] = case.pool.num_slots + 64
    before = [b.clone() for b in case.pool.kv_buffer]
    with pytest.raises(ValueError, match="page"):
        backend_for(case).init_forward_metadata(case.batch)
    assert all(torch.equal(a.nan_to_num(7), b.nan_to_num(7)) for a, b in zip(before, case.pool.kv_buffer))


def test_whole_row_kernels_need_flashmla_dims_where_the_compiled_kernels_run(monkeypatch):
    """FlashMLA and split-KV read only a 512 + 64 latent row: where the compiled kernels would run (the
    impl resolves to FA3), another row is refused at construction for an explicit choice, and 'auto'
    never picks them; the torch reference reads any row."""
    case = make_mla_case(BatchSpec(ForwardMode.DECODE, (70, 5), (1, 1), page_size=64), "tiny")
    kw = dict(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=64, device="cpu",
              num_heads=case.cfg.num_heads, mla_dims=case.cfg.dims)
    assert MLABackend(**kw, decode_kernel="flashmla").whole_row_kernels_fit  # reference: any row
    monkeypatch.setattr(ops, "resolve_impl", lambda impl, device: ops.Impl.FA3)
    for kernel in ("flashmla", "splitkv"):
        with pytest.raises(ValueError, match=f"decode_kernel={kernel} reads a latent row of 512 \\+ 64 only"):
            MLABackend(**kw, decode_kernel=kernel)
    auto = MLABackend(**kw, decode_kernel="auto")
    assert auto.graph_kernels() == (DecodeKernel.FA3,)
    kernel, reason = auto.planner.kernel_choice.choose_decode_kernel(2, 75, 40.0)
    assert kernel is DecodeKernel.FA3 and "512 + 64" in reason


def test_device_metadata_step_refuses_layers_before_its_prologue():
    """With device metadata the page table and FlashMLA schedule are derived by the graph's prologue: a layer
    run on a captured or replayed plan before it would read stale tables, so it raises, changing nothing."""
    spec = BatchSpec(ForwardMode.DECODE, (40, 3, 77), (1,) * 3, page_size=16)
    case = make_mla_case(spec, "tiny", seed=9)
    backend = backend_for(case)
    backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context, device_metadata=True)
    backend.init_forward_metadata_capture_cuda_graph(4, ForwardMode.DECODE)
    step = follow_up(case, ForwardMode.DECODE, (40, 3, 77), (1,) * 3, requests=[0, 1, 2], seed=3, pad_to=4)
    backend.init_forward_metadata_replay_cuda_graph(step.batch)
    pool = case.pool.kv_buffer[0].clone()
    with pytest.raises(RuntimeError, match="graph_prologue"):
        backend.forward(padded(step.q, 4), padded(step.new_latent, 4), None, step.layer, step.batch)
    torch.testing.assert_close(case.pool.kv_buffer[0], pool, rtol=0, atol=0, equal_nan=True)  # nothing stored
    backend.graph_prologue()
    out = backend.forward(padded(step.q, 4), padded(step.new_latent, 4), None, step.layer, step.batch)
    assert rel_err(out[:3], mla_oracle(step)) <= 1e-5
