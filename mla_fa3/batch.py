"""What an engine hands the attention backend each step: the forward mode and the batch.

Symbols (per request ``b`` of a batch of ``bs`` requests):

- ``prefix_b``  tokens of the request already in the KV cache before this step;
- ``new_b``     tokens this step writes (extend length; 1 for decode; ``k`` for TARGET_VERIFY);
- ``seq_b``     = ``prefix_b + new_b``: KV tokens the request attends to after this step's tokens are
  written. This holds for EVERY mode (unlike SGLang, our TARGET_VERIFY ``seq_lens`` include the
  ``k`` draft tokens);
- ``T``         = ``sum_b new_b``: rows of the token-major tensors (queries, ``out_cache_loc``,
  ``positions``), ordered request by request.

Tree steps (EAGLE with topk > 1, :mod:`mla_fa3.tree`): a TARGET_VERIFY or DRAFT_DECODE batch with a
``tree`` (:class:`~mla_fa3.tree.DraftTree`, mask ``[bs, m, n]``): ``m`` queries per request (k for verify,
``topk`` for a draft step, then also ``num_draft_tokens``), the last ``n`` tokens of each row are the tree
keys, ``seq_lens - n`` the prefix every query sees whole (``>= 1``). Without a tree, verify is the causal
chain of today.

Every length lives twice: on the device (for kernels) and as a ``*_cpu`` int32 copy (for host-side
maxima, shapes and checks), so that no hot path ever syncs device->host (the conversions: :mod:`mla_fa3.host`).
The constructors
(:meth:`ForwardBatch.extend`, :meth:`ForwardBatch.decode`, :meth:`ForwardBatch.verify`,
:meth:`ForwardBatch.draft_decode`, :meth:`ForwardBatch.idle`) take Python lists or CPU tensors for the
lengths, build the CPU copies once and copy each to the device once (host->device only).

Cross-attention: ``encoder_lens`` counts a request's encoder tokens; they live in the first
``ceil(encoder_len / page_size) * page_size`` columns of its ``req_to_token`` row and are not part of
``seq_lens`` (which counts decoder tokens only). See :mod:`mla_fa3.kv`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mla_fa3.checks import check_int
from mla_fa3.host import IntsLike, check_tensor_1d, cpu_int32, index_tensor, index_tensors, to_device
from mla_fa3.tree import DraftTree, DraftTreeError, check_tree_fits, tree_positions

__all__ = ["ForwardMode", "ForwardBatch", "queries_per_request"]

class ForwardMode(enum.Enum):
    """Kind of step. SGLang's names; the predicates group them the way the metadata builder does."""

    EXTEND = "extend"  # prefill of new tokens, with or without a cached prefix
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # extend rows and decode rows (extend_len 1) in one batch
    IDLE = "idle"  # empty batch (a data-parallel rank with nothing to do)
    TARGET_VERIFY = "target_verify"  # k draft tokens per request, verified by the target model
    DRAFT_DECODE = "draft_decode"  # step i of a multi-step draft: one token per request
    DRAFT_EXTEND = "draft_extend"  # draft model extends with the accepted tokens (varying lengths)

    def is_decode_like(self) -> bool:
        """One query per request: DECODE, DRAFT_DECODE."""
        return self in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE)

    def is_extend_like(self) -> bool:
        """Varying number of queries per request over a cached prefix: EXTEND, MIXED, DRAFT_EXTEND."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND)

    def is_graph_capturable(self) -> bool:
        """Fixed queries per request, so a CUDA graph can replay it: DECODE, TARGET_VERIFY, DRAFT_DECODE."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE)

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_decode(self) -> bool:
        return self is ForwardMode.DRAFT_DECODE


