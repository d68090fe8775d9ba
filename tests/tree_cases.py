"""Speculative tree steps over adversarial paged caches, and their fp64 oracle (CPU and GPU tests share these).

A :class:`TreeCase` is a latent pool whose every slot starts as NaN (finite garbage on a GPU, where the kernels
read whole pages), over a shuffled layout (``mla_cases.make_layout``), with request b's committed prefix written
and its ``n`` tree-key rows written too — by the backend's store for a verify step (they are the step's new
tokens), by the case for a draft step's earlier tokens. Trees are parent arrays, one per request:
:func:`random_tree`, :func:`chain`, :func:`star`, :func:`tree_of` (a named shape of given depth and width).

:func:`tree_oracle` is written from the definitions: for request b it builds the whole ``[m, P_b + n]`` mask
itself — every prefix key visible, and tree key j visible to query i iff j is i or an ancestor of i (walking
the parent array), or for a draft step the case's mask — then decompresses the latent rows through kv_b_proj
and runs ``oracle.dense_attention`` in fp64. It shares no code with the library (its twin there is
``ops.tree_attention``, which it never calls).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from mla_cases import STALE_FINITE, make_layout
from oracle import dense_attention
from specs import MLA_CONFIGS, MLAConfig

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.layer import AttentionLayer
from mla_fa3.tree import DraftTree


# (decode kernel, page size) pairs a tree step runs on: FlashMLA reads pages of 64 only
KERNEL_PAGES = [("fa3", 1), ("fa3", 16), ("fa3", 64), ("splitkv", 1), ("splitkv", 16), ("splitkv", 64),
                ("flashmla", 64)]


def backend_for(case, **kw) -> MLABackend:
    """Our backend over ``case``'s pool and request table, at its heads and MLA dims."""
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.layout.page_size, device=case.layout.device, num_heads=case.cfg.num_heads,
                      mla_dims=case.cfg.dims, **kw)


# ---------------------------------------------------------------------------------------------- tree shapes
def chain(k: int) -> list[int]:
    return [-1] + list(range(k - 1))


def star(k: int) -> list[int]:
    return [-1] + [0] * (k - 1)


def random_tree(k: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, k)]


def tree_of(depth: int, width: int, rng: random.Random) -> list[int]:
    """A tree of exactly ``depth`` levels below the root and up to ``width`` children per node (EAGLE's shape:
    at each level the top nodes branch), its nodes in level order (parents first)."""
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for node in level:
            for _ in range(rng.randint(1, width) if nxt else width):
                if len(parents) >= 64:
                    break
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = rng.sample(nxt, min(len(nxt), width))
    return parents


def ancestors_mask(parents: list[int]) -> torch.Tensor:
    """[k, k] bool: j is i or an ancestor of i — by walking each node's parent chain."""
    k = len(parents)
    mask = torch.zeros(k, k, dtype=torch.bool)
    for i in range(k):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


# ---------------------------------------------------------------------------------------------- cases
@dataclass
class TreeCase:
    cfg: MLAConfig
    layout: object  # mla_cases.CacheLayout
    pool: MLATokenPool
    layer: AttentionLayer
    kv_b_proj: torch.Tensor  # [H*(d_nope+d_v), r] fp32 cpu
    prefix_lens: list[int]
    num_keys: int  # n
    masks: list[torch.Tensor]  # per request [m, n] bool: the tree part of the oracle's mask
    latent: list[torch.Tensor]  # per request [P_b + n, r + d_rope] fp32 cpu
    q: torch.Tensor  # [bs*m, H, d_nope + d_rope]
    new_latent: torch.Tensor  # [bs*m, r + d_rope]: the rows the step stores (verify: the tree keys)
    batch: ForwardBatch

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)


