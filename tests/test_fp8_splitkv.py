"""The FP8 (e4m3) latent pool read by the split-KV kernel with an exact (unquantized) query, on CPU.

Same oracle as ``test_fp8_cache.py`` (fp64, fed the dequantized cache: ``fp8_cases.fp8_oracle``), but the
decode rows' query is NOT rounded to e4m3 (``query_e4m3=False``): split-KV converts the cache tile in
registers and keeps q in its own dtype, so the only error left against the oracle is fp32 rounding
(rel err <= 1e-5). Page 64 (where FlashMLA FP8 could run too) and page 16 (split-KV is the only reader).
Also: which kernel an FP8 pool gets (``policy.fp8_decode``), and the construction errors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8_cases import DEC, FP8, TOL, fp8_backend, fp8_case, fp8_oracle, run
from mla_cases import make_mla_case, rel_err
from specs import FP8_SPECS, BatchSpec

from mla_fa3 import ops
from mla_fa3.backend import MLABackend
from mla_fa3.graphs.runner import GraphRunner, InputSpec
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.ops.splitkv_config import E4M3_CONFIG_TABLE
from mla_fa3.policy import fp8_decode, kernel_choice
from mla_fa3.policy.fp8_decode import MeasuredFP8, choose_fp8_decode_kernels, explain_fp8_decode_kernel
from mla_fa3.policy.paths import AttentionPath, DecodeKernel

SKV, MLA = DecodeKernel.SPLITKV, DecodeKernel.FLASHMLA


def _paged(name: str, page: int) -> BatchSpec:
    return dataclasses.replace(FP8_SPECS[name], page_size=page)


# every FP8 spec at page 64 (decode_kernel='splitkv') and page 16 (auto: split-KV is the only reader)
CASES = [(name, 64, "splitkv") for name in FP8_SPECS] + [(name, 16, "auto") for name in FP8_SPECS]


@pytest.mark.parametrize("name,page,kernel", CASES)
def test_every_mode_on_split_kv_matches_the_oracle_with_an_exact_query(name, page, kernel):
    case = fp8_case(_paged(name, page), seed=len(name) + page)
    out, backend = run(case, prefill_workspace_tokens=64, decode_kernel=kernel)
    ref = fp8_oracle(case, query_e4m3=False)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL, name
    rec = backend.explain()
    assert rec.kv_dtype == "float8_e4m3fn"
    plan = backend.step_plan
    if rec.path is AttentionPath.ABSORBED:  # decode-like steps, and an extend whose rows are all decode rows
        assert rec.kernel == "splitkv" and plan.kernel is SKV and plan.splitkv_schedule is not None
        assert plan.splitkv_schedule.config in E4M3_CONFIG_TABLE.values()  # planned with the e4m3 table
    elif plan.prefill.split is not None:  # the decode rows of a mixed step: split-KV too
        assert plan.kernel is SKV and plan.splitkv_schedule is not None and plan.flashmla_schedule is None
        assert "decode rows: " in rec.reason and ("splitkv" in rec.reason or "split-KV" in rec.reason)


def test_split_kv_differs_from_the_flashmla_fp8_semantics_by_the_query_rounding():
    """Same FP8 pool, same step: FlashMLA FP8 (e4m3 q) matches its own oracle, split-KV matches the exact-q one,
    and the two differ by far more than either's error (the q rounding is visible)."""
    case = fp8_case("decode", "deepseek_v3", seed=7)
    out_mla, _ = run(case, decode_kernel="flashmla")
    case = fp8_case("decode", "deepseek_v3", seed=7)
    out_skv, _ = run(case, decode_kernel="splitkv")
    exact_q, e4m3_q = fp8_oracle(case, query_e4m3=False), fp8_oracle(case)
    assert rel_err(out_skv, exact_q) <= TOL and rel_err(out_mla, e4m3_q) <= TOL
    assert rel_err(out_skv, out_mla) > 100 * TOL


def test_graph_runner_replay_on_fp8_split_kv_page16():
    spec = BatchSpec(DEC, (40, 100, 7), (1, 1, 1), page_size=16)
    case = fp8_case(spec, seed=11)
    backend = fp8_backend(case)
    assert backend.graph_kernels() == (SKV,)
    d, H = case.cfg.dims, case.cfg.num_heads
    specs = {"q": InputSpec((H, d.qk_head_dim), torch.float32), "latent": InputSpec((d.latent_dim,), torch.float32)}

    def step(batch, inputs):
        return backend.forward(inputs["q"], inputs["latent"], None, case.layer, batch)

    runner = GraphRunner(backend, step, batch_sizes=(4, 8), mode=DEC,
                         max_context=case.layout.req_to_token_pool.req_to_token.shape[1], input_specs=specs,
                         device="cpu")
    out = runner.run(case.batch, {"q": case.q, "latent": case.new_latent}).clone()
    rec = backend.explain()
    assert rec.graph and rec.kernel == "splitkv" and backend.step_plan.splitkv_schedule is not None
    assert rel_err(out[:3], fp8_oracle(case, query_e4m3=False)) <= TOL


