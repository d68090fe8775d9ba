"""The per-step plan of the MHA prefill (``chunked_prefix``): index tensors built once, read by every layer.

Request ``b`` of an extend-like step has ``p_b`` cached prefix tokens and ``n_b`` new ones. The prefix
tokens of the whole batch, concatenated request by request, are cut into chunks of at most ``W`` tokens
(the workspace budget; a chunk may hold slices of several requests and may end mid-page), each a
:class:`PrefixChunk`: its pool slot ids (from ``req_to_token``) and the cu_seqlens of the requests it covers.

When the prefix and the new tokens fit the workspace together (``P + N <= W``), the plan also holds
a :class:`OnePass` layout (``[prefix_b | new_b]`` per request) and the layer runs ONE causal attention over
it instead of the chunk loop (no pass over the new tokens alone, no merge); ``chunks`` still describes
the prefix in chunks (one here).

Plan once per step, run per layer: :func:`build_prefill_plan` turns the step's host lengths into
index tensors (chunk slot ids, cu_seqlens, host maxima) shared by every layer; the backend stores it
in the step plan (:func:`plan_extend` first chooses the path with ``policy.prefill_cost``). Not
legal inside a CUDA graph (extend steps are never captured). The plan is a handful of tensor operations
over the per-request lengths (no loop over tokens or pages; one small loop builds the chunk records).

Memory: the workspace (:class:`PrefillWorkspace`) is ``W`` tokens of gathered latent rows and of
decompressed ``[v | k_nope | k_rope]`` rows per head, allocated once and reused by every chunk, layer
and step. Its size is a budget in BYTES (:data:`PREFILL_WORKSPACE_BYTES`, 512 MiB by default):
:func:`workspace_tokens_for_bytes` turns it into ``W`` for a head count, so 16 heads decompress ~8x
more prefix tokens per chunk than 128 heads in the same memory (DeepSeek-V3 dims, bf16: ~47k tokens
at 16 heads, ~6.4k at 128). A memory planner reserves :meth:`PrefillWorkspace.bytes_for`.

Split steps (MIXED): decode rows (``n_b = 1``, ``p_b > 0``; see ``prefill_cost.decode_rows``) run the
absorbed path on a sub-metadata of their own while the other rows run MHA; :class:`RowSplit` holds
the index tensors (built once in the plan) that split ``q`` and scatter the outputs back in batch order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mla_fa3.checks import check_int
from mla_fa3.policy.paths import AttentionPath
from mla_fa3.policy.prefill_cost import H200_COSTS, PathDecision, choose_path, decode_rows

__all__ = ["PrefixChunk", "OnePass", "RowSplit", "PrefillWorkspace", "PrefillPlan", "build_prefill_plan", "plan_extend",
           "PREFILL_WORKSPACE_BYTES", "workspace_tokens_for_bytes", "chunk_layout"]

PREFILL_WORKSPACE_BYTES = 512 * 2**20  # default workspace budget of the chunked MHA prefill (bytes, per rank)


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
class OnePass:
    """The whole step in one workspace pass (``P + N <= W``): each request's prefix then its new tokens.

    Keys are laid out request by request as ``[prefix_b | new_b]``, so one causal varlen call with
    bottom-right alignment (query ``i`` of request ``b`` sees keys ``j <= p_b + i``) is exactly the
    causal set: no chunk, no separate pass over the new tokens, no merge.
    """

    slot_ids: Tensor  # [P + N] int64, device — pool slots in that layout
    cu_seqlens_k: Tensor  # [n+1] int32, device — p_b + n_b per MHA request
    new_rows: Tensor  # [N] int64, device — the workspace rows of the new tokens (where latent_new lands)
    num_keys: int  # host: P + N
    max_seqlen_k: int  # host: max p_b + n_b


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
    """Chunk buffers of ``workspace_tokens`` rows, allocated at first use, reused across layers and steps.

    Buffers (``W`` = workspace_tokens): ``latent [W, r + d_rope]`` (the chunk's gathered latent rows) and
    ``kv [W, H, d_v + d_nope + d_rope]`` (per head ``[v | k_nope | k_rope]``: the attention reads
    ``v = kv[..., :d_v]`` and ``k = kv[..., d_v:]`` in place — the decompression GEMM writes both).
    """

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
        """Device bytes per workspace token: the latent row and the decompressed ``[v | k]`` row of every head."""
        per_head = dims.v_head_dim + dims.qk_nope_head_dim + dims.qk_rope_head_dim
        return element_size * (dims.kv_lora_rank + dims.qk_rope_head_dim + num_heads * per_head)

    @staticmethod
    def bytes_for(workspace_tokens: int, num_heads: int, dims, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes a workspace of ``workspace_tokens`` tokens holds once every buffer exists (for memory planners)."""
        check_int(workspace_tokens, "workspace_tokens")
        check_int(num_heads, "num_heads")
        elem = torch.empty((), dtype=dtype).element_size()
        return workspace_tokens * PrefillWorkspace.bytes_per_token(num_heads, dims, elem)


def workspace_tokens_for_bytes(num_heads: int, dims, budget_bytes: int, dtype: torch.dtype = torch.bfloat16, *,
                               page_size: int = 1) -> int:
    """Prefix tokens per chunk that fit ``budget_bytes`` of workspace: ``floor(budget / bytes_per_token)``.

    The inverse of :meth:`PrefillWorkspace.bytes_for` (``bytes_for(W) <= budget_bytes``). Raises
    ``ValueError`` when the budget holds less than one page (``page_size`` tokens). Example (DeepSeek-V3
    dims, bf16, 512 MiB): 16 heads -> 47,080 tokens, 128 heads -> 6,460 tokens.
    """
    check_int(num_heads, "num_heads")
    check_int(budget_bytes, "budget_bytes")
    page_size = check_int(page_size, "page_size")
    elem = torch.empty((), dtype=dtype).element_size()
    per = PrefillWorkspace.bytes_per_token(num_heads, dims, elem)
    tokens = budget_bytes // per
    if tokens < page_size:
        raise ValueError(f"budget_bytes {budget_bytes} holds {tokens} workspace tokens at {num_heads} heads "
                         f"({per} B each); the chunked prefill needs at least one page ({page_size} tokens)")
    return tokens


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
    # the prefix and the new tokens fit the workspace together (P + N <= W, P > 0): one pass, no chunk loop
    one_pass: OnePass | None = None
    # the step's validated kernel calls per layer configuration (q shape/dtype, scale, impl, ...):
    # filled by the first layer that runs with this plan (chunked_prefix), reused by every other one
    calls: dict = field(default_factory=dict, repr=False)


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


def chunk_layout(prefix: Tensor, extend: Tensor, W: int) -> tuple[Tensor, Tensor, Tensor]:
    """The chunks of the concatenated prefixes, as tensors (int64, cpu): no loop over tokens or requests.

    prefix / extend ``[n]`` (the MHA requests). Chunk ``c`` covers prefix tokens ``[c·W, min(P, (c+1)·W))``
    of the concatenation and requests ``lo_c .. hi_c - 1`` (``lo_c``: the request holding its first token;
    ``hi_c``: one past the last request with a token in it; empty prefixes inside the range stay, with
    no key). Returns

    * ``host [C, 8]``: per chunk ``(start, end, lo, hi, q_lo, q_hi, max_seqlen_q, max_seqlen_k)``;
    * ``cu_q [Σ_c (hi_c - lo_c + 1)]``: each chunk's q cu_seqlens (from 0), chunk after chunk;
    * ``cu_k`` (same length): each chunk's key cu_seqlens.

    Example: prefix ``[5, 3, 0, 7, 2]``, extend ``[2, 1, 3, 4, 2]``, W = 6 (offsets 0 5 8 8 15 17)::

        chunk 0: tokens 0..6   requests 0..1  keys [5, 1]      cu_q [0, 2, 3]     cu_k [0, 5, 6]
        chunk 1: tokens 6..12  requests 1..3  keys [2, 0, 4]   cu_q [0, 1, 4, 8]  cu_k [0, 2, 2, 6]
        chunk 2: tokens 12..17 requests 3..4  keys [3, 2]      cu_q [0, 4, 6]     cu_k [0, 3, 5]
    """
    prefix, extend = prefix.long(), extend.long()
    off = torch.zeros(prefix.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(prefix, 0, out=off[1:])
    cq = torch.zeros_like(off)
    torch.cumsum(extend, 0, out=cq[1:])
    P = int(off[-1])
    start = torch.arange(0, P, W, dtype=torch.int64)
    end = (start + W).clamp(max=P)
    lo = torch.searchsorted(off[1:], start, right=True)  # first request whose prefix ends after start
    nz = torch.nonzero(prefix > 0).flatten()
    hi = nz[torch.searchsorted(off[nz], end) - 1] + 1  # one past the last non-empty request starting before end
    width = hi - lo + 1  # cu_seqlens entries per chunk
    chunk = torch.repeat_interleave(torch.arange(start.shape[0]), width)
    first = torch.cumsum(width, 0) - width
    b = torch.arange(chunk.shape[0]) - first[chunk] + lo[chunk]  # request of each entry (lo .. hi)
    cu_q = cq[b] - cq[lo][chunk]
    cu_k = (torch.minimum(off[b], end[chunk]) - start[chunk]).clamp(min=0)
    # per-chunk maxima over the entries b < hi (each entry's q and k counts are the next entry's minus its own)
    last = torch.ones_like(b, dtype=torch.bool)
    last[:-1] = chunk[1:] != chunk[:-1]  # the hi entry of each chunk carries no request
    dq, dk = cu_q.roll(-1) - cu_q, cu_k.roll(-1) - cu_k
    zero = torch.zeros(start.shape[0], dtype=torch.int64)
    max_q = zero.scatter_reduce(0, chunk[~last], dq[~last], "amax")
    max_k = zero.scatter_reduce(0, chunk[~last], dk[~last], "amax")
    host = torch.stack([start, end, lo, hi, cq[lo], cq[hi], max_q, max_k], 1)
    return host, cu_q, cu_k


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
    return _build(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, split_decode_rows,
                  workspace, debug_checks)


def _build(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, split_decode_rows, workspace,
           debug_checks) -> PrefillPlan:
    """:func:`build_prefill_plan` on checked inputs."""
    if workspace is None:
        workspace = PrefillWorkspace(workspace_tokens)
    elif not isinstance(workspace, PrefillWorkspace) or workspace.workspace_tokens != workspace_tokens:
        raise ValueError(f"workspace must be a PrefillWorkspace of {workspace_tokens} tokens")
    prefix_all, extend_all = metadata.prefix_lens_cpu.long(), metadata.extend_lens_cpu.long()
    bs, device = metadata.batch_size, req_to_token.device
    is_dec = decode_rows(prefix_all, extend_all) if split_decode_rows else torch.zeros(bs, dtype=torch.bool)
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
    one = 0 < P and P + N <= workspace_tokens  # the one-pass layout: (request, column) of [prefix_b | new_b]
    whole = prefix + extend
    parts = [torch.repeat_interleave(mha_req, prefix), _ranges(col0, prefix),
             torch.repeat_interleave(mha_req, extend), _ranges(col0 + prefix, extend),
             _ranges(tok_start[mha_req], extend), _ranges(tok_start[abs_req], extend_all[abs_req])]
    if one:
        parts += [torch.repeat_interleave(mha_req, whole), _ranges(col0, whole),
                  _ranges(torch.cumsum(whole, 0) - extend, extend)]
    idx = torch.cat(parts).to(device)
    sizes = [P, P, N, N, N, T - N] + ([P + N, P + N, N] if one else [])
    pr, pc, nr, nc, mha_tok, abs_tok, *one_idx = idx.split(sizes)
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
    # one host->device copy of every int32 cu_seqlens: the MHA rows', then each chunk's q and k
    cq = torch.zeros(extend.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(extend, 0, out=cq[1:])
    host, cu_q, cu_k = chunk_layout(prefix, extend, workspace_tokens)
    cu_whole = torch.zeros(extend.shape[0] + 1 if one else 0, dtype=torch.int64)
    if one:
        torch.cumsum(whole, 0, out=cu_whole[1:])
    cu = torch.cat([cq, cu_q, cu_k, cu_whole]).to(torch.int32).to(device)
    n0, E = cq.shape[0], cu_q.shape[0]
    one_pass = None
    if one:
        wr, wc, new_rows = one_idx
        one_pass = OnePass(slot_ids=req_to_token[req_pool_indices[wr], wc].long(), cu_seqlens_k=cu[n0 + 2 * E:],
                           new_rows=new_rows, num_keys=P + N, max_seqlen_k=int(whole.max()))
    chunks, pos = [], n0
    for s, e, lo, hi, q_lo, q_hi, mq, mk in host.tolist():  # one record per chunk
        k = hi - lo + 1
        chunks.append(PrefixChunk(
            slot_ids=prefix_slots[s:e], cu_seqlens_q=cu[pos: pos + k], cu_seqlens_k=cu[pos + E: pos + E + k],
            req_lo=lo, req_hi=hi, q_lo=q_lo, q_hi=q_hi, num_keys=e - s, max_seqlen_q=mq, max_seqlen_k=mk))
        pos += k
    return PrefillPlan(
        path=AttentionPath.MHA_CHUNKED if P else AttentionPath.MHA_ONESHOT, page_size=page_size,
        workspace_tokens=workspace_tokens, num_tokens=T, num_mha_tokens=N, cu_seqlens_q=cu[:n0],
        max_seqlen_q=int(extend.max()), new_slot_ids=new_slots, prefix_slot_ids=prefix_slots, chunks=tuple(chunks),
        split=split, workspace=workspace, prefix_lens_cpu=prefix.to(torch.int32),
        extend_lens_cpu=extend.to(torch.int32), one_pass=one_pass)


def plan_extend(metadata, req_to_token: Tensor, req_pool_indices: Tensor, *, num_heads: int, dims,
                workspace_tokens: int, page_size: int, prefill_path: str = "auto", constants=H200_COSTS,
                workspace: PrefillWorkspace | None = None) -> tuple[PathDecision, PrefillPlan | None]:
    """Once per extend-like step: choose the path from host lengths and, for an MHA path, build its plan.

    Returns ``(decision, plan)``; ``plan`` is None when the decision is ABSORBED (store it on
    in the step plan either way, and ``decision`` on its record).
    """
    _check_plan_inputs(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, None)
    decision = choose_path(metadata.prefix_lens_cpu, metadata.extend_lens_cpu, num_heads=num_heads, dims=dims,
                           workspace_tokens=workspace_tokens, prefill_path=prefill_path, constants=constants)
    if not decision.path.is_mha_prefill:
        return decision, None
    return decision, _build(metadata, req_to_token, req_pool_indices, workspace_tokens, page_size, True,
                            workspace, False)
