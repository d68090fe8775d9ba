"""SGLang's MLA attention backends side by side, inside SGLang: ``mla_fa3`` vs ``fa3`` vs ``flashmla``.

One DeepSeek attention layer's decode step as SGLang runs it — the backend's store of the new latent row and its
attention core, in the form SGLang's DeepSeek model calls each backend (``fa3`` / ``mla_fa3``: q_lat and q_rope apart;
``flashmla``: one 576-wide query) — captured in a CUDA graph through each backend's own capture / replay hooks and
timed by CUDA events around graph replays (median of ``--iters``). Every backend reads the same SGLang pool
(``MLATokenToKVPool``, page 64 or ``--page``) of ``bs`` requests at ``ctx`` tokens, built by SGLang's attention test kit.

    python benchmarks/sglang_backends.py --out out/sglang_backends.csv [--quick]
    python benchmarks/sglang_backends.py --out out/one.csv --shapes 16:16:16384 --kv bf16 --profile

``--shapes heads:bs:ctx,...`` replaces the sweep, ``--kv`` picks the cache dtypes, ``--profile`` also prints each
backend's kernels in its metadata graph and its layer graph (torch's profiler over graph replays).

``--ab FIELD=V1,V2,...`` (a ``KernelConfig`` switch, as ``bench.splitkv --ab``; or variants that change several
switches at once, ``F=V+G=W,F=V2+G=W2``, e.g. ``num_stages=3+waves=2,num_stages=2+waves=3+max_registers=168``): the
split-KV launch config A/B-tested inside SGLang's step instead of kernel alone — per shape and round
(``--ab-rounds``), fa3 once and then mla_fa3 once per value, the config table's row for the shape
(``splitkv_config.table_key``) changed by that value while its backend is built, captured and timed (values in
reverse order every other round). Columns: heads, bs, ctx, kv, round, config
(the label), value, stacked_us, fa3_stacked_us, ratio_stacked, kernel, page.

    python benchmarks/sglang_backends.py --out out/ab.csv --kv bf16 --shapes 16:4:32768 --ab combine_tile=rule,64x64

``--probe``: mla_fa3's split-KV phase 1 and combine also stamp each program (SM, start, first key load or first read
of a partial, end: ``benchmarks/splitkv_probe.py``); the last layer of its stacked step (the 61st) is summarized per
shape (and per ``--ab`` value) into ``OUT.probe.csv`` beside the timings: programs per SM, start spread, time to the
first key, duration, tail, the read rate, the hand-off to the combine and its time, and the gap from the layer
before, µs; every program's stamps (and the 60th layer's combine's) into ``OUT.probe_raw.csv``.

``--page N`` (default 64): the pool's page size; SGLang's own default is 1 (flashmla needs 64: an error row).

Columns: heads, bs, ctx, kv (bf16 / fp8), backend, us (median replay of the backend's in-graph metadata half and one
layer call in one graph), host_us (the replay update: the backend's ``init_forward_metadata_out_graph``),
ratio_vs_fa3 (fa3 us / this us: > 1 is faster than fa3), meta_us and layer_us (the same two halves captured and
replayed apart), per_layer_us (layer_us + meta_us / ``--layers``: SGLang's runner runs the metadata half once per
step and the layer call once per layer, 61 layers in DeepSeek-V3), ratio_per_layer (fa3's per_layer_us / this),
kernel (what mla_fa3 ran); stacked_us and ratio_stacked: the step as a model runs it — one graph holding the
metadata half once and ``--layers`` layer calls, layer i over pool layer i mod R (R pool layers of random rows, as
many as it takes for the bytes read in a cycle to pass 3x the 50 MB L2), per layer (replay / ``--layers``; median
of ``--stack-iters``). ``layer_us`` replays one layer call per graph, so it carries a graph launch and the event
pair (the empty graph's ``meta_us`` of fa3, ~9-17 µs on an H100) that a model's step pays once, not per layer:
``stacked_us`` is the per-layer figure; ``per_layer_us`` is what the tables of earlier runs show. Last, ``page``.
GPU only; needs SGLang 0.5.17 and sgl-kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.splitkv_probe import SplitKVProbe  # noqa: E402
from mla_fa3.bench.splitkv_candidates import ab_text, parse_ab  # noqa: E402

SHAPES = [(1, 65536), (1, 131072), (4, 32768), (4, 65536), (16, 16384), (64, 16384), (64, 32768)]
QUICK = [(1, 65536), (4, 32768), (64, 16384)]


def decode_world(kit, mode, heads, bs, ctx, fp8, device="cuda", pool_layers=1, page=64):
    """SGLang's pools (the kit's MockMLAModelRunner) for ``bs`` requests of ``ctx`` tokens on shuffled pages of
    ``page`` tokens (1: every row of a request on its own slot, in shuffled order — SGLang's default page size),
    filled with random latent rows, and the decode batch writing token ``ctx - 1`` of each (vectorized: the kit's
    own fixture fills tables element by element). ``pool_layers`` > 1: the kit's one-layer pool gets more layer
    buffers of random rows (same page table), and ``layers`` one RadixAttention per pool layer."""
    from types import SimpleNamespace

    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    if ctx % page:
        raise ValueError(f"ctx {ctx} is not a whole number of pages of {page}")
    c = kit.MLAAttentionCase(name=f"bench_{heads}_{bs}_{ctx}", backend="mla_fa3", forward_mode=mode,
                             num_heads=heads, page_size=page, prefix_lens=(ctx - 1,) * bs)
    cfg = kit.TinyMLAModelConfig(num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=64,
                                 context_len=ctx)
    runner = kit.MockMLAModelRunner(case=c, model_config=cfg, dtype=torch.bfloat16, device=device,
                                    max_context_len=ctx, kv_lora_rank=512, qk_rope_head_dim=64,
                                    disable_cuda_graph=False, fp8_kv_cache=fp8)
    pages_per_req = ctx // page
    g = torch.Generator(device=device).manual_seed(bs * 7 + ctx)
    perm = torch.randperm(bs * pages_per_req, device=device, generator=g) + 1  # page 0: padding
    pages = perm.view(bs, pages_per_req).to(torch.int64)
    slots = (pages.unsqueeze(-1) * page + torch.arange(page, device=device)).view(bs, ctx)
    runner.req_to_token_pool.req_to_token[:bs, :ctx] = slots.to(torch.int32)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    rows = torch.randn(buf.shape[0], 1, 576, device=device, generator=g, dtype=torch.bfloat16)
    buf.copy_(rows.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else rows)
    del rows
    pool = runner.token_to_kv_pool
    for _ in range(pool_layers - 1):  # more layers: each backend reads pool.kv_buffer[layer_id] when it is built
        more = torch.empty_like(buf)
        more.copy_(buf[torch.randperm(buf.shape[0], device=device, generator=g)])
        pool.kv_buffer.append(more)
    pool.layer_num = len(pool.kv_buffer)
    seq = torch.full((bs,), ctx, dtype=torch.int32)
    fb = ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
                      req_pool_indices=torch.arange(bs, dtype=torch.int32, device=device), seq_lens=seq.to(device),
                      seq_lens_cpu=seq, out_cache_loc=slots[:, -1].contiguous(), seq_lens_sum=bs * ctx,
                      positions=torch.full((bs,), ctx - 1, dtype=torch.int64, device=device))
    layers = [RadixAttention(num_heads=heads, head_dim=576, scaling=192 ** -0.5, num_kv_heads=1, layer_id=i,
                             v_head_dim=512) for i in range(pool.layer_num)]
    return SimpleNamespace(runner=runner, layer=layers[0], layers=layers, fb=fb, bs=bs, heads=heads)


def pool_layers_for(bs: int, ctx: int, fp8: bool, l2_bytes: int = 50 * 2 ** 20) -> int:
    """Pool layers a stacked step cycles through: enough that one cycle reads more than 3x the L2."""
    return max(1, -(-3 * l2_bytes // (bs * ctx * 576 * (1 if fp8 else 2))))


def sglang_ready(prog: str) -> bool:
    """A CUDA GPU is here (else one line on stderr and False); the import shim applied; the plugin registered."""
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (sm90) with SGLang 0.5.17 and sgl-kernel", file=sys.stderr)
        return False
    from tests.sglang_cpu_shim import prepare_sglang_import

    prepare_sglang_import()
    from mla_fa3.integrations.sglang import plugin

    plugin.register()
    return True


def step_inputs(bs: int, heads: int):
    """(q_lat [bs, H, 512], q_rope [bs, H, 64], c_kv [bs, 1, 512], k_rope [bs, 1, 64]) bf16, seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((bs, heads, 512), (bs, heads, 64), (bs, 1, 512), (bs, 1, 64))
    return tuple(torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes)


def replay_us(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Median time of one replay of ``graph`` (CUDA events), in µs."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _captured(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once, then captured alone in a CUDA graph, replayed once."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _kernel_table(graph: torch.cuda.CUDAGraph, replays: int = 20) -> list[tuple[str, float, float]]:
    """The GPU kernels of ``graph``, from torch's profiler over ``replays`` replays: (name, µs per replay, launches
    per replay), slowest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / replays, e.count / replays) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def _time_backend(name, fx, registry, iters, profile_meta=False, stack=0, stack_iters=10):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend = registry[name](fx.runner)
    layer, fb, bs, H = fx.layer, fx.fb, fx.bs, fx.heads
    q_lat, q_rope, c_kv, k_rope = step_inputs(bs, H)
    q_cat, k_cat = torch.cat([q_lat, q_rope], -1), torch.cat([c_kv, k_rope], -1)

    def step(layer=layer):
        if name == "flashmla":
            return layer(q_cat.view(bs, -1), k_cat, c_kv, fb)
        return layer(q_lat.view(bs, -1), c_kv, c_kv, fb, q_rope=q_rope, k_rope=k_rope)

    def stacked():  # a model's step: the metadata half once, then ``stack`` layers over the pool layers in turn
        backend.init_forward_metadata_in_graph(fb)
        for i in range(stack):
            step(fx.layers[i % len(fx.layers)])

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        backend.init_forward_metadata_in_graph(fb)
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # as SGLang's runner captures: the backend's in-graph half, then the layer
            backend.init_forward_metadata_in_graph(fb)
            step()
        host = []
        for _ in range(20):
            t0 = time.perf_counter()
            backend.init_forward_metadata_out_graph(fb)
            host.append(time.perf_counter() - t0)
            graph.replay()
        torch.cuda.synchronize()
        us = replay_us(graph, iters)
        parts = {"meta": _captured(lambda: backend.init_forward_metadata_in_graph(fb)), "layer": _captured(step)}
        meta_us, layer_us = (replay_us(parts[part], iters) for part in ("meta", "layer"))
        if profile_meta:  # the same two graphs
            for part, part_graph in parts.items():
                for kname, us_each, n in _kernel_table(part_graph):
                    print(f"  {name} {part}: {us_each:8.2f} us  x{n:g}  {kname[:110]}", flush=True)
        del parts
        stacked_us = replay_us(_captured(stacked), stack_iters) / stack if stack else float("nan")
    kernel = backend.explain().kernel if name == "mla_fa3" else ""
    return dict(us=us, host_us=statistics.median(host) * 1e6, meta_us=meta_us, layer_us=layer_us,
                stacked_us=stacked_us, kernel=kernel)


class With:
    """``obj`` with some attributes replaced (SGLang's resolved server args are read-only): the backends read the
    runner's server args when they are built."""

    def __init__(self, obj, **changes):
        self.__dict__.update(changes)
        self._obj = obj

    def __getattr__(self, name):
        return getattr(self._obj, name)


@contextlib.contextmanager
def table_row_with(heads: int, bs: int, ctx: int, fp8: bool, changes: dict):
    """The split-KV config table's row for (heads, bs, ctx) with ``changes`` (field -> value, a ``parse_ab`` value)
    inside the block (restored after); yields that config. A backend built, captured and run inside plans its
    schedules with it."""
    from mla_fa3.ops import splitkv_config

    table = splitkv_config.E4M3_CONFIG_TABLE if fp8 else splitkv_config.CONFIG_TABLE
    key = splitkv_config.table_key(heads, bs, ctx, table)
    saved = table[key]
    table[key] = saved.with_(**changes)
    try:
        yield table[key]
    finally:
        table[key] = saved


def time_ours(fx, registry, args, stack: int, probes: dict, **labels) -> dict:
    """``_time_backend`` of mla_fa3 (``stack`` layers stacked); with ``args.probe`` its split-KV timeline too, appended
    to ``probes["summary"]`` as one row and to ``probes["raw"]`` as one row per program (``labels`` first)."""
    with SplitKVProbe() if args.probe else contextlib.nullcontext() as probe:
        r = _time_backend("mla_fa3", fx, registry, args.iters, args.profile, stack, args.stack_iters)
    timeline = probe.summary() if probe else {}
    if timeline:
        probes["summary"].append(dict(labels, **timeline))
        print("probe," + ",".join(f"{k}={v}" for k, v in probes["summary"][-1].items()), flush=True)
        probes["raw"].extend(dict(labels, **row) for row in probe.timeline())
    return r


def ab_rows(args, ab, kit, registry, mode, shapes, probes: dict) -> list[dict]:
    """``--ab``: per shape and round, fa3's stacked step and mla_fa3's with each value of ``ab`` = (name, one dict of
    config changes per value: ``parse_ab``)."""
    _, values = ab
    rows = []
    for heads, bs, ctx in shapes:
        for fp8 in (kv == "fp8" for kv in args.kv):
            fx = decode_world(kit, mode, heads, bs, ctx, fp8, pool_layers=pool_layers_for(bs, ctx, fp8),
                              page=args.page)
            for rnd in range(args.ab_rounds):
                base = _time_backend("fa3", fx, registry, args.iters, False, args.layers, args.stack_iters)
                for value in (values if rnd % 2 == 0 else values[::-1]):
                    text = ab_text(value)
                    with table_row_with(heads, bs, ctx, fp8, value) as config:
                        r = time_ours(fx, registry, args, args.layers, probes, heads=heads, bs=bs, ctx=ctx,
                                      kv="fp8" if fp8 else "bf16", round=rnd, value=text)
                    row = dict(heads=heads, bs=bs, ctx=ctx, kv="fp8" if fp8 else "bf16", round=rnd,
                               config=config.label(), value=text, stacked_us=round(r["stacked_us"], 2),
                               fa3_stacked_us=round(base["stacked_us"], 2),
                               ratio_stacked=round(base["stacked_us"] / r["stacked_us"], 3), kernel=r["kernel"],
                               page=args.page)
                    rows.append(row)
                    print(",".join(str(v) for v in row.values()), flush=True)
            del fx
            torch.cuda.empty_cache()
    return rows


def write_rows(path: str, rows: list[dict]) -> None:
    """``rows`` (dicts, in column order) as a CSV file with a header: every key of any row, in the order first seen
    (a row without one leaves its cell empty)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        w.writeheader()
        w.writerows(rows)


def write_probes(out: str, probes: dict) -> None:
    """``--probe``'s files beside ``out``: ``OUT.probe.csv`` (a summary per timed step) and ``OUT.probe_raw.csv`` (its
    programs' stamps), when any was taken."""
    if probes["summary"]:
        write_rows(out + ".probe.csv", probes["summary"])
    if probes["raw"]:
        write_rows(out + ".probe_raw.csv", probes["raw"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="CSV path")
    p.add_argument("--quick", action="store_true", help="three shapes")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--layers", type=int, default=61, help="layers per step for per_layer_us (DeepSeek-V3: 61)")
    p.add_argument("--shapes", default="", help="heads:bs:ctx,... instead of the sweep (e.g. 16:4:32768)")
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--page", type=int, default=64, choices=(1, 16, 32, 64),
                   help="the pool's page size (SGLang's default is 1; flashmla needs 64 and reports an error row)")
    p.add_argument("--profile", action="store_true", help="also each backend's kernels per graph (torch profiler)")
    p.add_argument("--stack-iters", type=int, default=10, help="replays of the stacked step (0: not timed)")
    p.add_argument("--ab", metavar="FIELD=V1,V2",
                   help="mla_fa3's stacked step once per value of a split-KV KernelConfig switch (see above)")
    p.add_argument("--ab-rounds", type=int, default=2, help="rounds of --ab (fa3, then every value, per round)")
    p.add_argument("--probe", action="store_true", help="also split-KV phase 1's program timeline (OUT.probe.csv)")
    args = p.parse_args(argv)
    try:  # a bad switch is refused before anything is built
        ab = parse_ab(args.ab) if args.ab else None
    except ValueError as exc:
        p.error(str(exc))
    if not sglang_ready("sglang_backends"):
        return 2
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    shapes = [(h, bs, ctx) for h in args.heads for bs, ctx in (QUICK if args.quick else SHAPES)]
    if args.shapes:
        shapes = [tuple(int(v) for v in item.split(":")) for item in args.shapes.split(",")]
    probes: dict = {"summary": [], "raw": []}
    if ab:
        rows = ab_rows(args, ab, kit, ATTENTION_BACKENDS, ForwardMode.DECODE, shapes, probes)
        write_rows(args.out, rows)
        write_probes(args.out, probes)
        return 0
    for heads, bs, ctx in shapes:
        for fp8 in (kv == "fp8" for kv in args.kv):
            stack = args.layers if args.stack_iters else 0
            fx = decode_world(kit, ForwardMode.DECODE, heads, bs, ctx, fp8,
                              pool_layers=pool_layers_for(bs, ctx, fp8) if stack else 1, page=args.page)
            res = {}
            for name in ("fa3", "flashmla", "mla_fa3"):
                try:
                    if name == "mla_fa3":
                        res[name] = time_ours(fx, ATTENTION_BACKENDS, args, stack, probes, heads=heads, bs=bs, ctx=ctx,
                                              kv="fp8" if fp8 else "bf16")
                    else:
                        res[name] = _time_backend(name, fx, ATTENTION_BACKENDS, args.iters, args.profile, stack,
                                                  args.stack_iters)
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape: say so
                    nan = float("nan")
                    res[name] = dict(us=nan, host_us=nan, meta_us=nan, layer_us=nan, stacked_us=nan,
                                     kernel=f"error: {type(exc).__name__}: {exc}"[:160])
            for r in res.values():
                r["per_layer_us"] = r["layer_us"] + r["meta_us"] / args.layers
            base = res["fa3"]
            for name, r in res.items():
                row = dict(heads=heads, bs=bs, ctx=ctx, kv="fp8" if fp8 else "bf16", backend=name,
                           us=round(r["us"], 2), host_us=round(r["host_us"], 1),
                           ratio_vs_fa3=round(base["us"] / r["us"], 3), meta_us=round(r["meta_us"], 2),
                           layer_us=round(r["layer_us"], 2), per_layer_us=round(r["per_layer_us"], 2),
                           ratio_per_layer=round(base["per_layer_us"] / r["per_layer_us"], 3),
                           stacked_us=round(r["stacked_us"], 2),
                           ratio_stacked=round(base["stacked_us"] / r["stacked_us"], 3),
                           pool_layers=len(fx.layers), kernel=r["kernel"], page=args.page)
                rows.append(row)
                print(",".join(str(v) for v in row.values()), flush=True)
            del fx
            torch.cuda.empty_cache()
    write_rows(args.out, rows)
    write_probes(args.out, probes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
