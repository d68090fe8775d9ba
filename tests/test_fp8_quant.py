"""The FP8 (e4m3) quantization ops: ``ops.store_e4m3`` (quantize + scatter into a cache) and
``ops.quantize_query_e4m3`` (per-step dynamic query quantization), on the CPU.

Oracle (written here from the definition, not from torch's cast): the e4m3 code of a value is the
nearest of the 253 finite e4m3 values (ties to the even code, i.e. mantissa LSB 0), from a table of
every code; the quotient ``x / s`` is the correctly rounded fp32 division (computed in fp64 and rounded
once to fp32 — innocuous double rounding for a quotient, 53 >= 2·24 + 2 bits). Store: NaN -> 0, clamp
to ±448 first. Query: ``s = fp32(max(absmax, 2^-100) / 448)``.

The reference implementation runs on every CPU; the fused Triton kernels (``ops/fp8_triton.py``) run
under Triton's CPU interpreter (``TRITON_INTERPRET=1``, this file as a script in a subprocess) and must
match the reference bit for bit — the kernels round to e4m3 in integer arithmetic, so the interpreter
runs the arithmetic the GPU runs (its own fp32 -> fp8 cast does not round to nearest even).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter, subprocess_env

from mla_fa3 import ops
from mla_fa3.ops.types import Impl

FP8 = torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------------------ oracle

_CODES = torch.arange(256, dtype=torch.int64)
_VALUES = _CODES.to(torch.uint8).view(FP8).double()
_FINITE = torch.isfinite(_VALUES)
_TABLE_V, _TABLE_C = _VALUES[_FINITE], _CODES[_FINITE]  # includes +0 (code 0) and -0 (code 128)


def e4m3_code(y: torch.Tensor) -> torch.Tensor:
    """uint8 codes of finite fp64 ``y`` (|y| <= 464 - tiny): nearest e4m3 value, ties to the even code; sign kept."""
    y = y.double().reshape(-1)
    neg = torch.signbit(y)
    a = y.abs()
    pos_v, pos_c = _TABLE_V[_TABLE_C < 128], _TABLE_C[_TABLE_C < 128]  # non-negative values, ascending codes
    d = (a[:, None] - pos_v[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    tie = d == best
    even = tie & (pos_c[None, :] % 2 == 0)
    pick = torch.where(even.any(dim=1, keepdim=True), even, tie).int().argmax(dim=1)
    code = pos_c[pick] | (neg.long() << 7)
    return code.to(torch.uint8)


def fp32_quotient(x: torch.Tensor, s: float) -> torch.Tensor:
    """Correctly rounded fp32 x / s (fp64 quotient rounded once to fp32), as fp64."""
    return (x.double() / torch.tensor(s, dtype=torch.float32).double()).float().double()


def store_oracle(x: torch.Tensor, s: float) -> torch.Tensor:
    y = fp32_quotient(x, s)
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y).clamp(-448, 448)
    return e4m3_code(y).view(x.shape)


def query_oracle(q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(codes, s) of the dynamic quantization of a finite q."""
    amax = float(q.double().abs().max()) if q.numel() else 0.0
    s = float(torch.tensor(max(amax, 2.0 ** -100), dtype=torch.float32).double() / 448)
    s = float(torch.tensor(s, dtype=torch.float64).float())  # fp32(max / 448): one rounding
    return e4m3_code(fp32_quotient(q, s)).view(q.shape), s


# ------------------------------------------------------------------------------------------ cases

