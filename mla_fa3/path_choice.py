"""Which MLA path runs an extend step: absorbed, one-shot MHA or chunked MHA — a cost model with explain.

Symbols (per layer; all dims from the model config): ``H`` query heads, ``r`` = kv_lora_rank,
``d_nope``, ``d_rope``, ``d_v``; ``d_qk = d_nope + d_rope``; per request ``b``: ``p_b`` cached prefix
tokens, ``n_b`` new tokens; ``P = Σ p_b``, ``N = Σ n_b``; ``W`` the chunked path's workspace in tokens;
``S = Σ_b (n_b·p_b + n_b(n_b+1)/2)`` the (query, key) pairs of causal attention over prefix + new.

The paths (``absorb.py``, ``chunked_prefix.py``) and what the model charges each, in ms per layer:

* ``ABSORBED`` — attention over the 576-wide latent rows with ``q_lat = q_nope·W_UK``:
  ``max(2·H·S·(2r + d_rope) / R_abs, bytes / BW)`` (bytes: latent rows read once, q and o_lat)
  ``+ 2·N·H·r·(d_nope + d_v) / R_gemm`` (query absorption and output projection) ``+ fixed``.
* ``MHA_ONESHOT`` (no prefix among the MHA rows) / ``MHA_CHUNKED`` (prefixes, ``ceil(P / W)`` chunks):
  attention with head dims ``d_qk / d_v``: ``2·H·S·(d_qk + d_v) / (R_mha · occupancy)``, where
  ``occupancy = min(1, H·Σ_b ceil(n_b / tile_m) / num_sms)`` (FA3's varlen forward runs one CTA per
  (q tile, head): few new tokens leave SMs idle — why 16 heads × 512 tokens over 64k loses);
  decompression ``max(2·(P + N)·r·H·(d_nope + d_v) / R_gemm, bytes / BW)``; the gather of the
  prefix's latent rows ``2·P·(r + d_rope)·2 B / BW``; one LSE merge per chunk over all rows
  ``N·H·(3·d_v·2 B + 12 B) / BW``; ``chunk_overhead`` per chunk and a fixed cost.

Rows with ``n_b = 1`` and ``p_b > 0`` (decode rows of a MIXED step) always take the absorbed path —
decompressing a whole prefix for one query never pays — so the choice is made for the other rows,
and the decode rows' absorbed cost is added to every option. Decode-like modes (one query per
request) are ABSORBED by definition.

:class:`CostConstants` holds every constant in one place; the defaults are calibrated on the H200
measurements (kernels only, bf16, page 64) of shared/device/README.md — 128 heads, 4096 new over a
32k prefix: chunked MHA (8k chunks) 18.3 ms, absorbed 62.9 ms; 16 heads, 512 new over 64k: absorbed
1.82 ms, MHA 1.97 ms — and :func:`fit_cost_constants` re-fits them from benchmark rows
(``mla_fa3.bench.prefill`` writes them). Pure host arithmetic on CPU lengths: no tensor is read from
a device, so choosing a path never syncs.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Iterable, Mapping, Sequence

import torch

__all__ = [
    "PrefillPath",
    "PREFILL_PATH_OVERRIDES",
    "CostConstants",
    "H200_COSTS",
    "PathDecision",
    "CostSample",
    "decode_rows",
    "estimate_costs_ms",
    "choose_path",
    "fit_cost_constants",
]

PREFILL_PATH_OVERRIDES = ("auto", "absorbed", "mha")


class PrefillPath(enum.Enum):
    """The MLA compute path of an extend step's rows."""

    ABSORBED = "absorbed"  # attention over the latent cache with absorbed W_UK / W_UV (absorb.py)
    MHA_ONESHOT = "mha_oneshot"  # decompressed K/V of the new tokens, one causal varlen call
    MHA_CHUNKED = "mha_chunked"  # + the cached prefix decompressed chunk by chunk, merged by LSE

    @property
    def is_mha(self) -> bool:
        return self is not PrefillPath.ABSORBED


