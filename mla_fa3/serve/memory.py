"""The memory planner: what a serving configuration needs on one GPU, and how many KV tokens fit.

For a model config (one rank's view under tensor parallelism), weight and KV dtypes, page size ``p``,
GPU memory ``M`` and the serving limits, every term in bytes::

    weights    = Σ parameters (+ buffers) of the model as built  (meta-device build: exact, no allocation;
                 weight_dtype 'fp8': 2-D projection weights at 1 B + one fp32 scale per 128x128 block)
    absorbed   = layers · H · r · (d_nope + d_v) · elem          W_UK / W_UV, derived once at load
    req_table  = max_running · max_context · 4                  ReqToTokenPool (int32)
    workspace  = 2 · (T · a + W · H · (d_nope + d_rope + d_v) · elem + max_running · V · 4)
                 T = token_budget (a step's new tokens), a = activation bytes per token (hidden states,
                 q, latent, q_lat / o_lat, MLP intermediate), W = prefill_workspace_tokens (the chunked
                 MHA prefill's decompressed K/V chunk), logits in fp32; ×2 for temporaries
    graphs     = 2 · b_max · a + Σ_b b · V · elem · kernels + b_max · ceil(max_context / p) · 4
                 (one shared pool sized by the largest graph; each graph keeps its logits output;
                 the captured page table)
    reserved   = CUDA context and library handles (``reserved_gib``, default 1 GiB)
    headroom   = headroom_fraction · M   (fragmentation, allocator caching)
    KV pool    = M − everything above;  per token: layers · (r + d_rope) · kv_elem
                 (576 B per layer in fp8 e4m3, 1152 B in bf16 at V3 dims)
    pages      = floor(KV pool / (p · per-token bytes))  (page 0 is the padding page: usable = pages − 1)

A configuration that leaves no room for one request of ``max_context`` tokens raises
:class:`MemoryPlanError` naming the largest term, before anything is allocated. The workspace and
graph terms are estimates (upper bounds of the big tensors, doubled); weights, absorbed, the request
table and the KV pool are exact — ``tests/test_serve_memory.py`` checks them against the allocations.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from mla_fa3.checks import check_int, check_real
from mla_fa3.models.deepseek import DeepseekConfig, DeepseekForCausalLM

__all__ = ["MemoryPlanError", "MemoryPlan", "plan_memory", "KV_DTYPES", "WEIGHT_DTYPES", "H200_MEMORY_GIB"]

GIB = 1 << 30
H200_MEMORY_GIB = 139.8  # what torch.cuda.mem_get_info reports as total on the H200 (141 GB)
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
_FP8_BLOCK = 128


class MemoryPlanError(ValueError):
    """The configuration does not fit the GPU; the message names the largest term and what to shrink."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of every term (module docstring) and the KV pool that fits."""

    gpu_memory_bytes: int
    weight_dtype: str
    kv_dtype: str
    page_size: int
    num_layers: int
    max_running: int
    max_context: int
    token_budget: int
    weights_bytes: int
    absorbed_bytes: int
    req_to_token_bytes: int
    workspace_bytes: int
    graph_bytes: int
    reserved_bytes: int
    headroom_bytes: int
    kv_bytes_per_token_layer: int
    num_pages: int  # pages of the pool, padding page 0 included
    kv_pool_bytes: int  # num_pages · p · layers · per-token-layer bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.num_layers

    @property
    def kv_tokens(self) -> int:
        """Usable KV tokens (page 0 excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def full_context_requests(self) -> int:
        """Requests of ``max_context`` tokens the pool holds at once."""
        return (self.num_pages - 1) // math.ceil(self.max_context / self.page_size)

    def terms(self) -> list[tuple[str, int, str]]:
        """(name, bytes, note) rows of the plan, summing to the GPU memory (plus what is left over)."""
        used = (self.weights_bytes + self.absorbed_bytes + self.req_to_token_bytes + self.workspace_bytes
                + self.graph_bytes + self.reserved_bytes + self.headroom_bytes + self.kv_pool_bytes)
        return [
            ("weights", self.weights_bytes, f"{self.weight_dtype}"),
            ("absorbed W_UK/W_UV", self.absorbed_bytes, "derived at load"),
            ("request table", self.req_to_token_bytes, f"{self.max_running} x {self.max_context} int32"),
            ("workspace", self.workspace_bytes, f"estimate: {self.token_budget} tokens/step, x2"),
            ("CUDA graphs", self.graph_bytes, "estimate"),
            ("reserved", self.reserved_bytes, "CUDA context"),
            ("headroom", self.headroom_bytes, "fragmentation"),
            ("KV pool", self.kv_pool_bytes, f"{self.kv_tokens} tokens, {self.num_pages} pages of {self.page_size}, "
                                            f"{self.kv_bytes_per_token_layer} B/token/layer ({self.kv_dtype})"),
            ("unused", self.gpu_memory_bytes - used, "rounding to whole pages"),
        ]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(kv_tokens=self.kv_tokens, kv_bytes_per_token=self.kv_bytes_per_token,
                 full_context_requests=self.full_context_requests)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_table(self) -> str:
        lines = [f"{'term':<20} {'GiB':>9}  note", "-" * 72]
        for name, b, note in self.terms():
            lines.append(f"{name:<20} {b / GIB:>9.3f}  {note}")
        lines.append("-" * 72)
        lines.append(f"{'GPU memory':<20} {self.gpu_memory_bytes / GIB:>9.3f}")
        lines.append(f"KV tokens: {self.kv_tokens} ({self.full_context_requests} requests of {self.max_context} "
                     f"tokens at once; {self.kv_bytes_per_token} B per token over {self.num_layers} layers)")
        return "\n".join(lines)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def weight_bytes(cfg: DeepseekConfig, weight_dtype: str = "bf16") -> int:
    """Bytes of the model's parameters and buffers as built (meta device: exact shapes, no memory)."""
    dtype = WEIGHT_DTYPES[weight_dtype]
    build = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    model = DeepseekForCausalLM(cfg, dtype=build, device="meta")
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if dtype == torch.float8_e4m3fn and t.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name \
                and t.dtype == build:
            rows, cols = t.shape[-2], t.shape[-1]
            blocks = math.prod(t.shape[:-2]) * math.ceil(rows / _FP8_BLOCK) * math.ceil(cols / _FP8_BLOCK)
            total += t.numel() + 4 * blocks
        else:
            total += t.numel() * t.element_size()
    return total


