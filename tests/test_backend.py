"""MLABackend on CPU (reference kernels) against the NON-absorbed fp64 oracle, for every mode.

The oracle (tests/oracle.py ``mla_nonabsorbed``) decompresses c_kv through kv_b_proj into per-head
K and V and runs dense attention with explicit causal masks in fp64; the backend runs the absorbed
path in fp32 over a shuffled, NaN-poisoned paged latent pool. fp32 vs fp64: rel. error <= 1e-5.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mla_cases import follow_up, make_batch, make_mla_case, mla_oracle, padded, rel_err
from specs import CORE_SPECS, MLA_CONFIGS, SPECS, BatchSpec, MLAConfig

from mla_fa3 import ops
from mla_fa3.policy.paths import DecodeKernel
from mla_fa3.backend import MLABackend
from mla_fa3.batch import ForwardMode
from mla_fa3.draft_backend import MultiStepDraftBackend
from mla_fa3.plan import AttentionPath
from mla_fa3.layer import MLADims

TOL = 1e-5  # fp32 compute vs fp64 oracle
DEC, VER, DRAFT = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE


def backend_for(case, **kw) -> MLABackend:
    kw.setdefault("impl", "reference")
    kw.setdefault("num_heads", case.cfg.num_heads)
    kw.setdefault("mla_dims", case.cfg.dims)
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                      page_size=case.spec.page_size, device=case.layout.device, **kw)


def run_step(case, backend=None, **kw):
    backend = backend or backend_for(case, **kw)
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q, case.new_latent, None, case.layer, case.batch), backend


# every named spec with the small odd config; the DeepSeek-V3 dims on one spec per mode
CASES = [(name, "odd_small") for name in SPECS] + [(name, "deepseek_v3") for name in CORE_SPECS]


@pytest.mark.parametrize("spec_name,cfg_name", CASES)
def test_every_mode_matches_nonabsorbed_oracle(spec_name, cfg_name):
    case = make_mla_case(spec_name, cfg_name, seed=sum(map(ord, spec_name + cfg_name)))
    out, backend = run_step(case, prefill_path="absorbed")
    cfg = MLA_CONFIGS[cfg_name]
    assert out.shape == (sum(case.spec.extend_lens), cfg.num_heads, cfg.dims.v_head_dim)
    assert out.dtype == torch.float32
    if case.spec.mode is ForwardMode.IDLE:
        assert backend.explain().path is AttentionPath.IDLE
        return
    assert torch.isfinite(out).all(), "a NaN-poisoned stale slot leaked into the output"
    assert rel_err(out, mla_oracle(case)) <= TOL
    rec = backend.explain()
    assert rec.mode == case.spec.mode.name
    assert rec.path is AttentionPath.ABSORBED and rec.impl == "reference"


@pytest.mark.parametrize("seed", range(8))
def test_random_configs_and_batches(seed):
    """Seeded fuzz: random MLA dims / heads, page size, mode and lengths vs the oracle."""
    rng = torch.Generator().manual_seed(seed)

    def pick(n):
        return int(torch.randint(n, (1,), generator=rng))

    d_rope = 4 * (1 + pick(4))
    dims = MLADims(kv_lora_rank=8 * (1 + pick(8)), qk_nope_head_dim=4 * (1 + pick(8)), qk_rope_head_dim=d_rope,
                   v_head_dim=4 * (1 + pick(8)))
    cfg = MLAConfig(1 + pick(5), dims)
    mode = [DEC, VER, DRAFT, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND][pick(6)]
    bs, page = 1 + pick(4), [1, 2, 16, 64][pick(4)]
    prefix = tuple(pick(90) for _ in range(bs))
    if mode is VER:
        ext = (1 + pick(4),) * bs
    elif mode.is_decode_like():
        ext = (1,) * bs
    else:
        ext = tuple(1 + pick(12) for _ in range(bs))
    case = make_mla_case(BatchSpec(mode, prefix, ext, page_size=page), cfg, seed=seed)
    out, _ = run_step(case, prefill_path="absorbed")
    assert rel_err(out, mla_oracle(case)) <= TOL, (cfg, mode, prefix, ext, page)


@pytest.mark.parametrize("prefill_path", ["mha", "auto"])
@pytest.mark.parametrize("spec_name", ["extend_no_prefix", "extend_with_prefix", "mixed_long_prefix",
                                       "extend_page64_cross_page", "draft_extend"])
def test_extend_steps_through_the_mha_prefill_dispatch(spec_name, prefill_path):
    """The plan / chunked_prefix wiring: whatever path runs, the output is the oracle's."""
    case = make_mla_case(spec_name, "odd_small", seed=17)
    out, backend = run_step(case, prefill_path=prefill_path,
                            prefill_workspace_tokens=max(24, case.spec.page_size))  # splits mid-page
    assert rel_err(out, mla_oracle(case)) <= TOL
    rec = backend.explain()
    assert rec.decision is not None and rec.path.value == rec.decision.path.value
    if prefill_path == "mha":
        assert rec.path in (AttentionPath.MHA_ONESHOT, AttentionPath.MHA_CHUNKED)
        assert backend.step_plan.prefill is not None
    # the plan is made once, in init_forward_metadata; a second layer of the same step only reads it
    plan, prefill = backend.step_plan, backend.step_plan.prefill
    backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert backend.step_plan is plan and plan.prefill is prefill and backend.explain() is plan.record


