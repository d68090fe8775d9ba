"""The per-step plan of the MHA prefill (``chunked_prefix``): index tensors built once, read by every layer.

Request ``b`` of an extend-like step has ``p_b`` cached prefix tokens and ``n_b`` new ones. The prefix
tokens of the whole batch, concatenated request by request, are cut into chunks of at most ``W`` tokens
(the workspace budget; a chunk may hold slices of several requests and may end mid-page), each a
:class:`PrefixChunk`: its pool slot ids (from ``req_to_token``) and the cu_seqlens of the requests it covers.

Plan once per step, run per layer: :func:`build_prefill_plan` turns the step's host lengths into
index tensors (chunk slot ids, cu_seqlens, host maxima) shared by every layer; the backend stores it
on ``metadata.prefill_plan`` (:func:`plan_extend` first chooses the path with ``policy.prefill_cost``). Not
legal inside a CUDA graph (extend steps are never captured). Memory: the workspace
(:class:`PrefillWorkspace`) is ``W`` tokens of latent rows and assembled K, allocated once and reused by
every chunk, layer and step.

Split steps (MIXED): decode rows (``n_b = 1``, ``p_b > 0``; see ``prefill_cost.decode_rows``) run the
absorbed path on a sub-metadata of their own while the other rows run MHA; :class:`RowSplit` holds
the index tensors (built once in the plan) that split ``q`` and scatter the outputs back in batch order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from mla_fa3.checks import check_int
from mla_fa3.metadata import AttentionMetadata
from mla_fa3.policy.paths import AttentionPath
from mla_fa3.policy.prefill_cost import H200_COSTS, PathDecision, choose_path, decode_rows

__all__ = ["PrefixChunk", "RowSplit", "PrefillWorkspace", "PrefillPlan", "build_prefill_plan", "plan_extend"]


@dataclass(frozen=True)
class PrefixChunk:
    """One chunk of the batch's concatenated prefix tokens (at most ``workspace_tokens``)."""

    slot_ids: Tensor  # [num_keys] int64, device — pool slots of the chunk's prefix tokens, request order
    cu_seqlens_q: Tensor  # [k+1] int32, device — q rows of requests req_lo..req_hi-1, from 0
    cu_seqlens_k: Tensor  # [k+1] int32, device — the chunk's keys per request (0 for a request without)
    req_lo: int  # host: first MHA request of the chunk (index among the plan's MHA requests)
    req_hi: int  # host: one past the last
    q_lo: int  # host: first row of the chunk's queries among the MHA rows
    q_hi: int  # host: one past the last
    num_keys: int  # host: tokens of the chunk
    max_seqlen_q: int  # host
    max_seqlen_k: int  # host


@dataclass(frozen=True)
class RowSplit:
    """The rows of a split step: MHA rows and absorbed decode rows, with their batch positions."""

    num_tokens: int  # T: rows of the whole step
    mha_tokens: Tensor  # [T_mha] int64, device — batch rows of the MHA requests' tokens
    absorbed_tokens: Tensor  # [T_abs] int64, device — batch rows of the decode rows (one token each)
    mha_requests: Tensor  # [n_mha] int64, cpu — request indices taking MHA
    absorbed_requests: Tensor  # [n_abs] int64, cpu — request indices taking the absorbed path
    absorbed_metadata: object  # AttentionMetadata of the absorbed requests only (for absorb.forward_absorbed)

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, ...] -> (x of the MHA rows, x of the absorbed rows), in batch order within each."""
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"x must have the step's {self.num_tokens} rows, got {tuple(x.shape)}")
        return x.index_select(0, self.mha_tokens), x.index_select(0, self.absorbed_tokens)

    def merge(self, o_mha: Tensor, o_absorbed: Tensor) -> Tensor:
        """Scatter both paths' outputs back to [T, ...] in batch order."""
        out = o_mha.new_empty(self.num_tokens, *o_mha.shape[1:])
        out.index_copy_(0, self.mha_tokens, o_mha)
        out.index_copy_(0, self.absorbed_tokens, o_absorbed.to(o_mha.dtype))
        return out


