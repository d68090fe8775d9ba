"""Cross-attention (LayerKind.CROSS) through mha_fallback on CPU, against fp64 dense attention.

Encoder-decoder layout (see ``mla_fa3.kv``): request b's ``E_b`` encoder tokens occupy the first
``ceil(E_b / p) * p`` columns of its ``req_to_token`` row, its decoder tokens start right after. The
layout here is built by hand over shuffled pages (``specs.make_layout`` over the whole row), every
pool slot starts as NaN, and the oracle is, per request,

    out_b = softmax(scale · q_b · K_enc,bᵀ) · V_enc,b      over all E_b encoder keys, NON-causal
                                                          (E_b = 0 gives 0)

for ANY number of requests with different encoder lengths. When the step carries the encoder's K/V
(``k``/``v`` given) they must be written at ``batch.encoder_out_cache_loc`` before attending; a
self-attention layer in the same encoder-decoder batch must read only the decoder region.
``make_cross_case`` / ``cross_oracle`` / ``CROSS_SPECS`` are shared with ``test_mha_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from oracle import dense_attention
from specs import DEC, EXT, MIX, CacheLayout, make_layout, q_rows_of, rel_err
from test_mha_fallback import (
    E4M3, FP8_TOL, FP32_TOL, MHA_CONFIGS, MHAConfig, fp8_query, pin_amax, poison, quantize_e4m3, visible,
)

from mla_fa3 import mha_fallback, ops
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MHATokenPool
from mla_fa3.layer import AttentionLayer, LayerKind
from mla_fa3.metadata import AttentionMetadata, MetadataBuilder

CROSS_LAYER, SELF_LAYER = 0, 1


@dataclass(frozen=True)
class CrossSpec:
    """One decoder step of an encoder-decoder batch."""

    mode: ForwardMode  # EXTEND, MIXED or DECODE
    encoder_lens: tuple[int, ...]  # E_b encoder tokens per request
    prefix_lens: tuple[int, ...]  # decoder tokens already cached
    extend_lens: tuple[int, ...]  # new decoder tokens (queries)
    page_size: int = 16
    write_encoder: bool = False  # the step carries the encoder K/V (stored at encoder_out_cache_loc)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.prefix_lens, self.extend_lens))

    def encoder_cols(self, b: int) -> int:
        p = self.page_size
        return -(-self.encoder_lens[b] // p) * p


CROSS_SPECS: dict[str, CrossSpec] = {
    "one_encoder_extend_write": CrossSpec(EXT, (13,), (0,), (6,), write_encoder=True),
    "one_encoder_decode": CrossSpec(DEC, (40,), (5,), (1,)),
    "several_extend_write_p1": CrossSpec(EXT, (5, 17, 1), (0, 0, 0), (4, 1, 7), page_size=1, write_encoder=True),
    "several_decode_p16": CrossSpec(DEC, (33, 7, 16, 50), (3, 9, 0, 20), (1, 1, 1, 1)),
    "several_mixed_p64": CrossSpec(MIX, (70, 5, 64), (10, 0, 4), (1, 6, 1), page_size=64),
    "several_extend_prefix_write_p16": CrossSpec(EXT, (9, 20), (4, 0), (3, 5), write_encoder=True),
    "empty_encoder_decode": CrossSpec(DEC, (0, 9), (2, 4), (1, 1)),
}


@dataclass
class CrossCase:
    spec: CrossSpec
    cfg: MHAConfig
    layout: CacheLayout
    pool: MHATokenPool
    batch: ForwardBatch
    metadata: AttentionMetadata
    cross: AttentionLayer  # layer CROSS_LAYER
    self_attn: AttentionLayer  # layer SELF_LAYER, a causal MHA layer of the same decoder
    q: torch.Tensor  # [T, H, d]
    enc_k: torch.Tensor | None  # [sum E, H_kv, d] when the step carries the encoder K/V
    enc_v: torch.Tensor | None
    dec_k_new: torch.Tensor  # [T, H_kv, d] new decoder K/V (self-attention layer)
    dec_v_new: torch.Tensor
    enc_keys: list[torch.Tensor]  # per request [E_b, H_kv, d] fp32 cpu
    enc_values: list[torch.Tensor]
    dec_keys: list[torch.Tensor]  # per request [seq_b, H_kv, d] fp32 cpu
    dec_values: list[torch.Tensor]
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def q_rows(self) -> list[tuple[int, int]]:
        return q_rows_of(self.spec.extend_lens)

    def encoder_slots(self, b: int) -> torch.Tensor:
        return self.layout.token_slots(b, 0, self.spec.encoder_lens[b])

    def decoder_slots(self, b: int, start: int, end: int) -> torch.Tensor:
        c0 = self.spec.encoder_cols(b)
        return self.layout.token_slots(b, c0 + start, c0 + end)

    def forward_cross(self, **kw) -> torch.Tensor:
        return mha_fallback.forward(self.q, self.enc_k, self.enc_v, self.cross, self.batch, self.metadata,
                                    self.pool, **kw)


def make_cross_case(spec: CrossSpec | str, cfg: MHAConfig | str = "gqa_8_2", *, dtype=torch.float32,
                    kv_dtype=None, device="cpu", seed: int = 0, logit_cap: float = 0.0,
                    k_scale: float = 0.05, v_scale: float = 0.03, reserve: int = 3) -> CrossCase:
    spec = CROSS_SPECS[spec] if isinstance(spec, str) else spec
    cfg = MHA_CONFIGS[cfg] if isinstance(cfg, str) else cfg
    p, bs, fp8 = spec.page_size, len(spec.encoder_lens), kv_dtype == E4M3
    layout = make_layout([spec.encoder_cols(b) + spec.seq_lens[b] + reserve for b in range(bs)], p,
                         device=device, seed=seed)
    pool = MHATokenPool(2, layout.num_pages, p, cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim, dtype, device,
                        kv_dtype=kv_dtype)
    poison(pool)
    if fp8:
        for layer in (CROSS_LAYER, SELF_LAYER):
            pool.set_scales(layer, k_scale, v_scale)
    g = torch.Generator().manual_seed(3000 + seed)
    h_kv, d, dv = cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim
    enc_keys = [torch.randn(e, h_kv, d, generator=g) for e in spec.encoder_lens]
    enc_values = [torch.randn(e, h_kv, dv, generator=g) for e in spec.encoder_lens]
    dec_keys = [torch.randn(s, h_kv, d, generator=g) for s in spec.seq_lens]
    dec_values = [torch.randn(s, h_kv, dv, generator=g) for s in spec.seq_lens]

    def store(layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        loc = slots.to(device)
        pool.k_buffer[layer][loc] = (quantize_e4m3(k, k_scale) if fp8 else k.to(dtype)).to(device)
        pool.v_buffer[layer][loc] = (quantize_e4m3(v, v_scale) if fp8 else v.to(dtype)).to(device)

    for b in range(bs):
        c0, pre, e = spec.encoder_cols(b), spec.prefix_lens[b], spec.encoder_lens[b]
        if not spec.write_encoder and e:
            store(CROSS_LAYER, layout.token_slots(b, 0, e), enc_keys[b], enc_values[b])
        if pre:
            store(SELF_LAYER, layout.token_slots(b, c0, c0 + pre), dec_keys[b][:pre], dec_values[b][:pre])
    rows = layout.rows[:bs]
    loc = torch.cat([layout.token_slots(b, spec.encoder_cols(b) + spec.prefix_lens[b],
                                        spec.encoder_cols(b) + spec.seq_lens[b]) for b in range(bs)])
    enc_loc = torch.cat([layout.token_slots(b, 0, spec.encoder_lens[b]) for b in range(bs)])
    if spec.mode is DEC:
        batch = ForwardBatch.decode(rows, list(spec.seq_lens), loc, device, encoder_lens=list(spec.encoder_lens))
        if spec.write_encoder:
            batch.encoder_out_cache_loc = enc_loc.to(device)
    else:
        batch = ForwardBatch.extend(rows, list(spec.prefix_lens), list(spec.extend_lens), loc, device,
                                    mode=spec.mode, encoder_lens=list(spec.encoder_lens),
                                    encoder_out_cache_loc=enc_loc if spec.write_encoder else None)
    md = MetadataBuilder(layout.req_to_token_pool, p, device, num_slots=layout.num_slots).build(batch)
    T = sum(spec.extend_lens)
    q = torch.randn(T, cfg.num_heads, d, generator=g)
    if fp8:
        q = pin_amax(q, h_kv)
    common = dict(num_heads=cfg.num_heads, num_kv_heads=h_kv, head_dim=d, v_head_dim=dv, scaling=cfg.scale,
                  logit_cap=logit_cap)
    cross = AttentionLayer(layer_id=CROSS_LAYER, kind=LayerKind.CROSS, **common)
    self_attn = AttentionLayer(layer_id=SELF_LAYER, kind=LayerKind.MHA, **common)
    to = dict(dtype=dtype, device=device)
    enc_k = torch.cat(enc_keys).to(**to) if spec.write_encoder else None
    enc_v = torch.cat(enc_values).to(**to) if spec.write_encoder else None
    dec_k_new = torch.cat([dec_keys[b][pre:] for b, pre in enumerate(spec.prefix_lens)]).to(**to)
    dec_v_new = torch.cat([dec_values[b][pre:] for b, pre in enumerate(spec.prefix_lens)]).to(**to)
    return CrossCase(spec, cfg, layout, pool, batch, md, cross, self_attn, q.to(**to), enc_k, enc_v, dec_k_new,
                     dec_v_new, enc_keys, enc_values, dec_keys, dec_values, k_scale, v_scale)


def cross_oracle(case: CrossCase, *, from_pool: bool = False, q: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 non-causal attention of each request's queries over its encoder K/V -> [T, H, d_v].

    ``from_pool``: read the encoder K/V back from the pool (dequantized by hand for FP8).
    """
    q = (case.q if q is None else q).double().cpu()
    H, dv = case.cfg.num_heads, case.cfg.v_head_dim
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        E = case.spec.encoder_lens[b]
        if E == 0:
            outs.append(torch.zeros(e - s, H, dv, dtype=torch.float64))
            continue
        if from_pool:
            loc = case.encoder_slots(b).to(case.pool.device)
            k = case.pool.k_buffer[CROSS_LAYER][loc].double().cpu()
            v = case.pool.v_buffer[CROSS_LAYER][loc].double().cpu()
            if case.pool.is_fp8:
                k, v = k * case.k_scale, v * case.v_scale
        else:
            k = case.enc_keys[b].to(case.q.dtype).double()
            v = case.enc_values[b].to(case.q.dtype).double()
        mask = torch.ones(e - s, E, dtype=torch.bool)  # non-causal: every encoder token
        o, _ = dense_attention(q[s:e], k, v, scale=case.cross.scaling, softcap=case.cross.logit_cap, mask=mask)
        outs.append(o)
    return torch.cat(outs)


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
    case = make_cross_case(name, "gqa_8_2", kv_dtype=E4M3)
    out = case.forward_cross()
    assert out.dtype == torch.float32
    assert rel_err(out, cross_oracle(case, from_pool=True, q=fp8_query(case.q))) < FP8_TOL


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
