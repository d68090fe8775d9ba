"""The tree part of a speculative tree step alone: ``ops.tree_attention``'s Triton kernel vs its torch form.

    python benchmarks/tree_attention.py [--out FILE.txt] [--out-splits 1,2,4,8]

Each call is captured in a CUDA graph and its replays timed by CUDA events (``bench.timing.time_graph``: the median
of 20): device time, not the launch overhead of eager calls. Shapes: 16 and 128 heads, bs x k draft tokens per request (a chain mask), bf16,
DeepSeek's 512 + 64 latent row. GPU only (no sgl-kernel needed). ``--out-splits``: the kernel again with its output
columns split over that many programs (``tree_attention_triton.tree_attention(out_splits=)``), with the prefix part's
state merged in as a verify step runs it, one column per value.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mla_fa3 import ops  # noqa: E402
from mla_fa3.ops import tree_attention_triton as tk  # noqa: E402
from mla_fa3.bench.timing import time_graph  # noqa: E402

SHAPES = ((1, 8), (1, 16), (1, 32), (1, 64), (8, 16), (32, 16), (32, 64))  # (bs, k)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the lines to this file")
    p.add_argument("--out-splits", default="", help="comma-separated output column groups to time, e.g. 1,2,4,8")
    args = p.parse_args(argv)
    splits = [int(k) for k in args.out_splits.split(",") if k]
    if not torch.cuda.is_available():
        print("tree_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    lines = [torch.cuda.get_device_name()]
    for H in (16, 128):
        for bs, k in SHAPES:
            T, dev, bf16 = bs * k, "cuda", torch.bfloat16
            q_lat = torch.randn(T, H, 512, device=dev, dtype=bf16)
            q_rope = torch.randn(T, H, 64, device=dev, dtype=bf16)
            kv = torch.randn(bs * k * 4, 576, device=dev, dtype=bf16)
            slots = torch.randperm(bs * k * 4, device=dev)[: bs * k].view(bs, k)
            mask = torch.tril(torch.ones(k, k, dtype=torch.bool, device=dev)).expand(bs, k, k).contiguous()
            us = {impl: 1e3 * time_graph(lambda impl=impl: ops.tree_attention(q_lat, q_rope, kv, slots, mask,
                                                                               softmax_scale=0.07, impl=impl),
                                         warmup=3, iters=20)
                  for impl in ("triton", "reference")}
            q_mb = T * H * 576 * 2 / 1e6
            prior = (torch.randn(T, H, 512, device=dev, dtype=bf16), torch.randn(T, H, device=dev))
            split_us = {s_: 1e3 * time_graph(lambda s_=s_: tk.tree_attention(
                q_lat, q_rope, kv, slots, mask, softmax_scale=0.07, softcap=0.0, kv_scale=None, prior=prior,
                out_splits=s_), warmup=3, iters=20) for s_ in splits}
            with_splits = "".join(f", prior + out_splits {s_}: {v:.1f} us" for s_, v in split_us.items())
            lines.append(f"H {H} bs {bs} k {k} (q {q_mb:.1f} MB): triton {us['triton']:.1f} us, torch "
                         f"{us['reference']:.1f} us (graph replay){with_splits}")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