def _pool_and_layer(cfg: MLAConfig, alloc_lens, page_size, dtype, device, seed, kv_dtype=None, logit_cap=0.0):
    layout = make_layout(alloc_lens, page_size, device=device, seed=seed)
    d, H = cfg.dims, cfg.num_heads
    pool = MLATokenPool(2, layout.num_pages, page_size, d.kv_lora_rank, d.qk_rope_head_dim, dtype, device,
                        kv_dtype=kv_dtype)
    poison = float("nan") if torch.device(device).type == "cpu" else STALE_FINITE
    for buf in pool.kv_buffer:
        if buf.dtype.is_floating_point and buf.element_size() > 1:
            buf.fill_(poison)
        else:  # e4m3: the largest finite value (NaN is not representable for e4m3fn fills everywhere)
            buf.copy_(torch.full(buf.shape, 448.0, device=device).to(buf.dtype))
    g = torch.Generator().manual_seed(2000 + seed)
    w = torch.randn(H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, generator=g) / math.sqrt(d.kv_lora_rank)
    layer = AttentionLayer.mla_layer(1, H, d, cfg.scale, kv_b_proj_weight=w.to(dtype=dtype, device=device),
                                     logit_cap=logit_cap)
    return layout, pool, layer, w, g


def make_verify_case(prefix_lens, trees, *, cfg="tiny", page_size=16, dtype=torch.float32, device="cpu", seed=0,
                     kv_dtype=None, logit_cap=0.0, via="parents") -> TreeCase:
    """A TARGET_VERIFY tree step: request b has ``prefix_lens[b]`` committed tokens and the tree ``trees[b]``
    (parent arrays of one length k). ``via``: how the batch gets its tree — "parents", "mask", "sglang"
    (SGLang's flat FULL_MASK custom_mask), or "chain" (no tree: today's causal verify; trees must be chains)."""
    cfg = MLA_CONFIGS[cfg] if isinstance(cfg, str) else cfg
    k, bs = len(trees[0]), len(prefix_lens)
    layout, pool, layer, w, g = _pool_and_layer(cfg, [p + k + 3 for p in prefix_lens], page_size, dtype, device,
                                                seed, kv_dtype, logit_cap)
    d, H = cfg.dims, cfg.num_heads
    latent = [torch.randn(p + k, d.latent_dim, generator=g) for p in prefix_lens]
    for b, p in enumerate(prefix_lens):
        pool.set_latent(1, layout.token_slots(b, 0, p).to(device), latent[b][:p].to(dtype=dtype, device=device))
    rows = [layout.rows[b] for b in range(bs)]
    loc = torch.cat([layout.token_slots(b, p, p + k) for b, p in enumerate(prefix_lens)])
    seq = [p + k for p in prefix_lens]
    masks = [ancestors_mask(t) for t in trees]
    if via == "chain":
        tree = None
    elif via == "parents":
        tree = DraftTree.from_parents(trees, device)
    elif via == "mask":
        tree = DraftTree.from_mask(torch.stack(masks), device)
    elif via == "sglang":  # SGLang's seq_lens exclude the draft tokens: block b is k x (P_b + k), prefix True
        flat = torch.cat([torch.cat([torch.ones(k, p, dtype=torch.bool), masks[b]], 1).reshape(-1)
                          for b, p in enumerate(prefix_lens)])
        tree = DraftTree.from_sglang_custom_mask(flat, prefix_lens, k, device)
    else:
        raise ValueError(via)
    batch = ForwardBatch.verify(rows, seq, loc, device, num_draft_tokens=k, tree=tree)
    q = torch.randn(bs * k, H, d.qk_head_dim, generator=g)
    new = torch.cat([latent[b][p:] for b, p in enumerate(prefix_lens)])
    return TreeCase(cfg, layout, pool, layer, w, list(prefix_lens), k, masks, latent,
                    q.to(dtype=dtype, device=device), new.to(dtype=dtype, device=device), batch)


