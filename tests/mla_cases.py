"""Adversarial paged caches and MLA cases over the named specs of ``specs.py``, and their fp64 oracle.

:func:`make_layout` turns a spec into a request-to-token table over SHUFFLED pages (a random
permutation of page ids, random request rows, stale slot ids in every unused ``req_to_token``
column) with room reserved past each sequence's end; :func:`make_batch` builds any
``ForwardBatch`` over a layout (so one layout serves e.g. a verify step and the k decodes it stands
for). :func:`make_mla_case` adds a latent pool whose every slot starts as NaN (the padding page,
unused pages and the reserved slots past each sequence stay NaN: reading one poisons the output), the
prefix rows written, random queries, new latent rows and a kv_b_proj weight; :func:`mla_oracle`
computes the NON-absorbed answer in fp64 with ``tests/oracle.py``.

Everything here is test fixture code written from the definitions: slots are ``page * p + offset``,
a request's token ``j`` lives on its ``j // p``-th page — no library helper is used to build them.
Other pools (MHA, FP8) can reuse :func:`make_layout` / :func:`make_batch` and fill their own buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from oracle import dense_attention, mla_nonabsorbed
from specs import DEC, MLA_CONFIGS, SPECS, VER, BatchSpec, MLAConfig

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims


@dataclass
class CacheLayout:
    """Where every token of every request lives: a shuffled paged layout in a ReqToTokenPool."""

    page_size: int
    num_pages: int  # pool pages, page 0 (padding) included
    req_to_token_pool: ReqToTokenPool
    rows: list[int]  # req_to_token row of each request (shuffled, never 0 when avoidable)
    slots: list[torch.Tensor]  # per request [allocated tokens] int64 slot of token j (cpu)
    device: torch.device

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def token_slots(self, b: int, start: int, end: int) -> torch.Tensor:
        return self.slots[b][start:end]


def make_layout(alloc_lens, page_size: int, *, device="cpu", seed: int = 0, extra_pages: int = 3,
                max_context: int | None = None) -> CacheLayout:
    """Pages for requests that own ``alloc_lens[b]`` tokens each, in a random page order.

    Unused ``req_to_token`` columns hold stale slot ids (random valid slots): only the builder's
    ``seq_lens`` bound may keep a kernel from reading them.
    """
    g = torch.Generator().manual_seed(seed)
    p = page_size
    pages_per_req = [-(-n // p) for n in alloc_lens]
    num_pages = 1 + sum(pages_per_req) + extra_pages
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 is never handed out
    bs = len(alloc_lens)
    max_context = max_context or max([n for n in alloc_lens] + [1]) + 2 * p
    pool = ReqToTokenPool(bs + 2, max_context, device)
    rows = (torch.randperm(bs + 1, generator=g) + 1)[:bs].tolist()
    table = torch.randint(0, num_pages * p, (bs + 2, max_context), generator=g, dtype=torch.int32)
    slots, cursor = [], 0
    for b, n in enumerate(alloc_lens):
        pages = torch.tensor(perm[cursor:cursor + pages_per_req[b]], dtype=torch.int64)
        cursor += pages_per_req[b]
        j = torch.arange(n, dtype=torch.int64)
        s = pages[j // p] * p + j % p if n else j
        slots.append(s)
        table[rows[b], :n] = s.to(torch.int32)
    pool.req_to_token.copy_(table.to(pool.req_to_token.device))
    # the fixture owns its layout: it holds its rows with the tokens it gave slots; row 0 is the
    # CUDA-graph padding row (its table is stale: padding requests read it, never write through it)
    pool.claim([0] + rows, [max_context] + [int(n) for n in alloc_lens])
    return CacheLayout(p, num_pages, pool, rows, slots, torch.device(device))


def make_batch(layout: CacheLayout, mode: ForwardMode, prefix_lens, extend_lens, *, requests=None,
               draft_step: int = 0, pad_to: int | None = None) -> ForwardBatch:
    """A batch over ``layout``: request b's new tokens are its tokens prefix_b .. prefix_b + n_b - 1.

    ``requests``: which of the layout's requests form the batch, in batch order (default: the first
    ``len(prefix_lens)``). ``pad_to``: append CUDA-graph padding requests up to that many (as a graph
    runner does: request row 0, seq_len = their new tokens, every new token written to slot 0).
    """
    dev = layout.device
    if mode is ForwardMode.IDLE:
        return ForwardBatch.idle(dev)
    bs = len(prefix_lens)
    reqs = list(range(bs)) if requests is None else list(requests)
    rows = [layout.rows[b] for b in reqs]
    loc = torch.cat([layout.token_slots(r, prefix_lens[i], prefix_lens[i] + extend_lens[i])
                     for i, r in enumerate(reqs)]) if bs else torch.empty(0, dtype=torch.int64)
    seq = [p + n for p, n in zip(prefix_lens, extend_lens)]
    if pad_to is not None and pad_to > bs:
        n = extend_lens[0]
        pad = pad_to - bs
        rows, seq = rows + [0] * pad, seq + [n] * pad
        prefix_lens, extend_lens = list(prefix_lens) + [0] * pad, list(extend_lens) + [n] * pad
        loc = torch.cat([loc, torch.zeros(pad * n, dtype=torch.int64)])
    if mode.is_extend_like():
        return ForwardBatch.extend(rows, list(prefix_lens), list(extend_lens), loc, dev, mode=mode)
    if mode is DEC:
        return ForwardBatch.decode(rows, seq, loc, dev)
    if mode is VER:
        return ForwardBatch.verify(rows, seq, loc, dev, num_draft_tokens=extend_lens[0])
    if mode is ForwardMode.DRAFT_DECODE:
        return ForwardBatch.draft_decode(rows, seq, loc, dev, step=draft_step)
    raise ValueError(f"mode {mode!r} not handled")


@dataclass
class MLACase:
    """A latent pool + batch + inputs for one spec and MLA config, with the ground truth latent."""

    spec: BatchSpec
    cfg: MLAConfig
    layout: CacheLayout
    pool: MLATokenPool
    batch: ForwardBatch
    layer: AttentionLayer
    kv_b_proj: torch.Tensor  # [H*(d_nope+d_v), r] fp32 (cpu)
    latent: list[torch.Tensor]  # per request [seq_b, r + d_rope] fp32 (cpu): prefix + new rows
    q: torch.Tensor  # [T, H, d_nope + d_rope] pool dtype, device
    new_latent: torch.Tensor  # [T, r + d_rope] pool dtype, device — the rows forward stores
    extra: dict = field(default_factory=dict)

    @property
    def q_rows(self) -> list[tuple[int, int]]:
        """(start, end) rows of each request's queries in q."""
        return self.spec.q_rows


