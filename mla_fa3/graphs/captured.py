"""The steps a backend captured as CUDA graphs, and the one a replay of a live batch takes.

A captured step is keyed by ``(mode, bs, shape, kernel)``: its mode, its batch size, the per-request shape
(``k`` queries of a chain, or ``("tree", m, n)`` for a tree step: :func:`graph_shape`) and the absorbed
kernel baked into it (several per size where the backend lets each replay choose). A replay of ``n``
requests takes ``bs = min{b captured for (mode, shape) : b >= n}`` (or the size it is given), then one of
that size's kernels. Worked example: captured DECODE sizes ``{2: [FA3], 8: [FA3, FLASHMLA]}``; a batch of 3
replays ``bs = 8`` and may run either kernel; a batch of 9 fits none (``ValueError``).

The table holds what the backend records per step (its plan over the capture buffers); it knows neither
plans nor kernels beyond their order, so it sits below the planner. Host work only; the sorted sizes of a
``(mode, shape)`` are computed once per capture, so a replay neither sorts nor scans the captured steps.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from mla_fa3.batch import ForwardMode

__all__ = ["CapturedGraphs", "GraphShape", "graph_shape"]

GraphShape = int | tuple  # k queries per request, or ("tree", m, n)
Entry = TypeVar("Entry")


def graph_shape(k: int, tree_shape: tuple[int, int] | None) -> GraphShape:
    """The per-request shape a graph is keyed by: ``k`` queries (a chain), or ``("tree", m, n)``."""
    return k if tree_shape is None else ("tree", *tree_shape)


class CapturedGraphs(Generic[Entry]):
    """``(mode, bs, shape, kernel) -> entry`` of the captured steps; ``kernels``: every kernel, in the order a
    replay lists (and by default takes) those captured for one size."""

    def __init__(self, kernels: Sequence[Hashable]):
        self._kernels = tuple(kernels)
        self._entries: dict[tuple[ForwardMode, int, GraphShape, Hashable], Entry] = {}
        # (mode, shape) -> (sorted captured sizes, size -> captured kernels in kernel order); rebuilt
        # lazily after a capture
        self._sizes: dict[tuple[ForwardMode, GraphShape], tuple[list[int], dict[int, list]]] = {}

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()

    def add(self, mode: ForwardMode, bs: int, shape: GraphShape, kernel: Hashable, entry: Entry) -> None:
        """Record a captured step (replacing one of the same key)."""
        self._entries[(mode, bs, shape, kernel)] = entry
        self._sizes.clear()

    def get(self, mode: ForwardMode, bs: int, shape: GraphShape, kernel: Hashable) -> Entry:
        return self._entries[(mode, bs, shape, kernel)]

    def kernels_for(self, mode: ForwardMode, shape: GraphShape, num_requests: int,
                    bs: int | None = None) -> tuple[int, list]:
        """``(bs, kernels captured for it)``: the captured size a batch of ``num_requests`` replays at — the
        smallest that fits, or ``bs`` when given — and its kernels in kernel order. ``ValueError`` when no
        captured size fits, or ``bs`` was not captured for ``(mode, shape)``."""
        captured = self._sizes.get((mode, shape))
        if captured is None:  # sizes and kernels of (mode, shape), sorted once per capture
            captured = self._sizes[(mode, shape)] = self._captured_sizes(mode, shape)
        sizes, kernels_of = captured
        if bs is None:
            i = bisect.bisect_left(sizes, num_requests)
            if i == len(sizes):
                raise ValueError(f"batch of {num_requests} requests ({mode.name}, k={shape}) fits no captured "
                                 f"batch size {sizes}")
            bs = sizes[i]
        kernels = kernels_of.get(bs)
        if not kernels:
            raise ValueError(f"bs {bs} was not captured for {mode.name} (k={shape}); captured: {sizes}")
        return bs, kernels

    def _captured_sizes(self, mode: ForwardMode, shape: GraphShape) -> tuple[list[int], dict[int, list]]:
        """(sorted sizes, size -> kernels in kernel order) of the steps captured for ``(mode, shape)``."""
        sizes = sorted({b for (m, b, s, _) in self._entries if m is mode and s == shape})
        return sizes, {b: [kn for kn in self._kernels if (mode, b, shape, kn) in self._entries] for b in sizes}
