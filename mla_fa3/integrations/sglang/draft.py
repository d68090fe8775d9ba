"""The EAGLE draft model's multi-step decode backend on mla_fa3 (SGLang 0.5.17), the counterpart of SGLang's
``FlashAttentionMultiStepBackend`` (``srt/layers/attention/flashattention_backend.py``).

SGLang builds the draft model's backends from its own table (``srt/speculative/draft_utils.py``,
``DraftBackendFactory``); ``plugin.register`` hooks ``create_decode_backend`` so that a draft whose resolved backend
is ``mla_fa3`` gets :class:`SGLangMLAMultiStepDraftBackend` (:func:`route_draft_decode`), and
``create_draft_extend_backend`` of one gets the target's adapter, :class:`SGLangMLABackend`, over the draft's pools
(:func:`route_draft_extend`): DRAFT_EXTEND_V2 (the draft model's extend over a fixed window of tokens per request)
converts to a chain verify's shape there (``convert.py``), eager and under SGLang's draft-extend CUDA graphs. A
DRAFT_EXTEND batch handed to the multi-step decode backend raises
:class:`~mla_fa3.integrations.sglang.convert.UnsupportedStepError`.

The draft step, as SGLang's EAGLE runs it (``speculative/eagle_worker_v2.py:draft_forward``,
``speculative/eagle_worker_common.py:prepare_for_draft``), for bs requests with committed prefixes ``P_b`` (the
draft batch's ``seq_lens``), ``topk`` branches and ``S`` = ``speculative_num_steps``::

    prepare_for_draft   req_to_token[b, P_b + j·S + s] = draft slot of branch j, step s   (branch-major; page 1 or
                        topk 1 — page > 1 with topk > 1: each branch on its own pages, see :func:`draft_columns`)
    init_forward_metadata(fb)              every step's plan at once (attn_backends[i], i < S - 1)
    for i in 0 .. S - 2:                   (the last step's token needs no forward)
        fb.out_cache_loc = slots of step i   [bs·topk]: the model stores each branch's latent row there
        layer(...) -> attn_backends[i]     query row b·topk + j (branch j of request b) sees
                                             the prefix req_to_token[b, :P_b]  and  its own keys of steps 0 .. i

Worked example, topk = 2, S = 3, P = [5]: the row's draft columns 5..10 are [j0s0 j0s1 j0s2 j1s0 j1s1 j1s2]; at
step 1 branch 0 sees columns 0..4 and 5, 6; branch 1 sees 0..4 and 8, 9. The same at page 4: the prefix's tail
page holds column 4, each branch gets ceil((1 + 3) / 4) = 1 page: branch 0 at columns 5..7, branch 1 at 9..11.

Step i's batch (ours, :meth:`SGLangDraftStepBackend._convert`): topk > 1, a DRAFT_DECODE tree step —
``seq_lens = P + topk·S`` (the tree keys: the row's last topk·S columns at page 1, the batch's
``tree_key_columns`` = :func:`draft_columns` at page > 1), ``tree =
DraftTree.draft(sglang_draft_mask(bs, topk, S, i))`` (the same layout as :func:`mla_fa3.draft_backend.sglang_tree_steps`),
run by the core as the prefix part on the plan's kernel plus the tree part, merged by LSE; topk = 1, a chain —
``seq_lens = P + i + 1``, one query per request over its first P + i + 1 columns. Either way the slots step i writes
are gathered on the device from ``req_to_token`` (no sync) for the plan; the layer stores at SGLang's live
``fb.out_cache_loc``.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangMode
from sglang.srt.model_executor.forward_batch_info import build_inner_fb_view

from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.integrations.sglang.adapter import SGLangMLABackend
from mla_fa3.integrations.sglang.convert import UnsupportedStepError, host_int32
from mla_fa3.tree import DraftTree, sglang_draft_mask

__all__ = ["SGLangDraftStepBackend", "SGLangMLAMultiStepDraftBackend", "create_draft_decode_backend",
           "route_draft_decode", "route_draft_extend", "draft_columns"]


def draft_columns(prefix: torch.Tensor, topk: int, num_steps: int, page_size: int) -> torch.Tensor:
    """[bs, topk·S] int64 ``req_to_token`` columns of each request's draft tokens, branch-major (key j·S + s: branch
    j, step s), as SGLang's ``prepare_for_draft`` lays them out (``speculative/eagle_worker_common.py``), from the
    committed prefixes ``prefix`` [bs] (device; no host read). Page 1: contiguous after the prefix, ``P + j·S + s``.
    Page > 1 with topk > 1: each branch on its own pages, ``B + j·N·page + t + s`` with the prefix's last partial page
    at ``B = P - t``, ``t = P % page``, ``N = ceil((t + S) / page)`` pages per branch (SGLang copies the prefix tail
    into each branch's first page; the prefix part reads it at columns [B, P) of the prefix)."""
    P = prefix.to(torch.int64)
    tail = P % page_size
    per_branch = (tail + num_steps + page_size - 1) // page_size * page_size  # N·page columns per branch
    branch = torch.arange(topk, dtype=torch.int64, device=P.device)
    starts = (P - tail)[:, None] + branch[None, :] * per_branch[:, None] + tail[:, None]  # [bs, topk]
    steps = torch.arange(num_steps, dtype=torch.int64, device=P.device)
    return (starts[:, :, None] + steps[None, None, :]).reshape(P.shape[0], topk * num_steps)


class SGLangDraftStepBackend(SGLangMLABackend):
    """Draft step ``step`` of ``num_steps`` (``attn_backends[step]``): SGLangMLABackend's pools, planning, CUDA-graph
    protocol and absorbed forward, with SGLang's draft batch converted into this step's tree (or chain) batch."""

    def __init__(self, model_runner, topk: int, num_steps: int, step: int):
        super().__init__(model_runner)
        self._verify_mask = None  # a draft model never verifies
        self.topk, self.num_steps, self.step = int(topk), int(num_steps), int(step)
        self._trees: dict[int, DraftTree] = {}  # bs -> this step's tree on the device (constant per bs)

    def _tree(self, bs: int) -> DraftTree:
        tree = self._trees.get(bs)
        if tree is None:
            tree = DraftTree.draft(sglang_draft_mask(bs, self.topk, self.num_steps, self.step), self.device)
            self._trees[bs] = tree
        return tree

    def _convert(self, fb) -> ForwardBatch:
        """SGLang's draft batch (``seq_lens`` = the committed prefixes) -> our DRAFT_DECODE batch of this step."""
        mode = getattr(fb, "actual_forward_mode", None) or fb.forward_mode
        name = getattr(mode, "name", str(mode))
        if name == "IDLE" or int(fb.batch_size) == 0:
            return ForwardBatch.idle(self.device)
        if name not in ("DECODE", "DRAFT_DECODE"):  # SGLang's draft decode steps run as DECODE with spec_info
            raise UnsupportedStepError(f"forward_mode {name} reached mla_fa3's multi-step draft decode backend, which "
                                       "serves the draft's DECODE steps only (DRAFT_EXTEND runs on the draft-extend "
                                       "backend, SGLangMLABackend)")
        bs, topk, S, i = int(fb.batch_size), self.topk, self.num_steps, self.step
        rows = fb.req_pool_indices[:bs].to(torch.int64)
        prefix_cpu = host_int32(fb.seq_lens_cpu, "seq_lens_cpu", bs)
        prefix = fb.seq_lens[:bs].to(torch.int32)
        table = self.req_to_token_pool.req_to_token
        last = table.shape[1] - 1  # columns clamped: padding rows of a replay; a live overflow fails validation
        if topk == 1:
            col = (prefix.to(torch.int64) + i).clamp(max=last)
            loc = table[rows, col].to(torch.int64)
            return ForwardBatch(forward_mode=ForwardMode.DRAFT_DECODE, batch_size=bs, req_pool_indices=rows,
                                seq_lens=prefix + (i + 1), seq_lens_cpu=prefix_cpu + (i + 1), out_cache_loc=loc,
                                draft_step=i)
        # the draft tokens' columns [bs, topk·S], branch-major; step i's slots: key j·S + i of each branch
        cols = draft_columns(prefix, topk, S, self.page_size).clamp_(max=last)
        loc = table[rows[:, None], cols[:, i::S]].reshape(-1).to(torch.int64)
        n = topk * S
        return ForwardBatch(forward_mode=ForwardMode.DRAFT_DECODE, batch_size=bs, req_pool_indices=rows,
                            seq_lens=prefix + n, seq_lens_cpu=prefix_cpu + n, out_cache_loc=loc,
                            num_draft_tokens=topk, draft_step=i, tree=self._tree(bs),
                            tree_key_columns=cols if self.page_size > 1 else None)


class SGLangMLAMultiStepDraftBackend:
    """SGLang's multi-step draft decode container (the interface of ``FlashAttentionMultiStepBackend``):
    ``attn_backends[i]`` serves draft step i (i < num_steps - 1); the worker runs step i's layers under it."""

    needs_cpu_seq_lens = True  # every step is planned from host prefix lengths

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        topk, steps = int(topk), int(speculative_num_steps)
        if topk < 1 or steps < 2:
            raise ValueError(f"a multi-step draft needs topk >= 1 and speculative_num_steps >= 2, got topk {topk}, "
                             f"speculative_num_steps {steps}")
        self.model_runner, self.topk, self.speculative_num_steps = model_runner, topk, steps
        self.attn_backends = [SGLangDraftStepBackend(model_runner, topk, steps, i) for i in range(steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan every step (eager): step i's metadata lives in ``attn_backends[i]``."""
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        for backend in self.attn_backends:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Capture, or a replay's host update, of every step: each on SGLang's inner DECODE view of the batch (which
        keeps the batch's own mode as ``actual_forward_mode``: each step refuses a DRAFT_EXTEND by name)."""
        inner = build_inner_fb_view(forward_batch, bs=forward_batch.batch_size, forward_mode=SGLangMode.DECODE,
                                    encoder_lens=getattr(forward_batch, "encoder_lens", None))
        for backend in self.attn_backends:
            backend.init_forward_metadata_out_graph(inner, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.attn_backends[0].get_cuda_graph_seq_len_fill_value()


def create_draft_decode_backend(model_runner, topk: int, speculative_num_steps: int):
    return SGLangMLAMultiStepDraftBackend(model_runner, topk, speculative_num_steps)


def _resolved_name(factory, field: str) -> str | None:
    """The backend name ``DraftBackendFactory._create_backend`` picks (draft_utils.py): the draft flag, else the
    server's ``field``, else ``attention_backend``."""
    sa = factory.server_args
    return factory.draft_attn_backend or getattr(sa, field, None) or sa.attention_backend


def route_draft_decode(original, factory, *args, backend_name: str, **kwargs):
    """AROUND hook on ``DraftBackendFactory.create_decode_backend`` (``plugin.DRAFT_HOOKS`` binds ``backend_name``,
    ``mla_fa3``): ours when the draft resolves to ``backend_name``, else SGLang's ``original``."""
    if _resolved_name(factory, "decode_attention_backend") != backend_name:
        return original(factory, *args, **kwargs)
    if factory.speculative_num_steps <= 1:  # as SGLang: no multi-step backend for 0 or 1 steps
        return None
    return create_draft_decode_backend(factory.draft_model_runner, factory.topk, factory.speculative_num_steps)


def route_draft_extend(original, factory, *args, backend_name: str, **kwargs):
    """AROUND hook on ``DraftBackendFactory.create_draft_extend_backend``: an ``mla_fa3`` draft's DRAFT_EXTEND runs on
    :class:`SGLangMLABackend` over the draft model's pools (as SGLang builds its own entry for the draft there);
    other names: SGLang's ``original``."""
    field = "decode_attention_backend" if getattr(factory.server_args, "speculative_attention_mode", None) == "decode" \
        else "prefill_attention_backend"
    if _resolved_name(factory, field) != backend_name:
        return original(factory, *args, **kwargs)
    return SGLangMLABackend(factory.draft_model_runner)
