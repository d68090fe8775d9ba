"""THE attention metadata: one builder turns a :class:`~mla_fa3.batch.ForwardBatch` into the tensors
every attention path reads, once per step, for every mode, eagerly or into CUDA-graph buffers.

Symbols (request ``b`` of ``bs``; ``p`` = page size): ``L_b`` = ``seq_lens[b]`` KV tokens after this
step (prefix + new, every mode), ``n_b`` new tokens (queries), ``P_b = L_b - n_b`` cached prefix.

- ``cache_seqlens[b] = L_b``;  ``cu_seqlens_k = [0, L_0, L_0+L_1, ...]``;
- ``cu_seqlens_q``: DECODE / DRAFT_DECODE ``arange(bs+1)``; TARGET_VERIFY ``arange(0, bs*k+1, k)`` (a draft
  tree's step: ``arange(0, bs*topk+1, topk)``);
  EXTEND / MIXED / DRAFT_EXTEND ``[0, n_0, n_0+n_1, ...]``;
- ``max_seqlen_q`` / ``max_seqlen_k``: host ints from the ``*_cpu`` copies (1, k or max n_b; max L_b);
- ``page_table[b, j] = req_to_token[row_b, c0_b + j*p] // p`` for ``j < ceil(L_b / p)``, else 0, over
  ``ceil(max L / p)`` columns (``c0_b`` = the request's encoder region width, 0 without one). FA3 with
  bottom-right causal masking then gives query ``i`` of ``n_b`` the keys ``0 .. P_b + i``.

Tree steps (a batch with a ``tree``, :mod:`mla_fa3.tree`): the metadata is the *prefix's* — ``L_b`` above is
``seq_lens[b] - n`` (the n tree keys excluded), the page table covers the prefix — and ``tree``
(:class:`~mla_fa3.tree.TreeMetadata`) holds the mask and the tree keys' slots for the tree part.

Sliding window needs no metadata: FA3 takes ``window_size=(left, 0)`` per layer over the same page
table, so the layer passes it (``AttentionLayer.sliding_window``). Local (chunked) attention does need
its own virtual batch (:class:`LocalAttentionMetadata`, see :mod:`mla_fa3.pages`); cross-attention its
own page table over the encoder region (:class:`EncoderMetadata`).

Sync rules: ``build`` reads host ints only from the batch's CPU copies; on CUDA it launches small
index kernels and host->device copies but never reads a device value. Before it, the batch is held
against ``req_to_token`` and the pool (:class:`~mla_fa3.batch_checks.BatchChecks`: rows, context, slot
ownership, tree), and every page table built is range-checked there: value checks run for CPU tensors
always, on CUDA only with ``debug_checks=True`` (which also compares the CPU copies with the device tensors).
``capture`` / ``replay`` (``graphs.capture``) follow the same rules and touch only the buffers
allocated by ``init_capture_buffers``. Paths only read the metadata; what a step runs on top of it
(path, kernel, FlashMLA schedule, prefill chunks) is the step plan of :mod:`mla_fa3.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mla_fa3.batch import ForwardBatch, ForwardMode, queries_per_request
from mla_fa3.batch_checks import BatchChecks, new_tokens_cpu
from mla_fa3.host import to_device
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.kv.pools import check_page_size, same_device
from mla_fa3.graphs.capture import (DEVICE_TABLES_MAX_ENTRIES, CaptureBuffers, LengthSources, capture_views,
                                   derive_lengths, derive_tables, replay_into)
from mla_fa3.graphs.tree_buffers import TreeBuffers
from mla_fa3.pages import cumsum_padded, gather_page_table, local_layout
from mla_fa3.tree import DraftTreeError, TreeMetadata, tree_key_slots

__all__ = ["AttentionMetadata", "LocalAttentionMetadata", "EncoderMetadata", "MetadataBuilder"]


@dataclass
class LocalAttentionMetadata:
    """Local (chunked) attention as ``vb`` virtual requests (see :mod:`mla_fa3.pages`)."""

    batch_size: int  # vb: virtual requests (host int)
    cu_seqlens_q: Tensor  # [vb+1] int32, device — queries per virtual request, cumulated
    cache_seqlens: Tensor  # [vb] int32, device — keys per virtual request (from its chunk start)
    page_table: Tensor  # [vb, C/p] int32, device — pages from the chunk start; unused entries 0
    max_seqlen_q: int  # host
    max_seqlen_k: int  # host (<= attention_chunk_size)


@dataclass
class EncoderMetadata:
    """Cross-attention over each request's encoder tokens (the first columns of its row)."""

    cache_seqlens: Tensor  # [bs] int32, device — encoder tokens per request
    cu_seqlens_k: Tensor  # [bs+1] int32, device
    page_table: Tensor  # [bs, ceil(max_enc/p)] int32, device — encoder pages; unused entries 0
    max_seqlen_k: int  # host
    encoder_lens_cpu: Tensor  # [bs] int32, cpu
    decoder_first_col: Tensor  # [bs] int32, device — ceil(enc/p)*p: first decoder column of the row


