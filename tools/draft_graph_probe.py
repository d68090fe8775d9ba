"""The kit's topk-2, page-1 EAGLE draft case on the GPU (tests/test_sglang_gpu.py, ``_DRAFT_GRAPH``): its eager run and
its draft graph runner's replay differ in 1-2 of 15 draft values. One line per variant (pass, or the kit's message),
each variant removing one suspect; ``--dump`` prints each live row's attention against an fp64 oracle over the pool
and the eager run against the padded replay row by row (queries, outputs, the latent rows each step wrote).

    python3 tools/draft_graph_probe.py [VARIANT ...]   (on the GPU machine, with PYTHONPATH=$PWD:/tmp/site after one
    python3 tools/draft_graph_probe.py --dump            tools/device_sglang_run.sh call has set up /tmp/site)
    python3 tools/draft_graph_probe.py --guard [fa3]

``--guard [fa3]`` follows the pool through the base case: each store of the kit's model against what it was given and
against the other run's store of the same slots, and what changed the pool between stores (and across our forwards).

Variants: the case; SGLang's fa3 on it; the runner's replay run eagerly (no CUDA graph); other prefixes; a capture of
3 requests (no padding row); no in-graph prologue; the tree part on the torch reference; 2 and 4 draft steps; SGLang's
MLA KV store launched without programmatic dependent launch (ours and fa3). Findings: docs/PERFORMANCE_HISTORY.md,
"Inside SGLang, tenth run" — ``--guard`` located the cause: SGLang's store kernel reads the per-step slot vector of
its EAGLE draft (a strided view) as contiguous (earlier variants and probes: the same file)."""

from __future__ import annotations

import contextlib
import sys
import traceback

import torch

from tests.oracle import dense_attention
from tests.sglang_world import D_ROPE, R, TESTCASE, ReplayAsEagerRun, case  # noqa: I001 - SGLang's import shim first

import sglang.srt.speculative.eagle_draft_cuda_graph_runner as graph_runner  # noqa: E402
from sglang.kernels.ops.kvcache import mla_buffer  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_runner as dr  # noqa: E402

from mla_fa3 import absorb_tree  # noqa: E402
from mla_fa3.integrations.sglang import draft  # noqa: E402
from mla_fa3.integrations.sglang.adapter import SGLangMLABackend  # noqa: E402
from mla_fa3.integrations.sglang.draft import draft_columns  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the same case on our reference kernels


def run(prefixes=(14, 5, 30), capture_bs=4, topk=2, page_size=1, steps=3, backend="mla_fa3"):
    c = case("DECODE", prefix_lens=prefixes, page_size=page_size, backend=backend,
             name=f"draft_probe_{'_'.join(map(str, prefixes))}")
    dr.run_mla_eagle_draft_cuda_graph_runner_case(TESTCASE, c, topk=topk, speculative_num_steps=steps,
                                                  speculative_num_draft_tokens=4 if topk > 1 else 3,
                                                  cuda_graph_capture_batch_size=capture_bs, kv_lora_rank=R,
                                                  qk_rope_head_dim=D_ROPE, device=DEVICE, dtype=torch.bfloat16)


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def no_device_metadata():
    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.backend.init_cuda_graph_state(max_bs, self.max_context, max_num_draft_tokens=max(self.num_draft_tokens, 1),
                                           device_metadata=False)
        self._device_lengths.clear()

    with patched(SGLangMLABackend, "init_cuda_graph_state", init_cuda_graph_state):
        yield


@contextlib.contextmanager
def tree_part_reference():
    real = absorb_tree.ops.tree_attention

    def reference(*args, **kwargs):
        kwargs["impl"] = "reference"
        return real(*args, **kwargs)

    with patched(absorb_tree.ops, "tree_attention", reference):
        yield


@contextlib.contextmanager
def nothing():
    yield


@contextlib.contextmanager
def no_graph():
    with patched(graph_runner, "resolve_decode_backend", ReplayAsEagerRun):
        yield


