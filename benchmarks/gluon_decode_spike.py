"""Issue 40's spike on the GPU: the Gluon warp-specialized MLA decode vs our Triton split-KV vs FA3 / FlashMLA.

    python benchmarks/gluon_decode_spike.py --out out/gluon_spike.csv      (about 2 minutes on an H100 / H200)
    python benchmarks/gluon_decode_spike.py --check                         (the correctness check alone)
    python benchmarks/gluon_decode_spike.py --fp8 --out out/gluon_fp8.csv   (the e4m3 cache, bf16 q; --check too)

Kernels alone (each op's whole step: phase 1 + combine for the split-KV kernels), CUDA-graph replays over R
disjoint cache copies (R·bytes > 3x the 50 MiB L2; ``bench.splitkv.Shape``), at least 16 calls per replay, median
per call. Shapes: 16 heads, bf16, page 64, one query token, equal lengths, bs 1/4/16/64 x ctx 16k/32k/64k.

    gluon     ops/gluon_decode.gluon_mla_decode; schedule planned once with ``waves`` (default 1.0: one CTA per SM
              — the kernel takes 164 KB of shared memory), ``--waves 1,2`` times each; ``--half`` adds each with
              bf16 partial outputs (``half_partials``); the combine launched as a programmatic dependent (sm90+)
    triton    ops.splitkv_mla_with_kvcache(impl='triton'), its table's config and schedule
    fa3       FA3 (qv form) and flashmla (FlashMLA), when sgl_kernel imports (else their columns stay empty)
    bytes     Σ L_b · 576 · 2 (the latent rows streamed once);  roofline µs = bytes / the card's bandwidth,
              measured in the same run: a 2 GiB device-to-device copy, (read + write bytes) / time

First, always, ``--check``: the Gluon kernel against the Triton split-KV and the torch reference on one cache
(lengths 65536, 4097, 65, 1; several splits per request; NaN in the tail of each last page): max |Δout|,
max |Δlse|, cosine. A failed check prints CHECK FAILED, the timings still run (marked), the exit status is 1.

``--fp8``: the e4m3 cache (``float8_e4m3fn`` pools with a per-tensor ``descale_k``, ``bench.splitkv.Shape(fp8=True)``)
read with the bf16 q, by the Gluon kernel's e4m3 variant and by our Triton split-KV (its e4m3 table config,
``descale_k=``); bytes = Σ L_b · 576 · 1 (half of bf16's), roofline at the same measured copy bandwidth; FA3 /
FlashMLA columns stay empty (FlashMLA reads an e4m3 cache only with an e4m3 q: another contract). The check then
runs on the e4m3 cache as well as on the bf16 one. Each e4m3 variant is timed twice: the tile staged as fp16 in
shared memory, and (columns ``..r_us``) converted in wgmma's A registers (``reg_a``).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mla_fa3 import ops  # noqa: E402
from mla_fa3.bench import roofline  # noqa: E402
from mla_fa3.bench.splitkv import Shape, fa3_fn, flashmla_fn  # noqa: E402
from mla_fa3.bench.timing import time_cuda, time_per_call  # noqa: E402
from mla_fa3.ops import fa3 as fa3_kernels  # noqa: E402

R, D, H, PAGE = 512, 576, 16, 64
SCALE = (128 + 64) ** -0.5
BATCH, CONTEXT = (1, 4, 16, 64), (16384, 32768, 65536)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes``: (read + write) / median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3)


def check(gd, fp8: bool = False) -> bool:
    """Gluon vs Triton split-KV vs the torch reference on one adversarial cache (``fp8``: rounded to e4m3 with
    descale_k, read with the bf16 q); prints the errors."""
    lens = [65536, 4097, 65, 1]
    g = torch.Generator(device="cuda").manual_seed(0)
    need = [-(-L // PAGE) for L in lens]
    kv = torch.full((sum(need) + 2, PAGE, 1, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(kv.shape[0], device="cuda", generator=g).to(torch.int32)
    table = torch.full((len(lens), max(need)), 2**30, dtype=torch.int32, device="cuda")
    at = 0
    for b, L in enumerate(lens):
        pages = perm[at : at + need[b]]
        at += need[b]
        table[b, : need[b]] = pages
        rows = torch.randn(L, 1, D, device="cuda", generator=g).to(torch.bfloat16)
        kv.view(-1, 1, D)[(pages.long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()[:L]] = rows
    q = torch.randn(len(lens), 1, H, D, device="cuda", generator=g).to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = dict(head_dim_v=R, softmax_scale=SCALE, causal=True)
    gkw = {}
    if fp8:  # NaN stays NaN in e4m3fn; a scale that is not a power of two, so a missed / doubled one shows
        descale = torch.tensor([0.4375], dtype=torch.float32, device="cuda")
        kv = (kv.float() / descale).to(torch.float8_e4m3fn)
        kw["descale_k"] = gkw["descale_k"] = descale
    ok = True
    runs = [(w, r) for w in (1.0, 8.0) for r in ((False, True) if fp8 else (False,))]
    for waves, reg_a in runs:
        sched = ops.get_splitkv_schedule(lens, num_heads=H, page_size=PAGE, device="cuda", waves=waves,
                                         min_split_tokens=64)
        out, lse = gd.gluon_mla_decode(q, kv, table, seqlens, schedule=sched, softmax_scale=SCALE, reg_a=reg_a,
                                       **gkw)
        tri, tri_lse = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=ops.get_splitkv_schedule(
            lens, num_heads=H, page_size=PAGE, device="cuda", kv_fp8=fp8), impl="triton", **kw)
        ref, ref_lse = ops.splitkv_mla_with_kvcache(q, kv, table, seqlens, schedule=sched, impl="reference", **kw)
        a, t, r = out.double(), tri.double(), ref.double()
        cos = float((a.flatten() @ r.flatten()) / (a.norm() * r.norm()).clamp_min(1e-30))
        d_tri, d_ref = (a - t).abs().max().item(), (a - r).abs().max().item()
        dl_tri, dl_ref = (lse - tri_lse).abs().max().item(), (lse - ref_lse).abs().max().item()
        base = (t - r).abs().max().item()  # the Triton kernel's own error against the reference: the scale
        good = bool(torch.isfinite(out).all()) and cos >= 0.9999 and d_ref <= 2 * base + 1e-3 and dl_ref <= 2e-3
        ok &= good
        print(f"check {'e4m3' if fp8 else 'bf16'} cache{' (reg_a)' if reg_a else ''}, waves {waves} "
              f"({sched.planned_work} splits): "
              f"max |gluon - triton| {d_tri:.3g}, "
              f"|gluon - reference| {d_ref:.3g} (triton vs reference {base:.3g}), max |Δlse| vs triton {dl_tri:.3g}, "
              f"vs reference {dl_ref:.3g}, cosine vs reference {cos:.6f}: {'ok' if good else 'CHECK FAILED'}",
              file=sys.stderr, flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="CSV file to write")
    ap.add_argument("--check", action="store_true", help="run the correctness check only")
    ap.add_argument("--waves", default="1.0", help="comma-separated waves for the Gluon schedule (default 1.0)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batch", default=",".join(map(str, BATCH)))
    ap.add_argument("--context", default=",".join(map(str, CONTEXT)))
    ap.add_argument("--fp8", action="store_true", help="the e4m3 cache (descale_k) read with the bf16 q")
    ap.add_argument("--half", action="store_true",
                    help="also time each waves with bf16 partial outputs (columns gluon_w<waves>h_*)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from mla_fa3.ops import gluon_decode as gd

    t0 = time.time()
    ok = check(gd)
    if args.fp8:
        ok &= check(gd, fp8=True)
    if args.check:
        return 0 if ok else 1
    dev = torch.device("cuda")
    card = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{card}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)", file=sys.stderr, flush=True)
    peers = not args.fp8 and fa3_kernels.why_unavailable(dev) is None  # sgl_kernel imports, sm90
    waves = [float(w) for w in args.waves.split(",")]
    rows = []
    for bs in map(int, args.batch.split(",")):
        for ctx in map(int, args.context.split(",")):
            shape = Shape(bs, ctx, dev, fp8=args.fp8)
            q = shape.queries(H)
            n = len(shape.copies)
            nbytes = roofline.decode_bytes(bs * ctx) // (2 if args.fp8 else 1)  # e4m3: 1 byte a value
            gkw = dict(descale_k=shape.descale_k) if args.fp8 else {}
            row = dict(card=card, heads=H, kv="e4m3" if args.fp8 else "bf16", batch=bs, context=ctx, copies=n,
                       bytes=nbytes,
                       copy_tb_s=round(bw / 1e12, 3), roofline_us=1e6 * nbytes / bw, check="ok" if ok else "FAILED")

            def us(fn):
                return 1e3 * time_per_call(fn, n, warmup=3, iters=args.iters)

            variants = [(w, h, r) for w in waves for h in ((False, True) if args.half else (False,))
                        for r in ((False, True) if args.fp8 else (False,))]
            for w, h, r in variants:
                sched = ops.get_splitkv_schedule([ctx] * bs, num_heads=H, page_size=PAGE, device=dev, waves=w)
                tag = f"gluon_w{w:g}{'h' if h else ''}{'r' if r else ''}"
                row[f"{tag}_splits"] = sched.planned_work
                row[f"{tag}_us"] = us(lambda s=sched, h=h, r=r: [gd.gluon_mla_decode(
                    q, kv, table, shape.seqlens, schedule=s, softmax_scale=SCALE, half_partials=h, reg_a=r, **gkw)
                    for kv, table in shape.copies])
            tsched = ops.get_splitkv_schedule([ctx] * bs, num_heads=H, page_size=PAGE, device=dev, kv_fp8=args.fp8)
            row["triton_splits"] = tsched.planned_work
            row["triton_us"] = us(lambda: [ops.splitkv_mla_with_kvcache(
                q, kv, table, shape.seqlens, head_dim_v=R, schedule=tsched, softmax_scale=SCALE, causal=True,
                impl="triton", **gkw) for kv, table in shape.copies])
            for name, make in (("fa3", fa3_fn), ("flashmla", flashmla_fn)):
                row[f"{name}_us"] = us(make(shape, q)) if peers else None
            best = min(row[f"gluon_w{w:g}{'h' if h else ''}{'r' if r else ''}_us"] for w, h, r in variants)
            row["gluon_over_roofline"] = best / row["roofline_us"]
            row["triton_over_gluon"] = row["triton_us"] / best
            for name in ("fa3", "flashmla"):
                row[f"{name}_over_gluon"] = row[f"{name}_us"] / best if row[f"{name}_us"] else None
            rows.append(row)
            print(f"[{time.time() - t0:5.0f} s] bs {bs} ctx {ctx}: gluon {best:.1f} µs, triton {row['triton_us']:.1f}"
                  f", roofline {row['roofline_us']:.1f}", file=sys.stderr, flush=True)
            shape = q = None  # the pools go before the next shape's are made
            torch.cuda.empty_cache()
    cols = list(rows[0])
    fmt = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    shown = [c for c in cols if c not in ("card", "heads", "kv", "copy_tb_s", "check")]
    print(f"\n{card}, 16 heads, {'e4m3 cache (bf16 q)' if args.fp8 else 'bf16'}, page 64; copy {bw / 1e12:.2f} TB/s; "
          f"check {'ok' if ok else 'FAILED'}")
    print("| " + " | ".join(shown) + " |\n|" + "---|" * len(shown))
    for r in rows:
        print("| " + " | ".join(fmt(r[c]) for c in shown) + " |")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
