"""MHA cases for the mha_fallback tests: configs, poisoned MHA pools over shuffled pages, fp64 oracles.

:func:`make_mha_case` builds a self-attention step over a spec of ``specs.py`` (an MHA pool whose every
slot starts as NaN, each request's cached prefix written, q and the new K/V); :func:`mha_oracle` is fp64
dense attention with the mask written from the definitions (:func:`visible`). :func:`make_cross_case`
builds an encoder-decoder step over a :class:`specs.CrossSpec` (request b's ``E_b`` encoder tokens in
the first ``ceil(E_b / p) * p`` columns of its ``req_to_token`` row, its decoder tokens right after) and
:func:`cross_oracle` its non-causal attention over the encoder K/V. The FP8 functions quantize the cache and
the query from the definitions (per-tensor K/V scales; the query scale per tensor or per request and KV-head
group, :func:`fp8_query`); an FP8 oracle dequantizes the K/V the test WROTE (``quantized=True``) rather than
reading the pool under test back (``from_pool=True``, kept for graph replays that write other values).
Shared by ``test_mha_fallback.py``, ``test_mha_fallback_cross.py`` and ``test_mha_fallback_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_cases import CacheLayout, make_batch, make_layout, rel_err
from oracle import dense_attention
from specs import CROSS_SPECS, DEC, LOCAL_SPECS, SPECS, BatchSpec, CrossSpec, q_rows_of

from mla_fa3 import mha_fallback
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MHATokenPool
from mla_fa3.layer import AttentionLayer, LayerKind
from mla_fa3.metadata import AttentionMetadata, MetadataBuilder

FP32_TOL = 2e-5  # fp32 reference (online softmax, fp32 accumulation) vs fp64 oracle, relative to max|ref|
FP8_TOL = 2 ** -8  # FP8 inputs: fp32 accumulation, output rounded once to bf16 (FA3's fp8 output dtype)
E4M3 = torch.float8_e4m3fn
Q_AMAX = 7.0  # FP8 cases: max|q| = 7 in every (token, KV-head group), so any q_scale is 7/448 = 2^-6
# FP8 cases with query groups of very different magnitudes: request b's KV-head group g is scaled by
# Q_GROUP_MAGS[b % 3][g % 2] (MQA: its one group takes the first column), so the per-tensor, per-request and
# per-(request, KV-head group) q scales all differ and a path using another granularity than the documented
# one rounds q differently (1 / 64: the large groups' scores stay moderate in fp32)
Q_GROUP_MAGS = ((1.0, 1.0), (64.0, 1.0), (1.0, 64.0))


@dataclass(frozen=True)
class MHAConfig:
    """Heads and head dims of a test layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


MHA_CONFIGS: dict[str, MHAConfig] = {
    "gqa_8_2": MHAConfig(8, 2, 16, 16),
    "mqa": MHAConfig(4, 1, 16, 16),
    "mha_dv_differs": MHAConfig(3, 3, 32, 16),
    "deepseek_v3_mha_dims": MHAConfig(128, 128, 192, 128),  # DeepSeek-V3's MHA-prefill head dims
}


