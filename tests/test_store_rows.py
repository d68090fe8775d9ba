"""``ops.store_rows``: rows scattered into a float cache (``out[loc[t]] = x[t]`` in out's dtype), on the CPU.

Oracle (from the definition, not from torch's cast): the nearest value of out's dtype, ties to even — for bfloat16 the
nearer (in fp64) of the two bfloat16 values around each fp32 one, for float16 numpy's correctly rounded conversion,
float32 exact from the narrower types. Every slot not in ``loc`` and every column outside out's view keeps its
sentinel. The reference runs on every CPU; the Triton kernel (``ops/fp8_triton.py``, the e4m3 store's kernel with a
cast) runs under Triton's CPU interpreter (``TRITON_INTERPRET=1``, this file as a script in a subprocess) and must
give the same bytes (NaN payloads aside).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter

from mla_fa3 import ops
from mla_fa3.ops.types import Impl, KernelUnavailableError

NAN, INF = float("nan"), float("inf")
SENTINEL = -12345.0  # in every float dtype exactly


def _bf16_from_fp32(x: torch.Tensor) -> torch.Tensor:
    """The nearest bfloat16 to each finite fp32 value, ties to the even mantissa, compared in fp64: of the two
    bfloat16 values around |x| (x truncated to its high 16 bits, and the next one up — 2^128 standing in for the step
    past the largest finite value, where rounding up means inf); ±inf stays, NaN gives NaN."""
    mag = x.abs()
    lo_bits = mag.view(torch.int32) & ~0xFFFF  # |x| truncated: a bfloat16 value (exact in fp32)
    lo = lo_bits.view(torch.float32).double()
    hi_bits = lo_bits + 0x10000
    hi = hi_bits.view(torch.float32).double()
    hi = torch.where(torch.isinf(hi), torch.full_like(hi, 2.0 ** 128), hi)
    d_lo, d_hi = mag.double() - lo, hi - mag.double()
    lo_even = ((lo_bits >> 16) & 1) == 0
    up = (d_hi < d_lo) | ((d_hi == d_lo) & ~lo_even)
    bits = torch.where(up, hi_bits, lo_bits)
    out = (bits >> 16).to(torch.int16).view(torch.bfloat16)
    out = torch.where(torch.signbit(x), -out, out)
    out = torch.where(torch.isinf(x), x.to(torch.bfloat16), out)  # ±inf: exact in bfloat16
    return torch.where(torch.isnan(x), torch.full_like(out, NAN), out)


def cast_oracle(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    wide = x.float()  # exact from bf16 / fp16
    if dtype is torch.float32:
        return wide
    if dtype is torch.bfloat16:
        return _bf16_from_fp32(wide)
    with np.errstate(over="ignore"):  # past 65504: inf, as intended
        return torch.from_numpy(wide.numpy().astype(np.float16))


def special_rows(T: int, W: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over many magnitudes, with bf16 / fp16 ties, overflow, subnormals, ±inf, NaN, ±0 in the first / last."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, W, generator=g, dtype=torch.float64) * torch.logspace(-9, 5, W, dtype=torch.float64)
    if T:
        special = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65520.0,
                                70000.0, 2.0 ** -25, 3 * 2.0 ** -26, 3.4e38, -0.0, 0.0], dtype=torch.float64)
        n = min(W, len(special))
        x[0, :n] = special[:n]
        x[-1, : min(W, 3)] = torch.tensor([NAN, INF, -INF], dtype=torch.float64)[: min(W, 3)]
    x = x.to(dtype)
    if T and dtype is torch.float32 and W >= 6:  # NaNs whose payload lies in the low 16 bits only (a bf16 truncation
        # of them would be ±inf), of both signs
        x[-1, 3:6] = torch.tensor([0x7F800001, -8388607, 0x7F80FFFF], dtype=torch.int32).view(torch.float32)
        # (-8388607 is 0xFF800001)
    return x


CASES = {  # name -> (T, W, x dtype, out dtype, slots, out column offset, loc dtype)
    "fp32_to_bf16_latent": (37, 576, "float32", "bfloat16", 100, 0, "int64"),
    "bf16_one_row": (1, 576, "bfloat16", "bfloat16", 8, 0, "int32"),
    "fp16_to_fp32_columns": (9, 64, "float16", "float32", 40, 512, "int32"),
    "fp32_to_fp16_overflow_subnormal": (5, 300, "float32", "float16", 8, 0, "int64"),
    "bf16_to_fp16": (3, 70, "bfloat16", "float16", 6, 3, "int64"),
    "fp16_to_bf16": (4, 300, "float16", "bfloat16", 9, 0, "int32"),
    # rows per program by row count (fp8_triton.STORE_BLOCK_T): 1 up to 64 (above), 4 up to 1024, 16 beyond
    "bf16_4_rows_per_program": (70, 200, "bfloat16", "bfloat16", 90, 0, "int64"),
    "fp32_16_rows_per_program": (1030, 40, "float32", "bfloat16", 1100, 16, "int32"),
    "empty": (0, 576, "bfloat16", "bfloat16", 16, 0, "int64"),
}


def _inputs(name: str):
    T, W, x_dtype, out_dtype, S, col0, loc_dtype = CASES[name]
    x = special_rows(T, W, getattr(torch, x_dtype), len(name))
    buf = torch.full((S, col0 + W + 3), SENTINEL, dtype=getattr(torch, out_dtype))
    loc = torch.randperm(S, generator=torch.Generator().manual_seed(T))[:T].to(getattr(torch, loc_dtype))
    return x, buf, buf[:, col0: col0 + W], loc, col0


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bytes, NaN payloads aside."""
    nan = torch.isnan(got.float())
    if not torch.equal(nan, torch.isnan(want.float())):
        return False
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    return torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def _check(name: str, impl: str) -> None:
    x, buf, out, loc, col0 = _inputs(name)
    ops.store_rows(out, loc, x, impl=impl)
    want = torch.full_like(buf, SENTINEL)
    for t in range(x.shape[0]):  # row by row, from the oracle
        want[int(loc[t]), col0: col0 + x.shape[1]] = cast_oracle(x[t], buf.dtype)
    assert _same(buf, want), f"{name}: {(buf.float() != want.float()).sum()} elements differ"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_store_rows_matches_the_cast_oracle(name, impl):
    _check(name, impl)


