"""Roofline model of absorbed-MLA decode and the decode benchmark's outputs (CSV, markdown, PNG).

Per layer and decode step, with ``L_b`` the KV length of request b, ``H`` heads, ``r`` = 512 latent
and ``d_rope`` = 64 (DeepSeek-V3; rows of ``r + d_rope`` = 576 bf16 values):

    bytes  = Σ_b L_b · (r + d_rope) · 2                 (the latent cache, read once; q/out are tiny)
    FLOPs  = 2 · H · Σ_b L_b · ((r + d_rope) + r)        (scores over 576, values over 512)
    t_roof = max(bytes / BW, FLOPs / C)                   BW = 4.3 TB/s, C = 790 TFLOP/s measured

The arithmetic intensity FLOPs / bytes = 2·H·1088 / 1152 ≈ 1.89·H FLOP/B does not depend on batch
or context; the H200 ridge is C / BW ≈ 184 FLOP/B, so 16-64 heads are memory bound and 128 heads
compute bound. ``DecodeRow`` is one measured shape; ``write_csv`` / ``read_csv`` / ``markdown_table``
/ ``plot_roofline`` produce the benchmark's files. ``python -m mla_fa3.bench.roofline --decode-csv D
--prefill-csv P --out DIR`` redraws the plots from recorded CSVs (matplotlib: an optional import, used
only by the plots).
"""

from __future__ import annotations

import csv
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from mla_fa3.bench.timing import Ceilings

KV_LORA_RANK = 512  # DeepSeek-V3 latent width r
QK_ROPE_HEAD_DIM = 64  # DeepSeek-V3 rope width
BYTES_PER_ELEM = 2  # bf16


def decode_bytes(kv_tokens: int, *, r: int = KV_LORA_RANK, d_rope: int = QK_ROPE_HEAD_DIM) -> int:
    """Bytes of latent cache one layer's decode step reads: ``Σ L_b · (r + d_rope) · 2``."""
    return kv_tokens * (r + d_rope) * BYTES_PER_ELEM


def decode_flops(num_heads: int, kv_tokens: int, *, r: int = KV_LORA_RANK, d_rope: int = QK_ROPE_HEAD_DIM) -> int:
    """FLOPs of one layer's absorbed decode: ``2 · H · Σ L_b · ((r + d_rope) + r)``."""
    return 2 * num_heads * kv_tokens * (r + d_rope + r)


@dataclass
class DecodeRow:
    """One measured decode shape (per layer). Times in ms; empty (None) when not measured."""

    heads: int  # H query heads
    batch: int  # requests, one query token each
    context: int  # longest KV length (every request for "equal")
    page: int  # page size
    lengths: str  # "equal" or "skewed"
    kv_tokens: int  # Σ_b L_b
    bytes: int  # latent bytes read (decode_bytes)
    flops: int  # decode_flops
    roofline_ms: float  # max(bytes / BW, flops / C)
    bound: str  # "memory" or "compute"
    backend_ms: float | None = None  # whole backend step per layer under graph replay (+ update / layers)
    backend_kernel: str | None = None  # kernel the backend chose ("fa3" / "flashmla")
    update_ms: float | None = None  # metadata replay update per step (not per layer)
    fa3_ms: float | None = None  # FA3 kernel alone, graph replay
    flashmla_ms: float | None = None  # FlashMLA kernel alone (page 64 only)
    splitkv_ms: float | None = None  # the split-KV Triton kernel alone (page 64 only)
    layers_rotated: int = 1  # cache copies cycled per replay to defeat the L2

    @property
    def best_kernel_ms(self) -> float | None:
        times = [t for t in (self.fa3_ms, self.flashmla_ms, self.splitkv_ms) if t]
        return min(times) if times else None

    def ratios(self) -> dict[str, float | None]:
        """backend / the fastest kernel alone and kernel / roofline (None where a time is missing)."""
        best = self.best_kernel_ms

        def div(a, b):
            return a / b if a and b else None

        return {
            "backend_over_best": div(self.backend_ms, best),
            "fa3_over_roofline": div(self.fa3_ms, self.roofline_ms),
            "flashmla_over_roofline": div(self.flashmla_ms, self.roofline_ms),
            "splitkv_over_roofline": div(self.splitkv_ms, self.roofline_ms),
            "backend_over_roofline": div(self.backend_ms, self.roofline_ms),
        }


