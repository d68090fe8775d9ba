"""FP8 latent cache benchmark: the whole backend decode step per layer, FP8 pool vs bf16 pool, on the H200.

``python -m mla_fa3.bench.fp8`` (or ``mla-fa3 bench fp8``). Shapes: heads H x batch bs x context L
(equal lengths, page 64, DeepSeek-V3 latent dims, one query token per request, bf16 compute). Per shape
the decode benchmark's ``backend`` measurement (``bench.decode.BackendBench``: ``MLABackend.forward``
of one layer — latent store, q absorption, kernel, W_UV projection — replayed from a CUDA graph by
``GraphRunner``, plus the step's replay update / 61 layers) runs twice over the same page layout:

* ``bf16``: a bf16 latent pool, the backend's own kernel choice (``decode_kernel=auto``);
* ``fp8``: an e4m3 pool (``MLATokenPool(kv_dtype=torch.float8_e4m3fn)``): store quantized
  (``ops.store_e4m3``: one fused Triton launch), q quantized per step on the device
  (``ops.quantize_query_e4m3``: two Triton launches), FlashMLA's FP8 decode (``decode_kernel='flashmla'``);
* ``fp8_splitkv``: the same e4m3 pool read by the split-KV kernel with the bf16 q (``decode_kernel='splitkv'``:
  the cache tile converted in registers, no query quantization);
* ``fp8_auto``: what the backend's own choice costs on that pool (``policy.fp8_decode``), when ``--auto``.

Columns: per-layer microseconds of each (CSV ``bf16_us``, ``fp8_us`` = FlashMLA FP8, ``fp8_splitkv_us``,
``fp8_auto_us``), ``speedup`` = bf16 / the faster FP8 path (before split-KV was timed it was bf16 / FlashMLA
FP8; the markdown gives both ratios), and the pool's capacity: tokens per
GB of latent pool per layer (bf16: 1e9 / 1152, fp8: 1e9 / 576) and for the 61 layers of DeepSeek-V3.
Each pool cycles through enough layer copies to stream > 3x the L2 per replay (so the FP8 pool, half
the bytes, cycles twice as many). Outputs: the markdown table on stdout; with ``--out DIR``
``fp8.csv`` and ``fp8.md``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from mla_fa3.bench.decode import SMOKE_MAX_ITERS, DIMS, BackendBench, Cell, Config, _ints, rotations
from mla_fa3.bench.smoke import SMOKE_LABEL, add_device_argument, refused, start_smoke
from mla_fa3.bench.timing import Progress
from mla_fa3.ops.fp8 import FP8_DTYPE
from mla_fa3.kv.pools import MLATokenPool

FULL = dict(heads=(16, 128), batch=(1, 4, 16, 64), context=(4096, 16384, 32768, 65536))
QUICK = dict(heads=(16, 128), batch=(1, 64), context=(16384, 65536))
SMOKE = dict(heads=(16, 128), batch=(1, 4), context=(256, 2048))  # --device cpu (bench.smoke), in place of FULL / QUICK
PROG = "mla-fa3 bench fp8"
PAGE = 64


@dataclass
class Row:
    heads: int
    batch: int
    context: int
    bf16_us: float
    fp8_us: float
    bf16_kernel: str
    fp8_kernel: str
    fp8_splitkv_us: float | None = None
    fp8_auto_us: float | None = None
    fp8_auto_kernel: str = ""

    @property
    def speedup(self) -> float:
        """bf16 step / the faster of the two FP8 steps."""
        return self.bf16_us / min(t for t in (self.fp8_us, self.fp8_splitkv_us) if t is not None)


def tokens_per_gb(kv_dtype: torch.dtype, layers: int = 1) -> float:
    """Latent rows (r + d_rope wide) that one GB of pool holds across ``layers`` layers."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 1e9 / (DIMS.latent_dim * elem * layers)


def fp8_cell(cell: Cell) -> Cell:
    """The same page layout with an e4m3 pool (random rows), rotated for its own (half) size."""
    twin = copy.copy(cell)
    dev = cell.device
    twin.rotate = rotations(cell.bs * cell.ctx * DIMS.latent_dim) if dev.type == "cuda" else 1
    num_pages = cell.pool.num_pages
    twin.pool = MLATokenPool(twin.rotate, num_pages, PAGE, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim, torch.bfloat16,
                             dev, kv_dtype=FP8_DTYPE)
    twin.pool.set_scales([1.0 / 32] * twin.rotate)
    for buf in twin.pool.kv_buffer:
        for s in range(0, buf.shape[0], 1 << 20):  # bounded temporaries
            buf[s: s + (1 << 20)] = (torch.randn(buf[s: s + (1 << 20)].shape, device=dev) * 32).to(FP8_DTYPE)
    return twin