# a row given in two parts, x [T, W1] and rest [T, W - W1] (a latent row's c_kv and k_rope): name -> (case, W1)
SPLITS = {"latent_c_kv_and_k_rope": ("fp32_to_bf16_latent", 512), "split_inside_a_column_block": ("fp16_to_bf16", 45),
          "one_column_first": ("bf16_4_rows_per_program", 1), "split_16_rows_per_program": ("fp32_16_rows_per_program", 24)}


def _check_split(name: str, impl: str) -> None:
    """The row [x | rest] stored by one call: the same bytes as the whole row through the oracle."""
    case, w1 = SPLITS[name]
    x, buf, out, loc, col0 = _inputs(case)
    ops.store_rows(out, loc, x[:, :w1].contiguous(), rest=x[:, w1:].contiguous(), impl=impl)
    want = torch.full_like(buf, SENTINEL)
    for t in range(x.shape[0]):
        want[int(loc[t]), col0: col0 + x.shape[1]] = cast_oracle(x[t], buf.dtype)
    assert _same(buf, want), f"{name}: {(buf.float() != want.float()).sum()} elements differ"


@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_a_row_in_two_parts_is_stored_as_the_whole_row(name, impl):
    _check_split(name, impl)


def _bad_calls():
    x, buf, out, loc, _ = _inputs("fp32_to_bf16_latent")
    return {
        "out must be float32, float16 or bfloat16": dict(out=out.to(torch.float8_e4m3fn)),
        "out must be 2-D": dict(out=out[None]),
        "x must be float32, float16 or bfloat16": dict(x=x.double()),
        "x must have out's width": dict(x=x[:, :-1]),
        "loc must be int64 or int32": dict(loc=loc.float()),
        r"loc must be \[T\]": dict(loc=loc[:-1]),
        "x must be on out's device": dict(x=x.to("meta")),
        "x must have a contiguous last dimension": dict(x=torch.empty(576, x.shape[0], dtype=x.dtype).t()),
        "loc must be a torch.Tensor": dict(loc=loc.tolist()),
        "rest must have x's dtype": dict(x=x[:, :512], rest=x[:, 512:].half()),
        "x and rest must be": dict(x=x[:, :512], rest=x[:, 511:]),
        "rest must be 2-D": dict(x=x[:, :512], rest=x[None, :, 512:]),
        "rest must be on out's device": dict(x=x[:, :512], rest=x[:, 512:].to("meta")),
    }, (x, buf, out, loc)


