"""The static buffers of captured steps (``graphs.runner``) and the per-run copies that pad a live batch into them.

Symbols as in ``graphs.runner``: ``B = {b_1 < … < b_m}`` the captured batch sizes, ``q`` the query tokens
per request, ``n`` the live batch's requests and ``b = min{b_i ∈ B : b_i >= n}`` the padded size it
replays at (:func:`padded_size`).

A ``torch.cuda.CUDAGraph`` replays fixed device addresses, so everything the step reads lives in
:class:`StaticBuffers`, allocated once for ``b_m`` requests (``b_m · q`` tokens); the graph of size ``b``
reads views ``[:b]`` / ``[:b·q]`` of them (:func:`static_batch`). Per run, :func:`fill_inputs` copies
every named input into rows ``[:n·q]`` of its buffer and zeroes the padding rows ``[n·q:b·q]``;
:func:`pad_batch` does the same for the batch the step reads: ``out_cache_loc`` -> slot 0 (the padding
slot, never handed out: padding rows write only there), ``positions`` -> 0, ``req_pool_indices`` ->
``pad_req_index`` (0), ``seq_lens`` -> ``seq_len_fill`` (``max(fill, q)``, so the static batch stays a
valid ForwardBatch; no kernel reads it — the kernels read the metadata). Only rows an earlier run
filled are reset (host-side marks ``StaticBuffers.live_*``); all live-row copies go in one
``torch._foreach_copy_`` (:func:`copy_all`). Device->device copies and fills: no sync.

Tree steps (:mod:`mla_fa3.tree`; a runner with a ``tree_shape`` (m, n)): the static batch carries a
:class:`~mla_fa3.tree.DraftTree` whose mask is the view ``[:b]`` of ``tree_mask [b_m, m, n]``;
:func:`pad_batch` copies the live masks into ``[:n]`` and gives padding requests the *padding tree*
(every query sees tree key 0 — and, in a verify tree, itself: a valid star) and ``seq_lens = n + 1``
(``seq_len_fill`` is raised to it), so a padding request keeps a prefix of one token (slot 0 of the
padding page). A batch whose tree shape differs from the buffers' raises ``DraftTreeError`` before any
copy. The kernels read the tree part from the metadata builder's ``graphs.tree_buffers``, which its
replay update writes the same way; ``tree_mask`` keeps the static batch what the graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.tree import MAX_TREE_TOKENS, DraftTree, DraftTreeError

__all__ = ["InputSpec", "StaticBuffers", "padded_size", "static_batch", "copy_all", "pad_batch", "fill_inputs"]


@dataclass(frozen=True)
class InputSpec:
    """A per-token input of the captured step: ``[T, *shape]`` of ``dtype`` on the runner's device."""

    shape: tuple[int, ...]  # trailing shape per token, e.g. () for input ids, (H, 192) for q
    dtype: torch.dtype


