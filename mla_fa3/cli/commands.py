"""What each ``mla-fa3`` command does with its parsed flags (``args`` -> exit status): ``checkpoint``,
``validate``, ``generate``, ``plan`` and ``bench``; the checks that refuse a flag before anything is loaded
(``UsageError``, one line naming the flag); stderr's progress bars and log lines. The heavy modules (torch, the
model, transformers, the benchmarks) are imported inside the commands, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

from mla_fa3.cli.parser import DTYPES, PLAN_CONTEXT

__all__ = ["UsageError", "checkpoint", "validate", "generate", "plan", "bench"]

_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # config.json's dtype -> plan's
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class UsageError(ValueError):
    """A flag (or flag combination) that cannot work here; the message names the flag."""


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
    return getattr(torch, DTYPES[args.dtype])


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
def validate(args) -> int:
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


def generate(args) -> int:
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


def plan(args) -> int:
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
    max_context = args.max_context or min(PLAN_CONTEXT, cfg.max_position_embeddings)
    memory_plan = plan_memory(cfg, gpu_memory_gib=args.gpu_memory_gib or H200_MEMORY_GIB,
                              weight_dtype=weight_dtype, kv_dtype=args.kv_dtype, page_size=args.page_size,
                              max_running=args.max_running, max_context=max_context,
                              token_budget=args.token_budget, prefill_workspace_tokens=args.prefill_workspace_tokens,
                              graph_batch_sizes=args.graph_batch_sizes, headroom_fraction=args.headroom)
    print(memory_plan.to_json() if args.json else memory_plan.format_table())
    return 0


def checkpoint(args) -> int:
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


def bench(args) -> int:
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
