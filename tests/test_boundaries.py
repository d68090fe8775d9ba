"""Every public boundary refuses bad input by name, before any kernel runs and before anything is written.

One test per case of issue "[reliability]" (besides the KV ownership ones in test_kv_ownership.py):
``seq_lens`` over the tokens allocated to a request on every path, ``out_cache_loc`` slots that are
not the request's or are written twice, batches over rows never held, strict ints in the
``ForwardBatch`` constructors, ``impl`` and pool devices checked at construction, negative slot ids
reported as negative, empty EXTEND / MIXED batches on every prefill path, and ``forward`` with a
batch other than the one planned.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mla_cases import follow_up, make_mla_case, mla_oracle, rel_err
from specs import BatchSpec

from mla_fa3 import ops
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.plan import AttentionPath

EXT, DEC, MIX, VER = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
PATHS = ["absorbed", "auto", "mha"]


def backend_for(case, **kw) -> MLABackend:
    kw.setdefault("impl", "reference")
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device="cpu", num_heads=case.cfg.num_heads,
                      mla_dims=case.cfg.dims, prefill_workspace_tokens=max(16, case.spec.page_size), **kw)


def refused(case, backend, batch, match, exc=ValueError):
    """init_forward_metadata refuses ``batch``; the pool, the table and the plan state are unchanged."""
    pool = [b.clone().nan_to_num(7) for b in case.pool.kv_buffer]
    table = case.layout.req_to_token_pool.req_to_token.clone()
    with pytest.raises(exc, match=match):
        backend.init_forward_metadata(batch)
    assert backend.step_plan is None, "a refused step left a plan behind"
    assert all(torch.equal(a, b.nan_to_num(7)) for a, b in zip(pool, case.pool.kv_buffer))
    assert torch.equal(table, case.layout.req_to_token_pool.req_to_token)


# ---------------------------------------------------------------------------------- lengths
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", [DEC, VER, EXT, MIX, ForwardMode.DRAFT_DECODE])
def test_seq_lens_over_the_allocated_tokens_is_refused_on_every_path(mode, path):
    case = make_mla_case(BatchSpec(EXT, (5, 17), (2, 3)), "tiny", seed=1, reserve=2)
    row, allocated = case.layout.rows[0], case.layout.req_to_token_pool.allocated_len[case.layout.rows[0]]
    assert allocated == 9
    seq, n = allocated + 1, 2 if mode in (VER, EXT, MIX) else 1
    slots = case.layout.req_to_token_pool.req_to_token[row, seq - n: seq].long()
    if mode.is_extend_like():
        batch = ForwardBatch.extend([row], [seq - n], [n], slots, "cpu", mode=mode)
    elif mode is VER:
        batch = ForwardBatch.verify([row], [seq], slots, "cpu", num_draft_tokens=n)
    elif mode is DEC:
        batch = ForwardBatch.decode([row], [seq], slots, "cpu")
    else:
        batch = ForwardBatch.draft_decode([row], [seq], slots, "cpu", step=0)
    refused(case, backend_for(case, prefill_path=path), batch, r"seq_lens\[0\] = 10 exceeds the 9 tokens allocated")


def test_seq_lens_over_the_pool_width_is_refused():
    case = make_mla_case("small_decode", "tiny", seed=2)
    ctx = case.layout.req_to_token_pool.max_context
    batch = ForwardBatch.decode(case.layout.rows[:1], [ctx + 1], [int(case.layout.slots[0][0])], "cpu")
    refused(case, backend_for(case), batch, "max_context")


@pytest.mark.parametrize("gone", ["freed", "never"])
def test_a_batch_over_a_row_not_held_is_refused(gone):
    case = make_mla_case("small_decode", "tiny", seed=3)
    pool = case.layout.req_to_token_pool
    row = case.layout.rows[0] if gone == "freed" else next(r for r in range(pool.size) if not pool.is_held(r))
    if gone == "freed":
        pool.allocated_len[row] = 0  # the fixture gave its slots itself: release them, then the row
        pool.free(row)
    refused(case, backend_for(case), ForwardBatch.decode([row], [1], [int(case.layout.slots[0][0])], "cpu"),
            "not a held request row")


# ---------------------------------------------------------------------------------- out_cache_loc
def test_two_new_tokens_on_one_slot_are_refused():
    case = make_mla_case(BatchSpec(EXT, (0,), (3,)), "tiny", seed=4)
    row, s = case.layout.rows[0], case.layout.slots[0]
    batch = ForwardBatch.extend([row], [0], [3], [int(s[0]), int(s[1]), int(s[1])], "cpu")
    refused(case, backend_for(case), batch, "holds slot .* twice")


def test_a_slot_of_another_request_is_refused():
    case = make_mla_case("small_decode", "tiny", seed=5)
    rows, slots = case.layout.rows, case.layout.slots
    loc = [int(slots[1][17]), int(slots[1][17 - 1]), int(slots[2][33])]  # request 0 writes into request 1
    batch = ForwardBatch.decode(rows[:3], [6, 17, 34], loc, "cpu")
    refused(case, backend_for(case), batch, r"out_cache_loc\[0\] = .* is not the slot of request 0's token 5")


def test_negative_slots_are_reported_as_negative():
    case = make_mla_case("small_decode", "tiny", seed=6)
    with pytest.raises(ValueError, match="out_cache_loc must be >= 0"):
        ForwardBatch.decode(case.layout.rows[:1], [6], [-4], "cpu")
    case.layout.req_to_token_pool.req_to_token[case.layout.rows[0], 0] = -5
    refused(case, backend_for(case), case.batch, "page id -1, negative")


# ---------------------------------------------------------------------------------- strict types
@pytest.mark.parametrize("call,match", [
    (lambda: ForwardBatch.extend([1], [0], [1.5], [3], "cpu"), r"extend_lens\[0\] must be an int, got float"),
    (lambda: ForwardBatch.extend([1], [True], [1], [3], "cpu"), r"prefix_lens\[0\] must be an int, got bool"),
    (lambda: ForwardBatch.extend([1.0], [0], [1], [3], "cpu"), r"req_pool_indices\[0\] must be an int"),
    (lambda: ForwardBatch.extend([1], [0], [1], [3.0], "cpu"), r"out_cache_loc\[0\] must be an int"),
    (lambda: ForwardBatch.extend([1], [0], torch.tensor([1.0]), [3], "cpu"), "extend_lens must hold integers"),
    (lambda: ForwardBatch.verify([1], [2], [3], "cpu", num_draft_tokens=True), "num_draft_tokens must be an int, got bool"),
    (lambda: ForwardBatch.verify([1], [2], [3], "cpu", num_draft_tokens=1.0), "num_draft_tokens must be an int"),
    (lambda: ForwardBatch.draft_decode([1], [2], [3], "cpu", step=True), "step must be an int, got bool"),
    (lambda: ForwardBatch.decode([1], [2.0], [3], "cpu"), r"seq_lens\[0\] must be an int"),
    (lambda: ForwardBatch.decode([1], [2], [3], "cpu", positions=[0.5]), r"positions\[0\] must be an int"),
])
def test_constructors_never_truncate_floats_or_take_bools(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_the_dataclass_refuses_bools_for_its_int_fields():
    ok = ForwardBatch.verify([1], [2], [3, 4], "cpu", num_draft_tokens=2)
    for field, value in (("num_draft_tokens", True), ("draft_step", True), ("batch_size", True),
                         ("batch_size", 1.0)):
        with pytest.raises(TypeError, match=field):
            dataclasses.replace(ok, **{field: value})


def test_numpy_ints_are_ints():
    b = ForwardBatch.extend(np.array([1]), [np.int64(2)], [np.int32(1)], [np.int64(3)], "cpu")
    assert b.seq_lens_cpu.tolist() == [3] and b.req_pool_indices_cpu.tolist() == [1]


def test_impl_is_checked_at_construction_before_anything_is_written():
    case = make_mla_case("small_decode", "tiny", seed=7)
    with pytest.raises(ValueError, match="impl must be one of"):
        backend_for(case, impl="bogus")
    if not torch.cuda.is_available():  # FA3 asked where it cannot run: refused now, not at a kernel
        with pytest.raises(ops.KernelUnavailableError, match="impl='reference'"):
            backend_for(case, impl="fa3")


def test_a_pool_on_another_device_is_refused_at_construction():
    case = make_mla_case("small_decode", "tiny", seed=8)
    d = case.cfg.dims
    meta_pool = MLATokenPool(2, case.layout.num_pages, case.spec.page_size, d.kv_lora_rank, d.qk_rope_head_dim,
                             torch.float32, "meta")
    with pytest.raises(ValueError, match="kv_pool is on meta but the backend's device is cpu"):
        MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=meta_pool,
                   page_size=case.spec.page_size, device="cpu", impl="reference")


# ---------------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", [EXT, MIX, ForwardMode.DRAFT_EXTEND])
def test_empty_extend_like_batches_give_an_empty_output_on_every_path(mode, path):
    case = make_mla_case(BatchSpec(mode, (), ()), "tiny", seed=9)
    assert case.batch.batch_size == 0 and case.batch.num_tokens == 0
    backend = backend_for(case, prefill_path=path)
    pool = [b.clone().nan_to_num(7) for b in case.pool.kv_buffer]
    for _ in range(2):  # a retry takes the same path
        backend.init_forward_metadata(case.batch)
        out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
        assert out.shape == (0, case.cfg.num_heads, case.cfg.dims.v_head_dim)
        rec = backend.explain()
        assert rec.path is AttentionPath.ABSORBED and rec.mode == mode.name
        assert ("no new tokens" in rec.reason) or path == "absorbed"
    assert all(torch.equal(a, b.nan_to_num(7)) for a, b in zip(pool, case.pool.kv_buffer))


def test_extend_constructor_takes_empty_lists():
    b = ForwardBatch.extend([], [], [], [], "cpu", mode=MIX)
    assert b.batch_size == 0 and b.num_tokens == 0 and b.positions.numel() == 0


# ---------------------------------------------------------------------------------- the planned batch
def test_forward_with_a_batch_other_than_the_planned_one_raises():
    case = make_mla_case("small_decode", "tiny", seed=10)
    backend = backend_for(case)
    backend.init_forward_metadata(case.batch)
    other = follow_up(case, DEC, (4, 16, 32), (1, 1, 1), seed=1)  # same mode and size, other lengths
    pool = [b.clone().nan_to_num(7) for b in case.pool.kv_buffer]
    with pytest.raises(ValueError, match="not the batch this step was planned for"):
        backend.forward(other.q, other.new_latent, None, other.layer, other.batch)
    assert all(torch.equal(a, b.nan_to_num(7)) for a, b in zip(pool, case.pool.kv_buffer))
    ext = make_mla_case(BatchSpec(EXT, (5,), (1,)), "tiny", seed=10)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        backend.forward(ext.q, ext.new_latent, None, ext.layer, ext.batch)
    # a twin batch (same host lengths) is the same step: accepted, and gives the oracle's answer
    twin = dataclasses.replace(case.batch, seq_lens=case.batch.seq_lens.clone())
    out = backend.forward(case.q, case.new_latent, None, case.layer, twin)
    assert rel_err(out, mla_oracle(case)) <= 1e-5


def test_check_batch_compares_host_lengths_only():
    case = make_mla_case("verify_k4", "tiny", seed=11)
    backend = backend_for(case)
    backend.init_forward_metadata(case.batch)
    plan = backend.step_plan
    plan.check_batch(case.batch)
    with pytest.raises(ValueError, match="planned for"):
        plan.check_batch(dataclasses.replace(case.batch, seq_lens_cpu=case.batch.seq_lens_cpu + 1))
    with pytest.raises(ValueError, match="planned for"):
        plan.check_batch(follow_up(case, VER, (9, 30), (4, 4)).batch)
    swapped = follow_up(case, VER, (30, 9, 1), (4, 4, 4), requests=[1, 0, 2]).batch  # other rows, same sizes
    swapped = dataclasses.replace(swapped, seq_lens_cpu=case.batch.seq_lens_cpu.clone())
    with pytest.raises(ValueError, match="planned for"):
        plan.check_batch(swapped)
