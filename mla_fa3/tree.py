"""Speculative draft trees: which draft tokens each query row of a tree step sees (EAGLE with topk > 1).

A tree step of request ``b`` has ``m`` query rows and ``n`` *tree keys*: the last ``n`` tokens of its
``req_to_token`` row, columns ``P_b .. P_b + n - 1`` with ``P_b = seq_lens[b] - n`` the *prefix* (the
request's committed tokens, ``>= 1``). Every query row attends to

    the whole prefix (keys 0 .. P_b - 1, no causal mask)  +  the tree keys j with mask[b, i, j]

The two parts are computed apart and merged by their LSEs (``mla_fa3.absorb_tree``).

- TARGET_VERIFY: ``m = n = k = num_draft_tokens``; the tree keys are the step's k new tokens in
  ``out_cache_loc`` order, token 0 the root (the last verified token). ``mask[b, i, j]`` is True iff
  token j is token i or one of its ancestors. Worked example, parents ``[-1, 0, 0, 1]``:

        token:    0  1  2  3           a chain (parents [-1, 0, 1, 2]) is the lower triangle:
        mask 0 = [1, 0, 0, 0]          the causal verify of today, bit for bit the same keys
        mask 1 = [1, 1, 0, 0]
        mask 2 = [1, 0, 1, 0]
        mask 3 = [1, 1, 0, 1]

  Checked (:func:`check_verify_mask`, :class:`DraftTreeError` naming the request and token): every token
  sees itself and the root, no token sees a later one (parents precede children, as SGLang's EAGLE orders
  them), and each token sees exactly its parent's keys plus itself (the nearest earlier key it sees).
- DRAFT_DECODE (step ``i`` of a multi-step draft with ``topk`` branches): ``m = topk`` queries (this
  step's tokens), ``n`` tree keys (the draft tokens drafted so far, wherever the engine laid them out in
  the last ``n`` columns of the row; future ones may be there already, masked out); every query must see
  at least one key (its own token, written this step). :func:`sglang_draft_mask` builds SGLang's layout.

SGLang's FULL_MASK ``custom_mask`` (flat; request b's block is ``k x (S_b + k)`` row-major, ``S_b`` the
prefix, the prefix columns all True) converts with :meth:`DraftTree.from_sglang_custom_mask`.

Host values: the constructors build a CPU copy (``mask_cpu``) and check it once; a tree given as a device
tensor alone (``DraftTree(mask=..., mask_cpu=None)``) is checked for shape and dtype only (reading it
would sync) — the metadata builder checks its values on CPU tensors and under ``debug_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch
from torch import Tensor

__all__ = ["DraftTree", "DraftTreeError", "check_verify_mask", "check_draft_mask", "sglang_draft_mask",
           "mask_from_parents", "check_tree_fits", "tree_positions", "MAX_TREE_TOKENS", "TreeMetadata", "tree_key_slots",
           "check_tree_step"]

MAX_TREE_TOKENS = 64  # tree keys / queries per request a tree step may have (the tree part is dense)

ArrayLike = Union[Sequence, np.ndarray, Tensor]


class DraftTreeError(ValueError):
    """A draft tree that is not a tree, or does not fit its step (shapes, sizes, a token's visibility)."""


def _host_bool3(mask: ArrayLike, name: str) -> np.ndarray:
    if isinstance(mask, Tensor):
        if mask.device.type != "cpu":
            raise DraftTreeError(f"{name} must be a CPU tensor or a nested list here (reading a device tensor "
                                 f"would sync), got a tensor on {mask.device}")
        if mask.dtype != torch.bool:
            raise DraftTreeError(f"{name} must be bool, got {mask.dtype}")
        arr = mask.numpy()
    else:
        arr = np.asarray(mask)
        if arr.dtype != np.bool_:
            raise DraftTreeError(f"{name} must hold bools, got {arr.dtype}")
    if arr.ndim != 3:
        raise DraftTreeError(f"{name} must be [bs, m, n], got shape {tuple(arr.shape)}")
    return arr


def mask_from_parents(parents: ArrayLike) -> np.ndarray:
    """[bs, k, k] bool ancestors-or-self mask from a parent array [bs, k] (``parents[b, 0] = -1``, the root;
    ``0 <= parents[b, i] < i`` else). Raises DraftTreeError naming the first bad entry."""
    if isinstance(parents, Tensor):
        if parents.device.type != "cpu":
            raise DraftTreeError(f"parents must be a CPU tensor or a nested list, got a tensor on {parents.device}")
        if parents.dtype.is_floating_point or parents.dtype == torch.bool:
            raise DraftTreeError(f"parents must hold ints, got {parents.dtype}")
        par = parents.numpy().astype(np.int64)
    else:
        par = np.asarray(parents)
        if par.dtype.kind not in "iu":
            raise DraftTreeError(f"parents must hold ints, got {par.dtype}")
        par = par.astype(np.int64)
    if par.ndim != 2 or par.shape[1] < 1:
        raise DraftTreeError(f"parents must be [bs, k] with k >= 1, got shape {tuple(par.shape)}")
    bs, k = par.shape
    if k > MAX_TREE_TOKENS:
        raise DraftTreeError(f"parents has k = {k} tokens per request, over MAX_TREE_TOKENS = {MAX_TREE_TOKENS}")
    for b in range(bs):
        if par[b, 0] != -1:
            raise DraftTreeError(f"parents[{b}, 0] must be -1 (token 0 is the root), got {par[b, 0]}")
        bad = np.nonzero((par[b, 1:] < 0) | (par[b, 1:] >= np.arange(1, k)))[0]
        if bad.size:
            i = int(bad[0]) + 1
            raise DraftTreeError(f"parents[{b}, {i}] = {par[b, i]} is out of range: a parent must be an earlier "
                                 f"token, in [0, {i})")
    mask = np.zeros((bs, k, k), dtype=np.bool_)
    idx = np.arange(k)
    mask[:, idx, idx] = True
    for i in range(1, k):  # parents precede children: row i = row parent(i) + itself
        mask[np.arange(bs), i] |= mask[np.arange(bs), par[:, i]]
    return mask


def check_verify_mask(mask: np.ndarray, name: str = "tree.mask") -> None:
    """A TARGET_VERIFY tree mask [bs, k, k] (host NumPy bool): raise DraftTreeError unless it is a tree."""
    bs, m, n = mask.shape
    if m != n:
        raise DraftTreeError(f"{name} of a verify tree must be square [bs, k, k], got {tuple(mask.shape)}")
    idx = np.arange(n)
    diag = mask[:, idx, idx]
    if not diag.all():
        b, i = map(int, np.argwhere(~diag)[0])
        raise DraftTreeError(f"{name}[{b}, {i}, {i}] is False: draft token {i} of request {b} must see itself")
    later = np.triu(np.ones((n, n), dtype=np.bool_), 1)
    if (mask & later).any():
        b, i, j = map(int, np.argwhere(mask & later)[0])
        raise DraftTreeError(f"{name}[{b}, {i}, {j}] is True: draft token {i} of request {b} sees the later token "
                             f"{j} (parents must precede their children)")
    if not mask[:, :, 0].all():
        b, i = map(int, np.argwhere(~mask[:, :, 0])[0])
        raise DraftTreeError(f"{name}[{b}, {i}, 0] is False: draft token {i} of request {b} must see the root "
                             "(token 0)")
    # parent(i) = the nearest earlier token i sees; row i must be row parent(i) plus token i itself
    strict = mask & np.tril(np.ones((n, n), dtype=np.bool_), -1)
    parent = (n - 1) - np.argmax(strict[:, :, ::-1], axis=2)  # [bs, n]; row 0 has none (unused)
    want = np.take_along_axis(mask, parent[:, :, None], axis=1) | np.eye(n, dtype=np.bool_)[None]
    bad = (want != mask).any(axis=2)
    bad[:, 0] = False
    if bad.any():
        b, i = map(int, np.argwhere(bad)[0])
        raise DraftTreeError(f"{name}[{b}, {i}] = {mask[b, i].astype(int).tolist()} is not a path from the root: "
                             f"token {i} of request {b} must see exactly its parent {int(parent[b, i])}'s tokens and "
                             "itself")


def check_draft_mask(mask: np.ndarray, name: str = "tree.mask") -> None:
    """A DRAFT_DECODE tree mask [bs, m, n]: every query sees at least one tree key (its own token)."""
    seen = mask.any(axis=2)
    if not seen.all():
        b, i = map(int, np.argwhere(~seen)[0])
        raise DraftTreeError(f"{name}[{b}, {i}] sees no tree key: draft query {i} of request {b} must see at least "
                             "its own token")


def sglang_draft_mask(batch_size: int, topk: int, num_steps: int, step: int) -> np.ndarray:
    """SGLang's multi-step draft layout: tree keys branch-major ``[topk, num_steps]`` (key ``j * num_steps + s``
    is branch j's token of step s); at ``step`` branch j sees its own tokens of steps ``0 .. step``.
    Returns [bs, topk, topk * num_steps] bool."""
    for value, name, lo in ((batch_size, "batch_size", 0), (topk, "topk", 1), (num_steps, "num_steps", 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise DraftTreeError(f"{name} must be an int >= {lo}, got {value!r}")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < num_steps:
        raise DraftTreeError(f"step must be an int in [0, {num_steps}), got {step!r}")
    one = np.zeros((topk, topk, num_steps), dtype=np.bool_)
    one[np.arange(topk), np.arange(topk), : step + 1] = True
    return np.broadcast_to(one.reshape(topk, topk * num_steps), (batch_size, topk, topk * num_steps)).copy()


@dataclass(frozen=True)
class DraftTree:
    """The tree of one step: ``mask[b, i, j]`` — query row i of request b sees tree key j (see the module doc).

    Build it with :meth:`from_parents`, :meth:`from_mask`, :meth:`from_sglang_custom_mask` or
    :meth:`draft`; the batch checks it against its mode (``ForwardBatch.check``)."""

    mask: Tensor  # [bs, m, n] bool, device
    mask_cpu: Tensor | None = None  # [bs, m, n] bool, cpu — host copy, checked at construction (None: device only)
    verify: bool = True  # True: a TARGET_VERIFY tree (square, checked as a tree); False: a DRAFT_DECODE step's

    def __post_init__(self) -> None:
        for name, t in (("mask", self.mask), ("mask_cpu", self.mask_cpu)):
            if t is None and name == "mask_cpu":
                continue
            if not isinstance(t, Tensor):
                raise DraftTreeError(f"tree.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.bool or t.dim() != 3:
                raise DraftTreeError(f"tree.{name} must be a [bs, m, n] bool tensor, got {t.dtype} {tuple(t.shape)}")
        m, n = self.mask.shape[1:]
        if not (1 <= m <= MAX_TREE_TOKENS and 1 <= n <= MAX_TREE_TOKENS):
            raise DraftTreeError(f"tree.mask must have 1..{MAX_TREE_TOKENS} queries and keys per request, got "
                                 f"{tuple(self.mask.shape)}")
        if self.verify and m != n:
            raise DraftTreeError(f"tree.mask of a verify tree must be [bs, k, k], got {tuple(self.mask.shape)}")
        if self.mask_cpu is not None:
            if self.mask_cpu.device.type != "cpu" or self.mask_cpu.shape != self.mask.shape:
                raise DraftTreeError(f"tree.mask_cpu must be a CPU copy of tree.mask {tuple(self.mask.shape)}, got "
                                     f"{tuple(self.mask_cpu.shape)} on {self.mask_cpu.device}")
            self.check_values(self.mask_cpu)

    def check_values(self, host: Tensor) -> None:
        """The value checks of this kind of tree on a host copy (DraftTreeError)."""
        arr = host.numpy()
        (check_verify_mask if self.verify else check_draft_mask)(arr)

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def num_queries(self) -> int:
        """m: query rows per request."""
        return self.mask.shape[1]

    @property
    def num_keys(self) -> int:
        """n: tree keys per request (the last n tokens of its row)."""
        return self.mask.shape[2]

    @property
    def shape(self) -> tuple[int, int]:
        """(m, n): what a CUDA graph of a tree step is captured for."""
        return self.mask.shape[1], self.mask.shape[2]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_parents(cls, parents: ArrayLike, device: torch.device | str) -> "DraftTree":
        """A verify tree from its parent array [bs, k] (host ints: list, NumPy or CPU tensor)."""
        return cls._host(mask_from_parents(parents), device, verify=True)

    @classmethod
    def from_mask(cls, mask: ArrayLike, device: torch.device | str, *, verify: bool = True) -> "DraftTree":
        """A tree from its host bool mask [bs, m, n] (verify: [bs, k, k], checked as a tree)."""
        return cls._host(_host_bool3(mask, "mask"), device, verify=verify)

    @classmethod
    def draft(cls, mask: ArrayLike, device: torch.device | str) -> "DraftTree":
        """A DRAFT_DECODE step's tree from its host bool mask [bs, topk, n] (e.g. :func:`sglang_draft_mask`)."""
        return cls._host(_host_bool3(mask, "mask"), device, verify=False)

    @classmethod
    def from_sglang_custom_mask(cls, custom_mask: ArrayLike, prefix_lens: Sequence[int], num_draft_tokens: int,
                                device: torch.device | str) -> "DraftTree":
        """A verify tree from SGLang's FULL_MASK ``spec_info.custom_mask`` (host copy, flat bool): request b's
        block is ``k x (S_b + k)`` row-major, ``S_b = prefix_lens[b]`` (SGLang's verify ``seq_lens``, which
        exclude the draft tokens); its last k columns are the tree. Its prefix columns must all be True."""
        flat = custom_mask.numpy() if isinstance(custom_mask, Tensor) else np.asarray(custom_mask)
        if isinstance(custom_mask, Tensor) and custom_mask.device.type != "cpu":
            raise DraftTreeError("custom_mask must be a CPU copy (reading a device tensor would sync)")
        k, pre = int(num_draft_tokens), [int(s) for s in prefix_lens]
        if flat.ndim != 1 or flat.dtype != np.bool_:
            raise DraftTreeError(f"custom_mask must be a flat bool array, got {flat.dtype} {tuple(flat.shape)}")
        need = sum(k * (s + k) for s in pre)
        if flat.shape[0] < need:
            raise DraftTreeError(f"custom_mask holds {flat.shape[0]} entries, fewer than sum_b k * (S_b + k) = {need}")
        out, at = np.zeros((len(pre), k, k), dtype=np.bool_), 0
        for b, s in enumerate(pre):
            block = flat[at: at + k * (s + k)].reshape(k, s + k)
            if not block[:, :s].all():
                raise DraftTreeError(f"custom_mask of request {b} hides part of its prefix: a draft tree sees every "
                                     "prefix token")
            out[b] = block[:, s:]
            at += k * (s + k)
        return cls._host(out, device, verify=True)

    @classmethod
    def _host(cls, mask: np.ndarray, device: torch.device | str, *, verify: bool) -> "DraftTree":
        host = torch.from_numpy(np.ascontiguousarray(mask))
        dev = host.to(device=torch.device(device), non_blocking=True)
        return cls(mask=dev, mask_cpu=host, verify=verify)


def check_tree_fits(tree: object, *, verify: bool, batch_size: int, queries: int, seq_lens: Tensor,
                    seq_lens_cpu: Tensor) -> None:
    """A batch's tree fits its step (``ForwardBatch.check``; host values only — the mask's own values were
    checked when it was built): its kind, one tree per request, the device, ``queries`` per request, and a
    prefix of >= 1 token before the n tree keys of every request."""
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if tree.verify != verify:
        raise DraftTreeError(f"tree was built as a {'verify' if tree.verify else 'draft-step'} tree for a "
                             f"{'TARGET_VERIFY' if verify else 'DRAFT_DECODE'} batch (DraftTree.from_parents / "
                             "from_mask for verify, DraftTree.draft for a draft step)")
    if tree.batch_size != batch_size:
        raise DraftTreeError(f"tree.mask must have one tree per request ({batch_size}), got {tree.batch_size}")
    if tree.mask.device != seq_lens.device:
        raise DraftTreeError(f"tree.mask must be on {seq_lens.device}, got {tree.mask.device}")
    if tree.num_queries != queries:
        raise DraftTreeError(f"tree.mask has {tree.num_queries} queries per request, the batch {queries} "
                             "(num_draft_tokens)")
    if batch_size and int(seq_lens_cpu.min()) < tree.num_keys + 1:
        raise DraftTreeError(f"seq_lens must be >= the {tree.num_keys} tree keys + a prefix of >= 1 token per "
                             f"request, got {seq_lens_cpu.tolist()}")


def tree_positions(seq_lens_cpu: Tensor, tree: DraftTree) -> Tensor | None:
    """Positions of a tree step's queries, [bs * m] int64 CPU: ``prefix + depth`` with depth = the tree keys
    the query sees - 1 (from the host copy of the mask; None without one, or for a misfit the batch names)."""
    if not isinstance(tree, DraftTree) or tree.mask_cpu is None or tree.batch_size != seq_lens_cpu.shape[0]:
        return None
    depth = tree.mask_cpu.sum(dim=2).to(torch.int64) - 1  # [bs, m]
    return ((seq_lens_cpu.to(torch.int64) - tree.num_keys).unsqueeze(1) + depth).reshape(-1)


@dataclass
class TreeMetadata:
    """What the tree part of a tree step reads (``AttentionMetadata.tree``; built by the metadata builder, or views
    of CUDA-graph buffers). The prefix part reads the step metadata itself, whose ``cache_seqlens`` are the
    prefixes ``seq_lens - n`` and whose ``max_seqlen_q`` is m."""

    num_queries: int  # m, host
    num_keys: int  # n, host
    mask: Tensor  # [bs, m, n] bool, device
    key_slots: Tensor  # [bs, n] int64, device — pool slot of tree key j: req_to_token[row_b, prefix_b + j]
    #   (or req_to_token[row_b, tree_key_columns[b, j]] where the batch places its keys)


def tree_key_slots(req_to_token: Tensor, rows: Tensor, prefix_lens: Tensor, num_keys: int, *,
                   out: Tensor | None = None, columns: Tensor | None = None) -> Tensor:
    """[bs, n] int64 slots of each request's tree keys, ``req_to_token[rows[b], prefix_lens[b] + j]``, or
    ``req_to_token[rows[b], columns[b, j]]`` (``ForwardBatch.tree_key_columns``) — device index ops, no host read;
    columns clamped into the table (the batch checks lengths on the host; a CUDA-graph padding row reads in
    bounds)."""
    if columns is None:
        cols = prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(num_keys, device=prefix_lens.device)
    else:
        cols = columns.to(device=req_to_token.device, dtype=torch.int64).clamp(min=0)  # a new tensor: clamped below
    cols = cols.clamp_(max=req_to_token.shape[1] - 1)
    slots = req_to_token[rows.to(torch.int64).unsqueeze(1), cols].to(torch.int64)
    if out is None:
        return slots
    return out.copy_(slots)


def check_tree_step(tree: DraftTree, req_to_token: Tensor, rows: Tensor | None, seq_lens_cpu: Tensor,
                    out_cache_loc: Tensor, *, has_encoder: bool, check_values: bool, reread: bool,
                    key_columns: Tensor | None = None) -> None:
    """The metadata builder's checks of a tree step (DraftTreeError): no encoder; where host values may be read
    (``check_values``: CPU tensors or debug_checks; ``reread``: compare the device mask, not its CPU copy) the
    mask's values, and for a draft step every new token among its request's tree keys, seen by its own query."""
    if has_encoder:
        raise DraftTreeError("a tree step has no cross-attention form: batch.encoder_lens must be None")
    if not check_values:
        return
    mask_cpu = tree.mask.cpu() if tree.mask_cpu is None or reread else tree.mask_cpu
    tree.check_values(mask_cpu)
    if tree.verify or rows is None:
        return
    bs, m, n = mask_cpu.shape
    prefix = (seq_lens_cpu.to(torch.int64) - n).to(req_to_token.device)
    keys = tree_key_slots(req_to_token, rows.to(req_to_token.device), prefix, n, columns=key_columns).cpu()
    loc = out_cache_loc.cpu().view(bs, m)
    for b in range(bs):
        if int(seq_lens_cpu[b]) == n + 1 and not bool(loc[b].any()):
            continue  # a CUDA-graph padding request: writes and reads the padding slot only
        for i in range(m):
            hit = (keys[b] == loc[b, i]).nonzero()
            if hit.numel() == 0:
                raise DraftTreeError(f"out_cache_loc[{b * m + i}] = {int(loc[b, i])} is not one of request {b}'s tree "
                                     f"keys (the last {n} slots of its row, or its tree_key_columns): a draft "
                                     "token's slot must be a tree key")
            if not bool(mask_cpu[b, i, int(hit[0])]):
                raise DraftTreeError(f"tree.mask[{b}, {i}, {int(hit[0])}] is False: draft query {i} of request {b} "
                                     "must see its own token")
