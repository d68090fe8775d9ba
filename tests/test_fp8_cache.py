"""The FP8 (e4m3) latent cache on CPU: every mode against fp64 oracles fed the DEQUANTIZED cache.

Storage, from the definition (written here, not taken from the library): a latent row ``x`` of layer
``l`` is stored as ``e4m3(clamp(x / s_l, ±448))`` and read as ``float(x8) · s_l``. The oracle gets those
dequantized rows for every key read from the cache, so the only error left between the backend (fp32
reference kernels) and the fp64 oracle is rounding: rel err <= 1e-5.

* Extend rows (MHA prefill): the cached prefix dequantized, the step's own new rows as computed (not
  rounded: the prefill attends to them before they are cached), queries not quantized -> the
  non-absorbed oracle of ``specs.py``.
* Decode-like rows (FlashMLA FP8): the 576-wide query ``[q_lat | q_rope]`` of the rows that run
  together is quantized per tensor with ``s_q = absmax / 448`` (fp32); the oracle rebuilds it
  (q_lat in fp32 as the model computes it, then the same rule) and runs the absorbed attention in fp64
  over the dequantized latent: ``softmax(scale · q·latent) · c_kv`` through W_UV.

Every pool slot that is not a cached token of a live request holds e4m3 NaN (bits 0x7F).
"""

from __future__ import annotations


import pytest
import torch

from mla_cases import cosine, follow_up, make_batch, make_mla_case, mla_oracle, rel_err
from specs import FP8_SPECS, BatchSpec
from fp8_cases import (FP8, TOL, SCALES, EXT, DEC, stored, fp8_oracle, fp8_case, fp8_backend, run)
from oracle import mla_nonabsorbed

from mla_fa3 import absorb
from mla_fa3.draft_backend import MultiStepDraftBackend
from mla_fa3.graphs.runner import GraphRunner, InputSpec
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.layer import AttentionLayer
from mla_fa3.policy.paths import AttentionPath, DecodeKernel



# ---------------------------------------------------------------------------------------------------
# every mode


# every FP8 spec with the small odd config; the DeepSeek-V3 dims on a representative subset
CASES = [(name, "odd_small") for name in FP8_SPECS] + [
    (name, "deepseek_v3") for name in ("decode", "mixed", "extend_chunked_prefix")]


@pytest.mark.parametrize("name,cfg", CASES)
def test_every_mode_matches_the_oracle_on_the_dequantized_cache(name, cfg):
    case = fp8_case(name, cfg, seed=len(name))
    out, backend = run(case, prefill_workspace_tokens=64)
    ref = fp8_oracle(case)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL, name
    rec = backend.explain()
    assert rec.kv_dtype == "float8_e4m3fn" and "kv float8_e4m3fn" in rec.summary()
    if case.spec.mode.is_extend_like() and name != "extend_all_decode_rows":
        assert rec.path in (AttentionPath.MHA_ONESHOT, AttentionPath.MHA_CHUNKED) and "FP8" in rec.reason
    else:
        assert rec.path is AttentionPath.ABSORBED and rec.kernel == "flashmla" and "FP8" in rec.reason
    if name == "extend_chunked_prefix":
        assert len(backend.step_plan.prefill.chunks) >= 3  # 193 prefix tokens in chunks of 64
    if rec.kv_bytes is not None:  # one byte per element
        assert rec.kv_bytes == sum(case.spec.seq_lens) * cfg_width(case)


def cfg_width(case) -> int:
    return case.cfg.dims.latent_dim


def test_fp8_error_against_the_exact_answer_is_e4m3_sized():
    """Against the oracle on the UN-quantized cache and query the error is the quantization's: small."""
    case = fp8_case("mixed", "deepseek_v3", seed=4)
    exact = make_mla_case(FP8_SPECS["mixed"], "deepseek_v3", seed=4)
    out, _ = run(case)
    ref = mla_oracle(exact)
    assert cosine(out, ref) > 0.995
    assert 1e-4 < rel_err(out, ref) < 0.1  # quantization is visible, and bounded


