"""``ops.gather_page_ids`` (one Triton launch) and ``pages.gather_page_table`` (its torch form) against the page
table written out by hand: ``page_table[b, j] = R[rows[b], j * p] // p`` (floor) for ``j * p < num_tokens[b]``, else 0.

Oracle: Python loops over the integers. The torch form runs on every CPU; the kernel under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, this file as a script in a subprocess) and, marked ``gpu``, on CUDA (eager and replayed from
a CUDA graph with new rows and lengths). Cases: page sizes 1 / 16 / 64, lengths 0, 1, p - 1, p, p + 1 and the whole
row, int32 and int64 arguments, ``out`` a view of a wider buffer (nothing outside it written), negative slot values
(floor division), a row outside ``req_to_token`` (zeros, nothing read).
"""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter

from mla_fa3 import ops
from mla_fa3.ops.types import KernelUnavailableError
from mla_fa3.pages import gather_page_table

SENTINEL = -7


def oracle(r2t: torch.Tensor, rows, num_tokens, max_pages: int, p: int) -> torch.Tensor:
    R = r2t.tolist()
    out = [[0] * max_pages for _ in rows]
    for b, (row, n) in enumerate(zip(rows, num_tokens)):
        for j in range(max_pages):
            if j * p < n and 0 <= row < len(R):
                out[b][j] = R[row][j * p] // p  # Python's // floors
    return torch.tensor(out, dtype=torch.int32).reshape(len(rows), max_pages)


