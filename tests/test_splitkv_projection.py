"""Split-KV decode with MLA's output projection (``ops.splitkv_mla_with_kvcache(w_uv=)``) on the CPU: the torch
reference against an fp64 oracle, a bad ``w_uv`` named before any kernel, and — when ``triton`` imports — the
combine with the projection fused in, under Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess: this
file run as a script).

Oracle: the fp64 attention of the dequantized inputs (``ops_cases.flashmla_oracle``), then ``o_lat[b, i, h] @
w_uv[h]`` in fp64. The op rounds o_lat to the output dtype before projecting (as the unfused path stores it): an
error the output's own rounding bounds.
"""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter

from ops_cases import flashmla_oracle, tolerances
from test_splitkv import _op_args

from mla_fa3 import ops
from mla_fa3.ops import KernelConfig
from mla_fa3.ops.splitkv_config import FUSED_PROJECTION_MAX_COLUMNS, FUSED_PROJECTION_MAX_TOKENS
from mla_fa3.ops.types import Impl


def _w_uv(heads: int, r: int, n: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, r, n, generator=g) / r ** 0.5).to(dtype)


def _check_projected(c, dense, w, out, lse, scale=0.2, dtype=torch.float32) -> None:
    o_lat, ref_lse = flashmla_oracle(c, dense, scale)
    want = torch.einsum("bshr,hrn->bshn", o_lat, w.double())
    atol, rtol, lse_atol = tolerances(dtype, c.get("fp8", False) is True)
    assert out.shape == want.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys: lse -inf"
    torch.testing.assert_close(lse.double(), ref_lse, atol=lse_atol, rtol=1e-5)


# (lens, sq, heads, page, fp8, N): an empty request (o_lat 0 -> out 0), verify, an e4m3 cache, N not a power of two
REFERENCE_CASES = {
    "decode_page8_empty": ((9, 40, 0, 1), 1, 4, 8, False, 24),
    "verify_sq2_page1": ((1, 17, 33), 2, 4, 1, False, 16),
    "fp8kv_page16": ((33, 5), 1, 4, 16, "kv", 40),
}


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_with_projection_matches_the_fp64_oracle(name):
    lens, sq, heads, page, fp8, n = REFERENCE_CASES[name]
    c, args, kw, dense = _op_args(heads=heads, sq=sq, lens=lens, page=page, fp8=fp8)
    w = _w_uv(heads, c["r"], n)
    out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, w_uv=w, impl="reference")
    _check_projected(c, dense, w, out, lse)


BAD_W = {  # name -> (w_uv from a good one, error, message)
    "not_a_tensor": (lambda w: w.tolist(), TypeError, "w_uv must be a torch.Tensor"),
    "rank2": (lambda w: w[0], ValueError, "w_uv must be 3-D"),
    "heads": (lambda w: w[:3], ValueError, r"w_uv must be \[H, head_dim_v, N\]"),
    "rows": (lambda w: w[:, :31], ValueError, r"w_uv must be \[H, head_dim_v, N\]"),
    "no_columns": (lambda w: w[..., :0], ValueError, "N >= 1"),
    "dtype": (lambda w: w.double(), ValueError, "w_uv dtype"),
    "last_dim_strided": (lambda w: w[..., ::2], ValueError, "w_uv"),
}


@pytest.mark.parametrize("name", list(BAD_W))
def test_bad_projection_is_named_before_any_kernel(name):
    make, err, msg = BAD_W[name]
    c, args, kw, _ = _op_args(heads=4, lens=(9, 40))
    with pytest.raises(err, match=msg):
        ops.splitkv_mla_with_kvcache(*args, **kw, w_uv=make(_w_uv(4, c["r"], 24)), impl="reference")


# ------------------------------------------------------------------------------------------ Triton interpreter

