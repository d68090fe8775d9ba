"""CUDA-graph capture buffers on the CPU: replay equals the eager build on the live rows, leaves
harmless tails, clears what a bigger batch left behind, and refuses what does not fit.

The eager build itself is checked against Python lists (test_metadata.py); here each replay is also
checked against those lists directly. The host-cost contract (one host->device copy, a fixed small
number of device ops, no device value read on the host) is checked on the ``meta`` device: it runs
the CUDA code path but holds no data, so any host read of a device value raises there.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from metadata_world import check_against_lists, check_replay, expected_local, make_batch, make_world
from op_log import DeviceOpLog

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.metadata import AttentionMetadata, MetadataBuilder

M = ForwardMode
SEQ = [40, 150, 7, 90, 21]  # five requests; the small batch uses requests 2 and 4 (short)
ENC = [5, 70, 1, 33, 17]
SMALL = [2, 4]
# name -> (mode, queries per request)
MODES = {"decode": (M.DECODE, 1), "verify_k3": (M.TARGET_VERIFY, 3), "draft_decode": (M.DRAFT_DECODE, 1)}
CHUNK = {1: 8, 16: 16, 64: 64}


def setup(page_size: int, variant: str, pad: int = 1, max_bs: int = 6):
    enc = ENC if variant == "encoder" else None
    w = make_world(SEQ, page_size, enc, seed=page_size)
    chunk = CHUNK[page_size] if variant == "local" else None
    builder = MetadataBuilder(w.pool, page_size, "cpu", attention_chunk_size=chunk, num_slots=w.num_slots)
    builder.init_capture_buffers(max_bs, w.pool.max_context, max_num_draft_tokens=4,
                                 with_encoder=enc is not None, pad_seqlen=pad, device_tables=variant == "device")
    assert builder.capture_buffers.device_tables == (variant == "device")
    return w, builder, chunk


def replay(builder: MetadataBuilder, batch, cap) -> None:
    """The replay update, then (device tables) what the graph's prologue derives on the device."""
    builder.replay(batch, cap)
    builder.derive_tables(cap)


