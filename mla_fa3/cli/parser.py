"""The grammar of the ``mla-fa3`` command line: every subcommand's flags with their types, defaults and help
text (``build_parser``), and argparse's behaviour for the whole command (one-line errors naming the subcommand,
no abbreviated flags). What the commands do with the parsed flags is ``mla_fa3.cli.commands``; this module
imports nothing heavy, so ``mla-fa3 --help`` stays fast and CUDA-free.
"""

from __future__ import annotations

import argparse
import math
import re

from mla_fa3 import __version__

__all__ = ["build_parser", "DTYPES", "PLAN_CONTEXT", "TINY_NAMES"]

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # --dtype's spellings -> torch dtype names
_BENCHES = ("decode", "prefill", "serve", "fp8")
_PLAN_DTYPES = ("bf16", "fp16", "fp32", "fp8")
PLAN_CONTEXT = 131072  # plan's default tokens per request (at most the model's max_position_embeddings)
TINY_NAMES = ("tiny_v3", "tiny_v2", "v3_mla_dims")  # mla_fa3.models.tiny.TINY_CONFIGS (not imported: fast --help)
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


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
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model / KV dtype")
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
                    help=f"tokens per request, prompt and output (default: {PLAN_CONTEXT}, or the model's "
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
