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
    stream        a row-wise torch.amax over the same bytes of cache ([tokens, 576] -> [tokens]): what a generic
                  torch kernel streams, its TB/s beside it — not a ceiling (phase 1 beats it on the H100)
    roofline      bench.roofline's bound (bytes at 4.3 TB/s, FLOPs at 790 TFLOP/s)

Derived: ``phase1 - stream`` (phase 1's cost beyond streaming the bytes), ``both - phase1`` (what the combine adds
after phase 1, its launch overlapped by the programmatic dependent launch). ``--combine-tiles 64x32,256x32``: per
shape, both phases and the combine alone again with each combine tile (splits loaded at once x columns per program)
beside ``combine_tile``'s. ``--prefix-blocks 0,1,2,4``: phase 1 with every split cut to its first K key blocks (same
grid and splits): a program's fixed cost against its cost per block. Outputs: the markdown tables on stdout; with
``--out DIR``: ``splitkv_phases.csv`` / ``.md``, ``combine_tiles.csv`` / ``.md`` and ``prefix_blocks.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Tuple

import torch

from mla_fa3 import ops
from mla_fa3.bench import roofline
from mla_fa3.bench.smoke import refused
from mla_fa3.bench.splitkv import D, PAGE, R, SCALE, Shape
from mla_fa3.bench.timing import h200_ceilings, time_per_call
from mla_fa3.ops import validate
from mla_fa3.ops.pdl import pdl_capable
from mla_fa3.ops.splitkv_config import check_combine_tile, combine_tile

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
    stream_bytes: int
    roofline_us: float

    @property
    def phase1_over_stream_us(self) -> float:
        return self.phase1_us - self.stream_us

    @property
    def combine_added_us(self) -> float:
        return self.both_us - self.phase1_us

    @property
    def stream_tb_s(self) -> float:
        return self.stream_bytes / self.stream_us / 1e6

    @property
    def phase1_tb_s(self) -> float:
        return self.stream_bytes / self.phase1_us / 1e6


@dataclass
class TileRow:
    """Both phases and the combine alone with one combine tile (splits per load x columns)."""
    heads: int
    batch: int
    context: int
    splits: int
    tile: str
    rule: bool  # the tile combine_tile picks for this shape
    both_us: float
    combine_us: float


@dataclass
class PrefixRow:
    """Phase 1 with every split cut to its first ``blocks`` key blocks (0: each program stores an empty split)."""
    heads: int
    batch: int
    context: int
    splits: int
    blocks: int
    keys: int  # keys read in all
    phase1_us: float