@dataclass
class StaticBuffers:
    """Everything a captured step reads: allocated once for ``max_bs`` requests, written per run."""

    req_pool_indices: Tensor  # [max_bs] int64, device — padding rows: pad_req_index
    seq_lens: Tensor  # [max_bs] int32, device — padding rows: seq_len_fill
    seq_lens_cpu: Tensor  # [max_bs] int32, cpu — host copy of seq_lens (host maxima, no sync)
    out_cache_loc: Tensor  # [max_bs * q] int64, device — padding tokens: slot 0
    positions: Tensor  # [max_bs * q] int64, device — padding tokens: 0
    inputs: dict[str, Tensor]  # name -> [max_bs * q, *spec.shape] of spec.dtype, device; padding: 0
    tokens_per_request: int  # q
    seq_len_fill: int  # seq_lens value of a padding row (>= q)
    pad_req_index: int  # req_pool_indices value of a padding row
    live_rows: bytearray  # [max_bs] host: 1 where a batch row may hold a live (non-padding) value
    live_tokens: bytearray  # [max_bs * q] host: 1 where an input row may hold a non-zero value
    padding: dict[str, Tensor]  # name -> a device tensor of that buffer's padding values (resets are copies)
    tree_mask: Tensor | None = None  # [max_bs, m, n] bool, device — tree steps only; padding: the padding tree
    tree_verify: bool = True  # the tree is a TARGET_VERIFY tree (else a DRAFT_DECODE step's)
    _views: dict = field(default_factory=dict, repr=False)  # (kind, name, length) -> prefix view

    @classmethod
    def allocate(cls, max_bs: int, tokens_per_request: int, input_specs: Mapping[str, InputSpec],
                 device: torch.device | str, *, seq_len_fill: int = 1,
                 pad_req_index: int = 0, tree_shape: tuple[int, int] | None = None,
                 tree_verify: bool = True) -> "StaticBuffers":
        """``tree_shape`` (m, n): buffers of a tree step (m = ``tokens_per_request``), ``tree_verify`` its kind."""
        device = torch.device(device)
        fill = max(int(seq_len_fill), tokens_per_request)
        tree_mask = None
        if tree_shape is not None:
            m, n = _check_tree_shape(tree_shape, tokens_per_request, tree_verify)
            fill = max(fill, n + 1)  # a padding request keeps a prefix of one token before its n tree keys
            tree_mask = torch.zeros(max_bs, m, n, dtype=torch.bool, device=device)
            tree_mask[:, :, 0] = True  # the padding tree: every query sees key 0 (the root) ...
            if tree_verify:  # ... and, in a verify tree, itself
                tree_mask[:, torch.arange(m), torch.arange(m)] = True
        max_tokens = max_bs * tokens_per_request
        zeros64 = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        padding = {"req_pool_indices": torch.full((max_bs,), pad_req_index, dtype=torch.int64, device=device),
                   "seq_lens": torch.full((max_bs,), fill, dtype=torch.int32, device=device),
                   "out_cache_loc": zeros64, "positions": zeros64}
        padding.update({f"input:{name}": torch.zeros(max_tokens, *spec.shape, dtype=spec.dtype, device=device)
                        for name, spec in input_specs.items()})
        if tree_mask is not None:
            padding["tree_mask"] = tree_mask.clone()
        return cls(
            req_pool_indices=torch.full((max_bs,), pad_req_index, dtype=torch.int64, device=device),
            seq_lens=torch.full((max_bs,), fill, dtype=torch.int32, device=device),
            seq_lens_cpu=torch.full((max_bs,), fill, dtype=torch.int32),
            out_cache_loc=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            inputs={name: torch.zeros(max_tokens, *spec.shape, dtype=spec.dtype, device=device)
                    for name, spec in input_specs.items()},
            tokens_per_request=tokens_per_request, seq_len_fill=fill, pad_req_index=pad_req_index,
            live_rows=bytearray(max_bs), live_tokens=bytearray(max_tokens), padding=padding,
            tree_mask=tree_mask, tree_verify=bool(tree_verify),
        )

    @property
    def max_bs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def tree_shape(self) -> tuple[int, int] | None:
        """(m, n) of the tree step these buffers hold, or None (no tree)."""
        return None if self.tree_mask is None else (self.tree_mask.shape[1], self.tree_mask.shape[2])

    def check_tree(self, batch: ForwardBatch) -> None:
        """``batch`` has a tree exactly when these buffers do, of their shape and kind (DraftTreeError)."""
        shape, tree = self.tree_shape, batch.tree
        if shape is None and tree is None:
            return
        if tree is None or shape is None or tree.shape != shape or tree.verify != self.tree_verify:
            kind = lambda verify: "verify" if verify else "draft-step"  # noqa: E731
            want = "no tree" if shape is None else f"a {kind(self.tree_verify)} tree of shape (m, n) = {shape}"
            got = "no tree" if tree is None else f"a {kind(tree.verify)} tree of shape {tree.shape}"
            raise DraftTreeError(f"batch.tree must be {want} (the captured tree shape), got {got}")

    def head(self, name: str, length: int, *, input: bool = False) -> Tensor:
        """The view ``[:length]`` of the field ``name`` (or, ``input=True``, of the input ``name``), made once
        per length: a slice is a dispatcher call (microseconds of host time), and serving repeats sizes."""
        key = (input, name, length)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = (self.inputs[name] if input else getattr(self, name))[:length]
        return view