def make_draft_case(prefix_lens, topk: int, num_steps: int, step: int, *, cfg="tiny", page_size=16,
                    dtype=torch.float32, device="cpu", seed=0, kv_dtype=None, layout_kind="sglang") -> TreeCase:
    """A DRAFT_DECODE tree step ``step`` of a ``num_steps``-step draft with ``topk`` branches. The n = topk *
    num_steps tree keys follow each prefix; ``layout_kind`` "sglang": branch-major (key j*num_steps + s), branch j
    sees its own tokens of steps 0..step (future keys hold poison); "random": each step's branches pick random
    parents among the previous step's, keys step-major (key s*topk + j), only steps 0..step in the row."""
    cfg = MLA_CONFIGS[cfg] if isinstance(cfg, str) else cfg
    bs, rng = len(prefix_lens), random.Random(seed)
    if layout_kind == "sglang":
        n = topk * num_steps
        key = lambda s, j: j * num_steps + s  # noqa: E731
    else:
        n = topk * (step + 1)
        key = lambda s, j: s * topk + j  # noqa: E731
    layout, pool, layer, w, g = _pool_and_layer(cfg, [p + n + 3 for p in prefix_lens], page_size, dtype, device,
                                                seed, kv_dtype)
    d, H = cfg.dims, cfg.num_heads
    latent, masks = [], []
    for b, p in enumerate(prefix_lens):
        lat = torch.randn(p + n, d.latent_dim, generator=g)
        mask = torch.zeros(topk, n, dtype=torch.bool)
        branch_keys = [[key(0, j)] for j in range(topk)]  # keys each live branch sees
        for s in range(1, step + 1):
            par = [j if layout_kind == "sglang" else rng.randrange(topk) for j in range(topk)]
            branch_keys = [branch_keys[par[j]] + [key(s, j)] for j in range(topk)]
        for j in range(topk):
            mask[j, branch_keys[j]] = True
        written = sorted({kk for s in range(step) for kk in (key(s, j) for j in range(topk))})  # earlier steps
        slots = layout.token_slots(b, 0, p + n)
        pool.set_latent(1, slots[:p].to(device), lat[:p].to(dtype=dtype, device=device))
        if written:
            idx = torch.tensor([p + kk for kk in written])
            pool.set_latent(1, slots[idx].to(device), lat[idx].to(dtype=dtype, device=device))
        latent.append(lat)
        masks.append(mask)
    rows = [layout.rows[b] for b in range(bs)]
    new_idx = [[p + key(step, j) for j in range(topk)] for p in prefix_lens]
    loc = torch.cat([layout.token_slots(b, 0, p + n)[torch.tensor(new_idx[b])] for b, p in enumerate(prefix_lens)])
    tree = DraftTree.draft(torch.stack(masks), device)
    batch = ForwardBatch.draft_decode(rows, [p + n for p in prefix_lens], loc, device, step=step, tree=tree)
    q = torch.randn(bs * topk, H, d.qk_head_dim, generator=g)
    new = torch.cat([latent[b][torch.tensor(new_idx[b])] for b in range(bs)])
    return TreeCase(cfg, layout, pool, layer, w, list(prefix_lens), n, masks, latent,
                    q.to(dtype=dtype, device=device), new.to(dtype=dtype, device=device), batch)


def tree_oracle(case: TreeCase, *, latent_dtype=None) -> torch.Tensor:
    """fp64 non-absorbed MLA of the step [bs*m, H, d_v]: each query over its prefix and its visible tree keys,
    the whole mask built here. ``latent_dtype``: round the true rows as the pool holds them (default q's dtype)."""
    d, H = case.cfg.dims, case.cfg.num_heads
    r, dn = d.kv_lora_rank, d.qk_nope_head_dim
    q = case.q.double().cpu()
    w = case.kv_b_proj.double().view(H, dn + d.v_head_dim, r)
    outs, row = [], 0
    for b, p in enumerate(case.prefix_lens):
        m, n = case.masks[b].shape
        lat = case.latent[b].to(latent_dtype or case.q.dtype).double()
        c_kv, k_rope = lat[:, :r], lat[:, r:]
        kv = torch.einsum("lr,hdr->lhd", c_kv, w)
        k = torch.cat([kv[..., :dn], k_rope.unsqueeze(1).expand(-1, H, -1)], dim=-1)
        full = torch.cat([torch.ones(m, p, dtype=torch.bool), case.masks[b]], dim=1)  # [m, P + n]
        o, _ = dense_attention(q[row:row + m], k, kv[..., dn:], scale=case.layer.scaling, mask=full,
                               softcap=case.layer.logit_cap)
        outs.append(o)
        row += m
    return torch.cat(outs)