def snapshot(builder: MetadataBuilder) -> dict:
    buf = builder.capture_buffers
    return {k: v.clone() for k, v in vars(buf).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("variant", ["plain", "device", "encoder", "local"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_replay_small_after_big_equals_eager(mode_name: str, page_size: int, variant: str) -> None:
    mode, q = MODES[mode_name]
    w, builder, chunk = setup(page_size, variant)
    enc = variant == "encoder"
    big = make_batch(w, mode, [q] * len(SEQ), with_encoder=enc)
    small = make_batch(w, mode, [q] * len(SMALL), idx=SMALL, with_encoder=enc)
    cap5 = builder.capture(5, mode, num_draft_tokens=q)
    cap3 = builder.capture(3, mode, num_draft_tokens=q)
    replay(builder, big, cap5)
    check_replay(cap5, builder.build(big), builder, 5, q, 1)
    for cap in (cap5, cap3):  # after the big batch, the small one on either captured size
        replay(builder, small, cap)
        eager = builder.build(small)
        check_replay(cap, eager, builder, len(SMALL), q, 1)
        live = AttentionMetadata(mode=mode, batch_size=2, page_size=page_size, cache_seqlens=cap.cache_seqlens[:2],
                                 cu_seqlens_q=cap.cu_seqlens_q[:3], cu_seqlens_k=cap.cu_seqlens_k[:3],
                                 max_seqlen_q=q, max_seqlen_k=max(SEQ[i] for i in SMALL),
                                 page_table=cap.page_table[:2, : eager.page_table.shape[1]])
        check_against_lists(live, w, mode, [q, q], SMALL, chunk=None, with_encoder=False)
        if chunk is not None:
            exp = expected_local(w, SMALL, [q, q], chunk)
            rows = len(exp["cache_seqlens"])
            assert cap.local.cache_seqlens[:rows].tolist() == exp["cache_seqlens"]
            assert cap.local.page_table[:rows].tolist() == exp["page_table"]


@pytest.mark.parametrize("pad", [0, 1])
def test_capture_starts_from_harmless_padding(pad: int) -> None:
    w, builder, _ = setup(16, "local", pad=pad)
    builder.replay(make_batch(w, M.DECODE, [1] * 5), builder.capture(5, M.DECODE))
    cap = builder.capture(4, M.TARGET_VERIFY, num_draft_tokens=2)  # re-capture resets to padding
    assert cap.cache_seqlens.tolist() == [pad] * 4 and cap.page_table.eq(0).all()
    assert cap.cu_seqlens_k.tolist() == [pad * i for i in range(5)]
    assert cap.cu_seqlens_q.tolist() == [0, 2, 4, 6, 8]
    assert cap.local.cu_seqlens_q[-1].item() == 8 and cap.local.page_table.eq(0).all()
    assert builder.capture_buffers.page_table.eq(0).all()


def test_replay_refuses_what_does_not_fit_and_changes_nothing() -> None:
    w, builder, _ = setup(16, "plain", max_bs=6)
    dec = make_batch(w, M.DECODE, [1] * 5)
    ver = make_batch(w, M.TARGET_VERIFY, [2] * 5)
    cap3 = builder.capture(3, M.DECODE)
    cap5 = builder.capture(5, M.DECODE)
    cap_v = builder.capture(5, M.TARGET_VERIFY, num_draft_tokens=3)
    builder.replay(dec, cap5)
    before = snapshot(builder)
    with pytest.raises(ValueError, match="exceeds the captured batch size 3"):
        builder.replay(dec, cap3)
    with pytest.raises(ValueError, match="forward_mode must be DECODE"):
        builder.replay(ver, cap5)
    with pytest.raises(ValueError, match="num_draft_tokens must be 3"):
        builder.replay(ver, cap_v)
    enc_batch = make_batch(w, M.DECODE, [1] * 5)
    enc_batch.encoder_lens, enc_batch.encoder_lens_cpu = (torch.zeros(5, dtype=torch.int32),) * 2
    with pytest.raises(ValueError, match="encoder_lens must be None"):
        builder.replay(enc_batch, cap5)
    with pytest.raises(ValueError, match="capture"):
        builder.replay(dec, builder.build(dec))
    after = snapshot(builder)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_replay_refuses_a_context_beyond_the_buffers() -> None:
    w = make_world(SEQ, 16, seed=3)
    builder = MetadataBuilder(w.pool, 16, "cpu")
    builder.init_capture_buffers(4, 64)
    cap = builder.capture(4, M.DECODE)
    ok = make_batch(w, M.DECODE, [1, 1], idx=[2, 4])
    builder.replay(ok, cap)
    before = snapshot(builder)
    with pytest.raises(ValueError, match="captured max_context 64"):
        builder.replay(make_batch(w, M.DECODE, [1, 1], idx=[0, 3]), cap)  # 90 > 64
    after = snapshot(builder)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_capture_named_errors() -> None:
    w = make_world([3], 4)
    builder = MetadataBuilder(w.pool, 4, "cpu")
    with pytest.raises(ValueError, match="init_capture_buffers"):
        builder.capture(1, M.DECODE)
    with pytest.raises(ValueError, match="max_context"):
        builder.init_capture_buffers(2, w.pool.max_context + 1)
    builder.init_capture_buffers(2, w.pool.max_context, max_num_draft_tokens=2)
    with pytest.raises(ValueError, match="mode"):
        builder.capture(1, M.EXTEND)
    with pytest.raises(ValueError, match="bs"):
        builder.capture(3, M.DECODE)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        builder.capture(2, M.TARGET_VERIFY, num_draft_tokens=3)
    with pytest.raises(ValueError, match="pad_seqlen"):
        builder.init_capture_buffers(2, 8, pad_seqlen=2)
    # IDLE through replay is refused too (not capturable); an empty decode replay resets everything
    cap = builder.capture(2, M.DECODE)
    builder.replay(ForwardBatch.decode([w.rows[0]], [3], [w.dec_slots[0][2]], "cpu"), cap)
    empty = ForwardBatch(M.DECODE, 0, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32),
                         torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64))
    builder.replay(empty, cap)
    assert cap.cache_seqlens.tolist() == [1, 1] and builder.capture_buffers.page_table.eq(0).all()


# ---------------------------------------------------------------------------------------- host cost
# case -> (mode, k, attention chunk, with encoder, device ops of one replay of 3 live rows into bs 4)
TABLE_OPS = Counter(index_select=1, lt=1, floor_divide_=1, mul=1)  # one page table: gather, compare, divide, mask
OFFSET_TABLE_OPS = TABLE_OPS - Counter(index_select=1) + Counter(add=1, clamp=1, index=1)  # + first column
META_CASES = {
    "decode": (M.DECODE, 1, None, False, Counter(copy_=1) + TABLE_OPS),
    "verify_k3": (M.TARGET_VERIFY, 3, None, False, Counter(copy_=1) + TABLE_OPS),
    "draft_decode_encoder": (M.DRAFT_DECODE, 1, None, True, Counter(copy_=1) + TABLE_OPS + OFFSET_TABLE_OPS),
    "verify_k3_local": (M.TARGET_VERIFY, 3, 32, False,
                        Counter(copy_=1) + TABLE_OPS + OFFSET_TABLE_OPS + Counter(index_select=1)),
}


def meta_batch(mode: ForwardMode, k: int, rows: list[int], seq: list[int], enc: list[int] | None) -> ForwardBatch:
    loc = list(range(1, 1 + len(rows) * k))
    if mode is M.TARGET_VERIFY:
        return ForwardBatch.verify(rows, seq, loc, "meta", num_draft_tokens=k, encoder_lens=enc)
    if mode is M.DRAFT_DECODE:
        return ForwardBatch.draft_decode(rows, seq, loc, "meta", step=0, encoder_lens=enc)
    return ForwardBatch.decode(rows, seq, loc, "meta", encoder_lens=enc)


@pytest.mark.parametrize("name", list(META_CASES))
def test_replay_is_one_host_copy_and_a_few_table_ops_without_reading_the_device(name: str) -> None:
    mode, k, chunk, with_enc, expected = META_CASES[name]
    pool = ReqToTokenPool(8, 512, "meta")
    pool.claim(list(range(8)), 512)  # a layout the test owns (the meta device holds no values)
    builder = MetadataBuilder(pool, 16, "meta", attention_chunk_size=chunk)
    builder.init_capture_buffers(6, 512, max_num_draft_tokens=4, with_encoder=with_enc)
    cap = builder.capture(4, mode, num_draft_tokens=k)
    enc = [3, 0, 40] if with_enc else None
    batch = meta_batch(mode, k, [1, 5, 2], [40, 17, 300], enc)
    builder.replay(batch, cap)
    log = DeviceOpLog()
    with log:  # steady state: the same live rows again (meta raises on any host read of a device value)
        builder.replay(batch, cap)
    assert log.host_to_device_copies() == 1
    assert log.device_ops() == expected
    smaller = meta_batch(mode, k, [5, 2], [17, 30], enc[1:] if enc else None)
    log = DeviceOpLog()
    with log:  # fewer rows than the previous replay: their stale page-table rows are zeroed, one op per table
        builder.replay(smaller, cap)
    tables = 1 + with_enc + (chunk is not None)
    assert log.host_to_device_copies() == 1
    assert log.device_ops() == expected + Counter(zero_=tables)


def test_one_dimensional_tables_are_disjoint_slices_of_one_packed_buffer() -> None:
    w, builder, _ = setup(16, "encoder")
    builder.init_capture_buffers(6, w.pool.max_context, max_num_draft_tokens=4, with_encoder=True)
    buf = builder.capture_buffers
    base, itemsize = buf.packed.data_ptr(), buf.packed.element_size()
    spans = []
    for name in ("cache_seqlens", "cu_seqlens_k", "enc_cache_seqlens", "enc_cu_seqlens_k", "enc_first_col"):
        t = getattr(buf, name)
        assert t.untyped_storage().data_ptr() == buf.packed.untyped_storage().data_ptr(), name
        start = (t.data_ptr() - base) // itemsize
        spans.append((start, start + t.numel()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= buf.packed.numel()


def test_device_tables_with_rows_given_on_the_device_equal_the_eager_build() -> None:
    """Rows handed over as a device tensor (no CPU copy): copied device to device into the staged rows."""
    w, builder, _ = setup(16, "device")
    batch = make_batch(w, M.DECODE, [1] * len(SMALL), idx=SMALL)
    batch.req_pool_indices_cpu = None  # as an engine that keeps its rows on the GPU hands them over
    cap = builder.capture(4, M.DECODE)
    replay(builder, make_batch(w, M.DECODE, [1] * 4, idx=[0, 1, 2, 3]), cap)  # a bigger batch first
    replay(builder, batch, cap)
    check_replay(cap, builder.build(make_batch(w, M.DECODE, [1] * len(SMALL), idx=SMALL)), builder, 2, 1, 1)
