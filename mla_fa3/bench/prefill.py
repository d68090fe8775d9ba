"""Prefill benchmark on the H200: absorbed vs (chunked) MHA per shape, and what ``policy.prefill_cost`` picks.

One MLA layer, DeepSeek-V3 dims (r 512, d_nope 128, d_rope 64, d_v 128), bf16, page 64, one request
of ``new`` tokens over a cached ``prefix`` (shuffled pages), heads {16, 128} x new {1024, 4096, 8192} x
prefix {16k, 64k, 128k} by default (``--quick``: heads {16, 128} x new {1024, 4096} x prefix {16k, 64k}).
The workspace is a byte budget (``--workspace-bytes``, default ``PREFILL_WORKSPACE_BYTES`` = 512 MiB; tokens
per chunk follow from the head count) unless ``--workspace`` gives tokens. Per shape, timed with CUDA
events (median, eager — the way the backend runs extend steps):

* ``absorbed_ms`` — ``absorb.forward_absorbed`` (q absorption, FA3 over the latent cache, W_UV projection);
* ``mha_ms``      — ``chunked_prefix.forward_mha_prefill`` with the step's plan (one-shot without prefix;
  otherwise gather + decompression + varlen attention per workspace chunk + LSE merges);
* ``auto``        — ``prefill_cost.choose_path`` on the host lengths; ``auto_over_best`` = time of the
  chosen path / the faster one (1.0 = auto chose right); ``mha_speedup`` = absorbed / MHA;
* ``model_*_ms``  — the cost model's estimates (re-fit constants from this CSV with
  ``policy.prefill_fit.fit_cost_constants``; the benchmark prints the re-fitted constants at the end);
* ``plan_ms``     — host + device time of ``build_prefill_plan`` (once per step, shared by all layers);
* ``host_us_per_chunk`` — host time of one layer's MHA call (no sync: Python + launches) / (chunks + 1);
* ``ceiling_ms``  — the MHA path's work at 790 TFLOP/s: attention ``2·H·T·(P + T/2)·(d_qk + d_v)`` plus
  decompression ``(P + T)·r·H·(d_nope + d_v)·2`` FLOPs (T new, P prefix); ``mha_pct_ceiling`` = ceiling / MHA ms;
* ``absorbed_ms`` is skipped (NaN, ``absorbed_skipped`` = 1) when the cost model puts it > 10x the MHA path;
* ``cosine``      — cosine similarity of the two paths' outputs (a correctness smoke check);
* ``mha_graph_ms`` (``--graph``) — the same MHA call replayed from a CUDA graph (``prefill_graph``: a first
  step of the shape runs eagerly, the timed calls replay; each includes copying q in and the output out);
  ``graph_pct_ceiling`` = ceiling / it; ``graph_host_us`` = host time of one such layer call (all chunks).

Usage: ``python -m mla_fa3.bench.prefill --out $OUT/prefill --repeat 2`` (or ``mla-fa3 bench prefill``):
writes ``prefill_run{i}.csv`` / ``.md`` per repeat under the directory and prints the table, the MHA
run-to-run spread and, on a GPU, the re-fitted cost constants (``policy.prefill_fit``), ready to paste into
``H200_COSTS``. ``--heads 16 --new 512 --prefix 65536`` narrow the sweep. Budget: < 3 minutes on the H200.
``--device cpu``: a smoke run on the reference kernels (``bench.smoke``: the ``SMOKE`` shapes, a few iterations, no
constants fitted from its timings).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from mla_fa3 import absorb
from mla_fa3.batch import ForwardBatch
from mla_fa3.bench.smoke import SMOKE_LABEL, add_device_argument, refused, start_smoke
from mla_fa3.bench.timing import Progress, time_cuda
from mla_fa3.chunked_prefix import forward_mha_prefill
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.prefill_graph import PrefillGraphs
from mla_fa3.prefill_plan import PREFILL_WORKSPACE_BYTES, PrefillWorkspace, build_prefill_plan, workspace_tokens_for_bytes
from mla_fa3.policy.paths import AttentionPath
from mla_fa3.policy.prefill_cost import choose_path, estimate_costs_ms
from mla_fa3.policy.prefill_fit import CostSample, constants_source, fit_cost_constants

V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@dataclass
class PrefillRow:
    """One measured shape (one layer). Times in ms."""

    heads: int
    new: int  # new tokens (queries) of the request
    prefix: int  # cached prefix tokens
    page: int
    workspace: int  # chunk budget in tokens
    chunks: int  # prefix chunks of the MHA path
    absorbed_ms: float
    mha_ms: float
    mha_path: str  # mha_oneshot / mha_chunked
    auto_path: str  # what the prefill cost model picked
    auto_ms: float  # measured time of the picked path
    best_path: str
    auto_over_best: float  # >= 1; 1.0 when auto picked the faster path
    mha_speedup: float  # absorbed_ms / mha_ms
    model_absorbed_ms: float
    model_mha_ms: float
    plan_ms: float
    host_us_per_chunk: float  # host time of one MHA layer call / (chunks + 1)
    ceiling_ms: float  # MHA FLOPs (attention + decompression) at PEAK_TFLOPS
    mha_pct_ceiling: float  # 100 * ceiling_ms / mha_ms
    absorbed_skipped: int  # 1: absorbed not timed (modelled > 10x the MHA path); its ms are the model's
    cosine: float  # of the two paths' outputs (NaN when absorbed was skipped)
    peak_gb: float  # peak device memory of the shape
    run: int = 0  # repeat index
    mha_graph_ms: float = math.nan  # the MHA path replayed from a CUDA graph (--graph; prefill_graph.PrefillGraphs)
    graph_pct_ceiling: float = math.nan  # 100 * ceiling_ms / mha_graph_ms
    graph_host_us: float = math.nan  # host time of one graph-replayed layer call (copy in, replay, clone out)


PROG = "mla-fa3 bench prefill"
SMOKE = dict(heads=[16, 128], new=[64], prefix=[0, 512])  # --device cpu (bench.smoke), in place of the defaults
PEAK_TFLOPS = 790.0  # H200 dense bf16 GEMM rate reached in practice (shared/device/README.md)
SKIP_RATIO = 10.0  # absorbed modelled this many times slower than MHA: not timed


def mha_flops(H: int, new: int, prefix: int, dims: MLADims = None) -> float:
    """The MHA path's FLOPs: attention 2·H·T·(P + T/2)·(d_qk + d_v) + decompression (P + T)·r·H·(d_nope + d_v)·2."""
    d = V3 if dims is None else dims
    attn = 2.0 * H * new * (prefix + new / 2) * (d.qk_head_dim + d.v_head_dim)
    decomp = (prefix + new) * d.kv_lora_rank * H * (d.qk_nope_head_dim + d.v_head_dim) * 2.0
    return attn + decomp


