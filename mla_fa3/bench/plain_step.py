"""The backend's decode step against the same work written plainly, per layer, side by side in one process (H200).

``python -m mla_fa3.bench.plain_step``. Per shape (heads H, batch bs, context L,
page 64, equal lengths, DeepSeek-V3 latent dims, bf16, one query token per request):

* ``backend``: ``bench.decode.BackendBench`` — ``MLABackend.forward`` of one layer replayed from a CUDA graph by
  ``GraphRunner`` (latent store, q absorption, the kernel the backend chooses, W_UV projection), plus the step's
  replay update and in-graph prologue divided over 61 layers;
* ``plain``: the unfused step of issue [splitkv] written the plain way and captured in a CUDA graph —
  ``kv[out_cache_loc] = latent``; ``q_lat = bmm(q_nope, W_UK)``; FA3 ``flash_attn_with_kvcache(q_rope, k_rope,
  c_kv, qv=q_lat)`` on a static page table; ``bmm(o_lat, W_UV)`` — no metadata, no checks.

Both cycle over the same rotated layer copies (> 3x the L2 per replay), at least 16 layers per replay
(``timing.MIN_CALLS_PER_REPLAY``). Output: the markdown table (``--out
DIR``: ``plain_step.csv`` / ``.md``); ``backend / plain`` > 1 is the backend's own overhead.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from mla_fa3 import ops
from mla_fa3.bench.decode import DIMS, BackendBench, Cell, Config, _ints
from mla_fa3.bench.smoke import refused
from mla_fa3.bench.timing import Progress, time_per_call
from mla_fa3.layer import MLAWeights

PAGE = 64
DEFAULT = dict(heads=(16, 128), batch=(1, 2, 4), context=(16384, 65536))


@dataclass
class Row:
    heads: int
    batch: int
    context: int
    backend_us: float
    backend_kernel: str
    plain_us: float

    @property
    def ratio(self) -> float:
        return self.backend_us / self.plain_us


def plain_step_fn(cell: Cell, heads: int, gen: torch.Generator, impl: str = "fa3"):
    """A capturable fn running the plain unfused step over every rotated layer copy of ``cell``."""
    dev, bs, r = cell.device, cell.bs, DIMS.kv_lora_rank
    lens = torch.full((bs,), cell.ctx, dtype=torch.int32, device=dev)
    loc = cell.req_pool.req_to_token[torch.arange(bs, device=dev), cell.ctx - 1].long()
    q = torch.randn(bs, heads, DIMS.qk_head_dim, device=dev).to(torch.bfloat16)
    latent = torch.randn(bs, DIMS.latent_dim, device=dev).to(torch.bfloat16)
    rows = heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim)
    weights = [MLAWeights.from_kv_b_proj((torch.randn(rows, r, generator=gen) / math.sqrt(r)).to(dev, torch.bfloat16),
                                         DIMS) for _ in range(cell.rotate)]
    scale = DIMS.qk_head_dim ** -0.5
    q_nope, q_rope = q.split([DIMS.qk_nope_head_dim, DIMS.qk_rope_head_dim], dim=-1)

    def fn():
        outs = []
        for layer, w in enumerate(weights):
            buf = cell.pool.kv_buffer[layer]
            buf[loc] = latent
            kv = buf.view(-1, PAGE, 1, DIMS.latent_dim)
            q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)
            o_lat = ops.flash_attn_with_kvcache(q_rope.unsqueeze(1), kv[..., r:], kv[..., :r], qv=q_lat.unsqueeze(1),
                                                page_table=cell.page_table, cache_seqlens=lens, softmax_scale=scale,
                                                causal=True, impl=impl)[:, 0]
            outs.append(torch.bmm(o_lat.transpose(0, 1), w.w_uv).transpose(0, 1))
        return outs

    fn.inputs = (q, latent, weights, scale)  # for a test's oracle
    return fn


def sweep(cfg: Config) -> list[Row]:
    dev = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    shapes = [(bs, ctx) for bs in cfg.batch for ctx in cfg.context]
    with Progress(len(shapes) * len(cfg.heads), quiet=cfg.quiet) as prog:
        for bs, ctx in shapes:
            cell = Cell(PAGE, bs, ctx, dev, gen)
            for heads in cfg.heads:
                bench = BackendBench(cfg, cell, heads, gen)
                try:
                    ms, _, kernel = bench.measure([ctx] * bs, bs * ctx * DIMS.latent_dim * 2 / 4.0e9)
                finally:
                    bench.close()
                fn = plain_step_fn(cell, heads, gen, "fa3" if dev.type == "cuda" else "reference")
                plain_ms = time_per_call(fn, cell.rotate, warmup=5 if dev.type == "cuda" else 1, iters=cfg.max_iters)
                rows.append(Row(heads, bs, ctx, 1e3 * ms, kernel, 1e3 * plain_ms))
                prog.step(f"H {heads} bs {bs} ctx {ctx}: backend {1e3 * ms:.1f} us ({kernel}), plain {1e3 * plain_ms:.1f} us")
            del cell
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| heads | bs | context | backend µs (kernel) | plain unfused µs | backend / plain |",
             "|---:|---:|---:|---|---:|---:|"]
    lines += [f"| {r.heads} | {r.batch} | {r.context} | {r.backend_us:.1f} ({r.backend_kernel}) | {r.plain_us:.1f} | "
              f"{r.ratio:.2f}x |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.plain_step", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=_ints)
    p.add_argument("--batch", type=_ints)
    p.add_argument("--context", type=_ints)
    p.add_argument("--out", help="directory for plain_step.csv and plain_step.md")
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if refused(p.prog, cpu_smoke=False):
        return 2
    cfg = Config(heads=a.heads or DEFAULT["heads"], batch=a.batch or DEFAULT["batch"],
                 context=a.context or DEFAULT["context"], page=(PAGE,), lengths=("equal",), device="cuda",
                 impl="auto", max_iters=a.max_iters, quiet=a.quiet)
    rows = sweep(cfg)
    table = markdown(rows)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "plain_step.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), "ratio"])
            w.writeheader()
            w.writerows({**asdict(r), "ratio": round(r.ratio, 4)} for r in rows)
        with open(os.path.join(a.out, "plain_step.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
