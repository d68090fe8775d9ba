"""Test fixture for the metadata tests: a req_to_token pool filled by a random allocation history
through ``PagedAllocator``, the slots kept as Python lists, and expectations derived from those lists.

Pages are handed out in a shuffled order, requests grow in interleaved random increments, and a
distractor request allocates and frees in between. Every expected tensor is computed with loops
over the Python lists (no library helper).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.metadata import AttentionMetadata, MetadataBuilder

M = ForwardMode


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class World:
    """A req_to_token pool filled by a random allocation history, and the slots as Python lists."""

    pool: ReqToTokenPool
    alloc: PagedAllocator
    page_size: int
    rows: list[int]
    seq: list[int]
    enc: list[int]  # encoder tokens per request (0 = none)
    dec_slots: list[list[int]]  # decoder token j of request b -> slot
    enc_slots: list[list[int]]

    @property
    def num_slots(self) -> int:
        return self.alloc.num_slots


def make_world(seq: list[int], page_size: int, enc: list[int] | None = None, seed: int = 0) -> World:
    rng = random.Random(seed)
    p, bs = page_size, len(seq)
    enc = enc or [0] * bs
    enc_cols = [cdiv(e, p) * p for e in enc]
    max_context = max([c + s for c, s in zip(enc_cols, seq)] + [12]) + 2 * p
    pool = ReqToTokenPool(bs + 3, max_context, "cpu")
    need = sum(cdiv(e, p) + cdiv(s, p) for e, s in zip(enc, seq))
    alloc = PagedAllocator(1 + need + cdiv(12, p) + 3, p, "cpu")
    pages = alloc.alloc_pages(alloc.num_free_pages())
    rng.shuffle(pages)
    alloc.free_pages(pages)  # the free list now hands pages out in a shuffled order
    rows = pool.alloc(bs + 3)
    rng.shuffle(rows)
    distractor, rows = rows[bs], rows[:bs]
    enc_slots: list[list[int]] = [[] for _ in range(bs)]
    for b in rng.sample(range(bs), bs):
        if enc[b]:
            enc_slots[b] = alloc.alloc_for_request(pool, rows[b], 0, enc[b]).tolist()
    dec_slots: list[list[int]] = [[] for _ in range(bs)]
    while True:
        pending = [b for b in range(bs) if len(dec_slots[b]) < seq[b]]
        if not pending:
            break
        b = rng.choice(pending)
        n = rng.randint(1, seq[b] - len(dec_slots[b]))
        dec_slots[b] += alloc.alloc_for_request(pool, rows[b], enc_cols[b] + len(dec_slots[b]), n).tolist()
        if rng.random() < 0.4:
            alloc.alloc_for_request(pool, distractor, 0, rng.randint(1, 12))
            alloc.free_request(pool, distractor)
    return World(pool, alloc, p, rows, list(seq), list(enc), dec_slots, enc_slots)


def make_batch(w: World, mode: ForwardMode, new: list[int], idx: list[int] | None = None,
               with_encoder: bool = False, device: str = "cpu") -> ForwardBatch:
    """A batch over requests ``idx`` of the world whose new tokens are each request's last ``new[b]``."""
    idx = list(range(len(w.seq))) if idx is None else idx
    if mode is M.IDLE:
        return ForwardBatch.idle(device)
    rows = [w.rows[b] for b in idx]
    seq = [w.seq[b] for b in idx]
    loc = [s for b, n in zip(idx, new) for s in w.dec_slots[b][w.seq[b] - n:]]
    enc = [w.enc[b] for b in idx] if with_encoder else None
    if mode.is_extend_like():
        return ForwardBatch.extend(rows, [s - n for s, n in zip(seq, new)], new, loc, device, mode=mode,
                                   encoder_lens=enc)
    if mode is M.DECODE:
        return ForwardBatch.decode(rows, seq, loc, device, encoder_lens=enc)
    if mode is M.TARGET_VERIFY:
        return ForwardBatch.verify(rows, seq, loc, device, num_draft_tokens=new[0], encoder_lens=enc)
    return ForwardBatch.draft_decode(rows, seq, loc, device, step=1, encoder_lens=enc)