def make_row(heads: int, batch: int, context: int, page: int, lengths: str, kv_tokens: int,
             ceilings: Ceilings) -> DecodeRow:
    """A DecodeRow with the roofline columns filled in."""
    nbytes, flops = decode_bytes(kv_tokens), decode_flops(heads, kv_tokens)
    return DecodeRow(heads, batch, context, page, lengths, kv_tokens, nbytes, flops,
                     ceilings.time_ms(nbytes, flops), ceilings.bound(nbytes, flops))


FIELDS = [f.name for f in dataclasses.fields(DecodeRow)]
RATIO_FIELDS = ["backend_over_best", "fa3_over_roofline", "flashmla_over_roofline", "backend_over_roofline"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_csv(rows: Sequence[DecodeRow], path: str) -> None:
    """One line per row: the DecodeRow fields then the ratios."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS + RATIO_FIELDS)
        for row in rows:
            ratios = row.ratios()
            w.writerow([_fmt(getattr(row, k)) for k in FIELDS] + [_fmt(ratios[k]) for k in RATIO_FIELDS])


def read_csv(path: str) -> list[DecodeRow]:
    """Rows written by ``write_csv`` (ratio columns are recomputed, not read)."""
    types = {f.name: f.type for f in dataclasses.fields(DecodeRow)}
    rows = []
    with open(path, newline="") as f:
        for rec in csv.DictReader(f):
            kw = {}
            for name in FIELDS:
                raw, typ = rec.get(name, ""), str(types[name])
                if raw == "":
                    kw[name] = None
                elif typ.startswith("int"):
                    kw[name] = int(raw)
                elif typ.startswith("float"):
                    kw[name] = float(raw)
                else:
                    kw[name] = raw
            rows.append(DecodeRow(**kw))
    return rows


def markdown_table(rows: Iterable[DecodeRow], ceilings: Ceilings, title: str | None = None) -> str:
    """Markdown summary: times in µs, achieved TB/s (memory bound) or TFLOP/s (compute bound), ratios.
    ``title`` replaces the first line (a CPU smoke run says so: :func:`smoke_label`)."""

    def us(t):
        return f"{1e3 * t:.1f}" if t else "—"

    def rate(row, t):
        if not t:
            return "—"
        if row.bound == "memory":
            return f"{row.bytes / (t * 1e-3) / 1e12:.2f} TB/s"
        return f"{row.flops / (t * 1e-3) / 1e12:.0f} TF/s"

    def ratio(x):
        return f"{x:.2f}" if x else "—"

    out = [
        title or f"Per layer, bf16, DeepSeek-V3 latent (576), CUDA-graph replay. Roofline: {ceilings.name} "
        f"{ceilings.read_bytes_per_s / 1e12:.1f} TB/s, {ceilings.bf16_flops_per_s / 1e12:.0f} TFLOP/s.",
        "",
        "| H | bs | ctx | page | lengths | roofline µs | backend µs (kernel) | FA3 µs | FlashMLA µs | split-KV µs "
        "| FA3 rate | FlashMLA rate | split-KV rate | backend / best | best / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row.ratios()
        best = row.best_kernel_ms
        out.append(
            f"| {row.heads} | {row.batch} | {row.context} | {row.page} | {row.lengths} | {us(row.roofline_ms)} "
            f"| {us(row.backend_ms)} ({row.backend_kernel or '—'}) | {us(row.fa3_ms)} | {us(row.flashmla_ms)} "
            f"| {us(row.splitkv_ms)} | {rate(row, row.fa3_ms)} | {rate(row, row.flashmla_ms)} "
            f"| {rate(row, row.splitkv_ms)} | {ratio(r['backend_over_best'])} "
            f"| {ratio(best / row.roofline_ms if best else None)} |"
        )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------- labels
def smoke_label(device: str, impl: str = "auto") -> str | None:
    """The title of a run that is not an H200 FA3 measurement (a CPU device or impl=reference), else None."""
    if device.startswith("cuda") and impl != "reference":
        return None
    where = "CPU" if not device.startswith("cuda") else f"{device} with impl=reference"
    return (f"**{where} smoke run** on the pure-torch reference kernels, not FA3 / FlashMLA (kernel columns time "
            "their references): no time here is an H200 measurement; H200 rooflines and cost models are shown "
            "for scale only.")


# ------------------------------------------------------------------------------------------- plots
# Heat maps over batch x context, one panel per head count and one panel row per (page, lengths):
#   decode_backend_vs_best.png  backend step / min(FA3, FlashMLA)   (< 1: the backend beat both kernels)
#   decode_roofline.png         min(FA3, FlashMLA) / roofline       (1 = at the roofline)
# prefill_paths.png: absorbed and MHA time over the cached prefix, auto's choice circled.
DECODE_METRICS = {
    "backend_over_best": "backend step / faster kernel alone (FA3 or FlashMLA); < 1: the backend beats both",
    "best_over_roofline": "faster kernel / roofline (1 = at the roofline)",
}


def decode_metric(row: DecodeRow, metric: str) -> float | None:
    """``backend_over_best`` or ``best_over_roofline`` of one row (None where a time is missing)."""
    best = row.best_kernel_ms
    if metric == "backend_over_best":
        return row.backend_ms / best if row.backend_ms and best else None
    if metric == "best_over_roofline":
        return best / row.roofline_ms if best else None
    raise ValueError(f"metric must be one of {sorted(DECODE_METRICS)}, got {metric!r}")


def decode_grid(rows: Sequence[DecodeRow], metric: str, *, heads: int, page: int, lengths: str):
    """(batches, contexts, values[batch index][context index] or None) of one heat-map panel."""
    cells = [r for r in rows if (r.heads, r.page, r.lengths) == (heads, page, lengths)]
    batches = sorted({r.batch for r in rows})
    contexts = sorted({r.context for r in rows})
    values = [[None] * len(contexts) for _ in batches]
    for r in cells:
        values[batches.index(r.batch)][contexts.index(r.context)] = decode_metric(r, metric)
    return batches, contexts, values


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tokens_label(n: int) -> str:
    """A token count as an axis label: 16384 -> "16k"."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_decode_heatmaps(rows: Sequence[DecodeRow], path: str, metric: str, title: str = "") -> bool:
    """One heat map per (page, lengths) x heads of ``metric`` (see DECODE_METRICS); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.colors import LogNorm, TwoSlopeNorm

    vals = [v for v in (decode_metric(r, metric) for r in rows) if v]
    if not vals:
        return False
    slices = sorted({(r.page, r.lengths) for r in rows}, key=lambda s: (-s[0], s[1]))
    heads = sorted({r.heads for r in rows})
    if metric == "backend_over_best":
        cmap, norm = "RdYlGn_r", TwoSlopeNorm(vmin=min(min(vals), 0.9), vcenter=1.0, vmax=max(max(vals), 1.1))
    else:
        cmap, norm = "YlOrRd", LogNorm(vmin=min(1.0, min(vals)), vmax=max(max(vals), 1.5))
    fig, axes = plt.subplots(len(slices), len(heads), figsize=(3.4 * len(heads) + 1.5, 2.9 * len(slices) + 1.2),
                             squeeze=False, constrained_layout=True)
    image = None
    for i, (page, lengths) in enumerate(slices):
        for j, h in enumerate(heads):
            ax = axes[i][j]
            batches, contexts, grid = decode_grid(rows, metric, heads=h, page=page, lengths=lengths)
            data = [[float("nan") if v is None else v for v in line] for line in grid]
            image = ax.imshow(data, origin="lower", aspect="auto", cmap=cmap, norm=norm)
            for bi, line in enumerate(grid):
                for ci, v in enumerate(line):
                    if v is not None:
                        ax.text(ci, bi, f"{v:.2f}" if v < 10 else f"{v:.0f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(contexts)), [tokens_label(c) for c in contexts], fontsize=8)
            ax.set_yticks(range(len(batches)), [str(b) for b in batches], fontsize=8)
            ax.set_title(f"H = {h}, page {page}, {lengths}", fontsize=9)
            if i == len(slices) - 1:
                ax.set_xlabel("context (longest KV length)", fontsize=8)
            if j == 0:
                ax.set_ylabel("batch", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label=DECODE_METRICS[metric])
    fig.suptitle(title or f"MLA decode per layer: {DECODE_METRICS[metric]}", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_roofline(rows: Sequence[DecodeRow], path: str, ceilings: Ceilings) -> bool:
    """The decode benchmark's plots: ``path`` gets best kernel / roofline, and ``decode_backend_vs_best.png``
    next to it backend / best kernel (heat maps, see :func:`plot_decode_heatmaps`); False without matplotlib."""
    roof = f"{ceilings.name} roofline ({ceilings.read_bytes_per_s / 1e12:.1f} TB/s, " \
           f"{ceilings.bf16_flops_per_s / 1e12:.0f} TFLOP/s)"
    ok = plot_decode_heatmaps(rows, path, "best_over_roofline",
                              f"MLA decode per layer, bf16: faster kernel (FA3 or FlashMLA) / {roof}")
    sibling = os.path.join(os.path.dirname(path), "decode_backend_vs_best.png")
    return plot_decode_heatmaps(rows, sibling, "backend_over_best",
                                "MLA decode per layer, bf16: whole backend step / faster kernel alone") and ok


def read_prefill_csv(path: str) -> list[dict]:
    """Rows of the prefill benchmark's CSV (``mla_fa3.bench.prefill``), numbers converted."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if v and k not in ("mha_path", "auto_path", "best_path"):
                r[k] = float(v) if any(c in v for c in ".eE") else int(v)
    return rows


def plot_prefill(rows: Sequence[dict], path: str) -> bool:
    """Absorbed vs MHA time over the cached prefix, one panel per (heads, new tokens), auto's pick circled."""
    plt = pyplot()
    if plt is None or not rows:
        return False
    from matplotlib.ticker import FuncFormatter

    heads, news = sorted({r["heads"] for r in rows}), sorted({r["new"] for r in rows})
    fig, axes = plt.subplots(len(heads), len(news), figsize=(3.3 * len(news) + 0.5, 2.9 * len(heads) + 1.0),
                             squeeze=False, constrained_layout=True)
    for i, h in enumerate(heads):
        for j, n in enumerate(news):
            ax, cell = axes[i][j], sorted((r for r in rows if (r["heads"], r["new"]) == (h, n)),
                                          key=lambda r: r["prefix"])
            x = list(range(len(cell)))
            ax.plot(x, [r["absorbed_ms"] for r in cell], "o-", color="tab:blue", label="absorbed")
            ax.plot(x, [r["mha_ms"] for r in cell], "s-", color="tab:orange", label="MHA (one-shot; chunked over a prefix)")
            ax.scatter(x, [r["auto_ms"] for r in cell], s=160, facecolors="none", edgecolors="black", lw=1.5,
                       label="auto's choice", zorder=3)
            wrong = [(k, r["auto_ms"]) for k, r in enumerate(cell) if r["auto_over_best"] > 1.0]
            if wrong:
                ax.scatter(*zip(*wrong), marker="x", color="red", s=70, label="auto chose the slower", zorder=4)
            ax.set_yscale("log")
            for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "125" else ""))
            ax.set_xticks(x, [tokens_label(r["prefix"]) for r in cell], fontsize=8)
            ax.set_title(f"H = {h}, {n} new tokens", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(heads) - 1:
                ax.set_xlabel("cached prefix tokens", fontsize=8)
            if j == 0:
                ax.set_ylabel("ms per layer", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="upper left")
    ws = sorted({r["workspace"] for r in rows})
    fig.suptitle(f"MLA prefill per layer, bf16, page {rows[0]['page']}, MHA workspace {ws[0]} tokens: "
                 "both paths and what auto picks", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Plots from recorded CSVs: ``python -m mla_fa3.bench.roofline --decode-csv D --prefill-csv P --out DIR``."""
    import argparse
    import sys

    from mla_fa3.bench.timing import h200_ceilings

    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.roofline", description=main.__doc__)
    p.add_argument("--decode-csv", help="decode benchmark CSV (decode.csv)")
    p.add_argument("--prefill-csv", help="prefill benchmark CSV (prefill.csv)")
    p.add_argument("--out", default=".", help="directory for the PNGs")
    args = p.parse_args(argv)
    if pyplot() is None:
        print("plots need matplotlib: pip install matplotlib (or the mla-fa3[plot] extra)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.decode_csv:
        png = os.path.join(args.out, "decode_roofline.png")
        if plot_roofline(read_csv(args.decode_csv), png, h200_ceilings()):
            written += [png, os.path.join(args.out, "decode_backend_vs_best.png")]
    if args.prefill_csv:
        png = os.path.join(args.out, "prefill_paths.png")
        if plot_prefill(read_prefill_csv(args.prefill_csv), png):
            written.append(png)
    for path in written:
        print(f"wrote {path}")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