def _check_tree_shape(shape: object, queries: int, verify: bool) -> tuple[int, int]:
    if not (isinstance(shape, tuple) and len(shape) == 2 and all(
            type(v) is int and 1 <= v <= MAX_TREE_TOKENS for v in shape)):
        raise DraftTreeError(f"tree_shape must be (m, n), two ints in [1, {MAX_TREE_TOKENS}], got {shape!r}")
    m, n = shape
    if m != queries or (verify and n != m):
        raise DraftTreeError(f"tree_shape must be (m, n) with m = the {queries} queries per request (and n = m for "
                             f"TARGET_VERIFY), got {shape!r}")
    return m, n


def padded_size(n: int, batch_sizes: Sequence[int]) -> int:
    """The smallest captured size >= ``n``; ``ValueError`` when ``n`` exceeds them all."""
    fit = min((b for b in batch_sizes if b >= n), default=None)  # no sort per run
    if fit is not None:
        return fit
    raise ValueError(f"batch_size {n} exceeds the largest captured batch size {max(batch_sizes)} "
                     f"(captured: {sorted(batch_sizes)}); run it eagerly or capture a larger size")


def static_batch(buf: StaticBuffers, bs: int, mode: ForwardMode, *, num_draft_tokens: int = 1,
                 draft_step: int = 0) -> ForwardBatch:
    """A ForwardBatch of ``bs`` requests whose tensors are views of the static buffers (and a tree step's tree:
    a device-only :class:`DraftTree` over ``tree_mask[:bs]``)."""
    q = buf.tokens_per_request
    tree = None if buf.tree_mask is None else DraftTree(mask=buf.tree_mask[:bs], verify=buf.tree_verify)
    if tree is not None:
        num_draft_tokens = q
    return ForwardBatch(
        forward_mode=mode, batch_size=bs, req_pool_indices=buf.req_pool_indices[:bs],
        seq_lens=buf.seq_lens[:bs], seq_lens_cpu=buf.seq_lens_cpu[:bs],
        out_cache_loc=buf.out_cache_loc[: bs * q], positions=buf.positions[: bs * q],
        num_draft_tokens=num_draft_tokens if mode is ForwardMode.TARGET_VERIFY or tree is not None else 0,
        draft_step=draft_step if mode is ForwardMode.DRAFT_DECODE else 0, tree=tree,
    )


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)  # many copies in one dispatcher call