STALE_FINITE = 3.0e3  # poison for the tail of a sequence's last page on a GPU (see make_mla_case)


def make_mla_case(spec: BatchSpec | str, cfg: MLAConfig | str = "tiny", *, dtype=torch.float32, device="cpu",
                  seed: int = 0, num_layers: int = 2, layer_id: int = 1, logit_cap: float = 0.0,
                  sliding_window: int = -1, poison: bool = True, reserve: int | None = None) -> MLACase:
    """Latent pool (every slot NaN, then the prefix rows), layout, batch, q, new latent rows, layer."""
    spec = SPECS[spec] if isinstance(spec, str) else spec
    cfg = MLA_CONFIGS[cfg] if isinstance(cfg, str) else cfg
    d, H = cfg.dims, cfg.num_heads
    g = torch.Generator().manual_seed(1000 + seed)
    reserve = spec.reserve if reserve is None else reserve
    layout = make_layout([s + reserve for s in spec.seq_lens], spec.page_size, device=device, seed=seed)
    pool = MLATokenPool(num_layers, layout.num_pages, spec.page_size, d.kv_lora_rank, d.qk_rope_head_dim,
                        dtype, device)
    for buf in pool.kv_buffer:
        buf.fill_(float("nan") if poison else 0.0)
    if poison and torch.device(device).type == "cuda":
        # FA3/FlashMLA read whole pages and multiply the slots past a sequence's end by a zero
        # probability: that tail must be finite (pools start zeroed and hold only written rows), so on a
        # GPU it holds large finite garbage instead of NaN — reading it still ruins the output.
        for b, n in enumerate(spec.seq_lens):
            if n:
                page = int(layout.slots[b][n - 1]) // spec.page_size
                for buf in pool.kv_buffer:
                    buf.view(layout.num_pages, spec.page_size, -1)[page] = STALE_FINITE
    latent = [torch.randn(s, d.latent_dim, generator=g) for s in spec.seq_lens]
    for b, pre in enumerate(spec.prefix_lens):
        if pre:
            loc = layout.token_slots(b, 0, pre).to(device)
            pool.kv_buffer[layer_id][loc] = latent[b][:pre].to(dtype=dtype, device=device)
    w = torch.randn(H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) / math.sqrt(d.kv_lora_rank)
    layer = AttentionLayer.mla_layer(layer_id, H, d, cfg.scale, kv_b_proj_weight=w.to(dtype=dtype, device=device),
                                     logit_cap=logit_cap, sliding_window=sliding_window)
    T = sum(spec.extend_lens)
    q = torch.randn(T, H, d.qk_head_dim, generator=g)
    new = [latent[b][pre:] for b, pre in enumerate(spec.prefix_lens)]
    new_latent = torch.cat(new) if new else torch.empty(0, d.latent_dim)
    batch = make_batch(layout, spec.mode, spec.prefix_lens, spec.extend_lens)
    return MLACase(spec, cfg, layout, pool, batch, layer, w, latent, q.to(dtype=dtype, device=device),
                   new_latent.to(dtype=dtype, device=device))


