"""Roofline model of absorbed-MLA decode and the decode benchmark's outputs (CSV, markdown, PNG).

Per layer and decode step, with ``L_b`` the KV length of request b, ``H`` heads, ``r`` = 512 latent
and ``d_rope`` = 64 (DeepSeek-V3; rows of ``r + d_rope`` = 576 bf16 values):

    bytes  = Σ_b L_b · (r + d_rope) · 2                 (the latent cache, read once; q/out are tiny)
    FLOPs  = 2 · H · Σ_b L_b · ((r + d_rope) + r)        (scores over 576, values over 512)
    t_roof = max(bytes / BW, FLOPs / C)                   BW = 4.3 TB/s, C = 790 TFLOP/s measured

The arithmetic intensity FLOPs / bytes = 2·H·1088 / 1152 ≈ 1.89·H FLOP/B does not depend on batch
or context; the H200 ridge is C / BW ≈ 184 FLOP/B, so 16-64 heads are memory bound and 128 heads
compute bound. ``DecodeRow`` is one measured shape; ``write_csv`` / ``read_csv`` / ``markdown_table``
/ ``plot_roofline`` produce the benchmark's files (matplotlib is optional).
"""

from __future__ import annotations

import csv
import dataclasses
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
    layers_rotated: int = 1  # cache copies cycled per replay to defeat the L2

    @property
    def best_kernel_ms(self) -> float | None:
        times = [t for t in (self.fa3_ms, self.flashmla_ms) if t]
        return min(times) if times else None

    def ratios(self) -> dict[str, float | None]:
        """backend / min(FA3, FlashMLA) and kernel / roofline (None where a time is missing)."""
        best = self.best_kernel_ms

        def div(a, b):
            return a / b if a and b else None

        return {
            "backend_over_best": div(self.backend_ms, best),
            "fa3_over_roofline": div(self.fa3_ms, self.roofline_ms),
            "flashmla_over_roofline": div(self.flashmla_ms, self.roofline_ms),
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


def markdown_table(rows: Iterable[DecodeRow], ceilings: Ceilings) -> str:
    """Markdown summary: times in µs, achieved TB/s (memory bound) or TFLOP/s (compute bound), ratios."""

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
        f"Per layer, bf16, DeepSeek-V3 latent (576), CUDA-graph replay. Roofline: {ceilings.name} "
        f"{ceilings.read_bytes_per_s / 1e12:.1f} TB/s, {ceilings.bf16_flops_per_s / 1e12:.0f} TFLOP/s.",
        "",
        "| H | bs | ctx | page | lengths | roofline µs | backend µs (kernel) | FA3 µs | FlashMLA µs "
        "| FA3 rate | FlashMLA rate | backend / best | best / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row.ratios()
        best = row.best_kernel_ms
        out.append(
            f"| {row.heads} | {row.batch} | {row.context} | {row.page} | {row.lengths} | {us(row.roofline_ms)} "
            f"| {us(row.backend_ms)} ({row.backend_kernel or '—'}) | {us(row.fa3_ms)} | {us(row.flashmla_ms)} "
            f"| {rate(row, row.fa3_ms)} | {rate(row, row.flashmla_ms)} | {ratio(r['backend_over_best'])} "
            f"| {ratio(best / row.roofline_ms if best else None)} |"
        )
    return "\n".join(out) + "\n"


def plot_roofline(rows: Sequence[DecodeRow], path: str, ceilings: Ceilings) -> bool:
    """Achieved TFLOP/s vs arithmetic intensity, with the two ceilings; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bw, peak = ceilings.read_bytes_per_s, ceilings.bf16_flops_per_s
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ai_all = [r.flops / r.bytes for r in rows] or [10.0]
    lo, hi = min(ai_all + [1.0]) / 2, max(ai_all + [2 * peak / bw]) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(bw * x, peak) / 1e12 for x in xs], "k-", lw=1.5,
            label=f"roofline ({bw / 1e12:.1f} TB/s, {peak / 1e12:.0f} TFLOP/s)")
    styles = {"fa3_ms": ("FA3", "o"), "flashmla_ms": ("FlashMLA", "s"), "backend_ms": ("backend step", "^")}
    for field, (label, marker) in styles.items():
        pts = [(r.flops / r.bytes, r.flops / (getattr(r, field) * 1e-3) / 1e12) for r in rows if getattr(r, field)]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=18, alpha=0.7, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of latent cache)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("MLA decode per layer (bf16, DeepSeek-V3 latent 576)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