@pytest.mark.parametrize("spec_name", ["small_decode", "extend_with_prefix", "mixed_long_prefix", "verify_k4"])
def test_latent_rows_land_at_out_cache_loc_and_nowhere_else(spec_name):
    case = make_mla_case(spec_name, "odd_small", seed=3)
    before = [b.clone() for b in case.pool.kv_buffer]
    run_step(case)
    loc = case.batch.out_cache_loc
    after = case.pool.kv_buffer[case.layer.layer_id]
    torch.testing.assert_close(after[loc], case.new_latent, rtol=0, atol=0)
    untouched = torch.ones(after.shape[0], dtype=torch.bool)
    untouched[loc] = False
    # NaN == NaN for this comparison: every other slot (NaN-poisoned or prefix) is bit-identical
    assert torch.equal(after[untouched].nan_to_num(7.0), before[case.layer.layer_id][untouched].nan_to_num(7.0))
    other = 1 - case.layer.layer_id
    assert torch.equal(case.pool.kv_buffer[other].isnan(), before[other].isnan())


def test_split_latent_form_and_save_kv_cache_false():
    """k = c_kv, v = k_rope equals the concatenated latent; save_kv_cache=False writes nothing."""
    case = make_mla_case("extend_with_prefix", "odd_small", seed=5)
    r = case.cfg.dims.kv_lora_rank
    backend = backend_for(case, prefill_path="mha")
    backend.init_forward_metadata(case.batch)
    out = backend.forward(case.q, case.new_latent[:, :r], case.new_latent[:, r:], case.layer, case.batch)
    assert rel_err(out, mla_oracle(case)) <= TOL
    # a second pool where the rows were written by someone else: save_kv_cache=False must not write
    twin = make_mla_case("extend_with_prefix", "odd_small", seed=5)
    buf = twin.pool.kv_buffer[twin.layer.layer_id]
    buf[twin.batch.out_cache_loc] = twin.new_latent
    snapshot = buf.clone()
    b2 = backend_for(twin)
    b2.init_forward_metadata(twin.batch)
    garbage = torch.full_like(twin.new_latent, 1e4)
    out2 = b2.forward(twin.q, garbage, None, twin.layer, twin.batch, save_kv_cache=False)
    assert torch.equal(buf.nan_to_num(7.0), snapshot.nan_to_num(7.0))
    assert rel_err(out2, mla_oracle(twin)) <= TOL


@pytest.mark.parametrize("cfg_name,page_size", [("odd_small", 1), ("odd_small", 16), ("odd_small", 64),
                                                ("deepseek_v3", 16)])