def test_rows_are_stored_quantized_at_out_cache_loc_only():
    case = fp8_case("mixed", seed=2)
    lid = case.layer.layer_id
    before = [b.view(torch.uint8).clone() for b in case.pool.kv_buffer]
    run(case)
    loc = case.batch.out_cache_loc
    buf = case.pool.kv_buffer[lid]
    want = (case.new_latent.float() / torch.tensor(SCALES[lid])).clamp(-448, 448).to(FP8)
    assert torch.equal(buf[loc].view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(buf.shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(buf.view(torch.uint8)[untouched], before[lid][untouched])
    assert torch.equal(case.pool.kv_buffer[1 - lid].view(torch.uint8), before[1 - lid])


def test_decode_after_prefill_reads_what_the_prefill_stored():
    """EXTEND stores raw rows quantized; the following DECODE (FlashMLA FP8) reads them back."""
    spec = BatchSpec(EXT, (0, 40), (71, 10), page_size=64)
    case = fp8_case(spec, seed=9)  # the truth: 71 / 50 tokens; the steps below use the first ones
    backend = fp8_backend(case)
    for mode, pre, ext in ((EXT, [0, 40], [70, 9]), (DEC, [70, 49], [1, 1])):
        step = follow_up(case, mode, pre, ext, seed=len(pre) + pre[0])  # raw new rows, stored by the step
        out, _ = run(step, backend)
        assert rel_err(out, fp8_oracle(step)) <= TOL, mode
    assert backend.explain().kernel == "flashmla"


def test_multi_step_draft_on_fp8():
    case = fp8_case("draft_decode", seed=5)
    draft = MultiStepDraftBackend(2, req_to_token_pool=case.layout.req_to_token_pool, kv_pool=case.pool,
                                  page_size=64, device="cpu", num_heads=case.cfg.num_heads,
                                  mla_dims=case.cfg.dims, impl="reference")
    step = draft.step(0)
    step.init_forward_metadata(case.batch)
    out = step.forward(case.q, case.new_latent, None, case.layer, case.batch)
    assert rel_err(out, fp8_oracle(case)) <= TOL
    assert step.explain().kernel == "flashmla"


# ---------------------------------------------------------------------------------------------------
# graph replay (CPU: the runner's padded static-buffer data path)


def test_graph_runner_replay_on_fp8_equals_eager_and_oracle():
    spec = BatchSpec(DEC, (40, 100, 7), (1, 1, 1), page_size=64)
    case = fp8_case(spec, seed=11)
    backend = fp8_backend(case)
    d, H = case.cfg.dims, case.cfg.num_heads
    specs = {"q": InputSpec((H, d.qk_head_dim), torch.float32), "latent": InputSpec((d.latent_dim,), torch.float32)}

    def step(batch, inputs):
        return backend.forward(inputs["q"], inputs["latent"], None, case.layer, batch)

    runner = GraphRunner(backend, step, batch_sizes=(4, 8), mode=DEC, max_context=case.layout.req_to_token_pool
                         .req_to_token.shape[1], input_specs=specs, device="cpu")
    out = runner.run(case.batch, {"q": case.q, "latent": case.new_latent}).clone()
    assert backend.explain().graph and backend.explain().kernel == "flashmla"
    assert backend.step_plan.flashmla_schedule.is_fp8
    assert rel_err(out[:3], fp8_oracle(case)) <= TOL
    backend.init_forward_metadata(case.batch)  # eager, same step (the rows are stored again: same values)
    eager = backend.forward(case.q, case.new_latent, None, case.layer, case.batch)
    torch.testing.assert_close(out[:3], eager, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# store semantics, scales, calibration


def small_pool(**kw) -> MLATokenPool:
    return MLATokenPool(2, 4, 64, 8, 4, torch.float32, "cpu", kv_dtype=FP8, **kw)


def test_store_saturates_and_never_writes_nan():
    pool = small_pool()
    pool.set_scales(0.5, layer=1)
    x = torch.tensor([[1e6, -1e6, float("inf"), float("-inf"), float("nan"), 1.0, -0.3, 0.0, 2.0, 3.0, 4.0, 5.0]])
    pool.set_latent(1, torch.tensor([70]), x)
    got = pool.dequantized(1, [70])[0]
    assert not torch.isnan(got).any()
    assert got[:5].tolist() == [224.0, -224.0, 224.0, -224.0, 0.0]  # ±448 · 0.5, NaN -> 0
    assert got[5:].tolist() == stored(x[0, 5:], 0.5).float().tolist()


def test_debug_checks_refuse_non_finite_rows_before_writing():
    pool = small_pool(debug_checks=True)
    before = pool.kv_buffer[0].view(torch.uint8).clone()
    bad = torch.ones(2, 12)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="latent holds non-finite"):
        pool.set_latent(0, torch.tensor([5, 6]), bad)
    with pytest.raises(ValueError, match="k_rope holds non-finite"):
        pool.set_kv(0, torch.tensor([5, 6]), torch.ones(2, 8), bad[:, 8:] * float("inf"))
    assert torch.equal(pool.kv_buffer[0].view(torch.uint8), before)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), None, "1.0", True])
