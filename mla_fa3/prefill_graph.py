"""CUDA graphs of the MHA prefill's layer call, for steps whose lengths repeat (serving).

An eager layer of the chunked MHA prefill (``chunked_prefix``) issues its kernels one by one from Python:
a gather, a GEMM, a copy and an attention call per chunk, a merge per chunk, each through a wrapper. On
the H200 that is ~0.25 ms of host work per layer and chunk, as long as the GPU work at 16 heads and 1k new
tokens over a 16k prefix. :class:`PrefillGraphs` captures the whole call (every chunk) once per layer and
replays it: one launch per layer.

What a graph bakes in, hence the key of a *shape*: every host value the launches carry — the MHA rows'
``prefix_lens`` and ``extend_lens`` (they fix the chunks, cu_seqlens, maxima and grid sizes), the
workspace size, q's shape and dtype, the pool's dtype, whether the new rows are passed in, the impl. Two
steps with the same key differ only in their slot ids. Within a shape, one graph per layer: the layer's
weights, pool rows and FP8 scale are addresses in it (the entry keeps those tensors alive, so an address
is never reused under it) and so are its scale and softcap.

Per step, at the first layer of a new plan: the live plan's slot ids are copied into the captured plan's
tensors (one ``_foreach_copy_`` for all layers); the captured plan owns those tensors (a copy made at
capture), so no caller's plan is ever written. Per layer: q (and the new rows) are copied into the
shape's static inputs, the graph is replayed, and its output is cloned out of the shape's static output
(one buffer for all layers): the caller owns what it gets, a later replay never overwrites it.

Policy: a shape is captured the second time it is seen (the first time runs eagerly: most prefill shapes
never repeat); at most ``max_shapes`` shapes are kept, the least recently used is dropped. Not captured
(eager, same result): split steps (their decode rows run the absorbed path), the torch reference, CPU
tensors. The eager call is the function the caller passes (``chunked_prefix`` passes its own), so this
module depends on nothing above the plan. Capture happens outside any other capture, on the current
device, after one eager warm-up run on a side stream; a failure raises (nothing is silently eager).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from mla_fa3 import ops
from mla_fa3.checks import check_int
from mla_fa3.prefill_plan import PrefillPlan

__all__ = ["PrefillGraphs"]

_SEEN_LIMIT = 256  # shapes remembered as seen once (oldest forgotten first)


@dataclass
class _Shape:
    """The graphs of one shape: the captured plan and static inputs/output shared by its layers."""

    plan: PrefillPlan  # a private copy of the plan captured with (_private_plan): the graphs' inputs
    q: Tensor  # [N, H, d_qk] static
    latent: Tensor | None  # [N, r + d_rope] static (None: the graphs read the new rows from the pool)
    out: Tensor  # [N, H, d_v] static output of every layer's graph (cloned out after each replay)
    bound: PrefillPlan | None = None  # the live plan whose slot ids the captured plan holds
    graphs: dict = field(default_factory=dict)  # layer key -> (CUDAGraph, tensors kept alive)

    def bind(self, plan: PrefillPlan) -> None:
        """Copy a live plan's slot ids into the captured plan (the only device values that differ)."""
        if plan is self.bound:
            return
        pairs = [(self.plan.prefix_slot_ids, plan.prefix_slot_ids), (self.plan.new_slot_ids, plan.new_slot_ids)]
        if self.plan.one_pass is not None:
            pairs.append((self.plan.one_pass.slot_ids, plan.one_pass.slot_ids))
        pairs = [(d, s) for d, s in pairs if d is not s and d.numel()]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        self.bound = plan


def _private_plan(plan: PrefillPlan) -> PrefillPlan:
    """The plan with slot-id tensors of its own (what ``bind`` overwrites), its chunks viewing them.

    Never the caller's tensors: a caller that runs an older plan again must find its own slots intact. The
    cu_seqlens and row tensors are shared: equal for every plan of the shape, and never written.
    """
    prefix = plan.prefix_slot_ids.clone()
    chunks, start = [], 0
    for ch in plan.chunks:
        chunks.append(dataclasses.replace(ch, slot_ids=prefix[start: start + ch.num_keys]))
        start += ch.num_keys
    one = plan.one_pass
    return dataclasses.replace(
        plan, prefix_slot_ids=prefix, new_slot_ids=plan.new_slot_ids.clone(), chunks=tuple(chunks),
        one_pass=None if one is None else dataclasses.replace(one, slot_ids=one.slot_ids.clone()), calls={})


