"""A step's batch checked against the KV memory it names, before any metadata is built or kernel runs.

``ForwardBatch.check`` looks at the batch alone (dtypes, shapes, lengths that agree with each other); the
checks here hold it against the request->token table and the KV pool it will read and write. Request ``b``
of ``bs`` uses row ``row_b = req_pool_indices[b]``; its row needs ``span_b = c0_b + seq_lens[b]`` columns
(``c0_b`` = its encoder region, ``ceil(encoder_len_b / p) * p``, 0 without one); ``n_b`` is its new tokens.

- context: ``span_b <= max_context`` (the table's width);
- rows: ``row_b`` in ``[0, rows)``; with a :class:`ReqToTokenPool`, held and ``span_b <= allocated_len[row_b]``;
- a tree step: ``tree.check_tree_step`` (no encoder; the mask's values; a draft step's new tokens are tree keys);
- slots: ``out_cache_loc`` in ``[0, num_slots)``, distinct, and token ``i`` of request ``b`` goes to
  ``req_to_token[row_b, c0_b + seq_lens[b] - n_b + i]`` — a token is written only to a slot its own request
  holds. Worked example (p = 1, no encoder): ``seq_lens = [5, 3]``, ``n = [2, 1]`` -> the three new tokens
  sit in columns ``[3, 4, 2]`` of rows ``[row_0, row_0, row_1]``;
- page ids of a built page table in ``[0, num_slots / p)``.

Sync rules: the context and row checks read host ints only (the batch's CPU copies; rows when it carries
their copy), on every path; the
tree values, slot and page-id checks read tensor values, so they run for CPU tensors always and on a GPU
only with ``debug_checks=True`` — which also compares every CPU copy with its device tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mla_fa3.batch import ForwardBatch, ForwardMode, queries_per_request
from mla_fa3.host import to_device
from mla_fa3.kv.pools import same_device
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.tree import check_tree_step

__all__ = ["BatchChecks", "new_tokens_cpu"]


def new_tokens_cpu(batch: ForwardBatch) -> Tensor:
    """[bs] int32 CPU: queries per request (n_b) for any mode."""
    if batch.forward_mode.is_extend_like():
        return batch.extend_seq_lens_cpu
    per = queries_per_request(batch.forward_mode, batch.num_draft_tokens)
    return torch.full_like(batch.seq_lens_cpu, per)


class BatchChecks:
    """The named errors (``ValueError``, ``TypeError``, ``DraftTreeError``) for a batch that does not fit the
    KV memory; owned by the :class:`~mla_fa3.metadata.MetadataBuilder`, which runs :meth:`validate` first on
    every build and replay and :meth:`check_pages` on every page table it builds.

    ``req_to_token``: [rows, max_context] int32 on ``device``; ``req_pool``: its :class:`ReqToTokenPool`, whose
    host-side ownership (held rows, ``allocated_len``) checks every batch — None for a bare tensor, which
    carries none (only ranges and max_context are checked then); ``num_slots``: the KV pool's slot count,
    enabling the range checks of ``out_cache_loc`` and page ids.
    """

    def __init__(self, req_to_token: Tensor, req_pool: ReqToTokenPool | None, page_size: int,
                 device: torch.device, *, num_slots: int | None, debug_checks: bool):
        self.req_to_token = req_to_token
        self.req_pool = req_pool
        self.max_context = req_to_token.shape[1]
        self.page_size = page_size
        self.device = device
        self.num_slots = num_slots
        self.debug_checks = debug_checks

    def validate(self, batch: ForwardBatch, *, check_context: bool = True) -> None:
        """Named errors for bad input, before any kernel runs; host values only unless debug_checks.

        ``check_context=False``: the caller checks the context length itself (replay checks it against
        the capture buffers' max_context, which is at most the table's).
        """
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        batch.ensure_checked()  # construction ran check(); again only after a field was reassigned
        if not same_device(batch.seq_lens.device, self.device):
            raise ValueError(f"batch.seq_lens must be on {self.device}, got {batch.seq_lens.device}")
        if batch.batch_size == 0:
            return
        if check_context:
            span = self.span(batch)
            if int(span.max()) > self.max_context:
                raise ValueError(f"seq_lens exceed max_context {self.max_context} (encoder region included): "
                                 f"{span.tolist()}")
        check_values = self.debug_checks or batch.seq_lens.device.type == "cpu"
        # host-readable rows: the device tensor itself (CPU / debug_checks), else the batch's CPU copy
        rows = batch.req_pool_indices.cpu() if check_values else batch.req_pool_indices_cpu
        if rows is not None:
            self.check_rows(batch, rows)
        if batch.tree is not None:
            check_tree_step(batch.tree, self.req_to_token, rows, batch.seq_lens_cpu, batch.out_cache_loc,
                            has_encoder=batch.encoder_lens is not None, check_values=check_values,
                            reread=self.debug_checks, key_columns=batch.tree_key_columns)
        if check_values and (batch.tree is None or batch.tree.verify):
            self.check_out_cache_loc(batch, rows)
        if self.debug_checks:
            for dev, cpu in (("req_pool_indices", "req_pool_indices_cpu"), ("seq_lens", "seq_lens_cpu"),
                             ("extend_prefix_lens", "extend_prefix_lens_cpu"),
                             ("extend_seq_lens", "extend_seq_lens_cpu"), ("encoder_lens", "encoder_lens_cpu")):
                d, c = getattr(batch, dev), getattr(batch, cpu)
                if d is not None and not torch.equal(d.cpu(), c):
                    raise ValueError(f"{dev} differs from {cpu}: {d.tolist()} vs {c.tolist()}")

    def check_rows(self, batch: ForwardBatch, rows: Tensor) -> None:
        """Rows in range; with a ReqToTokenPool: held, and ``seq_lens`` (after the encoder region) within
        the tokens allocated to each row. Host ints only (the batch's CPU copies)."""
        r = rows.numpy()
        span = self.span(batch) if self.req_pool is not None else None
        if span is not None and self.req_pool.rows_cover(r, span):  # the common case, in one NumPy pass
            return
        size = self.req_to_token.shape[0]
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= size:
            raise ValueError(f"req_pool_indices must be in [0, {size}), got {lo if lo < 0 else hi} "
                             f"in {rows.tolist()}")
        if self.req_pool is None:
            return
        held, allocated = self.req_pool.is_held, self.req_pool.allocated_len
        row_list = r.tolist()
        for b, (row, need) in enumerate(zip(row_list, span.tolist())):  # name the first offender
            if not held(row):
                raise ValueError(f"req_pool_indices[{b}] = {row} is not a held request row (never allocated, "
                                 "or freed)")
            if need > allocated[row]:
                enc = need - int(batch.seq_lens_cpu[b])
                raise ValueError(f"seq_lens[{b}] = {int(batch.seq_lens_cpu[b])}"
                                 f"{f' after an encoder region of {enc} columns' if enc else ''} exceeds the "
                                 f"{allocated[row]} tokens allocated to request row {row}")

    def span(self, batch: ForwardBatch) -> np.ndarray:
        """[bs] int32 (int64 with an encoder): the columns each request's row needs (its encoder region, then ``seq_lens``)."""
        span = batch.seq_lens_cpu.numpy()  # a view: never written
        if batch.encoder_lens_cpu is not None:
            p = self.page_size
            span = span.astype(np.int64) + (batch.encoder_lens_cpu.numpy().astype(np.int64) + (p - 1)) // p * p
        return span

    def check_out_cache_loc(self, batch: ForwardBatch, rows: Tensor) -> None:
        """Host values (CPU tensors, or a GPU under debug_checks): every new token's slot is in the pool,
        is the slot ``req_to_token`` gives that token of its request (so the request owns it and the
        kernels read it back), and no two tokens share one. A CUDA-graph padding request (every new
        token to slot 0, no cached keys — a verify or tree step's: one, SGLang's fill value) is exempt: it writes and
        reads only the padding page."""
        loc = batch.out_cache_loc.cpu()
        if not loc.numel():
            return
        lo, hi = int(loc.min()), int(loc.max())
        if self.num_slots is not None and (lo < 0 or hi >= self.num_slots):
            raise ValueError(f"out_cache_loc must be in [0, {self.num_slots}), got {lo if lo < 0 else hi}")
        if lo < 0:
            raise ValueError(f"out_cache_loc must be >= 0, got {lo}")
        new = new_tokens_cpu(batch).to(torch.int64)
        seq = batch.seq_lens_cpu.to(torch.int64)
        req = torch.repeat_interleave(torch.arange(batch.batch_size), new)  # request of each new token
        # a verify / tree padding request may keep a prefix of 1 (SGLang's verify fill value excludes the drafts)
        one_key = batch.tree is not None or batch.forward_mode is ForwardMode.TARGET_VERIFY
        pad_len = (seq == new) | ((seq == new + 1) & one_key)
        pad_req = pad_len & (torch.zeros_like(new).index_add_(0, req, loc.ne(0).long()) == 0)
        live = ~pad_req[req]
        loc_live = loc[live]
        if loc_live.unique().numel() != loc_live.numel():
            dup = torch.sort(loc_live).values
            dup = dup[1:][dup[1:] == dup[:-1]]
            raise ValueError(f"out_cache_loc holds slot {int(dup[0])} twice: two new tokens of one step "
                             "would overwrite each other")
        # column of each new token in its request's row: first_col + seq_b - n_b + i
        first_row = torch.cumsum(new, 0) - new
        col = (seq - new + self._encoder_cols_cpu(batch))[req] + torch.arange(loc.numel()) - first_row[req]
        want = self.req_to_token[to_device(rows[req], self.req_to_token.device),
                                 to_device(col, self.req_to_token.device)].cpu().to(torch.int64)
        bad = (want != loc) & live
        if bool(bad.any()):
            t = int(bad.nonzero()[0])
            b = int(req[t])
            raise ValueError(f"out_cache_loc[{t}] = {int(loc[t])} is not the slot of request {b}'s token "
                             f"{int(col[t])} (req_to_token[{int(rows[b])}, {int(col[t])}] = {int(want[t])}): "
                             "a token may only be written to a slot its own request holds")

    def check_pages(self, name: str, page_table: Tensor) -> None:
        """Page ids of a built ``page_table`` inside the pool (CPU tensors, or a GPU under debug_checks)."""
        if self.num_slots is None or page_table.numel() == 0:
            return
        if self.debug_checks or page_table.device.type == "cpu":
            num_pages = self.num_slots // self.page_size
            lo, hi = int(page_table.min()), int(page_table.max())
            if lo < 0:
                raise ValueError(f"{name} holds page id {lo}, negative (req_to_token holds a negative slot)")
            if hi >= num_pages:
                raise ValueError(f"{name} holds page id {hi}, outside the pool's {num_pages} pages "
                                 f"(req_to_token holds a slot outside the pool)")

    def _encoder_cols_cpu(self, batch: ForwardBatch) -> Tensor | int:
        if batch.encoder_lens_cpu is None:
            return 0
        p = self.page_size
        return (batch.encoder_lens_cpu.to(torch.int64) + p - 1) // p * p
