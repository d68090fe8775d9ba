"""CUDA-graph buffers for the metadata: allocated once, viewed ``[:bs]`` at capture, updated at replay.

A graph captured at batch size ``bs`` (mode DECODE / DRAFT_DECODE with 1 query per request, or
TARGET_VERIFY with ``k``) reads fixed addresses, so every metadata tensor is a view of one buffer of
:class:`CaptureBuffers`. Replaying it for a live batch of ``n <= bs`` requests writes, with
``copy_``/``fill_``/``zero_``/``cumsum`` only (no device->host sync; host ints from ``seq_lens_cpu``):

- ``cache_seqlens[:n] = seq_lens``, ``cache_seqlens[n:bs] = pad_seqlen`` (1 by default: padding rows
  read slot 0 of padding page 0, which every kernel — FlashMLA included — accepts; or 0, which FA3
  turns into output 0 / lse -inf);
- ``cu_seqlens_k[:bs+1]`` = cumsum of that (flat over the tail when ``pad_seqlen`` is 0);
- ``cu_seqlens_q``: a constant table ``arange(bs+1) * k`` written once at allocation (padding rows keep
  their ``k`` queries, so the graph's query tensor is fully covered);
- ``page_table[:n, :P]`` (``P = ceil(max seq_len / p)``), and zeros over every entry an earlier replay
  wrote outside ``[:n, :P]`` (tracked by host-side high-water marks, so stale rows/columns of a bigger
  batch never leak into a smaller one);
- the encoder (cross-attention) and local-attention tables the same way. Local virtual requests:
  the live ones, then one per padding request (its ``k`` queries, ``pad_seqlen`` keys), then empty ones
  (0 queries) up to the captured ``bs * (1 + ceil((k-1)/C))`` rows.

A mismatching batch (mode, ``k``, size, context, encoder presence) raises ValueError before any write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .batch import ForwardBatch, ForwardMode, to_device
from .metadata_pages import gather_page_table, local_layout, max_local_rows

__all__ = ["CaptureBuffers", "capture_views", "replay_into"]


def _i32(*shape: int, device: torch.device) -> Tensor:
    return torch.zeros(*shape, dtype=torch.int32, device=device)


@dataclass
class CaptureBuffers:
    """Every tensor a captured graph reads (all int32, device) plus host-side high-water marks."""

    max_bs: int
    max_context: int
    page_size: int
    max_num_draft_tokens: int
    pad_seqlen: int
    with_encoder: bool
    attention_chunk_size: int | None
    cache_seqlens: Tensor  # [max_bs]
    cu_seqlens_q_table: Tensor  # [max_k, max_bs+1]: row k-1 = arange(max_bs+1) * k
    cu_seqlens_k: Tensor  # [max_bs+1]
    page_table: Tensor  # [max_bs, ceil(max_context/p)]
    enc_cache_seqlens: Tensor | None = None  # [max_bs]
    enc_cu_seqlens_k: Tensor | None = None  # [max_bs+1]
    enc_page_table: Tensor | None = None  # [max_bs, ceil(max_context/p)]
    enc_first_col: Tensor | None = None  # [max_bs]: first decoder column of each row
    local_cu_seqlens_q: Tensor | None = None  # [max_rows+1]
    local_cache_seqlens: Tensor | None = None  # [max_rows]
    local_page_table: Tensor | None = None  # [max_rows, C/p]
    dirty: dict = field(default_factory=dict)  # table name -> (rows, cols) possibly non-zero

    @classmethod
    def allocate(cls, max_bs: int, max_context: int, page_size: int, device: torch.device, *,
                 max_num_draft_tokens: int = 1, with_encoder: bool = False,
                 attention_chunk_size: int | None = None, pad_seqlen: int = 1) -> "CaptureBuffers":
        if not isinstance(max_bs, int) or max_bs < 1:
            raise ValueError(f"max_bs must be a positive int, got {max_bs!r}")
        if not isinstance(max_num_draft_tokens, int) or max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be a positive int, got {max_num_draft_tokens!r}")
        if pad_seqlen not in (0, 1):
            raise ValueError(f"pad_seqlen must be 0 or 1, got {pad_seqlen!r}")
        max_pages = -(-max_context // page_size)
        ks = torch.arange(1, max_num_draft_tokens + 1, dtype=torch.int32, device=device)
        table = ks.unsqueeze(1) * torch.arange(max_bs + 1, dtype=torch.int32, device=device).unsqueeze(0)
        buf = cls(max_bs=max_bs, max_context=max_context, page_size=page_size,
                  max_num_draft_tokens=max_num_draft_tokens, pad_seqlen=pad_seqlen, with_encoder=with_encoder,
                  attention_chunk_size=attention_chunk_size,
                  cache_seqlens=torch.full((max_bs,), pad_seqlen, dtype=torch.int32, device=device),
                  cu_seqlens_q_table=table.to(torch.int32),
                  cu_seqlens_k=torch.arange(max_bs + 1, dtype=torch.int32, device=device) * pad_seqlen,
                  page_table=_i32(max_bs, max_pages, device=device))
        if with_encoder:
            buf.enc_cache_seqlens = torch.full((max_bs,), pad_seqlen, dtype=torch.int32, device=device)
            buf.enc_cu_seqlens_k = torch.arange(max_bs + 1, dtype=torch.int32, device=device) * pad_seqlen
            buf.enc_page_table = _i32(max_bs, max_pages, device=device)
            buf.enc_first_col = _i32(max_bs, device=device)
        if attention_chunk_size is not None:
            rows = max_local_rows(max_bs, max_num_draft_tokens, attention_chunk_size)
            buf.local_cu_seqlens_q = _i32(rows + 1, device=device)
            buf.local_cache_seqlens = _i32(rows, device=device)
            buf.local_page_table = _i32(rows, attention_chunk_size // page_size, device=device)
        return buf


def _queries_per_request(buf: CaptureBuffers, mode: ForwardMode, num_draft_tokens: int) -> int:
    if not isinstance(mode, ForwardMode) or not mode.is_graph_capturable():
        raise ValueError(f"mode must be DECODE, TARGET_VERIFY or DRAFT_DECODE for a CUDA graph, got {mode!r}")
    if mode is not ForwardMode.TARGET_VERIFY:
        return 1
    if not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens <= buf.max_num_draft_tokens:
        raise ValueError(f"num_draft_tokens must be an int in [1, {buf.max_num_draft_tokens}] "
                         f"(max_num_draft_tokens of the buffers), got {num_draft_tokens!r}")
    return num_draft_tokens


def capture_views(buf: CaptureBuffers, bs: int, mode: ForwardMode, num_draft_tokens: int) -> dict:
    """Views ``[:bs]`` of the buffers, reset to the all-padding state (what the graph is captured on)."""
    if not isinstance(bs, int) or not 1 <= bs <= buf.max_bs:
        raise ValueError(f"bs must be an int in [1, {buf.max_bs}] (max_bs of the buffers), got {bs!r}")
    q = _queries_per_request(buf, mode, num_draft_tokens)
    _write(buf, bs, q, None, None, None, None)
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
                req_to_token: Tensor, col_index: Tensor, encoder_cols_cpu: Tensor | int) -> None:
    """Check that ``batch`` fits the graph captured at ``(bs, mode, k)``, then write it (see module doc)."""
    if batch.forward_mode is not mode:
        raise ValueError(f"batch.forward_mode must be {mode.name} (the captured mode), got {batch.forward_mode.name}")
    q = _queries_per_request(buf, mode, num_draft_tokens)
    if mode is ForwardMode.TARGET_VERIFY and batch.num_draft_tokens != num_draft_tokens:
        raise ValueError(f"batch.num_draft_tokens must be {num_draft_tokens} (captured), got {batch.num_draft_tokens}")
    n = batch.batch_size
    if n > bs:
        raise ValueError(f"batch.batch_size {n} exceeds the captured batch size {bs}")
    if buf.with_encoder != (batch.encoder_lens is not None):
        raise ValueError(f"batch.encoder_lens must be {'given' if buf.with_encoder else 'None'}: the buffers "
                         f"were allocated with with_encoder={buf.with_encoder}")
    if n:
        span = batch.seq_lens_cpu.to(torch.int64) + encoder_cols_cpu
        if int(span.max()) > buf.max_context:
            raise ValueError(f"seq_lens exceed the captured max_context {buf.max_context} (encoder region "
                             f"included): {span.tolist()}")
    _write(buf, bs, q, batch, req_to_token, col_index, None if not n else encoder_cols_cpu)


def _clear_stale(buf: CaptureBuffers, name: str, table: Tensor, rows: int, cols: int) -> None:
    """Zero what earlier writes left outside ``[:rows, :cols]``, then remember ``(rows, cols)``."""
    old_rows, old_cols = buf.dirty.get(name, (0, 0))
    if old_cols > cols:
        table[:rows, cols:old_cols].zero_()
    if old_rows > rows:
        table[rows:old_rows, :old_cols].zero_()
    buf.dirty[name] = (rows, cols)


def _write(buf: CaptureBuffers, bs: int, q: int, batch: ForwardBatch | None, req_to_token: Tensor | None,
           col_index: Tensor | None, encoder_cols_cpu: Tensor | int | None) -> None:
    p, pad = buf.page_size, buf.pad_seqlen
    n = 0 if batch is None else batch.batch_size
    rows = batch.req_pool_indices if n else None
    # decoder lengths
    if n:
        buf.cache_seqlens[:n].copy_(batch.seq_lens)
    buf.cache_seqlens[n:bs].fill_(pad)
    torch.cumsum(buf.cache_seqlens[:bs], 0, dtype=torch.int32, out=buf.cu_seqlens_k[1: bs + 1])
    # encoder region (its width shifts where the decoder tokens start in each row)
    first_col = None
    if buf.with_encoder:
        if n:
            enc = batch.encoder_lens
            buf.enc_cache_seqlens[:n].copy_(enc)
            buf.enc_first_col[:n].copy_((enc + (p - 1)) // p * p)
            first_col = buf.enc_first_col[:n]
        buf.enc_cache_seqlens[n:bs].fill_(pad)
        buf.enc_first_col[n:bs].zero_()
        torch.cumsum(buf.enc_cache_seqlens[:bs], 0, dtype=torch.int32, out=buf.enc_cu_seqlens_k[1: bs + 1])
        enc_pages = -(-int(batch.encoder_lens_cpu.max()) // p) if n else 0
        if enc_pages:
            buf.enc_page_table[:n, :enc_pages].copy_(
                gather_page_table(req_to_token, rows, batch.encoder_lens, enc_pages, p, None, col_index))
        _clear_stale(buf, "encoder", buf.enc_page_table, n, enc_pages)
    # decoder page table
    pages = -(-int(batch.seq_lens_cpu.max()) // p) if n else 0
    if pages:
        buf.page_table[:n, :pages].copy_(
            gather_page_table(req_to_token, rows, batch.seq_lens, pages, p, first_col, col_index))
    _clear_stale(buf, "decoder", buf.page_table, n, pages)
    if buf.attention_chunk_size is not None:
        _write_local(buf, bs, q, batch, req_to_token, col_index, first_col)


def _write_local(buf: CaptureBuffers, bs: int, q: int, batch: ForwardBatch | None, req_to_token: Tensor | None,
                 col_index: Tensor | None, first_col: Tensor | None) -> None:
    chunk, p, pad = buf.attention_chunk_size, buf.page_size, buf.pad_seqlen
    n = 0 if batch is None else batch.batch_size
    total_rows = max_local_rows(bs, q, chunk)
    q_lens = torch.zeros(total_rows, dtype=torch.int64)
    k_lens = torch.zeros(total_rows, dtype=torch.int64)
    live = 0
    if n:
        lay = local_layout(batch.seq_lens_cpu, torch.full((n,), q, dtype=torch.int32), chunk)
        live = lay.num_rows
        q_lens[:live], k_lens[:live] = lay.q_lens, lay.k_lens
    q_lens[live: live + bs - n] = q  # one virtual request per padding request
    k_lens[live: live + bs - n] = pad
    lens = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q_lens, 0)]),
                        torch.cat([k_lens, torch.zeros(1, dtype=torch.int64)])]).to(torch.int32)
    lens = to_device(lens, buf.local_cache_seqlens.device)  # one H2D copy
    buf.local_cu_seqlens_q[: total_rows + 1].copy_(lens[0])
    buf.local_cache_seqlens[:total_rows].copy_(lens[1, :total_rows])
    if live:
        idx = to_device(torch.stack([lay.req, lay.k_start]), buf.local_page_table.device)
        col0 = idx[1] if first_col is None else idx[1] + first_col[idx[0]]
        buf.local_page_table[:live].copy_(gather_page_table(
            req_to_token, batch.req_pool_indices[idx[0]], lens[1, :live], chunk // p, p, col0, col_index))
    _clear_stale(buf, "local", buf.local_page_table, live, chunk // p if live else 0)