def special_rows(T: int, W: int, dtype: torch.dtype, seed: int, scale: float) -> torch.Tensor:
    """Rows spanning e4m3's range at ``scale``: subnormals, ties, overflow, ±inf, NaN, ±0."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-13, 3.5, W, dtype=torch.float64)
    x = torch.randn(T, W, generator=g, dtype=torch.float64) * mags * scale / 448 * 4
    if T:
        ties = torch.tensor([0.5, 1.5, 2.5, 9.0, 17.0, 100.0, 104.0, 127.0, 232.0, 464.0, 480.0, 2.0 ** -10,
                             3 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -10, -0.0, 0.0], dtype=torch.float64)
        x[0, : len(ties)] = ties * scale
        x[-1, :6] = torch.tensor([NAN, INF, -INF, 1e30, -1e30, -0.0])
    return x.to(dtype)


STORE_CASES = {  # name -> (T, W, dtype, scale, slots, out column offset, loc dtype)
    "bf16_latent_576": (37, 576, "bfloat16", 0.37, 100, 0, "int64"),
    "fp16_kv_columns": (9, 64, "float16", 0.0125, 40, 512, "int32"),
    "fp32_wide_scale": (5, 300, "float32", 3.0, 8, 0, "int64"),
    "empty": (0, 576, "bfloat16", 1.0, 16, 0, "int64"),
    # rows per program by row count (fp8_triton.STORE_BLOCK_T): 1 up to 64 rows (above), 4 up to 1024, 16 beyond;
    # both with a partial last block
    "fp16_4_rows_per_program": (70, 200, "float16", 0.25, 90, 0, "int64"),
    "bf16_16_rows_per_program": (1030, 40, "bfloat16", 0.5, 1100, 16, "int32"),
}


def _store_inputs(name: str):
    T, W, dtype, scale, S, col0, loc_dtype = STORE_CASES[name]
    x = special_rows(T, W, getattr(torch, dtype), len(name), scale)
    buf = torch.full((S, col0 + W + 3), 0x7F, dtype=torch.uint8).view(FP8)  # NaN everywhere: untouched stays NaN
    loc = torch.randperm(S, generator=torch.Generator().manual_seed(T))[:T].to(getattr(torch, loc_dtype))
    return x, buf, buf[:, col0: col0 + W], loc, torch.tensor([scale], dtype=torch.float32)


def _check_store(name: str, impl: str, split: int | None = None) -> None:
    """``split``: the row given as x[:, :split] and ``rest`` = x[:, split:] (one call), the oracle on the whole row."""
    x, buf, out, loc, s = _store_inputs(name)
    before = buf.view(torch.uint8).clone()
    if split is None:
        ops.store_e4m3(out, loc, x, s, impl=impl)
    else:
        ops.store_e4m3(out, loc, x[:, :split].contiguous(), s, rest=x[:, split:].contiguous(), impl=impl)
    want = before.clone()
    col0 = out.data_ptr() - buf.data_ptr()
    if x.shape[0]:
        want[loc.long(), col0: col0 + x.shape[1]] = store_oracle(x, float(s))
    assert torch.equal(buf.view(torch.uint8), want), f"{name}: codes differ at {(buf.view(torch.uint8) != want).sum()}"


def query_inputs(T: int, H: int, dtype: torch.dtype, seed: int, kind: str = "randn"):
    """(q_lat [T, H, 512], q_rope: a strided [T, H, 64] slice of q [T, H, 192])."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(T, H, 512, generator=g, dtype=torch.float64) * torch.logspace(-9, 1, 512, dtype=torch.float64)
    q = torch.randn(T, H, 192, generator=g, dtype=torch.float64)
    if kind == "zero":
        lat.zero_(), q.zero_()
    if kind == "rope_max":  # the absmax in q_rope's last head of the last row: every head's rope row must be read
        lat.mul_(1e-3)
        q[-1, -1, 128 + 5] = -40.0
    return lat.to(dtype), q.to(dtype)[..., 128:]


QUERY_CASES = {  # name -> (T, H, dtype, kind)
    "bf16_decode_16_heads": (3, 16, "bfloat16", "randn"),
    "fp16_many_blocks": (70, 5, "float16", "randn"),  # 350 rows: several programs, several partials
    "fp32_one_row": (1, 1, "float32", "randn"),
    "all_zero": (2, 4, "bfloat16", "zero"),
    "bf16_decode_128_heads": (1, 128, "bfloat16", "randn"),  # 32 programs, 32 partials (4 rows each)
    "bf16_16_rows_per_block": (17, 130, "bfloat16", "randn"),  # 2210 rows: 16 a block (fp8_triton.QUANT_BLOCK_N)
    "bf16_rope_holds_the_max": (4, 16, "bfloat16", "rope_max"),  # the scale comes from q_rope's head stride
}