def sweep(cfg: Config, cfg_auto: bool = False) -> list[Row]:
    dev = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    shapes = [(bs, ctx) for bs in cfg.batch for ctx in cfg.context]
    with Progress(len(shapes) * len(cfg.heads), quiet=cfg.quiet) as prog:
        for bs, ctx in shapes:
            cell = Cell(PAGE, bs, ctx, dev, gen)
            cell8 = fp8_cell(cell)
            lens = [ctx] * bs
            for heads in cfg.heads:
                est = bs * ctx * DIMS.latent_dim * 2 / 4.0e9  # ms at ~4 TB/s
                times = {}
                runs = [("bf16", cell, "auto"), ("fp8", cell8, "flashmla"), ("fp8_splitkv", cell8, "splitkv")]
                runs += [("fp8_auto", cell8, "auto")] if cfg_auto else []
                for name, c, kernel_setting in runs:
                    bench = BackendBench(cfg, c, heads, gen, decode_kernel=kernel_setting)
                    try:
                        ms, _, kernel = bench.measure(lens, est)
                    finally:
                        bench.close()
                    times[name] = (1e3 * ms, kernel)
                auto = times.get("fp8_auto", (None, ""))
                rows.append(Row(heads, bs, ctx, times["bf16"][0], times["fp8"][0], times["bf16"][1], times["fp8"][1],
                                times["fp8_splitkv"][0], auto[0], auto[1]))
                prog.step(f"H {heads} bs {bs} ctx {ctx}: bf16 {times['bf16'][0]:.1f} us, fp8 flashmla "
                          f"{times['fp8'][0]:.1f} us, fp8 split-KV {times['fp8_splitkv'][0]:.1f} us")
            del cell, cell8
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| heads | bs | context | bf16 pool (us) | kernel | fp8 FlashMLA (us) | fp8 split-KV (us) | bf16 / FlashMLA "
             "| bf16 / split-KV | fp8 auto (us, kernel) |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        skv = r.fp8_splitkv_us
        auto = f"{r.fp8_auto_us:.1f} {r.fp8_auto_kernel}" if r.fp8_auto_us is not None else "-"
        lines.append(f"| {r.heads} | {r.batch} | {r.context} | {r.bf16_us:.1f} | {r.bf16_kernel} | {r.fp8_us:.1f} | "
                     f"{skv:.1f} | {r.bf16_us / r.fp8_us:.2f}x | {r.bf16_us / skv:.2f}x | {auto} |")
    b, f = tokens_per_gb(torch.bfloat16), tokens_per_gb(FP8_DTYPE)
    lines.append("")
    lines.append(f"Pool capacity: bf16 {b:,.0f} tokens per GB per layer ({tokens_per_gb(torch.bfloat16, 61):,.0f} "
                 f"for 61 layers); fp8 {f:,.0f} ({tokens_per_gb(FP8_DTYPE, 61):,.0f} for 61 layers): {f / b:.1f}x.")
    return "\n".join(lines)


def parse_args(argv) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=_ints)
    p.add_argument("--batch", type=_ints)
    p.add_argument("--context", type=_ints)
    p.add_argument("--quick", action="store_true", help="H 16,128 x bs 1,64 x ctx 16k,64k (on cpu: the smoke shapes)")
    p.add_argument("--out", help="directory for fp8.csv and fp8.md")
    p.add_argument("--budget-ms", type=float, default=120.0)
    p.add_argument("--max-iters", type=int, default=None,
                   help=f"timed calls per measurement, at most (default: 100; {SMOKE_MAX_ITERS} on cpu)")
    add_device_argument(p)
    p.add_argument("--impl", default="auto", choices=["auto", "fa3", "reference"])
    p.add_argument("--auto", action="store_true", help="also time the FP8 pool with decode_kernel='auto'")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    base = SMOKE if cpu else QUICK if a.quick else FULL
    cfg = Config(heads=a.heads or base["heads"], batch=a.batch or base["batch"], context=a.context or base["context"],
                 page=(PAGE,), lengths=("equal",), device=a.device, impl=a.impl, budget_ms=a.budget_ms,
                 max_iters=a.max_iters or (SMOKE_MAX_ITERS if cpu else 100), quiet=a.quiet)
    return cfg, a


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if refused(PROG, cfg.device):
        return 2
    smoke = start_smoke(cfg.device)
    rows = sweep(cfg, args.auto)
    table = markdown(rows)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), "speedup"] if rows else ["heads"])
            w.writeheader()
            for r in rows:
                w.writerow({**asdict(r), "speedup": round(r.speedup, 4)})
        card = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else cfg.device
        with open(os.path.join(args.out, "fp8.md"), "w") as f:  # the card that measured it, never assumed
            f.write(f"# FP8 vs bf16 latent pool: backend decode step per layer ({card})\n\n"
                    + (SMOKE_LABEL + "\n\n" if smoke else "") + table + "\n")
        print(f"wrote {args.out}/fp8.csv, {args.out}/fp8.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
