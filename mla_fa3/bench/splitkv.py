"""Split-KV Triton MLA decode vs FA3 (qv) vs FlashMLA vs the roofline: kernels alone, CUDA-graph replay.

``python -m mla_fa3.bench.splitkv --out DIR`` on the H200 (``--quick``: four shapes; ``--sweep``: the
candidate configs of each head class on the sweep shapes, then the best of each shape against the peers,
and the ``CONFIG_TABLE`` of ``ops/splitkv_config.py`` to paste). Per shape (heads H, batch bs, context L, page 64,
bf16, DeepSeek-V3 latent r = 512 + d_rope = 64, one query token, equal lengths):

    splitkv   ops.splitkv_mla_with_kvcache's kernels (schedule planned once, outside the graph), with the
              config the table picks for the shape (``splitkv_config.choose_config``) unless overridden
    fa3       ops.flash_attn_with_kvcache(q_rope, k_rope view, c_kv view, qv = q_lat)
    flashmla  ops.flash_mla_with_kvcache (tile schedule planned once, outside the graph)
    roofline  max(bs·L·576·2 B / 4.3 TB/s, 2·bs·H·L·(576 + 512) FLOP / 790 TFLOP/s)   (bench.roofline)

``--ab FIELD[=V1,V2,...]``: every shape once per value of a ``KernelConfig`` field on the table's config, side by side
(``pdl``: programmatic dependent launch, ``half_partials``, ``reload_kv``: on and off; ``latent_chunks``: 1, 2, 4;
``waves``: 1, 2, 3 programs per SM, which sets the split count; ``num_stages``: 2, 3, 4; the rest:
``splitkv_candidates.AB_FIELDS``); or variants that change several fields at once, ``F=V+G=W,F=V2+G=W2``
(``splitkv_candidates.parse_ab``).

``--fp8``: an e4m3 cache (random values, descale 1/32): split-KV reads it with the bf16 q (the tile converted in
registers), FlashMLA FP8 with q quantized once to e4m3 outside the timed region (the backend quantizes per
step: ``bench.fp8`` times whole steps); FA3 cannot read it (no column); the roofline's bytes are halved. With
``--sweep``: the e4m3 candidates (``SWEEP_NARROW_E4M3``) at <= 32 heads.

Each kernel runs R times per replay over R disjoint copies of the cache (R·bytes > 3x the 50 MiB L2,
``timing.rotating_inputs``), and a replay holds at least 16 calls (``timing.replay_repeats``: the copies captured again,
so that the graph's own launch is amortized as over a model's layers; ``--min-calls 1``: one pass over the copies, as
before 2026-12-05); times are per call, median of replays
(``timing.time_graph``). Pages are
scattered (a random permutation). Before timing, the split-KV kernel is checked against the torch
reference at one shape (cosine >= 0.9999, else exit 1), and every timed shape records its cosine
against FA3. Outputs: the markdown table on stdout; with ``--out DIR`` ``splitkv.csv`` / ``splitkv.md``
(with ``--sweep``: ``splitkv_sweep.csv`` / ``.md`` every candidate, ``splitkv_best.csv`` / ``.md`` the best
per shape with the peers, ``splitkv_table.txt`` the new ``CONFIG_TABLE``).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional, Sequence

import torch

from mla_fa3 import ops
from mla_fa3.bench import kernel_roofline, roofline
from mla_fa3.bench.smoke import refused
from mla_fa3.bench.splitkv_candidates import (AB_FIELDS, SWEEP_NARROW, SWEEP_NARROW_E4M3, SWEEP_WIDE, parse_ab,
                                              sweep_candidates)
from mla_fa3.bench.timing import MIN_CALLS_PER_REPLAY, Progress, h200_ceilings, rotating_inputs, time_per_call
from mla_fa3.ops import validate
from mla_fa3.ops.fp8 import quantize_e4m3_dynamic
from mla_fa3.ops.splitkv_config import KernelConfig, choose_config

R, D_ROPE, PAGE = 512, 64, 64
D = R + D_ROPE
SCALE = (128 + D_ROPE) ** -0.5
FULL = dict(heads=(16, 128), batch=(1, 2, 4, 8), context=(16384, 32768, 65536, 131072))
QUICK_SHAPES = ((16, 1, 65536), (16, 4, 32768), (128, 1, 16384), (128, 4, 65536))  # (H, bs, L)
SWEEP_SHAPES = QUICK_SHAPES + ((16, 2, 131072), (128, 2, 32768))

@dataclass
class Row:
    heads: int
    batch: int
    context: int
    page: int
    variant: str
    splits: int
    roofline_us: float
    splitkv_us: Optional[float]
    fa3_us: Optional[float]
    flashmla_us: Optional[float]
    best_peer_us: Optional[float]
    speedup_vs_best_peer: Optional[float]  # best peer / splitkv (> 1: split-KV faster)
    splitkv_over_roofline: Optional[float]  # splitkv / roofline (1.0 = at the roofline)
    cos_vs_fa3: Optional[float]
    error: str = ""


class Shape:
    """bs requests of L tokens on page-64 latent pools: ``copies`` disjoint (pool, page table) pairs (``fp8``:
    e4m3 pools with ``descale_k``)."""

    def __init__(self, bs: int, ctx: int, device: torch.device, fp8: bool = False):
        self.bs, self.ctx, self.device, self.fp8 = bs, ctx, device, fp8
        pages = -(-ctx // PAGE)
        self.nbytes = bs * ctx * D * (1 if fp8 else 2)
        self.descale_k = torch.full((1,), 1.0 / 32, device=device) if fp8 else None

        def make(_):
            kv = torch.randn(bs * pages + 1, PAGE, 1, D, device=device)
            kv = (kv * 32).to(torch.float8_e4m3fn) if fp8 else kv.to(torch.bfloat16)
            table = (torch.randperm(bs * pages, device=device) + 1).view(bs, pages).to(torch.int32)
            return kv, table

        self.copies = rotating_inputs(make, self.nbytes) if device.type == "cuda" else [make(0)]
        self.seqlens = torch.full((bs,), ctx, dtype=torch.int32, device=device)

    def queries(self, heads: int) -> torch.Tensor:
        return (torch.randn(self.bs, 1, heads, D, device=self.device) * 0.5).to(torch.bfloat16)


def splitkv_fn(shape: Shape, q: torch.Tensor, config: Optional[KernelConfig]):
    """(fn over every copy, schedule) for the split-KV kernels with ``config`` (None: the table's)."""
    from mla_fa3.ops import splitkv_triton as kt

    sched = ops.get_splitkv_schedule([shape.ctx] * shape.bs, num_heads=q.shape[2], page_size=PAGE,
                                     device=shape.device, config=config, kv_fp8=shape.fp8)
    calls = [validate.check_splitkv(q, kv, table, shape.seqlens, head_dim_v=R, schedule=sched, softmax_scale=SCALE,
                                    causal=True, descale_q=None, descale_k=shape.descale_k, impl=ops.Impl.TRITON)
             for kv, table in shape.copies]
    return (lambda: [kt.splitkv_mla_with_kvcache(c, sched) for c in calls]), sched


def fa3_fn(shape: Shape, q: torch.Tensor):
    q_lat, q_rope = q[..., :R].contiguous(), q[..., R:].contiguous()
    return lambda: [ops.flash_attn_with_kvcache(q_rope, kv[..., R:], kv[..., :R], qv=q_lat, page_table=table,
                                                cache_seqlens=shape.seqlens, softmax_scale=SCALE, causal=True,
                                                return_lse=True, impl="fa3") for kv, table in shape.copies]


def flashmla_fn(shape: Shape, q: torch.Tensor):
    extra = {}
    if shape.fp8:  # FlashMLA's FP8 decode: an e4m3 q (quantized here once, outside the timed replays)
        q, descale_q = quantize_e4m3_dynamic(q)
        extra = dict(descale_q=descale_q, descale_k=shape.descale_k)
    sched = ops.get_mla_decode_metadata(shape.seqlens, q.shape[2], is_fp8=shape.fp8, impl="fa3")
    return lambda: [ops.flash_mla_with_kvcache(q, kv, table, shape.seqlens, head_dim_v=R, schedule=sched,
                                               softmax_scale=SCALE, causal=True, return_lse=True, impl="fa3", **extra)
                    for kv, table in shape.copies]


def _time_us(fn: Callable, copies: int, iters: int, min_calls: int = MIN_CALLS_PER_REPLAY) -> float:
    """µs per call of ``fn`` (one call per copy), replays of at least ``min_calls`` calls."""
    return 1e3 * time_per_call(fn, copies, warmup=max(3, iters // 10), iters=iters, min_calls=min_calls)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def check_correctness(device: torch.device, configs: Sequence[tuple] = (), fp8: bool = False) -> float:
    """Split-KV vs the torch reference at bs 2 (L 8191 and 70), page 64 (``fp8``: an e4m3 cache): the worst cosine.

    ``configs``: (heads, KernelConfig or None) pairs; 16 and 128 heads with the table's configs always."""
    lens = [8191, 70]
    shape = Shape(2, 8191, device, fp8)
    shape.seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
    kv, table = shape.copies[0]
    worst = 1.0
    for heads, cfg in [(16, None), (128, None), *configs]:
        q = shape.queries(heads)
        sched = ops.get_splitkv_schedule(lens, num_heads=heads, page_size=PAGE, device=device, config=cfg,
                                         kv_fp8=fp8)
        kw = dict(head_dim_v=R, schedule=sched, softmax_scale=SCALE, causal=True, descale_k=shape.descale_k)
        out, lse = ops.splitkv_mla_with_kvcache(q, kv, table, shape.seqlens, **kw, impl="triton")
        ref, ref_lse = ops.splitkv_mla_with_kvcache(q, kv, table, shape.seqlens, **kw, impl="reference")
        lse_err = (lse - ref_lse).abs().max().item()
        cos = _cos(out, ref)
        print(f"check H {heads} {sched.config.label()}: cosine {cos:.6f}, max |out - ref| "
              f"{(out.float() - ref.float()).abs().max().item():.3g}, max |lse - ref| {lse_err:.3g}", file=sys.stderr)
        worst = min(worst, cos, 1.0 if lse_err < 2e-3 else 0.0)
    return worst


def measure(shape: Shape, heads: int, config: Optional[KernelConfig], iters: int, peers: bool,
            min_calls: int = MIN_CALLS_PER_REPLAY) -> Row:
    ceil = h200_ceilings()
    tokens = shape.bs * shape.ctx
    roof_us = 1e3 * ceil.time_ms(roofline.decode_bytes(tokens) // (2 if shape.fp8 else 1),
                                 roofline.decode_flops(heads, tokens))
    q = shape.queries(heads)
    n = len(shape.copies)
    row = Row(heads, shape.bs, shape.ctx, PAGE, config.label() if config else "", 0, roof_us, None, None, None,
              None, None, None, None)
    try:
        fn, sched = splitkv_fn(shape, q, config)
        row.variant, row.splits = sched.config.label(), sched.planned_work
        row.splitkv_us = _time_us(fn, n, iters, min_calls)
        row.splitkv_over_roofline = row.splitkv_us / roof_us
    except Exception as exc:  # e.g. out of shared memory for a sweep config: record, go on
        row.error = f"splitkv: {type(exc).__name__}: {str(exc)[:120]}"
        return row
    if not peers:
        return row
    for name, make in ((("flashmla", flashmla_fn),) if shape.fp8 else (("fa3", fa3_fn), ("flashmla", flashmla_fn))):
        try:
            setattr(row, f"{name}_us", _time_us(make(shape, q), n, iters, min_calls))
        except Exception as exc:
            row.error += f" {name}: {type(exc).__name__}: {str(exc)[:80]}"
    peers_us = [t for t in (row.fa3_us, row.flashmla_us) if t]
    if peers_us:
        row.best_peer_us = min(peers_us)
        row.speedup_vs_best_peer = row.best_peer_us / row.splitkv_us
    if row.fa3_us:
        out = fn()[0][0]
        row.cos_vs_fa3 = _cos(out, fa3_fn(shape, q)()[0][0])
    return row


def _f(v, digits=1):
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def markdown(rows: Sequence[Row]) -> str:
    head = ("| H | bs | ctx | variant | splits | splitkv µs | FA3 µs | FlashMLA µs | roofline µs | best peer / splitkv "
            "| splitkv / roofline | cos vs FA3 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r.heads} | {r.batch} | {r.context // 1024}k | {r.variant} | {r.splits} | {_f(r.splitkv_us)} | "
        f"{_f(r.fa3_us)} | {_f(r.flashmla_us)} | {_f(r.roofline_us)} | {_f(r.speedup_vs_best_peer, 2)} | "
        f"{_f(r.splitkv_over_roofline, 2)} | {_f(r.cos_vs_fa3, 5)} |{' ' + r.error if r.error else ''}\n"
        for r in rows)


def write(rows: Sequence[Row], out_dir: str, stem: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as fh:
        fh.write(markdown(rows))
    kernel_roofline.plot([{k: "" if v is None else str(v) for k, v in asdict(r).items()} for r in rows],
                         os.path.join(out_dir, f"{stem}_roofline.png"))  # where matplotlib is installed


def run(shapes: Sequence[tuple], configs: Callable[[int, int, int], Sequence[Optional[KernelConfig]]], *, device,
        iters: int, peers: bool, quiet: bool = False, fp8: bool = False,
        min_calls: int = MIN_CALLS_PER_REPLAY) -> list:
    """Time every (H, bs, L) of ``shapes`` with every config of ``configs(H, bs, L)``; pools built once per (bs, L)."""
    rows = []
    by_cell = {}
    for h, bs, ctx in shapes:
        by_cell.setdefault((bs, ctx), []).append(h)
    with Progress(sum(len(configs(h, bs, ctx)) for h, bs, ctx in shapes), quiet=quiet) as prog:
        for (bs, ctx), heads in by_cell.items():
            shape = Shape(bs, ctx, device, fp8)
            for h in heads:
                for cfg in configs(h, bs, ctx):
                    rows.append(measure(shape, h, cfg, iters, peers, min_calls))
                    r = rows[-1]
                    prog.step(f"H {h} bs {bs} ctx {ctx} {r.variant}: splitkv {_f(r.splitkv_us)} µs, "
                              f"fa3 {_f(r.fa3_us)}, flashmla {_f(r.flashmla_us)} {r.error}")
            del shape
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def best_per_shape(rows: Sequence[Row]) -> dict:
    """(H, bs, L) -> the fastest row."""
    best = {}
    for r in rows:
        key = (r.heads, r.batch, r.context)
        if r.splitkv_us is not None and (key not in best or r.splitkv_us < best[key].splitkv_us):
            best[key] = r
    return best


def config_table(best: dict, configs: dict, fp8: bool = False) -> str:
    """The ``CONFIG_TABLE`` (``fp8``: ``E4M3_CONFIG_TABLE``) literal of ``ops/splitkv_config.py`` holding the best
    config of each shape."""
    lines = [f"{'E4M3_CONFIG_TABLE' if fp8 else 'CONFIG_TABLE'}: dict = {{"]
    for key, row in sorted(best.items()):
        c = configs[row.variant]
        args = ", ".join(f"{f.name}={getattr(c, f.name)!r}" for f in fields(c))
        lines.append(f"    {key}: KernelConfig({args}),  # {row.splitkv_us:.1f} us")
    return "\n".join(lines + ["}"]) + "\n"


def sweep(shapes: Sequence[tuple], *, device, iters: int, out: Optional[str], quiet: bool,
          fp8: bool = False) -> None:
    """Every candidate of each shape's head class (split-KV only), then each shape's best against the peers."""
    rows = run(shapes, lambda h, bs, ctx: sweep_candidates(h, fp8), device=device, iters=iters, peers=False,
               quiet=quiet, fp8=fp8)
    print(markdown(rows))
    best = best_per_shape(rows)
    known = {c.label(): c for c in SWEEP_NARROW + SWEEP_NARROW_E4M3 + SWEEP_WIDE}
    table = config_table(best, known, fp8)
    print(table)
    winners = [run([key], lambda h, bs, ctx, c=known[r.variant]: [c], device=device, iters=iters, peers=True,
                   quiet=True, fp8=fp8)[0] for key, r in best.items()]
    print("best per shape vs the peers:\n" + markdown(winners))
    if out:
        stem = "splitkv_fp8" if fp8 else "splitkv"
        write(rows, out, f"{stem}_sweep")
        write(winners, out, f"{stem}_best")
        with open(os.path.join(out, f"{stem}_table.txt"), "w") as fh:
            fh.write(table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.splitkv", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for splitkv.csv / splitkv.md")
    p.add_argument("--quick", action="store_true", help=f"only {QUICK_SHAPES} (H, bs, L)")
    p.add_argument("--sweep", action="store_true",
                   help=f"time each head class's candidate configs on {SWEEP_SHAPES} (H, bs, L), then the best vs peers")
    p.add_argument("--heads", type=int, nargs="+", default=FULL["heads"])
    p.add_argument("--batch", type=int, nargs="+", default=FULL["batch"])
    p.add_argument("--context", type=int, nargs="+", default=FULL["context"])
    p.add_argument("--block-n", type=int, help="a config for every shape instead of the table's (with the flags below)")
    p.add_argument("--num-warps", type=int)
    p.add_argument("--num-stages", type=int)
    p.add_argument("--waves", type=float)
    p.add_argument("--max-rows", type=int)
    p.add_argument("--half-partials", action="store_true")
    p.add_argument("--reload-kv", action="store_true")
    p.add_argument("--latent-chunks", type=int, choices=(1, 2, 4))
    p.add_argument("--ab", metavar="FIELD[=V1,V2]",
                   help=f"each shape once per value of a KernelConfig field on the table's config ({sorted(AB_FIELDS)}); "
                        "or variants changing several: F=V+G=W,F=V2+G=W2")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--min-calls", type=int, default=MIN_CALLS_PER_REPLAY,
                   help="kernel calls per graph replay, at least (1: a replay of the rotated copies once)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    p.add_argument("--fp8", action="store_true", help="an e4m3 cache: split-KV (bf16 q) vs FlashMLA FP8 (e4m3 q)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.min_calls < 1:
        p.error("--min-calls must be >= 1")
    try:
        ab = parse_ab(a.ab) if a.ab else None
    except ValueError as exc:
        p.error(str(exc))
    if refused(p.prog, cpu_smoke=False):
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    checks = [(16, c) for c in SWEEP_NARROW if c.reload_kv or c.warp_specialized] + \
        [(128, c) for c in SWEEP_WIDE if c.reload_kv][:1] if a.sweep else []
    if a.sweep and a.fp8:
        checks += [(16, c) for c in SWEEP_NARROW_E4M3 if c.num_warps == 8][:2] + \
            [(16, c) for c in SWEEP_NARROW_E4M3 if c.warp_specialized]
    if ab:  # every side of the switch checked before any is timed, at the head counts timed
        checks += [(h, choose_config(h, 1, 65536, kv_fp8=a.fp8).with_(**v)) for h in sorted(set(a.heads))
                   for v in ab[1]]
    if not a.no_check and check_correctness(device, checks, a.fp8) < 0.9999:
        print("splitkv bench: the split-KV kernel disagrees with the reference; not timing", file=sys.stderr)
        return 1
    if a.sweep:
        sweep(SWEEP_SHAPES, device=device, iters=a.iters, out=a.out, quiet=a.quiet, fp8=a.fp8)
        return 0
    shapes = list(QUICK_SHAPES) if a.quick else [(h, bs, ctx) for h in a.heads for bs in a.batch for ctx in a.context]
    flags = dict(block_n=a.block_n, num_warps=a.num_warps, num_stages=a.num_stages, waves=a.waves,
                 max_rows=a.max_rows, half_partials=a.half_partials or None, reload_kv=a.reload_kv or None,
                 latent_chunks=a.latent_chunks)
    flags = {k: v for k, v in flags.items() if v is not None}
    fixed = [KernelConfig(**flags)] if flags else [None]  # None: the table's choice per shape

    def configs(h, bs, ctx):
        if not ab:
            return fixed
        table = choose_config(h, bs, ctx, kv_fp8=a.fp8)
        return [table.with_(**v) for v in ab[1]]

    rows = run(shapes, configs, device=device, iters=a.iters, peers=True, quiet=a.quiet, fp8=a.fp8,
               min_calls=a.min_calls)
    print(markdown(rows))
    if a.out:
        write(rows, a.out, "splitkv_fp8" if a.fp8 else "splitkv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