def _check_query(name: str, impl: str) -> None:
    T, H, dtype, kind = QUERY_CASES[name]
    a, b = query_inputs(T, H, getattr(torch, dtype), len(name), kind)
    q8, descale = ops.quantize_query_e4m3(a, b, impl=impl)
    codes, s = query_oracle(torch.cat([a, b], dim=-1))
    assert q8.dtype == FP8 and q8.shape == (T, H, 576) and q8.is_contiguous()
    assert descale.dtype == torch.float32 and descale.shape == (1,) and float(descale) == s, (float(descale), s)
    assert torch.equal(q8.view(torch.uint8), codes), f"{name}: {(q8.view(torch.uint8) != codes).sum()} codes differ"


# ------------------------------------------------------------------------------------------ reference (CPU)


@pytest.mark.parametrize("name", list(STORE_CASES))
def test_store_reference_matches_the_e4m3_oracle(name):
    _check_store(name, "reference")
    assert ops.last_impl() is Impl.REFERENCE


# a row in two parts (``rest``: a latent row's c_kv and k_rope in one call): case -> where it splits
STORE_SPLITS = {"bf16_latent_576": 512, "fp16_4_rows_per_program": 77, "bf16_16_rows_per_program": 1}


@pytest.mark.parametrize("name", list(STORE_SPLITS))
def test_store_of_a_row_in_two_parts_matches_the_whole_rows_oracle(name):
    _check_store(name, "reference", STORE_SPLITS[name])


@pytest.mark.parametrize("name", list(QUERY_CASES))
def test_query_reference_matches_the_oracle(name):
    _check_query(name, "reference")


def test_query_nan_makes_everything_nan_and_empty_gets_descale_one():
    a, b = query_inputs(2, 3, torch.bfloat16, 1)
    a[1, 2, 7] = NAN
    q8, d = ops.quantize_query_e4m3(a, b, impl="reference")
    assert torch.isnan(d).all() and torch.isnan(q8.float()).all()
    q8, d = ops.quantize_query_e4m3(a[:0], b[:0], impl="reference")
    assert q8.shape == (0, 3, 576) and float(d) == 1.0


def _bad_store_calls():
    x, buf, out, loc, s = _store_inputs("bf16_latent_576")
    return {
        "out must be float8_e4m3fn": dict(out=out.float()),
        "out must be 2-D": dict(out=buf.unsqueeze(0)),
        "x must be 2-D": dict(x=x[None]),
        "x must be float32, float16 or bfloat16": dict(x=x.double()),
        "x must have out's width": dict(x=x[:, :-1]),
        "loc must be int64 or int32": dict(loc=loc.float()),
        r"loc must be \[T\]": dict(loc=loc[:-1]),
        r"scale must be a \[1\] float32": dict(s=s.double()),
        "scale must be on out's device": dict(s=s.to("meta")),
        "x must have a contiguous last dimension": dict(x=torch.empty(576, x.shape[0], dtype=x.dtype).t()),
    }, (x, buf, out, loc, s)


@pytest.mark.parametrize("match", list(_bad_store_calls()[0]))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_store_bad_input_raises_a_named_error_before_writing(match, impl):
    bad, (x, buf, out, loc, s) = _bad_store_calls()
    args = dict(out=out, loc=loc, x=x, s=s, **{})
    args.update(bad[match])
    before = buf.view(torch.uint8).clone()
    with pytest.raises((ValueError, TypeError), match="^" + match):
        ops.store_e4m3(args["out"], args["loc"], args["x"], args["s"], impl=impl)
    assert torch.equal(buf.view(torch.uint8), before)