@contextlib.contextmanager
def store_without_pdl():
    """SGLang's MLA KV store (``sglang/kernels/ops/kvcache/mla_buffer.py``) launched without programmatic dependent
    launch: on sm_90 it waits for its predecessor and lets its dependents start early (``gdc_launch_dependents``)."""
    with patched(mla_buffer, "is_arch_support_pdl", lambda *args, **kwargs: False):
        yield


VARIANTS = [
    ("SGLang's KV store without PDL", store_without_pdl, {}),
    ("fa3, SGLang's KV store without PDL", store_without_pdl, dict(backend="fa3")),
    ("base (14, 5, 30), capture 4", nothing, {}),
    ("fa3, the same case", nothing, dict(backend="fa3")),
    ("graph runner, replay run eagerly", no_graph, {}),
    ("prefixes (14, 7, 30)", nothing, dict(prefixes=(14, 7, 30))),
    ("prefixes (14, 6, 30)", nothing, dict(prefixes=(14, 6, 30))),
    ("prefixes (5, 14, 30)", nothing, dict(prefixes=(5, 14, 30))),
    ("prefixes (14, 30, 5)", nothing, dict(prefixes=(14, 30, 5))),
    ("prefixes (3, 4, 5)", nothing, dict(prefixes=(3, 4, 5))),
    ("capture 3 (no padding row)", nothing, dict(capture_bs=3)),
    ("no in-graph prologue", no_device_metadata, {}),
    ("tree part on torch", tree_part_reference, {}),
    ("steps 2", nothing, dict(steps=2)),
    ("steps 4", nothing, dict(steps=4)),
]


LIVE = 3  # the kit case's requests; a padded replay adds padding rows after them


def dump() -> None:
    """The base case with the replay run eagerly: at every draft step and layer, each live row's attention output
    against the fp64 oracle (tests/oracle.py) over the pool rows the kit laid out (request b's prefix columns and its
    branch's draft columns of steps 0 .. i, read through ``req_to_token``), and what our kernels were handed (the
    prefix lengths, page-table entries, tree key slots and mask) — for the eager run and the padded replay; then the
    two runs row by row: queries, outputs and the latent rows each step wrote. The replay's capture calls report too
    (all-padding metadata, outputs discarded: the rows with prefix 1)."""
    absorbed = draft.SGLangDraftStepBackend._forward_absorbed
    pools: dict[int, int] = {}
    seen: dict[tuple[int, int, int], tuple] = {}  # (run, step, layer) -> the live rows' q, out, written rows

    def recording(self, q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope):
        out = absorbed(self, q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope)
        which = pools.setdefault(id(self.req_to_token_pool), len(pools))  # 0: the eager run, 1: the replay
        r, H, T = self.kv_lora_rank, int(layer.tp_q_head_num), batch.num_tokens
        q_full = q.reshape(T, H, -1) if q_rope is None else \
            torch.cat([q.reshape(T, H, r), q_rope.reshape(T, H, -1)], dim=-1)
        kv = self.mla_pool.paged(self._pool_layer(layer)).reshape(-1, q_full.shape[-1])
        live = LIVE * self.topk
        parts = (q_full[:live], out[:live], kv[fb.out_cache_loc[:live].long()])
        seen[(which, self.step, int(layer.layer_id))] = tuple(t.reshape(live, -1).double().cpu() for t in parts)
        _report(self, which, layer, fb, batch, q_full, out.reshape(T, H, r), kv)
        return out

    with patched(draft.SGLangDraftStepBackend, "_forward_absorbed", recording), no_graph():
        try:
            run()
            print("dump: the kit passed")
        except AssertionError as e:
            print("dump: the kit failed:", " ".join(str(e).split())[:600])
    for (which, step, lid), parts in sorted(seen.items()):
        other = seen.get((1 - which, step, lid))
        if which == 0 and other is not None:
            deltas = [f"{(a - b).abs().max().item():.4g}" for a, b in zip(parts, other)]
            print(f"eager vs padded replay, step {step} layer {lid}: max |delta| of the live rows' queries, outputs "
                  f"and latent rows at out_cache_loc: {deltas}", flush=True)