def mla_oracle(case: MLACase, *, q: torch.Tensor | None = None) -> torch.Tensor:
    """Non-absorbed MLA in fp64 (decompress c_kv through kv_b_proj; explicit causal masks): [T, H, d_v].

    Uses the case's ground-truth latent rows and the case's q as stored (its dtype's values), so a
    low-precision run is compared with the exact answer for the very inputs it got.
    """
    d = case.cfg.dims
    q = (case.q if q is None else q).double().cpu()
    w = case.layer.mla_weights
    kv_b = case.kv_b_proj if w.dtype == torch.float32 else _kv_b_from_weights(w)
    outs = []
    for b, (s, e) in enumerate(case.q_rows):
        lat = case.latent[b].to(case.q.dtype).double()  # the values the pool actually holds
        c_kv, k_rope = lat[:, : d.kv_lora_rank], lat[:, d.kv_lora_rank:]
        lc, sw = case.layer.logit_cap, case.layer.sliding_window
        if lc > 0 or sw >= 0:
            outs.append(_mla_dense(q[s:e], c_kv, k_rope, kv_b, d, case.layer.scaling, lc, sw))
        else:
            o, _ = mla_nonabsorbed(q[s:e], c_kv, k_rope, kv_b, qk_nope_head_dim=d.qk_nope_head_dim,
                                   v_head_dim=d.v_head_dim, scale=case.layer.scaling, causal=True)
            outs.append(o)
    if not outs:
        return torch.empty(0, case.cfg.num_heads, d.v_head_dim, dtype=torch.float64)
    return torch.cat(outs)


def _kv_b_from_weights(w) -> torch.Tensor:
    """kv_b_proj [H*(d_nope+d_v), r] as the layer holds it (after its dtype cast), for low-precision cases."""
    H = w.num_heads
    uk = w.w_uk.double().cpu()  # [H, d_nope, r]
    uv = w.w_uv.double().cpu().transpose(1, 2)  # [H, d_v, r]
    return torch.cat([uk, uv], dim=1).reshape(H * (uk.shape[1] + uv.shape[1]), uk.shape[2])


