"""Soak of the CUDA-graph decode loop: requests join, finish and are preempted for ``--steps`` steps.

    python -m mla_fa3.bench.soak --steps 10000 --out DIR          # H200: graphs, bf16, FA3
    python -m mla_fa3.bench.soak --steps 50 --device cpu --out DIR  # CPU smoke: eager, fp32, reference

The loop (one :class:`~mla_fa3.graphs.runner.GraphRunner` over one :class:`~mla_fa3.backend.MLABackend`
and ``--layers`` random MLA layers; KV memory from ``ReqToTokenPool`` + ``PagedAllocator``)::

    for step in range(steps):
        join:    while a row and pages are free, with probability p_join a request arrives with a cached
                 prefix of random latent rows (written straight into the pool) and a target length
        preempt: with probability p_preempt one live request loses its pages and row (re-queued later)
        decode:  every live request gets one token (alloc_for_request) -> runner.run(batch, q, latent)
        check:   every --check-every steps, each request's output vs an fp32 reference (dense,
                 non-absorbed MLA over the latent rows the soak itself recorded for it)
        finish:  requests at their target length free their pages (clear_pages) and rows
        memory:  every --mem-every steps, torch.cuda.memory_allocated / memory_reserved

The whole loop runs twice from the same seed on fresh pools, runners and graphs; the digest of every
step's output bytes must agree (bitwise-identical outputs for the same inputs). Writes
``DIR/soak.json`` (config, counts, max reference error, memory samples and their spread, both digests,
wall times) and prints a summary. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.graphs.runner import GraphRunner, InputSpec
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims

__all__ = ["SoakConfig", "run_soak", "main"]


@dataclass
class SoakConfig:
    steps: int = 10_000
    device: str = "cuda"
    seed: int = 0
    max_bs: int = 16
    page_size: int = 64
    max_context: int = 1024
    layers: int = 2
    heads: int = 16
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    p_join: float = 0.3
    p_preempt: float = 0.01
    check_every: int = 50
    mem_every: int = 100

    @property
    def dims(self) -> MLADims:
        return MLADims(kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)


class _Soak:
    """One run of the loop on fresh pools, backend, runner and graphs."""

    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        dev = self.dev = torch.device(cfg.device)
        self.dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        d, p = cfg.dims, cfg.page_size
        pages = 1 + cfg.max_bs * -(-cfg.max_context // p)
        self.req_pool = ReqToTokenPool(cfg.max_bs, cfg.max_context, dev)
        self.alloc = PagedAllocator(pages, p, dev)
        self.pool = MLATokenPool(cfg.layers, pages, p, d.kv_lora_rank, d.qk_rope_head_dim, self.dtype, dev)
        self.backend = MLABackend(req_to_token_pool=self.req_pool, kv_pool=self.pool, page_size=p, device=dev,
                                  num_heads=cfg.heads, mla_dims=d,
                                  impl=None if dev.type == "cuda" else "reference")
        g = torch.Generator().manual_seed(cfg.seed + 1)
        self.kv_b = [(torch.randn(cfg.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g)
                      / math.sqrt(d.kv_lora_rank)).to(dev, self.dtype) for _ in range(cfg.layers)]
        self.scale = 1.0 / math.sqrt(d.qk_head_dim)
        self.layers = [AttentionLayer.mla_layer(i, cfg.heads, d, self.scale, kv_b_proj_weight=w)
                       for i, w in enumerate(self.kv_b)]
        # what the soak wrote, per row and layer: the reference reads this, never the pool
        self.history = torch.zeros(cfg.layers, cfg.max_bs, cfg.max_context, d.latent_dim, dtype=self.dtype,
                                   device=dev)
        self.length: dict[int, int] = {}  # row -> tokens in the cache
        self.target: dict[int, int] = {}  # row -> length at which the request finishes
        sizes = sorted({min(2 ** i, cfg.max_bs) for i in range(cfg.max_bs.bit_length() + 1)})
        specs = {"q": InputSpec((cfg.heads, d.qk_head_dim), self.dtype), "latent": InputSpec((d.latent_dim,), self.dtype)}
        self.runner = GraphRunner(self.backend, self._forward, batch_sizes=sizes, mode=ForwardMode.DECODE,
                                  max_context=cfg.max_context, input_specs=specs, device=dev,
                                  use_graphs=dev.type == "cuda")
        self.counts = dict(joins=0, finishes=0, preemptions=0, checks=0, tokens=0)
        self.max_err = 0.0
        self.digest = torch.zeros((), dtype=torch.int64, device=dev)
        self.mem: list[tuple[int, int, int]] = []  # (step, allocated, reserved)

    def _forward(self, batch: ForwardBatch, inputs: dict) -> torch.Tensor:
        return torch.stack([self.backend.forward(inputs["q"], inputs["latent"], None, layer, batch)
                            for layer in self.layers], dim=1)

    # ------------------------------------------------------------------ scheduler
    def _join(self) -> None:
        cfg, d = self.cfg, self.cfg.dims
        while self.req_pool.available_size() and self.rng.random() < cfg.p_join:
            prefix = self.rng.randint(1, cfg.max_context // 2)
            target = min(cfg.max_context, prefix + self.rng.randint(2, cfg.max_context // 4))
            if -(-target // cfg.page_size) > self.alloc.num_free_pages():
                return
            row = self.req_pool.alloc(1)[0]
            slots = self.alloc.alloc_for_request(self.req_pool, row, 0, prefix)
            for layer in range(cfg.layers):
                lat = torch.randn(prefix, d.latent_dim, generator=self.gen, device=self.dev, dtype=torch.float32)
                lat = lat.to(self.dtype)
                self.pool.set_latent(layer, slots, lat)
                self.history[layer, row, :prefix] = lat
            self.length[row], self.target[row] = prefix, target
            self.counts["joins"] += 1

    def _leave(self, row: int) -> None:
        self.pool.clear_pages(self.alloc.free_request(self.req_pool, row))
        self.req_pool.free(row)
        del self.length[row], self.target[row]

    def step(self, i: int) -> None:
        cfg, d = self.cfg, self.cfg.dims
        self._join()
        if self.length and self.rng.random() < cfg.p_preempt:
            self._leave(self.rng.choice(sorted(self.length)))
            self.counts["preemptions"] += 1
        rows = sorted(self.length)
        if not rows:
            return
        locs = [self.alloc.alloc_for_request(self.req_pool, r, self.length[r], 1) for r in rows]
        seq = [self.length[r] + 1 for r in rows]
        batch = ForwardBatch.decode(rows, seq, torch.cat(locs), self.dev)
        n = len(rows)
        q = torch.randn(n, cfg.heads, d.qk_head_dim, generator=self.gen, device=self.dev).to(self.dtype)
        lat = torch.randn(n, d.latent_dim, generator=self.gen, device=self.dev).to(self.dtype)
        out = self.runner.run(batch, {"q": q, "latent": lat})  # [n, layers, H, d_v]
        rows_t = torch.tensor(rows, device=self.dev)
        pos = torch.tensor([s - 1 for s in seq], device=self.dev)
        for layer in range(cfg.layers):
            self.history[layer, rows_t, pos] = lat
        bits = out.contiguous().view(torch.int16 if out.element_size() == 2 else torch.int32).to(torch.int64)
        self.digest = (self.digest * 1_000_003 + (bits * torch.arange(1, bits.numel() + 1, device=self.dev)
                                                  .view_as(bits)).sum()) % (2 ** 61 - 1)
        if i % cfg.check_every == 0:
            self._check(rows, seq, q, out)
        for r, s in zip(rows, seq):
            self.length[r] = s
            if s >= self.target[r]:
                self._leave(r)
                self.counts["finishes"] += 1
        self.counts["tokens"] += n

    def _check(self, rows, seq, q, out) -> None:
        d, H = self.cfg.dims, self.cfg.heads
        for layer in range(self.cfg.layers):
            w = self.kv_b[layer].float().view(H, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
            w_uk, w_uv = w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]
            for b, (row, s) in enumerate(zip(rows, seq)):
                lat = self.history[layer, row, :s].float()
                c_kv, k_rope = lat[:, : d.kv_lora_rank], lat[:, d.kv_lora_rank:]
                k_nope = torch.einsum("lr,hdr->hld", c_kv, w_uk)
                v = torch.einsum("lr,hdr->hld", c_kv, w_uv)
                qb = q[b].float()
                scores = (torch.einsum("hd,hld->hl", qb[:, : d.qk_nope_head_dim], k_nope)
                          + qb[:, d.qk_nope_head_dim:] @ k_rope.T) * self.scale
                ref = torch.einsum("hl,hld->hd", scores.softmax(-1), v)
                got = out[b, layer].float()
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                self.max_err = max(self.max_err, err if math.isfinite(err) else float("inf"))
        self.counts["checks"] += 1

    def run(self) -> dict:
        t0 = time.perf_counter()
        for i in range(self.cfg.steps):
            self.step(i)
            if self.dev.type == "cuda" and i % self.cfg.mem_every == 0:  # the step's temporaries are gone
                self.mem.append((i, torch.cuda.memory_allocated(self.dev), torch.cuda.memory_reserved(self.dev)))
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        wall = time.perf_counter() - t0
        for row in sorted(self.length):
            self._leave(row)
        leaked = self.alloc.num_free_pages() != self.alloc.num_pages - 1 or self.req_pool.available_size() != self.cfg.max_bs
        self.runner.close()
        return dict(counts=self.counts, max_rel_err=self.max_err, digest=int(self.digest), wall_s=wall, mem=self.mem,
                    leaked=leaked)


def run_soak(cfg: SoakConfig) -> dict:
    """Both runs and the verdict (see the module docstring)."""
    first = _Soak(cfg).run()
    second = _Soak(cfg).run()
    tol = 3e-2 if cfg.device.startswith("cuda") else 1e-4  # bf16 storage + FA3 vs fp32 reference; fp32 on CPU
    mem = first["mem"]
    steady = mem[len(mem) // 10:] if mem else []  # after warm-up (graphs captured, pools allocated)
    spread = (max(a for _, a, _ in steady) - min(a for _, a, _ in steady)) if steady else 0
    reserved_spread = (max(r for _, _, r in steady) - min(r for _, _, r in steady)) if steady else 0
    # flat: no growth beyond the last step's batch-sized tensors the plan still references (< 1 MiB)
    ok = (first["max_rel_err"] <= tol and first["digest"] == second["digest"] and not first["leaked"]
          and spread <= 1 << 20 and first["counts"]["checks"] > 0)
    return dict(config=asdict(cfg), tolerance=tol, first=first, second_digest=second["digest"],
                bitwise_identical=first["digest"] == second["digest"], mem_allocated_spread_bytes=spread,
                mem_reserved_spread_bytes=reserved_spread, ok=ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1,000 steps")
    args = ap.parse_args(argv)
    cfg = SoakConfig(steps=1000 if args.quick else args.steps, device=args.device, seed=args.seed)
    if not args.device.startswith("cuda"):  # CPU smoke: small dims, short contexts, frequent checks
        cfg = SoakConfig(steps=cfg.steps, device=args.device, seed=args.seed, max_bs=4, page_size=16,
                         max_context=96, heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=8, p_join=0.5, p_preempt=0.05, check_every=5)
    res = run_soak(cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(res, indent=1))
    f, c = res["first"], res["first"]["counts"]
    print(f"soak {cfg.steps} steps on {cfg.device}: {c['tokens']} tokens, {c['joins']} joins, {c['finishes']} "
          f"finishes, {c['preemptions']} preemptions; {c['checks']} checked steps, max rel err "
          f"{f['max_rel_err']:.2e} (tol {res['tolerance']:.0e}); memory_allocated spread "
          f"{res['mem_allocated_spread_bytes']} B, reserved spread {res['mem_reserved_spread_bytes']} B over "
          f"{len(f['mem'])} samples; bitwise identical: {res['bitwise_identical']}; leaked: {f['leaked']}; "
          f"{f['wall_s']:.1f} s per run -> {'OK' if res['ok'] else 'FAIL'}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
