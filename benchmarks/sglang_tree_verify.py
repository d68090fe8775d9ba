"""EAGLE's target verify with a draft tree (topk > 1) inside SGLang: ``mla_fa3`` vs SGLang's ``fa3`` on the same tree.

One DeepSeek attention layer's verify step as SGLang runs it: ``bs`` requests with a cached prefix of ``ctx`` tokens
and ``k`` draft tokens each, arranged as a random tree and sent as SGLang's FULL_MASK ``spec_info.custom_mask``. Each
backend builds its metadata from the batch (outside the timing), then the layer's attention forward (q_lat and q_rope
apart, as SGLang's DeepSeek calls both) is captured in a CUDA graph and its replays timed by CUDA events
(``bench.timing.time_graph``: median of ``--iters``). The chain rows are the same step with topk 1 (a causal verify). Page size 1: SGLang's fa3 reads a tree's
keys through a per-token page table (its topk > 1 verify expands the pool's token slots as page ids).

    python benchmarks/sglang_tree_verify.py --out out/tree_verify.csv [--heads 16 128] [--bs 1 8 32] [--k 8 16 32 64]
    python benchmarks/sglang_tree_verify.py --out out/split.csv --split-below 0 256 1024   # the output split's rule

``--split-below N ...`` adds one tree row per N, backend ``mla_fa3 split<N``: the tree kernel's output split on below
N programs (``ops.tree_attention_triton.SPLIT_BELOW_PROGRAMS``; the default row keeps the library's value).

Columns: heads, bs, k, ctx, backend, shape (tree / chain), us, ratio_vs_fa3 (fa3's us for the same shape / this us: > 1
is faster than fa3), max_diff_vs_fa3 (|out - fa3's out| on the same tree: both are bf16 attention of the same keys),
kernel (what mla_fa3 ran). GPU only; needs SGLang 0.5.17 and sgl-kernel.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # the tests' tree cases

import torch  # noqa: E402

from benchmarks.sglang_backends import With, sglang_ready  # noqa: E402
from mla_fa3.bench.timing import time_graph  # noqa: E402
from mla_fa3.ops import tree_attention_triton as tree_triton  # noqa: E402
from tree_cases import ancestors_mask, random_tree  # noqa: E402

R, D_ROPE = 512, 64


def _fixture(kit, heads, bs, ctx, k, seed, dev="cuda"):
    """SGLang's pools at page 1 for ``bs`` requests of ``ctx`` cached tokens plus ``k`` draft slots (random latent rows,
    shuffled slots), a random draft tree per request, the TARGET_VERIFY batch (SGLang's seq_lens exclude the draft)."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    c = kit.MLAAttentionCase(name=f"tree_{heads}_{bs}_{ctx}_{k}", backend="mla_fa3",
                             forward_mode=ForwardMode.TARGET_VERIFY,
                             num_heads=heads, page_size=1, prefix_lens=(ctx,) * bs, extend_lens=(k,) * bs)
    cfg = kit.TinyMLAModelConfig(num_heads=heads, kv_lora_rank=R, qk_rope_head_dim=D_ROPE, hidden_size=64,
                                 context_len=ctx + k)
    runner = kit.MockMLAModelRunner(case=c, model_config=cfg, dtype=torch.bfloat16, device=dev,
                                    max_context_len=ctx + k, kv_lora_rank=R, qk_rope_head_dim=D_ROPE,
                                    disable_cuda_graph=False, fp8_kv_cache=False)
    g = torch.Generator(device=dev).manual_seed(seed)
    n = ctx + k
    slots = (torch.randperm(bs * n, device=dev, generator=g) + 1).view(bs, n)  # slot 0: padding
    runner.req_to_token_pool.req_to_token[:bs, :n] = slots.to(torch.int32)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, device=dev, generator=g, dtype=torch.bfloat16))
    rng = random.Random(seed)
    trees = [random_tree(k, rng) for _ in range(bs)]
    full_mask = torch.cat([torch.cat([torch.ones(k, ctx, dtype=torch.bool), ancestors_mask(t)], 1).flatten()
                           for t in trees]).to(dev)
    depth = torch.cat([ancestors_mask(t).sum(1) - 1 for t in trees]).to(dev)
    seq = torch.full((bs,), ctx, dtype=torch.int32)
    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
                      input_ids=torch.zeros(bs * k, dtype=torch.int64, device=dev),
                      req_pool_indices=torch.arange(bs, dtype=torch.int32, device=dev), seq_lens=seq.to(dev),
                      seq_lens_cpu=seq, out_cache_loc=slots[:, ctx:].reshape(-1).contiguous(), seq_lens_sum=bs * ctx,
                      positions=(ctx + depth).to(torch.int64))
    layer = RadixAttention(num_heads=heads, head_dim=R + D_ROPE, scaling=192 ** -0.5, num_kv_heads=1, layer_id=0,
                           v_head_dim=R)
    return SimpleNamespace(runner=runner, layer=layer, fb=fb, bs=bs, heads=heads, k=k, full_mask=full_mask,
                           positions=fb.positions, dev=dev)


