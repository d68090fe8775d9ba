"""Host time of the CUDA-graph replay update, per step and per component.

What one decode step under graph replay spends on the host before ``graph.replay()``: the batch the
engine builds (``ForwardBatch.decode``) and ``GraphRunner.prepare`` — the runner's checks, the copies
that pad the live batch into the static buffers, the decode-kernel choice, the batch validation, the
metadata write (``graphs.capture.replay_into``), the FlashMLA schedule re-plan and the step plan.

Two ways of updating, side by side in one run (``--metadata``): ``device`` (``GraphRunner``'s default:
the page table and the FlashMLA schedule are derived inside the graph by ``MLABackend.graph_prologue``,
so the update is the host checks, the padding copies and one host->device copy) and ``host`` (the
SGLang protocol, ``device_metadata=False``: the update also gathers the page table and re-plans
FlashMLA). On CUDA the GPU time of the prologue itself is measured too (``prologue_gpu``: a graph of
the prologue alone, replayed, CUDA events; it runs once per step, not per layer).

Workload: ``bs`` requests at random lengths in ``[context/4, context]`` (seeded), each step one token
longer (a decode step of a running batch); page 64, 16 heads, ``decode_kernel='auto'`` by default
(``--decode-kernel``; a graph per kernel per size, the kernel chosen per step from the live lengths). Graphs are not captured: only the
host work before a replay is timed (``use_graphs=False`` runs nothing after ``prepare``).

Devices:

* ``cpu`` (default without CUDA): CPU tensors; the tensor ops compute on the CPU (on a GPU each is an
  asynchronous launch instead) and the builder range-checks slot and page ids on the host, which it
  does for CPU tensors only (``BatchChecks.validate``);
* ``cuda``: GPU tensors, the real FlashMLA planner (sgl_kernel); host time with ``perf_counter``,
  no sync inside the timed region (the stream is synchronized after each timed step, outside it).

To tell Python from tensor work, a second pass runs under a ``TorchDispatchMode`` that counts every
aten op and times it: ``python`` = wall time minus the ops' time (on a GPU each op then costs a
launch, ~4-8 µs of host time, instead of its CPU compute).

Reported (median over ``--iters`` steps, microseconds per step): each component's wall time
(exclusive of the components it calls; ``cpu_checks`` = the slot-ownership checks of
``out_cache_loc``, which run on the host for CPU tensors only — ``prepare_gpu_path`` = ``prepare``
minus them, the work a GPU step has),
``other`` (prepare minus its components), ``prepare`` (``GraphRunner.prepare`` alone, timed in a pass
without probes), ``batch`` (``ForwardBatch.decode``); then per component the aten ops per step and
the Python time. The probes wrap the component functions (a fraction of a µs per call).

Usage: ``python -m mla_fa3.bench.replay_host --bs 1,16,128 [--device cpu|cuda] [--context 4096]
[--iters 300] [--json PATH]``. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np
import torch

from mla_fa3 import metadata as metadata_mod
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.batch_checks import BatchChecks
from mla_fa3.bench.timing import time_graph
from mla_fa3.graphs import runner as runner_mod
from mla_fa3.graphs.runner import GraphRunner
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.plan import StepPlanner
from mla_fa3.schedules import KernelSchedules
from mla_fa3.policy.kernel_choice import DecodeKernelChoice
from torch.utils._python_dispatch import TorchDispatchMode

PAGE = 64
COMPONENTS = ("check_fits", "pad_fill", "kernel_choice", "validate", "cpu_checks", "replay_into", "flashmla",
              "step_plan")


def _probes() -> list[tuple[object, str, str]]:
    """(owner, attribute, component) of every function a component's time is taken around."""
    return [(GraphRunner, "check_fits", "check_fits"),
            (runner_mod, "fill_inputs", "pad_fill"), (runner_mod, "pad_batch", "pad_fill"),
            (runner_mod, "copy_all", "pad_fill"),
            (DecodeKernelChoice, "choose_decode_kernel", "kernel_choice"),
            (BatchChecks, "validate", "validate"),
            (BatchChecks, "check_out_cache_loc", "cpu_checks"),
            (metadata_mod, "replay_into", "replay_into"),
            (KernelSchedules, "replan_flashmla", "flashmla"),
            (StepPlanner, "decode_plan", "step_plan")]


class Probe:
    """Accumulates per component: wall seconds (``wall``), and under :class:`OpCounter` aten ops and their seconds."""

    def __init__(self):
        self.current = "other"
        self.nested = 0.0  # seconds spent in probes, for the exclusive time of an enclosing one
        self.wall = dict.fromkeys((*COMPONENTS, "batch"), 0.0)
        self.ops = dict.fromkeys((*COMPONENTS, "batch", "other"), 0)
        self.op_s = dict.fromkeys((*COMPONENTS, "batch", "other"), 0.0)

    def reset(self) -> None:
        self.nested = 0.0
        for d in (self.wall, self.ops, self.op_s):
            for k in d:
                d[k] = 0


