"""SGLang's ``ForwardBatch`` -> mla_fa3's :class:`~mla_fa3.batch.ForwardBatch` (host work only: no device value is
read, nothing is copied host->device; SGLang's device tensors are used as they are, cast to int32 where ours are).

The two engines name the modes alike but count one thing differently: in TARGET_VERIFY, SGLang's ``seq_lens`` exclude
the k draft tokens being verified, ours include them (``docs/ARCHITECTURE.md``, Conventions)::

    SGLang  seq_lens = [10, 7], k = 4, out_cache_loc: 8 slots   ->   ours  seq_lens = [14, 11]

Modes (SGLang 0.5.17 ``model_executor/forward_batch_info.py:ForwardMode``):

    EXTEND, MIXED   -> EXTEND, MIXED   (a MIXED decode row is an extend row of one token over its prefix)
    DECODE          -> DECODE          (a target-model decode; a draft step carries ``spec_info``: refused)
    TARGET_VERIFY   -> TARGET_VERIFY   (k draft tokens per request: a chain with topk = 1, else a draft tree read
                                        from ``spec_info.custom_mask``, see :func:`verify_tree`)
    DRAFT_EXTEND_V2 -> TARGET_VERIFY   (the EAGLE draft model's extend over a fixed window of n tokens per request,
                                        causal over its prefix: a chain verify's shape, so it runs on the same
                                        kernels, CUDA graphs and FP8 reads; here ``seq_lens`` already include the
                                        window, and graph padding rows are raised to n) — or, windows of unequal
                                        widths, DRAFT_EXTEND (extend-like; eager, bf16 cache); see :func:`_draft_extend`
    IDLE            -> IDLE            (a data-parallel rank with no request this step)
    others          -> UnsupportedStepError, naming the mode, before anything runs

A CUDA-graph replay passes a batch padded to the captured size: its tail rows (``seq_lens`` = the fill value 1,
``req_pool_indices`` 0) convert like any row and read the padding slot. SGLang's replay view keeps the live rows'
``out_cache_loc`` only (its runner pads its own static buffer, which the captured graph writes): the tail rows' new
tokens are given SGLang's padding slot 0 here, in DECODE and TARGET_VERIFY as in DRAFT_EXTEND_V2.
"""

from __future__ import annotations

import torch

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.tree import MAX_TREE_TOKENS, DraftTree

__all__ = ["UnsupportedStepError", "to_mla_batch", "num_draft_tokens_of", "verify_tree", "host_int32",
           "draft_extend_widths"]


class UnsupportedStepError(ValueError):
    """SGLang sent a step mla_fa3 does not serve (a mode, a layout, a speculative shape): nothing has run."""


_MODES = {"EXTEND": ForwardMode.EXTEND, "MIXED": ForwardMode.MIXED, "DECODE": ForwardMode.DECODE,
          "TARGET_VERIFY": ForwardMode.TARGET_VERIFY, "IDLE": ForwardMode.IDLE}


def num_draft_tokens_of(fb, configured: int) -> int:
    """k of a TARGET_VERIFY batch: its ``spec_info.draft_token_num`` when it carries one, else the server's setting."""
    spec = getattr(fb, "spec_info", None)
    k = getattr(spec, "draft_token_num", None) if spec is not None else None
    return int(k) if k is not None else int(configured)


def host_int32(values, name: str, bs: int) -> torch.Tensor:
    """A CPU int32 tensor of the first ``bs`` host values (a list or a CPU tensor); a device tensor is refused:
    reading it would sync."""
    if values is None:
        raise UnsupportedStepError(f"forward_batch.{name} is None: mla_fa3 plans each step from host lengths "
                                   "(SGLang fills it when the backend sets needs_cpu_seq_lens)")
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise UnsupportedStepError(f"forward_batch.{name} must be a host copy, got a tensor on {values.device}")
        out = values[:bs].to(torch.int32)
    else:
        out = torch.tensor(list(values)[:bs], dtype=torch.int32)
    if out.shape[0] < bs:  # a graph replay's copy of the live rows only: the tail is padding (fill value 1)
        out = torch.cat([out, torch.ones(bs - out.shape[0], dtype=torch.int32)])
    return out


