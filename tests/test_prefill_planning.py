"""The MHA prefill's step plan (prefill_plan) against a brute-force planner written here, token by token.

The oracle walks the concatenated prefix tokens one at a time, cutting a chunk every ``W`` tokens, and
records per chunk the requests it spans, their query rows and their keys: the definition of the plan,
with no arithmetic shared with the vectorised code. Checked on the named spec table (tests/specs.py)
and on random batches (many requests, zero-length prefixes, chunk borders mid-page, decode rows).
Also: the workspace budget in bytes (``workspace_tokens_for_bytes`` / ``PrefillWorkspace.bytes_for``).
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_cases import make_mla_case
from specs import EXT, MIX, SPECS, BatchSpec

from mla_fa3.layer import MLADims
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.prefill_plan import (PREFILL_WORKSPACE_BYTES, PrefillWorkspace, build_prefill_plan,
                                  workspace_tokens_for_bytes)

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def brute_force_chunks(prefix, extend, W):
    """Per chunk: (requests lo..hi-1, keys per request, q rows per request, q_lo, q_hi), token by token."""
    owner = [b for b, p in enumerate(prefix) for _ in range(p)]  # request of each prefix token
    q_start = [sum(extend[:b]) for b in range(len(extend) + 1)]
    out = []
    for s in range(0, len(owner), W):
        toks = owner[s: s + W]
        lo, hi = toks[0], toks[-1] + 1
        keys = [toks.count(b) for b in range(lo, hi)]
        out.append(dict(lo=lo, hi=hi, keys=keys, q=[extend[b] for b in range(lo, hi)], q_lo=q_start[lo],
                        q_hi=q_start[hi], tokens=list(range(s, s + len(toks)))))
    return out


def _check_plan(spec, W):
    case = make_mla_case(spec, "tiny")
    r2t = case.layout.req_to_token_pool.req_to_token
    md = MetadataBuilder(case.layout.req_to_token_pool, spec.page_size, "cpu").build(case.batch)
    plan = build_prefill_plan(md, r2t, case.batch.req_pool_indices, W, spec.page_size)
    mha = [b for b, (p, n) in enumerate(zip(spec.prefix_lens, spec.extend_lens)) if not (n == 1 and p > 0)]
    prefix = [spec.prefix_lens[b] for b in mha]
    extend = [spec.extend_lens[b] for b in mha]
    # every prefix slot of the MHA requests, request by request, from the layout itself
    slots = [int(s) for b in mha for s in case.layout.token_slots(b, 0, spec.prefix_lens[b])]
    assert plan.prefix_slot_ids.tolist() == slots
    assert plan.cu_seqlens_q.tolist() == [sum(extend[:b]) for b in range(len(extend) + 1)]
    assert plan.max_seqlen_q == max(extend)
    want = brute_force_chunks(prefix, extend, W)
    assert len(plan.chunks) == len(want)
    for ch, w in zip(plan.chunks, want):
        assert (ch.req_lo, ch.req_hi, ch.q_lo, ch.q_hi) == (w["lo"], w["hi"], w["q_lo"], w["q_hi"])
        assert ch.num_keys == len(w["tokens"]) <= W
        assert ch.slot_ids.tolist() == [slots[t] for t in w["tokens"]]
        assert ch.cu_seqlens_k.tolist() == [sum(w["keys"][:j]) for j in range(len(w["keys"]) + 1)]
        assert ch.cu_seqlens_q.tolist() == [sum(w["q"][:j]) for j in range(len(w["q"]) + 1)]
        assert ch.max_seqlen_q == max(w["q"]) and ch.max_seqlen_k == max(w["keys"])
        assert ch.cu_seqlens_q.dtype == ch.cu_seqlens_k.dtype == torch.int32
    return plan


EXTEND_SPECS = [n for n, s in SPECS.items() if s.mode in (EXT, MIX)
                and any(not (e == 1 and p > 0) and e > 0 for p, e in zip(s.prefix_lens, s.extend_lens))]


@pytest.mark.parametrize("name", EXTEND_SPECS)
@pytest.mark.parametrize("W_pages", [1, 1.5, 3, 1000])
def test_plan_equals_brute_force_on_the_spec_table(name, W_pages):
    spec = SPECS[name]
    _check_plan(spec, max(1, int(W_pages * spec.page_size)))


@pytest.mark.parametrize("seed", range(25))
def test_plan_equals_brute_force_on_random_batches(seed):
    rnd = random.Random(100 + seed)
    page = rnd.choice([1, 4, 16, 64])
    W = rnd.choice([page, page + rnd.randint(1, 2 * page), 3 * page - 1 if page > 1 else 3, 5 * page])
    bs = rnd.randint(1, 24)
    prefix = [rnd.choice([0, 0, rnd.randint(1, W), rnd.randint(W, 4 * W)]) for _ in range(bs)]
    extend = [rnd.choice([1, rnd.randint(1, 12)]) for _ in range(bs)]
    if all(n == 1 and p > 0 for p, n in zip(prefix, extend)):
        extend[0] = 3
    mode = MIX if any(n == 1 and p > 0 for p, n in zip(prefix, extend)) else EXT
    _check_plan(BatchSpec(mode, tuple(prefix), tuple(extend), page_size=page), W)


def test_leading_and_trailing_empty_prefixes():
    plan = _check_plan(BatchSpec(EXT, (0, 0, 20, 0, 0, 7, 0), (2, 3, 4, 5, 6, 7, 8)), 16)
    assert [(c.req_lo, c.req_hi) for c in plan.chunks] == [(2, 3), (2, 6)]


# --------------------------------------------------------------------------------------------------
# the workspace budget in bytes


def test_byte_budget_gives_more_tokens_to_fewer_heads():
    w16 = workspace_tokens_for_bytes(16, V3, PREFILL_WORKSPACE_BYTES, torch.bfloat16)
    w128 = workspace_tokens_for_bytes(128, V3, PREFILL_WORKSPACE_BYTES, torch.bfloat16)
    # per token: latent row (512 + 64) and per head [v | k_nope | k_rope] (128 + 128 + 64), 2 bytes each
    assert w16 == PREFILL_WORKSPACE_BYTES // (2 * (576 + 16 * 320))
    assert w128 == PREFILL_WORKSPACE_BYTES // (2 * (576 + 128 * 320))
    assert w16 > 7 * w128
    assert -(-65536 // w16) <= 2  # a 64k prefix at 16 heads: one or two chunks
    for H, W in ((16, w16), (128, w128)):
        assert PrefillWorkspace.bytes_for(W, H, V3, torch.bfloat16) <= PREFILL_WORKSPACE_BYTES
        assert PrefillWorkspace.bytes_for(W + 1, H, V3, torch.bfloat16) > PREFILL_WORKSPACE_BYTES
    with pytest.raises(ValueError, match="budget_bytes .* at least one page"):
        workspace_tokens_for_bytes(128, V3, 1000, torch.bfloat16, page_size=64)
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 1"):
        workspace_tokens_for_bytes(16, V3, 0)