def table_row(slots: list[int], start: int, length: int, width: int, p: int) -> list[int]:
    """Expected page-table row: page of tokens start, start+p, ... (length tokens), zero-padded."""
    row = [slots[start + j * p] // p for j in range(cdiv(length, p))]
    return row + [0] * (width - len(row))


def expected_local(w: World, idx: list[int], new: list[int], chunk: int) -> dict:
    q_lens, k_lens, rows = [], [], []
    for b, n in zip(idx, new):
        s = w.seq[b]
        positions = list(range(s - n, s))
        for c in sorted({t // chunk for t in positions}):
            mine = [t for t in positions if t // chunk == c]
            q_lens.append(len(mine))
            k_lens.append(mine[-1] + 1 - c * chunk)
            rows.append(table_row(w.dec_slots[b], c * chunk, k_lens[-1], chunk // w.page_size, w.page_size))
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    return dict(cu_seqlens_q=cu, cache_seqlens=k_lens, page_table=rows,
                max_seqlen_q=max(q_lens, default=0), max_seqlen_k=max(k_lens, default=0))


def check_against_lists(md: AttentionMetadata, w: World, mode: ForwardMode, new: list[int],
                        idx: list[int], *, chunk: int | None, with_encoder: bool) -> None:
    p = w.page_size
    seq = [w.seq[b] for b in idx]
    cu_q, cu_k = [0], [0]
    for n, s in zip(new, seq):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + s)
    assert md.mode is mode and md.batch_size == len(idx) and md.page_size == p
    assert md.cache_seqlens.tolist() == seq and md.cache_seqlens.dtype == torch.int32
    assert md.cu_seqlens_q.tolist() == cu_q and md.cu_seqlens_q.dtype == torch.int32
    assert md.cu_seqlens_k.tolist() == cu_k and md.cu_seqlens_k.dtype == torch.int32
    assert md.max_seqlen_q == max(new, default=0) and md.max_seqlen_k == max(seq, default=0)
    width = cdiv(max(seq, default=0), p)
    first = [cdiv(w.enc[b], p) * p for b in idx]  # where the decoder region starts in the row
    want = [table_row(w.dec_slots[b], 0, w.seq[b], width, p) for b in idx]
    assert md.page_table.dtype == torch.int32 and md.page_table.tolist() == (want or [])
    table = md.page_table.tolist()
    for i, b in enumerate(idx):  # the slot a kernel reads for token j is where token j was written
        assert [table[i][j // p] * p + j % p for j in range(w.seq[b])] == w.dec_slots[b]
        assert int(w.pool.req_to_token[w.rows[b], first[i]]) == w.dec_slots[b][0] or w.seq[b] == 0
    if mode.is_extend_like():
        assert md.prefix_lens.tolist() == [s - n for s, n in zip(seq, new)] == md.prefix_lens_cpu.tolist()
        assert md.extend_lens_cpu.tolist() == new
    else:
        assert md.prefix_lens is None and md.extend_lens_cpu is None
    if with_encoder:
        enc = [w.enc[b] for b in idx]
        e_width = cdiv(max(enc), p)
        assert md.encoder.cache_seqlens.tolist() == enc and md.encoder.max_seqlen_k == max(enc)
        assert md.encoder.cu_seqlens_k.tolist() == [sum(enc[:i]) for i in range(len(enc) + 1)]
        assert md.encoder.page_table.tolist() == [table_row(w.enc_slots[b], 0, w.enc[b], e_width, p) for b in idx]
        assert md.encoder.decoder_first_col.tolist() == first
    else:
        assert md.encoder is None
    if chunk is not None:
        exp = expected_local(w, idx, new, chunk)
        loc = md.local
        assert loc.batch_size == len(exp["cache_seqlens"])
        assert loc.cu_seqlens_q.tolist() == exp["cu_seqlens_q"] and loc.cu_seqlens_q.dtype == torch.int32
        assert loc.cache_seqlens.tolist() == exp["cache_seqlens"] and loc.cache_seqlens.dtype == torch.int32
        assert loc.page_table.tolist() == exp["page_table"] and loc.page_table.dtype == torch.int32
        assert (loc.max_seqlen_q, loc.max_seqlen_k) == (exp["max_seqlen_q"], exp["max_seqlen_k"])
    else:
        assert md.local is None


def check_replay(cap: AttentionMetadata, eager: AttentionMetadata, builder: MetadataBuilder, n: int, q: int,
                 pad: int) -> None:
    bs = cap.batch_size
    assert cap.is_capture and cap.max_seqlen_q == q and cap.max_seqlen_k == builder.capture_buffers.max_context
    assert cap.cache_seqlens[:n].tolist() == eager.cache_seqlens.tolist()
    assert cap.cache_seqlens[n:].tolist() == [pad] * (bs - n)
    last = int(eager.cu_seqlens_k[-1])
    assert cap.cu_seqlens_k.tolist() == eager.cu_seqlens_k.tolist() + [last + pad * i for i in range(1, bs - n + 1)]
    assert cap.cu_seqlens_q.tolist() == [q * i for i in range(bs + 1)]
    assert cap.cu_seqlens_q[: n + 1].tolist() == eager.cu_seqlens_q.tolist()
    width = eager.page_table.shape[1]
    assert cap.page_table[:n, :width].tolist() == eager.page_table.tolist()
    # nothing non-zero anywhere in the whole buffer outside the live block (stale rows/cols cleared);
    # device tables: in the graph's rows [:bs], each derived whole (rows past bs belong to other graphs)
    full = builder.capture_buffers.page_table.clone()
    if builder.capture_buffers.device_tables:
        full = full[:bs]
    full[:n, :width] = 0
    assert full.eq(0).all()
    if eager.encoder is not None:
        e, ce = eager.encoder, cap.encoder
        assert ce.cache_seqlens.tolist() == e.cache_seqlens.tolist() + [pad] * (bs - n)
        assert ce.decoder_first_col[:n].tolist() == e.decoder_first_col.tolist()
        assert ce.decoder_first_col[n:].eq(0).all()
        ew = e.page_table.shape[1]
        assert ce.page_table[:n, :ew].tolist() == e.page_table.tolist()
        full = builder.capture_buffers.enc_page_table.clone()
        full[:n, :ew] = 0
        assert full.eq(0).all()
    if eager.local is not None:
        lo, cl = eager.local, cap.local
        v = lo.batch_size
        qs = torch.diff(cl.cu_seqlens_q).tolist()
        assert qs == torch.diff(lo.cu_seqlens_q).tolist() + [q] * (bs - n) + [0] * (cl.batch_size - v - bs + n)
        assert cl.cu_seqlens_q[-1].item() == bs * q
        assert cl.cache_seqlens.tolist() == lo.cache_seqlens.tolist() + [pad] * (bs - n) + \
            [0] * (cl.batch_size - v - bs + n)
        assert cl.page_table[:v].tolist() == lo.page_table.tolist()
        assert cl.page_table[v:].eq(0).all() and builder.capture_buffers.local_page_table[v:].eq(0).all()
        assert cl.max_seqlen_q == q and cl.max_seqlen_k == builder.attention_chunk_size


def assert_same_metadata(a: object, b: object, path: str = "metadata") -> None:
    """Field-by-field equality of two metadata objects (tensors compared on the CPU, dtypes included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same_metadata(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path
