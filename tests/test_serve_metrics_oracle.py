"""Serving metrics against values worked out by hand from a timeline (mla_fa3.serve.metrics, the loop's records).

Definitions (``metrics`` module docstring, SGLang's bench_serving / vLLM's benchmark_serving): per request,
arrival ``a``, token times ``t_1 .. t_n``, finish ``f = t_n``; TTFT = t_1 - a, E2E = f - a,
TPOT = (f - t_1) / (n - 1) for n > 1, ITL = every gap t_(k+1) - t_k; the throughputs divide by the run's
duration (first arrival .. last finish); percentiles interpolate linearly between order statistics:
``p_q`` of sorted ``x_0 .. x_(m-1)`` sits at position ``(m - 1) q / 100``.

Every expected number below is written out and derived in a comment; none is computed by the library.
The last test runs the serving loop on a step-count clock, so the timeline itself is worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_fa3.models.deepseek import DeepseekForCausalLM
from mla_fa3.serve.configs import model_config
from mla_fa3.serve.loop import RequestTimes, ServingLoop, StepRecord
from mla_fa3.serve.metrics import percentile, request_metrics, summarize
from mla_fa3.serve.scheduler import Request


def test_percentile_interpolates_between_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]  # sorted 1 2 3 4 5, positions 0..4
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 3.0  # position 2
    assert percentile(xs, 90) == pytest.approx(4.6)  # position 3.6: 4 + 0.6 * (5 - 4)
    assert percentile(xs, 99) == pytest.approx(4.96)  # position 3.96
    assert percentile(xs, 100) == 5.0
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)  # position 0.25
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def _step(index, mode, *, graph=False, host_ms, prepare_ms, context, gpu_ms=None, idle_ms=None, attn_ms=None):
    return StepRecord(index=index, mode=mode, batch_size=1, decode_rows=0, prefill_tokens=0, num_tokens=1,
                      context_tokens=context, graph=graph, path="ABSORBED", kernel="reference", start_s=0.0,
                      host_ms=host_ms, prepare_ms=prepare_ms, gpu_ms=gpu_ms, idle_ms=idle_ms, attn_ms=attn_ms)


def test_summary_of_a_hand_written_timeline():
    """Three requests (seconds):

        R0: prompt 4, arrival 0.00, tokens at 0.50 0.75 1.00 1.50, preempted once
        R1: prompt 10, arrival 0.25, tokens at 1.00 2.00
        R2: prompt 6, arrival 1.00, token at 1.25
    """
    reqs, times = [], {}
    for rid, (prompt, arrival, toks, pre) in enumerate([(4, 0.0, [0.5, 0.75, 1.0, 1.5], 1),
                                                         (10, 0.25, [1.0, 2.0], 0),
                                                         (6, 1.0, [1.25], 0)]):
        r = Request(rid=rid, prompt=[1] * prompt, max_new_tokens=len(toks))
        r.output, r.num_preemptions, r.finish_reason = [2] * len(toks), pre, "length"
        reqs.append(r)
        times[rid] = RequestTimes(arrival=arrival, token_times=list(toks), finish=toks[-1])

    m = [request_metrics(r, times[r.rid]) for r in reqs]
    assert [x.ttft_s for x in m] == [0.5, 0.75, 0.25]  # 0.5 - 0, 1.0 - 0.25, 1.25 - 1.0
    assert [x.e2e_s for x in m] == [1.5, 1.75, 0.25]  # 1.5 - 0, 2.0 - 0.25, 1.25 - 1.0
    assert m[0].tpot_s == pytest.approx(1 / 3) and m[1].tpot_s == 1.0 and m[2].tpot_s is None  # (1.5-0.5)/3, 1/1
    assert [(x.prompt_tokens, x.output_tokens, x.preemptions) for x in m] == [(4, 4, 1), (10, 2, 0), (6, 1, 0)]

    steps = [_step(0, "EXTEND", host_ms=2.0, prepare_ms=0.5, context=14, gpu_ms=3.0, attn_ms=1.0),
             _step(1, "MIXED", host_ms=4.0, prepare_ms=1.0, context=20, gpu_ms=5.0, idle_ms=1.0, attn_ms=2.0),
             _step(2, "DECODE", graph=True, host_ms=1.0, prepare_ms=0.25, context=8, gpu_ms=2.0, idle_ms=0.5)]
    s = summarize(reqs, times, steps, num_layers=2, latent_bytes_per_token=100, bandwidth=1e6)

    def dist(d, mean, p50, p90, p99, count):
        assert (d.mean, d.p50, d.p90, d.p99) == pytest.approx((mean, p50, p90, p99)) and d.count == count

    # TTFT ms sorted 250 500 750: p90 at position 1.8 = 500 + 0.8 * 250, p99 at 1.98 = 500 + 0.98 * 250
    dist(s.ttft_ms, 500.0, 500.0, 700.0, 745.0, 3)
    # E2E ms sorted 250 1500 1750: mean 3500 / 3; p90 = 1500 + 0.8 * 250; p99 = 1500 + 0.98 * 250
    dist(s.e2e_ms, 3500 / 3, 1500.0, 1700.0, 1745.0, 3)
    # TPOT ms 333.3 and 1000 (R2 has one token: no TPOT): p90 at position 0.9, p99 at 0.99
    dist(s.tpot_ms, 2000 / 3, 2000 / 3, 1000 / 3 + 0.9 * 2000 / 3, 1000 / 3 + 0.99 * 2000 / 3, 2)
    # ITL ms: R0's gaps 250 250 500, R1's 1000 (R2 has none); sorted 250 250 500 1000, positions 1.5 2.7 2.97
    dist(s.itl_ms, 500.0, 375.0, 850.0, 985.0, 4)
    # duration: first arrival 0 .. last finish 2.0; 3 requests, 20 prompt tokens, 7 new tokens
    assert (s.requests, s.input_tokens, s.output_tokens, s.duration_s) == (3, 20, 7, 2.0)
    assert (s.request_throughput, s.input_throughput, s.output_throughput) == (1.5, 10.0, 3.5)
    assert s.preemptions == 1 and s.steps == 3 and s.graph_steps == 1
    assert s.steps_by_mode == {"EXTEND": 1, "MIXED": 1, "DECODE": 1}
    assert s.kernels == {"EXTEND:ABSORBED/reference": 1, "MIXED:ABSORBED/reference": 1, "DECODE:ABSORBED/reference": 1}
    dist(s.host_ms_per_step, 7 / 3, 2.0, 2.0 + 0.8 * 2.0, 2.0 + 0.98 * 2.0, 3)  # sorted 1 2 4
    dist(s.replay_update_ms_per_step, 0.25, 0.25, 0.25, 0.25, 1)  # the graph step's prepare
    dist(s.eager_metadata_ms_per_step, 0.75, 0.75, 0.95, 0.995, 2)  # the eager steps' 0.5 and 1.0
    assert s.gpu_ms_total == 10.0 and s.gpu_idle_ms_total == 1.5 and s.attention_ms_total == 3.0
    # attention bytes: (14 + 20 + 8) tokens x 100 B x 2 layers = 8400 B; at 1 MB/s that is 8.4 ms
    assert s.attention_bytes_total == 8400 and s.attention_roofline_ms_total == pytest.approx(8.4)
    # % of roofline over the timed (eager) steps: (14 + 20) x 200 B = 6.8 ms of roofline in 3.0 ms measured
    assert s.attention_pct_of_roofline == pytest.approx(100 * 6.8 / 3.0)


def test_loop_timeline_on_a_step_clock():
    """The serving loop on the clock ``c`` = steps launched so far (page 4, budget 8, a roomy pool).

    A: prompt 5, 3 new, arrival 0.   B: prompt 6, 2 new, arrival 1.5. A step's token reaches the host when
    the NEXT iteration resolves it (after launching its own step), so it is stamped with that iteration's c.

    iter 1  c=0: A joins (B: 1.5 > 0). Launch step 0: EXTEND A[0:5] (start_s 0; c becomes 1).
    iter 2  c=1: B not yet. Launch step 1: DECODE A (start_s 1; c=2). Resolve step 0: A's 1st token at 2.
    iter 3  c=2: B joins (1.5 <= 2). Launch step 2: MIXED, B[0:6] + A's decode (start_s 2; c=3).
            Resolve step 1: A's 2nd token at 3.
    iter 4  c=3: A has sampled its 3 tokens. Launch step 3: DECODE B (start_s 3; c=4).
            Resolve step 2: A's 3rd token at 4 (A finished at 4), B's 1st token at 4.
    iter 5  c=4: nothing to launch. Resolve step 3: B's 2nd token at 4 (B finished at 4).

    A: TTFT 2 - 0 = 2, E2E 4, TPOT (4 - 2) / 2 = 1; gaps 1, 1.   B: TTFT 4 - 1.5 = 2.5, E2E 2.5, TPOT 0 / 1 = 0;
    gap 0. Duration 0 .. 4. Context tokens per step: 5; 6; 7 + 6 = 13; 7.
    """
    cfg = model_config("tiny")
    torch.manual_seed(0)
    model = DeepseekForCausalLM(cfg, dtype=torch.float32)
    model.prepare_attention()
    loop = ServingLoop(model, page_size=4, max_running=2, max_context=16, num_pages=9, token_budget=8)
    a = Request(rid=0, prompt=[3] * 5, max_new_tokens=3, arrival=0.0)
    b = Request(rid=1, prompt=[4] * 6, max_new_tokens=2, arrival=1.5)
    loop.run([a, b], clock=lambda: float(len(loop.steps)))

    assert [(s.mode, s.start_s, s.context_tokens) for s in loop.steps] == [
        ("EXTEND", 0.0, 5), ("DECODE", 1.0, 6), ("MIXED", 2.0, 13), ("DECODE", 3.0, 7)]
    assert (loop.times[0].arrival, loop.times[0].token_times, loop.times[0].finish) == (0.0, [2.0, 3.0, 4.0], 4.0)
    assert (loop.times[1].arrival, loop.times[1].token_times, loop.times[1].finish) == (1.5, [4.0, 4.0], 4.0)
    ma, mb = request_metrics(a, loop.times[0]), request_metrics(b, loop.times[1])
    assert (ma.ttft_s, ma.e2e_s, ma.tpot_s) == (2.0, 4.0, 1.0)
    assert (mb.ttft_s, mb.e2e_s, mb.tpot_s) == (2.5, 2.5, 0.0)
    s = summarize([a, b], loop.times, loop.steps, num_layers=cfg.num_hidden_layers, latent_bytes_per_token=1)
    # TTFT ms 2000, 2500: p90 at position 0.9; E2E ms 2500, 4000; TPOT ms 0, 1000; ITL ms 1000 1000 0
    assert (s.ttft_ms.mean, s.ttft_ms.p50, s.ttft_ms.p90) == pytest.approx((2250.0, 2250.0, 2450.0))
    assert (s.e2e_ms.mean, s.e2e_ms.p50, s.e2e_ms.p99) == pytest.approx((3250.0, 3250.0, 3985.0))
    assert (s.tpot_ms.mean, s.tpot_ms.p90) == pytest.approx((500.0, 900.0))
    assert (s.itl_ms.mean, s.itl_ms.p50, s.itl_ms.count) == pytest.approx((2000 / 3, 1000.0, 3))
    assert (s.duration_s, s.input_throughput, s.output_throughput) == (4.0, 11 / 4, 5 / 4)
    assert s.attention_bytes_total == (5 + 6 + 13 + 7) * cfg.num_hidden_layers