class OpCounter(TorchDispatchMode):
    """Counts and times every aten op, charged to the probe's current component."""

    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = self.probe.current
        self.probe.op_s[name] += time.perf_counter() - t0
        self.probe.ops[name] += 1
        return out


@contextlib.contextmanager
def probed(probe: Probe):
    """Wrap every probe so that its wall time accumulates in ``probe.wall``; restore on exit."""
    saved = []
    for owner, attr, name in _probes():
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _name=name, **k):
            outer, probe.current = probe.current, _name
            inner0 = probe.nested
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                probe.wall[_name] += dt - (probe.nested - inner0)  # exclusive of nested probes
                probe.nested = inner0 + dt
                probe.current = outer

        saved.append((owner, attr, fn))
        setattr(owner, attr, wrap)
    try:
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


class Workload:
    """Pools, backend and runner for ``max_bs`` requests; :meth:`step` gives step ``i``'s batch inputs."""

    def __init__(self, device: torch.device, max_bs: int, context: int, heads: int, steps: int, seed: int = 0,
                 device_metadata: bool = True, decode_kernel: str = "auto"):
        self.device = device
        self.cap = -(-(context + steps + 1) // PAGE) * PAGE  # tokens per row, a whole number of pages
        rows = max_bs + 1  # row 0 unused: rows 1..max_bs hold the requests
        self.req_pool = ReqToTokenPool(rows, self.cap, device)
        # row r's token t sits at slot PAGE + (r - 1) * cap + t (page 0: the padding page)
        base = PAGE + np.arange(max_bs, dtype=np.int64) * self.cap
        self.base = base
        table = torch.from_numpy(base[:, None] + np.arange(self.cap, dtype=np.int64)[None, :]).to(torch.int32)
        self.req_pool.req_to_token[1:] = table.to(device)
        self.req_pool.claim(list(range(1, rows)), self.cap)
        # DeepSeek-V3's latent row (512 + 64): the row FlashMLA reads, so 'auto' may pick it
        pool = MLATokenPool(1, (PAGE + max_bs * self.cap) // PAGE, PAGE, 512, 64, torch.bfloat16, device)
        self.backend = MLABackend(req_to_token_pool=self.req_pool, kv_pool=pool, page_size=PAGE, device=device,
                                  decode_kernel=decode_kernel, num_heads=heads)
        rng = np.random.default_rng(seed)
        self.lens0 = rng.integers(max(context // 4, 1), context + 1, size=max_bs)
        sizes = sorted({min(2 ** i, max_bs) for i in range(max_bs.bit_length() + 1)})
        self.runner = GraphRunner(self.backend, lambda batch, inputs: inputs["input_ids"], batch_sizes=sizes,
                                  mode=ForwardMode.DECODE, max_context=self.cap, device=device, use_graphs=False,
                                  device_metadata=device_metadata)

    def step(self, bs: int, i: int) -> tuple[list[int], list[int], list[int]]:
        """(rows, seq_lens, out_cache_loc) of step ``i`` of ``bs`` requests (host lists)."""
        seq = self.lens0[:bs] + i
        loc = self.base[:bs] + seq - 1
        return list(range(1, bs + 1)), seq.tolist(), loc.tolist()


def prologue_gpu_us(work: Workload, bs: int) -> float | None:
    """GPU µs of ``graph_prologue`` for the last prepared step of size ``bs`` (a CUDA graph of it alone)."""
    if work.device.type != "cuda" or not work.runner.device_metadata:
        return None
    return time_graph(work.backend.graph_prologue, warmup=10, iters=200) * 1e3


def measure(device: torch.device, bs_list: Sequence[int], context: int, heads: int, iters: int,
            warmup: int = 20, device_metadata: bool = True, decode_kernel: str = "auto") -> list[dict]:
    """Per batch size: median µs per step of each component, ``prepare`` and ``batch``; ops and Python µs."""
    work = Workload(device, max(bs_list), context, heads, steps=3 * iters + warmup + 1,
                    device_metadata=device_metadata, decode_kernel=decode_kernel)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for bs in bs_list:
        ids = torch.zeros(bs, dtype=torch.int64, device=device)
        step = 0
        probe = Probe()
        walls: dict[str, list[float]] = {k: [] for k in (*COMPONENTS, "other", "prepare", "batch")}
        ops: dict[str, list[float]] = {k: [] for k in (*COMPONENTS, "other", "batch")}
        op_s: dict[str, list[float]] = {k: [] for k in (*COMPONENTS, "other", "batch")}

        def one(kind: str) -> None:
            nonlocal step
            rows, seq, loc = work.step(bs, step)
            step += 1
            probe.reset()
            probe.current = "batch"
            t0 = time.perf_counter()
            batch = ForwardBatch.decode(rows, seq, loc, device)
            t1 = time.perf_counter()
            probe.current = "other"
            work.runner.prepare(batch, {"input_ids": ids})
            t2 = time.perf_counter()
            sync()
            if kind == "plain":
                walls["batch"].append(t1 - t0)
                walls["prepare"].append(t2 - t1)
            elif kind == "probed":
                for k in COMPONENTS:
                    walls[k].append(probe.wall[k])
                walls["other"].append(t2 - t1 - sum(probe.wall[k] for k in COMPONENTS))
            else:
                for k in ops:
                    ops[k].append(probe.ops[k])
                    op_s[k].append(probe.op_s[k])

        for _ in range(warmup):
            one("plain")
        for k in walls:
            walls[k].clear()
        for _ in range(iters):
            one("plain")
        with probed(probe):
            for _ in range(iters):
                one("probed")
            with OpCounter(probe):
                for _ in range(iters):
                    one("ops")
        med = {k: statistics.median(v) * 1e6 for k, v in walls.items()}
        row = {"bs": bs, "device": device.type, "context": context, "heads": heads,
               "metadata": "device" if work.runner.device_metadata else "host",
               "kernel": getattr(work.backend.graph_kernel, "value", None),
               "prologue_gpu_us": prologue_gpu_us(work, bs)}
        row.update({f"{k}_us": v for k, v in med.items()})
        row.update({f"{k}_ops": statistics.median(v) for k, v in ops.items()})
        op_med = {k: statistics.median(v) * 1e6 for k, v in op_s.items()}
        row.update({f"{k}_python_us": max(0.0, med[k] - op_med[k]) for k in ops})
        row["prepare_ops"] = sum(row[f"{k}_ops"] for k in (*COMPONENTS, "other"))
        row["prepare_python_us"] = sum(row[f"{k}_python_us"] for k in (*COMPONENTS, "other"))
        # what a GPU step runs: prepare without the value checks only CPU tensors get
        row["prepare_gpu_path_us"] = max(0.0, med["prepare"] - med["cpu_checks"])
        out.append(row)
    return out


def _table(rows: list[dict]) -> str:
    parts = ["prepare", "prepare_gpu_path", *COMPONENTS, "other", "batch"]
    lines = [" ".join(f"{c[:13]:>13}" for c in ("bs", "metadata", "kernel", *parts))]
    for suffix, what in (("_us", "wall µs"), ("_python_us", "python µs"), ("_ops", "aten ops")):
        lines.append(f"-- {what}")
        for r in rows:
            cells = [f"{r['bs']:>13}", f"{r['metadata']:>13}", f"{str(r['kernel']):>13}"]
            cells += [f"{r[p + suffix]:>13.1f}" if p + suffix in r else f"{'':>13}" for p in parts]
            lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mla_fa3.bench.replay_host", description=__doc__.split("\n")[0])
    p.add_argument("--bs", default="1,16,128", help="comma-separated batch sizes")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--context", type=int, default=4096, help="longest KV length at the first step")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="100 iterations")
    p.add_argument("--metadata", default="device,host", help="comma-separated: device (derived in the graph: "
                   "GraphRunner's default), host (written by the replay update: the SGLang protocol)")
    p.add_argument("--decode-kernel", default="auto", choices=("auto", "fa3", "flashmla"),
                   help="the backend's decode kernel (flashmla: its schedule re-planned every step)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        bs_list = sorted({int(b) for b in args.bs.split(",")})
    except ValueError:
        p.error(f"--bs must be comma-separated ints, got {args.bs!r}")
    if not bs_list or bs_list[0] < 1:
        p.error("--bs must hold sizes >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs CUDA")
    torch.set_num_threads(1)
    ways = [w.strip() for w in args.metadata.split(",") if w.strip()]
    if not ways or any(w not in ("device", "host") for w in ways):
        p.error(f"--metadata must list device and/or host, got {args.metadata!r}")
    rows = [r for w in ways for r in measure(device, bs_list, args.context, args.heads,
                                              100 if args.quick else args.iters, device_metadata=w == "device",
                                              decode_kernel=args.decode_kernel)]
    print(f"replay update host time, µs per step (median; device {device.type}, context {args.context}, "
          f"page {PAGE}, {args.heads} heads, decode_kernel={args.decode_kernel})")
    print(_table(rows))
    gpu = [(r["bs"], r["prologue_gpu_us"]) for r in rows if r["prologue_gpu_us"] is not None]
    if gpu:
        print("prologue GPU µs per step (inside the graph): " + ", ".join(f"bs {b}: {t:.1f}" for b, t in gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
