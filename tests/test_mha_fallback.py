"""mha_fallback on CPU (reference kernels) against fp64 dense attention with explicit masks.

Every case builds a shuffled paged layout (``specs.make_layout``: random page order, stale slot ids in
unused ``req_to_token`` columns), an MHA pool whose every slot starts as NaN (reading a slot that is
not a live key poisons the output), writes each request's cached prefix, then runs ``forward`` with
the new tokens' K/V (which it must store at ``out_cache_loc`` before attending) and compares with
``tests/oracle.dense_attention`` over the ground-truth keys, with the mask written here from the
definitions:

    query at absolute position p sees key j  iff  j <= p
                                              and (W < 0 or j >= p - W)       (sliding window W)
                                              and (C = None or j // C == p // C)   (local chunk C)

FP8 (e4m3) pools are compared with the oracle run on the DEQUANTIZED cache (stored e4m3 * scale, read
back from the pool's buffers) and the e4m3-rounded query (per-tensor q scale ``max|q| / 448``, made a
power of two by construction so the rounding is unambiguous).

``MHA_CONFIGS`` / ``make_mha_case`` / ``mha_oracle`` are shared with ``test_cross_attention.py`` and
``test_mha_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from oracle import dense_attention
from specs import DEC, EXT, MIX, SPECS, VER, BatchSpec, CacheLayout, make_batch, make_layout, q_rows_of, rel_err

from mla_fa3 import mha_fallback, ops
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MHATokenPool
from mla_fa3.layer import AttentionLayer, LayerKind
from mla_fa3.metadata import AttentionMetadata, MetadataBuilder

FP32_TOL = 2e-5  # fp32 reference (online softmax, fp32 accumulation) vs fp64 oracle, relative to max|ref|
FP8_TOL = 2 ** -8  # FP8 inputs: fp32 accumulation, output rounded once to bf16 (FA3's fp8 output dtype)
E4M3 = torch.float8_e4m3fn
Q_AMAX = 7.0  # FP8 cases: max|q| = 7 in every (token, KV-head group), so any q_scale is 7/448 = 2^-6


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


def pin_amax(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """|q| <= 7 with max exactly 7 in every token's every KV-head group: the FP8 path's q scale is then
    2^-6 whatever its granularity (per tensor or per request and KV head), and q / scale is exact."""
    q = q.clamp(-Q_AMAX, Q_AMAX)
    if q.numel():
        q.view(q.shape[0], num_kv_heads, -1)[:, :, 0] = Q_AMAX
    return q


def fp8_query(q: torch.Tensor) -> torch.Tensor:
    """q as the FP8 path sees it: e4m3(q / s) * s with s = max|q| / 448 (= 2^-6 after pin_amax)."""
    s = float(q.abs().max()) / 448.0
    return quantize_e4m3(q, s).float() * s


def make_mha_case(spec: BatchSpec | str, cfg: MHAConfig | str = "gqa_8_2", *, dtype=torch.float32,
                  kv_dtype=None, device="cpu", seed: int = 0, num_layers: int = 2, layer_id: int = 1,
                  logit_cap: float = 0.0, sliding_window: int = -1, chunk: int | None = None,
                  k_scale: float = 0.05, v_scale: float = 0.03) -> MHACase:
    """A poisoned MHA pool holding each request's prefix, the step's batch and metadata, q and new K/V."""
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
    if fp8:
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
    """K, V of request b's live tokens as the pool holds them (dequantized by hand for FP8), fp64 cpu."""
    loc = case.layout.token_slots(b, 0, case.spec.seq_lens[b]).to(case.pool.device)
    k = case.pool.k_buffer[case.layer.layer_id][loc].double().cpu()
    v = case.pool.v_buffer[case.layer.layer_id][loc].double().cpu()
    if case.pool.is_fp8:
        k, v = k * case.k_scale, v * case.v_scale
    return k, v