def queries_per_request(mode: ForwardMode, num_draft_tokens: int) -> int:
    """Query tokens per request of a decode-like or verify step: ``num_draft_tokens`` for TARGET_VERIFY
    (k draft tokens verified at once); for DRAFT_DECODE 1, or ``topk`` (= ``num_draft_tokens`` > 1) for a
    step of a draft tree; else 1. Extend-like steps have per-request lengths instead."""
    if mode is ForwardMode.TARGET_VERIFY:
        return num_draft_tokens
    if mode is ForwardMode.DRAFT_DECODE:
        return max(num_draft_tokens, 1)
    return 1


def _default_positions(seq_lens_cpu: Tensor, new_lens_cpu: Tensor, device: torch.device) -> Tensor:
    """Absolute position of every new token: request b's tokens are seq_b - new_b .. seq_b - 1 (host
    arithmetic in NumPy, one copy to the device)."""
    seq = seq_lens_cpu.numpy().astype(np.int64)
    new = new_lens_cpu.numpy().astype(np.int64)
    total = int(new.sum())
    if total == new.shape[0] and (new == 1).all():  # one new token per request (decode)
        pos = seq - 1
    else:  # token i of request b sits at row first_b + i: position (seq_b - new_b - first_b) + row
        first_row = np.cumsum(new) - new
        pos = np.repeat(seq - new - first_row, new) + np.arange(total, dtype=np.int64)
    return to_device(torch.from_numpy(pos), device)