def _report(backend, which, layer, fb, batch, q_full, out, kv) -> None:
    """One draft step's layer: rows off the fp64 oracle (and every row of request 1), then, at step 0 of layer 0, the
    kit's prefix slots that are also draft slots and the metadata our kernels read."""
    r, bs, topk, S, i = backend.kv_lora_rank, batch.batch_size, backend.topk, backend.num_steps, backend.step
    rows, prefix = fb.req_pool_indices[:bs].long(), fb.seq_lens[:bs].long()
    cols = draft_columns(prefix, topk, S, backend.page_size)
    table = backend.req_to_token_pool.req_to_token
    for b in range(min(bs, LIVE)):
        for j in range(topk):
            t = b * topk + j
            slots = torch.cat([table[rows[b], : int(prefix[b])], table[rows[b], cols[b, j * S: j * S + i + 1]]]).long()
            keys = kv[slots].unsqueeze(1)
            ref, _ = dense_attention(q_full[t: t + 1], keys, keys[..., :r], scale=float(layer.scaling))
            err = (out[t].double().cpu() - ref[0]).abs().max().item()
            if err > 2e-2 * max(ref.abs().max().item(), 1.0) or b == 1:
                print(f"run {which} step {i} layer {layer.layer_id} request {b} branch {j}: max |ours - fp64| "
                      f"{err:.4g}; prefix {int(prefix[b])} rows {rows.tolist()} slots {slots.tolist()}", flush=True)
    if i == 0 and int(layer.layer_id) == 0:
        for b in range(min(bs, LIVE)):
            draft_slots = table[rows[b], cols[b]].tolist()
            shared = sorted(set(table[rows[b], : int(prefix[b])].tolist()) & set(draft_slots))
            print(f"run {which} request {b}: prefix slots that are also draft slots {shared}; draft slots "
                  f"{draft_slots}", flush=True)
        md = backend.backend.step_plan.metadata
        print(f"run {which} metadata: cache_seqlens {md.cache_seqlens.tolist()} page_table[:, :8] "
              f"{md.page_table[:, :8].tolist()} key_slots {md.tree.key_slots.tolist()} mask "
              f"{md.tree.mask.int().tolist()} out_cache_loc {fb.out_cache_loc.tolist()}", flush=True)


