"""FA3's absorbed decode per layer with its tile schedule planned per call vs once per step, side by side.

``python -m mla_fa3.bench.fa3_schedule``. FA3 launches a scheduler kernel
(per-request split counts from the live lengths) in front of every ``flash_attn_with_kvcache`` call unless it
is handed that schedule (``ops.get_fa3_schedule``, which the backend plans once per step at <= 8 requests).
Per shape (heads H, batch bs, context L, page 64, equal lengths, DeepSeek-V3 latent 512 + 64, bf16, one query
token, varlen q as the backend passes it), the same R layer copies of the cache run in one CUDA graph:

    per_call   ops.flash_attn_with_kvcache(q_rope, k_rope, c_kv, qv=q_lat) in every layer (FA3 plans each call)
    per_step   the same calls with one schedule planned outside the graph (``schedule=``)
    plan       ops.get_fa3_schedule alone, in its own graph (what a step adds once, for all its layers)
    splits N   (``--splits``) per_step with ``num_splits=N`` asked of FA3 (planned with the same N)

Before timing, each shape's per-step output must equal the per-call output bit for bit (same kernels, same
splits), else the bench exits 1. Times are per layer copy (median of replays, ``timing.time_per_call``); R copies
exceed 3x the 50 MiB L2 (``timing.rotating_inputs``). Without CUDA it runs the torch reference on the CPU at
small shapes (the equality check and the table, not a measurement). Output: the markdown table; with ``--out
DIR`` ``fa3_schedule.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from mla_fa3 import ops
from mla_fa3.bench.decode import _ints
from mla_fa3.bench.timing import Progress, rotating_inputs, time_per_call

R, D_ROPE, PAGE = 512, 64, 64
SCALE = (128 + D_ROPE) ** -0.5
FULL = dict(heads=(16, 128), batch=(1, 2, 4, 8, 16, 64), context=(16384, 65536))


@dataclass
class Row:
    heads: int
    batch: int
    context: int
    copies: int
    per_call_us: float
    per_step_us: float
    plan_us: float
    splits_us: dict = field(default_factory=dict)  # num_splits -> per-layer µs (per_step with that split count)

    @property
    def saved_us(self) -> float:
        return self.per_call_us - self.per_step_us


def measure(heads: int, bs: int, ctx: int, *, device, splits: Sequence[int], iters: int, gen: torch.Generator) -> Row:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    pages = -(-ctx // PAGE)  # scattered pages (a random permutation); page 0 is padding
    table = (torch.randperm(bs * pages, generator=gen) + 1).view(bs, pages).to(device, torch.int32)
    make = lambda i: torch.randn(bs * pages + 1, PAGE, 1, R + D_ROPE, device=device, dtype=dtype)  # noqa: E731
    kvs = rotating_inputs(make, bs * ctx * (R + D_ROPE) * 2) if cuda else [make(0)]
    lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=device)
    q = torch.randn(bs, heads, D_ROPE, generator=gen).to(device, dtype)
    qv = torch.randn(bs, heads, R, generator=gen).to(device, dtype)

    def plan(n: int = 0) -> ops.FA3Schedule:
        return ops.get_fa3_schedule(lens, table, page_size=PAGE, num_heads=heads, num_heads_k=1, head_dim=D_ROPE,
                                    head_dim_v=R, dtype=dtype, max_seqlen_q=1, cu_seqlens_q=cu, num_splits=n)

    def layers(schedule: Optional[ops.FA3Schedule], n: int = 0):
        return [ops.flash_attn_with_kvcache(q, kv[..., R:], kv[..., :R], qv=qv, page_table=table, cache_seqlens=lens,
                                            cu_seqlens_q=cu, max_seqlen_q=1, softmax_scale=SCALE, causal=True,
                                            num_splits=n, schedule=schedule) for kv in kvs]

    schedules = {n: plan(n) for n in (0, *splits)}
    if not all(torch.equal(a, b) for a, b in zip(layers(None), layers(schedules[0]))):
        raise RuntimeError(f"H {heads} bs {bs} ctx {ctx}: FA3 with a planned schedule differs from FA3 per call")
    def t(fn, calls=len(kvs)):  # µs per call of a fn making ``calls`` calls (a layer copy each; the planner once)
        return time_per_call(fn, calls, warmup=3, iters=iters) * 1e3

    row = Row(heads, bs, ctx, len(kvs), t(lambda: layers(None)), t(lambda: layers(schedules[0])), t(plan, 1))
    row.splits_us = {n: t(lambda n=n: layers(schedules[n], n)) for n in splits}
    return row


def markdown(rows: Sequence[Row]) -> str:
    splits = sorted({n for r in rows for n in r.splits_us})
    head = ["heads", "bs", "context", "copies", "per call µs", "per step µs", "saved µs / layer", "plan µs / step",
            *(f"splits {n}" for n in splits)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [r.heads, r.batch, r.context, r.copies, f"{r.per_call_us:.2f}", f"{r.per_step_us:.2f}",
                 f"{r.saved_us:+.2f}", f"{r.plan_us:.2f}", *(f"{r.splits_us[n]:.2f}" if n in r.splits_us else "—"
                                                             for n in splits)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.fa3_schedule", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=_ints, default=FULL["heads"])
    p.add_argument("--batch", type=_ints, default=FULL["batch"])
    p.add_argument("--context", type=_ints, default=FULL["context"])
    p.add_argument("--splits", type=_ints, default=(), help="num_splits values to time too (e.g. 32,48,64)")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--out", help="directory for fa3_schedule.csv / .md")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("fa3_schedule bench: no CUDA — the torch reference on the CPU (the checks, not a measurement)",
              file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    shapes = [(h, b, c) for b in a.batch for c in a.context for h in a.heads]
    rows = []
    try:
        with Progress(len(shapes), quiet=a.quiet) as prog:
            for h, b, c in shapes:
                rows.append(measure(h, b, c, device=device, splits=a.splits, iters=a.iters, gen=gen))
                prog.step(f"H {h} bs {b} ctx {c}: per call {rows[-1].per_call_us:.1f} us, per step "
                          f"{rows[-1].per_step_us:.1f} us")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    except RuntimeError as exc:
        print(f"fa3_schedule bench: {exc}", file=sys.stderr)
        return 1
    table = markdown(rows)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fa3_schedule.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*(k for k in asdict(rows[0]) if k != "splits_us"), "saved_us", "splits_us"])
            w.writeheader()
            for r in rows:
                d = asdict(r)
                d["splits_us"] = ";".join(f"{n}:{v:.3f}" for n, v in r.splits_us.items())
                w.writerow({**d, "saved_us": round(r.saved_us, 3)})
        with open(os.path.join(a.out, "fa3_schedule.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