def test_bad_scales_raise_and_change_nothing(bad):
    pool = small_pool()
    pool.set_scales([0.25, 0.5])
    with pytest.raises(ValueError, match="scales"):
        pool.set_scales(bad, layer=0)
    with pytest.raises(ValueError, match=r"scales\[1\]"):
        pool.set_scales([0.75, bad])
    assert [float(s) for s in pool.scale] == [0.25, 0.5]


def test_scales_need_one_per_layer_and_an_fp8_pool():
    with pytest.raises(ValueError, match="one scale per layer"):
        small_pool().set_scales([1.0])
    floating = MLATokenPool(2, 4, 64, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        floating.set_scales([1.0, 1.0])
    assert floating.layer_scale(0) is None


def test_calibration_proposes_absmax_over_448():
    pool = small_pool()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(5, 12, generator=g) * 3, torch.randn(7, 12, generator=g) * 0.1]
    with pytest.raises(ValueError, match="observe_absmax"):
        pool.proposed_scales()
    pool.observe_absmax()
    pool.set_latent(0, torch.arange(64, 69), rows[0])
    pool.set_kv(1, torch.arange(64, 71), rows[1][:, :8], rows[1][:, 8:])
    want = [float(r.abs().max()) / 448 for r in rows]
    assert pool.proposed_scales() == pytest.approx(want, rel=1e-6)
    assert pool.proposed_scales(headroom=2.0) == pytest.approx([2 * w for w in want], rel=1e-6)
    pool.set_scales(pool.proposed_scales())  # rows stored before keep their old scale: store again
    pool.set_latent(0, torch.arange(64, 69), rows[0])
    back = pool.dequantized(0, torch.arange(64, 69))
    assert float((back - rows[0]).abs().max()) <= float(rows[0].abs().max()) / 16  # e4m3: 3 mantissa bits
    pool.observe_absmax(False)
    assert pool.absmax is None


# ---------------------------------------------------------------------------------------------------
# bad input: named errors before any kernel runs, nothing written


def test_backend_construction_refuses_what_cannot_read_fp8():
    case = fp8_case("decode", seed=1)
    with pytest.raises(ValueError, match="decode_kernel='fa3'"):
        fp8_backend(case, decode_kernel="fa3")
    with pytest.raises(ValueError, match="num_heads and mla_dims"):
        fp8_backend(case, mla_dims=None)
    with pytest.raises(ValueError, match="prefill_path='absorbed'"):
        fp8_backend(case, prefill_path="absorbed")
    assert fp8_backend(case, decode_kernel="flashmla").graph_kernels() == (DecodeKernel.FLASHMLA,)
    assert fp8_backend(case, decode_kernel="splitkv").graph_kernels() == (DecodeKernel.SPLITKV,)
    for kernel in (None, "auto"):  # the shipped FP8 table never picks split-KV at page 64: FlashMLA FP8 alone
        assert fp8_backend(case, decode_kernel=kernel).graph_kernels() == (DecodeKernel.FLASHMLA,)


@pytest.mark.parametrize("what", ["softcap", "heads"])
def test_layers_flashmla_cannot_serve_raise_before_the_store(what):
    case = fp8_case("decode", seed=3)
    backend = fp8_backend(case)
    backend.init_forward_metadata(case.batch)
    w = case.kv_b_proj
    if what == "softcap":
        layer = AttentionLayer.mla_layer(case.layer.layer_id, case.cfg.num_heads, case.cfg.dims, case.layer.scaling,
                                         kv_b_proj_weight=w, logit_cap=30.0)
        q = case.q
    else:
        H = case.cfg.num_heads - 1
        d = case.cfg.dims
        layer = AttentionLayer.mla_layer(case.layer.layer_id, H, d, case.layer.scaling,
                                         kv_b_proj_weight=w[: H * (d.qk_nope_head_dim + d.v_head_dim)])
        q = case.q[:, :H].contiguous()
    before = case.pool.kv_buffer[layer.layer_id].view(torch.uint8).clone()
    with pytest.raises(ValueError, match=f"layer {layer.layer_id}"):
        backend.forward(q, case.new_latent, None, layer, case.batch)
    assert torch.equal(case.pool.kv_buffer[layer.layer_id].view(torch.uint8), before)


