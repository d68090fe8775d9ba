"""Host time of the chunked MHA prefill, on any machine: per step (planning) and per layer-chunk (forward).

What it measures: the Python, validation and tensor-op dispatch the host spends, with the two kernels
whose bodies dominate on a CPU replaced by null kernels that hand back preallocated outputs (the FA3
varlen attention and the LSE merge of ``ops.reference``: on the GPU each is one asynchronous launch).
Every other op (gather, decompression GEMM, rope copy, slicing) runs for real on tiny tensors, so its
cost is dispatch, like a launch. Shapes: ``H`` heads (16 by default) of tiny MLA dims, one request of
``new`` tokens over ``chunks`` chunks of ``W`` prefix tokens each (page 16) — compute is negligible.

Reported (median of ``--iters`` runs, microseconds):

* ``plan_us``            — ``build_prefill_plan`` of the step (once, shared by all layers); also for a
                           batch of ``--requests`` requests with random prefixes (chunk borders mid-page);
* ``layer_us``           — one layer's ``forward_mha_prefill`` (new tokens + every chunk + merges);
* ``per_chunk_us``       — the marginal host time of one more chunk in one layer:
                           (layer_us(chunks) - layer_us(1 chunk)) / (chunks - 1); printed twice: with the
                           tiny decompression GEMM computed (a slow strided path on a CPU) and with it
                           replaced by one dispatch (``null_kernels(null_gemm=True)``: what a GPU launch costs
                           the host, roughly).

Usage: ``python -m mla_fa3.bench.prefill_host [--heads 16] [--chunks 16] [--iters 200]``. CPU only,
a few seconds. Host times on the H200's host differ from this machine's; the ratio before/after holds.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from typing import Sequence

import torch

from mla_fa3.batch import ForwardBatch
from mla_fa3.bench.timing import median_host_us
from mla_fa3.chunked_prefix import forward_mha_prefill
from mla_fa3.prefill_plan import build_prefill_plan
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.ops import reference

TINY = MLADims(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
PAGE = 16


@contextlib.contextmanager
def null_kernels(null_gemm: bool = False):
    """Replace the reference varlen attention and LSE merge by kernels that only return their outputs;
    ``null_gemm``: also the decompression GEMM (``torch.bmm``) by one cheap op on its output (its dispatch,
    like a launch): on a CPU, the strided batched GEMM of the workspace layout is a slow compute path
    (~47 µs for the tiny shapes here) that the GPU runs as one cuBLAS launch."""
    cache: dict = {}

    def varlen(call):
        key = ("v", call.q.shape, call.v.shape[2])
        if key not in cache:
            out = torch.zeros(call.q.shape[0], call.q.shape[1], call.v.shape[2], dtype=call.out_dtype)
            cache[key] = (out, torch.zeros(call.q.shape[:2], dtype=torch.float32))
        return cache[key]

    def merge(o_a, lse_a, o_b, lse_b):
        return o_a, lse_a

    old = reference.flash_attn_varlen_func, reference.merge_state, torch.bmm
    reference.flash_attn_varlen_func, reference.merge_state = varlen, merge
    if null_gemm:
        real_bmm = torch.bmm
        torch.bmm = lambda a, b, *, out=None: out.zero_() if out is not None else real_bmm(a, b)
    try:
        yield
    finally:
        reference.flash_attn_varlen_func, reference.merge_state, torch.bmm = old


def _step(prefix: Sequence[int], new: Sequence[int], H: int, seed: int = 0):
    """A pool, request table, metadata, layer and inputs for one extend step over ``prefix`` / ``new``."""
    g = torch.Generator().manual_seed(seed)
    seqs = [p + n for p, n in zip(prefix, new)]
    pages = [-(-s // PAGE) for s in seqs]
    pool = MLATokenPool(1, 1 + sum(pages), PAGE, TINY.kv_lora_rank, TINY.qk_rope_head_dim, torch.float32, "cpu")
    pool.kv_buffer[0].normal_(generator=g)
    r2t = ReqToTokenPool(len(seqs) + 1, max(seqs) + PAGE, "cpu")
    perm = (torch.randperm(sum(pages), generator=g) + 1).tolist()
    out_loc, first = [], 0
    for b, s in enumerate(seqs):
        mine = torch.tensor(perm[first: first + pages[b]])
        first += pages[b]
        j = torch.arange(s)
        slots = mine[j // PAGE] * PAGE + j % PAGE
        r2t.req_to_token[b + 1, :s] = slots.to(torch.int32)
        out_loc.append(slots[prefix[b]:])
    r2t.claim(list(range(1, len(seqs) + 1)), seqs)  # the table was written by hand: hold its rows
    batch = ForwardBatch.extend(list(range(1, len(seqs) + 1)), list(prefix), list(new), torch.cat(out_loc), "cpu")
    md = MetadataBuilder(r2t, PAGE, "cpu").build(batch)
    w = torch.randn(H * (TINY.qk_nope_head_dim + TINY.v_head_dim), TINY.kv_lora_rank, generator=g)
    layer = AttentionLayer.mla_layer(0, H, TINY, TINY.qk_head_dim ** -0.5, kv_b_proj_weight=w)
    q = torch.randn(sum(new), H, TINY.qk_head_dim, generator=g)
    return pool, r2t, batch, md, layer, q


def measure(H: int, chunks: int, W: int, new: int, requests: int, iters: int, *,
            null_gemm: bool = False) -> dict[str, float]:
    """The host times of one configuration (see the module docstring)."""
    out = {}
    with null_kernels(null_gemm):
        for c in (1, chunks):
            pool, r2t, batch, md, layer, q = _step([c * W], [new], H)
            plan = build_prefill_plan(md, r2t.req_to_token, batch.req_pool_indices, W, PAGE)
            latent = pool.kv_buffer[0][batch.out_cache_loc]
            kv = pool.paged(0)
            out[f"layer_us_{c}"] = median_host_us(
                lambda: forward_mha_prefill(q, latent, layer, md, kv, plan, impl="reference"), iters, warmup=1)
            out[f"plan_us_{c}"] = median_host_us(
                lambda: build_prefill_plan(md, r2t.req_to_token, batch.req_pool_indices, W, PAGE), iters, warmup=1)
        rnd = random.Random(0)
        prefix = [rnd.choice([0, rnd.randint(1, 3 * W)]) for _ in range(requests)]
        extend = [rnd.randint(2, 40) for _ in range(requests)]
        pool, r2t, batch, md, layer, q = _step(prefix, extend, H)
        out["plan_us_batch"] = median_host_us(
            lambda: build_prefill_plan(md, r2t.req_to_token, batch.req_pool_indices, W, PAGE), iters, warmup=1)
        out["batch_chunks"] = float(-(-sum(prefix) // W))
    out["per_chunk_us"] = (out[f"layer_us_{chunks}"] - out["layer_us_1"]) / max(chunks - 1, 1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.prefill_host", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--chunks", type=int, default=16, help="prefix chunks of the long request (>= 2)")
    p.add_argument("--workspace", type=int, default=64, help="prefix tokens per chunk (tiny: compute stays negligible)")
    p.add_argument("--new", type=int, default=64, help="new tokens of the long request")
    p.add_argument("--requests", type=int, default=64, help="requests of the random batch planned")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    if args.chunks < 2:
        p.error("--chunks must be >= 2")
    torch.set_num_threads(1)
    r = measure(args.heads, args.chunks, args.workspace, args.new, args.requests, args.iters)
    g = measure(args.heads, args.chunks, args.workspace, args.new, 1, args.iters, null_gemm=True)
    print(f"heads {args.heads}, W {args.workspace} tokens/chunk, page {PAGE}, tiny dims, null attention/merge kernels")
    print(f"plan (1 request, {args.chunks} chunks): {r[f'plan_us_{args.chunks}']:.1f} us")
    print(f"plan ({args.requests} requests, {r['batch_chunks']:.0f} chunks): {r['plan_us_batch']:.1f} us")
    print(f"forward, one layer, 1 chunk: {r['layer_us_1']:.1f} us; {args.chunks} chunks: "
          f"{r[f'layer_us_{args.chunks}']:.1f} us")
    print(f"host per layer-chunk: {r['per_chunk_us']:.1f} us (the tiny decompression GEMM computed on this CPU); "
          f"{g['per_chunk_us']:.1f} us with the GEMM as one dispatch, as on a GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
