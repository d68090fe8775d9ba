"""ForwardMode predicates and the ForwardBatch constructors, against lengths worked out by hand."""

from __future__ import annotations

import pytest
import torch

from mla_fa3.batch import ForwardBatch, ForwardMode

M = ForwardMode

# mode -> (decode_like, extend_like, graph_capturable, idle)
PREDICATES = {
    M.EXTEND: (False, True, False, False),
    M.DECODE: (True, False, True, False),
    M.MIXED: (False, True, False, False),
    M.IDLE: (False, False, False, True),
    M.TARGET_VERIFY: (False, False, True, False),
    M.DRAFT_DECODE: (True, False, True, False),
    M.DRAFT_EXTEND: (False, True, False, False),
}


@pytest.mark.parametrize("mode", list(ForwardMode))
def test_mode_predicates(mode: ForwardMode) -> None:
    got = (mode.is_decode_like(), mode.is_extend_like(), mode.is_graph_capturable(), mode.is_idle())
    assert got == PREDICATES[mode]


def _positions(seq, new):
    return [s - n + i for s, n in zip(seq, new) for i in range(n)]


# name -> (constructor kwargs builder, expected seq_lens, new tokens per request)
CASES = {
    "extend_mixed_prefix": (lambda: ForwardBatch.extend([2, 0], [3, 0], [2, 4], list(range(10, 16)), "cpu"),
                            [5, 4], [2, 4]),
    "mixed": (lambda: ForwardBatch.extend([1, 3, 0], [7, 0, 2], [1, 3, 1], [5, 6, 7, 8, 9], "cpu", mode=M.MIXED),
              [8, 3, 3], [1, 3, 1]),
    "decode": (lambda: ForwardBatch.decode([4, 1], [9, 1], [20, 21], "cpu"), [9, 1], [1, 1]),
    "verify_k3": (lambda: ForwardBatch.verify([0, 1], [5, 7], list(range(6)), "cpu", num_draft_tokens=3),
                  [5, 7], [3, 3]),
    "draft_decode": (lambda: ForwardBatch.draft_decode([0], [12], [3], "cpu", step=2), [12], [1]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_constructors(name: str) -> None:
    make, seq, new = CASES[name]
    b = make()
    assert b.batch_size == len(seq)
    assert b.seq_lens.dtype == torch.int32 and b.seq_lens_cpu.dtype == torch.int32
    assert b.seq_lens.tolist() == seq and b.seq_lens_cpu.tolist() == seq
    assert b.seq_lens_cpu.device.type == "cpu"
    assert b.req_pool_indices.dtype == torch.int64 and b.out_cache_loc.dtype == torch.int64
    assert b.positions.tolist() == _positions(seq, new)
    assert b.num_tokens == sum(new)
    if b.forward_mode.is_extend_like():
        assert b.extend_seq_lens_cpu.tolist() == new == b.extend_seq_lens.tolist()
        assert b.extend_prefix_lens_cpu.tolist() == [s - n for s, n in zip(seq, new)]
    else:
        assert b.extend_seq_lens is None and b.extend_prefix_lens_cpu is None


def test_draft_and_verify_fields() -> None:
    assert ForwardBatch.draft_decode([0], [12], [3], "cpu", step=2).draft_step == 2
    assert ForwardBatch.verify([0], [4], [1, 2, 3, 4], "cpu", num_draft_tokens=4).num_draft_tokens == 4


def test_idle_and_encoder() -> None:
    b = ForwardBatch.idle("cpu")
    assert b.batch_size == 0 and b.forward_mode is M.IDLE and b.num_tokens == 0
    e = ForwardBatch.decode([0, 1], [3, 4], [7, 8], "cpu", encoder_lens=[5, 0])
    assert e.encoder_lens.tolist() == [5, 0] and e.encoder_lens_cpu.dtype == torch.int32


ERRORS = {
    "lens_mismatch": (lambda: ForwardBatch.extend([0, 1], [0], [1, 1], [1, 2], "cpu"), ValueError, "prefix_lens"),
    "loc_not_summing": (lambda: ForwardBatch.extend([0], [0], [3], [1, 2], "cpu"), ValueError, "out_cache_loc"),
    "negative": (lambda: ForwardBatch.decode([0], [-1], [1], "cpu"), ValueError, "seq_lens"),
    "decode_zero_seq": (lambda: ForwardBatch.decode([0], [0], [1], "cpu"), ValueError, "seq_lens"),
    "verify_short_seq": (lambda: ForwardBatch.verify([0], [2], [1, 2, 3], "cpu", num_draft_tokens=3),
                         ValueError, "seq_lens"),
    "verify_k0": (lambda: ForwardBatch.verify([0], [2], [], "cpu", num_draft_tokens=0), ValueError, "num_draft_tokens"),
    "rows_mismatch": (lambda: ForwardBatch.decode([0, 1], [3], [1], "cpu"), ValueError, "req_pool_indices"),
    "float_lens": (lambda: ForwardBatch.decode([0], torch.tensor([3.0]), [1], "cpu"), TypeError, "seq_lens"),
    "bad_mode": (lambda: ForwardBatch.extend([0], [0], [1], [1], "cpu", mode=M.DECODE), ValueError, "mode"),
    "enc_mismatch": (lambda: ForwardBatch.decode([0], [3], [1], "cpu", encoder_lens=[1, 2]), ValueError,
                     "encoder_lens"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_named_errors(name: str) -> None:
    make, exc, word = ERRORS[name]
    with pytest.raises(exc, match=word):
        make()


def test_dataclass_checks_dtypes_and_consistency() -> None:
    b = ForwardBatch.extend([0], [2], [3], [1, 2, 3], "cpu")
    with pytest.raises(TypeError, match="seq_lens must be torch.int32"):
        ForwardBatch(M.DECODE, 1, b.req_pool_indices, b.seq_lens.long(), b.seq_lens_cpu, b.out_cache_loc[:1])
    b.seq_lens_cpu = torch.tensor([4], dtype=torch.int32)  # no longer prefix + extend
    with pytest.raises(ValueError, match="seq_lens must equal"):
        b.check()