@dataclass
class AttentionMetadata:
    """Everything the attention paths read in one step. Built once, read by every layer."""

    mode: ForwardMode
    batch_size: int  # bs (for a captured graph: the captured size, padding rows included)
    page_size: int
    cache_seqlens: Tensor  # [bs] int32, device — seq_lens (KV tokens after this step)
    cu_seqlens_q: Tensor  # [bs+1] int32, device
    cu_seqlens_k: Tensor  # [bs+1] int32, device — cumulated cache_seqlens
    max_seqlen_q: int  # host
    max_seqlen_k: int  # host (for a captured graph: max_context)
    page_table: Tensor  # [bs, max_pages] int32, device — page ids; unused entries 0
    cache_seqlens_cpu: Tensor | None = None  # [bs] int32, cpu (None in a captured graph)
    num_draft_tokens: int = 0  # TARGET_VERIFY: k
    # extend-like modes (EXTEND, MIXED, DRAFT_EXTEND); None otherwise
    prefix_lens: Tensor | None = None  # [bs] int32, device — cached tokens before this step
    prefix_lens_cpu: Tensor | None = None  # [bs] int32, cpu
    extend_lens_cpu: Tensor | None = None  # [bs] int32, cpu — new tokens per request
    local: LocalAttentionMetadata | None = None  # when the builder has attention_chunk_size
    encoder: EncoderMetadata | None = None  # when the batch has encoder_lens
    tree: TreeMetadata | None = None  # a tree step (then cache_seqlens are the prefixes, see the module doc)
    is_capture: bool = False  # tensors are views of CUDA-graph buffers (updated by replay)

    @property
    def num_tokens(self) -> int:
        """Total queries T = cu_seqlens_q[-1], from host values."""
        if self.extend_lens_cpu is not None:
            return int(self.extend_lens_cpu.sum())
        return self.batch_size * queries_per_request(self.mode, self.num_draft_tokens)


