"""Host cost of the KV bookkeeping of one decode step: ``python -m mla_fa3.bench.bookkeeping [--bs 128]``.

Per step of ``bs`` decoding requests (CPU, median of ``--iters`` steps, microseconds):

- ``alloc``: ``bs`` calls of ``PagedAllocator.alloc_for_request(row, len, 1)`` (ownership checks included);
- ``batch``: ``ForwardBatch.decode`` from host lists (strict int checks, CPU copies);
- ``rows``: the builder's host check of rows and ``seq_lens`` against ``allocated_len`` — the part that
  runs on every GPU step (host ints only, no sync);
- ``slots``: the ``out_cache_loc`` ownership / distinctness check — on a GPU only with ``debug_checks``;
- ``free``: ``bs`` × ``free_request`` + ``ReqToTokenPool.free`` of requests finishing (per request).

Timings of a CPU process, for the order of magnitude; they are not a GPU benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mla_fa3.batch import ForwardBatch
from mla_fa3.bench.timing import median_host_us
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.metadata import MetadataBuilder

__all__ = ["measure", "main"]


def measure(bs: int = 128, iters: int = 50, page_size: int = 16, prefix: int = 1000) -> dict[str, float]:
    ctx = prefix + iters * 3 + 2
    pool = ReqToTokenPool(bs, ctx, "cpu")
    alloc = PagedAllocator(1 + bs * -(-ctx // page_size), page_size, "cpu")
    rows = pool.alloc(bs)
    for r in rows:
        alloc.alloc_for_request(pool, r, 0, prefix)
    builder = MetadataBuilder(pool, page_size, "cpu", num_slots=alloc.num_slots)
    state = {"len": prefix}

    def step_alloc():
        n = state["len"]
        state["locs"] = [alloc.alloc_for_request(pool, r, n, 1) for r in rows]
        state["len"] = n + 1

    def step_batch():
        state["batch"] = ForwardBatch.decode(rows, [state["len"]] * bs, torch.cat(state["locs"]), "cpu")

    out = {"alloc": median_host_us(lambda: (step_alloc(), step_batch()), iters)}
    out["batch"] = median_host_us(step_batch, iters)
    rows_cpu = state["batch"].req_pool_indices_cpu
    checks = builder.batch_checks
    out["rows"] = median_host_us(lambda: checks.check_rows(state["batch"], rows_cpu), iters)
    out["slots"] = median_host_us(lambda: checks.check_out_cache_loc(state["batch"], rows_cpu), iters)
    out["alloc"] -= out["batch"]

    def finish_one():
        r = pool.alloc(1)[0]
        alloc.alloc_for_request(pool, r, 0, 40)
        t0 = time.perf_counter()
        alloc.free_request(pool, r)
        pool.free(r)
        return time.perf_counter() - t0

    for r in rows[-4:]:
        alloc.free_request(pool, r)
    pool.free(rows[-4:])
    out["free"] = statistics.median(finish_one() for _ in range(iters)) * 1e6
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="host cost of a decode step's KV bookkeeping (CPU)")
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = measure(args.bs, args.iters)
    print(f"decode step of {args.bs} requests (CPU, median of {args.iters}): "
          f"alloc_for_request x{args.bs} {r['alloc']:.0f} us ({r['alloc'] / args.bs:.1f} us each), "
          f"ForwardBatch.decode {r['batch']:.0f} us, row/seq_lens ownership check {r['rows']:.0f} us, "
          f"out_cache_loc check {r['slots']:.0f} us (GPU: debug_checks only), "
          f"free_request + free {r['free']:.0f} us per finished request")


if __name__ == "__main__":
    main()
