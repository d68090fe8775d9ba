"""``mla-fa3`` command line (also ``python -m mla_fa3.cli`` / ``python -m mla_fa3``).

Commands::

    mla-fa3 validate [--checkpoint DIR] [--page-size N] [--dtype D] [--steps N] [--device D]
        Our DeepSeek model on the MLA backend vs transformers' model: prefill logits, step-by-step
        paged decode logits, greedy tokens (see mla_fa3.models.hf_compare). Without --checkpoint, a
        tiny DeepSeek-V3 (q_lora, grouped MoE, YaRN) with random weights is built and saved to a temp
        dir first (no downloads; --config picks another embedded config, and on cuda the default is
        v3_mla_dims: FA3 implements the real MLA head dims only). Prints a table; exit status 1 when
        a threshold is missed.
    mla-fa3 generate --checkpoint DIR --prompt-ids 1 2 3 [--max-new-tokens N] [--page-size N] [--json]
                     [--eos-token-id ID] [--dtype D] [--device D] [--cuda-graph]
        Greedy generation; --json prints {"token_ids": [...new tokens...]}.
    mla-fa3 bench decode|prefill [args...]
        Dispatches to mla_fa3.bench.decode:main(argv) / mla_fa3.bench.prefill:main(argv).

Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

__all__ = ["main", "build_parser"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
_BENCHES = ("decode", "prefill", "fp8")
TINY_NAMES = ("tiny_v3", "tiny_v2", "v3_mla_dims")  # mla_fa3.models.tiny.TINY_CONFIGS (not imported: fast --help)


def _progress(quiet: bool):
    start = time.monotonic()

    def say(msg: str) -> None:
        if not quiet:
            print(f"[{time.monotonic() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-fa3", description="MLA attention backend on FlashAttention-3: "
                                     "validate DeepSeek models against transformers, generate, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, *, checkpoint_required: bool) -> None:
        p.add_argument("--checkpoint", required=checkpoint_required, metavar="DIR",
                       help="HF checkpoint dir (config.json + safetensors)")
        p.add_argument("--page-size", type=_positive, default=None,
                       help="KV page size (1 or a power of 2; default 16, 64 with --kv-dtype fp8)")
        p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="model / KV dtype")
        p.add_argument("--device", default="cpu", help="cpu (reference kernels) or cuda (FA3)")
        p.add_argument("--threads", type=_positive, default=None,
                       help="torch CPU threads (default 1 on cpu: small ops run fastest single-threaded)")
        p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
        p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                       help="latent KV cache dtype: auto (= --dtype) or fp8 (e4m3, page size 64, FlashMLA)")
        p.add_argument("--kv-scale", type=float, default=None,
                       help="fp8: one scale for every layer (default: the checkpoint's, else 1.0)")

    v = sub.add_parser("validate", help="compare our model on the backend with transformers")
    common(v, checkpoint_required=False)
    v.add_argument("--steps", type=_positive, default=16, help="decode steps to compare")
    v.add_argument("--seed", type=int, default=0, help="seed of the tiny model and the prompts")
    v.add_argument("--config", choices=sorted(TINY_NAMES), default=None,
                   help="embedded config when no --checkpoint (default tiny_v3 on cpu, v3_mla_dims on cuda)")
    v.add_argument("--max-prefill-tokens", type=_positive, default=None, help="chunked prefill budget")
    v.add_argument("--cuda-graph", action="store_true", help="decode through CUDA graphs")
    v.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")

    g = sub.add_parser("generate", help="greedy generation from token ids")
    common(g, checkpoint_required=True)
    g.add_argument("--prompt-ids", type=int, nargs="+", required=True, metavar="ID")
    g.add_argument("--max-new-tokens", type=_positive, default=16)
    g.add_argument("--eos-token-id", type=int, default=None, help="stop a request at this token (kept)")
    g.add_argument("--max-prefill-tokens", type=_positive, default=None, help="chunked prefill budget")
    g.add_argument("--cuda-graph", action="store_true", help="decode through CUDA graphs")
    g.add_argument("--json", action="store_true", help='print {"token_ids": [...]} (new tokens only)')

    b = sub.add_parser("bench", help="benchmarks (mla_fa3.bench.*)")
    b.add_argument("which", choices=_BENCHES)
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    return parser


def _setup(args):
    import torch

    if args.page_size is None:
        args.page_size = 64 if args.kv_dtype == "fp8" else 16
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu":
        torch.set_num_threads(1)
    return getattr(torch, _DTYPES[args.dtype])


def _validate(args) -> int:
    from mla_fa3.models.hf_compare import format_report, report_json, run_validate

    dtype = _setup(args)
    report = run_validate(args.checkpoint, page_size=args.page_size, dtype=dtype, steps=args.steps,
                          device=args.device, seed=args.seed, max_prefill_tokens=args.max_prefill_tokens,
                          use_cuda_graph=args.cuda_graph, config=args.config, progress=_progress(args.quiet),
                          kv_dtype=args.kv_dtype, kv_scales=args.kv_scale)
    print(report_json(report) if args.json else format_report(report))
    return 0 if report.passed else 1


def _generate(args) -> int:
    from mla_fa3.engine import Engine
    from mla_fa3.models.loader import load_model

    dtype = _setup(args)
    say = _progress(args.quiet)
    say(f"loading {args.checkpoint}")
    model = load_model(args.checkpoint, dtype=dtype, device=args.device)
    engine = Engine(model, page_size=args.page_size, max_batch_size=1,
                    max_context=len(args.prompt_ids) + args.max_new_tokens,
                    max_prefill_tokens=args.max_prefill_tokens, use_cuda_graph=args.cuda_graph,
                    kv_dtype=args.kv_dtype, kv_scales=args.kv_scale)
    res = engine.generate([args.prompt_ids], args.max_new_tokens, eos_token_id=args.eos_token_id,
                          progress=lambda phase, i, n: say(f"{phase} step {i}/{n}"))
    tokens = res.token_ids[0]
    print(json.dumps({"token_ids": tokens}) if args.json else " ".join(map(str, tokens)))
    return 0


def _bench(args) -> int:
    name = f"mla_fa3.bench.{args.which}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (name, "mla_fa3.bench"):
            raise
        print(f"mla-fa3 bench {args.which}: {name} is not installed in this build", file=sys.stderr)
        return 2
    entry = getattr(module, "main", None)
    if not callable(entry):
        print(f"mla-fa3 bench {args.which}: {name} has no main(argv)", file=sys.stderr)
        return 2
    rc = entry(list(args.args))
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mla-fa3`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "validate":
            return _validate(args)
        if args.command == "generate":
            return _generate(args)
        return _bench(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        if args.command == "bench":
            raise
        print(f"mla-fa3 {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