def to_mla_batch(fb, *, device: torch.device, num_draft_tokens: int,
                 verify_mask: torch.Tensor | None = None) -> ForwardBatch:
    """Our batch for SGLang's ``fb`` (see the module docstring). ``num_draft_tokens``: the server's k;
    ``verify_mask``: the QLEN_ONLY buffer the adapter gave SGLang's EAGLE to write draft trees into."""
    name = getattr(fb.forward_mode, "name", str(fb.forward_mode))
    mode = _MODES.get(name)
    if name == "DRAFT_EXTEND_V2":
        return _draft_extend(fb, num_draft_tokens) if fb.batch_size else ForwardBatch.idle(device)
    if mode is None:
        raise UnsupportedStepError(f"forward_mode {name} is not served by mla_fa3 (it serves EXTEND, MIXED, DECODE, "
                                   "TARGET_VERIFY, DRAFT_EXTEND_V2 and IDLE)")
    if mode is ForwardMode.IDLE or fb.batch_size == 0:
        return ForwardBatch.idle(device)
    if mode is ForwardMode.DECODE and getattr(fb, "spec_info", None) is not None:
        raise UnsupportedStepError("a DECODE batch with spec_info is a speculative draft step: it belongs to the draft "
                                   "model's multi-step backend (draft.py, through SGLang's DraftBackendFactory), not "
                                   "to the target model's backend")
    bs = int(fb.batch_size)
    rows = fb.req_pool_indices[:bs].to(torch.int64)
    seq_cpu = host_int32(fb.seq_lens_cpu, "seq_lens_cpu", bs)
    seq = fb.seq_lens[:bs].to(torch.int32)
    loc = fb.out_cache_loc.to(torch.int64)
    if mode is ForwardMode.DECODE:
        loc = _window_slots(loc, bs, 1, name)
    elif mode is ForwardMode.TARGET_VERIFY:
        loc = _window_slots(loc, bs, num_draft_tokens_of(fb, num_draft_tokens), name)
    positions = getattr(fb, "positions", None)
    positions = None if positions is None or positions.shape[0] != loc.shape[0] else positions.to(torch.int64)
    common = dict(forward_mode=mode, batch_size=bs, req_pool_indices=rows, out_cache_loc=loc, positions=positions)
    if mode is ForwardMode.DECODE:
        return ForwardBatch(seq_lens=seq, seq_lens_cpu=seq_cpu, **common)
    if mode is ForwardMode.TARGET_VERIFY:
        topk = int(getattr(getattr(fb, "spec_info", None), "topk", 1) or 1)
        k = num_draft_tokens_of(fb, num_draft_tokens)
        tree = verify_tree(fb, bs, k, seq_cpu, device, verify_mask) if topk > 1 else None
        return ForwardBatch(seq_lens=seq + k, seq_lens_cpu=seq_cpu + k, num_draft_tokens=k, tree=tree, **common)
    ext_cpu = host_int32(fb.extend_seq_lens_cpu, "extend_seq_lens_cpu", bs)
    pre_cpu = host_int32(fb.extend_prefix_lens_cpu, "extend_prefix_lens_cpu", bs)
    ext = fb.extend_seq_lens[:bs].to(torch.int32)
    pre = fb.extend_prefix_lens[:bs].to(torch.int32) if fb.extend_prefix_lens is not None else seq - ext
    return ForwardBatch(seq_lens=seq, seq_lens_cpu=seq_cpu, extend_prefix_lens=pre, extend_prefix_lens_cpu=pre_cpu,
                        extend_seq_lens=ext, extend_seq_lens_cpu=ext_cpu, **common)


def draft_extend_widths(fb, bs: int, configured: int) -> torch.Tensor:
    """The host widths [bs] int32 of a DRAFT_EXTEND_V2 batch's windows: ``extend_seq_lens_cpu`` (the batch's, or the
    copy SGLang's draft-extend graph runner puts on ``spec_info`` at replay), else the fixed width
    ``spec_info.num_tokens_per_req``, else the server's ``speculative_num_draft_tokens``."""
    spec = getattr(fb, "spec_info", None)
    for owner in (fb, spec):
        values = getattr(owner, "extend_seq_lens_cpu", None) if owner is not None else None
        if values is not None:
            return host_int32(values, "extend_seq_lens_cpu", bs)
    width = getattr(spec, "num_tokens_per_req", None) if spec is not None else None
    width = int(width) if width is not None and int(width) > 0 else int(configured)
    if width < 1:
        raise UnsupportedStepError("a DRAFT_EXTEND_V2 batch without extend_seq_lens_cpu, spec_info.num_tokens_per_req "
                                   "or --speculative-num-draft-tokens: the window width is unknown")
    return torch.full((bs,), width, dtype=torch.int32)


def _draft_extend(fb, configured: int) -> ForwardBatch:
    """DRAFT_EXTEND_V2: n tokens per request at the end of each row (``seq_lens`` include them), causal over the
    prefix. Equal widths (SGLang's fixed window, always under CUDA graphs): a chain verify of k = n, the padding rows
    of a replay (seq_lens = the fill value, below n) raised to n, their slots (absent from the replay view's
    ``out_cache_loc``, which holds the live rows' only) SGLang's padding slot 0. Unequal widths: an extend-like
    DRAFT_EXTEND step."""
    bs = int(fb.batch_size)
    widths = draft_extend_widths(fb, bs, configured)
    rows = fb.req_pool_indices[:bs].to(torch.int64)
    loc = fb.out_cache_loc.to(torch.int64)
    seq_cpu = host_int32(fb.seq_lens_cpu, "seq_lens_cpu", bs)
    seq = fb.seq_lens[:bs].to(torch.int32)
    common = dict(batch_size=bs, req_pool_indices=rows, positions=None)
    n = int(widths[0])
    if bool((widths == n).all()):
        return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=seq.clamp(min=n),
                            seq_lens_cpu=seq_cpu.clamp(min=n), num_draft_tokens=n,
                            out_cache_loc=_window_slots(loc, bs, n, "DRAFT_EXTEND_V2"), **common)
    if bool((seq_cpu < widths).any()):
        raise UnsupportedStepError(f"DRAFT_EXTEND_V2: a window wider than its sequence (seq_lens_cpu "
                                   f"{seq_cpu.tolist()}, widths {widths.tolist()})")
    ext = getattr(fb, "extend_seq_lens", None)
    ext = widths.to(seq.device) if ext is None else ext[:bs].to(torch.int32)
    return ForwardBatch(forward_mode=ForwardMode.DRAFT_EXTEND, seq_lens=seq, seq_lens_cpu=seq_cpu,
                        extend_prefix_lens=seq - ext, extend_prefix_lens_cpu=seq_cpu - widths, extend_seq_lens=ext,
                        extend_seq_lens_cpu=widths, out_cache_loc=loc, **common)