@pytest.mark.parametrize("match", list(_bad_calls()[0]))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_bad_input_raises_a_named_error_before_writing(match, impl):
    bad, (x, buf, out, loc) = _bad_calls()
    args = dict(out=out, loc=loc, x=x, rest=None)
    args.update(bad[match])
    before = buf.clone()
    with pytest.raises((ValueError, TypeError), match="^" + match):
        ops.store_rows(args["out"], args["loc"], args["x"], rest=args["rest"], impl=impl)
    assert torch.equal(buf, before)


def test_triton_off_cuda_is_named():
    x, buf, out, loc, _ = _inputs("bf16_one_row")
    with pytest.raises(KernelUnavailableError, match="the pool store Triton kernel unavailable"):
        ops.store_rows(out, loc, x, impl="triton")
    assert (buf == SENTINEL).all()


@pytest.mark.parametrize("impl", [None, "auto", "fa3", "reference"])
def test_every_other_choice_stores_on_the_cpu(impl):
    """AUTO / FA3 / REFERENCE (given, or the global choice when impl is None) store on a CPU tensor — the indexed
    assignment (as head_matmul's bmm), not an error; a global 'triton' is refused as impl='triton' is."""
    with ops.use_impl(impl or "fa3"):
        _check("fp32_to_bf16_latent", impl)
    with ops.use_impl("triton"):
        with pytest.raises(KernelUnavailableError, match="the pool store Triton kernel unavailable"):
            _check("bf16_one_row", None)