def mha_oracle(case: MHACase, *, from_pool: bool = False, q: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 dense attention per request with explicit masks -> [T, H, d_v].

    ``from_pool``: use the K/V the pool holds after the step (dequantized for FP8) instead of the
    ground truth rounded to the model dtype.
    """
    q = (case.q if q is None else q).double().cpu()
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        if from_pool:
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


# ------------------------------------------------------------------------------------------- cases

MODE_SPECS = [name for name in SPECS if name != "idle"]

FEATURES = {  # name -> (config, layer options)
    "gqa": ("gqa_8_2", {}),
    "mqa_window": ("mqa", {"sliding_window": 5}),
    "gqa_softcap": ("gqa_8_2", {"logit_cap": 1.5}),
    "dv_window_softcap": ("mha_dv_differs", {"sliding_window": 3, "logit_cap": 1.5}),
}

# local attention: (spec, chunk C) with chunk borders inside the requests' new tokens / prefixes
LOCAL_SPECS = {
    "extend_borders_p4": (BatchSpec(EXT, (5, 0, 13), (9, 11, 1), page_size=4), 8),
    "decode_borders_p4": (BatchSpec(DEC, (7, 8, 23, 0), (1, 1, 1, 1), page_size=4), 8),
    "mixed_p16": (BatchSpec(MIX, (30, 0, 47), (5, 20, 1), page_size=16), 16),
    "verify_p1": (BatchSpec(VER, (6, 13), (4, 4), page_size=1), 8),
    "draft_extend_p1": (BatchSpec(ForwardMode.DRAFT_EXTEND, (7, 2), (3, 9), page_size=1), 4),
    "extend_p64": (BatchSpec(EXT, (60, 3), (9, 70), page_size=64), 64),
}

FP8_CASES = {  # name -> (spec, config, layer options, chunk)
    "decode_gqa": ("small_decode", "gqa_8_2", {}, None),
    "extend_prefix_mqa": ("extend_with_prefix", "mqa", {}, None),
    "verify_window": ("verify_k4", "gqa_8_2", {"sliding_window": 6}, None),
    "mixed_softcap": ("mixed_long_prefix", "gqa_8_2", {"logit_cap": 1.5}, None),
    "decode_page64": ("decode_page64_long", "mha_dv_differs", {}, None),
    "local_extend": (LOCAL_SPECS["extend_borders_p4"][0], "gqa_8_2", {}, 8),
    "local_verify": (LOCAL_SPECS["verify_p1"][0], "gqa_8_2", {"sliding_window": 2}, 8),
    "draft_decode_mqa": ("draft_decode", "mqa", {"logit_cap": 1.5}, None),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("spec_name", MODE_SPECS)
def test_matches_oracle(spec_name, feature):
    cfg, opts = FEATURES[feature]
    case = make_mha_case(spec_name, cfg, **opts)
    out = case.forward()
    assert out.shape == (case.batch.num_tokens, case.cfg.num_heads, case.cfg.v_head_dim)
    assert out.dtype == case.q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, mha_oracle(case)) < FP32_TOL


@pytest.mark.parametrize("spec_name", ["small_decode", "verify_k4"])
def test_deepseek_v3_dims(spec_name):
    case = make_mha_case(spec_name, "deepseek_v3_mha_dims", sliding_window=40)
    assert rel_err(case.forward(), mha_oracle(case)) < FP32_TOL


@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("local_name", LOCAL_SPECS)
def test_local_attention(local_name, window):
    spec, chunk = LOCAL_SPECS[local_name]
    case = make_mha_case(spec, "gqa_8_2", chunk=chunk, sliding_window=window)
    assert case.metadata.local is not None
    assert rel_err(case.forward(), mha_oracle(case)) < FP32_TOL


def test_local_attention_differs_from_global():
    """The chunk mask really cuts: the same step without local attention gives another answer."""
    spec, chunk = LOCAL_SPECS["extend_borders_p4"]
    local = make_mha_case(spec, chunk=chunk)
    out_local = local.forward()
    plain = make_mha_case(spec)
    out_plain = plain.forward()
    assert rel_err(out_local, out_plain) > 1e-2
    assert rel_err(out_plain, mha_oracle(plain)) < FP32_TOL


@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_matches_dequantized_oracle(name):
    spec, cfg, opts, chunk = FP8_CASES[name]
    case = make_mha_case(spec, cfg, kv_dtype=E4M3, chunk=chunk, **opts)
    out = case.forward()
    assert out.dtype == case.q.dtype
    # the new tokens were quantized into the pool: the oracle reads the pool back, dequantizing by hand
    for b, pre in enumerate(case.spec.prefix_lens):
        loc = case.layout.token_slots(b, pre, case.spec.seq_lens[b])
        assert torch.equal(case.pool.k_buffer[1][loc].float(), quantize_e4m3(case.keys[b][pre:], case.k_scale).float())
    ref = mha_oracle(case, from_pool=True, q=fp8_query(case.q))
    assert rel_err(out, ref) < FP8_TOL
    # and the whole FP8 round trip stays close to full precision
    full = mha_oracle(case)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), full.flatten(), dim=0)
    assert cos > 0.995


@pytest.mark.parametrize("uniform", [False, True])
def test_quantize_query_scales(uniform):
    """q_scale = max|q| / 448 per tensor, or per request and KV-head group; q8 * scale round-trips q."""
    bs, per, h_kv, group, d = 3, 2, 2, 4, 16
    g = torch.Generator().manual_seed(4)
    mags = torch.tensor([1e-4, 1.0, 300.0]).view(bs, 1, 1, 1, 1)  # very different magnitudes per request
    q = (torch.randn(bs, per, h_kv, group, d, generator=g) * mags).view(bs * per, h_kv * group, d)
    q8, scale = mha_fallback.quantize_query(q, bs, h_kv, uniform=uniform)
    assert q8.dtype == E4M3 and q8.shape == q.shape and scale.shape == (bs, h_kv) and scale.dtype == torch.float32
    if uniform:
        want = q.view(bs, per, h_kv, group, d).abs().amax(dim=(1, 3, 4)) / 448.0
    else:
        want = (q.abs().max() / 448.0).expand(bs, h_kv)
    assert torch.allclose(scale, want, rtol=1e-6, atol=0)
    back = q8.float().view(bs, per, h_kv, group, d) * scale.view(bs, 1, h_kv, 1, 1)
    err = (back - q.view(bs, per, h_kv, group, d)).abs()
    # e4m3: 3 mantissa bits (relative step 2^-3, error <= 2^-4 of |q|) down to the subnormal step 2^-9 * scale
    bound = 2 ** -4 * q.view(bs, per, h_kv, group, d).abs() + 2 ** -10 * scale.view(bs, 1, h_kv, 1, 1)
    assert (err <= bound * 1.0001).all()
    if not uniform:  # one scale for all: the tiny request underflows to 0 (what per-request scales avoid)
        assert (back[0] == 0).all()


def test_bf16_pool():
    case = make_mha_case("mixed_long_prefix", "gqa_8_2", dtype=torch.bfloat16, sliding_window=7)
    out = case.forward()
    assert out.dtype == torch.bfloat16
    # fp32 accumulation, one bf16 rounding of the output: within 2^-8 of max|ref|
    assert rel_err(out, mha_oracle(case)) < 2 ** -8


def test_window_counts_current_token():
    """sliding_window = W: a query sees W + 1 keys, itself included (uniform scores: out = mean of them)."""
    spec = BatchSpec(DEC, (9,), (1,), page_size=4)
    case = make_mha_case(spec, "mqa", sliding_window=3)
    case.q.zero_()  # every score 0: softmax is uniform over the visible keys
    out = case.forward()
    v = case.values[0]  # [10, 1, d_v]
    expected = v[6:10].mean(dim=0)  # positions 6, 7, 8, 9 (the query's own position is 9)
    assert torch.allclose(out[0], expected.expand_as(out[0]), atol=1e-6)
    case0 = make_mha_case(spec, "mqa", sliding_window=0)
    case0.q.zero_()
    assert torch.allclose(case0.forward()[0], v[9].expand_as(out[0]), atol=1e-6)


def test_save_kv_cache_false_does_not_write():
    case = make_mha_case("extend_with_prefix", "gqa_8_2")
    case.pool.set_kv(1, case.batch.out_cache_loc, case.k_new, case.v_new)  # written beforehand
    before = case.pool.k_buffer[1].clone(), case.pool.v_buffer[1].clone()
    out = mha_fallback.forward(case.q, torch.randn_like(case.k_new), torch.randn_like(case.v_new), case.layer,
                               case.batch, case.metadata, case.pool, save_kv_cache=False)
    assert same_bits(case.pool.k_buffer[1], before[0]) and same_bits(case.pool.v_buffer[1], before[1])
    assert rel_err(out, mha_oracle(case)) < FP32_TOL


def test_kv_none_reads_cached_tokens():
    case = make_mha_case("verify_k4", "mqa")
    case.pool.set_kv(1, case.batch.out_cache_loc, case.k_new, case.v_new)
    out = mha_fallback.forward(case.q, None, None, case.layer, case.batch, case.metadata, case.pool)
    assert rel_err(out, mha_oracle(case)) < FP32_TOL


def test_other_layer_untouched():
    case = make_mha_case("small_decode", "gqa_8_2", layer_id=1)
    case.forward()
    assert torch.isnan(case.pool.k_buffer[0]).all() and torch.isnan(case.pool.v_buffer[0]).all()


def test_idle_returns_empty():
    case = make_mha_case("idle", "gqa_8_2")
    out = case.forward()
    assert out.shape == (0, 8, 16)


# ------------------------------------------------------------------------------------ named errors


def _no_kernel(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel ran before the input was rejected")
    monkeypatch.setattr(ops, "flash_attn_with_kvcache", boom)


def _assert_rejected(case, exc, match, **overrides):
    args = dict(q=case.q, k=case.k_new, v=case.v_new, layer=case.layer, batch=case.batch,
                metadata=case.metadata, pool=case.pool)
    args.update(overrides)
    k_before = case.pool.k_buffer[case.layer.layer_id].clone()
    with pytest.raises(exc, match=match):
        mha_fallback.forward(args["q"], args["k"], args["v"], args["layer"], args["batch"], args["metadata"],
                             args["pool"])
    assert same_bits(case.pool.k_buffer[case.layer.layer_id], k_before), \
        "the pool was written before the input was rejected"


def test_error_mla_layer(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode")
    case.layer.kind = LayerKind.MLA
    _assert_rejected(case, ValueError, "^layer.kind")


def test_error_cross_with_window_or_local(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode")
    case.layer.kind = LayerKind.CROSS
    case.layer.sliding_window = 4
    _assert_rejected(case, ValueError, "^layer.sliding_window")
    case.layer.sliding_window = -1
    case.layer.use_local_attention = True
    _assert_rejected(case, ValueError, "^layer.use_local_attention")


def test_error_missing_local_or_encoder_metadata(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("extend_with_prefix")
    case.layer.use_local_attention = True
    _assert_rejected(case, ValueError, "^metadata.local")
    case.layer.use_local_attention = False
    case.layer.kind = LayerKind.CROSS
    _assert_rejected(case, ValueError, "^metadata.encoder", k=None, v=None)


@pytest.mark.parametrize("head_dim, v_head_dim", [(288, 16), (16, 320), (24, 16)])
def test_error_fp8_head_dims(monkeypatch, head_dim, v_head_dim):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode", MHAConfig(2, 1, head_dim, v_head_dim), kv_dtype=E4M3)
    name = "head_dim" if head_dim != 16 else "v_head_dim"
    _assert_rejected(case, ValueError, f"^layer.{name}")


def test_error_shapes_and_dtypes(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("extend_with_prefix", "gqa_8_2")
    T, H, d = case.q.shape
    _assert_rejected(case, ValueError, "^q must have shape", q=case.q[:-1])
    _assert_rejected(case, ValueError, "^q must have shape", q=case.q[:, :4])
    _assert_rejected(case, ValueError, "^q must have shape", q=torch.randn(T, H, 2 * d))
    _assert_rejected(case, TypeError, "^q dtype", q=case.q.to(torch.bfloat16))
    _assert_rejected(case, ValueError, "^q must be on", q=torch.empty(T, H, d, device="meta"))
    _assert_rejected(case, ValueError, "^k must have shape", k=case.k_new[:-1])
    _assert_rejected(case, ValueError, "^k must have shape", k=torch.randn(T, 8, d))
    _assert_rejected(case, ValueError, "^v must have shape", v=case.v_new[..., :8])
    _assert_rejected(case, ValueError, "^k and v must be given together", v=None)
    _assert_rejected(case, TypeError, "^k must be a torch.Tensor", k=[1.0])


def test_error_layer_pool_mismatch(monkeypatch):
    _no_kernel(monkeypatch)
    case = make_mha_case("small_decode", "gqa_8_2")
    case.layer.num_kv_heads = 4
    _assert_rejected(case, ValueError, "^layer.num_kv_heads")
    case = make_mha_case("small_decode", "gqa_8_2", num_layers=2, layer_id=1)
    case.layer.layer_id = 5
    with pytest.raises(ValueError, match="^layer.layer_id"):
        case.forward()


@pytest.mark.parametrize("spec_name, chunk", [("mixed_long_prefix", None), ("verify_k4", None),
                                              ("extend_with_prefix", 16)])
def test_through_backend(spec_name, chunk):
    """MLABackend dispatches an MHA layer (and its local-attention variant) to this module."""
    from mla_fa3.backend import MLABackend

    case = make_mha_case(spec_name, "gqa_8_2", sliding_window=6, logit_cap=2.0, chunk=chunk)
    backend = MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                         page_size=case.spec.page_size, device="cpu", attention_chunk_size=chunk)
    backend.init_forward_metadata(case.batch)
    out = backend.forward(case.q, case.k_new, case.v_new, case.layer, case.batch)
    assert rel_err(out, mha_oracle(case)) < FP32_TOL
