"""MultiStepDraftBackend: the attention backend of a multi-step speculative draft (EAGLE-style).

A draft of ``n`` steps runs the draft model ``n`` times per engine step, each time one new token per
request. With ``base_b`` the tokens request ``b`` had committed before drafting, step ``i``
(0-based) writes the request's token at position ``base_b + i`` and attends to

    cache_seqlens_i[b] = base_b + i + 1

keys — the uniform ``seq_lens`` convention of :mod:`mla_fa3.batch` (keys after this step's token is
written). The backend holds one :class:`~mla_fa3.backend.MLABackend` per step, each with its own
metadata builder and CUDA-graph capture buffers, so the ``n`` steps' metadata coexist (all planned
once, before the first step runs, or all captured in one graph). They share the KV pools.

Precondition: every step's slot is in ``req_to_token`` before the steps are planned (the engine
allocates the ``num_steps`` draft slots of each request up front, as EAGLE engines do): step ``i``'s
page table is gathered from ``req_to_token`` at planning time.

Batches: the engine hands ``init_forward_metadata`` the step-0 ``DRAFT_DECODE`` batch (``seq_lens =
base + 1``, ``draft_step = 0``); :meth:`step_batch` derives step ``i``'s batch from it (``seq_lens +
i``, ``positions + i``, that step's ``out_cache_loc``) with device arithmetic only (no sync). Each
layer of step ``i`` calls ``step(i).forward(...)`` — or :meth:`forward`, which routes by
``batch.draft_step``.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.plan import PathRecord

__all__ = ["MultiStepDraftBackend"]


class MultiStepDraftBackend:
    """``num_steps`` draft steps, one :class:`MLABackend` (and metadata) each; same kwargs as MLABackend."""

    def __init__(self, num_steps: int, **backend_kwargs):
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        self.num_steps = num_steps
        self.backends = [MLABackend(**backend_kwargs) for _ in range(num_steps)]
        self.device = self.backends[0].device

    def step(self, i: int) -> MLABackend:
        """The backend view of draft step ``i`` (its metadata is step i's)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_steps:
            raise ValueError(f"i must be a draft step in [0, {self.num_steps}), got {i!r}")
        return self.backends[i]

    def step_batch(self, batch: ForwardBatch, i: int, out_cache_loc: torch.Tensor | None = None) -> ForwardBatch:
        """Step ``i``'s DRAFT_DECODE batch from the step-0 batch (device adds, no sync).

        ``out_cache_loc`` [bs] int64: the slots step ``i`` writes — required for ``i > 0``, since a layer
        stores its latent rows there (reusing step 0's slots would overwrite step 0's token).
        """
        if i and out_cache_loc is None:
            raise ValueError(f"out_cache_loc is required for draft step {i} (the slots that step writes); "
                             "step 0's would be overwritten")
        return self._planning_batch(batch, i, out_cache_loc)

    def _planning_batch(self, batch: ForwardBatch, i: int, out_cache_loc: torch.Tensor | None = None) -> ForwardBatch:
        """Step ``i``'s batch for metadata planning (when no ``out_cache_loc`` is given: the slots
        ``req_to_token`` holds for step ``i``'s tokens, gathered on the device — no sync)."""
        self._check_base(batch)
        backend = self.step(i)
        changes = {"draft_step": i}
        if i:
            changes.update(seq_lens=batch.seq_lens + i, seq_lens_cpu=batch.seq_lens_cpu + i)
            if batch.positions is not None:
                changes["positions"] = batch.positions + i
            if out_cache_loc is None:
                col = batch.seq_lens.long() + (i - 1)
                if batch.encoder_lens is not None:
                    p = backend.page_size
                    col = col + (batch.encoder_lens.long() + p - 1) // p * p
                table = backend.builder.req_to_token  # col clamped: a too-long batch fails validation, named
                out_cache_loc = table[batch.req_pool_indices, col.clamp(max=table.shape[1] - 1)].long()
        if out_cache_loc is not None:
            changes["out_cache_loc"] = out_cache_loc
        return dataclasses.replace(batch, **changes)

    def _check_base(self, batch: ForwardBatch) -> None:
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        if batch.forward_mode is not ForwardMode.DRAFT_DECODE or batch.draft_step != 0:
            raise ValueError(f"batch must be the step-0 DRAFT_DECODE batch, got {batch.forward_mode.name} "
                             f"with draft_step {batch.draft_step}")

    # ------------------------------------------------------------------------------ eager
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan every step once from the step-0 batch: step i's cache_seqlens = batch.seq_lens + i."""
        self._check_base(batch)
        for i, backend in enumerate(self.backends):
            backend.init_forward_metadata(self._planning_batch(batch, i))

    def forward(self, q, k, v, layer, batch: ForwardBatch, *, save_kv_cache: bool = True) -> torch.Tensor:
        """A layer of draft step ``batch.draft_step`` (the step's own batch, with its out_cache_loc)."""
        return self.step(batch.draft_step).forward(q, k, v, layer, batch, save_kv_cache=save_kv_cache)

    def explain(self) -> list[PathRecord | None]:
        """One record per step."""
        return [b.explain() for b in self.backends]

    # ------------------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_context: int, **kwargs) -> None:
        """Capture buffers for every step (each step's metadata lives in its own buffers)."""
        for backend in self.backends:
            backend.init_cuda_graph_state(max_bs, max_context, **kwargs)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch, *args, **kwargs):
        """Capture the metadata of step ``batch.draft_step`` (how a per-step graph runner calls it)."""
        return self.step(batch.draft_step).init_forward_metadata_capture_cuda_graph(batch, *args, **kwargs)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch, *, bs: int | None = None):
        """Replay-update the metadata of step ``batch.draft_step`` from that step's batch."""
        return self.step(batch.draft_step).init_forward_metadata_replay_cuda_graph(batch, bs=bs)

    def capture_all_steps(self, bs: int) -> list:
        """Capture every step's metadata for one graph spanning the whole draft; returns them by step."""
        return [b.init_forward_metadata_capture_cuda_graph(bs, ForwardMode.DRAFT_DECODE) for b in self.backends]

    def replay_all_steps(self, batch: ForwardBatch, *, bs: int | None = None) -> list:
        """Replay-update every step's captured metadata from the step-0 batch (one graph, all steps)."""
        self._check_base(batch)
        return [backend.init_forward_metadata_replay_cuda_graph(self._planning_batch(batch, i), bs=bs)
                for i, backend in enumerate(self.backends)]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.backends[0].get_cuda_graph_seq_len_fill_value()
