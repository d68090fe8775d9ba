"""FP8 latent-cache test cases: the e4m3 storage definition, the oracles fed the dequantized cache, and
the backend builders shared by the CPU and H200 tests (tables of named specs: ``specs.FP8_SPECS``)."""

from __future__ import annotations

import dataclasses

import torch

from mla_cases import make_mla_case, mla_oracle
from specs import FP8_SPECS, BatchSpec

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardMode
from mla_fa3.kv.pools import MLATokenPool

FP8 = torch.float8_e4m3fn
TOL = 1e-5
SCALES = (0.0125, 0.02)  # per layer: |x| up to 5.6 / 8.96 stays in range; randn rows rarely exceed that
EXT, DEC, MIX, VER = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY
DRAFT, DRAFT_EXT = ForwardMode.DRAFT_DECODE, ForwardMode.DRAFT_EXTEND



# ---------------------------------------------------------------------------------------------------
# the storage definition and the oracles (test code, from the definitions)


def stored(x: torch.Tensor, s: float) -> torch.Tensor:
    """What an e4m3 pool with scale ``s`` gives back for ``x``: float(e4m3(clamp(x / s))) · s, fp64."""
    s32 = torch.tensor(s, dtype=torch.float32)
    return ((x.float() / s32).clamp(-448, 448).to(FP8).float() * s32).double()


def quantized_query(q: torch.Tensor, w_uk: torch.Tensor, dims) -> torch.Tensor:
    """[q_lat | q_rope] of rows q [n, H, d_qk] quantized per tensor with scale absmax / 448 (fp32), fp64."""
    q_nope, q_rope = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # fp32, as the model computes it
    q_cat = torch.cat([q_lat, q_rope], dim=-1)
    s = torch.tensor(max(float(q_cat.abs().max()), 2.0 ** -100), dtype=torch.float32) / 448
    return ((q_cat.float() / s.to(q_cat.device)).to(FP8).float() * s.to(q_cat.device)).double().cpu()


def absorbed_rows(case, tokens: list[int]) -> torch.Tensor:
    """fp64 absorbed MLA of the rows ``tokens`` (quantized together), over the dequantized latent."""
    d, H = case.cfg.dims, case.cfg.num_heads
    r, dn = d.kv_lora_rank, d.qk_nope_head_dim
    qq = quantized_query(case.q[tokens], case.layer.mla_weights.w_uk, d)
    w_uv = case.kv_b_proj.double().view(H, dn + d.v_head_dim, r)[:, dn:, :]  # [H, d_v, r]
    owner = [(b, i) for b, (s, e) in enumerate(case.q_rows) for i in range(e - s)]
    out = []
    for j, t in enumerate(tokens):
        b, i = owner[t]
        lat = case.latent[b].double()  # already the dequantized rows
        pos = lat.shape[0] - (case.q_rows[b][1] - case.q_rows[b][0]) + i
        keys = lat[: pos + 1]
        p = torch.softmax(case.layer.scaling * qq[j] @ keys.T, dim=-1)  # [H, L]
        o_lat = p @ keys[:, :r]  # [H, r]
        out.append(torch.einsum("hvr,hr->hv", w_uv, o_lat))
    return torch.stack(out)


def decode_tokens(spec: BatchSpec) -> list[int]:
    """Token rows that run FlashMLA: every row of a decode-like step; n = 1 over a prefix otherwise."""
    rows = spec.q_rows
    if spec.mode.is_decode_like() or spec.mode is VER:
        return list(range(rows[-1][1])) if rows else []
    return [s for (s, e), p in zip(rows, spec.prefix_lens) if e - s == 1 and p > 0]


def fp8_oracle(case, *, query_e4m3: bool = True) -> torch.Tensor:
    """case.latent holds the raw rows; the keys each row reads: cached ones dequantized, an MHA row's own
    new rows raw; decode rows (decode-like) read everything from the cache. ``query_e4m3``: FlashMLA FP8 runs
    them, with the query quantized per step; False: split-KV, whose q is exact (the non-absorbed oracle)."""
    lid, spec = case.layer.layer_id, case.spec
    flash = decode_tokens(spec)
    truth = []
    for b, (p, (s, e)) in enumerate(zip(spec.prefix_lens, spec.q_rows)):
        raw = case.latent[b]
        new_raw = spec.mode.is_extend_like() and s not in flash
        truth.append(torch.cat([stored(raw[:p], SCALES[lid]).float(),
                                raw[p:] if new_raw else stored(raw[p:], SCALES[lid]).float()]))
    seen = dataclasses.replace(case, latent=truth)
    ref = mla_oracle(seen)  # non-absorbed fp64, exact q
    if flash and query_e4m3:
        ref[flash] = absorbed_rows(seen, flash)
    return ref


def fp8_case(spec, cfg="odd_small", *, seed=0, scales=SCALES, **kw):
    """make_mla_case with its pool replaced by an e4m3 pool: stale slots NaN, prefixes stored quantized."""
    spec = FP8_SPECS[spec] if isinstance(spec, str) else spec
    case = make_mla_case(spec, cfg, seed=seed, **kw)
    d, old, dev = case.cfg.dims, case.pool, case.q.device
    pool = MLATokenPool(old.num_layers, old.num_pages, old.page_size, d.kv_lora_rank, d.qk_rope_head_dim,
                        case.q.dtype, dev, kv_dtype=FP8)
    pool.set_scales(list(scales))
    for buf in pool.kv_buffer:
        # e4m3 NaN (0x7F) in every slot; on a GPU 448 (0x7E): kernels read whole pages and weight the
        # tail past a sequence by a zero probability, so it must be finite there (large garbage instead)
        buf.view(torch.uint8).fill_(0x7F if dev.type == "cpu" else 0x7E)
    lid = case.layer.layer_id
    for b, pre in enumerate(spec.prefix_lens):
        if pre:
            pool.set_latent(lid, case.layout.token_slots(b, 0, pre).to(dev),
                            case.latent[b][:pre].to(dev, case.q.dtype))
    case.pool = pool  # case.latent stays the raw rows (fp8_oracle derives what each read sees)
    return case


def fp8_backend(case, **kw) -> MLABackend:
    kw.setdefault("impl", "reference")
    kw.setdefault("num_heads", case.cfg.num_heads)
    kw.setdefault("mla_dims", case.cfg.dims)
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device=case.q.device, **kw)


def run(case, backend=None, new_latent=None, **kw):
    backend = backend or fp8_backend(case, **kw)
    backend.init_forward_metadata(case.batch)
    raw = case.new_latent if new_latent is None else new_latent
    return backend.forward(case.q, raw, None, case.layer, case.batch), backend
