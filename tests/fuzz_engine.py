"""The engine the fuzz suite drives: pools, allocator and backend, with a model of the truth beside them.

:class:`FuzzWorld` holds a ``ReqToTokenPool``, a ``PagedAllocator``, an ``MLATokenPool`` of several
layers and one ``MLABackend``; next to them it keeps the ground truth of every live request — per layer,
the latent row of each of its tokens (fp32, CPU) — and nothing else. The oracle (:func:`oracle`)
computes each step's answer in fp64 from that truth alone: dense, non-absorbed MLA over the request's
true tokens with a bottom-right causal mask (``tests/oracle.py``), independent of pages, slots and
metadata. Before every step every pool slot that holds no live token is set to NaN (freed pages,
rejected draft tokens, the tail of each request's last page, the padding page): reading one poisons
the output (the CPU reference reads only ``seq_lens`` keys, as tests/test_backend.py relies on).

Operations (:meth:`FuzzWorld.step`): ``prefill`` (a new request's first chunk), ``extend`` (more prompt
tokens after a cached prefix; with decode rows this is a MIXED step), ``decode``, ``verify`` (k draft
tokens, then a random number accepted and the rest rewound with ``truncate_request``), ``tree_verify``
(a random draft tree per request, EAGLE topk > 1: :meth:`FuzzWorld.verify_tree`; one root-to-node path
accepted, its KV rows moved to the columns after the prefix as a paged engine must, the rest rewound),
``tree_draft`` (a multi-step draft with topk branches re-parented at random each step, SGLang's key
layout, on a ``MultiStepDraftBackend``: :meth:`FuzzWorld.draft_tree`; the draft keys rewound after),
``free`` (pages, pool clear, row), and ``misuse`` (a double free, ``free([r, r])``, a free of a live request's page,
a batch over a freed row, ``seq_lens`` past the allocation, a foreign slot, a forward on a batch other than
the planned one, a draft tree of another batch size or without a prefix) — each must raise its named error
and change nothing. A tree step's oracle: each query over the request's true tokens plus the draft tokens its
tree shows it (the ancestors-or-self of a verify token; a draft branch's mask), found by walking the parents.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from oracle import mla_nonabsorbed

from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardBatch, ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.req_to_token import OutOfSlotsError, OwnershipError, ReqToTokenPool
from mla_fa3.layer import AttentionLayer, MLADims
from mla_fa3.tree import DraftTree, DraftTreeError

DIMS = MLADims(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
HEADS = 2
TOL = 1e-5  # fp32 compute vs the fp64 oracle
OPS = ("prefill", "extend", "decode", "verify", "tree_verify", "tree_draft", "free", "misuse")


@dataclass
class Request:
    row: int
    prompt_len: int  # tokens of its prompt (prefilled over one or more steps)
    latent: list[list[torch.Tensor]] = field(default_factory=list)  # per layer, per token [r + d_rope] fp32

    @property
    def length(self) -> int:
        return len(self.latent[0])


class FuzzWorld:
    def __init__(self, *, page_size: int, num_layers: int, prefill_path: str, max_requests: int,
                 max_context: int, seed: int):
        self.p, self.L, self.ctx = page_size, num_layers, max_context
        self.g = torch.Generator().manual_seed(seed)
        pages = 1 + max_requests * -(-max_context // page_size) // 2 + 2  # tight: exhaustion happens
        self.pool = ReqToTokenPool(max_requests, max_context, "cpu")
        self.alloc = PagedAllocator(pages, page_size, "cpu")
        self.kv = MLATokenPool(num_layers, pages, page_size, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim,
                               torch.float32, "cpu")
        self.backend_kw = dict(req_to_token_pool=self.pool, kv_pool=self.kv, page_size=page_size, device="cpu",
                               num_heads=HEADS, mla_dims=DIMS, prefill_path=prefill_path, impl="reference",
                               prefill_workspace_tokens=max(page_size, 8))
        self.backend = MLABackend(**self.backend_kw)
        self.drafts: dict[int, MultiStepDraftBackend] = {}  # draft steps -> the multi-step draft backend
        self.kv_b = [torch.randn(HEADS * (DIMS.qk_nope_head_dim + DIMS.v_head_dim), DIMS.kv_lora_rank,
                                 generator=self.g) / math.sqrt(DIMS.kv_lora_rank) for _ in range(num_layers)]
        scale = 1.0 / math.sqrt(DIMS.qk_head_dim)
        self.layers = [AttentionLayer.mla_layer(i, HEADS, DIMS, scale, kv_b_proj_weight=w)
                       for i, w in enumerate(self.kv_b)]
        self.live: dict[int, Request] = {}  # row -> request
        self.batches = 0  # forward steps checked against the oracle
        self.refusals = 0  # misuse calls refused as expected
        self.paths: Counter = Counter()  # (mode, path) of every checked step

    # ------------------------------------------------------------------ truth and poison
    def _rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)

    def poison(self) -> None:
        """NaN in every slot that holds no live token (padding page, freed pages, rejected drafts, tails)."""
        live = torch.zeros(self.kv.num_slots, dtype=torch.bool)
        for req in self.live.values():
            live[self.pool.req_to_token[req.row, : req.length].long()] = True
        for buf in self.kv.kv_buffer:
            buf[~live] = float("nan")

    def check_ownership(self) -> None:
        """Host invariants: live requests own disjoint pages, exactly ceil(len / p) each, page 0 never."""
        seen: set[int] = set()
        for req in self.live.values():
            pages = self.alloc.request_pages(req.row)
            assert len(pages) == -(-req.length // self.p) and self.pool.allocated_len[req.row] == req.length
            assert 0 not in pages and not seen & set(pages)
            assert all(self.alloc.page_owner(pg) == req.row for pg in pages)
            seen |= set(pages)
        assert len(seen) + self.alloc.num_free_pages() == self.alloc.num_pages - 1

    # ------------------------------------------------------------------ one forward step
    def run(self, mode: ForwardMode, rows: list[int], new: list[int], *, k: int = 0) -> None:
        """Allocate ``new[b]`` slots per request, run every layer, compare with the oracle, keep the truth."""
        reqs = [self.live[r] for r in rows]
        prefix = [r.length for r in reqs]
        locs = [self.alloc.alloc_for_request(self.pool, r.row, pre, n) for r, pre, n in zip(reqs, prefix, new)]
        loc = torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64)
        seq = [pre + n for pre, n in zip(prefix, new)]
        if mode.is_extend_like():
            batch = ForwardBatch.extend(rows, prefix, new, loc, "cpu", mode=mode)
        elif mode is ForwardMode.TARGET_VERIFY:
            batch = ForwardBatch.verify(rows, seq, loc, "cpu", num_draft_tokens=k)
        else:
            batch = ForwardBatch.decode(rows, seq, loc, "cpu")
        self.poison()
        self.backend.init_forward_metadata(batch)
        self.paths[(mode.name, self.backend.explain().path.value)] += 1
        T = sum(new)
        for li, layer in enumerate(self.layers):
            q = self._rand(T, HEADS, DIMS.qk_head_dim)
            lat = self._rand(T, DIMS.latent_dim)
            out = self.backend.forward(q, lat, None, layer, batch)
            start = 0
            for req, n in zip(reqs, new):
                req.latent[li].extend(lat[start:start + n].unbind(0))
                start += n
            ref = oracle(q, reqs, new, self.kv_b[li], li)
            err = (out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30) if T else 0.0
            assert torch.isfinite(out).all(), f"poison leaked: {mode.name} layer {li} rows {rows} new {new}"
            assert err <= TOL, f"{mode.name} layer {li}: rel err {float(err):.2e} (rows {rows}, new {new})"
        self.batches += 1

    # ------------------------------------------------------------------ tree steps (EAGLE topk > 1)
    def _check(self, out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        assert torch.isfinite(out).all(), f"poison leaked: {what}"
        err = (out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        assert err <= TOL, f"{what}: rel err {float(err):.2e}"

    def verify_tree(self, rows: list[int], parents: list[list[int]], accepted_leaf: list[int]) -> None:
        """A TARGET_VERIFY tree step (``parents[b]``: request b's tree of k tokens), checked per layer; then request
        b accepts the path root .. ``accepted_leaf[b]``: its KV rows move to the columns right after the prefix
        (in path order, every layer) and the other draft tokens are rewound."""
        reqs, k = [self.live[r] for r in rows], len(parents[0])
        prefix = [r.length for r in reqs]
        loc = torch.cat([self.alloc.alloc_for_request(self.pool, r.row, p, k) for r, p in zip(reqs, prefix)])
        batch = ForwardBatch.verify(rows, [p + k for p in prefix], loc, "cpu", num_draft_tokens=k,
                                    tree=DraftTree.from_parents(parents, "cpu"))
        self.poison()
        self.backend.init_forward_metadata(batch)
        self.paths[("TARGET_VERIFY[tree]", self.backend.explain().path.value)] += 1
        visible = [[path_to(par, i) for i in range(k)] for par in parents]
        new_rows = []
        for li, layer in enumerate(self.layers):
            q, lat = self._rand(len(rows) * k, HEADS, DIMS.qk_head_dim), self._rand(len(rows) * k, DIMS.latent_dim)
            out = self.backend.forward(q, lat, None, layer, batch)
            ref = torch.cat([tree_oracle(q[b * k + i: b * k + i + 1], req.latent[li],
                                         [lat[b * k + j] for j in visible[b][i]], self.kv_b[li])
                             for b, req in enumerate(reqs) for i in range(k)])
            self._check(out, ref, f"TARGET_VERIFY tree layer {li} rows {rows} parents {parents}")
            new_rows.append(lat)
        self.batches += 1
        for b, (req, p) in enumerate(zip(reqs, prefix)):  # accept one path; move its rows, rewind the rest
            path = visible[b][accepted_leaf[b]]
            table = self.pool.req_to_token[req.row].long()
            src, dst = table[[p + j for j in path]], table[p: p + len(path)]
            for li in range(self.L):
                self.kv.set_latent(li, dst, self.kv.kv_buffer[li][src].clone())
                req.latent[li].extend(new_rows[li][b * k + j] for j in path)
            self.rewind(req, p + len(path))

    def draft_tree(self, rows: list[int], topk: int, parents: list[list[list[int]]]) -> None:
        """A multi-step draft with ``topk`` branches per request (``parents[b][s][j]``: the branch of step s - 1 that
        branch j of step s extends; step 0's entries unused) in SGLang's key layout (key ``j * S + s``, all
        ``topk * S`` keys in the row from step 0, the future ones poison), every step checked per layer; the draft
        keys are rewound after (a target verify would follow)."""
        reqs, S = [self.live[r] for r in rows], len(parents[0])
        n, bs = topk * S, len(rows)
        prefix = [r.length for r in reqs]
        keys = torch.stack([self.alloc.alloc_for_request(self.pool, r.row, p, n) for r, p in zip(reqs, prefix)])
        seen = [[[j * S] for j in range(topk)] for _ in rows]  # per request, per branch: the keys it sees, in order
        batches, masks = [], []
        for s in range(S):
            if s:
                seen = [[seen[b][parents[b][s][j]] + [j * S + s] for j in range(topk)] for b in range(bs)]
            mask = torch.zeros(bs, topk, n, dtype=torch.bool)
            for b in range(bs):
                for j in range(topk):
                    mask[b, j, seen[b][j]] = True
            masks.append([[list(v) for v in per_b] for per_b in seen])
            loc = keys.view(bs, topk, S)[:, :, s].reshape(-1)
            batches.append(ForwardBatch.draft_decode(rows, [p + n for p in prefix], loc, "cpu", step=s,
                                                     tree=DraftTree.draft(mask, "cpu")))
        draft = self.drafts.get(S) or self.drafts.setdefault(S, MultiStepDraftBackend(S, **self.backend_kw))
        self.poison()
        draft.init_forward_metadata(batches)
        written: list[list[dict[int, torch.Tensor]]] = [[{} for _ in rows] for _ in range(self.L)]
        for s, batch in enumerate(batches):
            self.paths[("DRAFT_DECODE[tree]", draft.step(s).explain().path.value)] += 1
            for li, layer in enumerate(self.layers):
                q, lat = self._rand(bs * topk, HEADS, DIMS.qk_head_dim), self._rand(bs * topk, DIMS.latent_dim)
                out = draft.forward(q, lat, None, layer, batch)
                for b in range(bs):
                    for j in range(topk):
                        written[li][b][j * S + s] = lat[b * topk + j]
                ref = torch.cat([tree_oracle(q[b * topk + j: b * topk + j + 1], reqs[b].latent[li],
                                             [written[li][b][key] for key in masks[s][b][j]], self.kv_b[li])
                                 for b in range(bs) for j in range(topk)])
                self._check(out, ref, f"DRAFT_DECODE tree step {s} layer {li} rows {rows}")
            self.batches += 1
        for req, p in zip(reqs, prefix):
            self.rewind(req, p)

    # ------------------------------------------------------------------ operations
    def new_request(self, prompt_len: int) -> Request | None:
        if not self.pool.available_size():
            return None
        row = self.pool.alloc(1)[0]
        req = Request(row, prompt_len, [[] for _ in range(self.L)])
        self.live[row] = req
        return req

    def release(self, req: Request) -> None:
        self.kv.clear_pages(self.alloc.free_request(self.pool, req.row))
        self.pool.free(req.row)
        del self.live[req.row]

    def rewind(self, req: Request, keep: int) -> None:
        """Accept the first ``keep`` tokens: the rest go (verify's partial acceptance)."""
        self.kv.clear_pages(self.alloc.truncate_request(self.pool, req.row, keep))
        for lat in req.latent:
            del lat[keep:]

    def fits(self, reqs_new: list[tuple[Request, int]]) -> bool:
        need = sum(max(0, -(-(r.length + n) // self.p) - len(self.alloc.request_pages(r.row))) for r, n in reqs_new)
        return need <= self.alloc.num_free_pages() and all(r.length + n <= self.ctx for r, n in reqs_new)


def oracle(q: torch.Tensor, reqs: list[Request], new: list[int], kv_b: torch.Tensor, layer: int) -> torch.Tensor:
    """fp64 non-absorbed MLA of each request's new queries over its true tokens (causal, bottom-right)."""
    outs, start = [], 0
    r = DIMS.kv_lora_rank
    for req, n in zip(reqs, new):
        lat = torch.stack(req.latent[layer]).double()
        o, _ = mla_nonabsorbed(q[start:start + n].double(), lat[:, :r], lat[:, r:], kv_b.double(),
                               qk_nope_head_dim=DIMS.qk_nope_head_dim, v_head_dim=DIMS.v_head_dim,
                               scale=1.0 / math.sqrt(DIMS.qk_head_dim), causal=True)
        outs.append(o)
        start += n
    return torch.cat(outs) if outs else torch.empty(0, HEADS, DIMS.v_head_dim, dtype=torch.float64)


def path_to(parents: list[int], i: int) -> list[int]:
    """Tokens root .. i of a parent array (i's ancestors and itself, root first), by walking the parents."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_oracle(q: torch.Tensor, committed: list[torch.Tensor], seen: list[torch.Tensor],
                kv_b: torch.Tensor) -> torch.Tensor:
    """fp64 non-absorbed MLA of ONE query [1, H, dq] over the request's true tokens and the draft rows it sees: no
    mask is needed, the rows are the keys."""
    lat = torch.stack(committed + seen).double()
    r = DIMS.kv_lora_rank
    o, _ = mla_nonabsorbed(q.double(), lat[:, :r], lat[:, r:], kv_b.double(), qk_nope_head_dim=DIMS.qk_nope_head_dim,
                           v_head_dim=DIMS.v_head_dim, scale=1.0 / math.sqrt(DIMS.qk_head_dim), causal=False)
    return o


def refused(world: FuzzWorld, fn, exc=ValueError) -> None:
    """``fn`` raises ``exc`` and changes no host bookkeeping, no table entry and no pool value."""
    before = (world.pool.req_to_token.clone(), list(world.pool.allocated_len), world.pool.available_size(),
              world.alloc.num_free_pages(), {r: world.alloc.request_pages(r) for r in world.live},
              [b.clone().nan_to_num(7.0) for b in world.kv.kv_buffer])
    try:
        fn()
    except exc:
        pass
    else:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} was accepted")
    after = (world.pool.req_to_token, list(world.pool.allocated_len), world.pool.available_size(),
             world.alloc.num_free_pages(), {r: world.alloc.request_pages(r) for r in world.live},
             [b.nan_to_num(7.0) for b in world.kv.kv_buffer])
    assert torch.equal(before[0], after[0]) and before[1:5] == after[1:5], "a refused call changed bookkeeping"
    assert all(torch.equal(a, b) for a, b in zip(before[5], after[5])), "a refused call wrote the pool"
    world.refusals += 1


def misuse(world: FuzzWorld, kind: int) -> None:
    """One misuse of the engine's API; each must be refused, changing nothing."""
    live = list(world.live.values())
    free_rows = [r for r in range(world.pool.size) if not world.pool.is_held(r)]
    kind %= 7
    if kind == 0 and free_rows:  # double free of a row / a request call on a freed row
        refused(world, lambda: world.pool.free(free_rows[0]))
        refused(world, lambda: world.alloc.free_request(world.pool, free_rows[0]))
        refused(world, lambda: world.alloc.alloc_for_request(world.pool, free_rows[0], 0, 1))
    if not live:
        return
    req = live[0]
    if kind == 1:
        refused(world, lambda: world.pool.free([req.row, req.row]))  # a live request's row
        if world.pool.available_size():  # a fresh row holding no tokens: only the duplicate is wrong
            row = world.pool.alloc(1)[0]
            refused(world, lambda: world.pool.free([row, row]))
            world.pool.free(row)
    elif kind == 2 and world.alloc.request_pages(req.row):  # someone else's page
        refused(world, lambda: world.alloc.free_pages(world.alloc.request_pages(req.row)[:1]))
    elif kind == 3:  # seq_lens past the allocation (on the planned path of this backend)
        n = req.length
        slot = world.pool.req_to_token[req.row, max(n - 1, 0)].long().reshape(1)
        refused(world, lambda: world.backend.init_forward_metadata(
            ForwardBatch.decode([req.row], [n + 1], slot, "cpu")))
    elif kind == 4 and len(live) > 1 and live[1].length and req.length:  # a slot of another request
        other = world.pool.req_to_token[live[1].row, live[1].length - 1].long().reshape(1)
        refused(world, lambda: world.backend.init_forward_metadata(
            ForwardBatch.decode([req.row], [req.length], other, "cpu")))
    elif kind == 5 and req.length >= 2:  # forward with a batch other than the planned one
        slots = world.pool.req_to_token[req.row, req.length - 2: req.length].long()
        planned = ForwardBatch.decode([req.row], [req.length], slots[1:], "cpu")
        world.backend.init_forward_metadata(planned)
        other = ForwardBatch.decode([req.row], [req.length - 1], slots[:1], "cpu")  # valid, but not planned
        q = torch.zeros(1, HEADS, DIMS.qk_head_dim)
        refused(world, lambda: world.backend.forward(q, None, None, world.layers[0], other))
    elif kind == 6 and req.length >= 2:  # draft trees that do not fit their batch
        slots = world.pool.req_to_token[req.row, req.length - 2: req.length].long()
        two = DraftTree.from_parents([[-1, 0], [-1, 0]], "cpu")  # two trees for one request
        refused(world, lambda: ForwardBatch.verify([req.row], [req.length], slots, "cpu", num_draft_tokens=2,
                                                   tree=two), DraftTreeError)
        one = DraftTree.from_parents([[-1, 0]], "cpu")  # no prefix before the 2 tree keys
        refused(world, lambda: world.backend.init_forward_metadata(ForwardBatch.verify(
            [req.row], [2], world.pool.req_to_token[req.row, :2].long(), "cpu", num_draft_tokens=2, tree=one)),
            DraftTreeError)


__all__ = ["FuzzWorld", "OPS", "OutOfSlotsError", "OwnershipError", "misuse", "oracle", "path_to", "refused",
           "tree_oracle"]