def _window_slots(loc: torch.Tensor, bs: int, n: int, mode: str) -> torch.Tensor:
    """The ``bs x n`` slots of a step of ``n`` new tokens per request: ``loc`` itself, or — the graph runner's replay
    view, which holds the live rows' slots only — ``loc`` followed by SGLang's padding slot 0 for the padding rows."""
    live = loc.numel()
    if live > bs * n or live % n:
        raise UnsupportedStepError(f"{mode}: out_cache_loc holds {live} slots, not the live rows' windows "
                                   f"of a batch of {bs} x {n} tokens")
    return loc if live == bs * n else torch.cat([loc, loc.new_zeros(bs * n - live)])


def verify_tree(fb, bs: int, k: int, prefix_cpu: torch.Tensor, device: torch.device,
                qlen_buffer: torch.Tensor | None = None) -> DraftTree:
    """The draft tree of a TARGET_VERIFY batch with topk > 1: ``mask [bs, k, k]`` (token i sees token j), gathered on
    the device from ``spec_info.custom_mask`` as SGLang's EAGLE wrote it (``speculative/eagle_utils.py``,
    ``build_tree_kernel_efficient``), in either layout:

        QLEN_ONLY  (the adapter's ``verify_mask``, ``qlen_buffer``, asks for it)  request b's k x k block at b·k·k
        FULL_MASK  (SGLang's default)  request b's k x (S_b + k) block, row-major, at Σ_{c<b} k·(S_c + k); its
                   tree part is columns S_b .. S_b + k - 1 (S_b: the prefix, SGLang's verify ``seq_lens``)

    Live requests are the first ``spec_info.positions.numel() // k`` (a CUDA-graph replay pads the batch past them);
    padding requests get a chain. The mask's values are SGLang's: no device value is read here (that would sync),
    so they are not checked as a tree (``DraftTree`` checks the shape; tests check SGLang's layout)."""
    spec = fb.spec_info
    flat = getattr(spec, "custom_mask", None)
    if flat is None:
        raise UnsupportedStepError("a TARGET_VERIFY batch with topk > 1 carries no spec_info.custom_mask: mla_fa3 "
                                   "reads the draft tree from it")
    if not 1 <= k <= MAX_TREE_TOKENS:
        raise UnsupportedStepError(f"a draft tree of {k} tokens per request: mla_fa3 verifies trees of 1 to "
                                   f"{MAX_TREE_TOKENS} tokens")
    if flat.dtype != torch.bool:
        raise UnsupportedStepError(f"spec_info.custom_mask must be bool (SGLang's tree mask), got {flat.dtype}")
    positions = getattr(spec, "positions", None)
    live = bs if positions is None else min(bs, int(positions.numel()) // k)
    flat = flat.reshape(-1)
    prefix = prefix_cpu[:live].to(torch.int64)
    if live == 0:
        mask = torch.zeros(0, k, k, dtype=torch.bool, device=device)
    elif flat.numel() == live * k * k or (qlen_buffer is not None and flat.data_ptr() == qlen_buffer.data_ptr()):
        if flat.numel() < live * k * k:
            raise UnsupportedStepError(f"spec_info.custom_mask has {flat.numel()} entries, fewer than the "
                                       f"{live * k * k} of {live} requests' k x k blocks")
        mask = flat[: live * k * k].view(live, k, k)
    else:
        row = prefix + k  # FULL_MASK: k rows of S_b + k columns per request
        if flat.numel() < int(row.sum()) * k:
            raise UnsupportedStepError(f"spec_info.custom_mask has {flat.numel()} entries, fewer than the "
                                       f"{int(row.sum()) * k} of {live} requests' FULL_MASK blocks")
        start = torch.cumsum(row * k, 0) - row * k
        j = torch.arange(k, dtype=torch.int64)
        index = start[:, None, None] + j[None, :, None] * row[:, None, None] + prefix[:, None, None] + j[None, None, :]
        mask = flat[index.to(flat.device)]
    mask = mask.to(device)
    if live < bs:
        chain = torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(bs - live, k, k)
        mask = torch.cat([mask, chain])
    return DraftTree(mask=mask, mask_cpu=None, verify=True)
