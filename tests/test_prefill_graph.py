"""The MHA prefill's CUDA-graph cache (``prefill_graph.PrefillGraphs``) on CPU: keys, policy, slot binding.

Graphs themselves run only on CUDA (``test_prefill_graph_gpu.py``); here: what makes two steps the same
shape, that the first step of a shape runs eagerly (every layer), that CPU / reference / split steps never
capture and give the oracle's answer through the backend, and that binding a live plan copies its slot ids
into the captured plan (the chunks' views included).
"""

from __future__ import annotations

import pytest
import torch

from mla_cases import make_mla_case, mla_oracle, rel_err
from specs import PREFILL_RUNS, PREFILL_SPECS

from mla_fa3.backend import MLABackend
from mla_fa3.chunked_prefix import forward_mha_prefill
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.prefill_graph import PrefillGraphs
from mla_fa3.prefill_plan import PrefillWorkspace, build_prefill_plan

TOL = 2e-5


def _plans(name, W=None, n=2):
    spec, (W0, cfg) = PREFILL_SPECS[name], PREFILL_RUNS[name]
    case = make_mla_case(spec, cfg)
    case.pool.kv_buffer[case.layer.layer_id][case.batch.out_cache_loc] = case.new_latent
    md = MetadataBuilder(case.layout.req_to_token_pool, spec.page_size, "cpu").build(case.batch)
    r2t, rows = case.layout.req_to_token_pool.req_to_token, case.batch.req_pool_indices
    ws = PrefillWorkspace(W or W0)
    return case, md, [build_prefill_plan(md, r2t, rows, W or W0, spec.page_size, workspace=ws) for _ in range(n)]


def test_same_lengths_same_shape_other_lengths_or_split_not():
    g = PrefillGraphs()
    _, _, (a, b) = _plans("budget_splits_mid_page")
    _, _, (c,) = _plans("prefix_page_border_chunks", n=1)
    _, _, (d,) = _plans("budget_splits_mid_page", W=32, n=1)
    _, _, (split,) = _plans("mixed_decode_rows_split", n=1)
    assert split.split is not None and g._plan_key(split) is None
    ka, kb, kc, kd = (g._plan_key(p) for p in (a, b, c, d))
    assert ka == kb and ka is not None
    assert kc != ka and kd != ka  # other lengths; the same lengths in chunks of another size


def test_cpu_and_reference_run_eagerly_with_the_oracle_answer():
    spec, (W, cfg) = PREFILL_SPECS["budget_splits_mid_page"], PREFILL_RUNS["budget_splits_mid_page"]
    case = make_mla_case(spec, cfg)
    backend = MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                         page_size=spec.page_size, device="cpu", num_heads=case.cfg.num_heads, mla_dims=case.cfg.dims,
                         prefill_path="mha", prefill_workspace_tokens=W, prefill_graph_shapes=2, impl="reference")
    ref = mla_oracle(case)
    for _ in range(3):
        backend.init_forward_metadata(case.batch)
        out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
        assert rel_err(out, ref) < TOL
    assert backend.prefill_graphs.stats == {"captures": 0, "replays": 0, "eager": 3, "evictions": 0}


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_prefill_graph_shapes_is_checked(bad, exc):
    spec, (W, cfg) = PREFILL_SPECS["budget_splits_mid_page"], PREFILL_RUNS["budget_splits_mid_page"]
    case = make_mla_case(spec, cfg)
    with pytest.raises(exc, match="prefill_graph_shapes"):
        MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool, page_size=spec.page_size,
                   device="cpu", prefill_graph_shapes=bad)
    with pytest.raises(ValueError, match="max_shapes"):
        PrefillGraphs(0)


def test_first_step_of_a_shape_is_eager_on_every_layer_a_later_step_repeats():
    g = PrefillGraphs()
    _, _, (a, b) = _plans("budget_splits_mid_page")
    key = g._plan_key(a)
    assert not g._seen_before(key, a) and not g._seen_before(key, a)  # layer 1, layer 2 of the same step
    assert g._seen_before(key, b)


@pytest.mark.parametrize("name,W", [("budget_splits_mid_page", None), ("budget_covers_all", 4096)])
def test_bind_copies_the_live_slots_into_the_captured_plan(name, W):
    """After bind, the captured plan IS the live step for every kernel that reads it (chunks' views too); the
    captured plan owns its slot tensors, so binding never writes a caller's plan (an older step run again)."""
    case, md, (first, live, again) = _plans(name, W=W, n=3)
    assert (first.one_pass is not None) == (W is not None)

    def slots(p):
        return [p.prefix_slot_ids, p.new_slot_ids] + ([p.one_pass.slot_ids] if p.one_pass else [])

    # the live step's slots differ: scramble them (a relocated cache), then bind
    for t in slots(live):
        t.copy_(t.flip(0))
    before = [t.clone() for t in slots(first)]
    shape = PrefillGraphs()._new_shape(("k",), case.q, None, case.layer, first)
    captured = shape.plan
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(slots(captured), slots(first)))
    for p in (live, first, live, again):
        shape.bind(p)
        assert shape.bound is p
        for c, l in zip(slots(captured), slots(p)):
            assert torch.equal(c, l)
        for c, l in zip(captured.chunks, p.chunks):
            assert torch.equal(c.slot_ids, l.slot_ids) and c.slot_ids.data_ptr() != l.slot_ids.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(slots(first), before))  # the caller's plan is untouched


def test_a_step_whose_first_plan_died_is_a_repeat():
    g = PrefillGraphs()
    _, _, (a, b) = _plans("budget_splits_mid_page")
    key = g._plan_key(a)
    assert not g._seen_before(key, a)
    g._last = (None, None)
    del a
    assert g._seen_before(key, b)


def test_eviction_keeps_at_most_max_shapes():
    g = PrefillGraphs(max_shapes=1)
    case, _, (a,) = _plans("budget_splits_mid_page", n=1)
    _, _, (c,) = _plans("prefix_page_border_chunks", n=1)
    g._new_shape(("a",), case.q, None, case.layer, a)
    g._new_shape(("c",), case.q, None, case.layer, c)
    assert list(g._shapes) == [("c",)] and g.stats["evictions"] == 1