def _case(p: int, *, idx_dtype=torch.int64, r2t_dtype=torch.int32, seed=0, negative=False):
    g = torch.Generator().manual_seed(seed)
    width = 9 * p + 3
    r2t = torch.randint(0, 1000 * p, (6, width), generator=g).to(r2t_dtype)
    if negative:
        r2t[2, :: p] = -torch.arange(1, r2t[2, :: p].numel() + 1, dtype=r2t_dtype) * 3
    lens = [0, 1, max(p - 1, 1), p, p + 1, width]
    rows = torch.tensor([3, 0, 5, 2, 1, 4], dtype=idx_dtype)
    num_tokens = torch.tensor(lens, dtype=idx_dtype)
    max_pages = -(-width // p)
    return r2t, rows, num_tokens, max_pages


CASES = {f"p{p}_{name}": (p, kw) for p in (1, 16, 64) for name, kw in
         (("int64_rows", {}), ("int32_all", dict(idx_dtype=torch.int32)), ("int64_r2t", dict(r2t_dtype=torch.int64)),
          ("negative_slots", dict(negative=True)))}


def _check(name: str, device: str, kernel: bool) -> None:
    p, kw = CASES[name]
    r2t, rows, num_tokens, max_pages = _case(p, **kw)
    want = oracle(r2t, rows.tolist(), num_tokens.tolist(), max_pages, p)
    r2t, rows, num_tokens = r2t.to(device), rows.to(device), num_tokens.to(device)
    if kernel:  # into a view of a wider buffer: the sentinel outside it stays
        wide = torch.full((rows.shape[0] + 2, max_pages + 5), SENTINEL, dtype=torch.int32, device=device)
        got = ops.gather_page_ids(r2t, rows, num_tokens, p, wide[1:-1, 2: 2 + max_pages])
        assert got.data_ptr() == wide[1:-1, 2: 2 + max_pages].data_ptr()
        rest = wide.clone()
        rest[1:-1, 2: 2 + max_pages] = SENTINEL
        assert (rest == SENTINEL).all(), f"{name}: written outside out"
    else:
        got = gather_page_table(r2t, rows, num_tokens, max_pages, p)
    assert torch.equal(got.cpu().to(torch.int32), want), f"{name}: {(got.cpu() != want).sum()} page ids differ"


@pytest.mark.parametrize("name", list(CASES))
def test_torch_form_matches_the_oracle(name):
    _check(name, "cpu", kernel=False)


def test_page_table_takes_the_torch_form_on_the_cpu():
    assert not ops.page_ids_kernel("cpu")
    with pytest.raises(KernelUnavailableError, match="page-table"):
        ops.page_ids_kernel("cpu", impl="triton")


def test_bad_arguments_are_named_before_any_launch():
    r2t, rows, num_tokens, max_pages = _case(16)
    out = torch.zeros(rows.shape[0], max_pages, dtype=torch.int32)
    bad = [
        (dict(out=out.long()), ValueError, "out must be int32"),
        (dict(rows=rows.float()), TypeError, "rows must be int32 or int64"),
        (dict(num_tokens=num_tokens[:-1]), ValueError, "num_tokens must have out's 6 rows"),
        (dict(out=torch.zeros(rows.shape[0], max_pages + 1, dtype=torch.int32)), ValueError, "reach past"),
        (dict(req_to_token=r2t.t().contiguous().t()), ValueError, "contiguous last dimension"),
        (dict(page_size=0), ValueError, "page_size must be >= 1"),
        (dict(rows=rows.view(2, 3)), ValueError, "rows"),
        # a column of a wider table (as SGLang hands per-step slot vectors): the kernel reads unit strides
        (dict(rows=torch.stack([rows, rows], 1)[:, 0]), ValueError, "rows must have a contiguous last dimension"),
        (dict(num_tokens=torch.stack([num_tokens] * 3, 1)[:, 1]), ValueError, "num_tokens must have a contiguous"),
    ]
    for change, error, message in bad:
        args = dict(req_to_token=r2t, rows=rows, num_tokens=num_tokens, page_size=16, out=out) | change
        with pytest.raises(error, match=message):
            ops.gather_page_ids(**args)


# ------------------------------------------------------------------------------------------ Triton interpreter


def _interpreter_run() -> dict:
    def row_outside_gives_zeros():
        r2t, rows, num_tokens, max_pages = _case(16)
        rows = rows.clone()
        rows[2], rows[5] = -1, r2t.shape[0]
        out = torch.full((rows.shape[0], max_pages), SENTINEL, dtype=torch.int32)
        ops.gather_page_ids(r2t, rows, num_tokens, 16, out)
        assert (out[2] == 0).all() and (out[5] == 0).all()
        want = oracle(r2t, rows.tolist(), num_tokens.tolist(), max_pages, 16)
        assert torch.equal(out, want)

    def empty_batch_writes_nothing():
        r2t, _, _, max_pages = _case(16)
        empty = torch.zeros(0, dtype=torch.int64)
        out = torch.zeros(0, max_pages, dtype=torch.int32)
        ops.gather_page_ids(r2t, empty, empty, 16, out)

    return run_cases([(name, lambda n=name: _check(n, "cpu", kernel=True)) for name in CASES]
                     + [("row_outside_gives_zeros", row_outside_gives_zeros),
                        ("empty_batch_writes_nothing", empty_batch_writes_nothing)])


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__) == {}


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_on_the_gpu_matches_the_oracle(name):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(name, "cuda", kernel=True)
    p, kw = CASES[name]
    r2t, rows, num_tokens, max_pages = _case(p, **kw)
    assert ops.page_ids_kernel("cuda")  # the page table takes it on CUDA
    got = gather_page_table(r2t.cuda(), rows.cuda(), num_tokens.cuda(), max_pages, p)
    assert torch.equal(got.cpu(), oracle(r2t, rows.tolist(), num_tokens.tolist(), max_pages, p))


@pytest.mark.gpu
def test_kernel_replays_from_a_cuda_graph_with_new_rows_and_lengths():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    r2t, rows, num_tokens, max_pages = _case(64)
    r2t, d_rows, d_lens = r2t.cuda(), rows.cuda(), num_tokens.cuda()
    out = torch.zeros(rows.shape[0], max_pages, dtype=torch.int32, device="cuda")
    ops.gather_page_ids(r2t, d_rows, d_lens, 64, out)  # warm-up: the launch compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gather_page_ids(r2t, d_rows, d_lens, 64, out)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        new_rows = torch.randperm(r2t.shape[0], generator=g)[: rows.shape[0]]
        new_lens = torch.randint(0, r2t.shape[1] + 1, (rows.shape[0],), generator=g)
        d_rows.copy_(new_rows)
        d_lens.copy_(new_lens)
        graph.replay()
        torch.cuda.synchronize()
        want = oracle(r2t.cpu(), new_rows.tolist(), new_lens.tolist(), max_pages, 64)
        assert torch.equal(out.cpu(), want)


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