def test_verify_k_tokens_equals_k_sequential_decodes(cfg_name, page_size):
    k, prefix = 4, (9, 30, 2)
    spec = BatchSpec(VER, prefix, (k,) * len(prefix), page_size=page_size)
    ver = make_mla_case(spec, cfg_name, seed=11)
    out_v, _ = run_step(ver)
    assert rel_err(out_v, mla_oracle(ver)) <= TOL
    # the same requests, tokens written one decode step at a time into a twin pool
    seq = make_mla_case(spec, cfg_name, seed=11)
    backend = backend_for(seq)
    d = seq.cfg.dims
    outs = []
    for j in range(k):
        batch = make_batch(seq.layout, DEC, [p + j for p in prefix], [1] * len(prefix))
        rows = torch.tensor([b * k + j for b in range(len(prefix))])
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(seq.q[rows], seq.new_latent[rows], None, seq.layer, batch))
    out_d = torch.stack(outs, dim=1).reshape(len(prefix) * k, seq.cfg.num_heads, d.v_head_dim)
    assert rel_err(out_v, out_d) <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_step_i_equals_the_eager_decode_it_stands_for(page_size):
    steps, prefix = 3, (7, 18, 1)
    spec = BatchSpec(DRAFT, prefix, (1,) * len(prefix), page_size=page_size, reserve=steps + 2)
    case = make_mla_case(spec, "odd_small", seed=21, reserve=steps + 2)
    g = torch.Generator().manual_seed(5)
    d, H, bs = case.cfg.dims, case.cfg.num_heads, len(prefix)
    latents = [torch.randn(bs, d.latent_dim, generator=g) for _ in range(steps)]
    qs = [torch.randn(bs, H, d.qk_head_dim, generator=g) for _ in range(steps)]
    draft = MultiStepDraftBackend(steps, req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                                  page_size=page_size, device="cpu", impl="reference")
    base = case.batch  # step 0: seq_lens = prefix + 1
    draft.init_forward_metadata(base)
    for i in range(steps):
        md = draft.step(i).forward_metadata
        assert md.cache_seqlens.tolist() == [p + i + 1 for p in prefix]
    twin = make_mla_case(spec, "odd_small", seed=21, reserve=steps + 2)
    eager = backend_for(twin)
    for i in range(steps):
        loc = torch.stack([case.layout.slots[b][prefix[b] + i] for b in range(bs)])
        out = draft.forward(qs[i], latents[i], None, case.layer, draft.step_batch(base, i, loc))
        dec = make_batch(twin.layout, DEC, [p + i for p in prefix], [1] * bs)
        eager.init_forward_metadata(dec)
        ref = eager.forward(qs[i], latents[i], None, twin.layer, dec)
        assert rel_err(out, ref) <= TOL
        # and the fp64 oracle over the true latent history (prefix rows + the i+1 draft rows)
        for b in range(bs):
            hist = torch.cat([case.latent[b][: prefix[b]]] + [latents[j][b:b + 1] for j in range(i + 1)])
            c1 = make_single_oracle(case, qs[i][b:b + 1], hist)
            assert rel_err(out[b:b + 1], c1) <= TOL
    assert [r.mode for r in draft.explain()] == ["DRAFT_DECODE"] * steps


def make_single_oracle(case, q, latent):
    from oracle import mla_nonabsorbed
    d = case.cfg.dims
    o, _ = mla_nonabsorbed(q.double(), latent[:, : d.kv_lora_rank].double(), latent[:, d.kv_lora_rank:].double(),
                           case.kv_b_proj, qk_nope_head_dim=d.qk_nope_head_dim, v_head_dim=d.v_head_dim,
                           scale=case.layer.scaling)
    return o


def test_idle_touches_no_kernel_and_no_pool(monkeypatch):
    case = make_mla_case("idle", "odd_small")
    backend = backend_for(case)

    def boom(*a, **k):
        raise AssertionError("IDLE must not run a kernel")

    for name in ("flash_attn_with_kvcache", "flash_mla_with_kvcache", "get_mla_decode_metadata"):
        monkeypatch.setattr(ops, name, boom)
    before = [b.clone() for b in case.pool.kv_buffer]
    backend.init_forward_metadata(case.batch)
    q = torch.empty(0, case.cfg.num_heads, case.cfg.dims.qk_head_dim)
    out = backend.forward(q, torch.empty(0, case.cfg.dims.latent_dim), None, case.layer, case.batch)
    assert out.shape == (0, case.cfg.num_heads, case.cfg.dims.v_head_dim)
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(case.pool.kv_buffer, before))


@pytest.mark.parametrize("logit_cap,window", [(5.0, -1), (0.0, 6), (3.0, 4)])
@pytest.mark.parametrize("spec_name", ["extend_with_prefix", "verify_k4", "small_decode"])
def test_softcap_and_sliding_window_on_mla_layers(spec_name, logit_cap, window):
    case = make_mla_case(spec_name, "odd_small", seed=8, logit_cap=logit_cap, sliding_window=window)
    out, _ = run_step(case, prefill_path="mha")  # such layers stay absorbed even when MHA is asked
    assert rel_err(out, mla_oracle(case)) <= TOL


