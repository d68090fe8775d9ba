"""A paged MLA world for the graph-runner tests: pools, backend, layers, and the history of latent rows.

``World`` builds one :class:`specs.GraphSpec` case (pools, an MLA backend or a multi-step draft
backend, the layers) and keeps per request the latent rows written, so its fp64 non-absorbed oracle
(``tests/oracle.py``) is independent of the library. ``run_round`` runs one round of requests
through a runner and checks that the run wrote the pool only at the batch's slots. Shared by
``test_graph_runner.py`` (CPU) and ``test_graph_runner_gpu.py`` (real CUDA graphs).
"""

from __future__ import annotations

import math

import torch

from oracle import mla_nonabsorbed
from specs import MLA_CONFIGS, GraphSpec

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend
from mla_fa3.graphs.runner import GraphRunner, InputSpec
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims


class World:
    """Pools, backend, layers and a per-request history of the latent rows written, for one case."""

    def __init__(self, spec: GraphSpec, device, dtype, *, cfg: str = "tiny", seed: int = 0, max_context: int = 160,
                 num_layers: int = 2, decode_kernel: str = "fa3", impl=None):
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self.gen = torch.Generator().manual_seed(seed)
        config = MLA_CONFIGS[spec.cfg or cfg]  # the spec's own config, else the test's
        self.dims: MLADims = config.dims
        self.heads: int = config.num_heads
        self.mode: ForwardMode = spec.mode
        self.k = spec.k if self.mode is ForwardMode.TARGET_VERIFY else 1
        self.steps = spec.steps if self.mode is ForwardMode.DRAFT_DECODE else 1
        page, max_bs = spec.page_size, max(spec.sizes)
        self.max_context = max_context
        num_pages = 2 + max_bs * -(-max_context // page)  # enough for one full round: rounds reuse pages
        self.req_pool = ReqToTokenPool(max_bs + 1, max_context, self.device)
        self.alloc = PagedAllocator(num_pages, page, self.device)
        self.pool = MLATokenPool(num_layers, num_pages, page, self.dims.kv_lora_rank, self.dims.qk_rope_head_dim,
                                 dtype, self.device)
        kw = dict(req_to_token_pool=self.req_pool, kv_pool=self.pool, page_size=page, device=self.device,
                  decode_kernel=decode_kernel, num_heads=self.heads, impl=impl)
        self.backend = MultiStepDraftBackend(self.steps, **kw) if self.mode is ForwardMode.DRAFT_DECODE \
            else MLABackend(**kw)
        d = self.dims
        self.scale = 1.0 / math.sqrt(d.qk_head_dim)
        self.kv_b = [self._randn(self.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)
                     / math.sqrt(d.kv_lora_rank) for _ in range(num_layers)]
        self.layers = [AttentionLayer.mla_layer(i, self.heads, d, self.scale, kv_b_proj_weight=w.to(self.device, dtype))
                       for i, w in enumerate(self.kv_b)]
        self.history: dict[int, list[torch.Tensor]] = {}  # row -> per layer [len, width] fp32 cpu

    # ------------------------------------------------------------------ data
    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def input_specs(self) -> dict[str, InputSpec]:
        d = self.dims
        return {"q": InputSpec((self.heads, d.qk_head_dim), self.dtype),
                "latent": InputSpec((d.latent_dim,), self.dtype)}

    def forward_fn(self, batch: ForwardBatch, inputs: dict) -> torch.Tensor:
        """The captured step: every layer on the same q / new latent rows; out [T, layers, H, d_v]."""
        outs = [self.backend.forward(inputs["q"], inputs["latent"], None, layer, batch) for layer in self.layers]
        return torch.stack(outs, dim=1)

    def start(self, prefix_lens: list[int]) -> list[int]:
        """New requests with cached prefixes of random latent rows (every layer)."""
        rows = self.req_pool.alloc(len(prefix_lens))
        for row, n in zip(rows, prefix_lens):
            slots = self.alloc.alloc_for_request(self.req_pool, row, 0, n)
            self.history[row] = []
            for layer in range(len(self.layers)):
                lat = self._randn(n, self.dims.latent_dim).to(self.dtype).float()
                self.pool.set_latent(layer, slots, lat.to(self.device, self.dtype))
                self.history[row].append(lat)
        return rows

    def finish(self, rows: list[int]) -> None:
        for row in rows:
            self.alloc.free_request(self.req_pool, row)
            self.history.pop(row)
        self.req_pool.free(rows)

    def length(self, row: int) -> int:
        return self.history[row][0].shape[0]

    def make_step(self, rows: list[int], step: int = 0):
        """(batch, inputs, new latents) of this world's mode over ``rows``; slots allocated, latents not written."""
        n_new = self.k
        locs, seq = [], []
        for row in rows:
            start = self.length(row)
            locs.append(self.alloc.alloc_for_request(self.req_pool, row, start, n_new))
            seq.append(start + n_new)
        loc = torch.cat(locs)
        if self.mode is ForwardMode.TARGET_VERIFY:
            batch = ForwardBatch.verify(rows, seq, loc, self.device, num_draft_tokens=self.k)
        elif self.mode is ForwardMode.DRAFT_DECODE:
            batch = ForwardBatch.draft_decode(rows, seq, loc, self.device, step=step)
        else:
            batch = ForwardBatch.decode(rows, seq, loc, self.device)
        T, d = loc.shape[0], self.dims
        q = self._randn(T, self.heads, d.qk_head_dim).to(self.dtype)
        latent = self._randn(T, d.latent_dim).to(self.dtype)
        inputs = {"q": q.to(self.device), "latent": latent.to(self.device)}
        return batch, inputs, latent.float()

    def commit(self, rows: list[int], latent: torch.Tensor) -> None:
        """Record the step's new latent rows (the step wrote them into every layer)."""
        for i, row in enumerate(rows):
            new = latent[i * self.k:(i + 1) * self.k]
            self.history[row] = [torch.cat([h, new]) for h in self.history[row]]

    def poison_stale(self, live_rows: list[int]) -> None:
        """NaN into every slot that is not a cached token of ``live_rows`` (page tails, freed slots, slot 0)."""
        keep = torch.zeros(self.pool.num_slots, dtype=torch.bool)
        table = self.req_pool.req_to_token.cpu()
        for row in live_rows:
            keep[table[row, : self.length(row)].long()] = True
        for buf in self.pool.kv_buffer:
            buf[~keep.to(self.device)] = float("nan")
        if self.device.type == "cuda":
            # The kernels read whole pages and weight the slots past a sequence's end by a zero
            # probability (0 * NaN = NaN): on a GPU that tail holds large finite garbage instead, as
            # the pools guarantee finite stale rows (zeroed when freed).
            p = self.pool.page_size
            for row in live_rows:
                n = self.length(row)
                if n % p:
                    page = int(table[row, n - 1]) // p
                    tail = torch.arange(page * p + n % p, (page + 1) * p, device=self.device)
                    for buf in self.pool.kv_buffer:
                        buf[tail] = 3.0e3

    def oracle(self, rows: list[int], q: torch.Tensor) -> torch.Tensor:
        """fp64 non-absorbed MLA per request and layer, after commit: [T, layers, H, d_v]."""
        d, outs = self.dims, []
        for i, row in enumerate(rows):
            qi = q[i * self.k:(i + 1) * self.k]
            per_layer = []
            for layer, w in enumerate(self.kv_b):
                lat = self.history[row][layer].to(self.device)  # fp64 on the device (fast on a GPU)
                o, _ = mla_nonabsorbed(qi, lat[:, : d.kv_lora_rank], lat[:, d.kv_lora_rank:],
                                       w.to(self.dtype).to(self.device), qk_nope_head_dim=d.qk_nope_head_dim,
                                       v_head_dim=d.v_head_dim, scale=self.scale, causal=True)
                per_layer.append(o)
            outs.append(torch.stack(per_layer, dim=1))
        return torch.cat(outs).to(self.device)

    def eager(self, batch: ForwardBatch, inputs: dict) -> torch.Tensor:
        """The same step without the runner: plan for the live batch, run the step on it."""
        target = self.backend.step(batch.draft_step) if self.mode is ForwardMode.DRAFT_DECODE else self.backend
        target.init_forward_metadata(batch)
        return self.forward_fn(batch, inputs)

    def runner(self, **kw) -> GraphRunner:
        return GraphRunner(self.backend, self.forward_fn, batch_sizes=self.spec.sizes, mode=self.mode,
                           num_draft_tokens=self.k, num_draft_steps=self.steps, max_context=self.max_context,
                           input_specs=self.input_specs(), device=self.device, **kw)

    def prefix_lens(self, n: int) -> list[int]:
        """Random cached prefix lengths leaving room for every step of the round."""
        hi = self.max_context - self.k * self.steps
        return torch.randint(1, hi + 1, (n,), generator=self.gen).tolist()


def run_round(world: World, runner: GraphRunner, n: int, *, poison: bool, check, longest: bool = False,
              run=None):
    """One round of ``n`` requests: every draft step (or the one decode / verify step), checked by ``check``.

    Also checks that the run wrote the pool only at the batch's slots and the padding slot 0.
    ``longest``: prefixes as long as the round allows (uses most pages, so the next round reuses them).
    ``run(batch, inputs)``: how to run the step (default ``runner.run``).
    """
    run = run or runner.run
    hi = world.max_context - world.k * world.steps
    rows = world.start([hi] * n if longest else world.prefix_lens(n))
    for step in range(world.steps):
        batch, inputs, latent = world.make_step(rows, step)
        if poison:
            world.poison_stale(rows)
        before = [buf.clone() for buf in world.pool.kv_buffer]
        out = run(batch, inputs)
        out = out.clone()  # the runner's output buffer is reused by the eager run below
        allowed = torch.zeros(world.pool.num_slots, dtype=torch.bool, device=world.device)
        allowed[batch.out_cache_loc] = True
        allowed[0] = True
        for old, new in zip(before, world.pool.kv_buffer):
            changed = ~((old == new) | (old.isnan() & new.isnan())).all(dim=1)
            assert not (changed & ~allowed).any(), "the run wrote outside out_cache_loc and the padding slot"
        eager = world.eager(batch, inputs)
        world.commit(rows, latent)
        check(out, eager, world.oracle(rows, inputs["q"]), batch)
    world.finish(rows)
