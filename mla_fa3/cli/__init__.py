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

Layout: ``parser.py`` is the grammar (flags, defaults, help text), ``commands.py`` what each command does
with its flags, and this module the entry point: parse, dispatch, and turn errors into exit statuses.
"""

from __future__ import annotations

import sys

from mla_fa3.cli import commands
from mla_fa3.cli.parser import build_parser

__all__ = ["main"]


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
            return commands.checkpoint(args)
        if args.command == "validate":
            return commands.validate(args)
        if args.command == "generate":
            return commands.generate(args)
        if args.command == "plan":
            return commands.plan(args)
        return commands.bench(args)
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