@pytest.mark.parametrize("spec_name", ["small_decode", "decode_page64_long", "verify_k2_page64", "draft_decode"])
def test_flashmla_decode_kernel_matches_oracle(spec_name):
    spec = SPECS[spec_name]
    spec = BatchSpec(spec.mode, spec.prefix_lens, spec.extend_lens, page_size=64)
    case = make_mla_case(spec, "tiny", seed=4)
    out, backend = run_step(case, decode_kernel="flashmla", num_heads=case.cfg.num_heads)
    assert backend.explain().kernel == "flashmla"
    assert backend.step_plan.flashmla_schedule is not None
    assert rel_err(out, mla_oracle(case)) <= TOL


@pytest.mark.parametrize("kernel", ["fa3", "flashmla"])
def test_explain_names_what_ran(kernel):
    """explain().kernel is the kernel chosen; explain().ran what computed it: on a CPU the ops' torch reference
    (what the ops record as run), on the kernels' implementation the kernel itself."""
    case = make_mla_case(BatchSpec(DEC, (10, 70), (1, 1), page_size=64), "tiny", seed=4)
    _, backend = run_step(case, decode_kernel=kernel, impl=None)  # the global setting: auto, the reference here
    record = backend.explain()
    assert record.kernel == kernel and record.ran == ops.last_impl().value == "reference"
    assert replace(record, impl="fa3").ran == kernel and replace(record, kernel=None).ran is None


def test_flashmla_step_falls_back_to_fa3_for_a_softcapped_layer():
    spec = BatchSpec(DEC, (10, 70), (1, 1), page_size=64)
    case = make_mla_case(spec, "tiny", seed=4, logit_cap=4.0)
    out, backend = run_step(case, decode_kernel="flashmla", num_heads=case.cfg.num_heads)
    assert "FA3 for layers with softcap" in backend.explain().reason
    assert rel_err(out, mla_oracle(case)) <= TOL


def test_auto_decode_kernel_uses_kernel_choice():
    kc = pytest.importorskip("mla_fa3.policy.decode_kernel")
    spec = BatchSpec(DEC, (10, 70), (1, 1), page_size=64)
    case = make_mla_case(spec, "tiny", seed=4)
    out, backend = run_step(case, decode_kernel="auto", num_heads=case.cfg.num_heads)
    want = kc.explain_decode_kernel(case.cfg.num_heads, 2, 71, 64, mean_seqlen_k=(11 + 71) / 2).kernel
    assert backend.explain().kernel == want.value
    assert rel_err(out, mla_oracle(case)) <= TOL
    case16 = make_mla_case("small_decode", "tiny", seed=4)  # page 16: FlashMLA impossible
    _, b16 = run_step(case16, decode_kernel="auto", num_heads=case16.cfg.num_heads)
    assert b16.explain().kernel == "fa3" and "page_size" in b16.explain().reason


@pytest.mark.parametrize("kernel", ["fa3", "flashmla"])
@pytest.mark.parametrize("mode,k", [(DEC, 1), (VER, 3), (DRAFT, 1)])
def test_cuda_graph_capture_then_replay_reads_captured_metadata(mode, k, kernel):
    """CPU stand-in for graph replay: capture at bs 4, replay smaller batches, forward on the captured views."""
    page = 64 if kernel == "flashmla" else 16
    spec = BatchSpec(mode, (40, 3, 77), (k,) * 3, page_size=page)
    case = make_mla_case(spec, "tiny", seed=9)
    backend = backend_for(case, decode_kernel=kernel, num_heads=case.cfg.num_heads)
    backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context, max_num_draft_tokens=k)
    captured = backend.init_forward_metadata_capture_cuda_graph(4, mode, num_draft_tokens=k)
    assert captured.batch_size == 4 and backend.explain().graph
    # replays pad to the captured size like a graph runner; the second has fewer requests in another
    # order and other lengths (the stale rows of the first must not matter)
    first = follow_up(case, mode, (40, 3, 77), (k,) * 3, requests=[0, 1, 2], seed=0, pad_to=4)
    later = follow_up(case, mode, (60, 30), (k, k), requests=[2, 0], seed=1, pad_to=4)
    for step in (first, later):
        md = backend.init_forward_metadata_replay_cuda_graph(step.batch)
        assert md is captured and backend.forward_metadata is captured
        rows = 4 * k
        out = backend.forward(padded(step.q, rows), padded(step.new_latent, rows), None, step.layer, step.batch)
        assert out.shape[0] == rows
        T = step.q.shape[0]
        assert rel_err(out[:T], mla_oracle(step)) <= TOL
        assert backend.explain().kernel == kernel and backend.explain().graph