@dataclass
class MHACase:
    """Pool + layout + batch + metadata + inputs of one step, with the ground-truth K/V per request."""

    spec: BatchSpec
    cfg: MHAConfig
    layout: CacheLayout
    pool: MHATokenPool
    batch: ForwardBatch
    metadata: AttentionMetadata
    layer: AttentionLayer
    q: torch.Tensor  # [T, H, d] model dtype, device
    k_new: torch.Tensor  # [T, H_kv, d] model dtype, device — the new tokens' keys
    v_new: torch.Tensor  # [T, H_kv, d_v]
    keys: list[torch.Tensor]  # per request [seq_b, H_kv, d] fp32 cpu (prefix + new)
    values: list[torch.Tensor]  # per request [seq_b, H_kv, d_v] fp32 cpu
    chunk: int | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def q_rows(self) -> list[tuple[int, int]]:
        return q_rows_of(self.spec.extend_lens)

    def forward(self, **kw) -> torch.Tensor:
        return mha_fallback.forward(self.q, self.k_new, self.v_new, self.layer, self.batch, self.metadata,
                                    self.pool, **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN, any dtype, fp8 included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def poison(pool: MHATokenPool) -> None:
    """NaN in every slot of every layer (e4m3 has a NaN encoding too)."""
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(float("nan"))


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Stored FP8 value of x under a per-tensor scale: e4m3(clamp(x / scale, ±448))."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(E4M3)


def dequantized_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an e4m3 pool with per-tensor ``scale`` gives back for ``x``: float(e4m3(x / scale)) * scale, fp64 cpu."""
    return quantize_e4m3(x.cpu(), scale).double() * torch.tensor(scale, dtype=torch.float32).double()


def scale_query_groups(q: torch.Tensor, q_rows: list[tuple[int, int]], num_kv_heads: int,
                       mags=Q_GROUP_MAGS) -> torch.Tensor:
    """q with request b's KV-head group g multiplied by ``mags[b % len(mags)][g % 2]`` (a new tensor)."""
    q = q.clone()
    view = q.view(q.shape[0], num_kv_heads, -1)
    for b, (s, e) in enumerate(q_rows):
        for g in range(num_kv_heads):
            view[s:e, g] *= mags[b % len(mags)][g % 2]
    return q


def pin_amax(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """|q| <= 7 with max exactly 7 in every token's every KV-head group: the FP8 path's q scale is then
    2^-6 whatever its granularity (per tensor or per request and KV head), and q / scale is exact."""
    q = q.clamp(-Q_AMAX, Q_AMAX)
    if q.numel():
        q.view(q.shape[0], num_kv_heads, -1)[:, :, 0] = Q_AMAX
    return q


def fp8_query(q: torch.Tensor, *, rows: list[tuple[int, int]] | None = None, num_kv_heads: int = 1) -> torch.Tensor:
    """q as the FP8 path sees it: e4m3(q / s) * s, fp32, with s = max|q| / 448 (fp32) over

    - the whole tensor (``rows`` None: one per-tensor scale; 2^-6 after pin_amax), or
    - each query run ``rows[i] = (start, end)`` and KV-head group (heads ``g * H / H_kv .. (g+1) * H / H_kv``).
    """
    if rows is None:
        s = float(q.abs().max()) / 448.0
        return quantize_e4m3(q, s).float() * s
    out = torch.empty(q.shape, dtype=torch.float32)
    qf, o = q.float().cpu(), out.view(q.shape[0], num_kv_heads, -1, q.shape[-1])
    grouped = qf.view(q.shape[0], num_kv_heads, -1, q.shape[-1])
    for s, e in rows:
        for g in range(num_kv_heads):
            block = grouped[s:e, g]
            scale = (block.abs().max() / 448.0).clamp(min=1e-12)  # fp32, as the definition states
            o[s:e, g] = (block / scale).clamp(-448.0, 448.0).to(E4M3).float() * scale
    return out


def q_scale_runs(mode: ForwardMode, q_rows: list[tuple[int, int]], local: bool) -> list[tuple[int, int]] | None:
    """The query runs that each get their own q scale per KV-head group, from ``mha_fallback``'s documented rule:
    every request's run when all requests have the same number of queries (decode, draft decode; target-verify
    unless local attention splits its runs at chunk borders); None (one per-tensor scale) otherwise."""
    if mode in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE) or (mode is ForwardMode.TARGET_VERIFY and not local):
        return q_rows
    return None


def rel_err_per_request(out, ref, q_rows) -> list[float]:
    """rel_err of each request's rows (each against its own max|ref|)."""
    return [rel_err(out[s:e], ref[s:e]) for s, e in q_rows if e > s]


def make_mha_case(spec: BatchSpec | str, cfg: MHAConfig | str = "gqa_8_2", *, dtype=torch.float32,
                  kv_dtype=None, device="cpu", seed: int = 0, num_layers: int = 2, layer_id: int = 1,
                  logit_cap: float = 0.0, sliding_window: int = -1, chunk: int | None = None,
                  k_scale: float = 0.05, v_scale: float = 0.03, q_group_mags=None) -> MHACase:
    """A poisoned MHA pool holding each request's prefix, the step's batch and metadata, q and new K/V.

    FP8: q is pinned (:func:`pin_amax`) unless ``q_group_mags`` is given, which scales each request's
    KV-head groups instead (:func:`scale_query_groups`).
    """
    spec = SPECS[spec] if isinstance(spec, str) else spec
    cfg = MHA_CONFIGS[cfg] if isinstance(cfg, str) else cfg
    p, fp8 = spec.page_size, kv_dtype == E4M3
    layout = make_layout([s + spec.reserve for s in spec.seq_lens], p, device=device, seed=seed)
    pool = MHATokenPool(num_layers, layout.num_pages, p, cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim,
                        dtype, device, kv_dtype=kv_dtype)
    poison(pool)
    if fp8:
        pool.set_scales(layer_id, k_scale, v_scale)
    g = torch.Generator().manual_seed(2000 + seed)
    keys = [torch.randn(s, cfg.num_kv_heads, cfg.head_dim, generator=g) for s in spec.seq_lens]
    values = [torch.randn(s, cfg.num_kv_heads, cfg.v_head_dim, generator=g) for s in spec.seq_lens]
    for b, pre in enumerate(spec.prefix_lens):
        if pre:
            loc = layout.token_slots(b, 0, pre).to(device)
            kb, vb = keys[b][:pre], values[b][:pre]
            pool.k_buffer[layer_id][loc] = (quantize_e4m3(kb, k_scale) if fp8 else kb.to(dtype)).to(device)
            pool.v_buffer[layer_id][loc] = (quantize_e4m3(vb, v_scale) if fp8 else vb.to(dtype)).to(device)
    T = sum(spec.extend_lens)
    q = torch.randn(T, cfg.num_heads, cfg.head_dim, generator=g)
    if q_group_mags is not None:
        q = scale_query_groups(q, q_rows_of(spec.extend_lens), cfg.num_kv_heads, q_group_mags)
    elif fp8:
        q = pin_amax(q, cfg.num_kv_heads)
    k_new = torch.cat([keys[b][pre:] for b, pre in enumerate(spec.prefix_lens)]) if T else \
        torch.empty(0, cfg.num_kv_heads, cfg.head_dim)
    v_new = torch.cat([values[b][pre:] for b, pre in enumerate(spec.prefix_lens)]) if T else \
        torch.empty(0, cfg.num_kv_heads, cfg.v_head_dim)
    layer = AttentionLayer(layer_id=layer_id, kind=LayerKind.MHA, num_heads=cfg.num_heads,
                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, v_head_dim=cfg.v_head_dim,
                           scaling=cfg.scale, logit_cap=logit_cap, sliding_window=sliding_window,
                           use_local_attention=chunk is not None)
    batch = make_batch(layout, spec.mode, spec.prefix_lens, spec.extend_lens)
    builder = MetadataBuilder(layout.req_to_token_pool, p, device, attention_chunk_size=chunk,
                              num_slots=layout.num_slots)
    md = builder.build(batch)
    to = dict(dtype=dtype, device=device)
    return MHACase(spec, cfg, layout, pool, batch, md, layer, q.to(**to), k_new.to(**to), v_new.to(**to),
                   keys, values, chunk, k_scale, v_scale)


def visible(n: int, L: int, *, window: int = -1, chunk: int | None = None) -> torch.Tensor:
    """[n, L] bool: the n queries at positions L-n .. L-1 over keys 0 .. L-1 (causal, window, chunk)."""
    pos = torch.arange(L - n, L).unsqueeze(1)
    key = torch.arange(L).unsqueeze(0)
    mask = key <= pos
    if window >= 0:
        mask &= key >= pos - window
    if chunk is not None:
        mask &= key // chunk == pos // chunk
    return mask


def stored_kv(case: MHACase, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of request b's live tokens as the pool holds them (dequantized by hand for FP8), fp64 cpu.

    This reads the pool under test back (``from_pool``): for a step whose K/V the test cannot name otherwise
    (a graph replay writing new values). Oracles of the path's own stores use :func:`quantized_kv`."""
    loc = case.layout.token_slots(b, 0, case.spec.seq_lens[b]).to(case.pool.device)
    k = case.pool.k_buffer[case.layer.layer_id][loc].double().cpu()
    v = case.pool.v_buffer[case.layer.layer_id][loc].double().cpu()
    if case.pool.is_fp8:
        k, v = k * case.k_scale, v * case.v_scale
    return k, v


def quantized_kv(case: MHACase, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of request b's live tokens as an e4m3 pool with the case's scales holds them, fp64 cpu: quantized
    here from the values the test wrote (prefix) and handed to the step (new tokens), not read from the pool."""
    if not case.pool.is_fp8:
        raise ValueError("quantized_kv: the case's pool is not FP8")
    pre = case.spec.prefix_lens[b]

    def written(x):  # the prefix as make_mha_case stored it; the new tokens as the step got them (model dtype)
        return torch.cat([x[:pre], x[pre:].to(case.q.dtype).float()])

    return (dequantized_e4m3(written(case.keys[b]), case.k_scale),
            dequantized_e4m3(written(case.values[b]), case.v_scale))


def mha_oracle(case: MHACase, *, quantized: bool = False, from_pool: bool = False,
               q: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 dense attention per request with explicit masks -> [T, H, d_v].

    ``quantized`` (FP8 pools): the K/V as e4m3 storage gives them back, quantized here from the values written
    (:func:`quantized_kv`), instead of the ground truth rounded to the model dtype. ``from_pool``: the K/V the
    pool holds after the step (:func:`stored_kv`: it reads the pool under test back, so it cannot see a
    store with the wrong scale; only for steps whose K/V the case does not hold).
    """
    q = (case.q if q is None else q).double().cpu()
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        if quantized:
            k, v = quantized_kv(case, b)
        elif from_pool:
            k, v = stored_kv(case, b)
        else:
            k = case.keys[b].to(case.q.dtype).double()
            v = case.values[b].to(case.q.dtype).double()
        mask = visible(e - s, k.shape[0], window=case.layer.sliding_window, chunk=case.chunk)
        o, _ = dense_attention(q[s:e], k, v, scale=case.layer.scaling, softcap=case.layer.logit_cap, mask=mask)
        outs.append(o)
    if not outs:
        return torch.empty(0, case.cfg.num_heads, case.cfg.v_head_dim, dtype=torch.float64)
    return torch.cat(outs)


# FP8 cases: name -> (spec, config, layer options, chunk)
FP8_CASES = {
    "decode_gqa": ("small_decode", "gqa_8_2", {}, None),
    "extend_prefix_mqa": ("extend_with_prefix", "mqa", {}, None),
    "verify_window": ("verify_k4", "gqa_8_2", {"sliding_window": 6}, None),
    "mixed_softcap": ("mixed_long_prefix", "gqa_8_2", {"logit_cap": 1.5}, None),
    "decode_page64": ("decode_page64_long", "mha_dv_differs", {}, None),
    "local_extend": (LOCAL_SPECS["extend_borders_p4"], "gqa_8_2", {}, 8),
    "local_verify": (LOCAL_SPECS["verify_p1"], "gqa_8_2", {"sliding_window": 2}, 8),
    "draft_decode_mqa": ("draft_decode", "mqa", {"logit_cap": 1.5}, None),
}


# ------------------------------------------------------------------------------------------- cross-attention
CROSS_LAYER, SELF_LAYER = 0, 1


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
                    k_scale: float = 0.05, v_scale: float = 0.03, reserve: int = 3,
                    q_group_mags=None) -> CrossCase:
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
    if q_group_mags is not None:
        q = scale_query_groups(q, q_rows_of(spec.extend_lens), h_kv, q_group_mags)
    elif fp8:
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


def cross_oracle(case: CrossCase, *, quantized: bool = False, from_pool: bool = False,
                 q: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 non-causal attention of each request's queries over its encoder K/V -> [T, H, d_v].

    ``quantized`` (FP8 pools): the encoder K/V as e4m3 storage with the case's scales gives them back,
    quantized here from the values the test wrote or handed to the step (never read from the pool).
    ``from_pool``: read the encoder K/V back from the pool under test (dequantized by hand for FP8).
    """
    q = (case.q if q is None else q).double().cpu()
    H, dv = case.cfg.num_heads, case.cfg.v_head_dim
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        E = case.spec.encoder_lens[b]
        if E == 0:
            outs.append(torch.zeros(e - s, H, dv, dtype=torch.float64))
            continue
        if quantized:
            if not case.pool.is_fp8:
                raise ValueError("cross_oracle(quantized=True): the case's pool is not FP8")
            given = (lambda x: x.to(case.q.dtype).float()) if case.enc_k is not None else (lambda x: x)  # model dtype
            k = dequantized_e4m3(given(case.enc_keys[b]), case.k_scale)
            v = dequantized_e4m3(given(case.enc_values[b]), case.v_scale)
        elif from_pool:
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
