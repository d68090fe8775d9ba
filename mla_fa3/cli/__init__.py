"""``mla-fa3`` command line (also ``python -m mla_fa3.cli`` / ``python -m mla_fa3``).

Commands::

    mla-fa3 checkpoint --out DIR [--config tiny_v3|tiny_v2|v3_mla_dims] [--seed N]
        Writes a tiny DeepSeek checkpoint with random weights (config.json, model.safetensors, a word-level
        tokenizer with a chat template, generation_config.json) to a new or empty DIR: something to try
        the other commands on, no downloads (mla_fa3.models.tiny).
    mla-fa3 validate [--checkpoint DIR] [--page-size N] [--dtype D] [--steps N] [--device D]
        Our DeepSeek model on the MLA backend vs transformers' model: prefill logits, step-by-step
        paged decode logits, greedy tokens (see mla_fa3.hf_compare). Without --checkpoint, a
        tiny DeepSeek-V3 (q_lora, grouped MoE, YaRN) with random weights is built and saved to a temp
        dir first (no downloads; --config picks another embedded config, and on cuda the default is
        v3_mla_dims: FA3 implements the real MLA head dims only). Prints a table; exit status 1 when
        a threshold is missed. With --kv-dtype fp8 the judge is the e4m3 reference (transformers in
        float64 over the same e4m3 roundings), and what FP8 costs against transformers is reported apart.
    mla-fa3 generate --checkpoint DIR (--prompt TEXT [--chat] | --prompt-ids 1 2 3) [--max-new-tokens N]
                     [--json] [--eos-token-id ID | --ignore-eos] [--dtype D] [--device D] [--cuda-graph]
        Greedy generation. --prompt encodes TEXT with the checkpoint's tokenizer (transformers'
        AutoTokenizer, local files only; --chat applies its chat template) and prints the new text;
        --prompt-ids prints the new token ids. --json prints {"token_ids": [...]} (new tokens only; with
        --prompt also "text" and "prompt_ids"). Generation stops at the EOS ids of the checkpoint's
        generation_config.json (else config.json), or at --eos-token-id.
    mla-fa3 plan [--checkpoint DIR | --config NAME] [--kv-dtype bf16|fp8] [--gpu-memory-gib G] [--json] ...
        The serving memory plan (mla_fa3.serve.memory): weights, workspace, graphs, headroom and the KV
        tokens that fit; exit status 2 with the reason when the configuration does not fit. With
        --checkpoint, the weight dtype and the context default to the checkpoint's.
    mla-fa3 bench decode|prefill|serve|fp8 [args...]
        Dispatches to mla_fa3.bench.<name>:main(argv). The benchmarks time the CUDA kernels; without CUDA each
        refuses in one line (exit status 2) unless given --device cpu: a smoke run on the reference kernels,
        labelled, about a minute (mla_fa3.bench.smoke).

Results go to stdout; progress bars (tqdm; off with --quiet or when stderr is not a terminal) and the
library's log messages go to stderr. Every usage or checkpoint error is one line on stderr naming the
flag or file, exit status 2, raised before the model is loaded where it can be.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys

from mla_fa3 import __version__

__all__ = ["main", "build_parser", "UsageError"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
_BENCHES = ("decode", "prefill", "serve", "fp8")
_PLAN_DTYPES = ("bf16", "fp16", "fp32", "fp8")
_PLAN_CONTEXT = 131072  # plan's default tokens per request (at most the model's max_position_embeddings)
_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # config.json's dtype -> plan's
TINY_NAMES = ("tiny_v3", "tiny_v2", "v3_mla_dims")  # mla_fa3.models.tiny.TINY_CONFIGS (not imported: fast --help)
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class UsageError(ValueError):
    """A flag (or flag combination) that cannot work here; the message names the flag."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after each option's help, except where there is no value to show (None, a flag's
    False): there the help says what happens without the option, if anything."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and no abbreviated flags; an unknown flag is reported
    by the subcommand it was given to, pointing to that subcommand's --help (``commands``: name -> parser)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self.commands.get(getattr(parsed, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def _page_size(text: str) -> int:
    value = _positive(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be 1 or a power of 2, got {value}")
    return value


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite float > 0, got {text}")
    return value


def _device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mla-fa3", description="MLA attention backend on FlashAttention-3: validate DeepSeek "
                     "models against transformers, generate, benchmark.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, *, checkpoint_required: bool) -> None:
        p.add_argument("--checkpoint", required=checkpoint_required, metavar="DIR",
                       help="HF checkpoint dir (config.json + safetensors; mla-fa3 checkpoint writes a tiny one)")
        p.add_argument("--page-size", type=_page_size, default=None, metavar="N",
                       help="KV page size, 1 or a power of 2 (default: 16; 64 with --kv-dtype fp8 or "
                            "--decode-kernel flashmla)")
        p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="model / KV dtype")
        p.add_argument("--device", type=_device, default="cpu", help="cpu (reference kernels) or cuda[:N] (FA3)")
        p.add_argument("--threads", type=_positive, default=None, metavar="N",
                       help="torch CPU threads (default: 1 on cpu, where small ops run fastest single-threaded; "
                            "torch's own on cuda)")
        p.add_argument("--max-prefill-tokens", type=_positive, default=None, metavar="N",
                       help="chunked prefill: prompt tokens per step (default: the whole prompt in one step)")
        p.add_argument("--cuda-graph", action="store_true", help="decode through CUDA graphs (needs --device cuda)")
        p.add_argument("--quiet", action="store_true", help="no progress bars or info messages on stderr")
        p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                       help="latent KV cache dtype: auto (= --dtype) or fp8 (e4m3; read by FlashMLA FP8 at page 64 "
                            "or by the split-KV kernel at any page size)")
        p.add_argument("--decode-kernel", choices=("auto", "fa3", "flashmla", "splitkv"), default="auto",
                       help="absorbed decode kernel (auto: the measured choice per step)")
        p.add_argument("--kv-scale", type=_scale, default=None, metavar="S",
                       help="with --kv-dtype fp8: one scale for every layer, a finite float > 0 "
                            "(default: the checkpoint's, else 1.0)")

    c = sub.add_parser("checkpoint", help="write a tiny DeepSeek checkpoint (random weights) to try the others on")
    c.add_argument("--out", required=True, metavar="DIR", help="directory to write (new or empty)")
    c.add_argument("--config", choices=sorted(TINY_NAMES), default="tiny_v3",
                   help="embedded config: tiny_v3 (DeepSeek-V3 layout), tiny_v2 (DeepSeek-V2 layout), v3_mla_dims "
                        "(DeepSeek-V3's MLA head dims, 16 heads; the dims FA3 runs on a GPU)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random weights")

    v = sub.add_parser("validate", help="compare our model on the backend with transformers")
    common(v, checkpoint_required=False)
    next(a for a in v._actions if a.dest == "kv_scale").help = (
        "with --kv-dtype fp8: one scale for every layer, a finite float > 0 (default: the checkpoint's, else "
        "calibrated on the prompts: prefill absmax / 448)")
    v.add_argument("--steps", type=_positive, default=16, help="decode steps to compare")
    v.add_argument("--seed", type=int, default=0, help="seed of the tiny model and the prompts")
    v.add_argument("--config", choices=sorted(TINY_NAMES), default=None,
                   help="embedded config when no --checkpoint (default: tiny_v3 on cpu, v3_mla_dims on cuda)")
    v.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")

    g = sub.add_parser("generate", help="greedy generation from text or token ids")
    common(g, checkpoint_required=True)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="text, encoded with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", type=int, nargs="+", metavar="ID", help="token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=_positive, default=16, metavar="N", help="new tokens per request")
    eos = g.add_mutually_exclusive_group()
    eos.add_argument("--eos-token-id", type=int, default=None, metavar="ID",
                     help="stop at this token, kept (default: the EOS ids of the checkpoint's "
                          "generation_config.json, else of its config.json)")
    eos.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--allow-past-max-position", action="store_true",
                   help="run past the config's max_position_embeddings (with a warning) instead of refusing")
    g.add_argument("--json", action="store_true",
                   help='print {"token_ids": [...]}, the new tokens only; with --prompt also "text" (the new '
                        'text) and "prompt_ids" (the encoded prompt)')

    pl = sub.add_parser("plan", help="serving memory plan: what fits one GPU")
    src = pl.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="HF checkpoint dir (its config.json only)")
    src.add_argument("--config", default="deepseek_v3_tp8",
                     help="embedded config, when no --checkpoint (mla_fa3.serve.configs.MODEL_CONFIGS)")
    pl.add_argument("--layers", type=_positive, default=None, metavar="N",
                    help="decoder layers (default: the config's num_hidden_layers)")
    pl.add_argument("--weight-dtype", choices=_PLAN_DTYPES, default=None,
                    help="weight storage dtype (default: the checkpoint's, from its config.json; fp8 for an "
                         "embedded config)")
    pl.add_argument("--kv-dtype", choices=_PLAN_DTYPES, default="bf16", help="KV cache dtype")
    pl.add_argument("--page-size", type=_page_size, default=64, metavar="N", help="KV page size, 1 or a power of 2")
    pl.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G",
                    help="GPU memory to plan for, in GiB (default: the H200's 139.8)")
    pl.add_argument("--max-running", type=_positive, default=128, metavar="N", help="requests running at once")
    pl.add_argument("--max-context", type=_positive, default=None, metavar="N",
                    help=f"tokens per request, prompt and output (default: {_PLAN_CONTEXT}, or the model's "
                         "max_position_embeddings when smaller)")
    pl.add_argument("--token-budget", type=_positive, default=8192, metavar="N", help="new tokens per step")
    pl.add_argument("--prefill-workspace-tokens", type=_positive, default=8192, metavar="N",
                    help="tokens per chunk of the MHA prefill's workspace")
    pl.add_argument("--graph-batch-sizes", type=_positive, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128],
                    metavar="BS", help="decode batch sizes captured as CUDA graphs (the flag alone: no graphs)")
    pl.add_argument("--headroom", type=float, default=0.05, help="fraction of GPU memory kept free")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    b = sub.add_parser("bench", help="benchmarks of the CUDA kernels (mla_fa3.bench.*; --device cpu: a smoke run)")
    b.add_argument("which", choices=_BENCHES, help="which benchmark")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    parser.commands = dict(sub.choices)
    return parser


