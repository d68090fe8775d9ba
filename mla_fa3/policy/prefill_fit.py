"""Calibration of the ``policy.prefill_cost`` cost model: fit its constants to measured rows, replay a CSV through it.

:func:`fit_cost_constants` fits constants of a ``prefill_cost.CostConstants`` to measured
:class:`CostSample` s (least squares of ``log(model / measured)``); ``prefill_cost.H200_COSTS`` was fitted
this way to the 32 shapes of ``docs/perf/prefill_2026-12-02_run1.csv`` (H200, eager CUDA-event times of
one layer, host overhead included, bf16, page 64, W = 8192). :func:`read_samples_csv` reads a
``mla_fa3.bench.prefill`` CSV; :func:`evaluate_on_csv` replays a benchmark CSV through the model: which
path it picks per shape and picked / best measured time (:func:`summarize`: one line). Host arithmetic
only.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import torch

from mla_fa3.policy.prefill_cost import H200_COSTS, CostConstants, check_shape_args, choose_path, decode_rows, path_costs
from mla_fa3.policy.paths import AttentionPath

__all__ = ["CostSample", "FITTED_CONSTANTS", "fit_cost_constants", "constants_source", "main", "PathEvaluation", "read_samples_csv",
           "evaluate_choices", "evaluate_on_csv", "summarize"]


@dataclass(frozen=True)
class CostSample:
    """One measured shape: per-layer times of both paths (e.g. a row of the prefill bench CSV)."""

    num_heads: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    workspace_tokens: int
    absorbed_ms: float | None  # measured absorbed time (None: not measured)
    mha_ms: float | None  # measured one-shot / chunked MHA time (None: not measured)


FITTED_CONSTANTS = ("mha_attn_tflops", "absorbed_attn_tflops", "gemm_tflops",
                    "chunk_overhead_us", "mha_fixed_us", "absorbed_fixed_us")


def _sample_costs(s: CostSample, dims, c: CostConstants) -> dict[AttentionPath, float]:
    return path_costs(list(s.prefix_lens), list(s.extend_lens), decode_rows(s.prefix_lens, s.extend_lens),
                  s.num_heads, dims, c, s.workspace_tokens)


def _measured(s: CostSample) -> dict[AttentionPath, float]:
    """{path: measured ms} of a sample with new tokens (its MHA time is the one-shot or chunked path)."""
    check_shape_args(list(s.prefix_lens), list(s.extend_lens), s.num_heads, s.workspace_tokens)
    prefix = [p for p, d in zip(s.prefix_lens, decode_rows(s.prefix_lens, s.extend_lens)) if not d]
    out = {AttentionPath.ABSORBED: s.absorbed_ms,
           AttentionPath.MHA_CHUNKED if any(prefix) else AttentionPath.MHA_ONESHOT: s.mha_ms}
    return {k: v for k, v in out.items() if v is not None and v > 0} if sum(s.extend_lens) > 0 else {}


def fit_cost_constants(samples: Iterable[CostSample], dims, *, base: CostConstants = H200_COSTS,
                       names: Sequence[str] = FITTED_CONSTANTS, max_iters: int = 100,
                       prior_weight: float = 0.02) -> CostConstants:
    """Fit the constants ``names`` to measured samples: least squares of ``log(model / measured)``.

    Levenberg-Marquardt over the logs of the constants (they stay positive), started at ``base``, plus
    a weak pull ``prior_weight · log(value / base value)`` per constant that settles what the samples
    leave open and costs ~nothing elsewhere. The rest stays from ``base``: ``copy_tbps`` too, as the
    decompression's GEMM and copies both scale with ``(P + N)·H`` — samples fix only their sum, so the
    GEMM rate is fitted with the copies at ``copy_tbps``. Host arithmetic only; ~0.2 s for 32 samples.
    """
    samples = list(samples)
    if not all(isinstance(s, CostSample) for s in samples):
        raise TypeError("samples must be CostSample instances")
    if not isinstance(base, CostConstants):
        raise TypeError(f"base must be a CostConstants, got {type(base).__name__}")
    names = tuple(names)
    if not names or not set(names) <= set(FITTED_CONSTANTS):
        raise ValueError(f"names must be a non-empty subset of {FITTED_CONSTANTS}, got {names}")
    data = [(s, path, ms) for s in samples for path, ms in _measured(s).items()]
    if not data:
        raise ValueError("samples: no measured time (absorbed_ms / mha_ms) to fit")
    theta0 = [math.log(max(getattr(base, n), 1.0)) for n in names]

    def consts(theta) -> CostConstants:
        return replace(base, **{n: math.exp(t) for n, t in zip(names, theta)})

    def residuals(theta) -> list[float]:
        c = consts(theta)
        out = [math.log(_sample_costs(s, dims, c)[path] / ms) for s, path, ms in data]
        return out + [prior_weight * (t - t0) for t, t0 in zip(theta, theta0)]

    theta, lam = list(theta0), 1e-3
    r = residuals(theta)
    cost = sum(x * x for x in r)
    for _ in range(max_iters):
        r0 = torch.tensor(r, dtype=torch.float64)
        cols = [torch.tensor(residuals([t + 1e-6 * (i == j) for i, t in enumerate(theta)]), dtype=torch.float64)
                for j in range(len(theta))]
        J = (torch.stack(cols, 1) - r0[:, None]) / 1e-6  # forward differences: [residual, constant]
        A, g = J.T @ J, J.T @ r0
        while lam < 1e10:
            step = torch.linalg.solve(A + lam * torch.diag(A.diagonal() + 1e-9), -g).tolist()
            trial = [min(max(t + d, t0 - 9.0), t0 + 9.0) for t, d, t0 in zip(theta, step, theta0)]  # e^±9
            r_t = residuals(trial)
            cost_t = sum(x * x for x in r_t)
            if cost_t < cost:
                break
            lam *= 10.0
        else:
            break  # no step lowers the cost: a minimum
        done = cost - cost_t < 1e-10 * (1.0 + cost)
        theta, r, cost, lam = trial, r_t, cost_t, max(lam / 10.0, 1e-9)
        if done:
            break
    return consts(theta)


@dataclass(frozen=True)
class PathEvaluation:
    """One measured shape replayed through the model: what auto picks and what that costs."""

    sample: CostSample
    modelled_ms: Mapping[AttentionPath, float]  # the model's ms of each option (inf: not applicable)
    measured_ms: Mapping[AttentionPath, float]  # the benchmark's ms of the measured options
    chosen: AttentionPath  # what choose_path(..., "auto") picks with the constants
    best: AttentionPath  # the measured faster path

    @property
    def chosen_over_best(self) -> float:
        """Measured time of the chosen path / of the faster one (1.0: auto picked the faster path)."""
        return self.measured_ms[self.chosen] / self.measured_ms[self.best]


def read_samples_csv(path) -> list[CostSample]:
    """The rows of a ``mla_fa3.bench.prefill`` CSV (one request per row) as :class:`CostSample`."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"heads", "new", "prefix", "workspace", "absorbed_ms", "mha_ms"}
    if not rows or not need <= set(rows[0]):
        raise ValueError(f"path: {path} is not a prefill bench CSV with columns {sorted(need)}")
    # absorbed_skipped (newer CSVs): absorbed was not timed, its column holds the model's estimate
    return [CostSample(int(r["heads"]), (int(r["prefix"]),), (int(r["new"]),), int(r["workspace"]),
                       None if r.get("absorbed_skipped") == "1" else float(r["absorbed_ms"]), float(r["mha_ms"]))
            for r in rows]