def test_a_slot_past_the_buffer_raises_in_the_reference():
    x, buf, out, loc, _ = _inputs("bf16_one_row")
    with pytest.raises(IndexError):
        ops.store_rows(out, loc + buf.shape[0], x, impl="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("e4m3", [False, True])
def test_a_strided_loc_on_the_gpu(e4m3):
    """On CUDA (the kernel), loc as SGLang's EAGLE draft hands it: each step's slots a column (stride = steps) of the
    [tokens, steps] table; the rows must land at loc's slots and nowhere else, under a CUDA graph too (the static
    view replayed with new slots)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    T, W, S, steps = 6, 576, 64, 3
    x = torch.randn(T, W, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(T, steps, dtype=torch.int64, device="cuda")
    pool = torch.zeros(S, W, dtype=torch.uint8 if e4m3 else torch.bfloat16, device="cuda")
    out = pool.view(torch.float8_e4m3fn) if e4m3 else pool
    scale = torch.ones(1, device="cuda")

    def store(step):
        if e4m3:
            ops.store_e4m3(out, table[:, step], x, scale, impl="triton")
        else:
            ops.store_rows(out, table[:, step], x, impl="triton")

    store(0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store(1)
    for seed in range(3):
        slots = torch.randperm(S - 1, generator=torch.Generator().manual_seed(seed))[: T * steps] + 1
        table.copy_(slots.view(T, steps))
        pool.zero_()
        graph.replay()
        torch.cuda.synchronize()
        written = set((pool.view(torch.uint8).view(S, -1) != 0).any(-1).nonzero().flatten().tolist())
        assert written == set(table[:, 1].tolist()), f"seed {seed}: rows at {sorted(written)}"
        if not e4m3:
            assert torch.equal(pool[table[:, 1]], x)


# ------------------------------------------------------------------------------------------ Triton interpreter


def _interpreter_run() -> dict:
    def through_the_kernel(name):
        ops.set_impl("reference")  # the global choice must not matter: impl='triton' runs the kernel
        try:
            _check(name, "triton")
        finally:
            ops.set_impl("auto")

    def slots_outside_the_buffer_are_skipped():
        """The values of loc are the caller's: a slot < 0 or >= S is not written (nothing past the buffer), by the
        float store and by the e4m3 store (one kernel); the rows with good slots are."""
        x, buf, _, loc, _ = _inputs("bf16_4_rows_per_program")
        S, W = buf.shape[0], x.shape[1]
        bad = loc.clone()
        bad[::3] = torch.tensor([-1, S, S + 5, -100] * 10, dtype=bad.dtype)[: len(bad[::3])]
        wide = torch.full((3 * S, W), SENTINEL, dtype=buf.dtype)  # the pool between two guard bands
        ops.store_rows(wide[S: 2 * S], bad, x, impl="triton")
        assert (wide[:S] == SENTINEL).all() and (wide[2 * S:] == SENTINEL).all(), "written past the buffer"
        good = torch.ones(len(bad), dtype=torch.bool)
        good[::3] = False
        want = torch.full((S, W), SENTINEL, dtype=buf.dtype)
        want[bad[good].long()] = cast_oracle(x[good], buf.dtype)
        assert _same(wide[S: 2 * S], want)
        wide8 = torch.zeros(3 * S, W, dtype=torch.uint8).view(torch.float8_e4m3fn)
        ops.store_e4m3(wide8[S: 2 * S], bad, x, torch.ones(1), impl="triton")
        raw = wide8.view(torch.uint8)
        assert (raw[:S] == 0).all() and (raw[2 * S:] == 0).all(), "e4m3 written past the buffer"
        assert (raw[S: 2 * S][bad[good].long()] != 0).any()

    def split_through_the_kernel(name):
        _check_split(name, "triton")

    def a_strided_loc_is_read_with_its_stride():
        """loc as SGLang's EAGLE draft hands it to each step (``per_step_draft_out_cache_loc``): one column of the
        [bs·topk, steps] slot table, stride = steps. Each row goes to the slot loc holds, not to loc's storage read
        as contiguous (which names the slots of other steps) — float store and e4m3 store alike."""
        x, buf, _, _, _ = _inputs("bf16_4_rows_per_program")
        T, W = x.shape
        S = 4 * T
        table = torch.randperm(S)[: T * 3].view(T, 3)  # [tokens, steps]: distinct slots
        for step in range(3):
            loc = table[:, step]
            assert loc.stride(0) == 3
            got = torch.full((S, W), SENTINEL, dtype=buf.dtype)
            ops.store_rows(got, loc, x, impl="triton")
            want = torch.full((S, W), SENTINEL, dtype=buf.dtype)
            want[loc] = cast_oracle(x, buf.dtype)
            assert _same(got, want), f"step {step}: rows stored at other slots than loc's"
            got8 = torch.zeros(S, W, dtype=torch.uint8).view(torch.float8_e4m3fn)
            ops.store_e4m3(got8, loc, x, torch.ones(1), impl="triton")
            written = (got8.view(torch.uint8) != 0).any(-1)
            assert set(written.nonzero().flatten().tolist()) <= set(loc.tolist()), f"step {step}: e4m3 elsewhere"

    return run_cases([(name, lambda n=name: through_the_kernel(n)) for name in CASES]
                     + [(name, lambda n=name: split_through_the_kernel(n)) for name in SPLITS]
                     + [("slots_outside_the_buffer_are_skipped", slots_outside_the_buffer_are_skipped),
                        ("a_strided_loc_is_read_with_its_stride", a_strided_loc_is_read_with_its_stride)])


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__) == {}


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