# ---------------------------------------------------------------------------------- stderr: logs, bars
class _StderrHandler(logging.Handler):
    """Library log records on the current sys.stderr, written through tqdm so bars are not broken."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(logging.Formatter("mla-fa3: %(message)s"))


def _setup_logging(quiet: bool) -> None:
    log = logging.getLogger("mla_fa3")
    if _HANDLER not in log.handlers:
        log.addHandler(_HANDLER)
    log.setLevel(logging.WARNING if quiet else logging.INFO)


class _Bars:
    """``progress(phase, i, n)`` drawn as one tqdm bar per phase ("load", "prefill", "decode") on stderr;
    nothing when quiet or when stderr is not a terminal."""

    def __init__(self, quiet: bool) -> None:
        self.enabled = not quiet and sys.stderr.isatty()
        self.phase, self.bar = None, None

    def __call__(self, phase: str, i: int, n: int) -> None:
        if not self.enabled:
            return
        if phase != self.phase:
            from tqdm import tqdm

            self.close()
            self.phase, self.bar = phase, tqdm(total=n, desc=f"{phase:>7}", unit="step", file=sys.stderr,
                                               leave=False, dynamic_ncols=True)
        self.bar.update(i - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.phase, self.bar = None, None

    def __enter__(self) -> "_Bars":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _transformers_bars(enabled: bool):
    """transformers' own progress bars ("Loading weights") follow ours: off with --quiet or off a terminal."""
    if enabled:
        yield
        return
    from mla_fa3.models.tiny import transformers_bars_off

    with transformers_bars_off():
        yield