def copy_all(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair: one ``torch._foreach_copy_`` call per dtype when
    available (its multi-tensor fast path, one launch on CUDA, takes lists of one dtype)."""
    if len(pairs) > 1 and _FOREACH_COPY is not None:
        groups: dict = {}
        for dst, src in pairs:
            group = groups.setdefault((dst.dtype, src.dtype), ([], []))
            group[0].append(dst)
            group[1].append(src)
        for dsts, srcs in groups.values():
            _FOREACH_COPY(dsts, srcs)
        return
    for dst, src in pairs:
        dst.copy_(src)


def _stale(marks: bytearray, live: int, padded: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` covering every row of ``[live, padded)`` an earlier run filled (``lo == hi``: none);
    ``marks`` then records this run: ``[:live]`` filled, ``[live:padded]`` padding."""
    lo = marks.find(1, live, padded)
    lo, hi = (lo, marks.rfind(1, live, padded) + 1) if lo >= 0 else (live, live)
    marks[live:padded] = bytes(padded - live)
    marks[:live] = b"\x01" * live
    return lo, hi


def pad_batch(batch: ForwardBatch, buf: StaticBuffers, padded_bs: int, *,
              copies: list | None = None) -> None:
    """Write ``batch``'s rows into the static buffers and reset rows ``n .. padded_bs-1`` to padding
    (only those an earlier call filled: ``buf.live_rows``; copied from ``buf.padding``, so a shrinking
    batch adds no launch to the batched copy). Device->device copies (plus CPU->CPU for ``seq_lens_cpu``):
    no sync. ``copies``: append the ``(dst, src)`` pairs there for the caller's :func:`copy_all` instead
    of copying — ``buf.live_rows`` already counts them as done, so the caller must run them (or restore the
    marks, as ``GraphRunner.prepare`` does when a later check fails)."""
    n, q = batch.batch_size, buf.tokens_per_request
    if not n <= padded_bs <= buf.max_bs:
        raise ValueError(f"padded_bs must be in [{n}, {buf.max_bs}], got {padded_bs}")
    if batch.num_tokens != n * q:
        raise ValueError(f"batch must hold {q} token(s) per request ({n * q}), got {batch.num_tokens}")
    buf.check_tree(batch)
    t = n * q
    pairs = [(buf.head("req_pool_indices", n), batch.req_pool_indices), (buf.head("seq_lens", n), batch.seq_lens),
             (buf.head("out_cache_loc", t), batch.out_cache_loc)]
    if batch.positions is not None:
        pairs.append((buf.head("positions", t), batch.positions))
    else:
        buf.head("positions", t).fill_(0)
    if buf.tree_mask is not None:
        pairs.append((buf.head("tree_mask", n), batch.tree.mask))
    buf.head("seq_lens_cpu", n).copy_(batch.seq_lens_cpu)
    lo, hi = _stale(buf.live_rows, n, padded_bs)
    if hi > lo:
        pad = buf.padding
        pairs += [(buf.req_pool_indices[lo:hi], pad["req_pool_indices"][lo:hi]),
                  (buf.seq_lens[lo:hi], pad["seq_lens"][lo:hi]),
                  (buf.out_cache_loc[lo * q:hi * q], pad["out_cache_loc"][lo * q:hi * q]),
                  (buf.positions[lo * q:hi * q], pad["positions"][lo * q:hi * q])]
        if buf.tree_mask is not None:
            pairs.append((buf.tree_mask[lo:hi], pad["tree_mask"][lo:hi]))
        buf.seq_lens_cpu[lo:hi].fill_(buf.seq_len_fill)
    copy_all(pairs) if copies is None else copies.extend(pairs)


def fill_inputs(inputs: Mapping[str, Tensor], buf: StaticBuffers, num_tokens: int, padded_tokens: int, *,
                copies: list | None = None) -> None:
    """Copy each named input ``[num_tokens, *shape]`` into its static buffer; zero rows up to
    ``padded_tokens`` (only those an earlier call filled: ``buf.live_tokens``; copied from zeros in
    ``buf.padding``). Validates every input
    before writing any. ``copies``: as in :func:`pad_batch`."""
    if not 0 <= num_tokens <= padded_tokens <= len(buf.live_tokens):
        raise ValueError(f"padded_tokens must be in [{num_tokens}, {len(buf.live_tokens)}], got {padded_tokens}")
    if inputs.keys() != buf.inputs.keys():
        raise ValueError(f"inputs must have exactly the keys {sorted(buf.inputs)}; missing "
                         f"{sorted(set(buf.inputs) - set(inputs))}, unexpected {sorted(set(inputs) - set(buf.inputs))}")
    pairs = []
    for name, x in inputs.items():
        dst = buf.inputs[name]
        if not isinstance(x, Tensor):
            raise TypeError(f"inputs[{name!r}] must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != (num_tokens, *dst.shape[1:]):
            raise ValueError(f"inputs[{name!r}] must have shape {(num_tokens, *dst.shape[1:])}, got {tuple(x.shape)}")
        if x.dtype != dst.dtype:
            raise TypeError(f"inputs[{name!r}] must be {dst.dtype}, got {x.dtype}")
        if x.device != dst.device:
            raise ValueError(f"inputs[{name!r}] must be on {dst.device} (a host copy would sync), got {x.device}")
        pairs.append((buf.head(name, num_tokens, input=True), x))
    lo, hi = _stale(buf.live_tokens, num_tokens, padded_tokens)
    if hi > lo:  # zero rows, copied from buf.padding: part of the batched copy
        pairs += [(dst[lo:hi], buf.padding[f"input:{name}"][lo:hi]) for name, dst in buf.inputs.items()]
    copy_all(pairs) if copies is None else copies.extend(pairs)