# ---------------------------------------------------------------------------------------------------
# construction


def _pool16(case) -> MLATokenPool:
    d = case.cfg.dims
    return MLATokenPool(2, case.layout.num_pages, 16, d.kv_lora_rank, d.qk_rope_head_dim, torch.float32, "cpu",
                        kv_dtype=FP8)


def _backend16(case, pool, **kw):
    return MLABackend(req_to_token_pool=case.layout.req_to_token_pool, kv_pool=pool, page_size=16, device="cpu",
                      num_heads=case.cfg.num_heads, mla_dims=case.cfg.dims, impl="reference", **kw)


def test_page16_fp8_pool_takes_split_kv_and_refuses_flashmla_and_fa3():
    case = make_mla_case(BatchSpec(DEC, (5, 9), (1, 1), page_size=16), "tiny")
    pool = _pool16(case)
    for kernel in (None, "auto", "splitkv"):
        assert _backend16(case, pool, decode_kernel=kernel).graph_kernels() == (SKV,)
    with pytest.raises(ValueError, match="^decode_kernel='flashmla' cannot read an FP8 latent pool of page_size 16"):
        _backend16(case, pool, decode_kernel="flashmla")
    with pytest.raises(ValueError, match="^decode_kernel='fa3' cannot read an FP8 latent pool"):
        _backend16(case, pool, decode_kernel="fa3")


def test_page16_fp8_pool_whose_split_kv_becomes_unavailable_fails_loudly_at_planning(monkeypatch):
    """A backend that follows the global ops setting (impl None) re-checks the one reader of a page-16 FP8 pool per
    choice: if split-KV cannot run any more, the step fails with a named error before any kernel."""
    case = make_mla_case(BatchSpec(DEC, (5, 9), (1, 1), page_size=16), "tiny")
    choice = kernel_choice.DecodeKernelChoice(decode_kernel="auto", page_size=16, num_heads=case.cfg.num_heads,
                                              kv_fp8=True, whole_row_kernels=True, impl=None,
                                              device=torch.device("cpu"))
    assert choice.choose_decode_kernel(2, 9)[0] is SKV and choice.pool_reader() is SKV
    choice._splitkv_ok.clear()
    monkeypatch.setattr(ops, "splitkv_available", lambda device, impl=None: False)
    with pytest.raises(ValueError, match="^page_size must be 64 for an FP8 latent cache where the split-KV"):
        choice.choose_decode_kernel(2, 9)


def test_fp8_extend_without_decode_rows_names_the_pools_reader():
    for page, want in ((16, SKV), (64, MLA)):
        case = fp8_case(_paged("extend_chunked_prefix", page), seed=3)
        _, backend = run(case, prefill_workspace_tokens=64)
        assert backend.step_plan.prefill.split is None and backend.step_plan.kernel is want


def test_page16_fp8_pool_without_split_kv_is_refused_at_construction(monkeypatch):
    case = make_mla_case(BatchSpec(DEC, (5, 9), (1, 1), page_size=16), "tiny")
    monkeypatch.setattr(ops, "splitkv_available", lambda device, impl=None: False)
    with pytest.raises(ValueError, match="^page_size must be 64 for an FP8 latent pool here, got 16.*no Triton"):
        _backend16(case, _pool16(case))
    with pytest.raises(ValueError, match="^decode_kernel='splitkv' cannot run on cpu"):
        fp8_backend(fp8_case("decode", seed=1), decode_kernel="splitkv")


# ---------------------------------------------------------------------------------------------------
# the choice (policy.fp8_decode)

TABLE = (  # split-KV faster at 16 heads, small batch; FlashMLA FP8 faster at 128 heads and at bs 64
    MeasuredFP8(16, 1, 65536, flashmla_ms=0.050, splitkv_ms=0.030),
    MeasuredFP8(16, 64, 65536, flashmla_ms=0.90, splitkv_ms=1.00),
    MeasuredFP8(128, 1, 65536, flashmla_ms=0.080, splitkv_ms=0.120),
)


def test_fp8_choice_follows_the_nearest_measured_step():
    pick = lambda h, bs, ctx, **kw: explain_fp8_decode_kernel(h, bs, ctx, 64, table=TABLE, **kw)  # noqa: E731
    assert pick(16, 1, 65536).kernel is SKV and "split-KV (bf16 q) gain 1.667x" in pick(16, 1, 65536).reason
    assert pick(16, 2, 60000).kernel is SKV
    assert pick(16, 64, 65536).kernel is MLA and "0.900x < 0.980" in pick(16, 64, 65536).reason
    assert pick(128, 1, 65536).kernel is MLA
    assert pick(16, 1, 65536, allow_splitkv=False).kernel is MLA
    assert pick(16, 1, 256).kernel is MLA and "no measured FP8 shape within" in pick(16, 1, 256).reason
    assert explain_fp8_decode_kernel(16, 1, 65536, 64, table=()).kernel is MLA
    assert explain_fp8_decode_kernel(16, 64, 65536, 1, table=TABLE).kernel is SKV  # page != 64: the only reader
    with pytest.raises(ValueError, match="^page_size must be 64 for an FP8 latent cache where the split-KV"):
        explain_fp8_decode_kernel(16, 1, 65536, 16, allow_splitkv=False)
    with pytest.raises(ValueError, match="^mean_seqlen_k"):
        explain_fp8_decode_kernel(16, 1, 100, 64, mean_seqlen_k=200.0)