@pytest.mark.parametrize("bad,match", [
    (lambda a, b: (a[0], b), r"q_a must be 3-D"),
    (lambda a, b: (a.double(), b.double()), "q_a must be float32, float16 or bfloat16"),
    (lambda a, b: (a, b.float()), "q_b dtype must match"),
    (lambda a, b: (a, b[:1]), r"q_b must be \[T, H, DB\]"),
    (lambda a, b: (a, b.to("meta")), "q_b must be on q_a's device"),
    (lambda a, b: (a, b.transpose(1, 2).contiguous().transpose(1, 2)), "q_b must have a contiguous last"),
    (lambda a, b: ("q", b), "q_a must be a torch.Tensor"),
])
def test_query_bad_input_raises_a_named_error(bad, match):
    a, b = query_inputs(2, 3, torch.bfloat16, 0)
    with pytest.raises((ValueError, TypeError), match="^" + match):
        ops.quantize_query_e4m3(*bad(a, b))


def test_impl_choice_on_cpu():
    x, buf, out, loc, s = _store_inputs("fp32_wide_scale")
    ops.store_e4m3(out, loc, x, s)
    want = Impl.TRITON if os.environ.get("TRITON_INTERPRET") == "1" and ops.fp8_fused_available("cpu") else Impl.REFERENCE
    assert ops.last_impl() is want
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not ops.fp8_fused_available("cpu", "triton") and ops.fp8_fused_available("cpu")
        with pytest.raises(ops.KernelUnavailableError, match="FP8 quantization Triton kernel unavailable"):
            ops.store_e4m3(out, loc, x, s, impl="triton")


def test_import_does_not_need_triton():
    code = ("import sys; sys.modules['triton'] = None; import mla_fa3.ops.triton_ops as o; "
            "assert isinstance(o._fp8_kernels(), str); print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# ------------------------------------------------------------------------------------------ Triton interpreter


def _pool_and_backend_run() -> None:
    """The latent pool's stores and a whole FP8 backend step (AUTO picks the Triton kernels) vs the oracles."""
    from fp8_cases import TOL, fp8_case, fp8_oracle, run
    from mla_cases import rel_err
    from mla_fa3.kv.pools import MLATokenPool

    pool = MLATokenPool(2, 4, 64, 512, 64, torch.bfloat16, "cpu", kv_dtype=FP8)
    pool.set_scales([0.02, 0.5])
    x = special_rows(7, 576, torch.bfloat16, 5, 0.5)
    loc = torch.tensor([3, 200, 64, 0, 255, 17, 18])
    pool.set_kv(1, loc, x[:, :512], x[:, 512:])
    assert ops.last_impl() is Impl.TRITON
    assert torch.equal(pool.kv_buffer[1][loc].view(torch.uint8), store_oracle(x, 0.5))
    case = fp8_case("mixed", seed=3)
    out, _ = run(case)
    assert ops.last_impl() is not None
    assert rel_err(out, fp8_oracle(case)) <= TOL


def _interpreter_run() -> dict:
    """Every case through the Triton kernels (impl='triton') against the oracle; returns failures (or {})."""
    def ran_a_kernel(check):
        check()
        assert ops.last_impl() in (Impl.TRITON, Impl.REFERENCE)

    checks = [(f"store/{n}", lambda n=n: _check_store(n, "triton")) for n in STORE_CASES]
    checks += [(f"store_split/{n}", lambda n=n: _check_store(n, "triton", STORE_SPLITS[n])) for n in STORE_SPLITS]
    checks += [(f"query/{n}", lambda n=n: _check_query(n, "triton")) for n in QUERY_CASES]
    checks += [("pool_and_backend", _pool_and_backend_run)]
    failures = run_cases((name, lambda c=check: ran_a_kernel(c)) for name, check in checks)
    a, b = query_inputs(2, 3, torch.bfloat16, 1)
    a[1, 2, 7] = NAN
    q8, d = ops.quantize_query_e4m3(a, b, impl="triton")
    if not (torch.isnan(d).all() and torch.isnan(q8.float()).all()):
        failures["query/nan"] = "a NaN in q must make the descale and every code NaN"
    q8, d = ops.quantize_query_e4m3(a[:0], b[:0], impl="triton")
    if q8.shape != (0, 3, 576) or float(d) != 1.0:
        failures["query/empty"] = f"{tuple(q8.shape)} {float(d)}"
    return failures


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__) == {}


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