def _iters(ms_estimate: float, budget_ms: float, lo: int = 3, hi: int = 50) -> int:
    return max(lo, min(hi, int(budget_ms / max(ms_estimate, 1e-3))))


def _layout(pool_pages: int, tokens: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of one request's ``tokens`` tokens on shuffled pages (page 0 stays the padding page)."""
    pages = torch.randperm(pool_pages - 1, generator=gen)[: -(-tokens // page)] + 1
    j = torch.arange(tokens)
    return pages[j // page] * page + j % page


def run_shape(H: int, new: int, prefix: int, *, page: int, workspace: int, pool: MLATokenPool,
              device: torch.device, budget_ms: float, gen: torch.Generator, graph: bool = False) -> PrefillRow:
    """Set up one request over a random latent pool, time both paths, ask the prefill cost model."""
    dtype = pool.dtype
    total = prefix + new
    r2t = ReqToTokenPool(2, total + page, device)
    r2t.claim([1], total)  # the benchmark writes its row itself
    slots = _layout(pool.num_pages, total, page, gen).to(device)
    r2t.req_to_token[1, :total] = slots.to(torch.int32)
    batch = ForwardBatch.extend([1], [prefix], [new], slots[prefix:], device)
    md = MetadataBuilder(r2t, page, device).build(batch)
    w = torch.randn(H * (V3.qk_nope_head_dim + V3.v_head_dim), V3.kv_lora_rank, device=device, dtype=dtype)
    layer = AttentionLayer.mla_layer(0, H, V3, V3.qk_head_dim ** -0.5,
                                     kv_b_proj_weight=w / math.sqrt(V3.kv_lora_rank))
    q = torch.randn(new, H, V3.qk_head_dim, device=device, dtype=dtype)
    latent_new = pool.kv_buffer[0][slots[prefix:]]
    kv = pool.paged(0)
    ws = PrefillWorkspace(workspace)
    mha_flop_ms = mha_flops(H, new, prefix) / (PEAK_TFLOPS * 1e9)

    def plan_fn():
        return build_prefill_plan(md, r2t.req_to_token, batch.req_pool_indices, workspace, page, workspace=ws)

    plan = plan_fn()
    model = estimate_costs_ms([prefix], [new], num_heads=H, dims=V3, workspace_tokens=workspace)
    mha_key = AttentionPath.MHA_CHUNKED if prefix else AttentionPath.MHA_ONESHOT
    absorbed = lambda: absorb.forward_absorbed(q, layer, md, kv, validate=False)  # noqa: E731
    mha = lambda: forward_mha_prefill(q, latent_new, layer, md, kv, plan)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skip = model[AttentionPath.ABSORBED] > SKIP_RATIO * model[mha_key]
    m_out = mha()
    if skip:
        cos = math.nan
    else:
        a_out = absorbed()
        cos = float(torch.nn.functional.cosine_similarity(a_out.float().flatten(), m_out.float().flatten(), dim=0))
        del a_out
    del m_out
    t_abs = model[AttentionPath.ABSORBED] if skip else time_cuda(
        absorbed, warmup=1, iters=_iters(model[AttentionPath.ABSORBED], budget_ms, hi=20))
    t_mha = time_cuda(mha, warmup=2, iters=_iters(model[mha_key], budget_ms))
    t_plan = time_cuda(plan_fn, warmup=1, iters=5)
    host_us = _host_us(mha, device) / (len(plan.chunks) + 1)
    t_graph = graph_host = math.nan
    if graph and device.type == "cuda":  # a first step of the shape (eager), then the timed one replays
        graphs = PrefillGraphs(max_shapes=1)
        forward_mha_prefill(q, latent_new, layer, md, kv, plan_fn(), graphs=graphs)
        replayed = lambda: forward_mha_prefill(q, latent_new, layer, md, kv, plan, graphs=graphs)  # noqa: E731
        t_graph = time_cuda(replayed, warmup=2, iters=_iters(model[mha_key], budget_ms))
        graph_host = _host_us(replayed, device)
        assert graphs.stats["captures"] == 1, graphs.stats
        del graphs
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    auto = choose_path([prefix], [new], num_heads=H, dims=V3, workspace_tokens=workspace).path
    times = {AttentionPath.ABSORBED: t_abs, mha_key: t_mha}
    best = min(times, key=times.get)
    return PrefillRow(
        heads=H, new=new, prefix=prefix, page=page, workspace=workspace, chunks=len(plan.chunks),
        absorbed_ms=t_abs, mha_ms=t_mha, mha_path=mha_key.value, auto_path=auto.value, auto_ms=times[auto],
        best_path=best.value, auto_over_best=times[auto] / times[best], mha_speedup=t_abs / t_mha,
        model_absorbed_ms=model[AttentionPath.ABSORBED], model_mha_ms=model[mha_key], plan_ms=t_plan,
        host_us_per_chunk=host_us, ceiling_ms=mha_flop_ms, mha_pct_ceiling=100.0 * mha_flop_ms / t_mha,
        absorbed_skipped=int(skip), cosine=cos, peak_gb=peak, mha_graph_ms=t_graph,
        graph_pct_ceiling=100.0 * mha_flop_ms / t_graph, graph_host_us=graph_host)


def _host_us(fn, device: torch.device) -> float:
    """Median host time of one call (us), the device idle at its start: Python + launches, no device work."""
    host = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sorted(host)[len(host) // 2] * 1e6


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(rows: Sequence[PrefillRow]) -> str:
    """A markdown table of the measured shapes."""
    head = ("| heads | new | prefix | W | chunks | absorbed ms | MHA ms | MHA % ceiling | MHA graph ms (% ceiling) "
            "| chunked/absorbed speedup | plan ms | host us/chunk | auto | auto/best | model abs / MHA ms | cosine |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mark = "" if r.auto_over_best <= 1.0 else " (!)"
        absorbed = f"{r.absorbed_ms:.3f}" + (" (model, skipped)" if r.absorbed_skipped else "")
        graph = "-" if math.isnan(r.mha_graph_ms) else \
            f"{r.mha_graph_ms:.3f} ({r.graph_pct_ceiling:.0f} %, host {r.graph_host_us:.0f} us)"
        lines.append(
            f"| {r.heads} | {r.new} | {r.prefix} | {r.workspace} | {r.chunks} | {absorbed} | {r.mha_ms:.3f} "
            f"| {r.mha_pct_ceiling:.0f} % | {graph} | {r.mha_speedup:.2f}x | {r.plan_ms:.3f} | {r.host_us_per_chunk:.0f} "
            f"| {r.auto_path} | {r.auto_over_best:.3f}{mark} "
            f"| {r.model_absorbed_ms:.3f} / {r.model_mha_ms:.3f} | {r.cosine:.5f} |")
    return "\n".join(lines)


def write_csv(rows: Sequence[PrefillRow], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=list(PrefillRow.__dataclass_fields__))
        out.writeheader()
        for r in rows:
            out.writerow({k: _fmt(v) for k, v in asdict(r).items()})


def samples(rows: Sequence[PrefillRow]) -> list[CostSample]:
    """The rows as cost-model samples (for ``policy.prefill_fit.fit_cost_constants``; skipped absorbed times left out)."""
    return [CostSample(r.heads, (r.prefix,), (r.new,), r.workspace, None if r.absorbed_skipped else r.absorbed_ms,
                       r.mha_ms) for r in rows]


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative ints, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=_ints, default=None, help="head counts (default 16,128)")
    p.add_argument("--new", type=_ints, default=None, help="new tokens per shape (default 1024,4096,8192)")
    p.add_argument("--prefix", type=_ints, default=None, help="cached prefix tokens (default 16384,65536,131072)")
    p.add_argument("--quick", action="store_true",
                   help="heads 16,128 x new 1024,4096 x prefix 16k,64k (on cpu: the smoke shapes)")
    p.add_argument("--workspace-bytes", type=int, default=PREFILL_WORKSPACE_BYTES,
                   help="MHA workspace budget in bytes (default 512 MiB); tokens per chunk follow per head count")
    p.add_argument("--workspace", type=int, default=None, help="tokens per chunk (overrides --workspace-bytes)")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="runs of the sweep (run-to-run spread)")
    p.add_argument("--graph", action="store_true",
                   help="also time the MHA path replayed from a CUDA graph (column mha_graph_ms; CUDA only)")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timed ms per path and shape (sets iters; default 60, on cpu 0: the fewest iterations)")
    add_device_argument(p)
    p.add_argument("--out", default="prefill", help="directory of the CSV / markdown files (or a .csv path)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    smoke = args.device == "cpu"
    shapes = SMOKE if smoke else dict(heads=[16, 128], new=[1024, 4096] if args.quick else [1024, 4096, 8192],
                                      prefix=[16384, 65536] if args.quick else [16384, 65536, 131072])
    args.heads, args.new, args.prefix = (args.heads or shapes["heads"], args.new or shapes["new"],
                                         args.prefix or shapes["prefix"])
    if args.budget_ms is None:
        args.budget_ms = 0.0 if smoke else 60.0
    if any(n < 1 for n in args.new) or min(args.heads) < 1 or args.repeat < 1:
        p.error("--new, --heads and --repeat must be >= 1")
    base = args.out[:-4] if args.out.endswith(".csv") else os.path.join(args.out, "prefill")
    if refused(PROG, args.device):
        return 2
    start_smoke(args.device)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    max_tokens = max(args.prefix) + max(args.new)
    pages = 2 + 2 * -(-max_tokens // args.page)  # room to shuffle
    pool = MLATokenPool(1, pages, args.page, V3.kv_lora_rank, V3.qk_rope_head_dim, dtype, device)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, device=device, dtype=dtype))
    shapes = [(h, n, pre) for h in args.heads for n in args.new for pre in args.prefix]
    runs: list[list[PrefillRow]] = []
    t0 = time.perf_counter()
    with Progress(len(shapes) * args.repeat) as prog:
        for run in range(args.repeat):
            rows: list[PrefillRow] = []
            runs.append(rows)
            out = f"{base}_run{run + 1}.csv"
            for h, n, pre in shapes:
                W = args.workspace or workspace_tokens_for_bytes(h, V3, args.workspace_bytes, dtype, page_size=args.page)
                row = run_shape(h, n, pre, page=args.page, workspace=W, pool=pool, device=device,
                                budget_ms=args.budget_ms, gen=gen, graph=args.graph)
                row.run = run + 1
                rows.append(row)
                prog.step(f"run {run + 1} heads {h} new {n} prefix {pre}: absorbed {row.absorbed_ms:.3f} ms, "
                          f"{row.mha_path} {row.mha_ms:.3f} ms ({row.mha_pct_ceiling:.0f} % of ceiling), "
                          f"auto {row.auto_path} ({row.auto_over_best:.3f}x best)")
                write_csv(rows, out)  # keep partial results if the run is cut short
            with open(f"{base}_run{run + 1}.md", "w") as f:
                f.write(f"Command: python -m mla_fa3.bench.prefill {' '.join(argv if argv is not None else sys.argv[1:])}\n\n")
                f.write(SMOKE_LABEL + "\n\n" if smoke else "")
                f.write(f"MHA ceiling: attention 2*H*T*(P + T/2)*320 + decompression (P + T)*512*H*256*2 FLOPs "
                        f"at {PEAK_TFLOPS:.0f} TFLOP/s\n\n" + table(rows) + "\n")
    for rows in runs:
        print(table(rows))
    if len(runs) > 1:
        spread = [max(r.mha_ms for r in group) / min(r.mha_ms for r in group) - 1 for group in zip(*runs)]
        print(f"\nMHA run-to-run spread: max {100 * max(spread):.1f} % over {len(spread)} shapes")
    if not smoke:  # the cost model is judged and fitted on GPU timings only, never on the CPU reference's
        rows = runs[-1]
        wrong = [r for r in rows if r.auto_over_best > 1.0]
        worst = max((r.auto_over_best for r in rows), default=1.0)
        print(f"\nauto chose the faster path in {len(rows) - len(wrong)}/{len(rows)} shapes; worst auto/best {worst:.3f}")
        fitted = fit_cost_constants([s for rows in runs for s in samples(rows)], V3)
        print("re-fitted cost constants (paste into policy/prefill_cost.py H200_COSTS):\n" + constants_source(fitted))
    print(f"wrote {base}_run*.csv / .md ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
