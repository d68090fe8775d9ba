"""Greedy generation of a fixed set of prompts: the serving loop with every request arriving at once.

Per :meth:`Engine.generate` call, for ``n`` prompts of lengths ``L_b`` and ``N`` new tokens each, the
requests join :class:`mla_fa3.serve.loop.ServingLoop` together and it runs them to completion:

1. one ``ReqToTokenPool`` row per running request; slots come from the ``PagedAllocator`` (page 0 is
   the padding page, never handed out) as tokens are written;
2. **prefill** — prompts are cut into chunks of at most ``max_prefill_tokens`` new tokens per step
   (all prompts in one EXTEND step when it is None); a chunk starting at token ``s`` is an extend
   row with ``prefix_len = s``, so later chunks attend to the cached earlier ones; the last chunk of
   a prompt gives its first new token. A step may hold decode rows of requests already past their
   prompt next to prefill chunks (MIXED);
3. **decode** — one token per request per step, greedy ``argmax`` (or, with ``forced_tokens``, the
   teacher-forced token: validation scores every cache setting on the same contexts); the next step's
   input ids are gathered from the previous step's samples on the device, and tokens reach the host one
   step late (``eos_token_id`` retires a request; its token is kept);
4. rows and pages are freed as each request finishes (``Scheduler.finish``; freed pages are zeroed).

A request longer than the model's ``max_position_embeddings`` (prompt + new tokens) is refused
before anything runs, unless the engine is built with ``allow_past_max_position=True`` (then a
warning is logged: RoPE past the trained range gives degraded output).

With ``use_cuda_graph=True`` DECODE steps replay ``mla_fa3.graphs.runner.GraphRunner`` graphs (one per
captured batch size, a live batch padded up to the next size). The model runs wherever its weights
are: CPU (reference ops) or CUDA (FA3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from mla_fa3.models.deepseek import DeepseekForCausalLM
from mla_fa3.serve.loop import ServingLoop
from mla_fa3.serve.scheduler import Request

__all__ = ["Engine", "GenerateResult"]

ProgressFn = Callable[[str, int, int], None]  # (phase "prefill" | "decode" | "mixed", step, estimated steps)
logger = logging.getLogger(__name__)


@dataclass
class GenerateResult:
    """Greedy generation of a list of prompts (request order = prompt order)."""

    token_ids: list[list[int]]  # new tokens per prompt (prompt excluded)
    logits: list[Tensor] | None = None  # per prompt [new tokens, V] float32 cpu: logits each token came from
    prefill_logits: list[Tensor] | None = None  # per prompt [prompt len, V] float32 cpu


class Engine:
    """Greedy batched generation for a :class:`DeepseekForCausalLM` on an :class:`MLABackend`.

    Args:
        model: a loaded model (its device and dtype decide where the pools live and their dtype).
        page_size: KV page size (1 or a power of two).
        max_batch_size: most requests of one ``generate`` call.
        max_context: longest prompt + new tokens of one request.
        num_pages: KV pages (default: enough for ``max_batch_size`` full contexts, plus page 0).
        max_prefill_tokens: most new tokens per step (chunked prefill); None = every prompt in one step.
        use_cuda_graph: decode through CUDA graphs (``mla_fa3.graphs.runner``); batch sizes
            ``cuda_graph_batch_sizes`` (default 1, 2, 4, ... up to ``max_batch_size``).
        decode_kernel / prefill_path / impl: passed to :class:`MLABackend`.
        kv_dtype / kv_scales: the latent cache's storage dtype ("fp8": e4m3; FlashMLA FP8 at page 64, split-KV at
            any page size) and its per-layer
            scales (default: the checkpoint's, else 1.0); :meth:`calibrate_kv_scales` measures them.
        allow_past_max_position: accept requests longer than the config's ``max_position_embeddings``
            (a warning is logged); by default they raise ValueError.
    """

    def __init__(self, model: DeepseekForCausalLM, *, page_size: int = 16, max_batch_size: int = 8,
                 max_context: int = 2048, num_pages: int | None = None, max_prefill_tokens: int | None = None,
                 use_cuda_graph: bool = False, cuda_graph_batch_sizes: Sequence[int] | None = None,
                 decode_kernel: str = "auto", prefill_path: str = "auto", impl=None,
                 allow_past_max_position: bool = False, kv_dtype=None,
                 kv_scales: Sequence[float] | float | None = None) -> None:
        if max_prefill_tokens is not None and (isinstance(max_prefill_tokens, bool)
                                               or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be a positive int or None, got {max_prefill_tokens!r}")
        self.loop = ServingLoop(model, page_size=page_size, max_running=max_batch_size, max_context=max_context,
                                num_pages=num_pages, token_budget=max_prefill_tokens or max_batch_size * max_context,
                                use_cuda_graph=use_cuda_graph, cuda_graph_batch_sizes=cuda_graph_batch_sizes,
                                decode_kernel=decode_kernel, prefill_path=prefill_path, impl=impl,
                                kv_dtype=kv_dtype, kv_scales=kv_scales)
        self.model, self.cfg, self.device = model, model.config, self.loop.device
        self.max_batch_size, self.max_context = max_batch_size, max_context
        self.max_prefill_tokens = max_prefill_tokens
        self.allow_past_max_position = bool(allow_past_max_position)
        self.req_to_token_pool, self.allocator = self.loop.req_to_token_pool, self.loop.allocator
        self.kv_pool, self.backend, self.graph_runner = self.loop.kv_pool, self.loop.backend, self.loop.graph_runner

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
        longest, limit = max(map(len, out)) + max_new_tokens, self.cfg.max_position_embeddings
        if longest > limit:
            if not self.allow_past_max_position:
                raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceed the model's "
                                 f"max_position_embeddings {limit} (allow_past_max_position=True to run anyway)")
            logger.warning("generating %d tokens past max_position_embeddings %d: RoPE beyond the trained "
                           "range, expect degraded output", longest - limit, limit)
        return out

    def _check_forced(self, forced_tokens, n: int, max_new_tokens: int) -> list[list[int] | None]:
        if forced_tokens is None:
            return [None] * n
        if not isinstance(forced_tokens, (list, tuple)) or len(forced_tokens) != n:
            raise ValueError(f"forced_tokens must be a list of {n} token-id lists (one per prompt)")
        out = []
        for i, f in enumerate(forced_tokens):
            ids = [int(t) for t in (f.tolist() if isinstance(f, Tensor) else f)][:max_new_tokens]
            if len(ids) < max_new_tokens:
                raise ValueError(f"forced_tokens[{i}] holds {len(ids)} tokens, fewer than max_new_tokens "
                                 f"{max_new_tokens}")
            if min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
                raise ValueError(f"forced_tokens[{i}] holds token ids outside [0, {self.cfg.vocab_size})")
            out.append(ids)
        return out

    @staticmethod
    def _eos_set(eos_token_id) -> frozenset[int] | None:
        """None, or the set of ids that end a request (one id or several, e.g. from generation_config)."""
        if eos_token_id is None:
            return None
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        return frozenset(ids)

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

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_token_id: int | Iterable[int] | None = None, return_logits: bool = False,
                 return_prefill_logits: bool = False, progress: ProgressFn | None = None,
                 forced_tokens: Sequence[Sequence[int]] | None = None) -> GenerateResult:
        """Greedy generation for every prompt at once; see the module docstring for the steps.

        ``eos_token_id``: one id or several; a request stops after emitting any of them (kept).
        ``progress(phase, step, steps)`` is called after every step.
        ``forced_tokens`` (teacher forcing, for validation): per prompt at least ``max_new_tokens`` ids;
        new token k of prompt i is ``forced_tokens[i][k]`` instead of the argmax, so every step runs on a
        context fixed in advance (the returned logits are still the model's own)."""
        eos = self._eos_set(eos_token_id)
        prompts = self._check_prompts(prompts, max_new_tokens)
        forced = self._check_forced(forced_tokens, len(prompts), max_new_tokens)
        loop = self.loop
        budget = self.max_prefill_tokens or sum(map(len, prompts))
        loop.scheduler.token_budget = budget
        loop.record_logits, loop.record_prefill_logits = return_logits, return_prefill_logits
        loop.logits.clear()
        loop.prefill_logits.clear()
        requests = [Request(rid=i, prompt=p, max_new_tokens=max_new_tokens, eos_token_id=eos, forced=f)
                    for i, (p, f) in enumerate(zip(prompts, forced))]
        estimate = -(-sum(map(len, prompts)) // budget) + max_new_tokens - 1
        def on_step(rec) -> None:
            if progress is not None:
                progress(rec.mode.lower() if rec.mode != "EXTEND" else "prefill", rec.index + 1, estimate)

        loop.run(requests, on_step=on_step)
        tokens = [r.output for r in requests]
        logits = [torch.stack(loop.logits[r.rid]) for r in requests] if return_logits else None
        prefill = [torch.cat(loop.prefill_logits[r.rid]) for r in requests] if return_prefill_logits else None
        return GenerateResult(token_ids=tokens, logits=logits, prefill_logits=prefill)