def test_auto_graphs_capture_every_kernel_and_each_replay_picks_from_live_lengths(monkeypatch):
    """decode_kernel='auto' on page 64: one graph per kernel per size (split-KV too: both the built-in whole-step
    table and the kernel-alone table measured it winning at 16 heads; with split-KV times removed only FA3 and
    FlashMLA are captured); a replay picks the kernel that kernel_choice gives for the live lengths (skew
    included) and computes the right answer with it."""
    kc = pytest.importorskip("mla_fa3.policy.decode_kernel")
    spec0 = BatchSpec(DEC, (40, 3, 77), (1,) * 3, page_size=64)
    case0 = make_mla_case(spec0, "deepseek_v3", seed=9)
    built_in = backend_for(case0, decode_kernel="auto", num_heads=case0.cfg.num_heads)
    assert built_in.graph_kernels() == (DecodeKernel.FA3, DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV)
    monkeypatch.setattr(kc, "MEASURED", tuple(replace(m, splitkv_ms=None) for m in kc.MEASURED))
    assert built_in.graph_kernels() == (DecodeKernel.FA3, DecodeKernel.FLASHMLA)
    perf = Path(__file__).resolve().parents[1] / "docs" / "perf"
    monkeypatch.setattr(kc, "MEASURED", kc.table_from_csvs([str(perf / "decode_2026-12-02_run1.csv"),
                                                             str(perf / "2026-12-03" / "decode_small_batch.csv")]))
    spec = BatchSpec(DEC, (40, 3, 77), (1,) * 3, page_size=64)
    case = make_mla_case(spec, "deepseek_v3", seed=9)
    H = case.cfg.num_heads
    backend = backend_for(case, decode_kernel="auto", num_heads=H)
    assert kc.splitkv_measured()
    assert backend.graph_kernels() == (DecodeKernel.FA3, DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV)
    backend.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context)
    for kernel in backend.graph_kernels():
        backend.init_forward_metadata_capture_cuda_graph(4, DEC, kernel=kernel)
        assert backend.graph_kernel is kernel
    for prefix, requests in (((40, 3, 77), [0, 1, 2]), ((70, 35), [2, 0])):
        step = follow_up(case, DEC, prefix, (1,) * len(prefix), requests=requests, seed=len(prefix), pad_to=4)
        backend.init_forward_metadata_replay_cuda_graph(step.batch)
        lens = [p + 1 for p in prefix]
        want = kc.explain_decode_kernel(H, len(lens), max(lens), 64, mean_seqlen_k=sum(lens) / len(lens)).kernel
        assert backend.graph_kernel is want and backend.explain().kernel == want.value
        out = backend.forward(padded(step.q, 4), padded(step.new_latent, 4), None, step.layer, step.batch)
        assert rel_err(out[: len(lens)], mla_oracle(step)) <= TOL
    with pytest.raises(ValueError, match="^kernel"):
        backend_for(case).init_forward_metadata_capture_cuda_graph(4, DEC, kernel=DecodeKernel.FLASHMLA)


def test_graph_runner_style_capture_with_a_static_batch_and_oversize_replay():
    case = make_mla_case("small_decode", "tiny", seed=2)
    backend = backend_for(case)
    backend.init_cuda_graph_state(3, case.layout.req_to_token_pool.max_context)
    backend.init_forward_metadata_capture_cuda_graph(case.batch)  # (batch) form, as GraphRunner calls it
    backend.init_forward_metadata_replay_cuda_graph(case.batch)
    out = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert rel_err(out, mla_oracle(case)) <= TOL
    # the replayed step accepts its live batch and the capture's static batch, not another batch of the size
    other = make_mla_case(BatchSpec(DEC, (9, 2, 5), (1,) * 3), "tiny", seed=3)
    with pytest.raises(ValueError, match="not the batch this step was planned for"):
        backend.forward(other.q, None, None, case.layer, other.batch, save_kv_cache=False)
    big = make_mla_case(BatchSpec(DEC, (1, 2, 3, 4), (1,) * 4), "tiny", seed=2)
    with pytest.raises(ValueError, match="captured"):
        backend.init_forward_metadata_replay_cuda_graph(big.batch)
    with pytest.raises(ValueError, match="bs"):
        backend.init_forward_metadata_replay_cuda_graph(case.batch, bs=2)
    assert backend.get_cuda_graph_seq_len_fill_value() >= 1


