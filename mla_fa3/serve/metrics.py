"""Serving metrics from the loop's records: the numbers users know, plus the per-step breakdown.

Per request ``i`` (serving clock, seconds): arrival ``a_i``, token times ``t_i1 < … < t_in`` (when each
token reached the host), finish ``f_i = t_in``. As in SGLang's bench_serving / vLLM's
benchmark_serving:

    TTFT_i = t_i1 − a_i          E2E_i = f_i − a_i
    TPOT_i = (f_i − t_i1) / (n − 1)        (requests with n > 1)
    ITL    = every gap t_i(k+1) − t_ik over all requests
    throughput: input tokens / s, output tokens / s, requests / s over the run (first arrival .. last finish)

reported as mean and p50 / p90 / p99 (linear interpolation between order statistics).

Per step (``StepRecord``): host time, replay update, GPU time and GPU idle (CUDA events), attention
time (eager steps, ``time_attention``), and the attention bytes ``Σ seq_len · (r + d_rope) · elem``
per layer: with the H200's 4.3 TB/s streaming ceiling this gives the attention roofline time, and the
measured attention time (or, for graph steps, the step's GPU time: an upper bound) its % of roofline.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from mla_fa3.serve.loop import RequestTimes, StepRecord
from mla_fa3.serve.scheduler import Request

__all__ = ["percentile", "Distribution", "RequestMetrics", "ServeSummary", "request_metrics", "summarize",
           "H200_STREAM_BW"]

H200_STREAM_BW = 4.3e12  # B/s: streaming reads measured on the H200 (shared/device/README.md)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between order statistics; nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    """mean, p50, p90, p99 of a metric, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values_s: Sequence[float]) -> "Distribution":
        ms = [v * 1e3 for v in values_s]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), len(ms))


@dataclass(frozen=True)
class RequestMetrics:
    rid: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    ttft_s: float
    e2e_s: float
    tpot_s: float | None
    preemptions: int
    finish_reason: str | None


def request_metrics(req: Request, times: RequestTimes) -> RequestMetrics:
    t = times.token_times
    n = len(t)
    return RequestMetrics(rid=req.rid, prompt_tokens=len(req.prompt), output_tokens=len(req.output),
                          arrival_s=times.arrival, ttft_s=t[0] - times.arrival, e2e_s=times.finish - times.arrival,
                          tpot_s=(t[-1] - t[0]) / (n - 1) if n > 1 else None, preemptions=req.num_preemptions,
                          finish_reason=req.finish_reason)


@dataclass
class ServeSummary:
    """One run's serving metrics and step breakdown (``to_dict`` is the JSON report's ``summary``)."""

    requests: int
    input_tokens: int
    output_tokens: int
    duration_s: float
    request_throughput: float  # requests / s
    input_throughput: float  # tokens / s
    output_throughput: float  # tokens / s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    preemptions: int
    steps: int
    steps_by_mode: dict
    host_ms_per_step: Distribution  # host time of a step (schedule, batch, metadata / replay, launches)
    prepare_ms_per_step: Distribution  # the metadata update alone, every step
    replay_update_ms_per_step: Distribution  # graph steps only: GraphRunner.prepare (the replay update)
    eager_metadata_ms_per_step: Distribution  # eager steps only: init_forward_metadata (plan included)
    gpu_ms_total: float | None
    gpu_idle_ms_total: float | None
    attention_ms_total: float | None  # eager steps with time_attention
    attention_roofline_ms_total: float  # Σ attention bytes / 4.3 TB/s, every step
    attention_bytes_total: int
    attention_pct_of_roofline: float | None  # roofline time / measured attention time (eager steps)
    kernels: dict  # "path/kernel" -> steps
    graph_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(requests: Iterable[Request], times: dict[int, RequestTimes], steps: Sequence[StepRecord], *,
              num_layers: int, latent_bytes_per_token: int, bandwidth: float = H200_STREAM_BW) -> ServeSummary:
    """The summary of a finished run (module docstring). ``latent_bytes_per_token``: (r + d_rope) · elem."""
    reqs = list(requests)
    per = [request_metrics(r, times[r.rid]) for r in reqs]
    itl = [b - a for r in reqs for a, b in zip(times[r.rid].token_times, times[r.rid].token_times[1:])]
    start = min((m.arrival_s for m in per), default=0.0)
    end = max((times[r.rid].finish for r in reqs), default=0.0)
    dur = max(end - start, 1e-9)
    inp, out = sum(m.prompt_tokens for m in per), sum(m.output_tokens for m in per)
    modes: dict[str, int] = {}
    kernels: dict[str, int] = {}
    for s in steps:
        modes[s.mode] = modes.get(s.mode, 0) + 1
        key = f"{s.mode}:{s.path}/{s.kernel}"
        kernels[key] = kernels.get(key, 0) + 1
    gpu = [s.gpu_ms for s in steps if s.gpu_ms is not None]
    idle = [s.idle_ms for s in steps if s.idle_ms is not None]
    attn_steps = [s for s in steps if s.attn_ms is not None]
    bytes_of = [s.context_tokens * latent_bytes_per_token * num_layers for s in steps]
    roof_ms = sum(bytes_of) / bandwidth * 1e3
    attn_total = sum(s.attn_ms for s in attn_steps) if attn_steps else None
    pct = None
    if attn_steps and attn_total:
        roof_attn = sum(s.context_tokens for s in attn_steps) * latent_bytes_per_token * num_layers / bandwidth * 1e3
        pct = 100.0 * roof_attn / attn_total
    return ServeSummary(
        requests=len(reqs), input_tokens=inp, output_tokens=out, duration_s=dur,
        request_throughput=len(reqs) / dur, input_throughput=inp / dur, output_throughput=out / dur,
        ttft_ms=Distribution.of([m.ttft_s for m in per]),
        tpot_ms=Distribution.of([m.tpot_s for m in per if m.tpot_s is not None]),
        itl_ms=Distribution.of(itl), e2e_ms=Distribution.of([m.e2e_s for m in per]),
        preemptions=sum(m.preemptions for m in per), steps=len(steps), steps_by_mode=modes,
        host_ms_per_step=Distribution.of([s.host_ms / 1e3 for s in steps]),
        prepare_ms_per_step=Distribution.of([s.prepare_ms / 1e3 for s in steps]),
        replay_update_ms_per_step=Distribution.of([s.prepare_ms / 1e3 for s in steps if s.graph]),
        eager_metadata_ms_per_step=Distribution.of([s.prepare_ms / 1e3 for s in steps if not s.graph]),
        gpu_ms_total=sum(gpu) if gpu else None, gpu_idle_ms_total=sum(idle) if idle else None,
        attention_ms_total=attn_total, attention_roofline_ms_total=roof_ms, attention_bytes_total=sum(bytes_of),
        attention_pct_of_roofline=pct, kernels=kernels, graph_steps=sum(1 for s in steps if s.graph))