class PrefillGraphs:
    """CUDA graphs of ``chunked_prefix``'s MHA rows, keyed by shape then layer (see the module docstring).

    ``stats``: ``captures`` (graphs captured), ``replays``, ``eager`` (calls run eagerly: first sightings,
    split steps, reference / CPU), ``evictions`` (shapes dropped).
    """

    def __init__(self, max_shapes: int = 4):
        self.max_shapes = check_int(max_shapes, "max_shapes", 1)
        self._shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self._seen: OrderedDict[tuple, weakref.ref] = OrderedDict()  # shape -> the plan it was first seen with
        self._pool = None  # one memory pool for every capture (graphs replay one at a time, in order)
        self._last: tuple[PrefillPlan | None, tuple | None] = (None, None)
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "evictions": 0}

    @property
    def num_graphs(self) -> int:
        return sum(len(s.graphs) for s in self._shapes.values())

    def clear(self) -> None:
        """Drop every graph (and the memory they hold)."""
        self._shapes.clear()
        self._seen.clear()
        self._last = (None, None)

    # ------------------------------------------------------------------------------------------ key
    def _plan_key(self, plan: PrefillPlan) -> tuple | None:
        """The plan's part of the shape key (cached per live plan: computed once per step)."""
        last, key = self._last
        if last is plan:
            return key
        key = None
        if plan.split is None:
            key = (tuple(plan.prefix_lens_cpu.tolist()), tuple(plan.extend_lens_cpu.tolist()), plan.workspace_tokens,
                   plan.page_size)
        self._last = (plan, key)
        return key

    def _shape_key(self, q: Tensor, latent: Tensor | None, rows: Tensor, plan: PrefillPlan, kv_scale, impl):
        if q.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        if ops.resolve_impl(impl, q.device) is not ops.Impl.FA3:
            return None
        pk = self._plan_key(plan)
        if pk is None:
            return None
        return pk + (tuple(q.shape), q.dtype, q.device, rows.dtype, None if latent is None else latent.dtype,
                     kv_scale is None)

    # ------------------------------------------------------------------------------------------ run
    def run(self, eager: Callable[..., Tensor], q: Tensor, latent: Tensor | None, layer, rows: Tensor,
            plan: PrefillPlan, kv_scale: Tensor | None, impl) -> Tensor:
        """``eager(q, latent, layer, rows, plan, kv_scale, impl)``, from a graph when the shape repeats."""
        key = self._shape_key(q, latent, rows, plan, kv_scale, impl)
        shape = None if key is None else self._shapes.get(key)
        if shape is None:
            if key is None or not self._seen_before(key, plan):
                self.stats["eager"] += 1
                return eager(q, latent, layer, rows, plan, kv_scale, impl)
            shape = self._new_shape(key, q, latent, layer, plan)
        else:
            self._shapes.move_to_end(key)
        shape.bind(plan)
        w_vk = layer.mla_weights.w_vk
        lkey = (layer.layer_id, w_vk.data_ptr(), rows.data_ptr(), None if kv_scale is None else kv_scale.data_ptr(),
                layer.num_heads, layer.mla, layer.scaling, layer.logit_cap)
        shape.q.copy_(q)
        if latent is not None:
            shape.latent.copy_(latent)
        entry = shape.graphs.get(lkey)
        if entry is None:
            entry = shape.graphs[lkey] = self._capture(shape, eager, layer, rows, kv_scale, impl, w_vk)
        entry[0].replay()
        self.stats["replays"] += 1
        return shape.out.clone()

    def _seen_before(self, key: tuple, plan: PrefillPlan) -> bool:
        """True when an earlier step (another plan) had this shape; every layer of the first step is eager."""
        first = self._seen.get(key)
        if first is not None and first() is not plan:  # a dead first plan was another step too
            return True
        self._seen[key] = weakref.ref(plan)
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)
        return False

    def _new_shape(self, key, q: Tensor, latent: Tensor | None, layer, plan: PrefillPlan) -> _Shape:
        while len(self._shapes) >= self.max_shapes:
            self._shapes.popitem(last=False)
            self.stats["evictions"] += 1
        out = q.new_empty(q.shape[0], layer.num_heads, layer.mla.v_head_dim)
        shape = self._shapes[key] = _Shape(plan=_private_plan(plan), q=torch.empty_like(q),
                                           latent=None if latent is None else torch.empty_like(latent), out=out,
                                           bound=plan)
        return shape

    def _capture(self, shape: _Shape, eager, layer, rows, kv_scale, impl, w_vk) -> tuple:
        """Warm up on a side stream, capture ``eager`` on the shape's static tensors into the shared pool."""
        args = (shape.q, shape.latent, layer, rows, shape.plan, kv_scale, impl)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=shape.q.device)
        side.wait_stream(torch.cuda.current_stream(shape.q.device))
        with torch.cuda.stream(side):
            eager(*args)  # lazy initialisation (cuBLAS workspace, the plan's validated calls) outside capture
        torch.cuda.current_stream(shape.q.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                shape.out.copy_(eager(*args))
        except Exception as exc:
            raise RuntimeError(f"capturing the MHA prefill of layer {layer.layer_id} in a CUDA graph failed ({exc}); "
                               "run it eagerly (MLABackend(prefill_graph_shapes=0))") from exc
        self.stats["captures"] += 1
        return graph, (w_vk, rows, kv_scale)