def test_absorbed_path_refuses_fa3_or_a_missing_scale_on_fp8():
    case = fp8_case("decode", seed=6)
    backend = fp8_backend(case)
    backend.init_forward_metadata(case.batch)
    kv = case.pool.paged(case.layer.layer_id)
    md = backend.forward_metadata
    with pytest.raises(ValueError, match="kernel must be FLASHMLA"):
        absorb.forward_absorbed(case.q, case.layer, md, kv, kernel=DecodeKernel.FA3, impl="reference")
    with pytest.raises(ValueError, match="kv_scale is None"):
        absorb.forward_absorbed(case.q, case.layer, md, kv, kernel=DecodeKernel.FLASHMLA,
                                schedule=backend.step_plan.flashmla_schedule, impl="reference")


def test_empty_extend_on_fp8_returns_no_rows():
    case = fp8_case(BatchSpec(EXT, (), (), page_size=64))
    backend = fp8_backend(case)
    batch = make_batch(case.layout, EXT, [], [])
    backend.init_forward_metadata(batch)
    d = case.cfg.dims
    out = backend.forward(case.q, torch.empty(0, d.latent_dim), None, case.layer, batch)
    assert out.shape == (0, case.cfg.num_heads, d.v_head_dim)


# ---------------------------------------------------------------------------------------------------
# checkpoint scales, engine, CLI


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

    return save_hf_checkpoint(random_hf_model("tiny_v3", seed=5), str(tmp_path_factory.mktemp("tiny_v3_fp8")))


def _with_scales(src, dst, values, name="self_attn.kv_scale"):
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    for i, v in values.items():
        tensors[f"model.layers.{i}.{name}"] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("name", ["self_attn.kv_scale", "self_attn.k_scale", "self_attn.attn.k_scale"])
def test_loader_reads_per_layer_kv_scales_and_the_engine_uses_them(tiny_ckpt, tmp_path, name):
    from mla_fa3.serve.engine import Engine
    from mla_fa3.models.loader import load_model, read_config

    n = read_config(tiny_ckpt)[0].num_hidden_layers
    want = [0.01 * (i + 1) for i in range(n)]
    model = load_model(_with_scales(tiny_ckpt, tmp_path / "c", dict(enumerate(want)), name))
    assert model.kv_scales == pytest.approx(want)
    engine = Engine(model, page_size=64, max_batch_size=1, max_context=64, kv_dtype="fp8")
    assert [float(s) for s in engine.kv_pool.scale] == pytest.approx(want)
    assert load_model(tiny_ckpt).kv_scales is None


@pytest.mark.parametrize("last,match", [(None, "missing"), (-1.0, "finite float > 0"),
                                        (float("nan"), "finite float > 0"), (0.0, "finite float > 0")])
def test_loader_refuses_partial_or_bad_kv_scales(tiny_ckpt, tmp_path, last, match):
    from mla_fa3.models.loader import CheckpointError, load_model, read_config

    n = read_config(tiny_ckpt)[0].num_hidden_layers
    values = {i: 0.5 for i in range(n - 1)}
    if last is not None:
        values[n - 1] = last
    with pytest.raises(CheckpointError, match=match):
        load_model(_with_scales(tiny_ckpt, tmp_path / "c", values))


def test_engine_fp8_generates_and_calibrates(tiny_ckpt):
    from mla_fa3.serve.engine import Engine
    from mla_fa3.models.loader import load_model

    model = load_model(tiny_ckpt)
    with pytest.raises(ValueError, match="decode_kernel='flashmla' cannot read an FP8 latent pool of page_size 16"):
        Engine(model, page_size=16, max_batch_size=2, max_context=64, kv_dtype="fp8", decode_kernel="flashmla")
    with pytest.raises(ValueError, match="kv_scales are only used"):
        Engine(model, page_size=64, max_batch_size=2, max_context=64, kv_scales=0.5)
    engine = Engine(model, page_size=64, max_batch_size=2, max_context=64, kv_dtype="fp8")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    scales = engine.calibrate_kv_scales(prompts)
    assert all(0 < s < 1 for s in scales) and [float(s) for s in engine.kv_pool.scale] == pytest.approx(scales)
    assert engine.allocator.num_free_pages() == engine.allocator.num_pages - 1  # calibration pages freed
    res = engine.generate(prompts, 5)
    assert [len(t) for t in res.token_ids] == [5, 5]
    assert engine.backend.explain().kv_dtype == "float8_e4m3fn" and engine.backend.explain().kernel == "flashmla"
    # split-KV reads the FP8 pool with an exact q: page 16 (the only reader there) and page 64 (asked for) give
    # the tokens and logits of the fp64 oracle generation (each request alone, the cache as e4m3 stores it)
    want = [_fp8_oracle_generate(model, p, 5, scales) for p in prompts]
    for page in (16, 64):
        e = Engine(model, page_size=page, max_batch_size=2, max_context=64, kv_dtype="fp8", kv_scales=scales,
                   decode_kernel="auto" if page == 16 else "splitkv")
        res = e.generate(prompts, 5, return_logits=True)
        assert e.backend.explain().kernel == "splitkv"
        assert res.token_ids == [w[0] for w in want], f"page {page}"
        for got, (_, logits) in zip(res.logits, want):
            assert rel_err(got, logits) <= 1e-5, f"page {page}"