class MetadataBuilder:
    """Builds :class:`AttentionMetadata` for every mode; owns the CUDA-graph capture buffers and the
    batch checks (``batch_checks``, run first by :meth:`build` and :meth:`replay`).

    ``req_to_token_pool``: a :class:`ReqToTokenPool` (or its ``req_to_token`` tensor);
    ``num_slots``: the KV pool's slot count, enabling range checks of ``out_cache_loc`` and page ids
    (always for CPU tensors, on CUDA only with ``debug_checks``); ``attention_chunk_size``: build
    local-attention virtual batches as well (a multiple of ``page_size``).
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool | Tensor, page_size: int,
                 device: torch.device | str, *, attention_chunk_size: int | None = None,
                 debug_checks: bool = False, num_slots: int | None = None):
        table = req_to_token_pool if isinstance(req_to_token_pool, Tensor) else \
            getattr(req_to_token_pool, "req_to_token", None)
        if not isinstance(table, Tensor) or table.dim() != 2 or table.dtype != torch.int32:
            raise TypeError("req_to_token_pool must be a ReqToTokenPool or a 2-D int32 tensor")
        self.req_to_token = table
        self.max_context = table.shape[1]
        self.page_size = check_page_size(page_size)
        self.device = torch.device(device)
        if not same_device(table.device, self.device):
            raise ValueError(f"device {self.device} differs from req_to_token's device {table.device}")
        if attention_chunk_size is not None and (
                not isinstance(attention_chunk_size, int) or attention_chunk_size < 1
                or attention_chunk_size % page_size):
            raise ValueError(f"attention_chunk_size must be a positive multiple of page_size {page_size}, "
                             f"got {attention_chunk_size!r}")
        if num_slots is not None and (not isinstance(num_slots, int) or num_slots < 1):
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.attention_chunk_size = attention_chunk_size
        self.debug_checks = bool(debug_checks)
        # the batch against the table and the pool: the pool's host-side ownership (held rows, allocated_len)
        # checks every batch; a bare tensor carries none, so only ranges and max_context are checked then
        self.batch_checks = BatchChecks(
            table, req_to_token_pool if isinstance(req_to_token_pool, ReqToTokenPool) else None, self.page_size,
            self.device, num_slots=num_slots, debug_checks=self.debug_checks)
        self.capture_buffers: CaptureBuffers | None = None
        self.tree_buffers: dict[tuple[int, int], TreeBuffers] = {}  # per captured tree shape (m, n)
        self._col_index = torch.arange(-(-self.max_context // page_size), dtype=torch.int64, device=self.device)
        self._zero32 = torch.zeros(1, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ eager build
    def build(self, batch: ForwardBatch) -> AttentionMetadata:
        """Metadata for one step (any mode). IDLE gives an empty (bs 0) metadata without device work."""
        self.batch_checks.validate(batch)
        mode, bs, p = batch.forward_mode, batch.batch_size, self.page_size
        if bs == 0:
            empty = self._zero32[:0]
            return AttentionMetadata(mode=mode, batch_size=0, page_size=p, cache_seqlens=empty,
                                     cu_seqlens_q=self._zero32, cu_seqlens_k=self._zero32, max_seqlen_q=0,
                                     max_seqlen_k=0, page_table=empty.view(0, 0),
                                     cache_seqlens_cpu=batch.seq_lens_cpu, num_draft_tokens=batch.num_draft_tokens)
        seq_lens, seq_cpu, tree = batch.seq_lens, batch.seq_lens_cpu, batch.tree
        if tree is not None:  # the prefix part's metadata (module doc)
            seq_lens, seq_cpu = seq_lens - tree.num_keys, seq_cpu - tree.num_keys
        max_k = int(seq_cpu.max())
        if mode.is_extend_like():
            cu_q, max_q = cumsum_padded(batch.extend_seq_lens), int(batch.extend_seq_lens_cpu.max())
        else:
            k = queries_per_request(mode, batch.num_draft_tokens)
            cu_q, max_q = torch.arange(0, bs * k + 1, k, dtype=torch.int32, device=self.device), k
        encoder = self._build_encoder(batch) if batch.encoder_lens is not None else None
        first_col = encoder.decoder_first_col if encoder is not None else None
        page_table = gather_page_table(self.req_to_token, batch.req_pool_indices, seq_lens,
                                       -(-max_k // p), p, first_col, self._col_index)
        self.batch_checks.check_pages("page_table", page_table)
        extend_like = mode.is_extend_like()
        md = AttentionMetadata(
            mode=mode, batch_size=bs, page_size=p, cache_seqlens=seq_lens, cu_seqlens_q=cu_q,
            cu_seqlens_k=cumsum_padded(seq_lens), max_seqlen_q=max_q, max_seqlen_k=max_k,
            page_table=page_table, cache_seqlens_cpu=seq_cpu,
            num_draft_tokens=batch.num_draft_tokens,
            prefix_lens=batch.extend_prefix_lens if extend_like else None,
            prefix_lens_cpu=batch.extend_prefix_lens_cpu if extend_like else None,
            extend_lens_cpu=batch.extend_seq_lens_cpu if extend_like else None,
            encoder=encoder)
        if tree is not None:
            md.tree = TreeMetadata(num_queries=tree.num_queries, num_keys=tree.num_keys, mask=tree.mask,
                                   key_slots=tree_key_slots(self.req_to_token, batch.req_pool_indices, seq_lens,
                                                            tree.num_keys, columns=batch.tree_key_columns))
        elif self.attention_chunk_size is not None:
            md.local = self._build_local(batch, first_col)
        return md

    def _build_encoder(self, batch: ForwardBatch) -> EncoderMetadata:
        p = self.page_size
        enc = batch.encoder_lens
        max_enc = int(batch.encoder_lens_cpu.max())
        table = gather_page_table(self.req_to_token, batch.req_pool_indices, enc, -(-max_enc // p), p,
                                  None, self._col_index)
        self.batch_checks.check_pages("encoder.page_table", table)
        return EncoderMetadata(cache_seqlens=enc, cu_seqlens_k=cumsum_padded(enc), page_table=table,
                               max_seqlen_k=max_enc, encoder_lens_cpu=batch.encoder_lens_cpu,
                               decoder_first_col=((enc + (p - 1)) // p * p).to(torch.int32))

    def _build_local(self, batch: ForwardBatch, first_col: Tensor | None) -> LocalAttentionMetadata:
        chunk, p = self.attention_chunk_size, self.page_size
        lay = local_layout(batch.seq_lens_cpu, new_tokens_cpu(batch), chunk)
        packed = to_device(torch.stack([lay.req, lay.k_start, lay.k_lens]), self.device)  # one H2D copy
        req, k_start, k_lens = packed[0], packed[1], packed[2]
        col0 = k_start if first_col is None else k_start + first_col[req]
        table = gather_page_table(self.req_to_token, batch.req_pool_indices[req], k_lens, chunk // p, p,
                                  col0, self._col_index)
        self.batch_checks.check_pages("local.page_table", table)
        cu_q = to_device(cumsum_padded(lay.q_lens.to(torch.int32)), self.device)
        return LocalAttentionMetadata(
            batch_size=lay.num_rows, cu_seqlens_q=cu_q, cache_seqlens=k_lens.to(torch.int32),
            page_table=table, max_seqlen_q=int(lay.q_lens.max()) if lay.num_rows else 0,
            max_seqlen_k=int(lay.k_lens.max()) if lay.num_rows else 0)

    # ------------------------------------------------------------------ CUDA graphs
    def init_capture_buffers(self, max_bs: int, max_context: int | None = None, *,
                             max_num_draft_tokens: int = 1, with_encoder: bool = False,
                             pad_seqlen: int = 1, device_tables: bool = False) -> CaptureBuffers:
        """Allocate, once, every tensor a captured graph will read (see ``graphs.capture``).

        ``device_tables``: derive the page table on the device (:meth:`derive_tables`, run inside the
        graph) instead of at each replay, where the buffers allow it (no encoder, no local attention, at
        most ``DEVICE_TABLES_MAX_ENTRIES`` page ids); ``capture_buffers.device_tables`` says whether it does.

        ``pad_seqlen`` is the ``cache_seqlens`` of padding rows: 1 (default: every kernel, FlashMLA
        included, accepts it; the row reads slot 0 of padding page 0, so its output is finite) or 0
        (FA3 then gives the row output 0 and lse -inf; cu_seqlens_k stays flat over the tail).
        """
        max_context = self.max_context if max_context is None else max_context
        if not isinstance(max_context, int) or not 1 <= max_context <= self.max_context:
            raise ValueError(f"max_context must be an int in [1, {self.max_context}], got {max_context!r}")
        device_tables = bool(device_tables) and not with_encoder and self.attention_chunk_size is None \
            and isinstance(max_bs, int) and max_bs * -(-max_context // self.page_size) <= DEVICE_TABLES_MAX_ENTRIES
        self.tree_buffers = {}
        self.capture_buffers = CaptureBuffers.allocate(
            max_bs, max_context, self.page_size, self.device, max_num_draft_tokens=max_num_draft_tokens,
            with_encoder=with_encoder, attention_chunk_size=self.attention_chunk_size, pad_seqlen=pad_seqlen,
            device_tables=device_tables)
        return self.capture_buffers

    def derive_tables(self, metadata: AttentionMetadata, sources: LengthSources | None = None) -> None:
        """The device half of a replay with device tables: ``metadata.page_table`` from the staged rows
        and lengths (tensor ops on fixed shapes; graph-legal) — or, with ``sources``, the lengths first derived
        from them (``graphs.capture.derive_lengths``) and the rows read from them. A no-op when the page table is written at
        replay (buffers without ``device_tables``)."""
        buf = self._buffers()
        if not isinstance(metadata, AttentionMetadata) or not metadata.is_capture:
            raise ValueError("metadata must come from MetadataBuilder.capture")
        if sources is not None:
            derive_lengths(buf, metadata.batch_size, sources)
        if buf.device_tables:
            derive_tables(buf, metadata.batch_size, self.req_to_token, sources)

    def capture(self, bs: int, mode: ForwardMode, *, num_draft_tokens: int = 1,
                tree_shape: tuple[int, int] | None = None) -> AttentionMetadata:
        """Metadata whose tensors are views ``[:bs]`` of the capture buffers, holding padding values.

        ``tree_shape`` (m, n): a tree step's graph (TARGET_VERIFY with ``m = n = num_draft_tokens``, or DRAFT_DECODE
        with ``m = num_draft_tokens`` = topk), its tree part in :class:`TreeBuffers` of that shape."""
        buf = self._buffers()
        tree = None
        if tree_shape is not None:
            tree = TreeBuffers.for_capture(self.tree_buffers, buf, mode, num_draft_tokens, tree_shape)
        v = capture_views(buf, bs, mode, num_draft_tokens)
        encoder = local = None
        if buf.with_encoder:
            encoder = EncoderMetadata(cache_seqlens=v["enc_cache_seqlens"], cu_seqlens_k=v["enc_cu_seqlens_k"],
                                      page_table=v["enc_page_table"], max_seqlen_k=buf.max_context,
                                      encoder_lens_cpu=torch.zeros(bs, dtype=torch.int32),
                                      decoder_first_col=v["enc_first_col"])
        if buf.attention_chunk_size is not None:
            local = LocalAttentionMetadata(
                batch_size=v["local_rows"], cu_seqlens_q=v["local_cu_seqlens_q"],
                cache_seqlens=v["local_cache_seqlens"], page_table=v["local_page_table"],
                max_seqlen_q=v["max_seqlen_q"], max_seqlen_k=buf.attention_chunk_size)
        return AttentionMetadata(
            mode=mode, batch_size=bs, page_size=self.page_size, cache_seqlens=v["cache_seqlens"],
            cu_seqlens_q=v["cu_seqlens_q"], cu_seqlens_k=v["cu_seqlens_k"], max_seqlen_q=v["max_seqlen_q"],
            max_seqlen_k=buf.max_context, page_table=v["page_table"],
            num_draft_tokens=num_draft_tokens if mode is ForwardMode.TARGET_VERIFY or tree is not None else 0,
            local=None if tree is not None else local, encoder=encoder,
            tree=None if tree is None else tree.views(bs), is_capture=True)

    def replay(self, batch: ForwardBatch, metadata: AttentionMetadata) -> None:
        """Update a captured ``metadata`` in place for ``batch`` (copy_/index ops only, no sync).

        Writes the live rows ``[:n]``, resets the tail ``[n:bs]`` (cache_seqlens = pad_seqlen, page
        ids 0, cu_seqlens flat) and clears stale page-table entries of earlier, larger replays.
        Raises ValueError (changing nothing) for a different mode or draft count, a batch larger than
        captured, or a sequence longer than the buffers' max_context.
        """
        buf = self._buffers()
        if not isinstance(metadata, AttentionMetadata) or not metadata.is_capture:
            raise ValueError("metadata must come from MetadataBuilder.capture")
        self.batch_checks.validate(batch, check_context=False)  # replay_into checks it against the buffers' max_context
        tree = metadata.tree
        if (tree is None) != (batch.tree is None) or (tree is not None and batch.tree.shape != (
                tree.num_queries, tree.num_keys)):
            want = "no tree" if tree is None else f"a tree of shape (m, n) = ({tree.num_queries}, {tree.num_keys})"
            raise DraftTreeError(f"batch.tree does not fit the captured step: it was captured with {want}")
        replay_into(buf, batch, metadata.mode, metadata.batch_size, metadata.num_draft_tokens,
                    self.req_to_token, self._col_index,
                    self.batch_checks.span(batch) if batch.encoder_lens_cpu is not None else None)
        if tree is not None:
            self.tree_buffers[(tree.num_queries, tree.num_keys)].replay(
                batch, metadata.batch_size, self.req_to_token, buf.cache_seqlens[:batch.batch_size])
        if metadata.encoder is not None:
            metadata.encoder.encoder_lens_cpu = _pad_cpu(batch.encoder_lens_cpu, metadata.batch_size)
        if self.debug_checks and not buf.device_tables:  # device tables: derived later, inside the graph
            self.batch_checks.check_pages("page_table", metadata.page_table)

    def _buffers(self) -> CaptureBuffers:
        if self.capture_buffers is None:
            raise ValueError("capture buffers are missing: call init_capture_buffers(max_bs, max_context) first")
        return self.capture_buffers


def _pad_cpu(values: Tensor | None, length: int) -> Tensor:
    out = torch.zeros(length, dtype=torch.int32)
    if values is not None:
        out[: values.shape[0]] = values
    return out
