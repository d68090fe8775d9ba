"""Serving benchmark: a seeded synthetic workload through the continuous-batching loop (``mla_fa3.serve``).

``mla-fa3 bench serve`` (or ``python -m mla_fa3.bench.serve``). The workload: ``--num-requests`` requests,
prompt and output lengths drawn uniformly from ``--prompt-len A-B`` / ``--output-len A-B`` (a single
number = fixed), random token ids, arriving all at once (``--request-rate inf``) or as a Poisson
process of that many requests per second; everything from ``--seed``. The model: a checkpoint
(``--checkpoint``) or an embedded config with random weights — ``v3`` (DeepSeek-V3 attention: r 512,
128/64/128, q_lora 1536, ``--heads`` 16 = one TP-8 rank or 128, ``--layers`` dense layers of hidden
7168; ``serve.configs.bench_config``) or ``tiny`` (the CPU smoke model). The KV pool is sized by the
memory planner (``serve.memory``) for ``--gpu-memory-gib`` (default: the device's memory).

Reports (stdout), per setting: TTFT, TPOT, ITL and E2E mean / p50 / p90 / p99, input / output tokens/s,
requests/s, preemptions; the step breakdown (host time and replay update per step, GPU busy and idle
time, attention time — measured on eager steps with ``--time-attention``, and the roofline time of
the attention bytes ``Σ seq_len · 576 · 2`` per layer at 4.3 TB/s); the histogram of the paths and
kernels the backend chose (``backend.explain()``). ``--compare decode_kernel=fa3,flashmla,auto`` runs
the same workload once per value in one process and prints the settings side by side.

``--out DIR`` writes ``serve.json`` (everything), ``serve_requests.csv``, ``serve_steps.csv`` and, with
matplotlib, ``serve_latency.png`` (TTFT and E2E vs prompt length) and ``serve_timeline.png`` (batch
composition and step time per step). A CPU run (``--device cpu``; without CUDA the benchmark refuses otherwise) is
a smoke run of the machinery on the reference kernels with a tiny workload (``bench.smoke``): its times are not
performance and the report says so, first.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import os
import random
import sys
from typing import Sequence

import torch

from mla_fa3 import ops
from mla_fa3.bench.smoke import SMOKE_LABEL, add_device_argument, refused, start_smoke
from mla_fa3.kv.pools import check_page_size
from mla_fa3.models.deepseek import DeepseekConfig, DeepseekForCausalLM
from mla_fa3.models.loader import load_model
from mla_fa3.policy.decode_kernel import splitkv_possible
from mla_fa3.serve.configs import bench_config, model_config
from mla_fa3.serve.loop import ServingLoop, default_graph_batch_sizes
from mla_fa3.serve.memory import GIB, plan_memory
from mla_fa3.serve.metrics import request_metrics, summarize
from mla_fa3.serve.scheduler import Request

__all__ = ["Workload", "make_requests", "random_model", "run_setting", "main"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COMPARE_KEYS = ("decode_kernel", "kv_dtype", "graphs", "page_size", "token_budget")
PROG = "mla-fa3 bench serve"


@dataclasses.dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    request_rate: float  # requests / s; inf = all at once
    seed: int
    vocab_size: int


def make_requests(w: Workload) -> list[Request]:
    """The workload's requests (fresh objects: a Request carries its progress)."""
    rng = random.Random(w.seed)
    t, out = 0.0, []
    for i in range(w.num_requests):
        n = rng.randint(*w.prompt_len)
        prompt = [rng.randrange(w.vocab_size) for _ in range(n)]
        if math.isfinite(w.request_rate) and i:
            t += rng.expovariate(w.request_rate)
        out.append(Request(rid=i, prompt=prompt, max_new_tokens=rng.randint(*w.output_len), arrival=t))
    return out


@torch.no_grad()
def random_model(cfg: DeepseekConfig, dtype: torch.dtype, device, seed: int) -> DeepseekForCausalLM:
    """``cfg`` with seeded random weights built on ``device``: N(0, 1/in) matrices, N(0, 1) embeddings,
    U(0.5, 1.5) norm weights, N(0, 0.02²) other vectors; W_UK / W_UV derived."""
    torch.manual_seed(seed)
    model = DeepseekForCausalLM(cfg, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if "norm" in name.rsplit(".", 2)[-2]:
            p.uniform_(0.5, 1.5, generator=g)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=g)
        elif p.dim() >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)
    model.prepare_attention()
    return model.eval()


def _span(text: str) -> tuple[int, int]:
    def one(t: str) -> int:
        t = t.strip().lower()
        return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    lo, _, hi = text.partition("-")
    a, b = one(lo), one(hi or lo)
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected N or A-B with 1 <= A <= B (16k-128k), got {text!r}")
    return a, b


