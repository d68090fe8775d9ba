"""CUDA-graph capture and replay of decode / verify / draft steps for a set of batch sizes.

Symbols: ``B = {b_1 < … < b_m}`` the captured batch sizes, ``q`` the query tokens per request of the
runner's mode (1 for DECODE and DRAFT_DECODE, ``k = num_draft_tokens`` for TARGET_VERIFY, ``topk`` for a
DRAFT_DECODE tree), ``n`` the
live batch's requests and ``b = min{b_i ∈ B : b_i >= n}`` the padded size it replays at.

A ``torch.cuda.CUDAGraph`` replays fixed device addresses, so everything the step reads lives in
:class:`StaticBuffers` (``graphs.static``), allocated once for ``b_m`` requests (``b_m · q`` tokens).
One graph is captured per size (and per draft step), all in ONE memory pool, largest first, each over
views ``[:b]`` / ``[:b·q]`` of the same buffers. Per run (``GraphRunner.run``):

1. checks (host only): the mode / draft tokens / draft step match, ``n <= b_m``, and
   ``max(seq_lens_cpu) <= max_context`` — otherwise ``ValueError``, before anything is written;
2. ``fill_inputs`` and ``pad_batch`` (``graphs.static``) copy the live inputs and batch into rows
   ``[:n·q]`` / ``[:n]`` of the static buffers and reset the padding rows ``[n·q:b·q]`` / ``[n:b]``
   (slot 0, position 0, ``pad_req_index``, ``seq_len_fill``); all live-row copies go in one
   ``torch._foreach_copy_``;
3. the backend's ``init_forward_metadata_replay_cuda_graph(live batch, bs=b)`` rewrites the captured
   metadata in place: the live rows ``[:n]`` and its own padding tail ``[n:b]`` (``cache_seqlens``
   0 or 1 over padding page 0, see ``graphs.capture``); host ints come from ``seq_lens_cpu``;
4. ``graph.replay()``; the result is the captured output's first ``n·q`` rows — views into the
   graph's output, valid until the next run of this runner (clone what must survive it).

Steps 1-4 are device->device copies and fills, one host->device copy from pinned memory and host
arithmetic on CPU tensors: a run never syncs (the GPU tests run 2-4 under
``torch.cuda.set_sync_debug_mode("error")``). Without CUDA (or with ``use_graphs=False``) "capture"
records nothing and a run calls ``forward_fn`` eagerly on the same static buffers and captured
metadata: the CPU tests check that padding and buffer reuse equal the eager step, the GPU tests check
the replay against the same.

DRAFT_DECODE: one graph per (size, draft step ``i``); a run replays ``batch.draft_step``'s graph
after updating step ``i``'s metadata (``MultiStepDraftBackend.step(i)``, each step its own buffers).

Tree steps (EAGLE topk > 1, :mod:`mla_fa3.tree`): ``tree_shape=(m, n)`` fixes the tree shape of every
graph of the runner — TARGET_VERIFY ``(k, k)``; DRAFT_DECODE ``(topk, n)`` with ``num_draft_tokens = topk``,
the same ``n`` at every draft step (SGLang's layout keeps all ``topk · num_steps`` draft keys in the row from
step 0, the future ones masked out: ``tree.sglang_draft_mask``). Each graph is captured with that tree shape
(the backend's tree buffers, ``graphs.tree_buffers``); a run copies the live masks with the other live rows
and pads with the padding tree and ``seq_lens = n + 1`` (``graphs.static``). A batch without a tree, or with
a tree of another shape or kind, raises ``DraftTreeError`` (a ``ValueError``) in step 1, before any write;
a runner without ``tree_shape`` refuses tree batches the same way. Chain and tree steps of one mode take
two runners, each over its own backend (a capture starts with ``init_cuda_graph_state``, which drops the
backend's earlier graphs).

``forward_fn(batch, inputs)`` is the step to capture: ``batch`` a :class:`ForwardBatch` whose tensors
are the static views, ``inputs`` a dict of the static input views (``name -> [b·q, *shape]``). It must
call the backend's ``forward`` (NOT ``init_forward_metadata``; the runner does the capture / replay
metadata calls) and return a tensor or a tuple / list / dict of tensors with ``b·q`` leading rows.
It must not write its inputs or the static batch in place: the runner resets padding rows only where
its own copies wrote live values.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor

from mla_fa3.batch import ForwardBatch, ForwardMode, queries_per_request
from mla_fa3.tree import DraftTreeError
from mla_fa3.graphs.static import (InputSpec, StaticBuffers, copy_all, fill_inputs, pad_batch, padded_size, static_batch)

__all__ = ["InputSpec", "StaticBuffers", "GraphRunner", "padded_size", "pad_batch", "fill_inputs",
           "copy_all", "static_batch", "DEFAULT_INPUTS"]


DEFAULT_INPUTS: dict[str, InputSpec] = {"input_ids": InputSpec((), torch.int64)}



def _slice_rows(out: Any, rows: int) -> Any:
    if isinstance(out, Tensor):
        return out[:rows]
    if isinstance(out, (tuple, list)):
        return type(out)(_slice_rows(o, rows) for o in out)
    if isinstance(out, dict):
        return {k: _slice_rows(v, rows) for k, v in out.items()}
    if out is None:
        return None
    raise TypeError(f"forward_fn must return a tensor or a tuple / list / dict of tensors, got {type(out).__name__}")


class GraphRunner:
    """One CUDA graph per (batch size[, draft step]) of a graph-capturable step; pad, update, replay.

    Args:
        backend: the attention backend (``MLABackend`` / ``MultiStepDraftBackend``) providing
            ``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph`` and
            ``init_forward_metadata_replay_cuda_graph`` (see docs/ARCHITECTURE.md).
        forward_fn: ``forward_fn(batch, inputs) -> out`` (module docstring).
        batch_sizes: sizes to capture (ints >= 1).
        mode: DECODE, TARGET_VERIFY or DRAFT_DECODE.
        num_draft_tokens: ``k`` tokens per request for TARGET_VERIFY, ``topk`` for a DRAFT_DECODE tree
            (1 for a draft chain; ignored for DECODE).
        max_context: the longest ``seq_lens`` a run may carry (sizes the page-table buffers).
        num_draft_steps: DRAFT_DECODE: steps of the multi-step draft, one graph each (batch.draft_step).
        input_specs: the named per-token inputs (default: ``input_ids`` int64).
        device: where the static buffers live (default: the backend's ``device``, else CUDA).
        use_graphs: capture real CUDA graphs (default: when ``device`` is CUDA).
        seq_len_fill: ``seq_lens`` of the static batch's padding rows (raised to ``q``); the
            kernels' padding lengths are the metadata builder's (``graphs.capture``).
        capture_now: capture in the constructor (default) or later through :meth:`capture`.
        tree_shape: ``(m, n)``: every graph is a tree step of that shape (module docstring); None: no tree.
        device_metadata: with a backend that has ``graph_prologue`` (``MLABackend``), derive the page
            table and the FlashMLA schedule inside each graph, before ``forward_fn`` (default): the
            replay update then writes the lengths and rows in one host->device copy. False: the
            backend's replay update writes them (the SGLang protocol).
    """

    def __init__(self, backend: Any, forward_fn: Callable[[ForwardBatch, dict], Any], *,
                 batch_sizes: Iterable[int], mode: ForwardMode, num_draft_tokens: int = 1,
                 max_context: int, num_draft_steps: int = 1,
                 input_specs: Mapping[str, InputSpec] | None = None,
                 device: torch.device | str | None = None, use_graphs: bool | None = None,
                 seq_len_fill: int = 1, capture_now: bool = True, device_metadata: bool = True,
                 tree_shape: tuple[int, int] | None = None):
        if not isinstance(mode, ForwardMode) or not mode.is_graph_capturable():
            raise ValueError(f"mode must be DECODE, TARGET_VERIFY or DRAFT_DECODE, got {mode!r}")
        sizes = sorted(set(batch_sizes))
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"batch_sizes must be a non-empty collection of ints >= 1, got {batch_sizes!r}")
        for name, value in (("num_draft_tokens", num_draft_tokens), ("max_context", max_context),
                            ("num_draft_steps", num_draft_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not callable(forward_fn):
            raise TypeError(f"forward_fn must be callable, got {type(forward_fn).__name__}")
        specs = dict(DEFAULT_INPUTS if input_specs is None else input_specs)
        for name, spec in specs.items():
            if not isinstance(spec, InputSpec):
                raise TypeError(f"input_specs[{name!r}] must be an InputSpec, got {type(spec).__name__}")
        self.backend, self.forward_fn, self.mode = backend, forward_fn, mode
        self.batch_sizes = sizes
        self.num_draft_tokens = queries_per_request(mode, num_draft_tokens)
        self.num_draft_steps = num_draft_steps if mode is ForwardMode.DRAFT_DECODE else 1
        # the backend's device half of each step's metadata runs inside the graph (see graph_prologue)
        self.device_metadata = bool(device_metadata) and callable(getattr(self._step_backend(0), "graph_prologue",
                                                                          None))
        self.max_context = max_context
        self.tokens_per_request = self.num_draft_tokens
        if max_context < self.tokens_per_request:
            raise ValueError(f"max_context must be >= {self.tokens_per_request} tokens per request, got {max_context}")
        if tree_shape is None and mode is ForwardMode.DRAFT_DECODE and self.num_draft_tokens > 1:
            raise DraftTreeError(f"num_draft_tokens = {num_draft_tokens} queries per request in DRAFT_DECODE is a "
                                 "draft tree: give its tree_shape (topk, n)")
        if tree_shape is not None and mode is ForwardMode.DECODE:
            raise DraftTreeError("tree_shape is for TARGET_VERIFY and DRAFT_DECODE runners, got DECODE")
        self.device = torch.device(device if device is not None else getattr(backend, "device", "cuda"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"use_graphs needs a CUDA device, got {self.device}")
        self.buffers = StaticBuffers.allocate(sizes[-1], self.tokens_per_request, specs, self.device,
                                              seq_len_fill=seq_len_fill, tree_shape=tree_shape,
                                              tree_verify=mode is ForwardMode.TARGET_VERIFY)
        self.tree_shape = self.buffers.tree_shape  # (m, n) checked by the buffers, or None
        if self.tree_shape is not None and max_context < self.tree_shape[1] + 1:
            raise ValueError(f"max_context must be >= the {self.tree_shape[1]} tree keys + a prefix of 1 token, got "
                             f"{max_context}")
        # keyed (size, draft step, kernel): a backend whose decode kernel is chosen per step
        # (``graph_kernels()`` lists more than one) gets one graph per kernel; the replay update says which
        self._batches: dict[tuple[int, int, Any], ForwardBatch] = {}
        self._graphs: dict[tuple[int, int, Any], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, Any], Any] = {}
        self._kernels: dict[int, tuple] = {}  # draft step -> the kernels captured for it (see _graph_kernels)
        self.pool = None  # the graphs' shared memory pool (CUDA)
        self.captured = False
        if capture_now:
            self.capture()

    # ------------------------------------------------------------------ capture
    def _static_inputs(self, bs: int) -> dict[str, Tensor]:
        rows = bs * self.tokens_per_request
        return {name: t[:rows] for name, t in self.buffers.inputs.items()}

    def capture(self) -> None:
        """Set up the backend's graph state and capture every (size, draft step), largest first."""
        if self.captured:
            raise RuntimeError("capture() was already called")
        self._kernels.clear()
        extra = {"device_metadata": True} if self.device_metadata else {}
        self.backend.init_cuda_graph_state(self.batch_sizes[-1], self.max_context,
                                           max_num_draft_tokens=self.num_draft_tokens, **extra)
        stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        for bs in reversed(self.batch_sizes):
            for step in range(self.num_draft_steps):
                batch = static_batch(self.buffers, bs, self.mode, num_draft_tokens=self.num_draft_tokens,
                                     draft_step=step)
                backend = self._step_backend(step)
                for kernel in self._graph_kernels(step):
                    extra = {} if kernel is None else {"kernel": kernel}
                    if self.tree_shape is not None:
                        extra["tree_shape"] = self.tree_shape
                    self._batches[(bs, step, kernel)] = batch
                    backend.init_forward_metadata_capture_cuda_graph(
                        bs, self.mode, num_draft_tokens=self.num_draft_tokens, **extra)
                    if self.use_graphs:
                        self._capture_one((bs, step, kernel), batch, stream)
        self.captured = True

    def _graph_kernels(self, step: int) -> tuple:
        """Decode kernels to capture a graph for (``(None,)``: the backend picks one at capture); asked
        of the backend once per capture (a replay reads the captured list)."""
        hit = self._kernels.get(step)
        if hit is None:
            kernels = getattr(self._step_backend(step), "graph_kernels", None)
            kernels = tuple(kernels()) if callable(kernels) else ()
            hit = self._kernels[step] = kernels if len(kernels) > 1 else (None,)
        return hit

    def _step_fn(self, key: tuple, batch: ForwardBatch, inputs: Mapping[str, Tensor]) -> Any:
        """What a graph holds: the backend's device metadata (with ``device_metadata``), then ``forward_fn``."""
        if self.device_metadata:
            self._step_backend(key[1]).graph_prologue()
        return self.forward_fn(batch, inputs)

    def _capture_one(self, key: tuple, batch: ForwardBatch, stream) -> None:
        inputs = self._static_inputs(key[0])
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up off the capture: lazy inits, workspace allocations
            for _ in range(2):
                self._step_fn(key, batch, inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self._step_fn(key, batch, inputs)
        self.pool = graph.pool()
        self._graphs[key] = graph
        self._outputs[key] = out
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ run
    def check_fits(self, batch: ForwardBatch) -> int:
        """Host-only checks that ``batch`` can replay here; returns the padded batch size."""
        if not self.captured:
            raise RuntimeError("capture() has not run")
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        if batch.forward_mode is not self.mode:
            raise ValueError(f"batch.forward_mode must be {self.mode.name} for this runner, got {batch.forward_mode.name}")
        if self.mode is ForwardMode.TARGET_VERIFY and batch.num_draft_tokens != self.num_draft_tokens:
            raise ValueError(f"batch.num_draft_tokens must be {self.num_draft_tokens} (captured), got {batch.num_draft_tokens}")
        if self.mode is ForwardMode.DRAFT_DECODE and not 0 <= batch.draft_step < self.num_draft_steps:
            raise ValueError(f"batch.draft_step must be in [0, {self.num_draft_steps}), got {batch.draft_step}")
        self.buffers.check_tree(batch)  # a tree exactly when captured with one, of the captured shape
        if batch.batch_size < 1:
            raise ValueError("batch.batch_size must be >= 1 (an IDLE step needs no graph)")
        bs = padded_size(batch.batch_size, self.batch_sizes)
        longest = batch.seq_lens_max  # host int (the CPU copy): no device sync
        if longest > self.max_context:
            raise ValueError(f"batch.seq_lens holds a context of {longest} tokens, over the max_context "
                             f"{self.max_context} the graphs were planned for")
        if batch.device != self.device:
            raise ValueError(f"batch is on {batch.device}, the runner's buffers on {self.device}")
        return bs

    def prepare(self, batch: ForwardBatch, inputs: Mapping[str, Tensor]) -> tuple[int, int, Any]:
        """Steps 1-3 of a run (check, pad, metadata replay update); returns the (size, step, kernel) key."""
        bs = self.check_fits(batch)
        q = self.tokens_per_request
        copies: list = []
        buf = self.buffers
        marks = bytes(buf.live_rows), bytes(buf.live_tokens)  # they count queued copies as done
        try:
            fill_inputs(inputs, buf, batch.batch_size * q, bs * q, copies=copies)  # validates before writing
            pad_batch(batch, buf, bs, copies=copies)
        except Exception:  # nothing was copied: the marks must not say otherwise
            buf.live_rows[:], buf.live_tokens[:] = marks
            raise
        copy_all(copies)  # every live row of the static buffers, one call per dtype
        step = batch.draft_step if self.mode is ForwardMode.DRAFT_DECODE else 0
        backend = self._step_backend(step)
        # the live rows: the builder writes [:n] and resets its own metadata tail [n:bs]; a backend with
        # several graph kernels picks one here from the live lengths (host values)
        backend.init_forward_metadata_replay_cuda_graph(batch, bs=bs)
        kernels = self._graph_kernels(step)
        return (bs, step, backend.graph_kernel if len(kernels) > 1 else None)

    def _step_backend(self, step: int) -> Any:
        """The backend holding draft step ``step``'s metadata (``MultiStepDraftBackend.step``), else the backend."""
        if self.mode is ForwardMode.DRAFT_DECODE and callable(getattr(self.backend, "step", None)):
            return self.backend.step(step)
        return self.backend

    def replay(self, key: tuple[int, int, Any]) -> Any:
        """Step 4 for a prepared key: replay the graph (or run eagerly without graphs); full padded output."""
        if self.use_graphs:
            self._graphs[key].replay()
            return self._outputs[key]
        return self._step_fn(key, self._batches[key], self._static_inputs(key[0]))

    def run(self, batch: ForwardBatch, inputs: Mapping[str, Tensor]) -> Any:
        """Pad ``batch`` to the next captured size, update the metadata, replay; first ``n·q`` rows."""
        key = self.prepare(batch, inputs)
        return _slice_rows(self.replay(key), batch.num_tokens)

    def graph(self, bs: int, draft_step: int = 0, kernel: Any = None) -> "torch.cuda.CUDAGraph":
        """The captured graph of padded size ``bs``, draft step and kernel (default: the first captured)."""
        if kernel is None:
            kernel = self._graph_kernels(draft_step)[0]
        return self._graphs[(bs, draft_step, kernel)]

    def close(self) -> None:
        """Drop the graphs, outputs and pool (free their memory); ``capture()`` may run again."""
        self._graphs.clear()
        self._outputs.clear()
        self._batches.clear()
        self._kernels.clear()
        self.pool = None
        self.captured = False

    @contextlib.contextmanager
    def no_sync_check(self):
        """Context in which any device->host sync raises (``torch.cuda.set_sync_debug_mode('error')``)."""
        if self.device.type != "cuda":
            yield
            return
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(old)
