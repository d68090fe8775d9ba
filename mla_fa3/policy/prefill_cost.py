"""Which MLA path runs an extend step: absorbed, one-shot MHA or chunked MHA — a cost model with explain.

Symbols (per layer; all dims from the model config): ``H`` query heads, ``r`` = kv_lora_rank,
``d_nope``, ``d_rope``, ``d_v``; ``d_qk = d_nope + d_rope``; per request ``b``: ``p_b`` cached prefix
tokens, ``n_b`` new tokens; ``P = Σ p_b``, ``N = Σ n_b``; ``W`` the chunked path's workspace in tokens;
``S = Σ_b (n_b·p_b + n_b(n_b+1)/2)`` the (query, key) pairs of causal attention over prefix + new.

Each path costs, in ms per layer, a device time ``g`` (roofline terms at effective rates) and a host
time ``h`` (the eager launches of the path: Python, dispatch, launch latency), combined as
``t = (g^k + h^k)^(1/k)`` with ``k = host_overlap_p``: the host runs ahead of the device in eager
mode, so the two overlap — ``k = 1`` adds them, a large ``k`` takes the larger. What each path charges:

* ``ABSORBED`` — attention over the 576-wide latent rows with ``q_lat = q_nope·W_UK``:
  ``g = max(2·H·S·(2r + d_rope) / R_abs, bytes / BW_hbm)`` (bytes: latent rows read once, q and o_lat)
  ``+ 2·N·H·r·(d_nope + d_v) / R_gemm`` (query absorption and output projection); ``h = absorbed_fixed``.
* ``MHA_ONESHOT`` (no prefix among the MHA rows) / ``MHA_CHUNKED`` (prefixes, ``c = ceil(P / W)`` chunks):
  attention with head dims ``d_qk / d_v``: ``2·H·S·(d_qk + d_v) / (R_mha · occupancy)``, where
  ``occupancy = min(1, H·Σ_b ceil(n_b / tile_m) / num_sms)`` (FA3's varlen forward runs one CTA per
  (q tile, head): few new tokens leave SMs idle); decompression ``2·(P + N)·r·H·(d_nope + d_v) / R_gemm``
  (one GEMM writes ``[v | k_nope]`` in place) plus the k_rope broadcast ``(P + N)·H·d_rope·2 B / BW_copy``;
  the gather of the prefix's latent rows ``2·P·(r + d_rope)·2 B / BW_copy``; one LSE merge per chunk
  ``N·H·(3·d_v·2 B + 12 B) / BW_copy``; ``h = mha_fixed + c·chunk_overhead`` (each chunk is ~6 launches:
  gather, GEMM, copy, attention, merge). When ``P + N <= W`` the step runs in one pass
  (``prefill_plan.OnePass``): ``c = 0``, no merge, the gather covers the ``P + N`` rows.

Rows with ``n_b = 1`` and ``p_b > 0`` (decode rows of a MIXED step) always take the absorbed path —
decompressing a whole prefix for one query never pays — so the choice is made for the other rows, and
the decode rows' absorbed ``g`` and ``h`` are added to the MHA options' (one split step runs both).
Decode-like modes (one query per request) are ABSORBED by definition.

:class:`CostConstants` holds every constant in one place. :data:`H200_COSTS` is fitted with
``prefill_fit.fit_cost_constants`` to the H200 sweeps listed above it (eager CUDA-event times of one layer,
host overhead included, bf16, page 64, workspace budget 512 MiB). The rates
are *effective* rates of the code as it runs, not hardware peaks. Pure host arithmetic on CPU lengths:
no tensor is read from a device, so choosing a path never syncs.

The calibration (fitting the constants, replaying a benchmark CSV: ``prefill_fit.py``) is
re-exported here on first use (``CostSample``, ``fit_cost_constants``, ``evaluate_on_csv``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping, Sequence

import torch

from mla_fa3.checks import check_int
from mla_fa3.policy.paths import AttentionPath, PrefillOverride

__all__ = ["CostConstants", "H200_COSTS", "PathDecision", "decode_rows", "estimate_costs_ms", "choose_path",
           "path_costs", "check_shape_args"]


@dataclass(frozen=True)
class CostConstants:
    """Every constant of the cost model (one layer, eager). Fitted ones first; ``replace(H200_COSTS, ...)``."""

    mha_attn_tflops: float  # FA3 varlen forward, head dims 192/128, full occupancy (TFLOP/s)
    absorbed_attn_tflops: float  # FA3 absorbed MLA (qv, head dims 64 + 512 / 512) (TFLOP/s)
    gemm_tflops: float  # effective rate of the GEMMs with K = r (decompression, absorption, projection)
    chunk_overhead_us: float  # host: launches of one prefix chunk (gather, 2 GEMMs, 2 copies, attention, merge)
    mha_fixed_us: float  # host: the MHA path's launches independent of the prefix (decompress, copies, attention)
    absorbed_fixed_us: float  # host: the absorbed path's launches (absorption, attention, projection)
    host_overlap_p: float = 2.0  # k of t = (g^k + h^k)^(1/k): 1 = host adds to device time, large = max
    hbm_tbps: float = 4.0  # streaming reads of FA3 over the latent cache (decode bench, shared/device/README.md)
    copy_tbps: float = 3.0  # read + write traffic of the MHA path's gathers, copies, merges (assumed, see fit)
    num_sms: int = 132  # streaming multiprocessors (H200)
    mha_tile_m: int = 128  # query rows per CTA of FA3's varlen forward at head dim 192
    dtype_bytes: int = 2  # activation / cache element size (bf16)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("mha_attn_tflops", "absorbed_attn_tflops", "gemm_tflops", "copy_tbps", "hbm_tbps", "num_sms",
                     "mha_tile_m", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.host_overlap_p < 1:
            raise ValueError(f"host_overlap_p must be >= 1, got {self.host_overlap_p!r}")


# H200 (sm90, 132 SMs), DeepSeek-V3 dims, bf16, page 64, workspace budget 512 MiB (47,127 tokens per chunk
# at 16 heads, 6,462 at 128): fit_cost_constants on docs/perf/2026-12-03/run4/prefill_run{3,4,5,6}.csv
# (two pairs of runs of the bench after the one-pass layout; heads {16,128} x new {1k,4k,8k} x prefix
# {16k,64k,128k}) and prefill_small_run{1,2}.csv (new {128,512} x prefix {0,8k,32k}: the crossover); eager
# CUDA-event times, host launch costs included. Auto picks the faster path on 18/18 shapes of each of the six
# sweeps of that run and within 5 % on 10/12 and 11/12 small shapes (misses: 0.2 ms steps, where two runs
# disagree by up to 20 %); tests/test_prefill_cost.py replays them. The rates are effective rates of the code.
# To re-fit:
#   python -m mla_fa3.bench.prefill --out $OUT/prefill --repeat 2     (prints the fitted constants), or
#   python -m mla_fa3.policy.prefill_fit docs/perf/<new>.csv           (prints a paste-ready H200_COSTS line)
# then record the CSV under docs/perf/ and point tests/test_prefill_cost.py's FIT_CSVS at it.
H200_COSTS = CostConstants(
    mha_attn_tflops=651.0, absorbed_attn_tflops=642.0, gemm_tflops=714.0,
    chunk_overhead_us=230.0, mha_fixed_us=176.0, absorbed_fixed_us=175.0, host_overlap_p=2.0)


@dataclass(frozen=True)
class PathDecision:
    """What ran and why: the explain record of one step's path choice."""

    path: AttentionPath  # the path of the step's non-decode rows (ABSORBED: every row absorbed)
    costs_ms: Mapping[AttentionPath, float]  # modelled ms per layer of each path (inf: not applicable)
    reason: str  # human-readable: override or the comparison that decided
    requested: str  # the override asked for: "auto" | "absorbed" | "mha"
    num_decode_rows: int  # rows with n = 1 over a prefix; absorbed even when path is MHA (split step)
    num_chunks: int  # prefix chunks of the chunked path (0 without prefix)

    @property
    def split(self) -> bool:
        """True when the step runs both paths: MHA rows and absorbed decode rows."""
        return self.path.is_mha_prefill and self.num_decode_rows > 0

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