def padded_tree_batch(case: TreeCase, pad_to: int) -> ForwardBatch:
    """``case.batch`` padded to ``pad_to`` requests as a graph runner pads a tree step: padding requests on row 0
    with a prefix of 1 (``seq_lens = n + 1``), every new token to slot 0, a tree whose queries see key 0 only."""
    b = case.batch
    pad = pad_to - b.batch_size
    m, n = b.tree.shape
    rows = b.req_pool_indices_cpu.tolist() + [0] * pad
    seq = b.seq_lens_cpu.tolist() + [n + 1] * pad
    loc = torch.cat([b.out_cache_loc.cpu(), torch.zeros(pad * m, dtype=torch.int64)])
    pad_mask = torch.zeros(pad, m, n, dtype=torch.bool)
    pad_mask[:, :, 0] = True
    if b.tree.verify:
        pad_mask[:, torch.arange(m), torch.arange(m)] = True  # a verify tree: each token sees the root and itself
        tree = DraftTree.from_mask(torch.cat([b.tree.mask_cpu, pad_mask]), b.device)
        return ForwardBatch.verify(rows, seq, loc, b.device, num_draft_tokens=m, tree=tree)
    tree = DraftTree.draft(torch.cat([b.tree.mask_cpu, pad_mask]), b.device)
    return ForwardBatch.draft_decode(rows, seq, loc, b.device, step=b.draft_step, tree=tree)


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def sub_case(case: TreeCase, idx: list[int], masks: list[torch.Tensor] | None = None) -> TreeCase:
    """Requests ``idx`` of ``case`` (in that order) as a case of their own, over the same pool and slots; ``masks``
    (one [m, n] per kept request): other trees over the same keys (a verify step's tree keys are its new tokens,
    so any tree of k fits; a draft step's masks must see each branch's own token)."""
    b = case.batch
    m, n = b.tree.shape
    masks = [case.masks[i] for i in idx] if masks is None else masks
    rows = [int(b.req_pool_indices_cpu[i]) for i in idx]
    seq = [int(b.seq_lens_cpu[i]) for i in idx]
    loc = torch.cat([b.out_cache_loc.cpu()[i * m:(i + 1) * m] for i in idx])
    tok = torch.tensor([i * m + j for i in idx for j in range(m)])
    if b.tree.verify:
        batch = ForwardBatch.verify(rows, seq, loc, b.device, num_draft_tokens=m,
                                    tree=DraftTree.from_mask(torch.stack(masks), b.device))
    else:
        batch = ForwardBatch.draft_decode(rows, seq, loc, b.device, step=b.draft_step,
                                          tree=DraftTree.draft(torch.stack(masks), b.device))
    return TreeCase(case.cfg, case.layout, case.pool, case.layer, case.kv_b_proj, [case.prefix_lens[i] for i in idx],
                    n, masks, [case.latent[i] for i in idx], case.q[tok.to(case.q.device)],
                    case.new_latent[tok.to(case.q.device)], batch)


def draft_steps(prefix_lens, topk: int, num_steps: int, *, reparent: bool = False, **kw) -> list[TreeCase]:
    """Every step of one ``num_steps``-step draft tree in SGLang's key layout (key j*num_steps + s), as cases over
    ONE pool (step 0's: the prefixes written, every draft key poison) — a multi-step run writes each step's keys
    itself. ``reparent``: branch j of step s descends from a random branch of step s-1 (EAGLE re-ranks its top-k
    each step), so it sees that branch's keys and its own; else its own keys of steps 0..s (SGLang's mask)."""
    cases = [make_draft_case(prefix_lens, topk, num_steps, s, **kw) for s in range(num_steps)]
    base = cases[0]
    if reparent:
        rng = random.Random(kw.get("seed", 0) + 99)
        for b in range(base.batch_size):
            seen = [{j * num_steps} for j in range(topk)]
            for s in range(1, num_steps):
                seen = [seen[rng.randrange(topk)] | {j * num_steps + s} for j in range(topk)]
                mask = torch.zeros(topk, topk * num_steps, dtype=torch.bool)
                for j in range(topk):
                    mask[j, sorted(seen[j])] = True
                cases[s].masks[b] = mask
    out = []
    for c in cases:  # each step over step 0's pool (same seed: same layout, rows, slots and latent rows)
        c = TreeCase(c.cfg, base.layout, base.pool, base.layer, base.kv_b_proj, c.prefix_lens, c.num_keys, c.masks,
                     c.latent, c.q, c.new_latent, c.batch)
        out.append(sub_case(c, list(range(c.batch_size))) if reparent else c)
    return out
