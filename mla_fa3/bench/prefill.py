"""Prefill benchmark on the H200: absorbed vs (chunked) MHA per shape, and what ``policy.prefill_cost`` picks.

One MLA layer, DeepSeek-V3 dims (r 512, d_nope 128, d_rope 64, d_v 128), bf16, page 64, one request
of ``new`` tokens over a cached ``prefix`` (shuffled pages), heads {16, 128} x new {128, 512, 4096,
8192} x prefix {0, 8k, 32k, 64k} by default. Per shape, timed with CUDA events (median, eager — the
way the backend runs extend steps):

* ``absorbed_ms`` — ``absorb.forward_absorbed`` (q absorption, FA3 over the latent cache, W_UV projection);
* ``mha_ms``      — ``chunked_prefix.forward_mha_prefill`` with the step's plan (one-shot without prefix;
  otherwise gather + decompression + varlen attention per workspace chunk + LSE merges);
* ``auto``        — ``prefill_cost.choose_path`` on the host lengths; ``auto_over_best`` = time of the
  chosen path / the faster one (1.0 = auto chose right); ``mha_speedup`` = absorbed / MHA;
* ``model_*_ms``  — the cost model's estimates (re-fit constants from this CSV with
  ``path_choice.fit_cost_constants``; the benchmark prints the re-fitted constants at the end);
* ``plan_ms``     — host + device time of ``build_prefill_plan`` (once per step, shared by all layers);
* ``cosine``      — cosine similarity of the two paths' outputs (a correctness smoke check).

Usage: ``python -m mla_fa3.bench.prefill --out results/prefill.csv`` (or ``mla-fa3 bench prefill``);
``--heads 16 --new 512 --prefix 65536`` narrow the sweep. Takes ~1-2 minutes on the H200, < 8 GB.
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
from mla_fa3.bench.timing import Progress, time_cuda
from mla_fa3.chunked_prefix import PrefillWorkspace, build_prefill_plan, forward_mha_prefill
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.metadata import MetadataBuilder
from mla_fa3.policy.paths import AttentionPath
from mla_fa3.policy.prefill_cost import choose_path, estimate_costs_ms
from mla_fa3.policy.prefill_fit import CostSample, fit_cost_constants

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
    auto_path: str  # what path_choice picked
    auto_ms: float  # measured time of the picked path
    best_path: str
    auto_over_best: float  # >= 1; 1.0 when auto picked the faster path
    mha_speedup: float  # absorbed_ms / mha_ms
    model_absorbed_ms: float
    model_mha_ms: float
    plan_ms: float
    cosine: float  # of the two paths' outputs
    peak_gb: float  # peak device memory of the shape


def _iters(ms_estimate: float, budget_ms: float, lo: int = 3, hi: int = 50) -> int:
    return max(lo, min(hi, int(budget_ms / max(ms_estimate, 1e-3))))


def _layout(pool_pages: int, tokens: int, page: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of one request's ``tokens`` tokens on shuffled pages (page 0 stays the padding page)."""
    pages = torch.randperm(pool_pages - 1, generator=gen)[: -(-tokens // page)] + 1
    j = torch.arange(tokens)
    return pages[j // page] * page + j % page


def run_shape(H: int, new: int, prefix: int, *, page: int, workspace: int, pool: MLATokenPool,
              device: torch.device, budget_ms: float, gen: torch.Generator) -> PrefillRow:
    """Set up one request over a random latent pool, time both paths, ask path_choice."""
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

    def plan_fn():
        return build_prefill_plan(md, r2t.req_to_token, batch.req_pool_indices, workspace, page, workspace=ws)

    plan = plan_fn()
    model = estimate_costs_ms([prefix], [new], num_heads=H, dims=V3, workspace_tokens=workspace)
    mha_key = AttentionPath.MHA_CHUNKED if prefix else AttentionPath.MHA_ONESHOT
    absorbed = lambda: absorb.forward_absorbed(q, layer, md, kv, validate=False)  # noqa: E731
    mha = lambda: forward_mha_prefill(q, latent_new, layer, md, kv, plan)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    a_out, m_out = absorbed(), mha()
    cos = float(torch.nn.functional.cosine_similarity(a_out.float().flatten(), m_out.float().flatten(), dim=0))
    del a_out, m_out
    t_abs = time_cuda(absorbed, warmup=1, iters=_iters(model[AttentionPath.ABSORBED], budget_ms))
    t_mha = time_cuda(mha, warmup=1, iters=_iters(model[mha_key], budget_ms))
    t_plan = time_cuda(plan_fn, warmup=1, iters=5)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    auto = choose_path([prefix], [new], num_heads=H, dims=V3, workspace_tokens=workspace).path
    times = {AttentionPath.ABSORBED: t_abs, mha_key: t_mha}
    best = min(times, key=times.get)
    return PrefillRow(
        heads=H, new=new, prefix=prefix, page=page, workspace=workspace, chunks=len(plan.chunks),
        absorbed_ms=t_abs, mha_ms=t_mha, mha_path=mha_key.value, auto_path=auto.value, auto_ms=times[auto],
        best_path=best.value, auto_over_best=times[auto] / times[best], mha_speedup=t_abs / t_mha,
        model_absorbed_ms=model[AttentionPath.ABSORBED], model_mha_ms=model[mha_key], plan_ms=t_plan,
        cosine=cos, peak_gb=peak)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(rows: Sequence[PrefillRow]) -> str:
    """A markdown table of the measured shapes."""
    head = ("| heads | new | prefix | chunks | absorbed ms | MHA ms | MHA speedup | auto | auto/best "
            "| model abs / MHA ms | cosine |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mark = "" if r.auto_over_best <= 1.0 else " (!)"
        lines.append(
            f"| {r.heads} | {r.new} | {r.prefix} | {r.chunks} | {r.absorbed_ms:.3f} | {r.mha_ms:.3f} "
            f"| {r.mha_speedup:.2f}x | {r.auto_path} | {r.auto_over_best:.3f}{mark} "
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
    """The rows as cost-model samples (for ``path_choice.fit_cost_constants``)."""
    return [CostSample(r.heads, (r.prefix,), (r.new,), r.workspace, r.absorbed_ms, r.mha_ms) for r in rows]


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative ints, got {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mla-fa3 bench prefill", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=_ints, default=[16, 128])
    p.add_argument("--new", type=_ints, default=[128, 512, 4096, 8192], help="new tokens per shape")
    p.add_argument("--prefix", type=_ints, default=[0, 8192, 32768, 65536], help="cached prefix tokens")
    p.add_argument("--workspace", type=int, default=8192, help="MHA chunk budget in tokens (default 8192)")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--budget-ms", type=float, default=300.0, help="timed ms per path and shape (sets iters)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="prefill.csv", help="CSV path (a directory gets prefill.csv inside)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if any(n < 1 for n in args.new) or min(args.heads) < 1:
        p.error("--new and --heads must be >= 1")
    out = args.out if args.out.endswith(".csv") else os.path.join(args.out, "prefill.csv")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    max_tokens = max(args.prefix) + max(args.new)
    pages = 2 + 2 * -(-max_tokens // args.page)  # room to shuffle
    pool = MLATokenPool(1, pages, args.page, V3.kv_lora_rank, V3.qk_rope_head_dim, dtype, device)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, device=device, dtype=dtype))
    shapes = [(h, n, pre) for h in args.heads for n in args.new for pre in args.prefix]
    rows: list[PrefillRow] = []
    t0 = time.perf_counter()
    with Progress(len(shapes)) as prog:
        for h, n, pre in shapes:
            row = run_shape(h, n, pre, page=args.page, workspace=args.workspace, pool=pool, device=device,
                            budget_ms=args.budget_ms, gen=gen)
            rows.append(row)
            prog.step(f"heads {h} new {n} prefix {pre}: absorbed {row.absorbed_ms:.3f} ms, "
                      f"{row.mha_path} {row.mha_ms:.3f} ms, auto {row.auto_path} ({row.auto_over_best:.3f}x best)")
            write_csv(rows, out)  # keep partial results if the run is cut short
    print(table(rows))
    wrong = [r for r in rows if r.auto_over_best > 1.0]
    worst = max((r.auto_over_best for r in rows), default=1.0)
    print(f"\nauto chose the faster path in {len(rows) - len(wrong)}/{len(rows)} shapes; worst auto/best {worst:.3f}")
    print(f"re-fitted cost constants: {fit_cost_constants(samples(rows), V3)}")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