def _time(name, topk, fx, registry, iters):
    """(µs per replay, out [bs·k, H·r], kernel) of backend ``name`` with EAGLE topk ``topk`` on the fixture's
    step."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    runner = With(fx.runner, server_args=With(fx.runner.server_args, speculative_eagle_topk=topk,
                                                speculative_algorithm="EAGLE", speculative_num_draft_tokens=fx.k,
                                                speculative_num_steps=fx.k - 1))
    backend = registry[name](runner)
    if getattr(backend, "topk", topk) != topk:
        backend.topk = topk
    fb, layer, T, H = fx.fb, fx.layer, fx.bs * fx.k, fx.heads
    fb.spec_info = SimpleNamespace(draft_token_num=fx.k, topk=topk, custom_mask=fx.full_mask, positions=fx.positions,
                                   spec_steps=fx.k - 1)
    g = torch.Generator(device=fx.dev).manual_seed(1)
    q_lat, q_rope = (torch.randn(T, H, d, device=fx.dev, generator=g, dtype=torch.bfloat16) for d in (R, D_ROPE))
    kv = torch.zeros(T, 1, R, device=fx.dev, dtype=torch.bfloat16)

    def step():
        return layer(q_lat.view(T, -1), kv, kv, fb, q_rope=q_rope, k_rope=kv[..., :D_ROPE], save_kv_cache=False)

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fb)
        out = step().clone()
        if fx.dev == "cpu":  # --smoke: the script's plumbing on the CPU (our reference kernels), one eager step
            return float("nan"), out, backend.explain().kernel if name == "mla_fa3" else ""
        us = 1e3 * time_graph(step, warmup=3, iters=iters)
    kernel = backend.explain().kernel if name == "mla_fa3" else ""
    return us, out, kernel


def _timed(name, topk, fx, registry, iters):
    try:
        return _time(name, topk, fx, registry, iters)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape: say so
        return float("nan"), None, f"error: {type(exc).__name__}: {exc}"[:200]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="CSV path")
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="CPU: one tiny shape through the plumbing, nothing timed")
    p.add_argument("--split-below", type=int, nargs="*", default=[],
                   help="also time the tree with the output split on below each of these program counts")
    args = p.parse_args(argv)
    if args.smoke:
        from tests.sglang_cpu_shim import prepare_sglang_import

        prepare_sglang_import()
        from mla_fa3.integrations.sglang import plugin

        plugin.register()
        args.heads, args.bs, args.k, args.ctx = [4], [2], [5], 40
    elif not sglang_ready("sglang_tree_verify"):
        return 2
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows, fields = [], None
    for heads in args.heads:
        for bs in args.bs:
            for k in args.k:
                fx = _fixture(kit, heads, bs, args.ctx, k, seed=bs * 131 + k, dev="cpu" if args.smoke else "cuda")
                res = {}
                for name, shape, topk in (("fa3", "tree", 2), ("mla_fa3", "tree", 2), ("fa3", "chain", 1),
                                          ("mla_fa3", "chain", 1)):
                    res[(name, shape)] = _timed(name, topk, fx, ATTENTION_BACKENDS, args.iters)
                for below in args.split_below:
                    default, tree_triton.SPLIT_BELOW_PROGRAMS = tree_triton.SPLIT_BELOW_PROGRAMS, below
                    try:
                        res[(f"mla_fa3 split<{below}", "tree")] = _timed("mla_fa3", 2, fx, ATTENTION_BACKENDS,
                                                                        args.iters)
                    finally:
                        tree_triton.SPLIT_BELOW_PROGRAMS = default
                for (name, shape), (us, out, kernel) in res.items():
                    base_us, base_out, _ = res[("fa3", shape)]
                    diff = float("nan")
                    if out is not None and base_out is not None:
                        diff = (out.float() - base_out.float()).abs().max().item()
                    row = dict(heads=heads, bs=bs, k=k, ctx=args.ctx, backend=name, shape=shape, us=round(us, 2),
                               ratio_vs_fa3=round(base_us / us, 3), max_diff_vs_fa3=round(diff, 4), kernel=kernel)
                    rows.append(row)
                    fields = fields or list(row)
                    print(",".join(str(v) for v in row.values()), flush=True)
                    with open(args.out, "w", newline="") as f:  # after every row: a killed run keeps what it measured
                        w = csv.DictWriter(f, fieldnames=fields)
                        w.writeheader()
                        w.writerows(rows)
                del fx, res
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