@dataclass
class ForwardBatch:
    """One step's batch. Tensors marked *device* live on the compute device; ``*_cpu`` are host copies.

    Fields are never mutated by the backend. Build it through the classmethods, which derive every
    CPU copy and device tensor from the given lengths; the dataclass constructor validates dtypes
    and shapes only (no device value is read).
    """

    forward_mode: ForwardMode
    batch_size: int  # bs, host int (0 for IDLE)
    req_pool_indices: Tensor  # [bs] int64, device — rows of ReqToTokenPool.req_to_token
    seq_lens: Tensor  # [bs] int32, device — KV tokens after this step (prefix + new), every mode
    seq_lens_cpu: Tensor  # [bs] int32, cpu — copy of seq_lens
    out_cache_loc: Tensor  # [T] int64, device — pool slot of each new token (T = total new tokens)
    extend_prefix_lens: Tensor | None = None  # [bs] int32, device (extend-like) — tokens already cached
    extend_prefix_lens_cpu: Tensor | None = None  # [bs] int32, cpu
    extend_seq_lens: Tensor | None = None  # [bs] int32, device (extend-like) — new tokens per request
    extend_seq_lens_cpu: Tensor | None = None  # [bs] int32, cpu
    encoder_lens: Tensor | None = None  # [bs] int32, device — cross-attention encoder tokens
    encoder_lens_cpu: Tensor | None = None  # [bs] int32, cpu
    encoder_out_cache_loc: Tensor | None = None  # [sum enc new] int64, device — where encoder K/V go
    num_draft_tokens: int = 0  # TARGET_VERIFY: k draft tokens per request (T = bs * k); DRAFT_DECODE of a
    #   tree: topk, its queries per request (T = bs * topk); else 0
    draft_step: int = 0  # DRAFT_DECODE: step i of a multi-step draft
    positions: Tensor | None = None  # [T] int64, device — absolute position of each new token
    req_pool_indices_cpu: Tensor | None = None  # [bs] int64, cpu — copy of req_pool_indices (None: given
    #   on the device only; the builder then checks row ownership on the host only for CPU / debug_checks)
    tree: DraftTree | None = None  # TARGET_VERIFY / DRAFT_DECODE with topk > 1: mask [bs, m, n] (mla_fa3.tree)
    tree_key_columns: Tensor | None = None  # [bs, n] int64, device — a tree step's req_to_token columns of its n
    #   tree keys (None: the last n columns of each row); SGLang's page-aligned draft branches (page > 1, topk > 1)

    def __post_init__(self) -> None:
        self.check()

    def __setattr__(self, name: str, value: object) -> None:
        # a reassigned field is checked again by the next ensure_checked (the metadata builder's)
        object.__setattr__(self, name, value)
        self.__dict__["_checked"] = False

    def ensure_checked(self) -> None:
        """:meth:`check`, unless it passed since the last field assignment (construction runs it)."""
        if not self.__dict__.get("_checked", False):
            self.check()

    def check(self) -> None:
        """Validate dtypes, shapes, placement and the CPU copies (host values only: never syncs).

        Raises ``TypeError``/``ValueError`` naming the field. Run at construction; the metadata builder
        runs it again (:meth:`ensure_checked`) only when a field was reassigned since.
        """
        self.__dict__["_checked"] = False
        if not isinstance(self.forward_mode, ForwardMode):
            raise TypeError(f"forward_mode must be a ForwardMode, got {type(self.forward_mode).__name__}")
        bs = check_int(self.batch_size, "batch_size", minimum=0)
        check_tensor_1d(self.req_pool_indices, "req_pool_indices", (torch.int64,), bs)
        if self.req_pool_indices_cpu is not None:
            check_tensor_1d(self.req_pool_indices_cpu, "req_pool_indices_cpu", (torch.int64,), bs, cpu=True)
        check_tensor_1d(self.seq_lens, "seq_lens", (torch.int32,), bs)
        check_tensor_1d(self.seq_lens_cpu, "seq_lens_cpu", (torch.int32,), bs, cpu=True)
        check_tensor_1d(self.out_cache_loc, "out_cache_loc", (torch.int64,), None)
        num_tokens = self.out_cache_loc.shape[0]
        mode = self.forward_mode
        if mode.is_idle() and (bs != 0 or num_tokens != 0):
            raise ValueError(f"batch_size must be 0 for IDLE, got {bs} (and {num_tokens} tokens)")
        if mode.is_extend_like():
            for name in ("extend_prefix_lens", "extend_seq_lens"):
                check_tensor_1d(getattr(self, name), name, (torch.int32,), bs)
                check_tensor_1d(getattr(self, name + "_cpu"), name + "_cpu", (torch.int32,), bs, cpu=True)
            if int(self.extend_seq_lens_cpu.sum()) != num_tokens:
                raise ValueError(f"extend_seq_lens must sum to len(out_cache_loc) = {num_tokens}, "
                                 f"got {int(self.extend_seq_lens_cpu.sum())}")
            if bool((self.seq_lens_cpu < self.extend_prefix_lens_cpu).any()):
                raise ValueError(f"seq_lens must be >= extend_prefix_lens, got {self.seq_lens_cpu.tolist()} "
                                 f"and {self.extend_prefix_lens_cpu.tolist()}")
            if not torch.equal(self.extend_prefix_lens_cpu + self.extend_seq_lens_cpu, self.seq_lens_cpu):
                raise ValueError("seq_lens must equal extend_prefix_lens + extend_seq_lens, got "
                                 f"{self.seq_lens_cpu.tolist()} vs {self.extend_prefix_lens_cpu.tolist()} "
                                 f"+ {self.extend_seq_lens_cpu.tolist()}")
        elif mode is ForwardMode.TARGET_VERIFY:
            k = check_int(self.num_draft_tokens, "num_draft_tokens (TARGET_VERIFY)")
            if num_tokens != bs * k:
                raise ValueError(f"out_cache_loc must hold batch_size * num_draft_tokens = {bs * k} "
                                 f"slots, got {num_tokens}")
        elif mode.is_decode_like():
            per = queries_per_request(mode, check_int(self.num_draft_tokens, "num_draft_tokens", minimum=0))
            if num_tokens != bs * per:
                raise ValueError(f"out_cache_loc must hold {per} slot(s) per request ({bs * per}) in {mode.name}, "
                                 f"got {num_tokens}")
        if self.tree is not None:
            self._check_tree(bs)
        elif self.tree_key_columns is not None:
            raise DraftTreeError("tree_key_columns without a tree: they place a tree step's keys")
        elif mode is ForwardMode.DRAFT_DECODE and self.num_draft_tokens > 1:
            raise DraftTreeError(f"num_draft_tokens = {self.num_draft_tokens} queries per request in DRAFT_DECODE "
                                 "needs a tree (the branches' masks)")
        seq = self.seq_lens_cpu.numpy()
        if bs and int(seq.min()) < self.new_tokens_per_request_min():
            raise ValueError(f"seq_lens must be >= the new tokens of each request, got "
                             f"{self.seq_lens_cpu.tolist()}")
        if self.encoder_lens is not None or self.encoder_lens_cpu is not None:
            check_tensor_1d(self.encoder_lens, "encoder_lens", (torch.int32,), bs)
            check_tensor_1d(self.encoder_lens_cpu, "encoder_lens_cpu", (torch.int32,), bs, cpu=True)
        if self.encoder_out_cache_loc is not None:
            check_tensor_1d(self.encoder_out_cache_loc, "encoder_out_cache_loc", (torch.int64,), None)
        if self.positions is not None:
            check_tensor_1d(self.positions, "positions", (torch.int64,), num_tokens)
        check_int(self.num_draft_tokens, "num_draft_tokens", minimum=0)
        check_int(self.draft_step, "draft_step", minimum=0)
        # host maxima read once per batch (seq_lens_max / seq_lens_sum), with the checks
        self.__dict__["_seq_stats"] = (int(seq.max()), int(seq.sum(dtype=np.int64))) if bs else (0, 0)
        self.__dict__["_checked"] = True

    def _check_tree(self, bs: int) -> None:
        mode = self.forward_mode
        if mode not in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE):
            raise DraftTreeError(f"tree is for TARGET_VERIFY and DRAFT_DECODE steps, got {mode.name}")
        check_tree_fits(self.tree, verify=mode is ForwardMode.TARGET_VERIFY, batch_size=bs,
                        queries=queries_per_request(mode, self.num_draft_tokens), seq_lens=self.seq_lens,
                        seq_lens_cpu=self.seq_lens_cpu)
        cols = self.tree_key_columns
        if cols is not None:
            n = self.tree.num_keys
            if not isinstance(cols, Tensor) or cols.dtype != torch.int64 or tuple(cols.shape) != (bs, n):
                got = f"{cols.dtype} {tuple(cols.shape)}" if isinstance(cols, Tensor) else type(cols).__name__
                raise ValueError(f"tree_key_columns must be a [batch_size, n] = [{bs}, {n}] int64 "
                                 f"tensor, got {got}")
            if cols.device != self.seq_lens.device:
                raise ValueError(f"tree_key_columns must be on {self.seq_lens.device}, got {cols.device}")

    # ------------------------------------------------------------------ derived host values
    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def num_tokens(self) -> int:
        """T: new tokens in this step (rows of q / out_cache_loc)."""
        return self.out_cache_loc.shape[0]

    @property
    def seq_lens_max(self) -> int:
        """``max(seq_lens)`` (host int, 0 for an empty batch), read from ``seq_lens_cpu`` once per batch."""
        self.ensure_checked()
        return self.__dict__["_seq_stats"][0]

    @property
    def seq_lens_sum(self) -> int:
        """``sum(seq_lens)`` (host int), read from ``seq_lens_cpu`` once per batch."""
        self.ensure_checked()
        return self.__dict__["_seq_stats"][1]

    def new_tokens_per_request_min(self) -> int:
        """Smallest number of new tokens of a request (host int; 0 for an empty batch)."""
        if self.batch_size == 0:
            return 0
        if self.forward_mode.is_extend_like():
            return int(self.extend_seq_lens_cpu.min())
        return queries_per_request(self.forward_mode, self.num_draft_tokens)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def extend(cls, req_pool_indices: IntsLike, prefix_lens: IntsLike, extend_lens: IntsLike,
               out_cache_loc: IntsLike, device: torch.device | str, mode: ForwardMode = ForwardMode.EXTEND,
               positions: IntsLike | None = None, encoder_lens: IntsLike | None = None,
               encoder_out_cache_loc: IntsLike | None = None) -> "ForwardBatch":
        """EXTEND / MIXED / DRAFT_EXTEND batch. ``seq_lens = prefix_lens + extend_lens``.

        A MIXED batch's decode rows are extend rows with ``extend_len`` 1.
        """
        if not isinstance(mode, ForwardMode) or not mode.is_extend_like():
            raise ValueError(f"mode must be EXTEND, MIXED or DRAFT_EXTEND, got {mode!r}")
        device = torch.device(device)
        prefix_cpu = cpu_int32(prefix_lens, "prefix_lens")
        ext_cpu = cpu_int32(extend_lens, "extend_lens")
        if prefix_cpu.shape != ext_cpu.shape:
            raise ValueError(f"prefix_lens and extend_lens must have the same length, got "
                             f"{prefix_cpu.shape[0]} and {ext_cpu.shape[0]}")
        seq_cpu = prefix_cpu + ext_cpu
        loc = index_tensor(out_cache_loc, "out_cache_loc", device)
        return cls._make(mode, req_pool_indices, seq_cpu, loc, device, ext_cpu, positions, encoder_lens,
                         encoder_out_cache_loc, prefix_cpu=prefix_cpu)

    @classmethod
    def decode(cls, req_pool_indices: IntsLike, seq_lens: IntsLike, out_cache_loc: IntsLike,
               device: torch.device | str, positions: IntsLike | None = None,
               encoder_lens: IntsLike | None = None) -> "ForwardBatch":
        """DECODE batch: one new token per request; ``seq_lens`` include it."""
        device = torch.device(device)
        seq_cpu = cpu_int32(seq_lens, "seq_lens")
        loc = index_tensor(out_cache_loc, "out_cache_loc", device)
        return cls._make(ForwardMode.DECODE, req_pool_indices, seq_cpu, loc, device,
                         torch.ones_like(seq_cpu), positions, encoder_lens, None)

    @classmethod
    def verify(cls, req_pool_indices: IntsLike, seq_lens: IntsLike, out_cache_loc: IntsLike,
               device: torch.device | str, num_draft_tokens: int,
               positions: IntsLike | None = None, encoder_lens: IntsLike | None = None,
               tree: DraftTree | None = None) -> "ForwardBatch":
        """TARGET_VERIFY batch: ``k = num_draft_tokens`` queries per request; ``seq_lens`` include them.

        ``tree`` (EAGLE topk > 1): the k tokens' tree (``DraftTree.from_parents`` / ``from_mask`` /
        ``from_sglang_custom_mask``); default positions are then ``prefix + depth``. None: the causal chain."""
        check_int(num_draft_tokens, "num_draft_tokens")
        device = torch.device(device)
        seq_cpu = cpu_int32(seq_lens, "seq_lens")
        loc = index_tensor(out_cache_loc, "out_cache_loc", device)
        if positions is None and tree is not None:
            positions = tree_positions(seq_cpu, tree)
        return cls._make(ForwardMode.TARGET_VERIFY, req_pool_indices, seq_cpu, loc, device,
                         torch.full_like(seq_cpu, num_draft_tokens), positions, encoder_lens, None,
                         num_draft_tokens=num_draft_tokens, tree=tree)

    @classmethod
    def draft_decode(cls, req_pool_indices: IntsLike, seq_lens: IntsLike, out_cache_loc: IntsLike,
                     device: torch.device | str, step: int, positions: IntsLike | None = None,
                     encoder_lens: IntsLike | None = None, tree: DraftTree | None = None) -> "ForwardBatch":
        """DRAFT_DECODE step ``step``: one query per request; ``seq_lens`` include this step's token.

        ``tree`` (``DraftTree.draft``, mask [bs, topk, n]): ``topk`` queries per request (``out_cache_loc``
        holds bs * topk slots), ``seq_lens`` = prefix + the n tree keys (see :mod:`mla_fa3.tree`)."""
        check_int(step, "step", minimum=0)
        device = torch.device(device)
        seq_cpu = cpu_int32(seq_lens, "seq_lens")
        loc = index_tensor(out_cache_loc, "out_cache_loc", device)
        per = 1 if tree is None else tree.num_queries
        if positions is None and tree is not None:
            positions = tree_positions(seq_cpu, tree)
        return cls._make(ForwardMode.DRAFT_DECODE, req_pool_indices, seq_cpu, loc, device,
                         torch.full_like(seq_cpu, per), positions, encoder_lens, None, draft_step=step,
                         num_draft_tokens=0 if tree is None else per, tree=tree)

    @classmethod
    def idle(cls, device: torch.device | str) -> "ForwardBatch":
        """IDLE batch: nothing to compute (a data-parallel rank without requests)."""
        device = torch.device(device)
        empty32 = torch.empty(0, dtype=torch.int32)
        return cls(forward_mode=ForwardMode.IDLE, batch_size=0,
                   req_pool_indices=torch.empty(0, dtype=torch.int64, device=device),
                   seq_lens=torch.empty(0, dtype=torch.int32, device=device), seq_lens_cpu=empty32,
                   out_cache_loc=torch.empty(0, dtype=torch.int64, device=device),
                   positions=torch.empty(0, dtype=torch.int64, device=device))

    @classmethod
    def _make(cls, mode: ForwardMode, req_pool_indices: IntsLike, seq_cpu: Tensor, loc: Tensor,
              device: torch.device, new_cpu: Tensor, positions: IntsLike | None,
              encoder_lens: IntsLike | None, encoder_out_cache_loc: IntsLike | None, *,
              prefix_cpu: Tensor | None = None, num_draft_tokens: int = 0,
              draft_step: int = 0, tree: DraftTree | None = None) -> "ForwardBatch":
        bs = seq_cpu.shape[0]
        rows, rows_cpu = index_tensors(req_pool_indices, "req_pool_indices", device)
        if rows.shape[0] != bs:
            raise ValueError(f"req_pool_indices must have one row per request ({bs}), got {rows.shape[0]}")
        seq_np, new_np = seq_cpu.numpy(), new_cpu.numpy()
        if bs and (seq_np < new_np).any():
            raise ValueError(f"seq_lens must include this step's new tokens ({new_cpu.tolist()}), got "
                             f"{seq_cpu.tolist()}")
        total_new = int(new_np.sum(dtype=np.int64))
        if loc.shape[0] != total_new:
            raise ValueError(f"out_cache_loc must hold one slot per new token ({total_new}), got "
                             f"{loc.shape[0]}")
        if positions is None:
            pos = _default_positions(seq_cpu, new_cpu, device)
        else:
            pos = index_tensor(positions, "positions", device)
        enc_dev = enc_cpu = enc_loc = None
        if encoder_lens is not None:
            enc_cpu = cpu_int32(encoder_lens, "encoder_lens")
            if enc_cpu.shape[0] != bs:
                raise ValueError(f"encoder_lens must have one entry per request ({bs}), got {enc_cpu.shape[0]}")
            enc_dev = to_device(enc_cpu, device)
        if encoder_out_cache_loc is not None:
            enc_loc = index_tensor(encoder_out_cache_loc, "encoder_out_cache_loc", device)
        extend_like = mode.is_extend_like()
        return cls(forward_mode=mode, batch_size=bs, req_pool_indices=rows,
                   seq_lens=to_device(seq_cpu, device), seq_lens_cpu=seq_cpu, out_cache_loc=loc,
                   extend_prefix_lens=to_device(prefix_cpu, device) if extend_like else None,
                   extend_prefix_lens_cpu=prefix_cpu if extend_like else None,
                   extend_seq_lens=to_device(new_cpu, device) if extend_like else None,
                   extend_seq_lens_cpu=new_cpu if extend_like else None,
                   encoder_lens=enc_dev, encoder_lens_cpu=enc_cpu, encoder_out_cache_loc=enc_loc,
                   num_draft_tokens=num_draft_tokens, draft_step=draft_step, positions=pos,
                   req_pool_indices_cpu=rows_cpu, tree=tree)
