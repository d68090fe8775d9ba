"""Every ``mla-fa3 bench`` command on a machine without CUDA (``mla_fa3.bench.smoke``): without ``--device cpu`` one
line on stderr naming the way out, exit status 2, nothing built; with it a labelled smoke run on the reference kernels
that finishes within about a minute, shows its progress and prints nothing meant to be pasted into a table."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from mla_fa3 import cli
from mla_fa3.bench import decode, fp8, plain_step, prefill, serve, splitkv, splitkv_phases
from mla_fa3.bench.smoke import SMOKE_LABEL

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
BENCHES = ("decode", "prefill", "serve", "fp8")
SMOKE_WALL_S = 120  # about a minute on two cores; room for a slow CI machine


@pytest.fixture
def nothing_built(monkeypatch):
    """Every bench's first expensive step raises: a refusal must come before any of them."""
    def built(*args, **kwargs):
        raise AssertionError("the benchmark built something before refusing")
    for module, name in ((decode, "sweep"), (fp8, "sweep"), (prefill, "MLATokenPool"), (prefill, "run_shape"),
                         (serve, "random_model"), (serve, "load_model"), (plain_step, "sweep"),
                         (splitkv, "check_correctness"), (splitkv, "run"), (splitkv_phases, "Shape")):
        monkeypatch.setattr(module, name, built)


def _one_line(capsys, prog: str, *words: str) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@no_cuda
@pytest.mark.parametrize("bench", BENCHES)
@pytest.mark.parametrize("argv", [[], ["--quick"], ["--device", "cuda"], ["--device", "cuda:1", "--out", "x"]])
def test_bench_without_cuda_refuses_in_one_line(bench, argv, nothing_built, capsys):
    assert cli.main(["bench", bench, *argv]) == 2
    _one_line(capsys, f"mla-fa3 bench {bench}", "CUDA is not available", "--device cpu", "smoke run")


@no_cuda
@pytest.mark.parametrize("module", [splitkv, splitkv_phases, plain_step])
def test_gpu_only_kernel_benches_refuse_in_one_line(module, nothing_built, capsys):
    """The kernel benchmarks with no CPU path (``python -m mla_fa3.bench.NAME``) refuse the same way."""
    assert module.main([]) == 2
    _one_line(capsys, f"python -m {module.__name__}", "CUDA is not available", "CUDA GPU only")


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_device_flag_is_checked_before_anything_runs(bench, nothing_built, capsys):
    assert cli.main(["bench", bench, "--device", "gpu"]) == 2
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["decode", "--quick"],  # the H200's quick set replaced by the smoke shapes (it took ~10 minutes on 2 cores)
    ["prefill"],            # the full sweep replaced by the smoke shapes; no cost constants fitted from CPU times
    ["fp8"],
    ["serve"],
], ids=lambda argv: argv[0])
def test_cpu_smoke_run_is_labelled_short_and_pastes_nothing(argv, tmp_path):
    """The CLI itself (a subprocess): label first on stdout, progress on stderr, done within the bound."""
    cmd = [sys.executable, "-m", "mla_fa3", "bench", *argv, "--device", "cpu", "--out", str(tmp_path / "out")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_WALL_S)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == SMOKE_LABEL
    for text in (proc.stdout, proc.stderr):
        assert "paste" not in text.lower() and "H200_COSTS" not in text and "CostConstants(" not in text
    if argv[0] != "serve":  # serve draws its bar on a terminal only; its smoke run takes a few seconds
        assert re.search(r"^\[ *1/\d+ ", proc.stderr, re.M) and "done:" in proc.stderr, proc.stderr
    for path in (tmp_path / "out").glob("*.md"):  # the files carry the label too
        assert "smoke run" in path.read_text()
    assert wall < SMOKE_WALL_S