class _FP8OracleAttention:
    """What each MLA layer must get from an FP8 latent cache (split-KV: exact q), one request, fp64, from the
    definitions: a prefill attends causally to its own rows as computed (not rounded: they are attended to before
    they are cached), then stores them; a decode step stores its row, then attends to every cached row, each
    read back as ``stored(row, s_layer)``. Output: non-absorbed MLA through the layer's kv_b_proj."""

    def __init__(self, model, scales):
        self.model, self.scales = model, scales
        self.cache = {}  # layer id -> [L, r + d_rope] fp64, the rows as the pool gives them back

    def forward(self, q, latent, _k, layer, batch):
        lid, r, cfg = layer.layer_id, self.model.config.kv_lora_rank, self.model.config
        stored_rows = stored(latent, self.scales[lid])
        prev = self.cache.get(lid, stored_rows[:0])
        self.cache[lid] = torch.cat([prev, stored_rows])
        keys = latent.double() if q.shape[0] > 1 else self.cache[lid]  # prefill: own raw rows; decode: cache
        assert q.shape[0] == 1 or prev.shape[0] == 0, "one prefill, then decode steps"
        w = self.model.model.layers[lid].self_attn.kv_b_proj.weight
        out, _ = mla_nonabsorbed(q, keys[:, :r], keys[:, r:], w, qk_nope_head_dim=cfg.qk_nope_head_dim,
                                 v_head_dim=cfg.v_head_dim, scale=layer.scaling)
        return out.to(q.dtype)


def _fp8_oracle_generate(model, prompt, n, scales):
    """Greedy tokens and their logits [n, V] for ``prompt`` alone, every attention from _FP8OracleAttention."""
    from types import SimpleNamespace

    attn, ids, tokens, logits = _FP8OracleAttention(model, scales), list(prompt), [], []
    pos = 0
    for _ in range(n):
        new = ids[pos:]
        out = model(torch.tensor(new), torch.arange(pos, pos + len(new)), SimpleNamespace(num_tokens=len(new)),
                    attn)[-1].float()
        pos = len(ids)
        tokens.append(int(out.argmax()))
        logits.append(out)
        ids.append(tokens[-1])
    return tokens, torch.stack(logits)


def test_cli_generate_with_fp8_cache(tiny_ckpt, capsys):
    from mla_fa3.cli import main

    assert main(["generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "1", "2", "3", "--max-new-tokens", "3",
                 "--kv-dtype", "fp8", "--kv-scale", "0.01", "--json", "--quiet"]) == 0
    assert len(__import__("json").loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(["generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "1", "2", "--max-new-tokens", "2",
                 "--kv-dtype", "fp8", "--page-size", "16", "--json", "--quiet"]) == 0  # split-KV reads it
    assert len(__import__("json").loads(capsys.readouterr().out)["token_ids"]) == 2
    assert main(["generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "1", "--kv-dtype", "fp8",
                 "--page-size", "16", "--decode-kernel", "flashmla", "--quiet"]) == 2
    assert "--decode-kernel flashmla needs --page-size 64" in capsys.readouterr().err  # before loading


def test_bench_fp8_smoke_on_cpu(tmp_path, capsys):
    from mla_fa3.bench import fp8

    assert fp8.main(["--device", "cpu", "--impl", "reference", "--heads", "4", "--batch", "2", "--context", "128",
                     "--max-iters", "1", "--budget-ms", "1", "--quiet", "--out", str(tmp_path)]) == 0
    assert "| 4 | 2 | 128 |" in capsys.readouterr().out and (tmp_path / "fp8.csv").exists()
    from mla_fa3.policy.fp8_decode import table_from_fp8_csv

    (row,) = table_from_fp8_csv(str(tmp_path / "fp8.csv"))  # both FP8 paths timed: the policy table's input
    assert (row.num_heads, row.batch_size, row.context) == (4, 2, 128) and row.flashmla_ms > 0 and row.splitkv_ms > 0
    assert fp8.tokens_per_gb(FP8) == pytest.approx(2 * fp8.tokens_per_gb(torch.bfloat16))
