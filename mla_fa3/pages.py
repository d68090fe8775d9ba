"""Page tables and local-attention virtual batches: the index math shared by eager build and replay.

Symbols: ``p`` page size; ``R = req_to_token`` [rows, max_context] int32 slot ids; for a request row
``r`` whose KV region starts at column ``c0`` (0, or the encoder region's width for a decoder with
cross-attention) and holds ``L`` tokens, its page table is

    page_table[j] = R[r, c0 + j * p] // p      for j < ceil(L / p),   else 0 (the padding page),

valid because a request's tokens ``i*p .. (i+1)*p - 1`` share one page (see ``kv``).

Local (chunked) attention with chunk ``C`` (a multiple of ``p``): query at absolute position ``t``
sees keys ``floor(t / C) * C .. t``. A request with ``q`` new tokens over ``L`` KV tokens (queries at
``L-q .. L-1``) is split at chunk borders into *virtual requests*, one per chunk ``c`` it touches:

    k_start = c*C;  q positions [max(k_start, L-q), min(k_start + C, L));  k_len = q_end - k_start

and each virtual request runs ordinary bottom-right causal attention over its ``k_len`` keys with
the page table starting at page ``k_start / p``. Virtual requests keep the token order (request by
request, chunk by chunk), so the query tensor needs no permutation. Same result as SGLang's
``make_local_attention_virtual_batches`` (our own vectorized code; the layout is host math on the
``*_cpu`` lengths, so it runs in NumPy: no torch op, no device value read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mla_fa3 import ops

__all__ = ["gather_page_table", "cumsum_padded", "LocalLayout", "local_layout", "local_layout_np",
           "max_local_rows"]


def cumsum_padded(lens: Tensor) -> Tensor:
    """``[0, l0, l0+l1, ...]`` as int32 on ``lens``'s device (cu_seqlens)."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    if lens.shape[0]:
        torch.cumsum(lens, 0, dtype=torch.int32, out=out[1:])
    return out


def gather_page_table(req_to_token: Tensor, rows: Tensor, num_tokens: Tensor, max_pages: int,
                      page_size: int, first_col: Tensor | None = None, col_index: Tensor | None = None, *,
                      col_offsets: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """[n, max_pages] int32 page ids of ``rows`` (tensor ops only; no device->host sync).

    ``rows`` [n] int64 (or int32) request rows, ``num_tokens`` [n] tokens of each region,
    ``first_col`` [n] first column of each region (None = 0), ``col_index`` an optional cached
    ``arange`` (int64, >= max_pages long) on the device, ``col_offsets`` an optional cached
    ``arange * page_size`` (>= max_pages long; saves the multiply), ``out`` an optional [n, max_pages]
    int32 destination (a view of a CUDA-graph buffer: written in place, no extra copy). Entries past
    a region's pages are 0. Without ``first_col``, on CUDA: one launch of ``ops.gather_page_ids`` (where
    ``ops.page_ids_kernel`` says so: the global impl is not 'reference' and Triton imports); else torch ops —
    four kernels when ``first_col`` is None and ``col_offsets`` is given (gather, compare, divide, mask), six
    with ``first_col``.
    """
    device = req_to_token.device
    width = req_to_token.shape[1]
    strided = first_col is None and max_pages <= -(-width // page_size)  # column j*p of each row, inside the table
    if strided and ops.page_ids_kernel(device):
        if out is None:
            out = torch.empty(rows.shape[0], max_pages, dtype=torch.int32, device=device)
        return ops.gather_page_ids(req_to_token, rows, num_tokens, page_size, out)
    if col_offsets is not None:
        offs = col_offsets[:max_pages]
    else:
        j = (col_index[:max_pages] if col_index is not None
             else torch.arange(max_pages, dtype=torch.int64, device=device))
        offs = j * page_size
    if strided:  # one index_select over the strided view (no index arithmetic)
        values = torch.index_select(req_to_token[:, : max_pages * page_size: page_size], 0, rows)
    else:
        cols = offs.unsqueeze(0) if first_col is None else first_col.unsqueeze(1) + offs
        values = req_to_token[rows.unsqueeze(1), cols.clamp(max=width - 1)]  # broadcast to [n, max_pages]
    # page j is live iff j*p < num_tokens (<=> j < ceil(num_tokens / p))
    live = offs < num_tokens.unsqueeze(1)
    values = values.floor_divide_(page_size)
    if out is None:
        return values.mul_(live)
    return torch.mul(values, live, out=out)


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


def local_layout_np(seq_lens: np.ndarray, q_lens: np.ndarray, chunk: int) -> tuple[np.ndarray, ...]:
    """:func:`local_layout` on NumPy arrays (host only, no torch op): ``(req, k_start, q_lens, k_lens)``
    as int64 arrays of the ``V`` virtual requests."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    q = np.asarray(q_lens, dtype=np.int64)
    first_pos = seq - q
    first_chunk = first_pos // chunk
    last_chunk = np.maximum(seq - 1, 0) // chunk
    nblocks = np.where(q > 0, last_chunk - first_chunk + 1, 0)
    req = np.repeat(np.arange(seq.shape[0], dtype=np.int64), nblocks)
    block_start_row = np.cumsum(nblocks) - nblocks
    chunk_idx = first_chunk[req] + np.arange(req.shape[0], dtype=np.int64) - block_start_row[req]
    k_start = chunk_idx * chunk
    q_begin = np.maximum(k_start, first_pos[req])
    q_end = np.minimum(k_start + chunk, seq[req])
    return req, k_start, q_end - q_begin, q_end - k_start


def local_layout(seq_lens_cpu: Tensor, q_lens_cpu: Tensor, chunk: int) -> LocalLayout:
    """Split each request's queries at multiples of ``chunk`` (CPU tensors in, CPU tensors out)."""
    arrays = local_layout_np(seq_lens_cpu.numpy(), q_lens_cpu.numpy(), chunk)
    req, k_start, q_lens, k_lens = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays)
    return LocalLayout(req=req, k_start=k_start, q_lens=q_lens, k_lens=k_lens)


def max_local_rows(batch_size: int, queries_per_request: int, chunk: int) -> int:
    """Most virtual requests ``batch_size`` requests of ``queries_per_request`` queries can make."""
    return batch_size * (1 + -(-(queries_per_request - 1) // chunk))
