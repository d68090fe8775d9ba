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

Draft trees (EAGLE with topk > 1, :mod:`mla_fa3.tree`): step ``i`` runs ``topk`` queries per request, one per
branch, and which draft tokens each branch sees is the engine's to say — the tree is not derived here. The
engine hands :meth:`init_forward_metadata` (and :meth:`replay_all_steps`) the list of every step's batch,
step ``i``'s built as

    ForwardBatch.draft_decode(rows, prefix_lens + n, loc_i, device, step=i, tree=DraftTree.draft(mask_i))

with ``n`` the draft keys in the last ``n`` columns of each row (in ``req_to_token`` before planning, as
above), ``mask_i [bs, topk, n]`` (``mask_i[b, j, t]``: branch j of request b sees draft key t at step i —
its ancestors' tokens and its own) and ``loc_i [bs * topk]`` the slots step i writes (among the draft keys,
each seen by its own branch). In SGLang's layout (``draft_loc [bs, topk, num_steps]``: the draft slots,
branch-major, the row's last ``topk · num_steps`` columns; branch j sees its own steps ``0 .. i``),
:func:`sglang_tree_steps` builds the list. ``n`` may be the same at every step (SGLang's layout, future keys
masked out: what a CUDA-graph runner needs, its tree shape being fixed) or grow step by step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.plan import PathRecord
from mla_fa3.tree import DraftTree, DraftTreeError, sglang_draft_mask

__all__ = ["MultiStepDraftBackend", "sglang_tree_steps"]

DraftSteps = ForwardBatch | Sequence[ForwardBatch]  # the step-0 batch (a chain), or every step's (a tree)


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

    def _step_batches(self, steps: DraftSteps) -> list[ForwardBatch]:
        """Every step's batch: derived from the step-0 batch of a chain, or the engine's list (checked: one
        DRAFT_DECODE batch per step, step i's ``draft_step`` i, the same requests)."""
        if isinstance(steps, ForwardBatch):
            if steps.tree is not None:
                raise DraftTreeError("a draft tree's steps are the engine's: pass every step's batch (a list, step "
                                     "i's with its tree), not the step-0 batch alone")
            self._check_base(steps)
            return [self._planning_batch(steps, i) for i in range(self.num_steps)]
        batches = list(steps) if isinstance(steps, (list, tuple)) else None
        if batches is None or len(batches) != self.num_steps:
            raise ValueError(f"batch must be the step-0 ForwardBatch or a list of {self.num_steps} step batches, got "
                             f"{type(steps).__name__}{'' if batches is None else f' of {len(batches)}'}")
        first = batches[0]
        for i, b in enumerate(batches):
            if not isinstance(b, ForwardBatch):
                raise TypeError(f"batch[{i}] must be a ForwardBatch, got {type(b).__name__}")
            if b.forward_mode is not ForwardMode.DRAFT_DECODE or b.draft_step != i:
                raise ValueError(f"batch[{i}] must be the DRAFT_DECODE batch of step {i}, got {b.forward_mode.name} "
                                 f"with draft_step {b.draft_step}")
            if b.batch_size != first.batch_size or (b.tree is None) != (first.tree is None) or (
                    b.req_pool_indices_cpu is not None and first.req_pool_indices_cpu is not None
                    and not torch.equal(b.req_pool_indices_cpu, first.req_pool_indices_cpu)):
                raise ValueError(f"batch[{i}] must hold the requests of batch[0] (the same rows, each step with a "
                                 "tree or none)")
        return batches

    # ------------------------------------------------------------------------------ eager
    def init_forward_metadata(self, batch: DraftSteps) -> None:
        """Plan every step once. ``batch``: the step-0 batch of a chain draft (step i's cache_seqlens =
        batch.seq_lens + i), or the list of every step's batch of a draft tree (module doc)."""
        for backend, step_batch in zip(self.backends, self._step_batches(batch)):
            backend.init_forward_metadata(step_batch)

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

    def capture_all_steps(self, bs: int, *, tree_shape: tuple[int, int] | None = None) -> list:
        """Capture every step's metadata for one graph spanning the whole draft; returns them by step.
        ``tree_shape`` (topk, n): a draft tree's, the same at every step."""
        kw = {} if tree_shape is None else {"num_draft_tokens": tree_shape[0], "tree_shape": tree_shape}
        return [b.init_forward_metadata_capture_cuda_graph(bs, ForwardMode.DRAFT_DECODE, **kw) for b in self.backends]

    def replay_all_steps(self, batch: DraftSteps, *, bs: int | None = None) -> list:
        """Replay-update every step's captured metadata (one graph, all steps) from the step-0 batch of a chain
        or every step's batch of a tree (as :meth:`init_forward_metadata`)."""
        return [backend.init_forward_metadata_replay_cuda_graph(step_batch, bs=bs)
                for backend, step_batch in zip(self.backends, self._step_batches(batch))]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.backends[0].get_cuda_graph_seq_len_fill_value()


def sglang_tree_steps(req_pool_indices: Sequence[int], prefix_lens: Sequence[int], draft_loc: torch.Tensor,
                      device: torch.device | str) -> list[ForwardBatch]:
    """Every step's DRAFT_DECODE batch of a draft tree in SGLang's layout (module doc).

    ``draft_loc [bs, topk, num_steps]`` int64: the draft slots, branch-major — request b's row holds
    ``draft_loc[b].reshape(-1)`` in its last ``topk · num_steps`` columns, after its ``prefix_lens[b]`` tokens.
    Step i: ``seq_lens = prefix + topk · num_steps``, ``out_cache_loc = draft_loc[:, :, i]``, the tree
    ``sglang_draft_mask(bs, topk, num_steps, i)`` (branch j sees its own steps 0 .. i), positions prefix + i."""
    if not isinstance(draft_loc, torch.Tensor) or draft_loc.dim() != 3:
        raise ValueError(f"draft_loc must be a [bs, topk, num_steps] tensor, got "
                         f"{tuple(draft_loc.shape) if isinstance(draft_loc, torch.Tensor) else type(draft_loc).__name__}")
    bs, topk, num_steps = draft_loc.shape
    seq = [int(p) + topk * num_steps for p in prefix_lens]
    if len(seq) != bs:
        raise ValueError(f"prefix_lens must have one entry per request of draft_loc ({bs}), got {len(seq)}")
    return [ForwardBatch.draft_decode(req_pool_indices, seq, draft_loc[:, :, i].reshape(-1), device, step=i,
                                      tree=DraftTree.draft(sglang_draft_mask(bs, topk, num_steps, i), device))
            for i in range(num_steps)]
