"""Decode benchmark: the MLA backend step vs the FA3 and FlashMLA kernels vs the roofline, per layer.

``python -m mla_fa3.bench.decode`` (or ``mla-fa3 bench decode``, or ``python benchmarks/decode.py``).
Sweeps heads H x batch bs x context L x page size p, with equal lengths (every request L) and skewed
lengths (geometric from L down to L/16: ``L_b = L · 16^(-b/(bs-1))``), DeepSeek-V3 latent dims
(r = 512, d_rope = 64, d_nope = d_v = 128), bf16, one query token per request. Per shape and layer:

(a) ``backend``: ``MLABackend.forward`` of one layer (latent store + q absorption through W_UK +
    kernel + W_UV projection) replayed from a CUDA graph by ``GraphRunner``, plus the step's
    metadata work — the replay update on the host (``GraphRunner.prepare``: padding, one copy) and
    the graph's prologue on the GPU (page table, FlashMLA plan; timed alone and taken out of the
    replay) — divided by the 61 layers of DeepSeek-V3 that share it. The backend picks its kernel (``decode_kernel=auto``,
    ``mla_fa3.policy.decode_kernel``); the column ``backend_kernel`` says which.
(b) ``fa3``: ``ops.flash_attn_with_kvcache`` alone (q_rope / k_rope, qv = q_lat / c_kv), graph replay.
(c) ``flashmla``: ``ops.flash_mla_with_kvcache`` alone over the 576-wide rows (page 64 only), with
    the tile schedule planned outside the graph.
(d) ``splitkv``: ``ops.splitkv_mla_with_kvcache`` alone (our Triton split-KV kernel, page 64 only), with
    its split schedule planned outside the graph.
(e) ``roofline``: ``max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)`` (``bench.roofline``).

``--whole-step``: (b)-(d) become the backend's whole step (as (a)) with that kernel forced
(``decode_kernel='fa3' | 'flashmla' | 'splitkv'``) — what the decode-kernel choice should compare where the
steps' other work differs by kernel (small batches: FlashMLA's q concatenation, split-KV's host-planned schedule
in the replay update); the CSV feeds ``policy.decode_kernel --from-csv`` the same way.

L2: a shape whose cache is smaller than 3x the 50 MiB L2 cycles through ``R`` copies (pool layers,
R <= 64) inside one graph, and times are per copy. A replay holds at least 16 layers or kernel calls (the copies
cycled again, each backend layer with its own weights; ``timing.MIN_CALLS_PER_REPLAY``): with one or two, a replay
also times the graph's own launch, which a model's 61 layers amortize. Pages are scattered (a random permutation), as in
a long-running server. One latent pool per (page, bs, L) is shared by every H and both length
patterns; shapes whose pool exceeds ``--mem-cap-gb`` are skipped.

Outputs: a progress line per shape on stderr, the markdown table on stdout, and with ``--out DIR``
``decode.csv`` (``python -m mla_fa3.policy.decode_kernel --from-csv`` reads it), ``decode.md`` and ``decode_roofline.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch

from mla_fa3 import ops
from mla_fa3.layer import MLAWeights
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.bench import roofline
from mla_fa3.bench.smoke import add_device_argument, refused, start_smoke
from mla_fa3.bench.timing import (L2_BYTES_H200, MIN_CALLS_PER_REPLAY, Progress, h200_ceilings, time_cuda,
                                  time_graph, time_per_call)
from mla_fa3.graphs.runner import GraphRunner, InputSpec
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims

DIMS = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # DeepSeek-V3
LAYERS_PER_STEP = 61  # DeepSeek-V3: one metadata replay update serves 61 layers
MAX_ROTATE = 64  # at most this many cache copies cycled per replay to defeat the L2

FULL = dict(heads=(16, 32, 64, 128), batch=(1, 4, 16, 64, 128), context=(1024, 4096, 16384, 65536, 131072),
            page=(1, 64), lengths=("equal", "skewed"))
QUICK = dict(heads=(16, 128), batch=(1, 64), context=(4096, 65536), page=(64,), lengths=("equal",))
# --device cpu (bench.smoke): the shapes of a smoke run on the reference kernels, in place of FULL and QUICK
SMOKE = dict(heads=(16, 128), batch=(1, 4), context=(256, 2048), page=(64,), lengths=("equal", "skewed"))
SMOKE_MAX_ITERS = 3  # timed calls per measurement in a smoke run
PROG = "mla-fa3 bench decode"


@dataclass
class Config:
    heads: Sequence[int]
    batch: Sequence[int]
    context: Sequence[int]
    page: Sequence[int]
    lengths: Sequence[str]
    device: str = "cuda"
    impl: str = "auto"  # ops implementation: auto / fa3 / reference
    mem_cap_gb: float = 40.0
    budget_ms: float = 120.0  # target timed milliseconds per measurement
    max_iters: int = 100
    skip: set = field(default_factory=set)  # of "backend", "fa3", "flashmla", "splitkv"
    whole_step: bool = False  # kernel columns = the backend's whole step with that kernel forced (not the kernel alone)
    quiet: bool = False
    seed: int = 0


def lengths_of(kind: str, bs: int, ctx: int) -> list[int]:
    """Per-request KV lengths: ``equal`` (all ctx) or ``skewed`` (geometric from ctx down to ctx/16)."""
    if kind == "equal" or bs == 1:
        return [ctx] * bs
    if kind == "skewed":
        return [max(1, round(ctx * 16.0 ** (-b / (bs - 1)))) for b in range(bs)]
    raise ValueError(f"lengths must be 'equal' or 'skewed', got {kind!r}")


def rotations(cache_bytes: int) -> int:
    """Copies of a cache of ``cache_bytes`` so that one replay streams > 3x the L2 (1 for big caches)."""
    return max(1, min(MAX_ROTATE, math.ceil(3 * L2_BYTES_H200 / max(cache_bytes, 1))))


class Cell:
    """One latent pool for (page, bs, ctx): R layers of scattered pages, shared by every H and length kind.

    The request->token table is written directly (a benchmark owns its layout): request b's token j
    lives on page ``perm[b, j // p]`` at offset ``j % p``; page 0 stays the padding page.
    """

    def __init__(self, page: int, bs: int, ctx: int, device: torch.device, gen: torch.Generator):
        self.page, self.bs, self.ctx, self.device = page, bs, ctx, device
        pages_per_req = -(-ctx // page)
        num_pages = 1 + bs * pages_per_req
        # L2 rotation on a GPU only (a CPU smoke run has no L2 to defeat and no time to spare)
        self.rotate = rotations(bs * ctx * DIMS.latent_dim * 2) if device.type == "cuda" else 1
        self.req_pool = ReqToTokenPool(bs, ctx, device)
        self.req_pool.claim(list(range(bs)), ctx)  # the benchmark writes its rows itself, all ctx tokens
        self.pool = MLATokenPool(self.rotate, num_pages, page, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim,
                                 torch.bfloat16, device)
        for buf in self.pool.kv_buffer:
            buf.normal_(generator=gen if device.type == "cpu" else None)
        perm = (torch.randperm(num_pages - 1, device=device) + 1).view(bs, pages_per_req)
        tok = torch.arange(ctx, device=device)
        self.req_pool.req_to_token.copy_((perm[:, tok // page] * page + tok % page).to(torch.int32))
        self.page_table = (self.req_pool.req_to_token[:, ::page] // page).to(torch.int32).contiguous()

    @staticmethod
    def bytes_needed(page: int, bs: int, ctx: int) -> int:
        slots = (1 + bs * -(-ctx // page)) * page
        return rotations(bs * ctx * DIMS.latent_dim * 2) * slots * DIMS.latent_dim * 2 + bs * ctx * 4

    def batch(self, lens: list[int]) -> ForwardBatch:
        """DECODE batch: request b's new token is its token L_b - 1 (already in the table)."""
        seq = torch.tensor(lens, dtype=torch.int32)
        rows = torch.arange(self.bs, device=self.device)
        loc = self.req_pool.req_to_token[rows, seq.to(self.device).long() - 1].long()
        return ForwardBatch.decode(rows, seq, loc, self.device)


def _iters(cfg: Config, est_ms: float) -> tuple[int, int]:
    iters = max(1, int(min(cfg.max_iters, max(5, cfg.budget_ms / max(est_ms, 1e-3)))))
    return max(1, iters // 5), iters


class BackendBench:
    """(a): one MLABackend + GraphRunner per (cell, H), captured once, timed for each length pattern."""

    def __init__(self, cfg: Config, cell: Cell, heads: int, gen: torch.Generator, decode_kernel: str = "auto"):
        self.cfg, self.cell, self.heads = cfg, cell, heads
        dev = cell.device
        self.backend = MLABackend(req_to_token_pool=cell.req_pool, kv_pool=cell.pool, page_size=cell.page, device=dev,
                                  decode_kernel=decode_kernel, num_heads=heads, mla_dims=DIMS, impl=cfg.impl)
        scale = DIMS.qk_head_dim ** -0.5
        rows = heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim)
        self.layers = []
        # layer i reads cache copy i % R (R copies defeat the L2) with its own weights, and a replay runs at least
        # MIN_CALLS_PER_REPLAY layers on a GPU (the graph's own launch amortized as over a model's layers)
        for i in range(max(cell.rotate, MIN_CALLS_PER_REPLAY if dev.type == "cuda" else 1)):
            w = (torch.randn(rows, DIMS.kv_lora_rank, generator=gen) / math.sqrt(DIMS.kv_lora_rank))
            weights = MLAWeights.from_kv_b_proj(w.to(dev, torch.bfloat16), DIMS)
            self.layers.append(AttentionLayer.mla_layer(i % cell.rotate, heads, DIMS, scale, mla_weights=weights))
        specs = {"q": InputSpec((heads, DIMS.qk_head_dim), torch.bfloat16),
                 "latent": InputSpec((DIMS.latent_dim,), torch.bfloat16)}
        self.runner = GraphRunner(self.backend, self._step, batch_sizes=[cell.bs], mode=ForwardMode.DECODE,
                                  max_context=cell.ctx, input_specs=specs, device=dev)

    def _step(self, batch: ForwardBatch, inputs: dict) -> torch.Tensor:
        out = None
        for layer in self.layers:
            out = self.backend.forward(inputs["q"], inputs["latent"], None, layer, batch)
        return out

    def measure(self, lens: list[int], est_ms: float) -> tuple[float, float, str]:
        """(per-layer ms: (replay - prologue) / layers + (update + prologue) / 61, update ms per step, kernel the
        backend chose)."""
        cell, dev = self.cell, self.cell.device
        batch = cell.batch(lens)
        inputs = {"q": torch.randn(cell.bs, self.heads, DIMS.qk_head_dim, device=dev).to(torch.bfloat16),
                  "latent": torch.randn(cell.bs, DIMS.latent_dim, device=dev).to(torch.bfloat16)}
        warm, iters = _iters(self.cfg, 0.05)
        update_ms = time_cuda(lambda: self.runner.prepare(batch, inputs), warmup=warm, iters=iters)
        key = self.runner.prepare(batch, inputs)
        layers = len(self.layers)
        warm, iters = _iters(self.cfg, est_ms * layers)
        graph_ms = time_cuda(lambda: self.runner.replay(key), warmup=warm, iters=iters)
        record = self.backend.explain()
        # the graph also runs the step's metadata prologue (page table, FlashMLA schedule) once: per-step
        # work, amortized over a step's layers like the replay update — not over the replay's layers. Timed as
        # MIN_CALLS_PER_REPLAY prologues per replay: one alone would also time a graph launch
        prologue_ms = time_graph(self.backend.graph_prologue, warmup=5, iters=50,
                                 calls_per_graph=MIN_CALLS_PER_REPLAY) if self.runner.device_metadata else 0.0
        replay_ms = max(graph_ms - prologue_ms, 0.0) / layers
        per_layer = replay_ms + (update_ms + prologue_ms) / LAYERS_PER_STEP
        return per_layer, update_ms, (record.kernel if record else None) or "?"

    def close(self) -> None:
        self.runner.close()


def _queries(bs: int, heads: int, dev, width: int) -> torch.Tensor:
    return (torch.randn(bs, 1, heads, width, device=dev) * 0.5).to(torch.bfloat16)


def _time_layers(cfg: Config, cell: Cell, est_ms: float, kernel) -> float:
    """Graph-replay ms of ``kernel(layer)`` run over the cell's R cache copies, per copy."""

    def fn():
        for layer in range(cell.rotate):
            kernel(layer)

    warm, iters = _iters(cfg, est_ms * cell.rotate)
    return time_per_call(fn, cell.rotate, warmup=warm, iters=iters)


def measure_fa3(cfg: Config, cell: Cell, heads: int, lens: list[int], est_ms: float) -> float:
    dev, r = cell.device, DIMS.kv_lora_rank
    q = _queries(cell.bs, heads, dev, DIMS.latent_dim)
    q_lat, q_rope = q[..., :r].contiguous(), q[..., r:].contiguous()
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    scale = DIMS.qk_head_dim ** -0.5
    return _time_layers(cfg, cell, est_ms, lambda layer: ops.flash_attn_with_kvcache(
        q_rope, cell.pool.k_rope_paged(layer), cell.pool.c_kv_paged(layer), qv=q_lat, page_table=cell.page_table,
        cache_seqlens=seqlens, softmax_scale=scale, causal=True, impl=cfg.impl))


def _measure_latent(cfg: Config, cell: Cell, heads: int, lens: list[int], est_ms: float, kernel, plan_schedule) -> float:
    """``kernel`` (a FlashMLA-style op over the 576-wide rows) alone, its schedule ``plan_schedule(seqlens)``
    planned once, outside the graph."""
    dev = cell.device
    q = _queries(cell.bs, heads, dev, DIMS.latent_dim)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
    schedule = plan_schedule(seqlens)
    scale = DIMS.qk_head_dim ** -0.5
    return _time_layers(cfg, cell, est_ms, lambda layer: kernel(
        q, cell.pool.paged(layer), cell.page_table, seqlens, head_dim_v=DIMS.kv_lora_rank, schedule=schedule,
        softmax_scale=scale, causal=True, impl=cfg.impl))


def measure_flashmla(cfg: Config, cell: Cell, heads: int, lens: list[int], est_ms: float) -> float:
    return _measure_latent(cfg, cell, heads, lens, est_ms, ops.flash_mla_with_kvcache,
                           lambda seqlens: ops.get_mla_decode_metadata(seqlens, heads, impl=cfg.impl))


def measure_splitkv(cfg: Config, cell: Cell, heads: int, lens: list[int], est_ms: float) -> float:
    return _measure_latent(cfg, cell, heads, lens, est_ms, ops.splitkv_mla_with_kvcache,
                           lambda seqlens: ops.get_splitkv_schedule(lens, num_heads=heads, page_size=cell.page,
                                                                    device=cell.device))


MEASURE = {"fa3": measure_fa3, "flashmla": measure_flashmla, "splitkv": measure_splitkv}  # the kernel alone


def plan(cfg: Config) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(cells to run, cells skipped for the memory cap) as (page, bs, ctx), big pools first per page."""
    run, skipped = [], []
    for page in cfg.page:
        for bs in cfg.batch:
            for ctx in cfg.context:
                need = Cell.bytes_needed(page, bs, ctx)
                (run if need <= cfg.mem_cap_gb * 1e9 else skipped).append((page, bs, ctx))
    return run, skipped


def sweep(cfg: Config) -> list[roofline.DecodeRow]:
    """Run every selected shape; returns one DecodeRow per (page, bs, ctx, H, lengths)."""
    device = torch.device(cfg.device)
    ceil = h200_ceilings()
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    cells, skipped = plan(cfg)
    for page, bs, ctx in skipped:
        print(f"skip page {page} bs {bs} ctx {ctx}: pool over the {cfg.mem_cap_gb:g} GB cap", file=sys.stderr)
    kinds = {bs: [k for k in cfg.lengths if not (k == "skewed" and bs == 1)] for bs in cfg.batch}
    total = sum(len(cfg.heads) * len(kinds[bs]) for _, bs, _ in cells)
    rows: list[roofline.DecodeRow] = []
    with Progress(total, quiet=cfg.quiet) as progress:
        for page, bs, ctx in cells:
            cell = Cell(page, bs, ctx, device, gen)
            for heads in cfg.heads:
                bench = BackendBench(cfg, cell, heads, gen) if "backend" not in cfg.skip else None
                kernels = [k for k in ("fa3", "flashmla", "splitkv") if k not in cfg.skip and (k == "fa3" or page == 64)]
                forced = {k: BackendBench(cfg, cell, heads, gen, decode_kernel=k) for k in kernels} \
                    if cfg.whole_step else {}
                for kind in kinds[bs]:
                    lens = lengths_of(kind, bs, ctx)
                    row = roofline.make_row(heads, bs, ctx, page, kind, sum(lens), ceil)
                    row.layers_rotated = cell.rotate
                    for k in kernels:
                        ms = forced[k].measure(lens, row.roofline_ms)[0] if cfg.whole_step else \
                            MEASURE[k](cfg, cell, heads, lens, row.roofline_ms)
                        setattr(row, f"{k}_ms", ms)
                    if bench is not None:
                        row.backend_ms, row.update_ms, row.backend_kernel = bench.measure(lens, row.roofline_ms)
                    rows.append(row)
                    progress.step(_describe(row))
                for b in ([bench] if bench is not None else []) + list(forced.values()):
                    b.close()
            del cell
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def _describe(row: roofline.DecodeRow) -> str:
    def us(t):
        return f"{1e3 * t:.1f}" if t else "-"

    r = row.ratios()
    ratio = f" backend/best {r['backend_over_best']:.2f}" if r["backend_over_best"] else ""
    return (f"page {row.page} H {row.heads} bs {row.batch} ctx {row.context} {row.lengths}: "
            f"backend {us(row.backend_ms)} us ({row.backend_kernel or '-'}) fa3 {us(row.fa3_ms)} "
            f"flashmla {us(row.flashmla_ms)} splitkv {us(row.splitkv_ms)} roofline {us(row.roofline_ms)}{ratio}")


def summary(rows: Sequence[roofline.DecodeRow]) -> str:
    """Median / worst of the ratios over the sweep."""
    lines = []
    for name in roofline.RATIO_FIELDS:
        vals = sorted(v for v in (row.ratios()[name] for row in rows) if v)
        if vals:
            lines.append(f"{name}: median {vals[len(vals) // 2]:.2f}, min {vals[0]:.2f}, max {vals[-1]:.2f} "
                         f"over {len(vals)} shapes")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(part[:-1] if mult > 1 else part) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated ints (8192 or 8k), got {text!r}") from None
        if out[-1] < 1:
            raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return tuple(out)


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def parse_args(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=_ints, help="e.g. 16,128 (default 16,32,64,128)")
    p.add_argument("--batch", type=_ints, help="e.g. 1,64 (default 1,4,16,64,128)")
    p.add_argument("--context", type=_ints, help="e.g. 8192 or 8k,128k (default 1k,4k,16k,64k,128k)")
    p.add_argument("--page", type=_ints, help="page sizes, e.g. 64 (default 1,64)")
    p.add_argument("--lengths", type=_words, help="equal,skewed (default both)")
    p.add_argument("--quick", action="store_true",
                   help="a small subset: H 16,128 x bs 1,64 x ctx 4k,64k, page 64 (on cpu: the smoke shapes)")
    p.add_argument("--skip", type=_words, default=(), help="parts to skip: backend,fa3,flashmla,splitkv")
    p.add_argument("--whole-step", action="store_true",
                   help="time each kernel column as the backend's whole step with that kernel forced (store, "
                        "absorption, kernel, projection, replay update / 61) instead of the kernel alone")
    p.add_argument("--out", help="directory for decode.csv, decode.md, decode_roofline.png")
    p.add_argument("--mem-cap-gb", type=float, default=40.0, help="skip shapes whose latent pool exceeds this")
    p.add_argument("--budget-ms", type=float, default=120.0, help="timed milliseconds per measurement")
    p.add_argument("--max-iters", type=int, default=None,
                   help=f"timed calls per measurement, at most (default: 100; {SMOKE_MAX_ITERS} on cpu)")
    add_device_argument(p)
    p.add_argument("--impl", default="auto", choices=["auto", "fa3", "reference"])
    p.add_argument("--dry-run", action="store_true", help="list the shapes and their roofline, run nothing")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    base = SMOKE if cpu else QUICK if a.quick else FULL
    bad = set(a.skip) - {"backend", "fa3", "flashmla", "splitkv"}
    if bad:
        p.error(f"--skip takes backend, fa3, flashmla, splitkv; got {sorted(bad)}")
    lengths = a.lengths or base["lengths"]
    if set(lengths) - {"equal", "skewed"}:
        p.error(f"--lengths takes equal, skewed; got {lengths}")
    cfg = Config(heads=a.heads or base["heads"], batch=a.batch or base["batch"], context=a.context or base["context"],
                 page=a.page or base["page"], lengths=lengths, device=a.device, impl=a.impl, mem_cap_gb=a.mem_cap_gb,
                 budget_ms=a.budget_ms, max_iters=a.max_iters or (SMOKE_MAX_ITERS if cpu else 100), skip=set(a.skip),
                 quiet=a.quiet, whole_step=a.whole_step)
    return cfg, a


def write_outputs(rows: Sequence[roofline.DecodeRow], out_dir: str, title: str | None = None) -> list[str]:
    """decode.csv, decode.md and (with matplotlib) decode_roofline.png under ``out_dir``; returns the paths.
    ``title``: the table's first line (a smoke run's label)."""
    os.makedirs(out_dir, exist_ok=True)
    ceil = h200_ceilings()
    paths = [os.path.join(out_dir, "decode.csv"), os.path.join(out_dir, "decode.md")]
    roofline.write_csv(rows, paths[0])
    with open(paths[1], "w") as f:
        f.write("# MLA decode benchmark\n\n" + roofline.markdown_table(rows, ceil, title) + "\n```\n" + summary(rows)
                + "```\n")
    png = os.path.join(out_dir, "decode_roofline.png")
    if roofline.plot_roofline(rows, png, ceil):
        paths.append(png)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.dry_run:
        ceil = h200_ceilings()
        cells, skipped = plan(cfg)
        for page, bs, ctx in cells:
            for heads in cfg.heads:
                row = roofline.make_row(heads, bs, ctx, page, "equal", bs * ctx, ceil)
                print(f"page {page} H {heads} bs {bs} ctx {ctx}: roofline {1e3 * row.roofline_ms:.1f} us ({row.bound}), "
                      f"pool {Cell.bytes_needed(page, bs, ctx) / 1e9:.2f} GB")
        for page, bs, ctx in skipped:
            print(f"skip page {page} bs {bs} ctx {ctx}: over the {cfg.mem_cap_gb:g} GB cap")
        return 0
    if refused(PROG, cfg.device):
        return 2
    start_smoke(cfg.device)
    rows = sweep(cfg)
    label = roofline.smoke_label(cfg.device, cfg.impl)  # a CPU / reference run must not read as H200 FA3
    print(roofline.markdown_table(rows, h200_ceilings(), label))
    print(summary(rows))
    if args.out:
        for path in write_outputs(rows, args.out, label):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