def test_multistep_draft_capture_and_replay_all_steps():
    steps, prefix = 3, (12, 40)
    spec = BatchSpec(DRAFT, prefix, (1, 1), page_size=16, reserve=steps + 1)
    case = make_mla_case(spec, "tiny", seed=6, reserve=steps + 1)
    draft = MultiStepDraftBackend(steps, req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                                  page_size=16, device="cpu", impl="reference")
    draft.init_cuda_graph_state(4, case.layout.req_to_token_pool.max_context)
    mds = draft.capture_all_steps(4)
    assert len({id(m.cache_seqlens) for m in mds}) == steps  # each step owns its buffers
    draft.replay_all_steps(case.batch)
    for i in range(steps):
        assert draft.step(i).forward_metadata.cache_seqlens[:2].tolist() == [p + i + 1 for p in prefix]
    # per-step capture/replay as a graph runner does it (batch.draft_step selects the step)
    with pytest.raises(ValueError, match="^out_cache_loc is required for draft step 2"):
        draft.step_batch(case.batch, 2)
    sb = draft.step_batch(case.batch, 2, case.batch.out_cache_loc + 2)
    assert draft.init_forward_metadata_replay_cuda_graph(sb) is mds[2]
    with pytest.raises(ValueError, match="draft step"):
        draft.step(steps)
    with pytest.raises(ValueError, match="step-0 DRAFT_DECODE"):
        draft.init_forward_metadata(sb)  # step 2's batch is not a base batch
    dec = make_batch(case.layout, DEC, list(prefix), [1, 1])
    with pytest.raises(ValueError, match="step-0 DRAFT_DECODE"):
        draft.init_forward_metadata(dec)


@pytest.mark.parametrize("spec_name", ["extend_with_prefix", "mixed_long_prefix", "verify_k4", "small_decode"])
def test_local_attention_mla_layer(spec_name):
    """use_local_attention: query at position p sees keys floor(p / C) * C .. p (builder's virtual batches)."""
    from oracle import dense_attention
    from mla_fa3.layer import AttentionLayer
    chunk = 16
    case = make_mla_case(spec_name, "odd_small", seed=12)
    layer = AttentionLayer.mla_layer(case.layer.layer_id, case.cfg.num_heads, case.cfg.dims, case.layer.scaling,
                                     mla_weights=case.layer.mla_weights, use_local_attention=True)
    backend = backend_for(case, attention_chunk_size=chunk, prefill_path="mha")  # local layers stay absorbed
    backend.init_forward_metadata(case.batch)
    out = backend.forward(case.q, case.new_latent, None, layer, case.batch)
    d, H = case.cfg.dims, case.cfg.num_heads
    w = case.kv_b_proj.double().view(H, d.qk_nope_head_dim + d.v_head_dim, -1)
    refs = []
    for b, (s, e) in enumerate(case.q_rows):
        lat = case.latent[b].double()
        L, n = lat.shape[0], e - s
        kv = torch.einsum("lr,hdr->lhd", lat[:, : d.kv_lora_rank], w)
        k = torch.cat([kv[..., : d.qk_nope_head_dim], lat[:, None, d.kv_lora_rank:].expand(L, H, -1)], dim=-1)
        pos = torch.arange(L - n, L).unsqueeze(1)
        key = torch.arange(L).unsqueeze(0)
        mask = (key <= pos) & (key >= pos // chunk * chunk)
        o, _ = dense_attention(case.q[s:e], k, kv[..., d.qk_nope_head_dim:], scale=layer.scaling, mask=mask)
        refs.append(o)
    assert rel_err(out, torch.cat(refs)) <= TOL


def test_explain_counts_the_bytes_a_layer_reads():
    """kv: each request's latent rows once; weights: W_UK + W_UV — both from the definitions, not the code."""
    case = make_mla_case("small_decode", "odd_small", seed=3)
    _, backend = run_step(case)
    rec = backend.explain()
    d, H = case.cfg.dims, case.cfg.num_heads
    width = d.kv_lora_rank + d.qk_rope_head_dim
    assert rec.kv_bytes == sum(p + n for p, n in zip(case.spec.prefix_lens, case.spec.extend_lens)) * width * 4
    assert rec.weight_bytes == H * d.kv_lora_rank * (d.qk_nope_head_dim + d.v_head_dim) * 4
    assert "reads per layer" in rec.summary()