def _page_size(text: str) -> int:
    try:
        return check_page_size(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 1 or a power of 2, got {text!r}") from None


def _compare(text: str) -> tuple[str, list[str]]:
    key, _, values = text.partition("=")
    if key not in _COMPARE_KEYS or not values:
        raise argparse.ArgumentTypeError(f"expected KEY=V1,V2 with KEY one of {_COMPARE_KEYS}, got {text!r}")
    if key == "page_size":
        for v in values.split(","):
            _page_size(v)
    return key, values.split(",")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    add_device_argument(p)
    p.add_argument("--checkpoint", metavar="DIR", help="HF checkpoint dir (else an embedded config)")
    p.add_argument("--config", choices=("v3", "tiny"), default=None, help="default: v3 on cuda, tiny on cpu")
    p.add_argument("--heads", type=int, default=16, help="v3: attention heads (16 = one TP-8 rank, or 128)")
    p.add_argument("--layers", type=int, default=4, help="v3: decoder layers")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--num-requests", type=int, default=None, help="default 32 (8 with --quick / on cpu)")
    p.add_argument("--prompt-len", type=_span, default=None, help="A-B or N, e.g. 16k-128k (default)")
    p.add_argument("--output-len", type=_span, default=None, help="A-B or N (default 256)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=_page_size, default=None,
                   help="1 or a power of 2 (default 64 on cuda, 16 on cpu)")
    p.add_argument("--max-running", type=int, default=None, help="default: the number of requests (<= 128)")
    p.add_argument("--token-budget", type=int, default=None, help="new tokens per step (default 8192; 64 on cpu)")
    p.add_argument("--decode-kernel", default="auto", choices=("auto", "fa3", "flashmla"))
    p.add_argument("--no-graphs", action="store_true", help="eager decode steps (default: CUDA graphs on cuda)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory the planner sizes the pool for")
    p.add_argument("--time-attention", action="store_true", help="events around attention in eager steps")
    p.add_argument("--compare", type=_compare, default=None, metavar="KEY=V1,V2",
                   help=f"run the workload once per value; KEY in {_COMPARE_KEYS}")
    p.add_argument("--quick", action="store_true", help="8 requests, 8k-32k prompts, 64 new tokens")
    p.add_argument("--out", help="directory for serve.json, CSVs and PNGs")
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    a.config = a.config or ("tiny" if cpu and not a.checkpoint else "v3")
    a.dtype = a.dtype or ("fp32" if cpu else "bf16")
    a.num_requests = a.num_requests or (8 if (cpu or a.quick) else 32)
    a.prompt_len = a.prompt_len or ((16, 64) if cpu else (8192, 32768) if a.quick else (16384, 131072))
    a.output_len = a.output_len or ((4, 16) if cpu else (64, 64) if a.quick else (256, 256))
    a.page_size = a.page_size or (16 if cpu else 64)
    a.max_running = a.max_running or min(a.num_requests, 128)
    a.token_budget = a.token_budget or (64 if cpu else 8192)
    return a


def _settings(args) -> list[dict]:
    base = dict(decode_kernel=args.decode_kernel, kv_dtype="bf16" if args.dtype == "bf16" else args.dtype,
                graphs="off" if args.no_graphs or args.device == "cpu" else "on", page_size=str(args.page_size),
                token_budget=str(args.token_budget))
    if args.compare is None:
        return [base]
    key, values = args.compare
    return [dict(base, **{key: v}) for v in values]


def _graph_kernel_count(setting: dict, page: int, heads: int, device) -> int:
    """Graphs per batch size the backend will capture (the memory plan sizes their memory): FA3 and
    FlashMLA under 'auto' on page 64, plus split-KV where its kernel runs and the table can pick it."""
    if setting["kv_dtype"] == "fp8" or setting["decode_kernel"] != "auto" or page != 64:
        return 1
    return 3 if ops.splitkv_available(device) and splitkv_possible(heads) else 2


def run_setting(model: DeepseekForCausalLM, workload: Workload, setting: dict, args, progress=None) -> dict:
    """One run of the workload with ``setting``; returns the report entry (summary, requests, steps)."""
    cfg = model.config
    if setting["kv_dtype"] not in ("bf16", args.dtype):
        raise ValueError(f"kv_dtype {setting['kv_dtype']!r}: the latent pool stores the model dtype ({args.dtype}); "
                         "an fp8 latent pool is not available in this build")
    page, budget = int(setting["page_size"]), int(setting["token_budget"])
    max_context = workload.prompt_len[1] + workload.output_len[1]
    graphs = setting["graphs"] == "on"
    sizes = [b for b in default_graph_batch_sizes(args.max_running)] if graphs else []
    if args.device == "cpu":
        plan, num_pages = None, args.max_running * -(-max_context // page) + 1
    else:
        gib = args.gpu_memory_gib or torch.cuda.get_device_properties(args.device).total_memory / GIB
        plan = plan_memory(cfg, gpu_memory_gib=gib, weight_dtype=args.dtype, kv_dtype=setting["kv_dtype"],
                           page_size=page, max_running=args.max_running, max_context=max_context,
                           token_budget=budget, graph_batch_sizes=sizes,
                           graph_kernels=_graph_kernel_count(setting, page, cfg.num_attention_heads, args.device))
        num_pages = None
    loop = ServingLoop(model, page_size=page, max_running=args.max_running, max_context=max_context,
                       num_pages=num_pages, memory_plan=plan, token_budget=budget, use_cuda_graph=graphs,
                       cuda_graph_batch_sizes=sizes or None, decode_kernel=setting["decode_kernel"],
                       time_attention=args.time_attention)
    if args.device != "cpu":  # warm-up: lazy inits, autotuning, allocator growth — then fresh records
        loop.run([Request(rid=-1 - i, prompt=[1] * 256, max_new_tokens=4) for i in range(2)])
        loop.steps.clear()
        loop.times.clear()
    requests = make_requests(workload)
    loop.run(requests, progress=progress)
    elem = model.lm_head.weight.element_size()
    summary = summarize(requests, loop.times, loop.steps, num_layers=cfg.num_hidden_layers,
                        latent_bytes_per_token=(cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem)
    entry = dict(setting=setting, num_pages=loop.allocator.num_pages,
                 kv_tokens=(loop.allocator.num_pages - 1) * page, plan=None if plan is None else plan.to_dict(),
                 summary=summary.to_dict(),
                 requests=[dataclasses.asdict(request_metrics(r, loop.times[r.rid])) for r in requests],
                 steps=[dataclasses.asdict(s) for s in loop.steps])
    if loop.graph_runner is not None:
        loop.graph_runner.close()
    del loop
    gc.collect()  # the loop and its graph runner hold each other: free the pool before the next setting
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return entry


def _fmt(v, digits=2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def format_report(runs: list[dict], label: str) -> str:
    """The side-by-side table of every setting's summary."""
    varied = [k for k in runs[0]["setting"] if len({r["setting"][k] for r in runs}) > 1]
    names = [",".join(f"{k}={r['setting'][k]}" for k in varied) or "value" for r in runs]
    rows: list[tuple[str, list[str]]] = []

    def add(name, fn, digits=2):
        rows.append((name, [_fmt(fn(r["summary"]), digits) for r in runs]))

    add("requests", lambda s: s["requests"])
    add("input / output tokens", lambda s: f"{s['input_tokens']} / {s['output_tokens']}")
    add("duration s", lambda s: s["duration_s"], 3)
    add("requests/s", lambda s: s["request_throughput"], 3)
    add("input tokens/s", lambda s: s["input_throughput"], 1)
    add("output tokens/s", lambda s: s["output_throughput"], 1)
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for q in ("mean", "p50", "p90", "p99"):
            add(f"{m[:-3].upper()} {q} ms", lambda s, m=m, q=q: s[m][q])
    add("preemptions", lambda s: s["preemptions"])
    add("steps (by mode)", lambda s: " ".join(f"{k}:{v}" for k, v in sorted(s["steps_by_mode"].items())))
    add("graph steps", lambda s: s["graph_steps"])
    add("host ms/step p50", lambda s: s["host_ms_per_step"]["p50"], 3)
    add("host ms/step p99", lambda s: s["host_ms_per_step"]["p99"], 3)
    add("replay update ms/step p50 (graph steps)", lambda s: s["replay_update_ms_per_step"]["p50"], 3)
    add("replay update ms/step p99 (graph steps)", lambda s: s["replay_update_ms_per_step"]["p99"], 3)
    add("metadata + plan ms/step p50 (eager steps)", lambda s: s["eager_metadata_ms_per_step"]["p50"], 3)
    add("GPU busy ms", lambda s: s["gpu_ms_total"], 1)
    add("GPU idle ms", lambda s: s["gpu_idle_ms_total"], 1)
    add("attention ms (eager, measured)", lambda s: s["attention_ms_total"], 1)
    add("attention roofline ms", lambda s: s["attention_roofline_ms_total"], 1)
    add("attention % of roofline", lambda s: s["attention_pct_of_roofline"], 1)
    add("kernels/paths", lambda s: " ".join(f"{k}:{v}" for k, v in sorted(s["kernels"].items())))
    width = max(len(n) for n, _ in rows)
    cols = [max(len(names[i]), *(len(v[i]) for _, v in rows)) for i in range(len(runs))]
    common = ", ".join(f"{k}={v}" for k, v in runs[0]["setting"].items() if k not in varied)
    out = [label, f"settings: {common}", f"{'':<{width}}  " + "  ".join(n.rjust(c) for n, c in zip(names, cols))]
    for name, vals in rows:
        out.append(f"{name:<{width}}  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)))
    return "\n".join(out)


def write_outputs(report: dict, out_dir: str) -> list[str]:
    """serve.json, serve_requests.csv, serve_steps.csv and (matplotlib) the two PNGs; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "serve.json")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1, default=str)
    for kind in ("requests", "steps"):
        path = os.path.join(out_dir, f"serve_{kind}.csv")
        rows = [dict(setting=",".join(f"{k}={v}" for k, v in run["setting"].items()), **row)
                for run in report["runs"] for row in run[kind]]
        if rows:
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            paths.append(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in report["runs"]:
        name = ",".join(f"{k}={v}" for k, v in run["setting"].items())
        xs = [r["prompt_tokens"] for r in run["requests"]]
        ax.scatter(xs, [r["ttft_s"] for r in run["requests"]], s=12, label=f"TTFT {name}")
        ax.scatter(xs, [r["e2e_s"] for r in run["requests"]], s=12, marker="x", label=f"E2E {name}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds")
    ax.set_title(report["label"], fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "serve_latency.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    run = report["runs"][0]
    steps = run["steps"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    idx = [s["index"] for s in steps]
    a1.bar(idx, [s["decode_rows"] for s in steps], width=1.0, label="decode rows")
    a1.bar(idx, [s["prefill_tokens"] for s in steps], width=1.0, bottom=[s["decode_rows"] for s in steps],
           label="prefill tokens")
    a1.set_yscale("symlog")
    a1.set_ylabel("tokens in step")
    a1.legend(fontsize=7)
    gpu = [s["gpu_ms"] for s in steps]
    a2.plot(idx, [s["host_ms"] for s in steps], label="host ms", lw=0.8)
    if any(g is not None for g in gpu):
        a2.plot(idx, [g or 0.0 for g in gpu], label="GPU ms", lw=0.8)
        a2.plot(idx, [s["idle_ms"] or 0.0 for s in steps], label="GPU idle ms", lw=0.8)
    a2.set_yscale("log")
    a2.set_xlabel("step")
    a2.set_ylabel("ms")
    a2.legend(fontsize=7)
    a1.set_title(f"{report['label']} — {','.join(f'{k}={v}' for k, v in run['setting'].items())}", fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "serve_timeline.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if refused(PROG, args.device):
        return 2
    start_smoke(args.device)
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    if args.checkpoint:
        model = load_model(args.checkpoint, dtype=dtype, device=device)
        what = args.checkpoint
    else:
        cfg = model_config("tiny") if args.config == "tiny" else bench_config(args.heads, args.layers)
        model = random_model(cfg, dtype, device, args.seed)
        what = "tiny (random weights)" if args.config == "tiny" else \
            f"DeepSeek-V3 attention, {args.heads} heads, {args.layers} layers (random weights)"
    workload = Workload(args.num_requests, args.prompt_len, args.output_len, args.request_rate, args.seed,
                        model.config.vocab_size)
    cpu_note = f" — {SMOKE_LABEL}" if device.type == "cpu" else ""  # the plots' and serve.json's label too
    label = (f"bench serve: {what}, {args.dtype}, {args.num_requests} requests, prompts {args.prompt_len[0]}-"
             f"{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]}, rate {args.request_rate}"
             f"{cpu_note}")
    runs = []
    for setting in _settings(args):
        bar = None
        if not args.quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                bar = tqdm(total=args.num_requests, desc=",".join(f"{k}={v}" for k, v in setting.items()),
                           unit="req", file=sys.stderr)
            except ImportError:
                bar = None

        def progress(done, total, bar=bar):
            if bar is not None:
                bar.n = done
                bar.refresh()
        runs.append(run_setting(model, workload, setting, args, progress=progress))
        if bar is not None:
            bar.close()
    report = dict(label=label, cpu_smoke=device.type == "cpu", args={k: str(v) for k, v in vars(args).items()},
                  workload=dataclasses.asdict(workload), runs=runs)
    print(format_report(runs, label))
    if args.out:
        for path in write_outputs(report, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
