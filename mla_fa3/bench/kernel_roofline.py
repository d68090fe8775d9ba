"""The decode kernels alone against the roofline, shape by shape: ``bench.splitkv``'s CSV (kernel-alone µs of our
split-KV kernel, FA3 and FlashMLA beside the roofline of the shape's bytes and FLOPs) as each kernel's time over the
roofline, and one plot of it — a group of bars per shape (batch x context), a panel per head count, the roofline at
1 and [kernel]'s bf16 target (within 1.25x of it at 16 heads) drawn across.

    python -m mla_fa3.bench.kernel_roofline docs/perf/2026-12-06/h200/kernel_alone/splitkv.csv --out roofline.png

``bench.splitkv`` draws it next to its CSV (``splitkv_roofline.png``) where matplotlib is installed.
"""

from __future__ import annotations

import csv
import sys
from typing import Optional, Sequence

from mla_fa3.bench.roofline import pyplot, tokens_label

KERNELS = (("splitkv_us", "split-KV (ours)"), ("fa3_us", "FA3"), ("flashmla_us", "FlashMLA"))
TARGET_16_HEADS = 1.25  # [kernel]: bf16 within 1.25x of the roofline at 16 heads, every bs 1-128 at ctx >= 16k


def read_rows(path: str) -> list[dict]:
    """The CSV's rows (``bench.splitkv.Row`` fields as text)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def over_roofline(rows: Sequence[dict]) -> dict:
    """{(heads, batch, context): {kernel column: time / roofline}} — the fastest row of each shape per kernel (a
    sweep or ``--ab`` times several variants of split-KV; the peers repeat), kernels without a time left out."""
    out: dict = {}
    for r in rows:
        key = (int(r["heads"]), int(r["batch"]), int(r["context"]))
        roof = float(r["roofline_us"])
        for col, _ in KERNELS:
            if r.get(col):
                ratio = float(r[col]) / roof
                cell = out.setdefault(key, {})
                cell[col] = min(cell.get(col, ratio), ratio)
    return out


def plot(rows: Sequence[dict], path: str, title: str = "") -> bool:
    """The plot (module docstring) into ``path``; False without matplotlib or without a timed row."""
    plt = pyplot()
    ratios = over_roofline(rows)
    if plt is None or not ratios:
        return False
    heads = sorted({h for h, _, _ in ratios})
    fig, axes = plt.subplots(len(heads), 1, figsize=(max(6.0, 0.55 * len(ratios) + 2), 3.2 * len(heads)),
                             squeeze=False, constrained_layout=True)
    for ax, h in zip((a[0] for a in axes), heads):
        shapes = sorted(k for k in ratios if k[0] == h)
        width = 0.8 / len(KERNELS)
        for i, (col, label) in enumerate(KERNELS):
            xs = [x + (i - (len(KERNELS) - 1) / 2) * width for x in range(len(shapes))]
            ys = [ratios[s].get(col, float("nan")) for s in shapes]
            ax.bar(xs, ys, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        if h <= 32:
            ax.axhline(TARGET_16_HEADS, color="red", linewidth=0.8, linestyle="--", label=f"{TARGET_16_HEADS}x")
        ax.set_xticks(range(len(shapes)), [f"{b} x {tokens_label(c)}" for _, b, c in shapes], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time / roofline", fontsize=8)
        ax.set_title(f"{h} heads: kernel alone / roofline (batch x context)", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.kernel_roofline", description=__doc__.splitlines()[0])
    p.add_argument("csv", help="bench.splitkv's CSV (splitkv.csv or splitkv_fp8.csv)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    if pyplot() is None:
        print("plots need matplotlib: pip install matplotlib (or the mla-fa3[plot] extra)", file=sys.stderr)
        return 2
    if not plot(read_rows(a.csv), a.out, a.title):
        print(f"{a.csv}: no timed row", file=sys.stderr)
        return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