def constants_source(c: CostConstants) -> str:
    """``H200_COSTS = CostConstants(...)`` with the fitted constants to 3 significant digits (paste-ready)."""
    args = ", ".join(f"{n}={float(f'{getattr(c, n):.3g}')!r}" for n in FITTED_CONSTANTS + ("host_overlap_p",))
    return f"H200_COSTS = CostConstants({args})"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mla_fa3.policy.prefill_fit CSV [CSV ...]``: fit, print the constants, replay each CSV."""
    import argparse

    from mla_fa3.layer import MLADims

    p = argparse.ArgumentParser(prog="python -m mla_fa3.policy.prefill_fit", description=main.__doc__)
    p.add_argument("csv", nargs="+", help="prefill bench CSVs (mla_fa3.bench.prefill)")
    args = p.parse_args(argv)
    dims = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    fitted = fit_cost_constants([s for path in args.csv for s in read_samples_csv(path)], dims)
    print(constants_source(fitted))
    for path in args.csv:
        print(f"{path}: {summarize(evaluate_on_csv(path, dims, constants=fitted))}")
    return 0


def evaluate_choices(samples: Iterable[CostSample], dims, *,
                     constants: CostConstants = H200_COSTS) -> list[PathEvaluation]:
    """Per sample measured on both paths: the path auto picks with ``constants`` and the measured best."""
    out = []
    for s in samples:
        measured = _measured(s)
        if len(measured) < 2:
            continue  # one path measured: nothing to compare
        d = choose_path(s.prefix_lens, s.extend_lens, num_heads=s.num_heads, dims=dims,
                        workspace_tokens=s.workspace_tokens, constants=constants)
        out.append(PathEvaluation(s, d.costs_ms, measured, d.path, min(measured, key=measured.get)))
    return out


def evaluate_on_csv(path, dims, *, constants: CostConstants = H200_COSTS) -> list[PathEvaluation]:
    """:func:`evaluate_choices` over a prefill bench CSV (``docs/perf/prefill_*.csv``)."""
    return evaluate_choices(read_samples_csv(path), dims, constants=constants)


def summarize(evaluations: Sequence[PathEvaluation]) -> str:
    """One line: shapes picked right, and the worst picked / best with its shape."""
    right = sum(e.chosen is e.best for e in evaluations)
    head = f"auto picked the faster path on {right}/{len(evaluations)} shapes"
    if right == len(evaluations):
        return head
    w = max(evaluations, key=lambda e: e.chosen_over_best)
    s = w.sample
    return (f"{head}; worst picked/best {w.chosen_over_best:.3f} ({s.num_heads} heads, {sum(s.extend_lens)} new "
            f"over {sum(s.prefix_lens)}: {w.chosen.value} instead of {w.best.value})")


if __name__ == "__main__":
    raise SystemExit(main())
