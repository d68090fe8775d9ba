"""CUDA-graph buffers for the metadata: allocated once, viewed ``[:bs]`` at capture, updated at replay.

A graph captured at batch size ``bs`` (mode DECODE / DRAFT_DECODE with 1 query per request, or
TARGET_VERIFY with ``k``) reads fixed addresses, so every metadata tensor is a view of a buffer of
:class:`CaptureBuffers`. Replaying it for a live batch of ``n <= bs`` requests (lengths ``L_b``,
page size ``p``) writes:

- ``cache_seqlens = [L_0 .. L_{n-1}, pad, pad, ...]`` (``pad`` = ``pad_seqlen``, 1 by default:
  padding rows read slot 0 of padding page 0, which every kernel — FlashMLA included — accepts; or 0,
  which FA3 turns into output 0 / lse -inf) and ``cu_seqlens_k`` = its cumulated sum, over the whole
  ``max_bs`` buffer (rows past ``bs`` hold padding values no graph of this size reads);
- ``cu_seqlens_q``: a constant table ``arange(bs+1) * k`` written once at allocation (padding rows keep
  their ``k`` queries, so the graph's query tensor is fully covered);
- ``page_table[:n, :P]`` (``P = ceil(max L / p)``; ``page_table[b, j] = req_to_token[row_b, c0_b + j p]
  // p`` for ``j p < L_b``, else 0), and zeros over every entry an earlier replay wrote outside
  ``[:n, :P]`` (host-side high-water marks, so stale rows/columns of a bigger batch never leak into a
  smaller one);
- the encoder (cross-attention) and local-attention tables the same way. Local virtual requests:
  the live ones, then one per padding request (its ``k`` queries, ``pad_seqlen`` keys), then empty ones
  (0 queries) up to the buffer's end (the graph of ``bs`` reads ``bs * (1 + ceil((k-1)/C))`` rows).

Host cost (the point of this layout; each torch op on CUDA costs ~5-10 us of host time): every 1-D
table is a slice of ONE int32 device buffer ``packed``. A replay computes all of them on the host
with NumPy from the batch's ``*_cpu`` copies into a staging buffer of the same layout and lands them
with ONE ``copy_``; the page tables then take one gather + compare + divide + mask each (see
``pages.gather_page_table``), written straight into the captured buffers. On CUDA the
staging buffer is pinned and comes fresh from PyTorch's caching host allocator each replay: the
non-blocking copy records an event on its block, so the block is not handed out again (and never
overwritten) while the copy may still be in flight. No device value is ever read on the host.

Device-derived page table (``device_tables=True``; decoder tables only, no encoder / local attention):
the replay stages the request rows (``req_rows``) and their page-table lengths (``table_lens``: 0 for
padding rows, which get page 0) with the other lengths, and the page
table is NOT written on the host; :func:`derive_tables` computes ``page_table[:bs]`` over its whole
width from ``req_rows``, ``table_lens`` and ``req_to_token`` in tensor ops on fixed shapes, which a
CUDA graph captures: a replay then costs one host->device copy in all (``GraphRunner`` runs it inside
every graph, before the layers). The whole-width gather costs ``bs * ceil(max_context / p)`` entries of
GPU work per replay instead of host launches (:data:`DEVICE_TABLES_MAX_ENTRIES` bounds it).

Lengths read on the device (``LengthSources``; DECODE and chain TARGET_VERIFY graphs over device tables): an engine
that keeps its own static input buffers — SGLang's CUDA-graph runner rewrites ``seq_lens`` and ``req_pool_indices`` of
the padded batch in place before every replay, padding rows with length 1 at row 0 — hands them over at capture, and
the graph's prologue derives ``cache_seqlens`` (plus ``extra`` tokens each: SGLang's verify lengths exclude the k
draft tokens) and ``cu_seqlens_k`` from them (:func:`derive_lengths`, two or three kernels on fixed shapes) and the
page table from their rows. A replay update is then host checks
alone (:func:`check_bound_lengths`): no staging, no copy, no launch. Padding rows keep the engine's values (one key
of its row 0: a slot of the pool, read and discarded).

A mismatching batch (mode, ``k``, size, context, encoder presence) raises ValueError before any write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
import torch
from torch import Tensor

from mla_fa3.batch import ForwardBatch, ForwardMode, queries_per_request
from mla_fa3.checks import check_int
from mla_fa3.pages import gather_page_table, local_layout_np, max_local_rows

__all__ = ["CaptureBuffers", "DEVICE_TABLES_MAX_ENTRIES", "LengthSources", "capture_views", "check_bound_lengths",
           "derive_lengths", "derive_tables", "replay_into"]

# a device-derived page table is gathered whole-width at every replay: at most this many entries
# (max_bs * pages of max_context), 4 MB of int32 — e.g. 128 requests x 512k tokens at page 64
DEVICE_TABLES_MAX_ENTRIES = 1 << 20


def _i32(*shape: int, device: torch.device) -> Tensor:
    return torch.zeros(*shape, dtype=torch.int32, device=device)


@dataclass
class CaptureBuffers:
    """Every tensor a captured graph reads (int32, device) plus host-side layout and high-water marks."""

    max_bs: int
    max_context: int
    page_size: int
    max_num_draft_tokens: int
    pad_seqlen: int
    with_encoder: bool
    attention_chunk_size: int | None
    packed: Tensor  # [N] int32, device — every 1-D table below is a slice (view) of it
    regions: dict  # name -> (offset, length) of that table in ``packed`` (host ints)
    cu_seqlens_q_table: Tensor  # [max_k, max_bs+1]: row k-1 = arange(max_bs+1) * k
    col_offsets: Tensor  # [max(ceil(max_context/p), C/p)] int64, device — j * page_size
    page_table: Tensor  # [max_bs, ceil(max_context/p)]
    cache_seqlens: Tensor  # [max_bs] (packed)
    cu_seqlens_k: Tensor  # [max_bs+1] (packed)
    enc_cache_seqlens: Tensor | None = None  # [max_bs] (packed)
    enc_cu_seqlens_k: Tensor | None = None  # [max_bs+1] (packed)
    enc_first_col: Tensor | None = None  # [max_bs] (packed): first decoder column of each row
    enc_page_table: Tensor | None = None  # [max_bs, ceil(max_context/p)]
    local_cu_seqlens_q: Tensor | None = None  # [max_rows+1] (packed)
    local_cache_seqlens: Tensor | None = None  # [max_rows] (packed)
    local_req: Tensor | None = None  # [max_rows] (packed): batch row of each live virtual request
    local_col0: Tensor | None = None  # [max_rows] (packed): its first req_to_token column
    local_page_table: Tensor | None = None  # [max_rows, C/p]
    req_rows: Tensor | None = None  # [max_bs] (packed), device_tables only: request rows (padding: row 0)
    table_lens: Tensor | None = None  # [max_bs] (packed), device_tables only: tokens with pages (padding: 0)
    device_tables: bool = False  # the page table is derived on the device (derive_tables), not at replay
    staging: Tensor | None = None  # [N] int32, cpu — reused host staging buffer (CPU device only)
    dirty: dict = field(default_factory=dict)  # table name -> (rows, cols) possibly non-zero

    @classmethod
    def allocate(cls, max_bs: int, max_context: int, page_size: int, device: torch.device, *,
                 max_num_draft_tokens: int = 1, with_encoder: bool = False,
                 attention_chunk_size: int | None = None, pad_seqlen: int = 1,
                 device_tables: bool = False) -> "CaptureBuffers":
        if not isinstance(max_bs, int) or max_bs < 1:
            raise ValueError(f"max_bs must be a positive int, got {max_bs!r}")
        if not isinstance(max_num_draft_tokens, int) or max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be a positive int, got {max_num_draft_tokens!r}")
        if pad_seqlen not in (0, 1):
            raise ValueError(f"pad_seqlen must be 0 or 1, got {pad_seqlen!r}")
        device = torch.device(device)
        max_pages = -(-max_context // page_size)
        if device_tables and (with_encoder or attention_chunk_size is not None):
            raise ValueError("device_tables derives the decoder page table only: not with an encoder or local "
                             "attention (their tables are written at replay)")
        if device_tables and max_bs * max_pages > DEVICE_TABLES_MAX_ENTRIES:
            raise ValueError(f"device_tables gathers max_bs * pages = {max_bs * max_pages} page ids per replay, "
                             f"over DEVICE_TABLES_MAX_ENTRIES = {DEVICE_TABLES_MAX_ENTRIES}")
        sizes = [("cache_seqlens", max_bs), ("cu_seqlens_k", max_bs + 1)]
        if device_tables:
            sizes += [("req_rows", max_bs), ("table_lens", max_bs)]
        if with_encoder:
            sizes += [("enc_cache_seqlens", max_bs), ("enc_cu_seqlens_k", max_bs + 1), ("enc_first_col", max_bs)]
        rows = 0
        if attention_chunk_size is not None:
            rows = max_local_rows(max_bs, max_num_draft_tokens, attention_chunk_size)
            sizes += [("local_cu_seqlens_q", rows + 1), ("local_cache_seqlens", rows), ("local_req", rows),
                      ("local_col0", rows)]
        regions, total = {}, 0
        for name, length in sizes:
            regions[name] = (total, length)
            total += length
        packed = _i32(total, device=device)
        views = {name: packed[o: o + n] for name, (o, n) in regions.items()}
        ks = torch.arange(1, max_num_draft_tokens + 1, dtype=torch.int32, device=device)
        table = ks.unsqueeze(1) * torch.arange(max_bs + 1, dtype=torch.int32, device=device).unsqueeze(0)
        width = max(max_pages, attention_chunk_size // page_size if attention_chunk_size else 0)
        buf = cls(max_bs=max_bs, max_context=max_context, page_size=page_size,
                  max_num_draft_tokens=max_num_draft_tokens, pad_seqlen=pad_seqlen, with_encoder=with_encoder,
                  attention_chunk_size=attention_chunk_size, device_tables=device_tables, packed=packed,
                  regions=regions,
                  cu_seqlens_q_table=table.to(torch.int32),
                  col_offsets=torch.arange(width, dtype=torch.int64, device=device) * page_size,
                  page_table=_i32(max_bs, max_pages, device=device), **views)
        if with_encoder:
            buf.enc_page_table = _i32(max_bs, max_pages, device=device)
        if attention_chunk_size is not None:
            buf.local_page_table = _i32(rows, attention_chunk_size // page_size, device=device)
        _write(buf, max_bs, 1, None, None, None)  # every row padding
        return buf


def _graph_queries_per_request(buf: CaptureBuffers, mode: ForwardMode, num_draft_tokens: int) -> int:
    if not isinstance(mode, ForwardMode) or not mode.is_graph_capturable():
        raise ValueError(f"mode must be DECODE, TARGET_VERIFY or DRAFT_DECODE for a CUDA graph, got {mode!r}")
    if mode is ForwardMode.TARGET_VERIFY or (mode is ForwardMode.DRAFT_DECODE and num_draft_tokens > 1):
        check_int(num_draft_tokens, "num_draft_tokens", 1, buf.max_num_draft_tokens)  # a verify / draft tree's rows
    return queries_per_request(mode, num_draft_tokens)


def capture_views(buf: CaptureBuffers, bs: int, mode: ForwardMode, num_draft_tokens: int) -> dict:
    """Views ``[:bs]`` of the buffers, reset to the all-padding state (what the graph is captured on)."""
    if not isinstance(bs, int) or not 1 <= bs <= buf.max_bs:
        raise ValueError(f"bs must be an int in [1, {buf.max_bs}] (max_bs of the buffers), got {bs!r}")
    q = _graph_queries_per_request(buf, mode, num_draft_tokens)
    _write(buf, bs, q, None, None, None)
    views = dict(cache_seqlens=buf.cache_seqlens[:bs], cu_seqlens_q=buf.cu_seqlens_q_table[q - 1, : bs + 1],
                 cu_seqlens_k=buf.cu_seqlens_k[: bs + 1], page_table=buf.page_table[:bs], max_seqlen_q=q)
    if buf.with_encoder:
        views.update(enc_cache_seqlens=buf.enc_cache_seqlens[:bs], enc_cu_seqlens_k=buf.enc_cu_seqlens_k[: bs + 1],
                     enc_page_table=buf.enc_page_table[:bs], enc_first_col=buf.enc_first_col[:bs])
    if buf.attention_chunk_size is not None:
        rows = max_local_rows(bs, q, buf.attention_chunk_size)
        views.update(local_rows=rows, local_cu_seqlens_q=buf.local_cu_seqlens_q[: rows + 1],
                     local_cache_seqlens=buf.local_cache_seqlens[:rows], local_page_table=buf.local_page_table[:rows])
    return views


def replay_into(buf: CaptureBuffers, batch: ForwardBatch, mode: ForwardMode, bs: int, num_draft_tokens: int,
                req_to_token: Tensor, col_index: Tensor | None, span: np.ndarray | None) -> None:
    """Check that ``batch`` fits the graph captured at ``(bs, mode, k)``, then write it (see module doc).

    Host values only (``seq_lens_cpu``, ``encoder_lens_cpu``; ``span`` = the ``req_to_token`` columns each
    request needs, its encoder region included: NumPy [n]; None: ``seq_lens``, no encoder region). ``col_index`` is
    accepted for the builder's call and unused (the buffers keep their own column offsets).
    """
    if batch.forward_mode is not mode:
        raise ValueError(f"batch.forward_mode must be {mode.name} (the captured mode), got {batch.forward_mode.name}")
    q = _graph_queries_per_request(buf, mode, num_draft_tokens)
    if queries_per_request(mode, batch.num_draft_tokens) != q:
        raise ValueError(f"batch.num_draft_tokens must be {num_draft_tokens} (captured), got {batch.num_draft_tokens}")
    n = batch.batch_size
    if n > bs:
        raise ValueError(f"batch.batch_size {n} exceeds the captured batch size {bs}")
    if buf.with_encoder != (batch.encoder_lens is not None):
        raise ValueError(f"batch.encoder_lens must be {'given' if buf.with_encoder else 'None'}: the buffers "
                         f"were allocated with with_encoder={buf.with_encoder}")
    seq = batch.seq_lens_cpu.numpy()
    if n and (batch.seq_lens_max if span is None else int(span.max())) > buf.max_context:
        span = seq if span is None else span
        raise ValueError(f"seq_lens exceed the captured max_context {buf.max_context} (encoder region "
                         f"included): {span.tolist()}")
    tree_keys = 0 if batch.tree is None else batch.tree.num_keys
    if tree_keys:  # a tree step's metadata is its prefix's: cache_seqlens = seq_lens - n (mla_fa3.tree)
        seq = seq - tree_keys
    _write(buf, bs, q, batch if n else None, req_to_token, seq, tree_keys)


# ---------------------------------------------------------------------------------------- writes
def _write(buf: CaptureBuffers, bs: int, q: int, batch: ForwardBatch | None, req_to_token: Tensor | None,
           seq: np.ndarray | None, tree_keys: int = 0) -> None:
    """Stage every 1-D table on the host, one copy to the device, then the page tables (``batch`` None:
    all padding; ``seq`` = ``batch.seq_lens_cpu`` as NumPy)."""
    p, pad, reg = buf.page_size, buf.pad_seqlen, buf.regions
    n = 0 if batch is None else batch.batch_size
    device = buf.packed.device
    if device.type == "cpu":  # copies are synchronous: one buffer is reused
        if buf.staging is None:
            buf.staging = torch.empty_like(buf.packed)
        stage = buf.staging
    else:  # fresh block of the caching host allocator (not reused while the copy below is in flight)
        stage = torch.empty(buf.packed.shape[0], dtype=torch.int32, pin_memory=device.type == "cuda")
    s = stage.numpy()
    _stage_lengths(s, reg["cache_seqlens"], reg["cu_seqlens_k"], seq, n, pad)
    enc = first_np = None
    if buf.with_encoder:
        enc = batch.encoder_lens_cpu.numpy() if n else None
        _stage_lengths(s, reg["enc_cache_seqlens"], reg["enc_cu_seqlens_k"], enc, n, pad)
        o, length = reg["enc_first_col"]
        s[o + n: o + length] = 0
        if n:
            first_np = (enc.astype(np.int64) + (p - 1)) // p * p
            s[o: o + n] = first_np
    live = _stage_local(buf, s, bs, q, n, seq, first_np) if buf.attention_chunk_size is not None else 0
    rows_cpu = None if batch is None else batch.req_pool_indices_cpu
    if buf.device_tables:  # padding rows: row 0 with no page (page 0, as the host path writes)
        o, length = reg["req_rows"]
        s[o + n: o + length] = 0
        if rows_cpu is not None:
            s[o: o + n] = rows_cpu.numpy()
        o, length = reg["table_lens"]
        s[o + n: o + length] = 0
        if n:
            s[o: o + n] = seq
    buf.packed.copy_(stage, non_blocking=device.type == "cuda")  # the one host->device copy
    if buf.device_tables:
        if n and rows_cpu is None:  # rows given as a device tensor: one device->device copy
            buf.req_rows[:n].copy_(batch.req_pool_indices)
        return  # the page table: derive_tables, on the device

    rows, first_col = (batch.req_pool_indices if n else None), None
    if buf.with_encoder:
        enc_pages = -(-int(enc.max()) // p) if n else 0
        _write_table(buf, "encoder", buf.enc_page_table, n, enc_pages, req_to_token, rows,
                     buf.enc_cache_seqlens[:n], None)
        first_col = buf.enc_first_col[:n]
    pages = -(-(batch.seq_lens_max - tree_keys) // p) if n else 0
    _write_table(buf, "decoder", buf.page_table, n, pages, req_to_token, rows, buf.cache_seqlens[:n], first_col)
    if buf.attention_chunk_size is not None:
        local_rows = torch.index_select(rows, 0, buf.local_req[:live]) if live else None
        _write_table(buf, "local", buf.local_page_table, live, buf.attention_chunk_size // p if live else 0,
                     req_to_token, local_rows, buf.local_cache_seqlens[:live], buf.local_col0[:live])


def derive_tables(buf: CaptureBuffers, bs: int, req_to_token: Tensor, sources: LengthSources | None = None) -> None:
    """``page_table[:bs]`` over its whole width from the staged ``req_rows`` and ``table_lens``
    (``device_tables`` buffers) — or, with ``sources``, from their request rows and ``cache_seqlens`` (which
    :func:`derive_lengths` wrote first). Tensor ops on fixed shapes, no host value: graph-legal, and what a
    captured graph re-runs at each replay: one launch on CUDA (``ops.gather_page_ids``), four torch kernels
    elsewhere. Staged padding rows (length 0) get page 0 throughout."""
    if not buf.device_tables:
        raise ValueError("derive_tables needs buffers allocated with device_tables=True")
    rows, lens = (buf.req_rows[:bs], buf.table_lens[:bs]) if sources is None else \
        (sources.req_pool_indices, buf.cache_seqlens[:bs])
    gather_page_table(req_to_token, rows, lens, buf.page_table.shape[1], buf.page_size, col_offsets=buf.col_offsets,
                      out=buf.page_table[:bs])


@dataclass(frozen=True)
class LengthSources:
    """The device tensors a captured DECODE or chain TARGET_VERIFY graph reads its lengths from: the engine's static
    inputs ``[:bs]``, which it rewrites in place before every replay (see the module doc)."""

    seq_lens: Tensor  # [bs] int32 / int64, device: KV tokens of each request after this step, less ``extra``
    req_pool_indices: Tensor  # [bs] int32 / int64, device: its req_to_token row (padding: any held row, e.g. 0)
    extra: int = 0  # tokens added to each length on the device (SGLang's TARGET_VERIFY: the k draft tokens)

    def check(self, buf: CaptureBuffers, bs: int) -> None:
        """ValueError / TypeError naming the field unless both are [bs] integer tensors on the buffers' device and
        the buffers derive their page table on the device."""
        if not buf.device_tables:
            raise ValueError("lengths read on the device need capture buffers with device_tables=True (the page "
                             "table is then derived in the graph too)")
        check_int(self.extra, "extra", minimum=0)
        for name in ("seq_lens", "req_pool_indices"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be an int32 / int64 tensor, got "
                                f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
            if tuple(t.shape) != (bs,) or t.device != buf.packed.device:
                raise ValueError(f"{name} must be [{bs}] on {buf.packed.device} (the graph's batch), got "
                                 f"{tuple(t.shape)} on {t.device}")

    def same_as(self, seq_lens: Tensor, req_pool_indices: Tensor) -> bool:
        """Whether the two tensors are these (same storage, offset and shape): what a replay must pass."""
        return all(a.data_ptr() == b.data_ptr() and a.shape == b.shape
                   for a, b in ((self.seq_lens, seq_lens), (self.req_pool_indices, req_pool_indices)))


def derive_lengths(buf: CaptureBuffers, bs: int, sources: LengthSources) -> None:
    """``cache_seqlens[:bs]`` and ``cu_seqlens_k[:bs + 1]`` from ``sources`` (two kernels on fixed shapes, no host
    value: what a DECODE graph captured with sources runs first; :func:`derive_tables` then reads the rows from
    ``sources`` itself)."""
    lens = buf.cache_seqlens[:bs]
    lens.copy_(sources.seq_lens)
    if sources.extra:
        lens.add_(sources.extra)
    torch.cumsum(lens, 0, dtype=torch.int32, out=buf.cu_seqlens_k[1: bs + 1])


def check_bound_lengths(buf: CaptureBuffers, bs: int, seq_lens_cpu: Tensor, extra: int = 0) -> None:
    """The replay update of a graph reading its lengths on the device: the engine's host copy of them
    (``seq_lens_cpu`` [bs], padding included), plus ``extra``, within ``[1, max_context]``; ValueError otherwise,
    nothing run."""
    if not isinstance(seq_lens_cpu, Tensor) or seq_lens_cpu.device.type != "cpu" or tuple(seq_lens_cpu.shape) != (bs,):
        got = (tuple(seq_lens_cpu.shape), str(seq_lens_cpu.device)) if isinstance(seq_lens_cpu, Tensor) else \
            type(seq_lens_cpu).__name__
        raise ValueError(f"seq_lens_cpu must be a [{bs}] CPU tensor (the padded batch's host lengths), got {got}")
    v = seq_lens_cpu.numpy()
    if v.min() + extra < 1 or v.max() + extra > buf.max_context:
        plus = f" + {extra} draft tokens" if extra else ""
        raise ValueError(f"seq_lens{plus} must be in [1, {buf.max_context}] (the captured max_context), got "
                         f"{seq_lens_cpu.tolist()}{plus}")


def _stage_lengths(s: np.ndarray, lens_region: tuple[int, int], cu_region: tuple[int, int],
                   values: np.ndarray | None, n: int, pad: int) -> None:
    """``lens = [values..., pad, pad, ...]`` and ``cu = [0, cumsum(lens)]`` into the staging array."""
    o, length = lens_region
    lens = s[o: o + length]
    if n:
        lens[:n] = values
    lens[n:] = pad
    o, length = cu_region
    s[o] = 0
    np.add.accumulate(lens, dtype=np.int32, out=s[o + 1: o + length])


def _stage_local(buf: CaptureBuffers, s: np.ndarray, bs: int, q: int, n: int, seq: np.ndarray | None,
                 first_col: np.ndarray | None) -> int:
    """Local virtual requests into the staging array (live, one per padding request, empty); returns
    the number of live ones."""
    reg, chunk = buf.regions, buf.attention_chunk_size
    o_cu, cu_len = reg["local_cu_seqlens_q"]
    o_k, rows = reg["local_cache_seqlens"]
    o_r, _ = reg["local_req"]
    o_c, _ = reg["local_col0"]
    q_lens = np.zeros(rows, dtype=np.int32)
    k_lens = s[o_k: o_k + rows]
    live = 0
    if n:
        req, k_start, ql, kl = local_layout_np(seq, np.full(n, q, dtype=np.int64), chunk)
        live = req.shape[0]
        q_lens[:live], k_lens[:live] = ql, kl
        s[o_r: o_r + live] = req
        s[o_c: o_c + live] = k_start if first_col is None else k_start + first_col[req]
    s[o_r + live: o_r + rows] = 0
    s[o_c + live: o_c + rows] = 0
    q_lens[live: live + bs - n] = q  # one virtual request per padding request
    k_lens[live: live + bs - n] = buf.pad_seqlen
    k_lens[live + bs - n:] = 0
    s[o_cu] = 0
    np.add.accumulate(q_lens, dtype=np.int32, out=s[o_cu + 1: o_cu + cu_len])
    return live


def _write_table(buf: CaptureBuffers, name: str, table: Tensor, rows: int, pages: int,
                 req_to_token: Tensor | None, gather_rows: Tensor | None, num_tokens: Tensor | None,
                 first_col: Tensor | None) -> None:
    """Write ``table[:rows, :pages]`` (page ids of ``gather_rows``) and zero what earlier writes left
    outside it.

    The gather writes ``[:rows, :cols]`` with ``cols = max(pages, stale columns)``: its mask zeroes the
    columns past each row's pages, so stale columns cost no extra op; stale rows take one ``zero_``.
    """
    old_rows, old_cols = buf.dirty.get(name, (0, 0))
    if rows and pages:
        cols = max(pages, old_cols)
        gather_page_table(req_to_token, gather_rows, num_tokens, cols, buf.page_size, first_col,
                          col_offsets=buf.col_offsets, out=table[:rows, :cols])
        if old_rows > rows:
            table[rows:old_rows, :old_cols].zero_()
        buf.dirty[name] = (rows, pages)
    else:
        if old_rows and old_cols:
            table[:old_rows, :old_cols].zero_()
        buf.dirty[name] = (0, 0)
