"""The MHA-prefill dispatch point of :class:`~mla_fa3.backend.MLABackend` for extend-like steps.

An EXTEND / MIXED / DRAFT_EXTEND step's MLA layers run either the absorbed path (``absorb.py``:
attention over the latent cache, ``2r + d_rope`` work per score) or the MHA prefill of
``chunked_prefix.py`` (decompress c_kv through W_UK / W_UV and run ordinary ``d_qk / d_v`` attention,
the cached prefix chunk by chunk, merged by LSE; MIXED decode rows stay absorbed). ``path_choice.py``
decides per step from host lengths with a cost model; ``prefill_path`` overrides it
("absorbed" | "mha" | "auto").

The decision is made ONCE per step, at the step's first MLA layer (the layer supplies heads and dims;
extend steps are never graph-captured, so planning there is legal), and the ``PrefillPlan`` it builds
is stored on ``metadata.prefill_plan`` for every later layer. Layers with softcap, a sliding window
or local attention always take the absorbed path (the MHA prefill does not model them). When the
optional modules are missing, "auto" falls back to the absorbed path and "mha" raises.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from mla_fa3 import absorb
from mla_fa3.absorb import DecodeKernel
from mla_fa3.explain import AttentionPath, PathRecord

__all__ = ["ExtendDispatch", "optional_module", "PREFILL_PATHS"]

PREFILL_PATHS = ("auto", "absorbed", "mha")


@functools.lru_cache(maxsize=None)
def optional_module(name: str):
    """``mla_fa3.<name>`` if that file exists (its own import errors propagate), else None. Cached."""
    full = f"mla_fa3.{name}"
    if importlib.util.find_spec(full) is None:
        return None
    return importlib.import_module(full)


class ExtendDispatch:
    """Per-step state of the extend path choice (owned by one MLABackend)."""

    def __init__(self, prefill_path: str, workspace_tokens: int, page_size: int, req_to_token: torch.Tensor,
                 impl=None):
        if prefill_path not in PREFILL_PATHS:
            raise ValueError(f"prefill_path must be one of {PREFILL_PATHS}, got {prefill_path!r}")
        if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, int) or workspace_tokens < page_size:
            raise ValueError(f"prefill_workspace_tokens must be an int >= page_size {page_size}, got {workspace_tokens!r}")
        self.prefill_path = prefill_path
        self.workspace_tokens = workspace_tokens
        self.page_size = page_size
        self.req_to_token = req_to_token  # [rows, max_context] int32, device: the ReqToTokenPool's table
        self.impl = impl
        self._workspace = None  # chunked_prefix.PrefillWorkspace, reused across steps
        self._pending = False  # the step's path is decided at its first MLA layer
        self._batch = None
        self._record: PathRecord | None = None

    def plan_step(self, batch, md) -> PathRecord:
        """Start an extend-like step; the returned record is completed when the path is decided."""
        mode = batch.forward_mode.name
        self._batch, self._pending = batch, False
        md.prefill_plan = None
        if self.prefill_path == "absorbed":
            rec = PathRecord(mode, AttentionPath.ABSORBED, DecodeKernel.FA3.value, "prefill_path='absorbed' (override)")
        elif optional_module("path_choice") is None or optional_module("chunked_prefix") is None:
            if self.prefill_path == "mha":
                raise NotImplementedError("prefill_path='mha' needs mla_fa3.path_choice and mla_fa3.chunked_prefix")
            rec = PathRecord(mode, AttentionPath.ABSORBED, DecodeKernel.FA3.value,
                             "auto: MHA prefill modules unavailable -> absorbed")
        else:
            self._pending = True
            rec = PathRecord(mode, AttentionPath.ABSORBED, DecodeKernel.FA3.value,
                             f"prefill_path='{self.prefill_path}': decided at the step's first MLA layer")
        self._record = rec
        return rec

    def forward(self, q: torch.Tensor, latent_new: torch.Tensor | None, layer, md, kv_paged: torch.Tensor) -> torch.Tensor:
        """One MLA layer of the planned extend-like step -> o [T, H, d_v]."""
        plain = layer.logit_cap == 0 and layer.sliding_window < 0 and not layer.use_local_attention
        if plain and self._pending:
            self._decide(layer, md)
        plan = md.prefill_plan if plain else None
        if plan is None:
            return absorb.forward_absorbed(q, layer, md, kv_paged, kernel=DecodeKernel.FA3, impl=self.impl,
                                           validate=False)
        cp = optional_module("chunked_prefix")
        return cp.forward_mha_prefill(q, latent_new, layer, md, kv_paged, plan, impl=self.impl)

    def _decide(self, layer, md) -> None:
        """===== DISPATCH POINT (MHA prefill): path_choice decides, chunked_prefix plans, once per step. ====="""
        self._pending = False
        pc, cp = optional_module("path_choice"), optional_module("chunked_prefix")
        decision = pc.choose_path(md.prefix_lens_cpu, md.extend_lens_cpu, num_heads=layer.num_heads, dims=layer.mla,
                                  workspace_tokens=self.workspace_tokens, prefill_path=self.prefill_path)
        rec = self._record
        rec.decision, rec.reason = decision, decision.explain()
        if not decision.path.is_mha:
            return
        if self._workspace is None:
            self._workspace = cp.PrefillWorkspace(self.workspace_tokens)
        md.prefill_plan = cp.build_prefill_plan(md, self.req_to_token, self._batch.req_pool_indices,
                                                self.workspace_tokens, self.page_size, workspace=self._workspace)
        rec.path = AttentionPath(decision.path.value)
        rec.kernel = None