def test_fp8_choice_takes_the_more_accurate_read_when_it_is_as_fast():
    """Split-KV (q never rounded to e4m3) unless FlashMLA FP8 is measured at least 2 % faster: 1 % slower picks it,
    3 % slower does not; the vectorized choice and the graphs worth capturing agree."""
    for split_us, want in ((0.101, SKV), (0.0999, SKV), (0.103, MLA)):
        table = (MeasuredFP8(16, 4, 16384, flashmla_ms=0.100, splitkv_ms=split_us),)
        choice = explain_fp8_decode_kernel(16, 4, 16384, 64, table=table)
        assert choice.kernel is want, (split_us, choice.reason)
        assert fp8_decode.fp8_splitkv_possible(16, table) is (want is SKV)
    assert fp8_decode.FP8_MIN_GAIN == pytest.approx(1 / 1.02)


def test_vectorized_fp8_choice_equals_the_explained_one(monkeypatch):
    monkeypatch.setattr(fp8_decode, "MEASURED_FP8", TABLE)
    points = [(bs, ctx, mean) for bs in (1, 2, 3, 8, 16, 48, 64, 100) for ctx in (1024, 16384, 65536, 131072)
              for mean in (None, ctx / 3)]
    for heads in (8, 16, 32, 64, 128):
        want = [explain_fp8_decode_kernel(heads, b, m, 64, mean_seqlen_k=mean).kernel for b, m, mean in points]
        assert choose_fp8_decode_kernels(heads, points) == want
    assert fp8_decode.fp8_splitkv_possible(16) and not fp8_decode.fp8_splitkv_possible(128)


def test_backend_choice_on_an_fp8_pool_follows_the_table_and_is_cached_per_bucket(monkeypatch):
    monkeypatch.setattr(fp8_decode, "MEASURED_FP8", TABLE)
    choice = kernel_choice.DecodeKernelChoice(decode_kernel="auto", page_size=64, num_heads=16, kv_fp8=True,
                                              whole_row_kernels=True, impl="reference", device=torch.device("cpu"))
    assert choice.graph_kernels() == (MLA, SKV)
    for bs, ctx in ((1, 65536), (2, 65536), (64, 65536), (60, 70000), (1, 300)):
        want = explain_fp8_decode_kernel(16, bs, ctx, 64).kernel
        assert choice.choose_decode_kernel(bs, ctx, float(ctx))[0] is want
        cached = len(choice._kernel_cache)
        monkeypatch.setattr(choice, "_bucket_choice", lambda *a: pytest.fail("a repeated step was decided again"))
        assert choice.choose_decode_kernel(bs, ctx, float(ctx))[0] is want and len(choice._kernel_cache) == cached
        monkeypatch.undo()
        monkeypatch.setattr(fp8_decode, "MEASURED_FP8", TABLE)
    fixed = kernel_choice.DecodeKernelChoice(decode_kernel=MLA, page_size=64, num_heads=16, kv_fp8=True,
                                             whole_row_kernels=True, impl="reference", device=torch.device("cpu"))
    assert fixed.choose_decode_kernel(1, 65536)[0] is MLA and fixed.graph_kernels() == (MLA,)


def test_measured_fp8_rows_are_checked_and_read_from_a_bench_csv(tmp_path):
    with pytest.raises(ValueError, match="^splitkv_ms must be a positive number"):
        MeasuredFP8(16, 1, 1024, flashmla_ms=0.1, splitkv_ms=0.0)
    path = tmp_path / "fp8.csv"
    path.write_text("heads,batch,context,bf16_us,fp8_us,fp8_splitkv_us\n16,1,65536,60.0,50.0,30.0\n"
                    "128,1,65536,90.0,80.0,\n")
    table = fp8_decode.table_from_fp8_csv(str(path))
    assert len(table) == 1 and table[0].splitkv_gain == pytest.approx(50 / 30)
    assert "MeasuredFP8(16, 1, 65536, flashmla_ms=0.05, splitkv_ms=0.03" in fp8_decode.format_fp8_table(table)
    newer = tmp_path / "fp8_new.csv"
    newer.write_text("heads,batch,context,bf16_us,fp8_us,fp8_splitkv_us\n16,2,16384,40.0,42.0,36.0\n"
                     "16,1,65536,60.0,52.0,26.0\n")
    merged = fp8_decode.table_from_fp8_csvs([str(path), str(newer)])
    assert [(m.batch_size, m.context, m.flashmla_ms, m.splitkv_ms) for m in merged] == \
        [(1, 65536, 0.052, 0.026), (2, 16384, 0.042, 0.036)], "the later CSV's row replaces the shape, in its place"
    assert merged[0].source.endswith("fp8_new.csv")