def plan_memory(cfg: DeepseekConfig, *, gpu_memory_gib: float = H200_MEMORY_GIB, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16", page_size: int = 64, max_running: int = 128, max_context: int = 131072,
                token_budget: int = 8192, prefill_workspace_tokens: int = 8192,
                graph_batch_sizes: Sequence[int] = (), graph_kernels: int = 1, reserved_gib: float = 1.0,
                headroom_fraction: float = 0.05) -> MemoryPlan:
    """The plan (module docstring); MemoryPlanError when not even one ``max_context`` request fits."""
    if not isinstance(cfg, DeepseekConfig):
        raise TypeError(f"cfg must be a DeepseekConfig, got {type(cfg).__name__}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    gpu = int(check_real(gpu_memory_gib, "gpu_memory_gib", positive=True) * GIB)
    for name, v in (("page_size", page_size), ("max_running", max_running), ("max_context", max_context),
                    ("token_budget", token_budget), ("prefill_workspace_tokens", prefill_workspace_tokens),
                    ("graph_kernels", graph_kernels)):
        check_int(v, name)
    for b in graph_batch_sizes:
        check_int(b, "graph_batch_sizes")
    if not 0 <= check_real(headroom_fraction, "headroom_fraction") < 1:
        raise ValueError(f"headroom_fraction must be in [0, 1), got {headroom_fraction}")
    act_dtype = torch.bfloat16 if weight_dtype == "fp8" else WEIGHT_DTYPES[weight_dtype]
    elem, kv_elem = _elem(act_dtype), _elem(KV_DTYPES[kv_dtype])
    L, H, D, V = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size, cfg.vocab_size
    r, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    weights = weight_bytes(cfg, weight_dtype)
    absorbed = L * H * r * (dn + dv) * elem
    req_table = max_running * max_context * 4
    mlp = max(cfg.intermediate_size, cfg.num_experts_per_tok * cfg.moe_intermediate_size * 2
              + cfg.n_shared_experts * cfg.moe_intermediate_size)
    act = (4 * D + (cfg.q_lora_rank or 0) + H * (dn + dr) + (r + dr) + 2 * H * r + H * dv + 3 * mlp) * elem
    workspace = 2 * (token_budget * act + prefill_workspace_tokens * H * (dn + dr + dv) * elem + max_running * V * 4)
    graphs = 0
    if graph_batch_sizes:
        b_max = max(graph_batch_sizes)
        graphs = (2 * b_max * act + sum(graph_batch_sizes) * V * elem * graph_kernels
                  + b_max * math.ceil(max_context / page_size) * 4)
    reserved = int(check_real(reserved_gib, "reserved_gib") * GIB)
    headroom = int(headroom_fraction * gpu)
    per_token_layer = (r + dr) * kv_elem
    page_bytes = page_size * L * per_token_layer
    fixed = {"weights": weights, "absorbed W_UK/W_UV": absorbed, "request table": req_table,
             "workspace": workspace, "CUDA graphs": graphs, "reserved": reserved, "headroom": headroom}
    left = gpu - sum(fixed.values())
    need_pages = math.ceil(max_context / page_size) + 1
    if left < need_pages * page_bytes:
        big = max(fixed, key=fixed.get)
        raise MemoryPlanError(
            f"gpu_memory_gib: {gpu / GIB:.2f} GiB leaves {max(left, 0) / GIB:.3f} GiB for the KV pool, less than the "
            f"{need_pages * page_bytes / GIB:.3f} GiB one request of max_context {max_context} needs; the largest term "
            f"is {big} ({fixed[big] / GIB:.2f} GiB) — use more GPUs (fewer heads / layers per rank), an fp8 "
            f"weight or KV dtype, or a smaller max_context / token_budget / max_running")
    num_pages = left // page_bytes
    return MemoryPlan(gpu_memory_bytes=gpu, weight_dtype=weight_dtype, kv_dtype=kv_dtype, page_size=page_size,
                      num_layers=L, max_running=max_running, max_context=max_context, token_budget=token_budget,
                      weights_bytes=weights, absorbed_bytes=absorbed, req_to_token_bytes=req_table,
                      workspace_bytes=workspace, graph_bytes=graphs, reserved_bytes=reserved, headroom_bytes=headroom,
                      kv_bytes_per_token_layer=per_token_layer, num_pages=int(num_pages),
                      kv_pool_bytes=int(num_pages) * page_bytes)