# ---------------------------------------------------------------------------------- checks
def _check_kv_flags(args) -> None:
    """Set --page-size's default, and refuse the KV-cache flags that cannot go together before anything is
    loaded (the backend would refuse them only once the model is built)."""
    if args.page_size is None:
        args.page_size = 64 if args.kv_dtype == "fp8" or args.decode_kernel == "flashmla" else 16
    if args.kv_scale is not None and args.kv_dtype != "fp8":
        raise UsageError(f"--kv-scale {args.kv_scale} scales an FP8 cache: it needs --kv-dtype fp8")
    if args.decode_kernel == "fa3" and args.kv_dtype == "fp8":
        raise UsageError("--decode-kernel fa3 cannot read an FP8 cache (--kv-dtype fp8); use flashmla, splitkv "
                         "or auto")
    if args.decode_kernel == "flashmla" and args.page_size != 64:
        raise UsageError(f"--decode-kernel flashmla needs --page-size 64, got --page-size {args.page_size}")


def _setup(args):
    """Check the KV flags, and --device / --cuda-graph against this machine; set CPU threads; returns the
    torch dtype."""
    import torch

    _check_kv_flags(args)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available (torch {torch.__version__}); "
                             "use --device cpu")
        index = int(args.device.split(":")[1]) if ":" in args.device else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif args.cuda_graph:
        raise UsageError(f"--cuda-graph needs --device cuda (CUDA graphs do not exist on {args.device})")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu":
        torch.set_num_threads(1)
    return getattr(torch, _DTYPES[args.dtype])


