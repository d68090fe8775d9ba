"""DeepSeek feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts (MoE).

Symbols: ``T`` tokens, ``D`` hidden size, ``E`` routed experts, ``K`` experts per token
(``num_experts_per_tok``), ``G`` expert groups (``n_group``), ``Kg`` groups kept (``topk_group``).

SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.

Routing (per token, in float32 with a float32 gate weight ``[E, D]``)::

    logits = x · W_gateᵀ                                        [T, E]
    scores = softmax(logits)          (V2, scoring_func "softmax")
           = sigmoid(logits)          (V3, scoring_func "sigmoid")
    choice = scores + e_score_correction_bias   (V3 only: the bias steers *selection*, never weights)
    group-limited selection (topk_method "group_limited_greedy" (V2) / "noaux_tc" (V3)):
        group score = max of the group's choice scores (V2) / sum of its top-2 choice scores (V3)
        keep the Kg best groups, mask the other groups' experts out
    idx     = top-K experts of the (masked) choice scores                          [T, K]
    weights = scores[idx]  (unbiased);  / sum(weights) when norm_topk_prob;  * routed_scaling_factor
    y = Σ_k weights[k] · Expert_idx[k](x)  +  SharedExperts(x)

Topk method "greedy" (V2-Lite) is plain top-K over the scores. Renormalisation follows the V3 rule
for both scorings (DeepSeek's own V3 code, SGLang): normalise when ``norm_topk_prob``, then scale by
``routed_scaling_factor``. Released V2 checkpoints set ``norm_topk_prob=false``, where this equals
both DeepSeek's V2 code and transformers' V2 model.

Experts are stored stacked (``w_gate_up [E, 2I, D]``, ``w_down [E, D, I]``) and computed in plain
torch: a loop over the experts that received tokens (``sparse``; gathers indices, so it syncs) or,
while a CUDA graph is being captured, over all experts with zero weights for unselected ones
(``dense``; static shapes, no sync, E x the FLOPs — meant for the small models graphs are used on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MLP", "Router", "MoE"]


def _act(name: str):
    if name != "silu":
        raise ValueError(f"hidden_act must be 'silu' for DeepSeek models, got {name!r}")
    return F.silu


class MLP(nn.Module):
    """SwiGLU feed-forward: gate_proj/up_proj [I, D], down_proj [D, I] (HF names)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-K gate. ``weight`` [E, D] float32; ``e_score_correction_bias`` [E] float32 (sigmoid scoring)."""

    def __init__(self, cfg, *, device=None) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.scoring_func, self.topk_method = cfg.scoring_func, cfg.topk_method
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32, device=device))
        if self.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (weights [T, K] float32, idx [T, K] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.topk_method in ("group_limited_greedy", "noaux_tc") and self.n_group > 1:
            T, G = choice.shape[0], self.n_group
            grouped = choice.view(T, G, self.num_experts // G)
            if self.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = group_scores.topk(self.topk_group, dim=-1).indices  # [T, Kg]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(T, -1)
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, idx


class MoE(nn.Module):
    """Routed experts + shared experts. ``w_gate_up`` [E, 2I, D] (gate rows then up rows), ``w_down`` [E, D, I]."""

    def __init__(self, cfg, *, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        _act(cfg.hidden_act)
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.inter = E, I
        self.gate = Router(cfg, device=device)
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * I, D, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(E, D, I, dtype=dtype, device=device))
        self.shared_experts = (MLP(D, I * cfg.n_shared_experts, dtype=dtype, device=device)
                               if cfg.n_shared_experts else None)

    def _expert(self, e: int, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w_gate_up[e]).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down[e])

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, D]."""
        weights, idx = self.gate(x)
        out = torch.zeros_like(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # dense: every expert on every token, weight 0 where not selected (graph-safe, no sync)
            for e in range(self.num_experts):
                w_e = (weights * (idx == e)).sum(dim=-1, keepdim=True)  # [T, 1] float32
                out += (self._expert(e, x) * w_e).to(x.dtype)
        else:
            hit = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
            hit[idx.flatten()] = True
            for e in hit.nonzero().flatten().tolist():
                token, slot = torch.where(idx == e)
                y = self._expert(e, x[token]) * weights[token, slot, None]
                out.index_add_(0, token, y.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