def guard(backend: str = "mla_fa3") -> dict:
    """The pool's chain of custody through the base case (the replay run eagerly), per layer buffer: at each store of
    the kit's model (SGLang's ``MLATokenToKVPool.set_mla_kv_buffer``) the rows that changed since the previous store
    (the attention between them stores nothing: the model does), the stored rows against the rows it was given, rows
    it changed outside its slots, and the rows given against those the other run's store of the same slots was given;
    with mla_fa3, also every row each of our forwards changed. Slot 0 (SGLang's padding slot, written by every
    padding row) is left out. Printed as found; returned as ``{"stores", "forwards", "compared" (stores matched with
    the other run's), "stored_off", "outside", "between", "ours", "given_off", "kit"}`` (the lists name (run, store or
    step, slots) where anything was found)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    store, absorbed = MLATokenToKVPool.set_mla_kv_buffer, draft.SGLangDraftStepBackend._forward_absorbed
    after_store: dict[tuple, torch.Tensor] = {}  # (id(pool), layer) -> the layer's rows after its last store
    runs: dict[int, int] = {}  # id(pool) -> 0 for the eager run, 1 for the replay (its capture calls included)
    pools = []  # every pool seen, kept alive so that no later pool takes its id
    given_at: dict[tuple, dict[int, torch.Tensor]] = {}  # (layer, its live slots) -> run -> the rows it was given
    found = dict(stores=0, forwards=0, compared=0, stored_off=0.0, outside=[], between=[], ours=[], given_off=[],
                 kit=None)

    def rows_of(buf):  # [slots, 576] over SGLang's [slots, 1, 576] buffer or our paged view of it
        return buf.view(-1, buf.shape[-1])

    def changed(a, b):
        diff = (a.float() - b.float()).abs().amax(-1)
        diff[0] = 0
        return [(int(i), round(diff[i].item(), 4)) for i in diff.nonzero().flatten()[:12]]

    def note(kind, where, what):
        if what:
            found[kind].append((*where, what))
            print(f"{kind} {where}: {what}", flush=True)

    def storing(self, layer, loc, k_nope, k_rope):
        buf, where = self.kv_buffer[layer.layer_id - self.start_layer], (id(self), layer.layer_id)
        if id(self) not in runs:
            assert len(runs) < 2, "the case builds one pool for its eager run and one for the replay"
            runs[id(self)] = len(runs)
            pools.append(self)
        run_id, call = runs[id(self)], found["stores"]
        found["stores"] += 1
        before = rows_of(buf).clone()
        prev = after_store.get(where)
        if prev is not None:
            note("between", (run_id, call), changed(prev, before))
        out = store(self, layer, loc, k_nope, k_rope)
        rows, slots, live = rows_of(buf), loc.long(), loc.long() != 0
        given = torch.cat([k_nope.reshape(loc.numel(), -1), k_rope.reshape(loc.numel(), -1)], -1).to(rows.dtype)
        off = (rows[slots[live]].float() - given[live].float()).abs().amax().item() if live.any() else 0.0
        found["stored_off"] = max(found["stored_off"], off)
        outside = rows.clone()
        outside[slots] = before[slots]
        note("outside", (run_id, call), changed(before, outside))
        key = (layer.layer_id, tuple(slots[live].tolist()))  # the other run's store of these slots: what it was given
        other = given_at.setdefault(key, {}).get(1 - run_id)
        if other is not None:
            found["compared"] += 1
            delta = (given[live].float() - other).abs().amax(-1)
            note("given_off", (run_id, call), [(s, round(d, 4)) for s, d in zip(key[1], delta.tolist()) if d > 0][:12])
        given_at[key][run_id] = given[live].float().clone()
        after_store[where] = rows.clone()
        print(f"run {run_id} store {call} at {loc.tolist()}: max |stored - given| {off:.4g}", flush=True)
        return out

    def recording(self, q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope):
        buf = self.mla_pool.paged(self._pool_layer(layer))
        before = rows_of(buf).clone()
        out = absorbed(self, q, k, layer, fb, batch, save_kv_cache, q_rope, k_rope)
        found["forwards"] += 1
        note("ours", (self.step, int(layer.layer_id)), changed(before, rows_of(buf)))
        return out

    with patched(MLATokenToKVPool, "set_mla_kv_buffer", storing), \
            patched(draft.SGLangDraftStepBackend, "_forward_absorbed", recording), no_graph():
        try:
            run(backend=backend)
            found["kit"] = "passed"
        except AssertionError as e:
            found["kit"] = " ".join(str(e).split())[:600]
    print("guard: the kit", found["kit"], flush=True)
    return found


def main() -> int:
    if sys.argv[1:] == ["--dump"]:
        dump()
        return 0
    if sys.argv[1:2] == ["--guard"]:
        guard(*sys.argv[2:3])
        return 0
    only = set(sys.argv[1:])
    for name, ctx, kwargs in VARIANTS:
        if only and name not in only:
            continue
        try:
            with ctx():
                run(**kwargs)
            print(f"PASS  {name}", flush=True)
        except Exception as e:  # the kit's assertion, or anything else: name it and go on
            msg = " ".join(str(e).split())[:2000]
            print(f"FAIL  {name}: {type(e).__name__}: {msg}", flush=True)
            if not isinstance(e, AssertionError):
                traceback.print_exc(limit=6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
