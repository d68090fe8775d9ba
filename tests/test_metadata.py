"""MetadataBuilder.build for every mode x page size x (plain / window / local / encoder), against
expectations computed from plain Python lists (``metadata_world``); plus the metadata driving the
reference kernel against the fp64 oracle (window, local chunks, cross-attention), and named errors.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from metadata_world import check_against_lists, make_batch, make_world
from oracle import dense_attention
from specs import SPECS

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MHATokenPool
from mla_fa3.metadata import MetadataBuilder

M = ForwardMode
PAGE_SIZES = [1, 16, 64]
CHUNK = {1: 8, 16: 16, 64: 64}  # attention_chunk_size per page size (a multiple of it)
ENC_PATTERN = [5, 70, 1, 33, 17]  # encoder lengths of requests 0, 1, 2, ... (cycled)
VARIANTS = ["plain", "window", "local", "encoder1", "encoderN"]


def spec_case(name: str, page_size: int, variant: str):
    spec = SPECS[name]
    seq, new = list(spec.seq_lens), list(spec.extend_lens)
    with_encoder = variant.startswith("encoder")
    if variant == "encoder1":
        seq, new = seq[:1], new[:1]
    enc = [ENC_PATTERN[b % len(ENC_PATTERN)] for b in range(len(seq))] if with_encoder else None
    return spec.mode, seq, new, enc, with_encoder


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", list(SPECS))
def test_build_matches_lists(name: str, page_size: int, variant: str) -> None:
    mode, seq, new, enc, with_encoder = spec_case(name, page_size, variant)
    if mode is M.IDLE and with_encoder:
        pytest.skip("an idle batch has no requests to attach encoders to")
    w = make_world(seq, page_size, enc, seed=zlib.crc32(f"{name}/{page_size}/{variant}".encode()))
    chunk = CHUNK[page_size] if variant == "local" else None
    builder = MetadataBuilder(w.pool, page_size, "cpu", attention_chunk_size=chunk, num_slots=w.num_slots)
    batch = make_batch(w, mode, new, with_encoder=with_encoder)
    md = builder.build(batch)
    if mode is M.IDLE:
        assert md.batch_size == 0 and md.cache_seqlens.numel() == 0 and md.page_table.shape[0] == 0
        assert md.cu_seqlens_q.tolist() == [0] and md.max_seqlen_k == 0
        return
    check_against_lists(md, w, mode, new, list(range(len(seq))), chunk=chunk, with_encoder=with_encoder)
    if mode is M.TARGET_VERIFY:
        assert md.num_draft_tokens == new[0]


# ------------------------------------------------------------ the metadata drives the reference kernel
# (spec, page size, variant): every variant at page 16 on mixed / verify, the rest spread over page 1
SEMANTIC = [(name, 16, v) for name in ("mixed_long_prefix", "verify_k4") for v in ("plain", "window", "local", "encoderN")]
SEMANTIC += [("small_decode", 1, v) for v in ("plain", "window", "local", "encoderN")]
SEMANTIC += [("mixed_long_prefix", 1, "local"), ("verify_k4", 1, "encoderN")]


@pytest.mark.parametrize("name,page_size,variant", SEMANTIC)
def test_metadata_drives_reference_attention(name: str, page_size: int, variant: str) -> None:
    """Built tables + reference kernel == fp64 dense attention with explicit masks, per request.

    Every slot of the pool that no live token owns is NaN: a table pointing anywhere else poisons it.
    """
    ops = pytest.importorskip("mla_fa3.ops")
    mode, seq, new, enc, with_encoder = spec_case(name, page_size, variant)
    w = make_world(seq, page_size, enc, seed=7)
    chunk = CHUNK[page_size] if variant == "local" else None
    builder = MetadataBuilder(w.pool, page_size, "cpu", attention_chunk_size=chunk)
    md = builder.build(make_batch(w, mode, new, with_encoder=with_encoder))
    g = torch.Generator().manual_seed(3)
    H, Hkv, d = 4, 2, 8
    kv = MHATokenPool(1, w.alloc.num_pages, page_size, Hkv, d, d, torch.float32, "cpu")
    kv.k_buffer[0].fill_(float("nan"))
    kv.v_buffer[0].fill_(float("nan"))
    keys = [torch.randn(s, Hkv, d, generator=g) for s in seq]
    vals = [torch.randn(s, Hkv, d, generator=g) for s in seq]
    ekeys = [torch.randn(e, Hkv, d, generator=g) for e in (enc or [0] * len(seq))]
    evals = [torch.randn(e, Hkv, d, generator=g) for e in (enc or [0] * len(seq))]
    for b in range(len(seq)):
        kv.set_kv(0, torch.tensor(w.dec_slots[b]), keys[b], vals[b])
        if with_encoder:
            kv.set_kv(0, torch.tensor(w.enc_slots[b]), ekeys[b], evals[b])
    q = torch.randn(sum(new), H, d, generator=g)
    scale = d ** -0.5
    common = dict(softmax_scale=scale, impl="reference")
    window = (3, 0) if variant == "window" else (-1, -1)
    if variant == "local":
        loc = md.local
        out = ops.flash_attn_with_kvcache(q, kv.k_paged(0), kv.v_paged(0), page_table=loc.page_table,
                                          cache_seqlens=loc.cache_seqlens, cu_seqlens_q=loc.cu_seqlens_q,
                                          max_seqlen_q=loc.max_seqlen_q, causal=True, **common)
    elif with_encoder:
        enc_md = md.encoder
        out = ops.flash_attn_with_kvcache(q, kv.k_paged(0), kv.v_paged(0), page_table=enc_md.page_table,
                                          cache_seqlens=enc_md.cache_seqlens, cu_seqlens_q=md.cu_seqlens_q,
                                          max_seqlen_q=md.max_seqlen_q, causal=False, **common)
    else:
        out = ops.flash_attn_with_kvcache(q, kv.k_paged(0), kv.v_paged(0), page_table=md.page_table,
                                          cache_seqlens=md.cache_seqlens, cu_seqlens_q=md.cu_seqlens_q,
                                          max_seqlen_q=md.max_seqlen_q, causal=True, window_size=window, **common)
    start = 0
    for b, (n, s) in enumerate(zip(new, seq)):
        qb = q[start:start + n]
        if with_encoder:
            ref, _ = dense_attention(qb, ekeys[b], evals[b], scale=scale, causal=False)
        elif variant == "local":
            pos = torch.arange(s - n, s).unsqueeze(1)
            key = torch.arange(s).unsqueeze(0)
            mask = (key <= pos) & (key // chunk == pos // chunk)
            ref, _ = dense_attention(qb, keys[b], vals[b], scale=scale, mask=mask)
        else:
            ref, _ = dense_attention(qb, keys[b], vals[b], scale=scale, causal=True, window=window)
        got = out[start:start + n].double()
        assert torch.isfinite(got).all()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), f"request {b}"
        start += n


# ------------------------------------------------------------ named errors
def _world_and_builder(**kw):
    w = make_world([6, 20], 4)
    return w, MetadataBuilder(w.pool, 4, "cpu", num_slots=w.num_slots, **kw)


def test_error_out_cache_loc_outside_pool() -> None:
    w, builder = _world_and_builder()
    batch = make_batch(w, M.DECODE, [1, 1])
    batch.out_cache_loc = torch.tensor([3, w.num_slots])
    with pytest.raises(ValueError, match="out_cache_loc must be in"):
        builder.build(batch)


def test_error_page_ids_outside_pool() -> None:
    w, builder = _world_and_builder()
    w.pool.req_to_token[w.rows[1], 8] = w.num_slots + 40  # a corrupt slot inside the live region
    with pytest.raises(ValueError, match="page_table"):
        builder.build(make_batch(w, M.DECODE, [1, 1]))


def test_error_seq_lens_shorter_than_prefix() -> None:
    w, builder = _world_and_builder()
    batch = make_batch(w, M.EXTEND, [2, 3])
    batch.extend_prefix_lens_cpu = torch.tensor([5, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens must be >= extend_prefix_lens"):
        builder.build(batch)


def test_error_lengths_over_max_context() -> None:
    w, builder = _world_and_builder()
    too_long = w.pool.max_context + 1
    batch = ForwardBatch.decode(w.rows, [too_long, 3], [5, 6], "cpu")
    with pytest.raises(ValueError, match="max_context"):
        builder.build(batch)


def test_error_extend_lens_not_summing_to_out_cache_loc() -> None:
    w, builder = _world_and_builder()
    batch = make_batch(w, M.EXTEND, [2, 3])
    batch.out_cache_loc = batch.out_cache_loc[:4]
    with pytest.raises(ValueError, match="extend_seq_lens must sum"):
        builder.build(batch)


def test_error_req_pool_indices_outside_table() -> None:
    w, builder = _world_and_builder()
    batch = make_batch(w, M.DECODE, [1, 1])
    batch.req_pool_indices = torch.tensor([0, w.pool.size])
    with pytest.raises(ValueError, match="req_pool_indices"):
        builder.build(batch)


def test_debug_checks_compare_cpu_copies_with_device_tensors() -> None:
    w, builder = _world_and_builder()
    batch = make_batch(w, M.DECODE, [1, 1])
    batch = dataclasses.replace(batch, seq_lens=batch.seq_lens - 1)  # device copy disagrees
    builder.build(batch)  # off by default: not checked
    strict = MetadataBuilder(w.pool, 4, "cpu", debug_checks=True)
    with pytest.raises(ValueError, match="seq_lens differs from seq_lens_cpu"):
        strict.build(batch)


@pytest.mark.parametrize("chunk", [6, 2, 0])
def test_error_chunk_not_a_multiple_of_page_size(chunk: int) -> None:
    w = make_world([3], 4)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        MetadataBuilder(w.pool, 4, "cpu", attention_chunk_size=chunk)


def test_error_bad_builder_arguments() -> None:
    w = make_world([3], 4)
    with pytest.raises(ValueError, match="page_size"):
        MetadataBuilder(w.pool, 12, "cpu")
    with pytest.raises(TypeError, match="req_to_token_pool"):
        MetadataBuilder(w.pool.req_to_token.long(), 4, "cpu")
    with pytest.raises(TypeError, match="batch"):
        MetadataBuilder(w.pool, 4, "cpu").build("not a batch")