def _in_vocab(flag: str, ids, vocab: int, config_path: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError(f"{flag} {bad[0]} is outside the vocabulary [0, {vocab}) of {config_path}")


def _tokenizer(path: str):
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise UsageError(f"--prompt needs the checkpoint's tokenizer, but {path} has no "
                         f"{' / '.join(_TOKENIZER_FILES)}; pass token ids with --prompt-ids")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds here (OSError, ValueError, ImportError ...)
        raise UsageError(f"--prompt: cannot load the tokenizer of {path}: {exc}") from exc


def _encode(args, tokenizer) -> list[int]:
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"--chat: the tokenizer of {args.checkpoint} has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
    else:
        ids = tokenizer(args.prompt)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise UsageError("--prompt encodes to no tokens")
    return ids


# ---------------------------------------------------------------------------------- commands
def _validate(args) -> int:
    from mla_fa3.hf_compare import format_report, report_json, run_validate

    dtype = _setup(args)
    _setup_logging(args.quiet)
    with _Bars(args.quiet) as bars, _transformers_bars(bars.enabled):
        report = run_validate(args.checkpoint, page_size=args.page_size, dtype=dtype, steps=args.steps,
                              device=args.device, seed=args.seed, max_prefill_tokens=args.max_prefill_tokens,
                              use_cuda_graph=args.cuda_graph, config=args.config, progress=bars,
                              kv_dtype=args.kv_dtype, kv_scales=args.kv_scale, decode_kernel=args.decode_kernel)
    print(report_json(report) if args.json else format_report(report))
    return 0 if report.passed else 1


def _generate(args) -> int:
    from mla_fa3.models.loader import check_checkpoint, eos_token_ids

    if args.chat and args.prompt is None:
        raise UsageError("--chat needs --prompt TEXT")
    dtype = _setup(args)
    _setup_logging(args.quiet)
    cfg, raw = check_checkpoint(args.checkpoint)  # config.json and every safetensors header, named on error
    config_path = os.path.join(args.checkpoint, "config.json")
    if args.ignore_eos:
        eos = []
    elif args.eos_token_id is not None:
        _in_vocab("--eos-token-id", [args.eos_token_id], cfg.vocab_size, config_path)
        eos = [args.eos_token_id]
    else:
        eos = eos_token_ids(args.checkpoint, raw)
    tokenizer = _tokenizer(args.checkpoint) if args.prompt is not None else None
    prompt = _encode(args, tokenizer) if tokenizer is not None else list(args.prompt_ids)
    _in_vocab("--prompt" if tokenizer is not None else "--prompt-ids", prompt, cfg.vocab_size, config_path)
    total, limit = len(prompt) + args.max_new_tokens, cfg.max_position_embeddings
    if total > limit and not args.allow_past_max_position:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} + a {len(prompt)}-token prompt = {total} "
                         f"tokens exceed max_position_embeddings {limit} of {config_path}; "
                         "pass --allow-past-max-position to run anyway")
    return _run_generate(args, dtype, prompt, eos, tokenizer)


def _run_generate(args, dtype, prompt: list[int], eos: list[int], tokenizer) -> int:
    from mla_fa3.serve.engine import Engine
    from mla_fa3.models.loader import load_model

    log = logging.getLogger("mla_fa3.cli")
    log.info("loading %s", args.checkpoint)
    with _Bars(args.quiet) as bars:
        model = load_model(args.checkpoint, dtype=dtype, device=args.device, progress=bars)
        engine = Engine(model, page_size=args.page_size, max_batch_size=1,
                        max_context=len(prompt) + args.max_new_tokens, max_prefill_tokens=args.max_prefill_tokens,
                        use_cuda_graph=args.cuda_graph, allow_past_max_position=args.allow_past_max_position,
                        kv_dtype=args.kv_dtype, kv_scales=args.kv_scale, decode_kernel=args.decode_kernel)
        tokens = engine.generate([prompt], args.max_new_tokens, eos_token_id=eos or None,
                                 progress=bars).token_ids[0]
    if tokenizer is None:
        print(json.dumps({"token_ids": tokens}) if args.json else " ".join(map(str, tokens)))
        return 0
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    print(json.dumps({"token_ids": tokens, "text": text, "prompt_ids": prompt}) if args.json else text)
    return 0


