"""impl=auto on a CUDA tensor never falls back to the reference silently; the torch/sgl-kernel pairing.

No GPU is needed: the CUDA device, its capability and the sgl_kernel import are monkeypatched, and the
op is called with CPU tensors whose device ``ops`` is told is ``cuda:0``. Every error must come before
any kernel (or the reference) runs — the reference is patched to fail if it is reached.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mla_fa3 import ops
from mla_fa3.ops import fa3, reference, validate

I32 = torch.int32


def _varlen_args():
    q, k, v = torch.randn(3, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3], dtype=I32), torch.tensor([0, 5], dtype=I32)
    return (q, k, v), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=5, causal=True)


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Tensors read as cuda:0 on a machine with CUDA; returns a setter for capability / import state."""
    monkeypatch.setattr(validate, "device_of", lambda t, name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def must_not_run(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the reference ran although an error was due")

    monkeypatch.setattr(reference, "flash_attn_varlen_func", must_not_run)

    def state(*, capability=(9, 0), import_error=None, spec=True, sgl_version=None, torch_version="2.13.0+cpu"):
        monkeypatch.setattr(fa3, "_capability", lambda index: capability)
        monkeypatch.setattr(fa3, "import_error", lambda: import_error)
        monkeypatch.setattr(fa3.importlib.util, "find_spec", lambda name: object() if spec else None)
        monkeypatch.setattr(fa3, "installed_sgl_kernel", lambda: sgl_version)
        monkeypatch.setattr(fa3.torch, "__version__", torch_version)
        return calls

    return state


CASES = {
    # name: (state, reason, words the message must hold)
    "sgl_kernel_missing": (dict(import_error="ModuleNotFoundError: No module named 'sgl_kernel'", spec=False),
                           fa3.Unavailable.SGL_KERNEL_MISSING, ["sgl_kernel is not installed", "mla-fa3[gpu]"]),
    "wrong_arch": (dict(capability=(8, 0)), fa3.Unavailable.WRONG_ARCH, ["(8, 0)", "(9, 0)"]),
    "version_mismatch": (dict(import_error="OSError: undefined symbol: _ZN3c10", sgl_version="0.4.5",
                              torch_version="2.13.0+cu130"),
                         fa3.Unavailable.VERSION_MISMATCH, ["undefined symbol", "torch 2.11.*", "2.13.0+cu130"]),
    "import_failed": (dict(import_error="ImportError: libcuda.so.1"), fa3.Unavailable.IMPORT_FAILED,
                      ["libcuda.so.1"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_on_cuda_raises_why_instead_of_falling_back(case, pretend_cuda):
    state, reason, words = CASES[case]
    ran = pretend_cuda(**state)
    args, kw = _varlen_args()
    with pytest.raises(ops.FA3UnavailableError) as info:
        ops.flash_attn_varlen_func(*args, **kw)  # impl=auto (the default)
    assert info.value.reason is reason
    message = str(info.value)
    assert "impl=auto" in message and "impl='reference'" in message and "\n" not in message
    for word in words:
        assert word in message, (word, message)
    assert isinstance(info.value, ops.KernelUnavailableError) and not ran
    with pytest.raises(ops.FA3UnavailableError):  # the same for impl='fa3'
        ops.flash_attn_varlen_func(*args, **kw, impl="fa3")


def test_explicit_reference_still_runs_on_cuda(pretend_cuda, monkeypatch):
    pretend_cuda(**CASES["sgl_kernel_missing"][0])
    sentinel = (torch.zeros(3, 2, 8), None)
    monkeypatch.setattr(reference, "flash_attn_varlen_func", lambda args: sentinel)
    args, kw = _varlen_args()
    assert ops.flash_attn_varlen_func(*args, **kw, impl="reference") is sentinel[0]
    with ops.use_impl("reference"):
        assert ops.flash_attn_varlen_func(*args, **kw) is sentinel[0]
    assert ops.last_impl() is ops.Impl.REFERENCE


def test_auto_off_cuda_is_the_reference_without_a_word(caplog):
    args, kw = _varlen_args()
    with caplog.at_level(logging.DEBUG):
        out = ops.flash_attn_varlen_func(*args, **kw)
    assert out.shape == (3, 2, 8) and ops.last_impl() is ops.Impl.REFERENCE and not caplog.records


@pytest.mark.parametrize("sgl, torch_version, pairs", [
    ("0.4.5", "2.11.0+cu130", True), ("0.4.5", "2.11.1", True), ("0.4.5", "2.13.0+cpu", False),
    ("0.4.5", "2.9.1", False), ("0.9.9", "2.13.0", True),  # a release we know nothing of is not judged
])
def test_version_pairing_line(sgl, torch_version, pairs):
    message = fa3.version_mismatch(sgl, torch_version)
    if pairs:
        assert message is None
        return
    assert "\n" not in message and f"sglang-kernel {sgl}" in message and f"torch {torch_version}" in message
    assert 'pip install "torch==2.11.*" "sglang-kernel==0.4.5"' in message


def test_no_sgl_kernel_installed_means_no_pairing_message(monkeypatch):
    monkeypatch.setattr(fa3, "installed_sgl_kernel", lambda: None)
    assert fa3.version_mismatch() is None and fa3.report_version_mismatch() is None


def test_mismatch_reported_once_in_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(fa3, "installed_sgl_kernel", lambda: "0.4.5")
    monkeypatch.setattr(fa3.torch, "__version__", "2.13.0+cu130")
    with caplog.at_level(logging.WARNING, logger="mla_fa3.ops.fa3"):
        message = fa3.report_version_mismatch()
    [record] = caplog.records
    assert record.levelno == logging.WARNING and message in record.getMessage()
    assert "\n" not in record.getMessage()


def test_gpu_extra_pins_the_pair():
    """pyproject's gpu extra pins the torch that the pinned sglang-kernel is built for (SGL_KERNEL_TORCH)."""
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = pathlib.Path(__file__).resolve().parents[1]
    gpu = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = dict(req.split("==") for req in gpu)
    assert pins["torch"] == fa3.SGL_KERNEL_TORCH[pins["sglang-kernel"]] + ".*"


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("kernel_shape,perm,want", [((3, 5), (1, 0), (5, 3)), ((2, 3, 4), (0, 2, 1), (2, 4, 3))])
def test_fa3_lse_comes_back_token_major_with_empty_rows_at_minus_inf(kernel_shape, perm, want, requires_grad):
    """FA3's LSE in its own layout ([H, T] varlen, [bs, H, sq] batched) comes back contiguous in ours, +inf (FA3's
    empty row) as -inf, -inf and NaN as they were; already in our layout it passes through; any other shape is a
    named error; an LSE that requires grad (a caller with autograd on, as SGLang's test kit runs) gives the same.
    Oracle: the element-wise rule on an explicit transpose."""
    inf = float("inf")
    raw = torch.randn(kernel_shape)
    flat = raw.view(-1)
    flat[1], flat[4], flat[7] = inf, -inf, float("nan")
    raw.requires_grad_(requires_grad)
    got = fa3._token_major(raw, kernel_shape, perm, want)
    raw = raw.detach()
    expected = raw.permute(*perm).contiguous().clone()
    expected[expected == inf] = -inf
    assert got.is_contiguous() and got.dtype == torch.float32 and got.shape == want
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))
    assert (got == inf).sum() == 0 and (got == -inf).sum() == 2
    same = fa3._token_major(expected, kernel_shape, perm, want)
    assert torch.equal(same.nan_to_num(0.0), expected.nan_to_num(0.0))
    with pytest.raises(RuntimeError, match="unexpected kernel lse shape"):
        fa3._token_major(raw.view(-1), kernel_shape, perm, want)
