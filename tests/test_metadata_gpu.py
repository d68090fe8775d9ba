"""On the GPU: batch constructors, ``build`` (DECODE / TARGET_VERIFY / DRAFT_DECODE) and ``replay`` run
under ``torch.cuda.set_sync_debug_mode("error")`` — which raises on ``.item()``, ``.tolist()``,
boolean-mask indexing and blocking copies — and give exactly the CPU build's metadata.
"""

from __future__ import annotations

import pytest
import torch

from metadata_world import assert_same_metadata, check_replay, make_batch, make_world

from mla_fa3.batch import ForwardMode
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.metadata import MetadataBuilder

pytestmark = pytest.mark.gpu

M = ForwardMode
SEQ = [40, 150, 7, 90, 21]
ENC = [5, 70, 1, 33, 17]
SMALL = [2, 4]
MODES = {"decode": (M.DECODE, 1), "verify_k3": (M.TARGET_VERIFY, 3), "draft_decode": (M.DRAFT_DECODE, 1)}
CHUNK = {1: 8, 16: 16, 64: 64}


class _NoSync:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block, restored afterwards."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.prev)
        torch.cuda.synchronize()
        return False


@pytest.mark.parametrize("variant", ["plain", "encoder", "local"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode_name", list(MODES))
def test_build_and_replay_without_sync_match_cpu(mode_name: str, page_size: int, variant: str) -> None:
    mode, q = MODES[mode_name]
    enc = variant == "encoder"
    chunk = CHUNK[page_size] if variant == "local" else None
    w = make_world(SEQ, page_size, ENC if enc else None, seed=page_size)
    cpu = MetadataBuilder(w.pool, page_size, "cpu", attention_chunk_size=chunk, num_slots=w.num_slots)
    gpu_pool = ReqToTokenPool(w.pool.size, w.pool.max_context, "cuda")
    gpu_pool.req_to_token.copy_(w.pool.req_to_token)
    gpu_pool.claim(w.rows, [w.pool.allocated_len[r] for r in w.rows])
    gpu = MetadataBuilder(gpu_pool, page_size, "cuda", attention_chunk_size=chunk, num_slots=w.num_slots)
    gpu.init_capture_buffers(6, w.pool.max_context, max_num_draft_tokens=4, with_encoder=enc)
    cap = gpu.capture(5, mode, num_draft_tokens=q)
    with _NoSync():
        big = make_batch(w, mode, [q] * len(SEQ), with_encoder=enc, device="cuda")
        small = make_batch(w, mode, [q] * len(SMALL), idx=SMALL, with_encoder=enc, device="cuda")
        md_big = gpu.build(big)
        md_small = gpu.build(small)
        gpu.replay(big, cap)
        gpu.replay(small, cap)
    assert md_big.page_table.is_cuda and cap.page_table.is_cuda
    cpu_big = cpu.build(make_batch(w, mode, [q] * len(SEQ), with_encoder=enc))
    cpu_small = cpu.build(make_batch(w, mode, [q] * len(SMALL), idx=SMALL, with_encoder=enc))
    assert_same_metadata(md_big, cpu_big)
    assert_same_metadata(md_small, cpu_small)
    check_replay(cap, cpu_small, gpu, len(SMALL), q, 1)


def test_extend_build_without_sync_matches_cpu() -> None:
    """Extend steps build from CPU copies too (local chunks included): no sync either."""
    w = make_world(SEQ, 16, seed=5)
    new = [3, 30, 7, 1, 21]
    cpu = MetadataBuilder(w.pool, 16, "cpu", attention_chunk_size=32)
    gpu_pool = ReqToTokenPool(w.pool.size, w.pool.max_context, "cuda")
    gpu_pool.req_to_token.copy_(w.pool.req_to_token)
    gpu_pool.claim(w.rows, [w.pool.allocated_len[r] for r in w.rows])
    gpu = MetadataBuilder(gpu_pool, 16, "cuda", attention_chunk_size=32)
    with _NoSync():
        md = gpu.build(make_batch(w, M.EXTEND, new, device="cuda"))
    assert_same_metadata(md, cpu.build(make_batch(w, M.EXTEND, new)))


def test_replays_queued_behind_a_busy_stream_each_land_their_own_values() -> None:
    """Replays whose host->device copies are still queued (behind a long kernel) must each deliver their
    own step's metadata: a staging buffer is never rewritten while its copy may be in flight. Each
    replay's metadata is cloned on the stream right after it, then checked against the CPU build."""
    w = make_world(SEQ, 16, seed=7)
    cpu = MetadataBuilder(w.pool, 16, "cpu", num_slots=w.num_slots)
    gpu_pool = ReqToTokenPool(w.pool.size, w.pool.max_context, "cuda")
    gpu_pool.req_to_token.copy_(w.pool.req_to_token)
    gpu_pool.claim(w.rows, [w.pool.allocated_len[r] for r in w.rows])
    gpu = MetadataBuilder(gpu_pool, 16, "cuda", num_slots=w.num_slots)
    gpu.init_capture_buffers(6, w.pool.max_context)
    cap = gpu.capture(5, M.DECODE)
    subsets = [[0, 1, 2, 3, 4], [2, 4], [1], [3, 0, 2], [4, 3, 2, 1]] * 4
    batches = [make_batch(w, M.DECODE, [1] * len(idx), idx=idx, device="cuda") for idx in subsets]
    snaps = []
    with _NoSync():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every copy below waits behind it
        for batch in batches:
            gpu.replay(batch, cap)
            snaps.append([t.clone() for t in (cap.cache_seqlens, cap.cu_seqlens_k, cap.page_table)])
    for idx, (seqlens, cu_k, table) in zip(subsets, snaps):
        eager = cpu.build(make_batch(w, M.DECODE, [1] * len(idx), idx=idx))
        n, width = len(idx), eager.page_table.shape[1]
        assert seqlens.tolist() == eager.cache_seqlens.tolist() + [1] * (5 - n)
        assert cu_k[: n + 1].tolist() == eager.cu_seqlens_k.tolist()
        assert table[:n, :width].tolist() == eager.page_table.tolist()
        assert table[n:].eq(0).all() and table[:, width:].eq(0).all()
