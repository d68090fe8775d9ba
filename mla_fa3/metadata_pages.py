"""Page tables and local-attention virtual batches: the index math shared by eager build and replay.

Symbols: ``p`` page size; ``R = req_to_token`` [rows, max_context] int32 slot ids; for a request row
``r`` whose KV region starts at column ``c0`` (0, or the encoder region's width for a decoder with
cross-attention) and holds ``L`` tokens, its page table is

    page_table[j] = R[r, c0 + j * p] // p      for j < ceil(L / p),   else 0 (the padding page),

valid because a request's tokens ``i*p .. (i+1)*p - 1`` share one page (see ``kv_cache``).

Local (chunked) attention with chunk ``C`` (a multiple of ``p``): query at absolute position ``t``
sees keys ``floor(t / C) * C .. t``. A request with ``q`` new tokens over ``L`` KV tokens (queries at
``L-q .. L-1``) is split at chunk borders into *virtual requests*, one per chunk ``c`` it touches:

    k_start = c*C;  q positions [max(k_start, L-q), min(k_start + C, L));  k_len = q_end - k_start

and each virtual request runs ordinary bottom-right causal attention over its ``k_len`` keys with
the page table starting at page ``k_start / p``. Virtual requests keep the token order (request by
request, chunk by chunk), so the query tensor needs no permutation. Same result as SGLang's
``make_local_attention_virtual_batches``, written with tensor ops instead of NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["gather_page_table", "cumsum_padded", "LocalLayout", "local_layout", "max_local_rows"]


def cumsum_padded(lens: Tensor) -> Tensor:
    """``[0, l0, l0+l1, ...]`` as int32 on ``lens``'s device (cu_seqlens)."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    if lens.shape[0]:
        torch.cumsum(lens, 0, dtype=torch.int32, out=out[1:])
    return out


def gather_page_table(req_to_token: Tensor, rows: Tensor, num_tokens: Tensor, max_pages: int,
                      page_size: int, first_col: Tensor | None = None, col_index: Tensor | None = None) -> Tensor:
    """[n, max_pages] int32 page ids of ``rows`` (tensor ops only; no device->host sync).

    ``rows`` [n] int64 request rows, ``num_tokens`` [n] tokens of each region, ``first_col`` [n] first
    column of each region (None = 0), ``col_index`` an optional cached ``arange`` (int64, >= max_pages
    long) on the device. Entries past a region's pages are 0.
    """
    device = req_to_token.device
    j = (col_index[:max_pages] if col_index is not None
         else torch.arange(max_pages, dtype=torch.int64, device=device))
    cols = j.unsqueeze(0) * page_size
    if first_col is not None:
        cols = cols + first_col.to(torch.int64).unsqueeze(1)
    cols = cols.clamp(max=req_to_token.shape[1] - 1).expand(rows.shape[0], max_pages)
    pages = req_to_token[rows.unsqueeze(1), cols] // page_size
    live_pages = (num_tokens.to(torch.int64) + page_size - 1) // page_size
    return torch.where(j.unsqueeze(0) < live_pages.unsqueeze(1), pages, torch.zeros_like(pages))


@dataclass
class LocalLayout:
    """Host-side description of the virtual requests (all [V] int64 CPU tensors, V virtual requests)."""

    req: Tensor  # batch row (0 .. bs-1) of each virtual request
    k_start: Tensor  # first KV position (a chunk border) of each virtual request
    q_lens: Tensor  # queries of each virtual request (>= 1)
    k_lens: Tensor  # KV tokens each virtual request attends to (k_start .. k_start + k_len - 1)

    @property
    def num_rows(self) -> int:
        return self.req.shape[0]


def local_layout(seq_lens_cpu: Tensor, q_lens_cpu: Tensor, chunk: int) -> LocalLayout:
    """Split each request's queries at multiples of ``chunk`` (CPU tensors in, CPU tensors out)."""
    seq = seq_lens_cpu.to(torch.int64)
    q = q_lens_cpu.to(torch.int64)
    first_pos = seq - q
    first_chunk = first_pos // chunk
    last_chunk = (seq - 1).clamp(min=0) // chunk
    nblocks = torch.where(q > 0, last_chunk - first_chunk + 1, torch.zeros_like(q))
    num_rows = int(nblocks.sum())
    req = torch.repeat_interleave(torch.arange(seq.shape[0], dtype=torch.int64), nblocks)
    block_start_row = torch.cumsum(nblocks, 0) - nblocks
    chunk_idx = first_chunk[req] + torch.arange(num_rows, dtype=torch.int64) - block_start_row[req]
    k_start = chunk_idx * chunk
    q_begin = torch.maximum(k_start, first_pos[req])
    q_end = torch.minimum(k_start + chunk, seq[req])
    return LocalLayout(req=req, k_start=k_start, q_lens=q_end - q_begin, k_lens=q_end - k_start)


def max_local_rows(batch_size: int, queries_per_request: int, chunk: int) -> int:
    """Most virtual requests ``batch_size`` requests of ``queries_per_request`` queries can make."""
    return batch_size * (1 + -(-(queries_per_request - 1) // chunk))
