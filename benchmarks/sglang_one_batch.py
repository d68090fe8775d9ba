"""SGLang's own benchmark, ``sglang.bench_one_batch`` (plugins loaded first), on ``mla_fa3`` vs ``fa3`` vs ``flashmla``.

The whole decode step of SGLang's DeepSeek model (``DeepseekV3ForCausalLM``: projections, MLP, lm_head, sampling,
CUDA graphs), run by SGLang's ``ModelRunner`` in one process, on a DeepSeek-V3-shaped model with few layers and
random weights (``--load-format dummy``: only config.json and a tokenizer are written): hidden 7168, q_lora 1536,
kv_lora 512, qk_nope 128, qk_rope 64, v 128, 16 or 128 heads (16 = DeepSeek-V3's heads per rank at tp 8), dense
MLP of ``--intermediate`` (default 2048, one routed expert's width), vocab 32768. Page 64.

    python benchmarks/sglang_one_batch.py --out out/one_batch.csv [--quick] [--heads 16 128] [--layers 4]
    python benchmarks/sglang_one_batch.py --out out/h128.csv --quick --heads 128 --kv auto --repeat 3

One process per (heads, KV dtype, backend): SGLang's ``load_model`` once (CUDA graphs captured for the batch sizes
used), then SGLang's ``latency_test_run_once`` per (bs, ctx) — prefill of the batch, then ``--output-len`` decode
steps; the first shape runs once more first as the warm-up, as ``bench_one_batch`` does. SGLang's benchmark prefills
the whole batch in one forward, whose activations outgrow the card past a few hundred thousand tokens: a batch of
more than ``PREFILL_TOKENS`` tokens is prefilled in groups of requests (:class:`GroupedPrefill`: each group SGLang's
own ``extend``, the groups merged into one batch by ``ScheduleBatch.merge_batch`` as SGLang's scheduler merges a
prefilled batch into its running one); the timed decode steps are SGLang's, untouched. Beside the step's wall time,
``forward_ms`` is the median CUDA-event time of the decode ``ModelRunner.forward`` alone (:class:`DecodeForwardTimes`:
the backend's replay update plus the graph on the GPU), the part of a step an attention backend changes. The median
decode latency goes to the CSV with ``ratio_vs_fa3`` (fa3's latency / this one in the same round: > 1 is faster
than fa3), ``forward_ms`` with ``forward_ratio_vs_fa3``.
``--repeat N`` runs every backend's process N times, the backends alternating within each round (column ``round``):
one process's step can sit 10-20 % away from the next one's on the same machine, so a ratio is read within a round
and its spread across rounds says how far to trust it. GPU only; needs SGLang 0.5.17 and sgl-kernel.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.sglang_engine_check import SGLANG_CONFIG_KEYS  # noqa: E402

# (bs, ctx) per head count, the largest batches last (a failure there leaves the others measured)
SHAPES = {16: [(1, 32768), (1, 131072), (4, 32768), (4, 65536), (16, 16384), (16, 32768), (64, 16384)],
          128: [(1, 32768), (1, 131072), (4, 32768), (16, 16384), (64, 16384)]}
QUICK = {16: [(1, 65536), (4, 32768)], 128: [(1, 32768)]}
BACKENDS = ("mla_fa3", "fa3", "flashmla")
# the most tokens one prefill forward takes here (bs 1 x 128k, the largest single request, fits one forward)
PREFILL_TOKENS = 131072


class GroupedPrefill:
    """SGLang's bench runner (``one_batch._TorchBenchRunner``) with its ``extend`` taken in groups of requests of at
    most ``max_tokens`` prompt tokens each (one group when the batch fits): ``extend_fn(group, model_runner)`` is
    SGLang's ``one_batch.extend`` (-> next token ids, next-token logits, the group's ``ScheduleBatch``); the groups'
    batches are merged, in order, into the first one (``ScheduleBatch.merge_batch``), and their token ids and logits
    concatenated in the same order, so the batch ``decode`` then steps is the one a single extend would return."""

    def __init__(self, runner, extend_fn, max_tokens: int):
        self.runner, self.extend_fn, self.max_tokens = runner, extend_fn, int(max_tokens)

    def groups(self, reqs) -> list:
        """Consecutive groups of ``reqs``, each of at most ``max_tokens`` prompt tokens (a longer request alone)."""
        out, group, tokens = [], [], 0
        for r in reqs:
            n = len(r.origin_input_ids)
            if group and tokens + n > self.max_tokens:
                out.append(group)
                group, tokens = [], 0
            group.append(r)
            tokens += n
        return out + [group] if group else out

    def extend(self, reqs):
        parts = [self.extend_fn(group, self.runner.torch_runner) for group in self.groups(reqs)]
        batch = parts[0][2]
        for _, _, other in parts[1:]:
            batch.merge_batch(other)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), batch

    def decode(self, next_token_ids, batch):
        return self.runner.decode(next_token_ids, batch)

    def clear(self):
        self.runner.clear()

    def cleanup(self, batch):
        self.runner.cleanup(batch)

    def synchronize(self):
        self.runner.synchronize()

    def max_batch_size(self, input_len, output_len):
        return self.runner.max_batch_size(input_len, output_len)


class DecodeForwardTimes:
    """The CUDA-event time of every decode ``ModelRunner.forward`` (installed over the runner's own): from the host
    entering ``forward`` — the GPU idles there, bench_one_batch synchronizes after each step — to the last kernel of
    the step's graph, i.e. the backend's replay update plus the graph's GPU time, without the batch preparation and
    the sampling around it that every backend shares (on a 4-layer model those are most of a step's wall time)."""

    def __init__(self, model_runner):
        self._pairs = []
        inner = model_runner.forward

        def forward(forward_batch, *args, **kwargs):
            if not forward_batch.forward_mode.is_decode():
                return inner(forward_batch, *args, **kwargs)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = inner(forward_batch, *args, **kwargs)
            end.record()
            self._pairs.append((start, end))
            return out

        model_runner.forward = forward

    def take_median_ms(self) -> float | None:
        """Median over the decode forwards since the last call (the first one left out, as a warm-up); None if none."""
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in self._pairs[1:])
        self._pairs = []
        return times[len(times) // 2] if times else None


def write_model(path: str, heads: int, layers: int, intermediate: int) -> str:
    """config.json of a DeepSeek-V3-shaped model (all layers dense) and a word-level tokenizer; no weights."""
    from mla_fa3.models.tiny import tiny_tokenizer

    vocab = 32768
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=vocab, hidden_size=7168,
        intermediate_size=intermediate, moe_intermediate_size=intermediate, num_hidden_layers=layers,
        first_k_dense_replace=layers, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        rms_norm_eps=1e-6, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        hidden_act="silu", routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
        scoring_func="sigmoid", attention_bias=False)
    cfg.update({k: v for k, v in SGLANG_CONFIG_KEYS.items() if k not in cfg})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tiny_tokenizer(256).save_pretrained(path)
    return path


def _worker(argv) -> int:
    """One model, backend and KV dtype: SGLang's bench_one_batch steps (``sglang.benchmark.one_batch``) per shape.
    SGLang's plugins are loaded first: unlike launch_server and Engine, bench_one_batch does not load them."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.benchmark import one_batch as ob

    w = argparse.ArgumentParser()
    w.add_argument("--shapes", required=True)
    w.add_argument("--output-len", type=int, required=True)
    mine, rest = w.parse_known_args(argv)
    shapes = [tuple(map(int, s.split("x"))) for s in mine.shapes.split(",")]
    parser = argparse.ArgumentParser()
    ob.ServerArgs.add_cli_args(parser)
    server_args = ob.ServerArgs.from_cli_args(parser.parse_args(rest))
    if server_args.cuda_graph_config is not None:  # as bench_one_batch's main: graphs up to the largest batch
        server_args.cuda_graph_config[ob.Phase.DECODE].max_bs = max(bs for bs, _ in shapes)
    ob._set_envs_and_config(server_args)
    port_args = ob.PortArgs.init_new(server_args)
    ob.initialize_moe_config(server_args)
    ob.initialize_fp8_gemm_config(server_args)
    ob.initialize_fp4_gemm_config(server_args)
    ob.configure_logger(server_args, prefix=" TP0")
    runner, _ = ob.load_model(server_args, port_args, 0, 0)
    forwards = DecodeForwardTimes(runner.torch_runner)
    runner = GroupedPrefill(runner, ob.extend, PREFILL_TOKENS)
    for i, (bs, ctx) in enumerate([shapes[0]] + shapes):
        reqs = ob.prepare_synthetic_inputs_for_latency_test(bs, ctx)
        ret = ob.latency_test_run_once("one_batch", runner, print, reqs, bs, ctx, mine.output_len, 0, False, False,
                                       ("CPU", "GPU"), "", "all", 0)
        forward_ms = forwards.take_median_ms()
        if i and ret is not None:
            print("RESULT " + json.dumps(dict(ret, median_decode_forward_ms=forward_ms)), flush=True)
    return 0


def _run(model: str, backend: str, kv: str, shapes, out_len: int, log, mem_fraction: float) -> list[dict]:
    max_bs = max(bs for bs, _ in shapes)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shapes", ",".join(f"{b}x{c}" for b, c in shapes),
           "--output-len", str(out_len), "--model-path", model, "--load-format", "dummy",
           "--attention-backend", backend, "--kv-cache-dtype", kv, "--page-size", "64", "--dtype", "bfloat16",
           "--sampling-backend", "pytorch", "--grammar-backend", "none", "--mem-fraction-static", str(mem_fraction),
           "--context-length", str(max(c for _, c in shapes) + out_len + 64),
           "--max-running-requests", str(max_bs), "--cuda-graph-max-bs-decode", str(max_bs), "--disable-prefill-cuda-graph"]
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300).stdout
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += "\nTIMEOUT"
    log.write(out)
    log.flush()
    got = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    rows = [dict(bs=r["batch_size"], ctx=r["input_len"], decode_ms=round(r["median_decode_latency"] * 1e3, 4),
                 tok_s=round(r["median_decode_throughput"], 1), prefill_s=round(r["prefill_latency"], 3),
                 forward_ms=round(r["median_decode_forward_ms"], 4) if r.get("median_decode_forward_ms") else "")
            for r in got]
    done = {(r["bs"], r["ctx"]) for r in rows}
    rows += [dict(bs=b, ctx=c, error=failure_line(out)) for b, c in shapes if (b, c) not in done]
    return rows


def failure_line(out: str) -> str:
    """Why a worker stopped, from its output: the last exception line (``...Error: ...``; SGLang's scheduler logs
    it with a ``[rank0]:`` prefix, then exit warnings), else TIMEOUT, else the last line; 200 characters at most."""
    lines = [line.removeprefix("[rank0]:").strip() for line in out.strip().splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    if errors:
        return errors[-1][:200]
    if "TIMEOUT" in lines:
        return "TIMEOUT"
    return lines[-1][:200] if lines else ""


COLUMNS = ["heads", "kv", "backend", "round", "bs", "ctx", "decode_ms", "tok_s", "ratio_vs_fa3", "forward_ms",
           "forward_ratio_vs_fa3", "prefill_s", "error"]


def _write_csv(path: str, rows: list[dict]) -> None:
    """The rows with ``ratio_vs_fa3`` (fa3's decode latency at the same (heads, kv, round, bs, ctx) / this row's) and
    ``forward_ratio_vs_fa3`` (the same of the decode forwards' CUDA-event time, :class:`DecodeForwardTimes`)."""
    def key(r):
        return r["heads"], r["kv"], r.get("round", 0), r["bs"], r["ctx"]

    for col, ratio in (("decode_ms", "ratio_vs_fa3"), ("forward_ms", "forward_ratio_vs_fa3")):
        base = {key(r): r[col] for r in rows if r.get("backend") == "fa3" and r.get(col)}
        for r in rows:
            ref = base.get(key(r))
            r[ratio] = round(ref / r[col], 3) if ref and r.get(col) else ""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv", nargs="+", default=["auto", "fp8_e4m3"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--flashmla-fp8", action="store_true", help="also SGLang's flashmla backend on an FP8 cache")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every backend's process, alternating")
    p.add_argument("--mem-fraction-static", type=float, default=0.8,
                   help="SGLang's share of GPU memory for weights and the KV pool (the pool fills the rest of it: "
                        "SGLang's fa3 converts a whole layer's FP8 pool to bf16 per layer, which at 0.8 on an 80 GB "
                        "card does not fit)")
    args = p.parse_args(argv)
    from benchmarks.sglang_backends import sglang_ready

    if not sglang_ready("sglang_one_batch"):
        return 2
    tmp = tempfile.mkdtemp(prefix="v3_shaped_")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    with open(os.path.join(out_dir, "one_batch_log.txt"), "a") as log:
        for heads in args.heads:
            model = write_model(os.path.join(tmp, f"h{heads}"), heads, args.layers, args.intermediate)
            for kv in args.kv:
                for rnd in range(args.repeat):
                    for backend in args.backends:
                        if kv != "auto" and backend == "flashmla" and not args.flashmla_fp8:
                            continue
                        for r in _run(model, backend, kv, (QUICK if args.quick else SHAPES)[heads], args.output_len,
                                      log, args.mem_fraction_static):
                            rows.append(dict(heads=heads, kv=kv, backend=backend, round=rnd, **r))
                            print(json.dumps(rows[-1]), flush=True)
                        _write_csv(args.out, rows)  # after every process: a run cut short keeps what it measured
    for r in rows:
        print(",".join(str(r.get(c, "")) for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