@dataclass(frozen=True)
class CostConstants:
    """Every constant of the cost model (per-layer kernel times; H200, bf16). Re-fit from benchmarks."""

    mha_attn_tflops: float = 745.0  # FA3 varlen forward, head dims 192/128, full occupancy (TFLOP/s)
    absorbed_attn_tflops: float = 636.0  # FA3 absorbed MLA (qv, head dims 64 + 512 / 512) (TFLOP/s)
    gemm_tflops: float = 650.0  # bf16 GEMMs with K = r (decompression, absorption, projection)
    hbm_tbps: float = 4.0  # achieved bandwidth of gathers, copies and merges (TB/s)
    num_sms: int = 132  # streaming multiprocessors (H200)
    mha_tile_m: int = 128  # query rows per CTA of FA3's varlen forward at head dim 192
    chunk_overhead_us: float = 64.0  # per prefix chunk: ~6 launches (gather, 2 GEMMs, copy, attn, merge) + tails
    mha_fixed_us: float = 30.0  # the MHA path's new-token part: launches independent of sizes
    absorbed_fixed_us: float = 10.0  # the absorbed path's launches (absorb, attention, projection)
    dtype_bytes: int = 2  # activation / cache element size (bf16)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("mha_attn_tflops", "absorbed_attn_tflops", "gemm_tflops", "hbm_tbps", "num_sms",
                     "mha_tile_m", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


H200_COSTS = CostConstants()


@dataclass(frozen=True)
class PathDecision:
    """What ran and why: the explain record of one step's path choice."""

    path: PrefillPath  # the path of the step's non-decode rows (ABSORBED: every row absorbed)
    costs_ms: Mapping[PrefillPath, float]  # modelled ms per layer of each path (inf: not applicable)
    reason: str  # human-readable: override or the comparison that decided
    requested: str  # the override asked for: "auto" | "absorbed" | "mha"
    num_decode_rows: int  # rows with n = 1 over a prefix; absorbed even when path is MHA (split step)
    num_chunks: int  # prefix chunks of the chunked path (0 without prefix)

    @property
    def split(self) -> bool:
        """True when the step runs both paths: MHA rows and absorbed decode rows."""
        return self.path.is_mha and self.num_decode_rows > 0

    def explain(self) -> str:
        costs = ", ".join(f"{p.value} {ms:.3f} ms" for p, ms in self.costs_ms.items() if math.isfinite(ms))
        return f"{self.path.value}: {self.reason} [{costs}]"


# ---------------------------------------------------------------------------------------------------
# lengths


