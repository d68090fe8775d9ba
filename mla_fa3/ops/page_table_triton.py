"""Page ids of a batch's requests from ``req_to_token`` in one Triton launch (``triton`` is imported only by the
kernel modules).

``gather_page_ids`` writes ``out[b, j] = R[rows[b], j * p] // p`` for ``j * p < num_tokens[b]``, else 0 — what
``pages.gather_page_table`` computes (without a first column) in four torch kernels (gather, compare, divide,
mask). It runs in every step's metadata and, under CUDA graphs, in every replay's prologue before the layers.
``ops.gather_page_ids`` checks the arguments and resolves the implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor
BLOCK_PAGES = 256  # page ids per program


@triton.jit
def _page_ids_kernel(ReqToToken, stride_r, num_rows, Rows, NumTokens, Out, stride_o, max_pages, page_size,
                     BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(Rows + b).to(tl.int64)
    inside = (row >= 0) & (row < num_rows)
    n = tl.where(inside, tl.load(NumTokens + b).to(tl.int64), 0)  # a row outside R: its pages 0, nothing read
    row = tl.where(inside, row, 0)
    col = j.to(tl.int64) * page_size
    live = (col < n) & (j < max_pages)
    tok = tl.load(ReqToToken + row * stride_r + col, mask=live, other=0).to(tl.int64)
    page = tok // page_size
    page = tl.where((tok % page_size != 0) & (tok < 0), page - 1, page)  # floor division, as torch's floor_divide
    tl.store(Out + b.to(tl.int64) * stride_o + j, tl.where(live, page, 0).to(tl.int32), mask=j < max_pages)


def gather_page_ids(req_to_token: Tensor, rows: Tensor, num_tokens: Tensor, page_size: int, out: Tensor) -> None:
    """``out [n, max_pages]`` int32 from the checked arguments (``ops.gather_page_ids``): one launch, none for n = 0."""
    n, max_pages = out.shape
    if n == 0 or max_pages == 0:
        return
    grid = (n, triton.cdiv(max_pages, BLOCK_PAGES))
    _page_ids_kernel[grid](req_to_token, req_to_token.stride(0), req_to_token.shape[0], rows, num_tokens, out,
                           out.stride(0), max_pages, page_size, BLOCK=BLOCK_PAGES, num_warps=4)
