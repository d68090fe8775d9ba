"""A small greedy generate loop over the MLA backend: pools, allocator, batches, optional CUDA graphs.

Per :meth:`Engine.generate` call, for ``n`` prompts of lengths ``L_b`` and ``N`` new tokens each:

1. one ``ReqToTokenPool`` row per request; slots come from the ``PagedAllocator`` (page 0 is the
   padding page, never handed out) as tokens are written;
2. **prefill** — the prompts are cut into chunks of at most ``max_prefill_tokens`` tokens in total
   per step (all prompts in one EXTEND step when it is None); a chunk of request ``b`` starting at
   token ``s`` is an extend row with ``prefix_len = s``, so later chunks attend to the cached earlier
   ones. The last chunk of a prompt gives the logits of its first new token;
3. **decode** — ``N - 1`` batched DECODE steps, one token per request, ``seq_lens = L_b + i + 1``,
   greedy ``argmax``. New tokens stay on the device (the next step's input ids), so a step reads
   nothing back from the device — unless ``eos_token_id`` is set, which needs the tokens on the
   host each step to retire finished requests;
4. the rows and pages are freed.

The backend is planned once per step (``init_forward_metadata``) and run by every layer. With
``use_cuda_graph=True`` the decode steps go through ``mla_fa3.graphs.runner.GraphRunner`` (imported
lazily): one graph per captured batch size, a live batch padded up to the next size. The model runs
wherever its weights are: CPU (reference ops) or CUDA (FA3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.models.deepseek import DeepseekForCausalLM

__all__ = ["Engine", "GenerateResult"]

ProgressFn = Callable[[str, int, int], None]  # (phase "prefill" | "decode", step, total steps)


@dataclass
class GenerateResult:
    """Greedy generation of a list of prompts (request order = prompt order)."""

    token_ids: list[list[int]]  # new tokens per prompt (prompt excluded)
    logits: list[Tensor] | None = None  # per prompt [new tokens, V] float32 cpu: logits each token came from
    prefill_logits: list[Tensor] | None = None  # per prompt [prompt len, V] float32 cpu


def _kv_dtype(value) -> torch.dtype | None:
    """None / a float dtype / torch.float8_e4m3fn, or the names "fp8", "float8_e4m3fn", "auto"."""
    if value is None or value == "auto":
        return None
    if value in ("fp8", "float8_e4m3fn"):
        return torch.float8_e4m3fn
    if isinstance(value, torch.dtype):
        return value
    raise ValueError(f"kv_dtype must be None, 'auto', 'fp8' or a torch.dtype, got {value!r}")


class Engine:
    """Greedy batched generation for a :class:`DeepseekForCausalLM` on an :class:`MLABackend`.

    Args:
        model: a loaded model (its device and dtype decide where the pools live and their dtype).
        page_size: KV page size (1 or a power of two).
        max_batch_size: most requests of one ``generate`` call.
        max_context: longest prompt + new tokens of one request.
        num_pages: KV pages (default: enough for ``max_batch_size`` full contexts, plus page 0).
        max_prefill_tokens: most prompt tokens per prefill step (chunked prefill); None = no limit.
        use_cuda_graph: decode through CUDA graphs (``mla_fa3.graphs.runner``); batch sizes
            ``cuda_graph_batch_sizes`` (default 1, 2, 4, ... up to ``max_batch_size``).
        decode_kernel / prefill_path / impl: passed to :class:`MLABackend`.
        kv_dtype: the latent cache's storage dtype: None (the model's dtype) or ``torch.float8_e4m3fn``
            / ``"fp8"`` (half the bytes per token; page_size 64; FlashMLA FP8 decode).
        kv_scales: per-layer FP8 scales (a list, or one float for every layer); None = the checkpoint's
            (``model.kv_scales``), else 1.0. :meth:`calibrate_kv_scales` measures them on a prefill.
    """

    def __init__(self, model: DeepseekForCausalLM, *, page_size: int = 16, max_batch_size: int = 8,
                 max_context: int = 2048, num_pages: int | None = None, max_prefill_tokens: int | None = None,
                 use_cuda_graph: bool = False, cuda_graph_batch_sizes: Sequence[int] | None = None,
                 decode_kernel: str = "auto", prefill_path: str = "auto", impl=None, kv_dtype=None,
                 kv_scales: Sequence[float] | float | None = None) -> None:
        if not isinstance(model, DeepseekForCausalLM):
            raise TypeError(f"model must be a DeepseekForCausalLM, got {type(model).__name__}")
        for name, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                            ("max_context", max_context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_prefill_tokens is not None and (not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be a positive int or None, got {max_prefill_tokens!r}")
        if any(a is None for a in model.attention_layers):
            raise ValueError("model: prepare_attention() has not run (load it with models.loader.load_model)")
        cfg = model.config
        self.model, self.cfg = model, cfg
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.page_size, self.max_batch_size, self.max_context = page_size, max_batch_size, max_context
        self.max_prefill_tokens = max_prefill_tokens
        if num_pages is None:
            num_pages = max_batch_size * math.ceil(max_context / page_size) + 1
        self.req_to_token_pool = ReqToTokenPool(max_batch_size, max_context, self.device)
        self.allocator = PagedAllocator(num_pages, page_size, self.device)
        kv_dtype = _kv_dtype(kv_dtype)
        self.kv_pool = MLATokenPool(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_lora_rank,
                                    cfg.qk_rope_head_dim, self.dtype, self.device, kv_dtype=kv_dtype)
        if not self.kv_pool.is_fp8:
            if kv_scales is not None:
                raise ValueError("kv_scales are only used with kv_dtype='fp8'")
        elif (kv_scales if kv_scales is not None else model.kv_scales) is not None:
            scales = kv_scales if kv_scales is not None else model.kv_scales
            self.kv_pool.set_scales([scales] * cfg.num_hidden_layers if isinstance(scales, (int, float))
                                    else list(scales))
        self.backend = MLABackend(req_to_token_pool=self.req_to_token_pool, kv_pool=self.kv_pool,
                                  page_size=page_size, device=self.device, decode_kernel=decode_kernel,
                                  num_heads=cfg.num_attention_heads, mla_dims=cfg.mla_dims, prefill_path=prefill_path,
                                  impl=impl)
        self.graph_runner = None
        if use_cuda_graph:
            self.graph_runner = self._make_graph_runner(cuda_graph_batch_sizes)

    # ------------------------------------------------------------------ FP8 calibration
    def calibrate_kv_scales(self, prompts: Sequence[Sequence[int]], *, headroom: float = 1.0,
                            apply: bool = True) -> list[float]:
        """Prefill ``prompts`` once, measuring each layer's absmax of the latent rows stored (before
        quantization); returns the proposed per-layer scales ``absmax · headroom / 448`` and, with
        ``apply``, sets them on the FP8 pool (the calibration's pages are freed first)."""
        if not self.kv_pool.is_fp8:
            raise ValueError("calibrate_kv_scales needs an FP8 latent pool (kv_dtype='fp8')")
        self.kv_pool.observe_absmax()
        try:
            self.generate(prompts, 1)
            scales = self.kv_pool.proposed_scales(headroom)
        finally:
            self.kv_pool.observe_absmax(False)
        if apply:
            self.kv_pool.set_scales(scales)
        return scales

    # ------------------------------------------------------------------ CUDA graphs
    def _make_graph_runner(self, batch_sizes: Sequence[int] | None):
        try:
            from mla_fa3.graphs.runner import GraphRunner
        except ImportError as exc:
            raise ImportError(f"use_cuda_graph needs mla_fa3.graphs.runner: {exc}") from exc
        if batch_sizes is None:
            batch_sizes = sorted({min(2 ** i, self.max_batch_size)
                                  for i in range(self.max_batch_size.bit_length() + 1)})

        def decode_step(batch: ForwardBatch, inputs: dict) -> Tensor:
            return self.model(inputs["input_ids"], batch.positions, batch, self.backend)

        return GraphRunner(self.backend, decode_step, batch_sizes=batch_sizes, mode=ForwardMode.DECODE,
                           max_context=self.max_context, device=self.device)

    # ------------------------------------------------------------------ generation
    def _check_prompts(self, prompts, max_new_tokens: int) -> list[list[int]]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"prompts holds {len(prompts)} requests, more than max_batch_size {self.max_batch_size}")
        out = []
        for i, p in enumerate(prompts):
            ids = [int(t) for t in (p.tolist() if isinstance(p, Tensor) else p)]
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
                raise ValueError(f"prompts[{i}] holds token ids outside [0, {self.cfg.vocab_size})")
            if len(ids) + max_new_tokens > self.max_context:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens + max_new_tokens {max_new_tokens} exceed "
                                 f"max_context {self.max_context}")
            out.append(ids)
        return out

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, eos_token_id: int | None = None,
                 return_logits: bool = False, return_prefill_logits: bool = False,
                 progress: ProgressFn | None = None) -> GenerateResult:
        """Greedy generation for every prompt at once; see the module docstring for the steps."""
        prompts = self._check_prompts(prompts, max_new_tokens)
        n = len(prompts)
        rows = self.req_to_token_pool.alloc(n)
        try:
            first, first_logits, prefill_logits = self._prefill(prompts, rows, return_prefill_logits, progress)
            tokens, logits = self._decode(prompts, rows, first, first_logits, max_new_tokens, eos_token_id,
                                          return_logits, progress)
        finally:
            for row in rows:  # freed pages are zeroed: kernels read whole pages (see clear_pages)
                self.kv_pool.clear_pages(self.allocator.free_request(self.req_to_token_pool, row))
            self.req_to_token_pool.free(rows)
        return GenerateResult(token_ids=tokens, logits=logits, prefill_logits=prefill_logits)

    def _prefill(self, prompts, rows, return_prefill_logits, progress):
        """Chunked EXTEND steps. Returns (first tokens [n] device, their logits [n, V], prefill logits)."""
        budget = self.max_prefill_tokens or sum(len(p) for p in prompts)
        chunks = []  # (request index, start, length), in request order
        for b, p in enumerate(prompts):
            for s in range(0, len(p), budget):
                chunks.append((b, s, min(budget, len(p) - s)))
        steps, cur, used = [], [], 0
        for c in chunks:
            if used + c[2] > budget and cur:
                steps.append(cur)
                cur, used = [], 0
            cur.append(c)
            used += c[2]
        steps.append(cur)
        n, V = len(prompts), self.cfg.vocab_size
        last_logits = torch.empty(n, V, dtype=torch.float32, device=self.device)
        all_logits = [[] for _ in prompts] if return_prefill_logits else None
        for i, step in enumerate(steps):
            locs = [self.allocator.alloc_for_request(self.req_to_token_pool, rows[b], s, ln) for b, s, ln in step]
            ids = torch.tensor([t for b, s, ln in step for t in prompts[b][s:s + ln]], dtype=torch.int64)
            batch = ForwardBatch.extend([rows[b] for b, _, _ in step], [s for _, s, _ in step],
                                        [ln for _, _, ln in step], torch.cat(locs), self.device)
            ends = torch.tensor([ln for _, _, ln in step], dtype=torch.int64).cumsum(0) - 1
            self.backend.init_forward_metadata(batch)
            if return_prefill_logits:
                out = self.model(ids.to(self.device), batch.positions, batch, self.backend).float()
                for (b, _, _), lo, hi in zip(step, [0] + (ends + 1).tolist()[:-1], (ends + 1).tolist()):
                    all_logits[b].append(out[lo:hi].cpu())
                out = out[ends.to(self.device)]
            else:
                out = self.model(ids.to(self.device), batch.positions, batch, self.backend,
                                 logit_rows=ends.to(self.device)).float()
            done = [j for j, (b, s, ln) in enumerate(step) if s + ln == len(prompts[b])]
            if done:
                reqs = torch.tensor([step[j][0] for j in done], dtype=torch.int64, device=self.device)
                last_logits[reqs] = out[torch.tensor(done, dtype=torch.int64, device=self.device)]
            if progress is not None:
                progress("prefill", i + 1, len(steps))
        prefill = [torch.cat(x) for x in all_logits] if return_prefill_logits else None
        return last_logits.argmax(dim=-1), last_logits, prefill

    def _decode(self, prompts, rows, first, first_logits, max_new_tokens, eos_token_id, return_logits, progress):
        """Batched DECODE steps. Returns (new tokens per prompt, their logits per prompt or None)."""
        n = len(prompts)
        seq = [len(p) for p in prompts]  # tokens in the cache + the pending token, per request
        active = list(range(n))
        cur = first  # [len(active)] device: the token each active request feeds next
        toks = [[] for _ in range(n)]  # host ints, filled from `pending` at the end
        logit_rows = [[first_logits[b].cpu()] for b in range(n)] if return_logits else None
        pending = [(list(active), cur)]
        for step in range(max_new_tokens - 1):
            if eos_token_id is not None:
                host = cur.tolist()  # the one read-back per step that early stopping needs
                keep = [j for j, b in enumerate(active) if host[j] != eos_token_id]
                if len(keep) < len(active):
                    idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
                    active, cur = [active[j] for j in keep], cur[idx]
                if not active:
                    break
            locs = [self.allocator.alloc_for_request(self.req_to_token_pool, rows[b], seq[b], 1) for b in active]
            for b in active:
                seq[b] += 1
            batch = ForwardBatch.decode([rows[b] for b in active], [seq[b] for b in active], torch.cat(locs),
                                        self.device)
            if self.graph_runner is not None:
                logits = self.graph_runner.run(batch, {"input_ids": cur}).float()
            else:
                self.backend.init_forward_metadata(batch)
                logits = self.model(cur, batch.positions, batch, self.backend).float()
            if return_logits:
                host_logits = logits.cpu()
                for j, b in enumerate(active):
                    logit_rows[b].append(host_logits[j])
            cur = logits.argmax(dim=-1)
            pending.append((list(active), cur))
            if progress is not None:
                progress("decode", step + 1, max_new_tokens - 1)
        for reqs, t in pending:  # one read-back of every generated token at the end
            for b, tok in zip(reqs, t.tolist()):
                if eos_token_id is None or not toks[b] or toks[b][-1] != eos_token_id:
                    toks[b].append(tok)
        logits = [torch.stack(x)[: len(toks[b])] for b, x in enumerate(logit_rows)] if return_logits else None
        return toks, logits