# (lens, sq, heads, r, page, dtype, fp8, N, config fields): fp32 / fp16 (no bf16 dot: triton-lang/triton#11584);
# N masked (24 of 32 columns); the narrow combine tile (< 64 rows) and the wide one (64 rows: 16 requests x 4 heads);
# an e4m3 cache read by fp32 and by e4m3 q (bf16 output and weights: the projection is no dot, so bf16 is fine here);
# r = 128 / 256: a row's projection summed from 4 / 8 column blocks' shares (the narrow tile's 32 columns each; 2 / 4
# of the wide tile's 64), the order the last program sums them in
INTERPRETER_CASES = {
    "fp32_page8_empty_request": ((9, 40, 0, 1), 1, 4, 32, 8, "float32", False, 24, {}),
    "fp16_page1_verify_sq2": ((1, 17, 33), 2, 4, 32, 1, "float16", False, 16, {}),
    "fp32_wide_tile_64_rows": (tuple(range(1, 160, 10)), 1, 4, 32, 16, "float32", False, 32, {}),
    "fp32_half_partials_sq2": ((63, 65, 129), 2, 4, 32, 64, "float32", False, 24, dict(half_partials=True)),
    "fp8kv_fp32_page16": ((33, 5, 1), 1, 4, 32, 16, "float32", "kv", 40, {}),
    "fp8_e4m3_q_page16": ((33, 5), 1, 4, 32, 16, "float32", True, 16, {}),
    "fp32_r128_four_blocks": ((9, 70), 1, 4, 128, 16, "float32", False, 24, {}),
    "fp16_r128_wide_tile_two_blocks": (tuple(range(1, 160, 10)), 1, 4, 128, 16, "float16", False, 100, {}),
    "fp32_r256_sq2_eight_blocks": ((5, 66), 2, 4, 256, 16, "float32", False, 40, {}),
}


