"""``ops.head_matmul`` (MLA's absorption and output projection: out[t, h] = x[t, h] @ w[h]) and
``ops.absorb_query_e4m3`` (the absorbed FP8 query: head_matmul, then the dynamic e4m3 quantization), on the CPU.

Oracle: the fp64 einsum of the same inputs. The torch path (bmm) runs on every CPU; the Triton kernel
(``ops/head_matmul_triton.py``) runs under Triton's CPU interpreter (``TRITON_INTERPRET=1``, this file as a script in
a subprocess) in fp32 and fp16 — not bf16: the interpreter multiplies bf16 bit patterns in ``tl.dot``
(triton-lang/triton#11584); the H200 tests cover bf16 (``test_head_matmul_gpu.py``).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter

from mla_fa3 import ops
from mla_fa3.ops.fp8 import quantize_e4m3_dynamic
from mla_fa3.ops.types import KernelUnavailableError

FP8 = torch.float8_e4m3fn
NAN = float("nan")
# (T, H, K, N): DeepSeek-V3's two projections at decode sizes (W_UK: 128 -> 512, W_UV: 512 -> 128), odd widths and
# heads, the largest T the kernel takes, a head count whose column blocks shrink to 16
SHAPES = {
    "w_uk_1x16": (1, 16, 128, 512),
    "w_uv_3x16": (3, 16, 512, 128),
    "w_uk_2x128": (2, 128, 128, 512),
    "odd_5x3_40x72": (5, 3, 40, 72),
    "max_rows": (ops.HEAD_MATMUL_MAX_ROWS, 2, 128, 64),
    "one_head_k16": (7, 1, 16, 16),
}


def inputs(T, H, K, N, dtype, seed=0):
    """x as a strided view (a slice of a wider q, as the model's q_nope is), w [H, K, N] contiguous."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, K + 24, generator=g).to(dtype)[..., 8: 8 + K]
    w = (torch.randn(H, K, N, generator=g) / K ** 0.5).to(dtype)
    return x, w


def oracle(x, w):
    return torch.einsum("thk,hkn->thn", x.double(), w.double())


def within_precision(out, x, w):
    """|out - oracle| <= the dtype's rounding of the result plus an fp32-accumulated dot's error."""
    ref = oracle(x, w)
    eps = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[x.dtype]
    big = float(x.double().abs().max()) * float(w.double().abs().max()) if x.numel() and w.numel() else 0.0
    bound = eps * ref.abs() + 2.0 ** -20 * x.shape[2] * big
    err = (out.double() - ref).abs()
    assert out.dtype == x.dtype and tuple(out.shape) == tuple(ref.shape)
    if err.numel():
        worst, top = float((err - bound).max()), float(err.max())
        assert bool((err <= bound + 1e-12).all()), f"max err {top:.3g}, over the bound by {worst:.3g}"


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_the_oracle(name, dtype):
    x, w = inputs(*SHAPES[name], dtype)
    within_precision(ops.head_matmul(x, w), x, w)


def test_out_view_is_written_in_place_and_nothing_else():
    T, H, K, N = 3, 4, 32, 48
    x, w = inputs(T, H, K, N, torch.float32)
    buf = torch.full((T, H, N + 16), 7.0)
    res = ops.head_matmul(x, w, out=buf[..., :N])
    assert res.data_ptr() == buf.data_ptr()
    within_precision(buf[..., :N], x, w)
    assert bool((buf[..., N:] == 7.0).all())


def test_more_rows_than_the_kernel_takes_and_no_rows():
    x, w = inputs(ops.HEAD_MATMUL_MAX_ROWS + 5, 3, 32, 16, torch.float32)
    within_precision(ops.head_matmul(x, w), x, w)
    assert ops.head_matmul(x[:0], w).shape == (0, 3, 16)


BAD = {
    "x rank": (lambda x, w, o: (x[0], w, o), "x must be 3-D"),
    "w rank": (lambda x, w, o: (x, w[0], o), "w must be 3-D"),
    "int x": (lambda x, w, o: (x.to(torch.int32), w, o), "x must be float32"),
    "w dtype": (lambda x, w, o: (x, w.double(), o), "w dtype must match"),
    "w heads": (lambda x, w, o: (x, w[:2], o), r"w must be \[H, K, N\]"),
    "w rows": (lambda x, w, o: (x, w[:, :5], o), r"w must be \[H, K, N\]"),
    "x strided last dim": (lambda x, w, o: (x.transpose(1, 2).contiguous().transpose(1, 2), w, o),
                           "x must have a contiguous last dimension"),
    "out shape": (lambda x, w, o: (x, w, o[:, :, :3]), r"out must be \[T, H, N\]"),
    "out dtype": (lambda x, w, o: (x, w, o.double()), "out dtype must match"),
    "out strided": (lambda x, w, o: (x, w, torch.zeros(o.shape[2], o.shape[1], o.shape[0]).permute(2, 1, 0)),
                    "out must have a contiguous last dimension"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_a_named_error_and_writes_nothing(name):
    x, w = inputs(2, 3, 8, 8, torch.float32)
    out = torch.zeros(2, 3, 8)
    make, match = BAD[name]
    bx, bw, bo = make(x, w, out)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.head_matmul(bx, bw, out=bo)
    assert bool((out == 0).all()) and bool((bo == 0).all())


@pytest.mark.parametrize("rows", [0, 2, ops.HEAD_MATMUL_MAX_ROWS + 5])
def test_impl_choice_on_cpu(rows):
    """Every row count: the reference is bmm, TRITON cannot run on a CPU, a bad impl is named — before any work."""
    x, w = inputs(rows, 3, 16, 16, torch.float32)
    within_precision(ops.head_matmul(x, w, impl="reference"), x, w)
    with pytest.raises(KernelUnavailableError, match="per-head matmul"):
        ops.head_matmul(x, w, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.head_matmul(x, w, impl="bogus")


def quantized_oracle(q_lat, q_rope):
    """The dynamic e4m3 quantization of [q_lat | q_rope] (the reference op: itself checked against a table of every
    e4m3 code in ``test_fp8_quant.py``)."""
    return quantize_e4m3_dynamic(torch.cat([q_lat, q_rope], dim=-1))


def close_to_fp64(q8, d, x, w, q_rope):
    """The e4m3 query against the fp64 [q_nope·W_UK | q_rope]: the descale is its absmax / 448 up to q_lat's rounding
    to x's dtype, every value within half an e4m3 step (2^-4 relative, 2^-10 · descale in the subnormals) plus that
    rounding."""
    ref = torch.cat([oracle(x, w), q_rope.double()], dim=-1)
    eps = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[x.dtype]
    amax = float(ref.abs().max())
    assert abs(float(d) - amax / 448) <= amax / 448 * 2 * eps
    err = (q8.double() * float(d) - ref).abs()
    assert bool((err <= (2.0 ** -4 + 2 * eps) * ref.abs() + float(d) * 2.0 ** -10 + 1e-12).all())


def test_absorbed_fp8_query_on_the_torch_path():
    x, w = inputs(3, 4, 32, 64, torch.bfloat16)
    q_rope = torch.randn(3, 4, 80).to(torch.bfloat16)[..., 8:24]
    q8, d = ops.absorb_query_e4m3(x, w, q_rope)
    assert q8.dtype == FP8 and tuple(q8.shape) == (3, 4, 80)
    close_to_fp64(q8, d, x, w, q_rope)
    with pytest.raises(ValueError, match="q_rope must be"):
        ops.absorb_query_e4m3(x, w, q_rope[:2])
    with pytest.raises(ValueError, match=r"w_uk must be \[H, K, N\] with q_nope's"):
        ops.absorb_query_e4m3(x, w[:, :5], q_rope)


# ------------------------------------------------------------------------------------------ Triton interpreter


def _check_kernel(name, dtype):
    x, w = inputs(*SHAPES[name], dtype, seed=zlib.crc32(name.encode()) % 1000)
    within_precision(ops.head_matmul(x, w, impl="triton"), x, w)
    buf = torch.zeros(x.shape[0], x.shape[1], w.shape[2] + 16, dtype=dtype)
    ops.head_matmul(x, w, out=buf[..., 8: 8 + w.shape[2]], impl="triton")
    within_precision(buf[..., 8: 8 + w.shape[2]], x, w)
    assert bool((buf[..., :8] == 0).all()) and bool((buf[..., 8 + w.shape[2]:] == 0).all())


def _check_absorbed(name, dtype, poison=None):
    """The fused launch's absmax partials: the codes and descale equal the full quantization of the kernel's own
    q_lat (bit for bit), whichever column block or head holds the largest |value| or a NaN."""
    T, H, K, N = SHAPES[name]
    x, w = inputs(T, H, K, N, dtype, seed=5)
    q_rope = (torch.randn(T, H, 64 + 16) * 0.5).to(dtype)[..., 16:]
    if poison == "rope_max":
        q_rope[T - 1, H - 1, 63] = 1e3
    elif poison == "rope_nan":
        q_rope[0, H - 1, 5] = NAN
    elif poison == "x_nan":
        x[T - 1, 0, K - 1] = NAN
    q8, d = ops.absorb_query_e4m3(x, w, q_rope, impl="triton")
    r8, rd = quantized_oracle(ops.head_matmul(x, w, impl="triton"), q_rope)
    if poison in ("rope_nan", "x_nan"):
        assert torch.isnan(d).all() and torch.isnan(rd).all()
        return
    assert torch.equal(d, rd), (float(d), float(rd))
    assert torch.equal(q8.view(torch.uint8), r8.view(torch.uint8))
    close_to_fp64(q8, d, x, w, q_rope)


def _check_rows_past_the_auto_limit():
    """TRITON asked for: the kernel takes up to its one tile's 64 rows (above AUTO's limit); more is a named error."""
    x, w = inputs(40, 3, 128, 64, torch.float32, seed=9)
    within_precision(ops.head_matmul(x, w, impl="triton"), x, w)
    x, w = inputs(65, 3, 16, 16, torch.float32)
    out = torch.zeros(65, 3, 16)
    try:
        ops.head_matmul(x, w, out=out, impl="triton")
    except ValueError as exc:
        assert "at most 64 rows" in str(exc) and bool((out == 0).all()), exc
    else:
        raise AssertionError("65 rows with impl='triton' must raise")


def _interpreter_run() -> dict:
    checks = [(f"kernel/{n}/{dt}", lambda n=n, dt=dt: _check_kernel(n, dt))
              for n in SHAPES for dt in (torch.float32, torch.float16)]
    checks += [(f"absorbed/{n}/{p}", lambda n=n, p=p: _check_absorbed(n, torch.float32, p))
               for n in ("w_uk_1x16", "odd_5x3_40x72") for p in (None, "rope_max", "rope_nan", "x_nan")]
    checks += [("absorbed/w_uk_2x128/fp16", lambda: _check_absorbed("w_uk_2x128", torch.float16)),
               ("rows_past_the_auto_limit", _check_rows_past_the_auto_limit)]
    return run_cases(checks)


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__) == {}


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