class PrefillWorkspace:
    """Chunk buffers of ``workspace_tokens`` rows, allocated at first use, reused across layers and steps."""

    def __init__(self, workspace_tokens: int):
        self.workspace_tokens = workspace_tokens
        self._buffers: dict[str, Tensor] = {}

    def buffer(self, name: str, tail: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """The ``[workspace_tokens, *tail]`` buffer ``name`` (re-allocated only if its shape/dtype/device change)."""
        buf = self._buffers.get(name)
        shape = (self.workspace_tokens, *tail)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
            self._buffers.pop(name, None)
            buf = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @staticmethod
    def bytes_per_token(num_heads: int, dims, element_size: int = 2) -> int:
        """Device bytes per workspace token: latent row and assembled K (held), K_nope and V (per chunk)."""
        d_qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        per_head = d_qk + dims.qk_nope_head_dim + dims.v_head_dim
        return element_size * (dims.kv_lora_rank + dims.qk_rope_head_dim + num_heads * per_head)


@dataclass
class PrefillPlan:
    """Everything the MHA prefill of one step needs, built once (host ints from CPU copies)."""

    path: AttentionPath  # MHA_ONESHOT (no prefix among the MHA rows) or MHA_CHUNKED
    page_size: int
    workspace_tokens: int  # W: prefix tokens per chunk, across the whole batch
    num_tokens: int  # T: rows of the whole step (MHA + absorbed decode rows)
    num_mha_tokens: int  # rows taking the MHA path
    cu_seqlens_q: Tensor  # [n_mha+1] int32, device — MHA rows per request (also the new tokens' keys)
    max_seqlen_q: int  # host: longest extend among the MHA requests
    new_slot_ids: Tensor  # [num_mha_tokens] int64, device — pool slots of the MHA rows' new tokens
    prefix_slot_ids: Tensor  # [P] int64, device — pool slots of every MHA request's prefix, request order
    chunks: tuple[PrefixChunk, ...]  # the prefix in chunks of <= W tokens (empty for MHA_ONESHOT)
    split: RowSplit | None  # decode rows taking the absorbed path (None: every row is MHA)
    workspace: PrefillWorkspace
    prefix_lens_cpu: Tensor  # [n_mha] int32, cpu — of the MHA requests
    extend_lens_cpu: Tensor  # [n_mha] int32, cpu


# ---------------------------------------------------------------------------------------------------
# plan




def _check_plan_inputs(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, seq_lens_cpu):
    page_size = check_int(page_size, "page_size", 1)
    if check_int(workspace_tokens, "workspace_tokens", 1) < page_size:
        raise ValueError(f"workspace_tokens must be at least one page ({page_size} tokens), got {workspace_tokens}")
    if getattr(metadata, "page_size", page_size) != page_size:
        raise ValueError(f"page_size {page_size} differs from metadata.page_size {metadata.page_size}")
    prefix, extend = getattr(metadata, "prefix_lens_cpu", None), getattr(metadata, "extend_lens_cpu", None)
    if not isinstance(prefix, Tensor) or not isinstance(extend, Tensor):
        raise ValueError("metadata must be an extend-like step's metadata with prefix_lens_cpu and extend_lens_cpu")
    bs = metadata.batch_size
    for t, name in ((prefix, "metadata.prefix_lens_cpu"), (extend, "metadata.extend_lens_cpu")):
        if t.device.type != "cpu" or t.dim() != 1 or t.shape[0] != bs or t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a [{bs}] integer CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not isinstance(req_to_token, Tensor) or req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise TypeError("req_to_token must be a 2-D int32 tensor [rows, max_context]")
    if not isinstance(req_pool_indices, Tensor) or req_pool_indices.dtype != torch.int64 \
            or tuple(req_pool_indices.shape) != (bs,):
        raise TypeError(f"req_pool_indices must be a [{bs}] int64 tensor")
    if req_pool_indices.device != req_to_token.device:
        raise ValueError(f"req_pool_indices is on {req_pool_indices.device}, req_to_token on {req_to_token.device}")
    if bs == 0:
        return
    if int(prefix.min()) < 0 or int(extend.min()) < 0:
        raise ValueError(f"prefix_lens / extend_lens must be >= 0, got {prefix.tolist()} / {extend.tolist()}")
    total = prefix.long() + extend.long()
    if int((total + _first_columns(metadata)).max()) > req_to_token.shape[1]:
        raise ValueError(f"prefix_lens: prefix + new tokens {total.tolist()} exceed what req_to_token holds "
                         f"(max_context {req_to_token.shape[1]}, encoder columns included)")
    seq = seq_lens_cpu if seq_lens_cpu is not None else getattr(metadata, "cache_seqlens_cpu", None)
    if seq is not None and not torch.equal(total, seq.long()):
        raise ValueError(f"prefix_lens disagree with seq_lens: prefix + new = {total.tolist()}, "
                         f"seq_lens = {seq.tolist()}")
    if seq is None and int(total.max()) > metadata.max_seqlen_k:
        raise ValueError(f"prefix_lens: prefix + new = {total.tolist()} exceed metadata.max_seqlen_k "
                         f"{metadata.max_seqlen_k}")


def _first_columns(metadata) -> Tensor:
    """[bs] int64 cpu: the first decoder column of each row (past an encoder region, else 0)."""
    enc = getattr(metadata, "encoder", None)
    if enc is None:
        return torch.zeros(metadata.batch_size, dtype=torch.int64)
    p = metadata.page_size
    return (enc.encoder_lens_cpu.long() + p - 1) // p * p


def _ranges(starts: Tensor, lens: Tensor) -> Tensor:
    """Concatenation of arange(starts[i], starts[i] + lens[i]) (int64, cpu)."""
    lens = lens.long()
    first = torch.cumsum(lens, 0) - lens
    idx = torch.arange(int(lens.sum()), dtype=torch.int64)
    return idx - torch.repeat_interleave(first, lens) + torch.repeat_interleave(starts.long(), lens)


def _chunk_layout(prefix: list[int], W: int) -> list[tuple]:
    """Host layout of each chunk: (start, end, req_lo, req_hi, keys per request of the range)."""
    off = [0]
    for p in prefix:
        off.append(off[-1] + p)
    out, b = [], 0
    for s in range(0, off[-1], W):
        e = min(off[-1], s + W)
        while off[b + 1] <= s:  # skip requests whose prefix ends before the chunk (and empty ones)
            b += 1
        keys, c = [], b
        while c < len(prefix) and off[c] < e:
            keys.append(max(0, min(e, off[c + 1]) - max(s, off[c])))
            c += 1
        while keys and keys[-1] == 0:
            keys.pop()
        out.append((s, e, b, b + len(keys), keys))
    return out


def _absorbed_metadata(metadata, rows: Tensor):
    """The metadata restricted to requests ``rows`` (cpu int64): decode rows, one query each."""
    dev_rows = rows.to(metadata.cache_seqlens.device)
    seq_cpu = (metadata.prefix_lens_cpu + metadata.extend_lens_cpu)[rows].to(torch.int32)
    n = rows.shape[0]
    pages = -(-int(seq_cpu.max()) // metadata.page_size)
    cu_k = torch.zeros(n + 1, dtype=torch.int32)
    torch.cumsum(seq_cpu, 0, out=cu_k[1:])
    small = torch.cat([torch.arange(n + 1, dtype=torch.int32), cu_k]).to(dev_rows.device)
    sub = lambda t: None if t is None else t.index_select(0, dev_rows if t.device == dev_rows.device else rows)
    return dataclasses.replace(
        metadata, batch_size=n, cache_seqlens=sub(metadata.cache_seqlens), cu_seqlens_q=small[: n + 1],
        cu_seqlens_k=small[n + 1:], max_seqlen_q=1, max_seqlen_k=int(seq_cpu.max()),
        page_table=sub(metadata.page_table)[:, :pages], cache_seqlens_cpu=seq_cpu,
        prefix_lens=sub(metadata.prefix_lens), prefix_lens_cpu=metadata.prefix_lens_cpu[rows],
        extend_lens_cpu=metadata.extend_lens_cpu[rows], local=None, encoder=None)


def build_prefill_plan(metadata, req_to_token: Tensor, req_pool_indices: Tensor, workspace_tokens: int,
                       page_size: int, *, split_decode_rows: bool = True, workspace: PrefillWorkspace | None = None,
                       seq_lens_cpu: Tensor | None = None, debug_checks: bool = False) -> PrefillPlan:
    """The MHA prefill plan of one extend-like step (EXTEND / MIXED / DRAFT_EXTEND); shared by all layers.

    req_to_token ``[rows, max_context]`` int32 (slot ids), req_pool_indices ``[bs]`` int64 (the batch's
    rows), both on the compute device. workspace_tokens: prefix tokens decompressed per chunk across the
    batch (>= one page). split_decode_rows: decode rows (n = 1 over a prefix) take the absorbed path.
    workspace: a :class:`PrefillWorkspace` of the same size to reuse (else a new one). Host values come
    from ``metadata.prefix_lens_cpu`` / ``extend_lens_cpu`` / ``cache_seqlens_cpu`` (or ``seq_lens_cpu``);
    the device work is two host->device copies (int64 indices, int32 cu_seqlens) and two gathers,
    no device->host sync. With CPU tensors or ``debug_checks`` the gathered slots are checked against
    the padding page (a prefix longer than what the request's row holds).
    """
    _check_plan_inputs(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, seq_lens_cpu)
    if workspace is None:
        workspace = PrefillWorkspace(workspace_tokens)
    elif not isinstance(workspace, PrefillWorkspace) or workspace.workspace_tokens != workspace_tokens:
        raise ValueError(f"workspace must be a PrefillWorkspace of {workspace_tokens} tokens")
    prefix_all, extend_all = metadata.prefix_lens_cpu.long(), metadata.extend_lens_cpu.long()
    bs, device = metadata.batch_size, req_to_token.device
    dec = decode_rows(prefix_all.tolist(), extend_all.tolist()) if split_decode_rows else [False] * bs
    is_dec = torch.tensor(dec, dtype=torch.bool)
    mha_req = torch.nonzero(~is_dec).flatten()
    if mha_req.numel() == 0 or int(extend_all[mha_req].sum()) == 0:
        raise ValueError("metadata: no row needs the MHA path (every row is a decode row or empty); "
                         "run the absorbed path instead")
    prefix, extend = prefix_all[mha_req], extend_all[mha_req]
    tok_start = torch.cumsum(extend_all, 0) - extend_all
    P, N, T = int(prefix.sum()), int(extend.sum()), int(extend_all.sum())
    split = None
    abs_req = torch.nonzero(is_dec).flatten()
    # one host->device copy of every int64 index: prefix (request, column), new (request, column), rows
    col0 = _first_columns(metadata)[mha_req]
    idx = torch.cat([torch.repeat_interleave(mha_req, prefix), _ranges(col0, prefix),
                     torch.repeat_interleave(mha_req, extend), _ranges(col0 + prefix, extend),
                     _ranges(tok_start[mha_req], extend), _ranges(tok_start[abs_req], extend_all[abs_req])])
    idx = idx.to(device)
    pr, pc, nr, nc, mha_tok, abs_tok = idx.split([P, P, N, N, N, T - N])
    prefix_slots = req_to_token[req_pool_indices[pr], pc].long()
    new_slots = req_to_token[req_pool_indices[nr], nc].long()
    if debug_checks or device.type == "cpu":  # reads device values: only on CPU or when asked
        for slots, what in ((prefix_slots, "prefix"), (new_slots, "new tokens")):
            if slots.numel() and int(slots.min()) < page_size:
                raise ValueError(f"prefix_lens: req_to_token holds a padding-page slot (< {page_size}) among "
                                 f"the {what} of a request: the lengths exceed what the pool holds for it")
    if abs_req.numel():
        split = RowSplit(num_tokens=T, mha_tokens=mha_tok, absorbed_tokens=abs_tok, mha_requests=mha_req,
                         absorbed_requests=abs_req, absorbed_metadata=_absorbed_metadata(metadata, abs_req))
    # one host->device copy of every int32 cu_seqlens: the MHA rows', then each chunk's (q, k)
    ext_l, pre_l = extend.tolist(), prefix.tolist()
    cq = [0]
    for n in ext_l:
        cq.append(cq[-1] + n)
    layout = _chunk_layout(pre_l, workspace_tokens)
    ints = list(cq)
    for _, _, lo, hi, keys in layout:
        ints += [cq[b] - cq[lo] for b in range(lo, hi + 1)]
        ck = [0]
        for k in keys:
            ck.append(ck[-1] + k)
        ints += ck
    cu = torch.tensor(ints, dtype=torch.int32).to(device)
    pos, chunks = len(cq), []
    for s, e, lo, hi, keys in layout:
        k = hi - lo + 1
        chunks.append(PrefixChunk(
            slot_ids=prefix_slots[s:e], cu_seqlens_q=cu[pos: pos + k], cu_seqlens_k=cu[pos + k: pos + 2 * k],
            req_lo=lo, req_hi=hi, q_lo=cq[lo], q_hi=cq[hi], num_keys=e - s,
            max_seqlen_q=max(ext_l[lo:hi]), max_seqlen_k=max(keys)))
        pos += 2 * k
    return PrefillPlan(
        path=AttentionPath.MHA_CHUNKED if P else AttentionPath.MHA_ONESHOT, page_size=page_size,
        workspace_tokens=workspace_tokens, num_tokens=T, num_mha_tokens=N, cu_seqlens_q=cu[: len(cq)],
        max_seqlen_q=max(ext_l), new_slot_ids=new_slots, prefix_slot_ids=prefix_slots, chunks=tuple(chunks),
        split=split, workspace=workspace, prefix_lens_cpu=prefix.to(torch.int32),
        extend_lens_cpu=extend.to(torch.int32))


def plan_extend(metadata, req_to_token: Tensor, req_pool_indices: Tensor, *, num_heads: int, dims,
                workspace_tokens: int, page_size: int, prefill_path: str = "auto", constants=H200_COSTS,
                workspace: PrefillWorkspace | None = None) -> tuple[PathDecision, PrefillPlan | None]:
    """Once per extend-like step: choose the path from host lengths and, for an MHA path, build its plan.

    Returns ``(decision, plan)``; ``plan`` is None when the decision is ABSORBED (store it on
    ``metadata.prefill_plan`` either way, and ``decision`` on the backend's explain record).
    """
    _check_plan_inputs(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, None)
    decision = choose_path(metadata.prefix_lens_cpu, metadata.extend_lens_cpu, num_heads=num_heads, dims=dims,
                           workspace_tokens=workspace_tokens, prefill_path=prefill_path, constants=constants)
    if not decision.path.is_mha_prefill:
        return decision, None
    return decision, build_prefill_plan(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size,
                                        workspace=workspace)
