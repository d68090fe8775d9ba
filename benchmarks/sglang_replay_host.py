"""The host time of the update SGLang runs before each replay of a decode CUDA graph (``init_forward_metadata_out_graph``).

For each shape: SGLang's pools (the attention kit's ``MockMLAModelRunner``, page 64) holding ``bs`` requests of ``ctx``
tokens, a decode graph state captured at ``bs`` as SGLang's runner captures it (its static ``seq_lens`` /
``req_pool_indices`` views handed over at capture and at every replay), then ``--iters`` replay updates timed one by
one (``time.perf_counter``, median). ``--verify K``: also EAGLE's topk-1 verify graph of K draft tokens per request
(SGLang's TARGET_VERIFY; ``seq_lens`` without the drafts) over the same pools. Variants: ``mla_fa3`` (the graph reads its lengths on the device: the update is
host checks), ``mla_fa3 host`` (``MLA_FA3_GRAPH_LENGTHS=host``: the batch converted and its lengths staged each
replay), and on a GPU SGLang's ``fa3`` and ``flashmla`` (their own replay updates).

    python benchmarks/sglang_replay_host.py --device cpu --out out/replay_host_cpu.csv
    python benchmarks/sglang_replay_host.py --device cuda --out out/replay_host.csv

On the CPU the staged path would also check every new token's slot against ``req_to_token`` (values a GPU run never
reads: that would sync); the benchmark skips that check there, so both devices time the same host work.
Columns: device, mode, heads, bs, ctx, backend, host_us (median), p90_us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
if os.path.isdir(os.path.join(ROOT, ".sglang-cpu")):  # SGLang's CPU import set (make test installs it), else installed
    sys.path.append(os.path.join(ROOT, ".sglang-cpu"))

import torch  # noqa: E402

from benchmarks.sglang_backends import With, decode_world, write_rows  # noqa: E402

SHAPES = [(16, 1, 65536), (16, 4, 32768), (16, 64, 16384), (128, 1, 32768), (128, 64, 16384)]


def _world(kit, heads, bs, ctx, device, k=0):
    """SGLang's runner with ``bs`` requests of ``ctx`` tokens on shuffled pages and the decode batch over them
    (``sglang_backends.decode_world``) — or, ``k`` > 0, the topk-1 verify batch of their last ``k`` tokens."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    fx = decode_world(kit, ForwardMode.DECODE, heads, bs, ctx, False, device)
    if not k:
        return fx.runner, fx.fb
    slots = fx.runner.req_to_token_pool.req_to_token[:bs, ctx - k: ctx].to(torch.int64)
    seq = torch.full((bs,), ctx - k, dtype=torch.int32)  # a verify step's seq_lens leave the drafts out
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
                      input_ids=torch.zeros(bs * k, dtype=torch.int64, device=device),
                      req_pool_indices=fx.fb.req_pool_indices, seq_lens=seq.to(device), seq_lens_cpu=seq,
                      out_cache_loc=slots.reshape(-1).contiguous(), seq_lens_sum=int(seq.sum()),
                      positions=torch.arange(ctx - k, ctx).repeat(bs).to(device, torch.int64))
    fb.spec_info = SimpleNamespace(draft_token_num=k, topk=1, custom_mask=None, positions=fb.positions,
                                   spec_steps=k - 1)
    spec = dict(speculative_eagle_topk=1, speculative_algorithm="EAGLE", speculative_num_draft_tokens=k,
                speculative_num_steps=k - 1)
    _publish_spec(fx.runner.server_args, spec)
    runner = With(fx.runner, server_args=With(fx.runner.server_args, **spec))
    return runner, fb


def _publish_spec(server_args, spec: dict) -> None:
    """SGLang's fa3 reads the verify width from the process's published runtime config (``get_spec()``), not from
    the runner: set the draft settings on the world's (fresh) server args and publish them, as SGLang's attention
    kit does for its speculative runners."""
    from sglang.srt.runtime_context import get_context

    server_args.override(source="replay-host-verify", **spec)
    get_context().set_server_args(server_args)


def _time(registry, name, runner, fb, bs, iters):
    backend = registry[name](runner)
    backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=fb.out_cache_loc.numel())
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata_in_graph(fb)
    for _ in range(20):
        backend.init_forward_metadata_out_graph(fb)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        backend.init_forward_metadata_out_graph(fb)
        times.append(time.perf_counter() - t0)
    if fb.seq_lens.is_cuda:
        torch.cuda.synchronize()
    times.sort()
    return statistics.median(times) * 1e6, times[int(0.9 * (len(times) - 1))] * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="CSV path")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--verify", type=int, default=0, help="also the topk-1 verify graph of this many draft tokens")
    args = p.parse_args(argv)
    from tests.sglang_cpu_shim import prepare_sglang_import

    prepare_sglang_import()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    from mla_fa3.batch_checks import BatchChecks
    from mla_fa3.integrations.sglang import plugin
    from mla_fa3.integrations.sglang.adapter import GRAPH_LENGTHS_ENV

    plugin.register()
    if args.device == "cpu":  # a GPU run never reads the slots' values (see the module doc)
        BatchChecks.check_out_cache_loc = lambda self, batch, rows: None
    variants = [("mla_fa3", "mla_fa3", "device"), ("mla_fa3 host", "mla_fa3", "host")]
    if args.device == "cuda":
        variants += [("fa3", "fa3", None), ("flashmla", "flashmla", None)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    for (heads, bs, ctx), k in [(shape, k) for k in sorted({0, args.verify}) for shape in SHAPES]:
        runner, fb = _world(kit, heads, bs, ctx, args.device, k)
        for label, name, lengths in variants:
            if lengths is not None:
                os.environ[GRAPH_LENGTHS_ENV] = lengths
            try:
                med, p90 = _time(ATTENTION_BACKENDS, name, runner, fb, bs, args.iters)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run here: say so
                med = p90 = float("nan")
                print(f"{label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            finally:
                os.environ.pop(GRAPH_LENGTHS_ENV, None)
            rows.append(dict(device=args.device, mode=f"verify k{k}" if k else "decode", heads=heads, bs=bs, ctx=ctx,
                             backend=label, host_us=round(med, 1), p90_us=round(p90, 1)))
            print(",".join(str(v) for v in rows[-1].values()), flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