def decode_rows(prefix_lens, extend_lens):
    """Per request: True for a decode row (one new token over a cached prefix), absorbed on every path.

    Sequences give a ``list[bool]``; CPU integer tensors give a bool tensor (``(n == 1) & (p > 0)``).
    """
    if isinstance(prefix_lens, torch.Tensor):
        return (extend_lens == 1) & (prefix_lens > 0)
    return [n == 1 and p > 0 for p, n in zip(prefix_lens, extend_lens)]


def _pairs(prefix: Sequence[int], extend: Sequence[int]) -> int:
    return sum(n * p + n * (n + 1) // 2 for p, n in zip(prefix, extend))


def _absorbed_parts(prefix, extend, H, dims, c: CostConstants) -> tuple[float, float]:
    """(device ms, host ms) of the absorbed path over these rows."""
    if not extend or sum(extend) == 0:
        return 0.0, 0.0
    r, dr, dn, dv, e = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim, c.dtype_bytes
    N = sum(extend)
    flops = 2.0 * H * _pairs(prefix, extend) * (2 * r + dr)
    nbytes = e * (sum(prefix) + N) * (r + dr) + e * N * H * (2 * r + dr)
    attn = max(flops / (c.absorbed_attn_tflops * 1e9), nbytes / (c.hbm_tbps * 1e9))
    proj = 2.0 * N * H * r * (dn + dv) / (c.gemm_tflops * 1e9)
    return attn + proj, c.absorbed_fixed_us * 1e-3


def _mha_parts(prefix, extend, H, dims, c: CostConstants, workspace_tokens: int) -> tuple[float, float]:
    """(device ms, host ms) of the one-shot (no prefix) or chunked MHA path over these rows."""
    if not extend or sum(extend) == 0:
        return 0.0, 0.0
    r, dr, dn, dv, e = dims.kv_lora_rank, dims.qk_rope_head_dim, dims.qk_nope_head_dim, dims.v_head_dim, c.dtype_bytes
    dqk, P, N = dn + dr, sum(prefix), sum(extend)
    bw = c.copy_tbps * 1e9  # bytes per ms
    tiles = H * sum(-(-n // c.mha_tile_m) for n in extend)
    occupancy = min(1.0, tiles / c.num_sms)
    attn = 2.0 * H * _pairs(prefix, extend) * (dqk + dv) / (c.mha_attn_tflops * 1e9 * occupancy)
    rows = P + N
    decomp = 2.0 * rows * r * H * (dn + dv) / (c.gemm_tflops * 1e9) + e * rows * H * dr / bw
    one_pass = 0 < P and rows <= workspace_tokens  # prefill_plan.OnePass: no chunk loop, no merge
    chunks = 0 if one_pass or not P else -(-P // workspace_tokens)
    gather = 2.0 * e * (rows if one_pass else P) * (r + dr) / bw
    merge = chunks * N * H * (3 * dv * e + 12) / bw
    return attn + decomp + gather + merge, (chunks * c.chunk_overhead_us + c.mha_fixed_us) * 1e-3


def _overlap(device_ms: float, host_ms: float, c: CostConstants) -> float:
    """Eager time of a path: ``(g^k + h^k)^(1/k)`` — host launches run ahead of, and overlap, device work."""
    top, k = max(device_ms, host_ms), c.host_overlap_p
    return top * ((device_ms / top) ** k + (host_ms / top) ** k) ** (1.0 / k) if top > 0 else 0.0


def path_costs(prefix, extend, is_decode, H, dims, c: CostConstants, workspace_tokens: int) -> dict[AttentionPath, float]:
    """Modelled ms of each option; decode rows (``is_decode``) stay absorbed under the MHA options."""
    rest_p = [p for p, d in zip(prefix, is_decode) if not d]
    rest_n = [n for n, d in zip(extend, is_decode) if not d]
    dec_p = [p for p, d in zip(prefix, is_decode) if d]
    dec_n = [n for n, d in zip(extend, is_decode) if d]
    mha_g, mha_h = _mha_parts(rest_p, rest_n, H, dims, c, workspace_tokens)
    dec_g, dec_h = _absorbed_parts(dec_p, dec_n, H, dims, c)
    mha = _overlap(mha_g + dec_g, mha_h + dec_h, c)
    has_prefix = any(p > 0 for p in rest_p)
    return {
        AttentionPath.ABSORBED: _overlap(*_absorbed_parts(prefix, extend, H, dims, c), c),
        AttentionPath.MHA_ONESHOT: math.inf if has_prefix else mha,
        AttentionPath.MHA_CHUNKED: mha if has_prefix else math.inf,
    }


def estimate_costs_ms(prefix_lens, extend_lens, *, num_heads: int, dims, workspace_tokens: int,
                      constants: CostConstants = H200_COSTS) -> dict[AttentionPath, float]:
    """Modelled ms per layer of each path for these rows (no decode-row split; inf: not applicable).

    ``dims``: an ``MLADims`` (any object with kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim). MHA_ONESHOT applies only without prefix, MHA_CHUNKED only with one.
    """
    prefix = _host_lengths(prefix_lens, "prefix_lens")
    extend = _host_lengths(extend_lens, "extend_lens")
    check_shape_args(prefix, extend, num_heads, workspace_tokens)
    return path_costs(prefix, extend, [False] * len(prefix), num_heads, dims, constants, workspace_tokens)


def check_shape_args(prefix, extend, num_heads, workspace_tokens) -> None:
    if len(prefix) != len(extend):
        raise ValueError(f"prefix_lens and extend_lens must have the same length, got {len(prefix)} and {len(extend)}")
    check_int(num_heads, "num_heads")
    check_int(workspace_tokens, "workspace_tokens")


# ---------------------------------------------------------------------------------------------------
# the choice


def choose_path(prefix_lens, extend_lens, *, num_heads: int, dims, workspace_tokens: int,
                prefill_path: PrefillOverride | str = "auto", constants: CostConstants = H200_COSTS,
                decode_like: bool = False) -> PathDecision:
    """Choose the path of one step's rows from CPU lengths; ``prefill_path`` overrides the model.

    prefix_lens / extend_lens: per request (lists or CPU int tensors, e.g. ``metadata.prefix_lens_cpu``
    / ``extend_lens_cpu``). ``decode_like``: the step is DECODE / DRAFT_DECODE / TARGET_VERIFY
    (absorbed by definition). ``prefill_path``: "auto" (cheapest modelled path), "absorbed" (every
    row) or "mha" (the MHA path for every non-decode row; decode rows stay absorbed).
    """
    override = PrefillOverride.coerce(prefill_path)
    if not isinstance(constants, CostConstants):
        raise TypeError(f"constants must be a CostConstants, got {type(constants).__name__}")
    prefix = _host_lengths(prefix_lens, "prefix_lens")
    extend = _host_lengths(extend_lens, "extend_lens")
    check_shape_args(prefix, extend, num_heads, workspace_tokens)
    is_decode = [True] * len(prefix) if decode_like else decode_rows(prefix, extend)
    costs = path_costs(prefix, extend, is_decode, num_heads, dims, constants, workspace_tokens)
    rest_p = [p for p, d in zip(prefix, is_decode) if not d]
    rest_n = [n for n, d in zip(extend, is_decode) if not d]
    n_dec = sum(is_decode)
    has_prefix = any(p > 0 for p in rest_p)
    mha_path = AttentionPath.MHA_CHUNKED if has_prefix else AttentionPath.MHA_ONESHOT
    chunks = -(-sum(rest_p) // workspace_tokens) if has_prefix else 0

    def decision(path: AttentionPath, reason: str) -> PathDecision:
        return PathDecision(path=path, costs_ms=costs, reason=reason, requested=override.value,
                            num_decode_rows=n_dec if path.is_mha_prefill else 0,
                            num_chunks=chunks if path is AttentionPath.MHA_CHUNKED else 0)

    if decode_like:
        return decision(AttentionPath.ABSORBED, "decode-like step: one query per request")
    if not rest_n or sum(rest_n) == 0:
        return decision(AttentionPath.ABSORBED, f"every row is a decode row ({n_dec}): nothing to decompress for")
    if override is PrefillOverride.ABSORBED:
        return decision(AttentionPath.ABSORBED, "override prefill_path='absorbed'")
    shape = (f"{len(rest_n)} extend rows, {sum(rest_n)} new tokens over {sum(rest_p)} prefix tokens, "
             f"{num_heads} heads" + (f", {chunks} chunks of <= {workspace_tokens}" if chunks else "")
             + (", one pass (prefix + new fit the workspace)" if has_prefix and sum(rest_p) + sum(rest_n)
                <= workspace_tokens else "")
             + (f"; {n_dec} decode rows absorbed" if n_dec else ""))
    if override is PrefillOverride.MHA:
        return decision(mha_path, f"override prefill_path='mha' ({shape})")
    a, m = costs[AttentionPath.ABSORBED], costs[mha_path]
    if m < a:
        return decision(mha_path, f"auto: {mha_path.value} {m:.3f} ms < absorbed {a:.3f} ms ({shape})")
    return decision(AttentionPath.ABSORBED, f"auto: absorbed {a:.3f} ms <= {mha_path.value} {m:.3f} ms ({shape})")