def _host_lengths(values, name: str) -> list[int]:
    """A list of non-negative ints from a sequence or a CPU integer tensor (a device tensor would sync)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor or a sequence (reading {values.device} would sync)")
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        out = [int(v) for v in values.tolist()]
    else:
        try:
            out = [int(v) for v in values]
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from exc
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def decode_rows(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> list[bool]:
    """Per request: True for a decode row (one new token over a cached prefix), absorbed on every path."""
    return [n == 1 and p > 0 for p, n in zip(prefix_lens, extend_lens)]


def _pairs(prefix: Sequence[int], extend: Sequence[int]) -> int:
    return sum(n * p + n * (n + 1) // 2 for p, n in zip(prefix, extend))


def _absorbed_ms(prefix, extend, H, dims, c: CostConstants) -> float:
    if not extend or sum(extend) == 0:
        return 0.0
    r, dr, dn, dv, e = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim, c.dtype_bytes
    N = sum(extend)
    flops = 2.0 * H * _pairs(prefix, extend) * (2 * r + dr)
    nbytes = e * (sum(prefix) + N) * (r + dr) + e * N * H * (2 * r + dr)
    attn = max(flops / (c.absorbed_attn_tflops * 1e9), nbytes / (c.hbm_tbps * 1e9))
    proj = 2.0 * N * H * r * (dn + dv) / (c.gemm_tflops * 1e9)
    return attn + proj + c.absorbed_fixed_us * 1e-3


def _mha_ms(prefix, extend, H, dims, c: CostConstants, workspace_tokens: int) -> float:
    if not extend or sum(extend) == 0:
        return 0.0
    r, dr, dn, dv, e = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim, c.dtype_bytes
    dqk, P, N = dn + dr, sum(prefix), sum(extend)
    bw = c.hbm_tbps * 1e9  # bytes per ms
    tiles = H * sum(-(-n // c.mha_tile_m) for n in extend)
    occupancy = min(1.0, tiles / c.num_sms)
    attn = 2.0 * H * _pairs(prefix, extend) * (dqk + dv) / (c.mha_attn_tflops * 1e9 * occupancy)
    rows = P + N
    decomp = max(2.0 * rows * r * H * (dn + dv) / (c.gemm_tflops * 1e9), e * rows * H * (2 * dn + dqk + dv) / bw)
    chunks = -(-P // workspace_tokens) if P else 0
    gather = 2.0 * e * P * (r + dr) / bw
    merge = chunks * N * H * (3 * dv * e + 12) / bw
    return attn + decomp + gather + merge + (chunks * c.chunk_overhead_us + c.mha_fixed_us) * 1e-3


def estimate_costs_ms(prefix_lens, extend_lens, *, num_heads: int, dims, workspace_tokens: int,
                      constants: CostConstants = H200_COSTS) -> dict[PrefillPath, float]:
    """Modelled ms per layer of each path for these rows (no decode-row split; inf: not applicable).

    ``dims``: an ``MLADims`` (any object with kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim). MHA_ONESHOT applies only without prefix, MHA_CHUNKED only with one.
    """
    prefix = _host_lengths(prefix_lens, "prefix_lens")
    extend = _host_lengths(extend_lens, "extend_lens")
    _check_shape_args(prefix, extend, num_heads, workspace_tokens)
    mha = _mha_ms(prefix, extend, num_heads, dims, constants, workspace_tokens)
    has_prefix = any(p > 0 for p in prefix)
    return {
        PrefillPath.ABSORBED: _absorbed_ms(prefix, extend, num_heads, dims, constants),
        PrefillPath.MHA_ONESHOT: math.inf if has_prefix else mha,
        PrefillPath.MHA_CHUNKED: mha if has_prefix else math.inf,
    }


def _check_shape_args(prefix, extend, num_heads, workspace_tokens) -> None:
    if len(prefix) != len(extend):
        raise ValueError(f"prefix_lens and extend_lens must have the same length, got {len(prefix)} and {len(extend)}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, int) or workspace_tokens < 1:
        raise ValueError(f"workspace_tokens must be a positive int, got {workspace_tokens!r}")


# ---------------------------------------------------------------------------------------------------
# the choice


def choose_path(prefix_lens, extend_lens, *, num_heads: int, dims, workspace_tokens: int,
                prefill_path: str = "auto", constants: CostConstants = H200_COSTS,
                decode_like: bool = False) -> PathDecision:
    """Choose the path of one step's rows from CPU lengths; ``prefill_path`` overrides the model.

    prefix_lens / extend_lens: per request (lists or CPU int tensors, e.g. ``metadata.prefix_lens_cpu``
    / ``extend_lens_cpu``). ``decode_like``: the step is DECODE / DRAFT_DECODE / TARGET_VERIFY
    (absorbed by definition). ``prefill_path``: "auto" (cheapest modelled path), "absorbed" (every
    row) or "mha" (the MHA path for every non-decode row; decode rows stay absorbed).
    """
    if prefill_path not in PREFILL_PATH_OVERRIDES:
        raise ValueError(f"prefill_path must be one of {PREFILL_PATH_OVERRIDES}, got {prefill_path!r}")
    if not isinstance(constants, CostConstants):
        raise TypeError(f"constants must be a CostConstants, got {type(constants).__name__}")
    prefix = _host_lengths(prefix_lens, "prefix_lens")
    extend = _host_lengths(extend_lens, "extend_lens")
    _check_shape_args(prefix, extend, num_heads, workspace_tokens)
    is_decode = [True] * len(prefix) if decode_like else decode_rows(prefix, extend)
    dec_p = [p for p, d in zip(prefix, is_decode) if d]
    dec_n = [n for n, d in zip(extend, is_decode) if d]
    rest_p = [p for p, d in zip(prefix, is_decode) if not d]
    rest_n = [n for n, d in zip(extend, is_decode) if not d]
    costs = estimate_costs_ms(rest_p, rest_n, num_heads=num_heads, dims=dims,
                              workspace_tokens=workspace_tokens, constants=constants)
    decode_ms = _absorbed_ms(dec_p, dec_n, num_heads, dims, constants)
    if dec_n:  # decode rows run absorbed under every option; charge them to every option
        costs = {path: ms + decode_ms if path.is_mha else ms for path, ms in costs.items()}
        costs[PrefillPath.ABSORBED] = _absorbed_ms(prefix, extend, num_heads, dims, constants)
    has_prefix = any(p > 0 for p in rest_p)
    mha_path = PrefillPath.MHA_CHUNKED if has_prefix else PrefillPath.MHA_ONESHOT
    chunks = -(-sum(rest_p) // workspace_tokens) if has_prefix else 0
    n_dec = len(dec_n)

    def decision(path: PrefillPath, reason: str) -> PathDecision:
        return PathDecision(path=path, costs_ms=costs, reason=reason, requested=prefill_path,
                            num_decode_rows=n_dec if path.is_mha else 0,
                            num_chunks=chunks if path is PrefillPath.MHA_CHUNKED else 0)

    if decode_like:
        return decision(PrefillPath.ABSORBED, "decode-like step: one query per request")
    if not rest_n or sum(rest_n) == 0:
        return decision(PrefillPath.ABSORBED, f"every row is a decode row ({n_dec}): nothing to decompress for")
    if prefill_path == "absorbed":
        return decision(PrefillPath.ABSORBED, "override prefill_path='absorbed'")
    shape = (f"{len(rest_n)} extend rows, {sum(rest_n)} new tokens over {sum(rest_p)} prefix tokens, "
             f"{num_heads} heads" + (f", {chunks} chunks of <= {workspace_tokens}" if chunks else "")
             + (f"; {n_dec} decode rows absorbed" if n_dec else ""))
    if prefill_path == "mha":
        return decision(mha_path, f"override prefill_path='mha' ({shape})")
    a, m = costs[PrefillPath.ABSORBED], costs[mha_path]
    if m < a:
        return decision(mha_path, f"auto: {mha_path.value} {m:.3f} ms < absorbed {a:.3f} ms ({shape})")
    return decision(PrefillPath.ABSORBED, f"auto: absorbed {a:.3f} ms <= {mha_path.value} {m:.3f} ms ({shape})")


# ---------------------------------------------------------------------------------------------------
# re-fitting the constants from benchmark rows


@dataclass(frozen=True)
class CostSample:
    """One measured shape: per-layer kernel times of both paths (e.g. a row of the prefill bench CSV)."""

    num_heads: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    workspace_tokens: int
    absorbed_ms: float | None  # measured absorbed time (None: not measured)
    mha_ms: float | None  # measured one-shot / chunked MHA time (None: not measured)


def _rescale(samples, measured, model, base: CostConstants, names: tuple[str, ...]) -> CostConstants:
    """Scale the throughput constants ``names`` by the least-squares ratio of modelled to measured time."""
    pairs = [(m, model(s, base)) for s, m in zip(samples, measured) if m is not None and m > 0]
    if not pairs:
        return base
    # minimise Σ ((model/k - meas) / meas)²  over k: relative errors, so small shapes count as much.
    num = sum((mod / meas) ** 2 for meas, mod in pairs)
    den = sum(mod / meas for meas, mod in pairs)
    k = num / den  # model/k fits best; a rate multiplied by k divides every compute term by k
    return replace(base, **{n: getattr(base, n) * k for n in names})


def fit_cost_constants(samples: Iterable[CostSample], dims, *, base: CostConstants = H200_COSTS,
                       rounds: int = 3) -> CostConstants:
    """Re-fit the model's rates to measured samples (relative least squares), keeping its structure.

    Each path gets one multiplicative factor on its throughput constants (absorbed: its attention
    rate; MHA: its attention and GEMM rates and the bandwidth), alternated ``rounds`` times. Fixed
    and per-chunk overheads are kept from ``base`` (a few launches; edit them by hand if needed).
    """
    samples = list(samples)
    if not all(isinstance(s, CostSample) for s in samples):
        raise TypeError("samples must be CostSample instances")

    def model_abs(s: CostSample, c: CostConstants) -> float:
        return _absorbed_ms(list(s.prefix_lens), list(s.extend_lens), s.num_heads, dims, c)

    def model_mha(s: CostSample, c: CostConstants) -> float:
        return _mha_ms(list(s.prefix_lens), list(s.extend_lens), s.num_heads, dims, c, s.workspace_tokens)

    c = base
    for _ in range(max(1, rounds)):
        c = _rescale(samples, [s.absorbed_ms for s in samples], model_abs, c, ("absorbed_attn_tflops",))
        c = _rescale(samples, [s.mha_ms for s in samples], model_mha, c,
                     ("mha_attn_tflops", "gemm_tflops", "hbm_tbps"))
    return c