def _mla_dense(q, c_kv, k_rope, kv_b, d: MLADims, scale, softcap, window):
    """Non-absorbed MLA with softcap / sliding window through the oracle's dense attention (fp64)."""
    L, H = c_kv.shape[0], q.shape[1]
    wt = kv_b.double().view(H, d.qk_nope_head_dim + d.v_head_dim, -1)
    kv = torch.einsum("lr,hdr->lhd", c_kv, wt)
    k = torch.cat([kv[..., : d.qk_nope_head_dim], k_rope.unsqueeze(1).expand(L, H, -1)], dim=-1)
    o, _ = dense_attention(q, k, kv[..., d.qk_nope_head_dim:], scale=scale, causal=True,
                           window=(window, 0) if window >= 0 else (-1, -1), softcap=softcap)
    return o


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (fp64, on the CPU)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if ref.numel() == 0:
        return 0.0
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = out.double().cpu().flatten(), ref.double().cpu().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def check_bf16_rule(out: torch.Tensor, ref: torch.Tensor, torch_bf16: torch.Tensor, min_cosine: float) -> None:
    """The GPU precision rule: a kernel's error against the fp64 oracle ``ref`` is at most twice the error of the
    same computation written in torch bf16 (plus 1e-6 of the oracle's scale), and its cosine is >= ``min_cosine``."""
    ref = ref.double().cpu()
    err = (out.double().cpu() - ref).abs().max().item()
    base = (torch_bf16.double().cpu() - ref).abs().max().item()
    assert err <= 2 * base + 1e-6 * ref.abs().max().item(), f"kernel error {err:.3e} vs torch-bf16 error {base:.3e}"
    cos = cosine(out, ref)
    assert cos >= min_cosine, f"cosine {cos:.6f}"


def follow_up(case: MLACase, mode: ForwardMode, prefix_lens, extend_lens, *, requests=None,
              seed: int = 0, pad_to: int | None = None) -> MLACase:
    """A later step over the SAME layout, pool and layer: requests ``requests`` (default the first ones)
    with new prefix / extend lengths. The ground truth stays ``case.latent`` (token j of request b is
    ``case.latent[b][j]``), so ``prefix_b + n_b`` may not exceed the case's ``seq_lens[b]``; the caller
    makes sure tokens below ``prefix_b`` are in the pool (initial prefix, or written by an earlier step).
    """
    reqs = list(range(len(prefix_lens))) if requests is None else list(requests)
    latent = []
    for i, b in enumerate(reqs):
        end = prefix_lens[i] + extend_lens[i]
        if end > case.latent[b].shape[0]:
            raise ValueError(f"request {b} has {case.latent[b].shape[0]} true tokens, asked for {end}")
        latent.append(case.latent[b][:end])
    spec = BatchSpec(mode, tuple(prefix_lens), tuple(extend_lens), page_size=case.spec.page_size, reserve=0)
    g = torch.Generator().manual_seed(2000 + seed)
    d, H = case.cfg.dims, case.cfg.num_heads
    q = torch.randn(sum(extend_lens), H, d.qk_head_dim, generator=g)
    new = [lat[p:] for lat, p in zip(latent, prefix_lens)]
    new_latent = torch.cat(new) if new else torch.empty(0, d.latent_dim)
    batch = make_batch(case.layout, mode, prefix_lens, extend_lens, requests=reqs, pad_to=pad_to)
    dt, dev = case.q.dtype, case.q.device
    return MLACase(spec, case.cfg, case.layout, case.pool, batch, case.layer, case.kv_b_proj, latent,
                   q.to(dtype=dt, device=dev), new_latent.to(dtype=dt, device=dev))


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, ...] with zero rows appended up to ``rows`` (the inputs of CUDA-graph padding requests)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def capture_layer_graph(backend, layer, q_buf: torch.Tensor, lat_buf: torch.Tensor, static):
    """One MLA layer's forward over static buffers captured in a CUDA graph (the backend's capture hook,
    two warm-up calls on a side stream, then the capture); returns ``(graph, out_buf)``. GPU only."""
    backend.init_forward_metadata_capture_cuda_graph(static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            backend.forward(q_buf, lat_buf, None, layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out_buf = backend.forward(q_buf, lat_buf, None, layer, static)
    return graph, out_buf
