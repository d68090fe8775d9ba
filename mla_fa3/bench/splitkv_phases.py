"""Where the split-KV decode kernel's time goes: its two phases apart, an empty launch, and a plain streaming read.

``python -m mla_fa3.bench.splitkv_phases --out DIR`` on the H200. Per shape (heads H, batch bs, context L, page 64,
bf16 or ``--fp8`` e4m3 cache, DeepSeek-V3 latent 512 + rope 64, one query token, equal lengths, the table's config),
each timed alone from CUDA-graph replays over disjoint copies of the cache, at least 16 calls per replay (as
``bench.splitkv``):

    both          ops.splitkv_mla_with_kvcache's two launches (phase 1, then the combine)
    phase1        phase 1 alone (``splitkv_triton.splitkv_partials``): the key loop and the partial stores
    combine       the combine alone (``combine_splits``) over this schedule's partials, resident in L2 as they are
                  right after phase 1
    empty         phase 1 over the same grid with ``num_work`` = 0: every program exits at once (launch and drain)
    stream        torch.amax over the same bytes of cache (a plain streaming read: what this card's memory gives a
                  simple kernel)
    roofline      bench.roofline's bound (bytes at 4.3 TB/s, FLOPs at 790 TFLOP/s)

Derived: ``phase1 - stream`` (phase 1's cost beyond streaming the bytes), ``both - phase1`` (what the combine adds
after phase 1, its launch overlapped by the programmatic dependent launch). Outputs: the markdown table on stdout;
with ``--out DIR``: ``splitkv_phases.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from mla_fa3 import ops
from mla_fa3.bench import roofline
from mla_fa3.bench.splitkv import D, PAGE, R, SCALE, Shape
from mla_fa3.bench.timing import h200_ceilings, replay_repeats, time_graph
from mla_fa3.ops import validate

DEFAULT_SHAPES = dict(heads=(16,), batch=(1,), context=(4096, 8192, 16384, 32768, 65536, 131072))


@dataclass
class PhaseRow:
    heads: int
    batch: int
    context: int
    variant: str
    splits: int
    both_us: float
    phase1_us: float
    combine_us: float
    empty_us: float
    stream_us: float
    roofline_us: float

    @property
    def phase1_over_stream_us(self) -> float:
        return self.phase1_us - self.stream_us

    @property
    def combine_added_us(self) -> float:
        return self.both_us - self.phase1_us


def measure(shape: Shape, heads: int, iters: int) -> PhaseRow:
    """Time the phases of one shape (the table's config); ``shape``'s copies rotate through L2 as in bench.splitkv."""
    from mla_fa3.ops import splitkv_triton as kt
    from mla_fa3.ops.splitkv_combine_triton import combine_splits

    q = shape.queries(heads)
    n = len(shape.copies)
    sched = ops.get_splitkv_schedule([shape.ctx] * shape.bs, num_heads=heads, page_size=PAGE, device=shape.device,
                                     kv_fp8=shape.fp8)
    calls = [validate.check_splitkv(q, kv, table, shape.seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                    causal=True, descale_q=None, descale_k=shape.descale_k, impl=ops.Impl.TRITON)
             for kv, table in shape.copies]
    empty = copy.copy(sched)
    empty.num_work = torch.zeros_like(sched.num_work)
    part_o, part_lse2 = kt.splitkv_partials(calls[0], sched)
    out = torch.empty(shape.bs, 1, heads, R, dtype=calls[0].out_dtype, device=shape.device)
    lse = torch.empty(shape.bs, 1, heads, dtype=torch.float32, device=shape.device)
    pdl = sched.config.pdl and kt._pdl_capable(shape.device)
    descale = calls[0].descale_k if shape.fp8 else None
    # the cache bytes the kernel reads, one flat view per copy (page 0 is the pool's unused padding page; an e4m3
    # cache read as bytes: amax has no e4m3 kernel)
    flat = [kv[1:].view(-1)[: shape.bs * shape.ctx * D] for kv, _ in shape.copies]
    flat = [v.view(torch.uint8) if shape.fp8 else v for v in flat]
    sink = torch.empty(n, dtype=flat[0].dtype, device=shape.device)

    def stream():
        for i, v in enumerate(flat):
            torch.amax(v, dim=0, out=sink[i])

    def per_copy(fn) -> float:
        return 1e3 * time_graph(fn, warmup=max(3, iters // 10), iters=iters, calls_per_graph=replay_repeats(n)) / n

    ceil = h200_ceilings()
    tokens = shape.bs * shape.ctx
    roof = 1e3 * ceil.time_ms(roofline.decode_bytes(tokens) // (2 if shape.fp8 else 1),
                              roofline.decode_flops(heads, tokens))
    return PhaseRow(
        heads, shape.bs, shape.ctx, sched.config.label(), sched.planned_work,
        both_us=per_copy(lambda: [kt.splitkv_mla_with_kvcache(c, sched) for c in calls]),
        phase1_us=per_copy(lambda: [kt.splitkv_partials(c, sched) for c in calls]),
        combine_us=per_copy(lambda: [combine_splits(part_o, part_lse2, sched.split_offsets, out, lse, descale, pdl=pdl)
                                     for _ in calls]),
        empty_us=per_copy(lambda: [kt.splitkv_partials(c, empty) for c in calls]),
        stream_us=per_copy(stream),
        roofline_us=roof,
    )


def markdown(rows: Sequence[PhaseRow]) -> str:
    head = ("| H | bs | ctx | variant | splits | both µs | phase 1 µs | combine µs | empty µs | stream µs | roofline µs "
            "| phase 1 - stream | both - phase 1 |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r.heads} | {r.batch} | {r.context // 1024}k | {r.variant} | {r.splits} | {r.both_us:.1f} | "
        f"{r.phase1_us:.1f} | {r.combine_us:.1f} | {r.empty_us:.1f} | {r.stream_us:.1f} | {r.roofline_us:.1f} | "
        f"{r.phase1_over_stream_us:.1f} | {r.combine_added_us:.1f} |\n" for r in rows)


def write(rows: Sequence[PhaseRow], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "splitkv_phases.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(asdict(rows[0])) + ["phase1_over_stream_us", "combine_added_us"])
        w.writeheader()
        w.writerows(dict(asdict(r), phase1_over_stream_us=r.phase1_over_stream_us,
                         combine_added_us=r.combine_added_us) for r in rows)
    with open(os.path.join(out_dir, "splitkv_phases.md"), "w") as fh:
        fh.write(markdown(rows))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=DEFAULT_SHAPES["heads"])
    p.add_argument("--batch", type=int, nargs="+", default=DEFAULT_SHAPES["batch"])
    p.add_argument("--context", type=int, nargs="+", default=DEFAULT_SHAPES["context"])
    p.add_argument("--fp8", action="store_true", help="an e4m3 cache (split-KV reads it with the bf16 q)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", help="directory for splitkv_phases.csv / .md")
    a = p.parse_args(argv)
    if min(a.heads + a.batch + a.context) < 1 or a.iters < 1:
        p.error("heads, batch, context and iters must be >= 1")
    if not torch.cuda.is_available():
        print("splitkv_phases bench: needs a CUDA GPU (the Triton kernels run only there)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for bs in a.batch:
        for ctx in a.context:
            shape = Shape(bs, ctx, device, a.fp8)
            for h in a.heads:
                rows.append(measure(shape, h, a.iters))
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
            del shape
            torch.cuda.empty_cache()
    print(markdown(rows))
    if a.out:
        write(rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
