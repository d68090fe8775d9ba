"""The serving loop: continuous batching over a DeepSeek model on the MLA backend, host work overlapped.

One iteration, with ``prev`` the step launched by the iteration before (its tokens still on the GPU)::

    admit the requests that have arrived (Scheduler.add)
    sched = scheduler.schedule()              # host: rows, pages, slots (module scheduler)
    launch(sched):                            # host work + kernel launches, NO sync
        input ids: prefill tokens from the host; decode rows gather prev's sampled tokens ON the device
        DECODE step with a captured size  -> GraphRunner.prepare (replay update) + replay
        otherwise                          -> backend.init_forward_metadata + model forward (eager)
        greedy argmax on the device (Request.forced: teacher-forced tokens replace it, for validation);
        async copy of the sampled tokens to pinned host memory; event
    resolve(prev):                            # the first and only wait: prev's tokens
        event.synchronize(); append each token; EOS / max_new_tokens -> Scheduler.finish (pages freed)
    prev = sched

So the host builds and launches step n+1 while the GPU still runs step n; the GPU waits for the host
only when the host work of a step outlasts the GPU work of the one before. A request that hits EOS in
step n has already been given a row in step n+1: that row's token is dropped (SGLang's overlap
scheduler does the same); ``max_new_tokens`` is known ahead and costs nothing.

Measured per step (:class:`StepRecord`): host time (schedule + batch + metadata or replay update +
launches), the replay update alone, and on CUDA the step's GPU time and the GPU idle time before it
(CUDA events recorded at the step's first and last device op; read once, after the run). With
``time_attention`` the attention calls of eager steps are timed too (events around each layer's
``backend.forward``; graph replays are not split).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.host import to_device
from mla_fa3.checks import check_int
from mla_fa3.graphs.runner import GraphRunner
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.fp8 import kv_dtype_of
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.models.deepseek import DeepseekForCausalLM
from mla_fa3.serve.memory import MemoryPlan
from mla_fa3.serve.scheduler import Request, RequestStatus, Scheduler, StepSchedule

__all__ = ["StepRecord", "RequestTimes", "ServingLoop", "default_graph_batch_sizes"]

ProgressFn = Callable[[int, int], None]  # (requests finished, requests total)


@dataclass
class StepRecord:
    """One step of the loop (host values; the CUDA-event fields are filled after the run)."""

    index: int
    mode: str  # DECODE | EXTEND | MIXED
    batch_size: int  # rows (requests) in the step
    decode_rows: int
    prefill_tokens: int
    num_tokens: int
    context_tokens: int  # Σ seq_len over the rows: KV tokens each layer's attention reads
    graph: bool  # replayed a captured CUDA graph
    path: str | None  # backend.explain(): attention path and kernel of the step's MLA layers
    kernel: str | None  # what ran for the absorbed path (explain().ran): the kernel, or "reference"
    start_s: float  # serving clock at the step's schedule
    host_ms: float  # schedule + batch + metadata / replay update + launches (host perf_counter)
    prepare_ms: float  # the metadata work alone: GraphRunner.prepare or init_forward_metadata
    preempted: int = 0
    gpu_ms: float | None = None  # CUDA events around the step's device work
    idle_ms: float | None = None  # GPU idle between the previous step's end and this step's start
    attn_ms: float | None = None  # attention calls (eager steps with time_attention)


@dataclass
class RequestTimes:
    """Serving-clock times of one request (seconds): arrival, each token on the host, finish."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None


@dataclass
class _Launched:
    sched: StepSchedule
    samplers: list[Request]  # requests whose next token this step samples, in token order
    tokens: Tensor  # [len(samplers)] int64, device
    host: Tensor  # [len(samplers)] int64, cpu (pinned on CUDA), filled asynchronously
    done: object | None  # torch.cuda.Event after the copy (None on CPU)
    logits: Tensor | None  # [len(samplers), V] float32 device (record_logits)
    prefill_logits: list[tuple[Request, int, Tensor]] | None  # (request, start, [n, V]) of chunks
    record: StepRecord


