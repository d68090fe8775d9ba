"""Bad trees get a named ``DraftTreeError`` (a ValueError) before any kernel runs, and change nothing."""

from __future__ import annotations

import random

import pytest
import torch

from tree_cases import make_draft_case, make_verify_case, random_tree, star

from mla_fa3 import ops
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch
from mla_fa3.layer import AttentionLayer
from mla_fa3.tree import DraftTree, DraftTreeError, sglang_draft_mask


def backend_for(case, **kw) -> MLABackend:
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.layout.page_size, device=case.layout.device, num_heads=case.cfg.num_heads,
                      mla_dims=case.cfg.dims, **kw)


def _mask(parents):
    from tree_cases import ancestors_mask
    return torch.stack([ancestors_mask(p) for p in parents])


@pytest.mark.parametrize("edit,match", [
    (lambda m: m[0, 2, 2].fill_(False), r"tree.mask\[0, 2, 2\] is False: draft token 2 of request 0 must see itself"),
    (lambda m: m[1, 1, 3].fill_(True), r"sees the later token 3"),
    (lambda m: m[0, 3, 0].fill_(False), r"must see the root"),
    (lambda m: m[0, 3].copy_(torch.tensor([True, False, True, True])), r"not a path from the root"),
])
def test_a_mask_that_is_not_a_tree_is_refused(edit, match):
    mask = _mask([[-1, 0, 1, 1], [-1, 0, 0, 2]])
    edit(mask)
    with pytest.raises(DraftTreeError, match=match):
        DraftTree.from_mask(mask, "cpu")


@pytest.mark.parametrize("parents,match", [
    ([[-1, 0, 2]], r"parents\[0, 2\] = 2 is out of range"),
    ([[-1, 0, -1]], r"parents\[0, 2\] = -1 is out of range"),
    ([[0, 0, 1]], r"parents\[0, 0\] must be -1"),
    ([[-1, 0, 7]], r"out of range"),
    ([-1, 0, 1], r"parents must be \[bs, k\]"),
    ([[-1.0, 0.0]], r"must hold ints"),
])
def test_bad_parent_arrays_are_refused(parents, match):
    with pytest.raises(DraftTreeError, match=match):
        DraftTree.from_parents(parents, "cpu")


def test_shapes_are_checked_against_the_batch():
    rng = random.Random(0)
    case = make_verify_case([5, 9], [random_tree(4, rng) for _ in range(2)])
    b = case.batch
    rows, seq, loc = b.req_pool_indices_cpu.tolist(), b.seq_lens_cpu.tolist(), b.out_cache_loc
    with pytest.raises(DraftTreeError, match="one tree per request"):
        ForwardBatch.verify(rows, seq, loc, "cpu", 4, tree=DraftTree.from_parents([[-1, 0, 0, 1]], "cpu"))
    with pytest.raises(DraftTreeError, match="queries per request"):
        ForwardBatch.verify(rows, seq, loc, "cpu", 4, tree=DraftTree.from_parents([[-1, 0, 0]] * 2, "cpu"))
    with pytest.raises(DraftTreeError, match="must be \\[bs, k, k\\]"):
        DraftTree(mask=torch.ones(2, 4, 5, dtype=torch.bool))
    with pytest.raises(DraftTreeError, match="bool"):
        DraftTree(mask=torch.ones(2, 4, 4, dtype=torch.int32))
    with pytest.raises(DraftTreeError, match="MAX_TREE_TOKENS = 64"):
        DraftTree.from_parents([[-1] + list(range(64))], "cpu")
    with pytest.raises(DraftTreeError, match="draft-step tree"):
        ForwardBatch.verify(rows, seq, loc, "cpu", 4, tree=DraftTree.draft(_mask([[-1, 0, 0, 1]] * 2), "cpu"))
    with pytest.raises(DraftTreeError, match="prefix of >= 1"):  # no committed token before the tree
        ForwardBatch.verify(rows, [4, 13], loc, "cpu", 4, tree=b.tree)
    with pytest.raises(DraftTreeError, match="needs a tree"):
        ForwardBatch(forward_mode=b.forward_mode.DRAFT_DECODE, batch_size=2, req_pool_indices=b.req_pool_indices,
                     seq_lens=b.seq_lens, seq_lens_cpu=b.seq_lens_cpu, out_cache_loc=loc[:6], num_draft_tokens=3)


def test_tree_key_columns_are_checked_with_the_batch():
    """A tree step's explicit key columns (SGLang's page-aligned draft branches): [bs, n] int64 on the batch's device,
    only with a tree; and with them, a draft token must sit at one of its request's listed columns."""
    case = make_draft_case([5, 9], 2, 3, 1)
    b = case.batch
    loc = b.out_cache_loc
    n = b.tree.num_keys
    last = b.seq_lens_cpu.long()[:, None] - n + torch.arange(n)  # the default: the last n columns of each row
    for bad, match in ((last[:1], r"\[batch_size, n\] = \[2, 6\] int64"), (last.int(), "int64"),
                       ([[0] * n] * 2, "tensor, got list")):
        with pytest.raises(ValueError, match=match):
            ForwardBatch(**{**_fields(b), "tree_key_columns": bad})
    with pytest.raises(DraftTreeError, match="tree_key_columns without a tree"):
        ForwardBatch(**{**_fields(b), "tree": None, "num_draft_tokens": 0, "out_cache_loc": loc[::2].clone(),
                        "tree_key_columns": last})
    same = ForwardBatch(**{**_fields(b), "tree_key_columns": last})  # the default columns, given: the same step
    backend_for(case).init_forward_metadata(same)
    shifted = ForwardBatch(**{**_fields(b), "tree_key_columns": last - n})  # n columns early: the prefix's tail,
    with pytest.raises(DraftTreeError, match="is not one of request 0's tree keys"):  # the new tokens not listed
        backend_for(case).init_forward_metadata(shifted)