def _interpreter_cases():
    from mla_fa3.ops import splitkv_triton as kt
    from mla_fa3.ops import validate

    def fused_matches_oracle_and_unfused(name):
        lens, sq, heads, r, page, dtype, fp8, n, fields = INTERPRETER_CASES[name]
        dt = getattr(torch, dtype)
        c, args, kw, dense = _op_args(heads=heads, sq=sq, lens=lens, page=page, r=r, dtype=dt, fp8=fp8,
                                      config=KernelConfig(**fields) if fields else None)
        out_dtype = torch.bfloat16 if fp8 is True else dt
        w = _w_uv(heads, c["r"], n, out_dtype)
        call = validate.check_splitkv(*args, head_dim_v=kw["head_dim_v"], schedule=kw["schedule"],
                                      softmax_scale=kw["softmax_scale"], causal=True, descale_q=kw.get("descale_q"),
                                      descale_k=kw.get("descale_k"), impl=Impl.TRITON)
        out, lse = kt.splitkv_mla_with_kvcache(call, kw["schedule"], w_uv=w)  # fused, whatever the token count
        _check_projected(c, dense, w.float(), out, lse, dtype=out_dtype)
        plain, plain_lse = kt.splitkv_mla_with_kvcache(call, kw["schedule"])  # the combine alone, then a matmul
        unfused = torch.einsum("bshr,hrn->bshn", plain.float(), w.float()).to(out_dtype)
        atol = 1e-5 if out_dtype is torch.float32 else 2 ** -8
        torch.testing.assert_close(out.float(), unfused.float(), atol=atol, rtol=atol)
        assert torch.equal(lse, plain_lse)

    def op_fuses_up_to_the_limits():
        """The op: fused with the switch on, up to FUSED_PROJECTION_MAX_TOKENS tokens and FUSED_PROJECTION_MAX_COLUMNS
        columns; else the combine alone, then a per-head matmul (the switch off, 3 requests x sq 4 = 12 tokens, or
        N past the limit) — which path ran is watched at the combine, the result checked either way."""
        seen = []
        combine = kt.combine_splits

        def watched(*a, w=None, **k):
            seen.append(w is not None)
            return combine(*a, w=w, **k)

        kt.combine_splits = watched
        try:
            wide = FUSED_PROJECTION_MAX_COLUMNS + 8
            for lens, sq, n, on, want in (((9, 40), 1, 24, True, True), ((9, 40), 1, 24, False, False),
                                          ((15, 16, 17), 4, 24, True, False), ((9, 40), 1, wide, True, False)):
                c, args, kw, dense = _op_args(heads=4, sq=sq, lens=lens, page=16,
                                              config=KernelConfig(fused_projection=on))
                w = _w_uv(4, c["r"], n)
                seen.clear()
                out, lse = ops.splitkv_mla_with_kvcache(*args, **kw, w_uv=w, impl="triton")
                assert ops.last_impl() is Impl.TRITON and seen == [want], (lens, sq, n, on, seen)
                _check_projected(c, dense, w, out, lse)
        finally:
            kt.combine_splits = combine
        assert FUSED_PROJECTION_MAX_TOKENS < 12

    def phase1_zeroes_the_counters():
        """The combine's arrival counters hold garbage on entry (torch.empty): phase 1 zeroes them, and the fused
        combine run with them after is the op's result bit for bit."""
        from mla_fa3.ops.splitkv_combine_triton import combine_splits

        c, args, kw, dense = _op_args(heads=4, lens=(150, 40), page=16)
        sched = kw["schedule"]
        call = validate.check_splitkv(*args, head_dim_v=kw["head_dim_v"], schedule=sched, softmax_scale=0.2,
                                      causal=True, descale_q=None, descale_k=None, impl=Impl.TRITON)
        w = _w_uv(4, c["r"], 24)
        counters = torch.full((2 * 4,), 12345, dtype=torch.int32)
        part_o, part_lse2 = kt.splitkv_partials(call, sched, counters=counters)
        assert (counters == 0).all()
        out = torch.full((2, 1, 4, 24), float("nan"))
        lse = torch.full((2, 1, 4), float("nan"))
        combine_splits(part_o, part_lse2, sched.split_offsets, out, lse, w=w, counters=counters)
        want, want_lse = kt.splitkv_mla_with_kvcache(call, sched, w_uv=w)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        _check_projected(c, dense, w, out, lse)

    def combine_refuses_columns_past_the_limit():
        from mla_fa3.ops.splitkv_combine_triton import combine_splits

        c, args, kw, _ = _op_args(heads=4, lens=(9, 40), page=16)
        sched = kw["schedule"]
        call = validate.check_splitkv(*args, head_dim_v=kw["head_dim_v"], schedule=sched, softmax_scale=0.2,
                                      causal=True, descale_q=None, descale_k=None, impl=Impl.TRITON)
        counters = torch.zeros(2 * 4, dtype=torch.int32)
        part_o, part_lse2 = kt.splitkv_partials(call, sched, counters=counters)
        n = FUSED_PROJECTION_MAX_COLUMNS + 1
        out = torch.full((2, 1, 4, n), float("nan"))
        try:
            combine_splits(part_o, part_lse2, sched.split_offsets, out, torch.empty(2, 1, 4), w=_w_uv(4, c["r"], n),
                           counters=counters)
        except ValueError as exc:
            assert "at most" in str(exc) and torch.isnan(out).all(), exc
        else:
            raise AssertionError("no ValueError for a projection past FUSED_PROJECTION_MAX_COLUMNS")

    return ([(name, lambda n=name: fused_matches_oracle_and_unfused(n)) for name in INTERPRETER_CASES]
            + [("op_fuses_up_to_the_limits", op_fuses_up_to_the_limits),
               ("phase1_zeroes_the_counters", phase1_zeroes_the_counters),
               ("combine_refuses_columns_past_the_limit", combine_refuses_columns_past_the_limit)])


def test_fused_projection_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__) == {}


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(lambda: run_cases(_interpreter_cases()))