def _weight_dtype(raw: dict) -> str:
    """The weight dtype a checkpoint's config.json states: fp8 when block-quantized, else its ``dtype`` /
    ``torch_dtype``; bf16 when it states none."""
    if (raw.get("quantization_config") or {}).get("quant_method") == "fp8":
        return "fp8"
    return _CONFIG_DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), "bf16")


def _plan(args) -> int:
    from mla_fa3.models.loader import read_config
    from mla_fa3.serve.configs import model_config
    from mla_fa3.serve.memory import H200_MEMORY_GIB, plan_memory

    if args.checkpoint is not None:
        cfg, raw = read_config(args.checkpoint)
        if args.layers is not None:
            import dataclasses
            cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
        weight_dtype = args.weight_dtype or _weight_dtype(raw)
    else:
        cfg = model_config(args.config, num_layers=args.layers)
        weight_dtype = args.weight_dtype or "fp8"
    max_context = args.max_context or min(_PLAN_CONTEXT, cfg.max_position_embeddings)
    plan = plan_memory(cfg, gpu_memory_gib=args.gpu_memory_gib or H200_MEMORY_GIB, weight_dtype=weight_dtype,
                       kv_dtype=args.kv_dtype, page_size=args.page_size, max_running=args.max_running,
                       max_context=max_context, token_budget=args.token_budget,
                       prefill_workspace_tokens=args.prefill_workspace_tokens,
                       graph_batch_sizes=args.graph_batch_sizes, headroom_fraction=args.headroom)
    print(plan.to_json() if args.json else plan.format_table())
    return 0


def _checkpoint(args) -> int:
    """``mla-fa3 checkpoint``: a tiny DeepSeek with random weights, saved as transformers saves it."""
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise UsageError(f"--out {args.out} exists and is not an empty directory; name a new one")
    from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

    save_hf_checkpoint(random_hf_model(args.config, seed=args.seed), args.out)
    print(f"wrote {args.out}: {args.config} with random weights (seed {args.seed}): "
          f"{', '.join(sorted(os.listdir(args.out)))}")
    print(f"try: mla-fa3 generate --checkpoint {args.out} --prompt \"tell me about the latent cache\" "
          "--max-new-tokens 8")
    return 0


def _bench(args) -> int:
    """``mla-fa3 bench NAME ARGS...``: the benchmark module's ``main(argv)`` (plain imports, one per bench)."""
    if args.which == "decode":
        from mla_fa3.bench.decode import main as entry
    elif args.which == "prefill":
        from mla_fa3.bench.prefill import main as entry
    elif args.which == "serve":
        from mla_fa3.bench.serve import main as entry
    else:
        from mla_fa3.bench.fp8 import main as entry
    try:
        return int(entry(list(args.args)) or 0)
    except SystemExit as exc:  # the benchmark's own argparse: --help (0) or a usage error (2), already printed
        return int(exc.code or 0)


def _is_user_error(exc: BaseException) -> bool:
    """Errors about the input (flags, files, this machine's kernels), reported in one line."""
    if isinstance(exc, (ValueError, TypeError, FileNotFoundError)):
        return True
    types_mod = sys.modules.get("mla_fa3.ops.types")
    return types_mod is not None and isinstance(exc, types_mod.KernelUnavailableError)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mla-fa3`` console script; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help / --version (0) or a one-line usage error (2)
        return int(exc.code or 0)
    try:
        if args.command == "checkpoint":
            return _checkpoint(args)
        if args.command == "validate":
            return _validate(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "plan":
            return _plan(args)
        return _bench(args)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(f"mla-fa3 {args.command}: error: torch is not installed for {sys.executable}; install it first "
              "(README, Install: the CPU build or torch 2.11 with the gpu extra)", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.command == "bench" or not _is_user_error(exc):
            raise
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"mla-fa3 {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