def _fields(batch: ForwardBatch) -> dict:
    import dataclasses
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def test_sglang_custom_mask_that_hides_prefix_or_is_short_is_refused():
    k, pre = 3, [2, 4]
    blocks = [torch.cat([torch.ones(k, p, dtype=torch.bool), _mask([star(k)])[0]], 1) for p in pre]
    flat = torch.cat([x.reshape(-1) for x in blocks])
    assert DraftTree.from_sglang_custom_mask(flat, pre, k, "cpu").mask_cpu.shape == (2, 3, 3)
    with pytest.raises(DraftTreeError, match="fewer than"):
        DraftTree.from_sglang_custom_mask(flat[:-1], pre, k, "cpu")
    hidden = flat.clone()
    hidden[0] = False
    with pytest.raises(DraftTreeError, match="hides part of its prefix"):
        DraftTree.from_sglang_custom_mask(hidden, pre, k, "cpu")


def test_a_device_only_mask_is_checked_by_the_builder():
    """A tree given as a device tensor alone (no host copy) is checked by the metadata builder where it may read
    values (CPU tensors here), before anything runs."""
    rng = random.Random(1)
    case = make_verify_case([5, 9], [random_tree(4, rng) for _ in range(2)])
    bad = case.batch.tree.mask.clone()
    bad[1, 2, 3] = True
    batch = case.batch
    batch.tree = DraftTree(mask=bad)
    with pytest.raises(DraftTreeError, match="later token"):
        backend_for(case).init_forward_metadata(batch)


def test_draft_step_tokens_must_be_tree_keys_seen_by_their_query():
    case = make_draft_case([5, 9], 2, 3, 1)
    b = case.batch
    mask = b.tree.mask_cpu.clone()
    own = mask.clone()
    own[0, 1] = False
    own[0, 1, 0] = True  # query 1 of request 0 sees a key, but not its own token
    batch = ForwardBatch.draft_decode(b.req_pool_indices_cpu.tolist(), b.seq_lens_cpu.tolist(), b.out_cache_loc,
                                      "cpu", step=1, tree=DraftTree.draft(own, "cpu"))
    with pytest.raises(DraftTreeError, match="must see its own token"):
        backend_for(case).init_forward_metadata(batch)
    loc = b.out_cache_loc.clone()
    loc[0] = int(case.layout.token_slots(0, 0, 1)[0])  # a prefix slot, not a tree key
    batch = ForwardBatch.draft_decode(b.req_pool_indices_cpu.tolist(), b.seq_lens_cpu.tolist(), loc, "cpu", step=1,
                                      tree=DraftTree.draft(mask, "cpu"))
    with pytest.raises(DraftTreeError, match="is not one of request 0's tree keys"):
        backend_for(case).init_forward_metadata(batch)
    with pytest.raises(DraftTreeError, match="sees no tree key"):
        DraftTree.draft(torch.zeros(1, 2, 4, dtype=torch.bool), "cpu")
    with pytest.raises(DraftTreeError, match="step must be"):
        sglang_draft_mask(1, 2, 3, 3)


def test_layers_without_a_tree_form_are_refused_before_the_store():
    rng = random.Random(2)
    case = make_verify_case([5, 9], [random_tree(4, rng) for _ in range(2)])
    backend = backend_for(case)
    backend.init_forward_metadata(case.batch)
    windowed = AttentionLayer.mla_layer(1, case.cfg.num_heads, case.cfg.dims, case.cfg.scale,
                                        mla_weights=case.layer.mla_weights, sliding_window=8)
    before = case.pool.kv_buffer[1].clone()
    with pytest.raises(DraftTreeError, match="sliding-window"):
        backend.forward(case.q, case.new_latent, None, windowed, case.batch)
    assert torch.equal(before.isnan(), case.pool.kv_buffer[1].isnan())  # nothing stored


def test_tree_attention_op_checks_its_arguments():
    q_lat, q_rope = torch.zeros(4, 2, 8), torch.zeros(4, 2, 4)
    kv, slots, mask = torch.zeros(10, 12), torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 2, 3, dtype=torch.bool)
    o, lse = ops.tree_attention(q_lat, q_rope, kv, slots, mask, softmax_scale=1.0)
    assert o.shape == (4, 2, 8) and lse.shape == (4, 2) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="key_slots"):
        ops.tree_attention(q_lat, q_rope, kv, slots.int(), mask, softmax_scale=1.0)
    with pytest.raises(ValueError, match="bs \\* m"):
        ops.tree_attention(q_lat[:3], q_rope[:3], kv, slots, mask, softmax_scale=1.0)
    with pytest.raises(ValueError, match="kv must be"):
        ops.tree_attention(q_lat, q_rope, kv[:, :11], slots, mask, softmax_scale=1.0)
    with pytest.raises(ValueError, match="kv_scale is None"):
        ops.tree_attention(q_lat, q_rope, kv.to(torch.float8_e4m3fn), slots, mask, softmax_scale=1.0)