class _Setup:
    """One shape's schedule, validated calls (one per cache copy), phase 1's workspace and the combine's outputs."""

    def __init__(self, shape: Shape, heads: int, iters: int):
        from mla_fa3.ops import splitkv_combine_triton, splitkv_triton  # triton: imported only on CUDA

        self.kt, self.combine_splits = splitkv_triton, splitkv_combine_triton.combine_splits
        kt = self.kt
        self.shape, self.iters = shape, iters
        self.q = shape.queries(heads)
        self.sched = ops.get_splitkv_schedule([shape.ctx] * shape.bs, num_heads=heads, page_size=PAGE,
                                              device=shape.device, kv_fp8=shape.fp8)
        self.calls = [validate.check_splitkv(self.q, kv, table, shape.seqlens, head_dim_v=R, schedule=self.sched,
                                             softmax_scale=SCALE, causal=True, descale_q=None,
                                             descale_k=shape.descale_k, impl=ops.Impl.TRITON)
                      for kv, table in shape.copies]
        self.part_o, self.part_lse2 = kt.splitkv_partials(self.calls[0], self.sched)
        self.out = torch.empty(shape.bs, 1, heads, R, dtype=self.calls[0].out_dtype, device=shape.device)
        self.lse = torch.empty(shape.bs, 1, heads, dtype=torch.float32, device=shape.device)
        self.pdl = self.sched.config.pdl and pdl_capable(shape.device)
        self.descale = self.calls[0].descale_k if shape.fp8 else None

    def per_copy(self, fn) -> float:
        """µs per call of ``fn`` (one call per cache copy), replays of at least 16 calls."""
        return 1e3 * time_per_call(fn, len(self.calls), warmup=max(3, self.iters // 10), iters=self.iters)

    def combine(self, tile=None, partials=None) -> None:
        """The combine into ``out``/``lse`` over ``partials`` (default: the workspace phase 1 filled at setup)."""
        part_o, part_lse2 = (self.part_o, self.part_lse2) if partials is None else partials
        self.combine_splits(part_o, part_lse2, self.sched.split_offsets, self.out, self.lse, self.descale,
                            pdl=self.pdl, tile=tile)

    def both(self, call, tile=None) -> None:
        """The op's two launches, phase 1 then the combine (with ``tile``), as ``splitkv_mla_with_kvcache``."""
        self.combine(tile, self.kt.splitkv_partials(call, self.sched))


def measure(shape: Shape, heads: int, iters: int) -> PhaseRow:
    """Time the phases of one shape (the table's config); ``shape``'s copies rotate through L2 as in bench.splitkv."""
    st = _Setup(shape, heads, iters)
    kt = st.kt
    empty = copy.copy(st.sched)
    empty.num_work = torch.zeros_like(st.sched.num_work)
    # the cache bytes the kernel reads as [tokens, D] rows, one view per copy (page 0 is the pool's unused padding
    # page; an e4m3 cache read as bytes: amax has no e4m3 kernel); a row-wise amax streams them with one small
    # output per row (torch.amax to a single value reduces in two passes and streams far slower)
    rows = [kv[1:].view(-1)[: shape.bs * shape.ctx * D].view(-1, D) for kv, _ in shape.copies]
    rows = [v.view(torch.uint8) if shape.fp8 else v for v in rows]
    sinks = [torch.empty(v.shape[0], dtype=v.dtype, device=shape.device) for v in rows]

    def stream():
        for v, sink in zip(rows, sinks):
            torch.amax(v, dim=1, out=sink)

    ceil = h200_ceilings()
    tokens = shape.bs * shape.ctx
    roof = 1e3 * ceil.time_ms(roofline.decode_bytes(tokens) // (2 if shape.fp8 else 1),
                              roofline.decode_flops(heads, tokens))
    return PhaseRow(
        heads, shape.bs, shape.ctx, st.sched.config.label(), st.sched.planned_work,
        both_us=st.per_copy(lambda: [kt.splitkv_mla_with_kvcache(c, st.sched) for c in st.calls]),
        phase1_us=st.per_copy(lambda: [kt.splitkv_partials(c, st.sched) for c in st.calls]),
        combine_us=st.per_copy(lambda: [st.combine() for _ in st.calls]),
        empty_us=st.per_copy(lambda: [kt.splitkv_partials(c, empty) for c in st.calls]),
        stream_us=st.per_copy(stream),
        stream_bytes=rows[0].numel() * rows[0].element_size(),
        roofline_us=roof,
    )


def measure_prefix(shape: Shape, heads: int, iters: int, blocks: Sequence[int]) -> list:
    """Phase 1 over the same grid and splits, each split cut to its first ``k`` key blocks, for k in ``blocks``: the
    time against k separates a program's fixed cost (launch, its first loads, the partial's store) from its cost per
    key block."""
    st = _Setup(shape, heads, iters)
    block_n = st.sched.config.block_n
    n = st.sched.planned_work
    out = []
    for k in blocks:
        cut = copy.copy(st.sched)
        cut.work = st.sched.work.clone()
        start, end = cut.work[:n, 1], cut.work[:n, 2]
        cut.work[:n, 2] = torch.minimum(end, start + k * block_n)
        keys = int((cut.work[:n, 2] - start).sum())
        out.append(PrefixRow(heads, shape.bs, shape.ctx, n, k, keys,
                             phase1_us=st.per_copy(lambda: [st.kt.splitkv_partials(c, cut) for c in st.calls])))
    return out


def measure_tiles(shape: Shape, heads: int, iters: int, tiles: Sequence[Tuple[int, int]]) -> list:
    """Both phases and the combine alone with each combine tile of ``tiles`` (and the rule's, listed first)."""
    st = _Setup(shape, heads, iters)
    rule = combine_tile(shape.bs * heads)
    out = []
    for tile in [rule] + [t for t in tiles if t != rule]:
        out.append(TileRow(heads, shape.bs, shape.ctx, st.sched.planned_work, f"{tile[0]}x{tile[1]}", tile == rule,
                           both_us=st.per_copy(lambda: [st.both(c, tile) for c in st.calls]),
                           combine_us=st.per_copy(lambda: [st.combine(tile) for _ in st.calls])))
    return out


def markdown(rows: Sequence[PhaseRow]) -> str:
    head = ("| H | bs | ctx | variant | splits | both µs | phase 1 µs | combine µs | empty µs | stream µs | stream TB/s "
            "| roofline µs | phase 1 - stream | both - phase 1 | phase 1 TB/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r.heads} | {r.batch} | {r.context // 1024}k | {r.variant} | {r.splits} | {r.both_us:.1f} | "
        f"{r.phase1_us:.1f} | {r.combine_us:.1f} | {r.empty_us:.1f} | {r.stream_us:.1f} | {r.stream_tb_s:.2f} | "
        f"{r.roofline_us:.1f} | {r.phase1_over_stream_us:.1f} | {r.combine_added_us:.1f} | {r.phase1_tb_s:.2f} |\n"
        for r in rows)


def markdown_tiles(rows: Sequence[TileRow]) -> str:
    head = "| H | bs | ctx | splits | combine tile | both µs | combine µs |\n|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r.heads} | {r.batch} | {r.context // 1024}k | {r.splits} | {r.tile}{' (rule)' if r.rule else ''} | "
        f"{r.both_us:.1f} | {r.combine_us:.1f} |\n" for r in rows)


def markdown_prefix(rows: Sequence[PrefixRow]) -> str:
    head = "| H | bs | ctx | splits | blocks per split | keys | phase 1 µs |\n|---|---|---|---|---|---|---|\n"
    return head + "".join(f"| {r.heads} | {r.batch} | {r.context // 1024}k | {r.splits} | {r.blocks} | {r.keys} | "
                          f"{r.phase1_us:.1f} |\n" for r in rows)


def write(rows: Sequence[PhaseRow], tile_rows: Sequence[TileRow], prefix_rows: Sequence[PrefixRow],
          out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    derived = ("phase1_over_stream_us", "combine_added_us", "stream_tb_s", "phase1_tb_s")
    for stem, table, extra, md in (("splitkv_phases", rows, derived, markdown),
                                   ("combine_tiles", tile_rows, (), markdown_tiles),
                                   ("prefix_blocks", prefix_rows, (), markdown_prefix)):
        if not table:
            continue
        with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(asdict(table[0])) + list(extra))
            w.writeheader()
            w.writerows(dict(asdict(r), **{k: getattr(r, k) for k in extra}) for r in table)
        with open(os.path.join(out_dir, f"{stem}.md"), "w") as fh:
            fh.write(md(table))


def parse_tiles(text: str) -> list:
    """``"64x32,256x32"`` -> [(64, 32), (256, 32)]: combine tiles, splits per load x columns, powers of two."""
    tiles = []
    for item in filter(None, text.split(",")):
        try:
            s, c = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"a combine tile is SPLITSxCOLUMNS, e.g. 64x32; got {item!r}") from None
        tiles.append(check_combine_tile((s, c)))
    return tiles


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.splitkv_phases", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=DEFAULT_SHAPES["heads"])
    p.add_argument("--batch", type=int, nargs="+", default=DEFAULT_SHAPES["batch"])
    p.add_argument("--context", type=int, nargs="+", default=DEFAULT_SHAPES["context"])
    p.add_argument("--fp8", action="store_true", help="an e4m3 cache (split-KV reads it with the bf16 q)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--combine-tiles", default="",
                   help="also time both phases and the combine alone with each combine tile SPLITSxCOLUMNS "
                        "(comma-separated, e.g. 64x32,256x32) beside the rule's (combine_tiles.csv / .md)")
    p.add_argument("--prefix-blocks", default="",
                   help="also time phase 1 with every split cut to its first K key blocks, for each K of this "
                        "comma-separated list (e.g. 0,1,2,4; prefix_blocks.csv / .md)")
    p.add_argument("--out", help="directory for splitkv_phases.csv / .md (and combine_tiles, prefix_blocks)")
    a = p.parse_args(argv)
    if min(a.heads + a.batch + a.context) < 1 or a.iters < 1:
        p.error("heads, batch, context and iters must be >= 1")
    try:
        tiles = parse_tiles(a.combine_tiles)
        blocks = [int(k) for k in filter(None, a.prefix_blocks.split(","))]
    except ValueError as exc:
        p.error(str(exc))
    if any(k < 0 for k in blocks):
        p.error(f"--prefix-blocks: block counts are >= 0, got {a.prefix_blocks!r}")
    if refused(p.prog, cpu_smoke=False):
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows, tile_rows, prefix_rows = [], [], []
    for bs in a.batch:
        for ctx in a.context:
            shape = Shape(bs, ctx, device, a.fp8)
            for h in a.heads:
                rows.append(measure(shape, h, a.iters))
                print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
                if tiles:
                    tile_rows += measure_tiles(shape, h, a.iters, tiles)
                if blocks:
                    prefix_rows += measure_prefix(shape, h, a.iters, blocks)
            del shape
            torch.cuda.empty_cache()
    print(markdown(rows))
    if tile_rows:
        print(markdown_tiles(tile_rows))
    if prefix_rows:
        print(markdown_prefix(prefix_rows))
    if a.out:
        write(rows, tile_rows, prefix_rows, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