def default_graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, ... and ``max_bs`` itself."""
    return sorted({min(2 ** i, max_bs) for i in range(max_bs.bit_length() + 1)})


class _TimedAttention:
    """The backend seen by an eager step's layers, recording an event pair around each forward."""

    def __init__(self, backend: MLABackend, sink: list):
        self.backend, self.sink = backend, sink

    def forward(self, *args, **kwargs):
        if self.backend.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.backend.forward(*args, **kwargs)
            end.record()
            self.sink.append((start, end))
            return out
        t0 = time.perf_counter()
        out = self.backend.forward(*args, **kwargs)
        self.sink.append((time.perf_counter() - t0) * 1e3)
        return out


class ServingLoop:
    """Continuous batching of greedy requests over ``model`` (module docstring).

    Args:
        model: a loaded :class:`DeepseekForCausalLM` (its device and dtype place the pools).
        page_size: KV page size.  max_running: most requests holding pages at once.
        max_context: longest prompt + new tokens of a request.
        num_pages: KV pages (plus the padding page 0); default: ``max_running`` full contexts.
        memory_plan: a :class:`mla_fa3.serve.memory.MemoryPlan` (instead of ``num_pages``): the pool gets
            the pages that fit the planned GPU; its page size, layers and limits must be the loop's.
        token_budget: most new tokens per step (prefill chunk + decode rows); default 8192.
        watermark_pages: free pages a new request must leave to the running ones.
        use_cuda_graph / cuda_graph_batch_sizes: DECODE steps of at most the largest size replay graphs.
        decode_kernel / prefill_path / impl: :class:`MLABackend` settings.
        record_logits: keep each sampled token's logits (float32, host); record_prefill_logits: every
            prompt position's logits (first computation only).
        time_attention: events around the attention calls of eager steps (StepRecord.attn_ms).
        kv_dtype: the latent cache's storage dtype: None (the model's dtype) or ``torch.float8_e4m3fn``
            / ``"fp8"`` (half the bytes per token; page_size 64; FlashMLA FP8 decode).
        kv_scales: per-layer FP8 scales (a list, or one float for every layer); None = the checkpoint's
            (``model.kv_scales``), else 1.0.
    """

    def __init__(self, model: DeepseekForCausalLM, *, page_size: int = 16, max_running: int = 8,
                 max_context: int = 2048, num_pages: int | None = None, token_budget: int = 8192,
                 watermark_pages: int = 0, use_cuda_graph: bool = False,
                 cuda_graph_batch_sizes: Sequence[int] | None = None, decode_kernel: str = "auto",
                 prefill_path: str = "auto", impl=None, record_logits: bool = False,
                 record_prefill_logits: bool = False, time_attention: bool = False,
                 memory_plan: MemoryPlan | None = None, kv_dtype=None,
                 kv_scales: Sequence[float] | float | None = None):
        if not isinstance(model, DeepseekForCausalLM):
            raise TypeError(f"model must be a DeepseekForCausalLM, got {type(model).__name__}")
        for name, value in (("page_size", page_size), ("max_running", max_running), ("max_context", max_context),
                            ("token_budget", token_budget)):
            check_int(value, name)
        if any(a is None for a in model.attention_layers):
            raise ValueError("model: prepare_attention() has not run (load it with models.loader.load_model)")
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.page_size, self.max_running, self.max_context = page_size, max_running, max_context
        if memory_plan is not None:
            if num_pages is not None:
                raise ValueError("num_pages: give num_pages or memory_plan, not both")
            for name, mine, planned in (("page_size", page_size, memory_plan.page_size),
                                        ("num_hidden_layers", cfg.num_hidden_layers, memory_plan.num_layers),
                                        ("max_context", max_context, memory_plan.max_context),
                                        ("max_running", max_running, memory_plan.max_running)):
                if mine != planned:
                    raise ValueError(f"memory_plan was made for {name} {planned}, the loop has {mine}")
            num_pages = memory_plan.num_pages
        if num_pages is None:
            num_pages = max_running * math.ceil(max_context / page_size) + 1
        check_int(num_pages, "num_pages", 2)
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context, self.device)
        self.allocator = PagedAllocator(num_pages, page_size, self.device)
        self.kv_pool = MLATokenPool(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_lora_rank,
                                    cfg.qk_rope_head_dim, self.dtype, self.device, kv_dtype=kv_dtype_of(kv_dtype))
        if not self.kv_pool.is_fp8:
            if kv_scales is not None:
                raise ValueError("kv_scales are only used with kv_dtype='fp8'")
        elif (kv_scales if kv_scales is not None else model.kv_scales) is not None:
            scales = kv_scales if kv_scales is not None else model.kv_scales
            self.kv_pool.set_scales([scales] * cfg.num_hidden_layers if isinstance(scales, (int, float))
                                    else list(scales))
        self.backend = MLABackend(req_to_token_pool=self.req_to_token_pool, kv_pool=self.kv_pool,
                                  page_size=page_size, device=self.device, decode_kernel=decode_kernel,
                                  num_heads=cfg.num_attention_heads, mla_dims=cfg.mla_dims, prefill_path=prefill_path,
                                  impl=impl)
        self.scheduler = Scheduler(self.req_to_token_pool, self.allocator, self.kv_pool, max_running=max_running,
                                   token_budget=token_budget, watermark_pages=watermark_pages)
        self.record_logits, self.record_prefill_logits = record_logits, record_prefill_logits
        self.time_attention = time_attention
        self.graph_runner: GraphRunner | None = None
        if use_cuda_graph:
            sizes = cuda_graph_batch_sizes or default_graph_batch_sizes(max_running)
            self.graph_runner = GraphRunner(self.backend, self._graph_step, batch_sizes=sizes,
                                            mode=ForwardMode.DECODE, max_context=max_context, device=self.device)
        self.on_cuda = self.device.type == "cuda"
        self.steps: list[StepRecord] = []
        self.times: dict[int, RequestTimes] = {}
        self.logits: dict[int, list[Tensor]] = {}
        self.prefill_logits: dict[int, list[Tensor]] = {}
        self._clock0 = time.perf_counter()
        self._now: Callable[[], float] = self.clock  # the serving clock of the current run (run's ``clock``)
        self._prev_tokens: Tensor | None = None  # the last launched step's samples (device)
        self._forcing = False  # a request of the current run has teacher-forced tokens (Request.forced)
        self._pending_events: list = []  # (record, CUDA events, attention events) until _finish_timing

    def _graph_step(self, batch: ForwardBatch, inputs: dict) -> Tensor:
        return self.model(inputs["input_ids"], batch.positions, batch, self.backend)

    def clock(self) -> float:
        """Seconds since the loop was built (or since :meth:`run` started)."""
        return time.perf_counter() - self._clock0

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Iterable[Request], *, progress: ProgressFn | None = None,
            on_step: Callable[[StepRecord], None] | None = None,
            clock: Callable[[], float] | None = None) -> list[Request]:
        """Serve ``requests`` (each joins at its ``arrival``) until all finish; returns them in finishing order.

        ``clock``: the serving clock — what arrivals are compared with, and what token times, finish times
        and ``StepRecord.start_s`` are read from (default: seconds since the run started, and an idle
        loop sleeps until the next arrival); any other clock (e.g. the step count, for tests) is jumped
        forward to the next arrival when nothing runs.
        """
        arrivals = sorted(requests, key=lambda r: r.arrival)
        total = len(arrivals)
        for r in arrivals:  # refuse what can never run, before anything runs
            self.scheduler.check(r)
        self._forcing = any(r.forced is not None for r in arrivals)
        self._clock0 = time.perf_counter()
        now_fn = self._now = clock or self.clock
        prev: _Launched | None = None
        done_before = len(self.scheduler.finished)
        while arrivals or self.scheduler.has_work() or prev is not None:
            now = now_fn()
            idle = prev is None and not self.scheduler.has_work()
            while arrivals and (arrivals[0].arrival <= now or (idle and clock is not None)):
                idle = False
                r = arrivals.pop(0)
                self.times[r.rid] = RequestTimes(arrival=r.arrival)
                self.scheduler.add(r)
            sched = self.scheduler.schedule() if self.scheduler.has_work() else None
            launched = self._launch(sched) if sched is not None else None
            if prev is not None:
                self._resolve(prev)
                if on_step is not None:
                    on_step(prev.record)
                if progress is not None:
                    progress(len(self.scheduler.finished) - done_before, total)
            prev = launched
            if sched is None and prev is None:
                if self.scheduler.has_work():
                    raise RuntimeError("the scheduler has requests but scheduled nothing with nothing in flight")
                if arrivals:
                    time.sleep(max(0.0, arrivals[0].arrival - self.clock()))
        self._finish_timing()
        return [r for r in self.scheduler.finished[done_before:]]

    # ------------------------------------------------------------------ launch (no sync)
    def _launch(self, sched: StepSchedule) -> _Launched:
        start_s = self._now()
        t0 = time.perf_counter()
        events = None
        if self.on_cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        rows = sched.rows
        n = len(rows)
        seq = [r.start + r.length for r in rows]
        ids = self._input_ids(sched)
        samplers = [r.request for r in rows if r.samples]
        graph = (sched.mode is ForwardMode.DECODE and self.graph_runner is not None
                 and n <= self.graph_runner.batch_sizes[-1])
        attn = [] if (self.time_attention and not graph) else None
        prefill_logits = None
        if sched.mode is ForwardMode.DECODE:
            batch = ForwardBatch.decode([r.request.row for r in rows], seq, sched.out_cache_loc, self.device)
            tp = time.perf_counter()
            if graph:
                key = self.graph_runner.prepare(batch, {"input_ids": ids})
                prepare_ms = (time.perf_counter() - tp) * 1e3
                logits = self.graph_runner.replay(key)[:n]
            else:
                self.backend.init_forward_metadata(batch)
                prepare_ms = (time.perf_counter() - tp) * 1e3
                backend = self.backend if attn is None else _TimedAttention(self.backend, attn)
                logits = self.model(ids, batch.positions, batch, backend)
        else:
            batch = ForwardBatch.extend([r.request.row for r in rows], [r.start for r in rows],
                                        [r.length for r in rows], sched.out_cache_loc, self.device, mode=sched.mode)
            tp = time.perf_counter()
            self.backend.init_forward_metadata(batch)
            prepare_ms = (time.perf_counter() - tp) * 1e3
            backend = self.backend if attn is None else _TimedAttention(self.backend, attn)
            ends, acc = [], 0
            for r in rows:
                acc += r.length
                if r.samples:
                    ends.append(acc - 1)
            if self.record_prefill_logits:
                full = self.model(ids, batch.positions, batch, backend).float()
                prefill_logits, acc = [], 0
                for r in rows:
                    if not r.is_decode:
                        prefill_logits.append((r.request, r.start, full[acc: acc + r.length]))
                    acc += r.length
                logits = full[to_device(torch.tensor(ends, dtype=torch.int64), self.device)]
            else:
                rows_dev = to_device(torch.tensor(ends, dtype=torch.int64), self.device)
                logits = self.model(ids, batch.positions, batch, backend, logit_rows=rows_dev)
        tokens = logits.argmax(dim=-1)
        if self._forcing:
            tokens = self._force(tokens, samplers)
        for j, req in enumerate(samplers):  # the next step's decode rows read tokens[j] on the device
            req.pending += 1
            req.pending_index = j
        done = None
        if self.on_cuda:
            host = torch.empty(tokens.shape[0], dtype=torch.int64, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            events[1].record()
        else:
            host = tokens
        self._prev_tokens = tokens
        record = self.backend.explain()
        rec = StepRecord(index=len(self.steps), mode=sched.mode.name, batch_size=n, decode_rows=sched.num_decode_rows,
                         prefill_tokens=sched.num_prefill_tokens, num_tokens=sched.num_tokens, context_tokens=sum(seq),
                         graph=graph, path=None if record is None else record.path.name,
                         kernel=None if record is None else record.ran, start_s=start_s,
                         host_ms=(time.perf_counter() - t0) * 1e3, prepare_ms=prepare_ms,
                         preempted=len(sched.preempted))
        self.steps.append(rec)
        self._pending_events.append((rec, events, attn))
        return _Launched(sched=sched, samplers=samplers, tokens=tokens, host=host, done=done,
                         logits=logits.float() if self.record_logits else None, prefill_logits=prefill_logits,
                         record=rec)

    def _force(self, tokens: Tensor, samplers: list[Request]) -> Tensor:
        """Teacher forcing: a request with ``forced`` tokens emits ``forced[k]`` as its new token k (the
        ``sampled`` so far, before this step's are counted); its logits stay the model's."""
        rows = [(j, req.forced[req.sampled]) for j, req in enumerate(samplers)
                if req.forced is not None and req.sampled < len(req.forced)]
        if not rows:
            return tokens
        idx, val = to_device(torch.tensor(rows, dtype=torch.int64), self.device).unbind(1)
        return tokens.index_put((idx,), val)

    def _input_ids(self, sched: StepSchedule) -> Tensor:
        """[T] int64 device: prompt tokens from the host; decode rows' from the previous step's samples."""
        rows = sched.rows
        gather_pos, gather_idx, host = [], [], []
        for r in rows:
            if r.from_device:
                gather_pos.append(len(host))
                gather_idx.append(r.request.pending_index)
                host.append(0)
            else:
                req = r.request
                host.extend(req.token(j) for j in range(r.start, r.start + r.length))
        if gather_idx and len(gather_idx) == len(host):  # a decode step: one gather on the device
            idx = to_device(torch.tensor(gather_idx, dtype=torch.int64), self.device)
            return self._prev_tokens.index_select(0, idx)
        if not gather_idx:
            return to_device(torch.tensor(host, dtype=torch.int64), self.device)
        packed = to_device(torch.tensor([host, gather_pos + [0] * (len(host) - len(gather_pos)),
                                         gather_idx + [0] * (len(host) - len(gather_idx))], dtype=torch.int64),
                           self.device)
        ids, k = packed[0].clone(), len(gather_idx)
        ids[packed[1, :k]] = self._prev_tokens.index_select(0, packed[2, :k])
        return ids

    # ------------------------------------------------------------------ resolve (the one wait)
    def _resolve(self, step: _Launched) -> None:
        if step.done is not None:
            step.done.synchronize()
        toks = step.host.tolist()
        now = self._now()
        logits = step.logits.cpu() if step.logits is not None else None
        if step.prefill_logits is not None:
            for req, start, rows in step.prefill_logits:
                got = self.prefill_logits.setdefault(req.rid, [])
                have = sum(x.shape[0] for x in got)
                keep = min(start + rows.shape[0], len(req.prompt)) - have
                if start == have and keep > 0:  # first computation of these prompt positions only
                    got.append(rows[:keep].cpu())
        for j, (req, tok) in enumerate(zip(step.samplers, toks)):
            if req.status is RequestStatus.FINISHED:
                continue  # EOS in the step before: this row's token is dropped
            req.pending -= 1
            req.output.append(tok)
            self.times[req.rid].token_times.append(now)
            if logits is not None:
                self.logits.setdefault(req.rid, []).append(logits[j])
            eos = req.eos_token_id
            if eos is not None and (tok in eos if isinstance(eos, frozenset) else tok == eos):
                self._retire(req, "eos", now)
            elif len(req.output) >= req.max_new_tokens:
                self._retire(req, "length", now)

    def _retire(self, req: Request, reason: str, now: float) -> None:
        self.scheduler.finish(req, reason)
        self.times[req.rid].finish = now

    def _finish_timing(self) -> None:
        """Read the CUDA events (one synchronize, after the run) into the step records."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        # the events live on the launched records; kept on the loop while running
        prev_end = None
        for rec, ev, attn in self._pending_events:
            if ev is not None:
                rec.gpu_ms = ev[0].elapsed_time(ev[1])
                rec.idle_ms = None if prev_end is None else max(0.0, prev_end.elapsed_time(ev[0]))
                prev_end = ev[1]
            if attn is not None:
                rec.attn_ms = sum(a.elapsed_time(b) for a, b in attn) if self.on_cuda else sum(attn)
        self._pending_events = []
