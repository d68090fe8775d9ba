"""Cross-attention (LayerKind.CROSS) through mha_fallback on CPU, against fp64 dense attention.

Encoder-decoder layout (see ``mla_fa3.kv``): request b's ``E_b`` encoder tokens occupy the first
``ceil(E_b / p) * p`` columns of its ``req_to_token`` row, its decoder tokens start right after. The
layout here is built by hand over shuffled pages (``mla_cases.make_layout`` over the whole row), every
pool slot starts as NaN, and the oracle is, per request,

    out_b = softmax(scale · q_b · K_enc,bᵀ) · V_enc,b      over all E_b encoder keys, NON-causal
                                                          (E_b = 0 gives 0)

for ANY number of requests with different encoder lengths. When the step carries the encoder's K/V
(``k``/``v`` given) they must be written at ``batch.encoder_out_cache_loc`` before attending; a
self-attention layer in the same encoder-decoder batch must read only the decoder region.
``make_cross_case`` / ``cross_oracle`` are in ``mha_cases.py``, ``CROSS_SPECS`` in ``specs.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mha_cases import (CROSS_LAYER, E4M3, FP8_TOL, FP32_TOL, Q_GROUP_MAGS, SELF_LAYER, CrossCase, cross_oracle,
                       fp8_query, make_cross_case, q_scale_runs, quantize_e4m3, rel_err_per_request, same_bits,
                       visible)
from mla_cases import rel_err
from oracle import dense_attention
from specs import CROSS_SPECS, DEC, EXT, CrossSpec

from mla_fa3 import mha_fallback, ops
from mla_fa3.batch import ForwardBatch
from mla_fa3.metadata import MetadataBuilder


def self_oracle(case: CrossCase) -> torch.Tensor:
    """fp64 causal attention of the self-attention layer over the decoder tokens only."""
    q = case.q.double().cpu()
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        k = case.dec_keys[b].to(case.q.dtype).double()
        v = case.dec_values[b].to(case.q.dtype).double()
        o, _ = dense_attention(q[s:e], k, v, scale=case.self_attn.scaling, softcap=case.self_attn.logit_cap,
                               mask=visible(e - s, k.shape[0]))
        outs.append(o)
    return torch.cat(outs)


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cfg", ["gqa_8_2", "mqa"])
@pytest.mark.parametrize("name", CROSS_SPECS)
def test_cross_matches_oracle(name, cfg):
    case = make_cross_case(name, cfg)
    out = case.forward_cross()
    assert out.shape == (case.batch.num_tokens, case.cfg.num_heads, case.cfg.v_head_dim)
    assert torch.isfinite(out).all()
    assert rel_err(out, cross_oracle(case)) < FP32_TOL


@pytest.mark.parametrize("name", ["several_extend_write_p1", "several_mixed_p64"])
def test_cross_is_not_causal(name):
    """Extend queries see every encoder token: a causal mask over the encoder would change the answer."""
    case = make_cross_case(name)
    out = case.forward_cross()
    causal = []
    for b, (s, e) in enumerate(case.q_rows):
        E = case.spec.encoder_lens[b]
        o, _ = dense_attention(case.q[s:e].double(), case.enc_keys[b].double(), case.enc_values[b].double(),
                               scale=case.cross.scaling, causal=True)
        causal.append(o)
    assert rel_err(out, torch.cat(causal)) > 1e-2
    assert rel_err(out, cross_oracle(case)) < FP32_TOL


def test_cross_softcap_mha_dims():
    case = make_cross_case("several_decode_p16", "mha_dv_differs", logit_cap=1.25)
    assert rel_err(case.forward_cross(), cross_oracle(case)) < FP32_TOL


def test_cross_deepseek_v3_dims():
    case = make_cross_case(CrossSpec(EXT, (7, 19), (0, 2), (3, 2), write_encoder=True), "deepseek_v3_mha_dims")
    assert rel_err(case.forward_cross(), cross_oracle(case)) < FP32_TOL


@pytest.mark.parametrize("name", ["several_extend_write_p1", "several_decode_p16", "several_mixed_p64"])
def test_cross_fp8_matches_dequantized_oracle(name):
    """Query groups of very different magnitudes (``Q_GROUP_MAGS``): the oracle quantizes q per request and
    KV-head group for the decode step, per tensor for extend / mixed (``q_scale_runs``), and the encoder K/V
    from the values the test wrote or handed to the step (never read back from the pool)."""
    case = make_cross_case(name, "gqa_8_2", kv_dtype=E4M3, q_group_mags=Q_GROUP_MAGS)
    out = case.forward_cross()
    assert out.dtype == torch.float32
    if case.enc_k is not None:  # the step wrote the encoder K/V: stored quantized at encoder_out_cache_loc
        for b in range(len(case.spec.encoder_lens)):
            loc = case.encoder_slots(b)
            assert same_bits(case.pool.k_buffer[CROSS_LAYER][loc], quantize_e4m3(case.enc_keys[b], case.k_scale))
            assert same_bits(case.pool.v_buffer[CROSS_LAYER][loc], quantize_e4m3(case.enc_values[b], case.v_scale))
    q8 = fp8_query(case.q, rows=q_scale_runs(case.spec.mode, case.q_rows, local=False),
                   num_kv_heads=case.cfg.num_kv_heads)
    ref = cross_oracle(case, quantized=True, q=q8)
    assert max(rel_err_per_request(out, ref, case.q_rows)) < FP8_TOL


def test_encoder_kv_written_at_encoder_loc_only():
    case = make_cross_case("several_extend_prefix_write_p16")
    case.forward_cross()
    k_buf, v_buf = case.pool.k_buffer[CROSS_LAYER], case.pool.v_buffer[CROSS_LAYER]
    for b in range(len(case.spec.encoder_lens)):
        loc = case.encoder_slots(b)
        assert torch.equal(k_buf[loc], case.enc_keys[b]) and torch.equal(v_buf[loc], case.enc_values[b])
    # the decoder's new-token slots of the cross layer are not touched (they stay NaN)
    assert torch.isnan(k_buf[case.batch.out_cache_loc]).all()
    # nor is any slot of the self-attention layer
    assert torch.isnan(case.pool.k_buffer[SELF_LAYER][case.batch.out_cache_loc]).all()


def test_encoder_written_then_decoded():
    """Step 1 (extend) stores the encoder K/V; step 2 (decode, k = v = None) reads them back."""
    first = make_cross_case("several_extend_write_p1")
    first.forward_cross()
    spec = first.spec
    bs = len(spec.seq_lens)
    dec = CrossSpec(DEC, spec.encoder_lens, spec.seq_lens, (1,) * bs, page_size=spec.page_size)
    loc = torch.cat([first.decoder_slots(b, spec.seq_lens[b], spec.seq_lens[b] + 1) for b in range(bs)])
    batch = ForwardBatch.decode(first.layout.rows[:bs], list(dec.seq_lens), loc, "cpu",
                                encoder_lens=list(spec.encoder_lens))
    md = MetadataBuilder(first.layout.req_to_token_pool, spec.page_size, "cpu",
                         num_slots=first.layout.num_slots).build(batch)
    q = torch.randn(bs, first.cfg.num_heads, first.cfg.head_dim, generator=torch.Generator().manual_seed(9))
    second = replace(first, spec=dec, batch=batch, metadata=md, q=q, enc_k=None, enc_v=None)
    assert rel_err(second.forward_cross(), cross_oracle(second)) < FP32_TOL


@pytest.mark.parametrize("name", ["several_decode_p16", "several_mixed_p64", "several_extend_write_p1"])
def test_self_attention_reads_decoder_region(name):
    """An MHA layer of the encoder-decoder batch attends to decoder tokens only (page table past the encoder)."""
    case = make_cross_case(name)
    out = mha_fallback.forward(case.q, case.dec_k_new, case.dec_v_new, case.self_attn, case.batch, case.metadata,
                               case.pool)
    assert rel_err(out, self_oracle(case)) < FP32_TOL


def test_cross_errors(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel ran before the input was rejected")
    monkeypatch.setattr(ops, "flash_attn_with_kvcache", boom)
    case = make_cross_case("one_encoder_decode")
    k = torch.randn(40, 2, 16)
    with pytest.raises(ValueError, match="^batch.encoder_out_cache_loc"):
        mha_fallback.forward(case.q, k, torch.randn(40, 2, 16), case.cross, case.batch, case.metadata, case.pool)
    case = make_cross_case("one_encoder_extend_write")
    with pytest.raises(ValueError, match="^k must have shape"):
        mha_fallback.forward(case.q, case.enc_k[:-1], case.enc_v, case.cross, case.batch, case.metadata, case.pool)
    case.cross.sliding_window = 8
    with pytest.raises(ValueError, match="^layer.sliding_window"):
        case.forward_cross()
    case.cross.sliding_window = -1
    case.cross.use_local_attention = True
    with pytest.raises(ValueError, match="^layer.use_local_attention"):
        case.forward_cross()
    assert torch.isnan(case.pool.k_buffer[CROSS_LAYER]).all(), "the pool was written before the input was rejected"
