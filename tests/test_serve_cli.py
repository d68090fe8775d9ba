"""``mla-fa3 plan`` and ``mla-fa3 bench serve`` from the command line (CPU, tiny config)."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from mla_fa3 import cli
from mla_fa3.bench import serve as bench_serve
from mla_fa3.bench.smoke import SMOKE_LABEL
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_plan_table_and_json(capsys):
    assert cli.main(["plan", "--kv-dtype", "fp8", "--max-context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "KV pool" in out and "576 B/token/layer (fp8)" in out
    assert cli.main(["plan", "--kv-dtype", "bf16", "--max-context", "32768", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token_layer"] == 1152 and plan["num_layers"] == 61
    assert plan["kv_tokens"] == (plan["num_pages"] - 1) * plan["page_size"]


def test_plan_refuses_with_exit_status_2(capsys):
    assert cli.main(["plan", "--weight-dtype", "bf16"]) == 2
    assert "weights" in capsys.readouterr().err


def _one_line_error(capsys, *words) -> None:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert "Traceback" not in captured.err and captured.out == ""
    assert "error:" in lines[-1] and all(w in lines[-1] for w in words), (words, captured.err)


def test_plan_refuses_a_page_size_not_a_power_of_2(capsys):
    assert cli.main(["plan", "--page-size", "3"]) == 2
    _one_line_error(capsys, "--page-size", "3")
    assert cli.main(["plan", "--no-such-flag"]) == 2
    _one_line_error(capsys, "--no-such-flag", "mla-fa3 plan --help")


def test_plan_of_a_checkpoint_takes_its_weight_dtype_and_context(tmp_path, capsys):
    """A float32 checkpoint of max_position_embeddings 256 is planned as float32 weights and 256-token requests,
    unless the flags say otherwise."""
    path = save_hf_checkpoint(random_hf_model("tiny_v3", seed=1), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert cli.main(["plan", "--checkpoint", path, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weight_dtype"] == "fp32" and plan["max_context"] == config["max_position_embeddings"]
    assert cli.main(["plan", "--checkpoint", path, "--json", "--weight-dtype", "fp8", "--max-context", "128"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weight_dtype"] == "fp8" and plan["max_context"] == 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("bench", ["serve", "prefill"])
def test_bench_on_cuda_without_cuda_is_one_line(bench, capsys):
    assert cli.main(["bench", bench, "--device", "cuda"]) == 2
    _one_line_error(capsys, "--device cuda", "CUDA is not available")


def test_bench_serve_refuses_a_bad_page_size_before_building_anything(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the error")
    monkeypatch.setattr(bench_serve, "random_model", refuse)
    for argv in (["--page-size", "3"], ["--compare", "page_size=16,3"]):
        assert cli.main(["bench", "serve", "--device", "cpu", *argv]) == 2
        _one_line_error(capsys, "--page-size" if argv[0] == "--page-size" else "--compare", "3")


SMALL_SERVE = ["bench", "serve", "--device", "cpu", "--num-requests", "2", "--prompt-len", "8", "--output-len", "3"]


def test_bench_serve_bar_on_a_terminal_only_and_it_names_the_reference(monkeypatch, capsys):
    """No progress bar when stderr is not a terminal (a bar on one); on a CPU the kernels row names the torch
    reference that ran, not the kernel it stands in for."""
    assert cli.main(SMALL_SERVE) == 0  # capsys: not a terminal
    captured = capsys.readouterr()
    assert "req" not in captured.err and "%|" not in captured.err
    kernels = next(line for line in captured.out.splitlines() if line.startswith("kernels/paths"))
    assert "/reference:" in kernels and "/fa3" not in kernels and "/flashmla" not in kernels
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.main(SMALL_SERVE) == 0
    assert "2/2" in capsys.readouterr().err


def test_bench_serve_cpu_smoke_end_to_end(tmp_path, capsys):
    out = tmp_path / "serve"
    assert cli.main(["bench", "serve", "--device", "cpu", "--quiet", "--num-requests", "6", "--prompt-len", "8-40",
                     "--output-len", "2-9", "--token-budget", "24", "--compare", "decode_kernel=fa3,auto",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(SMOKE_LABEL + "\n") and "decode_kernel=fa3" in text and "TTFT p99 ms" in text
    report = json.loads((out / "serve.json").read_text())
    assert report["cpu_smoke"] and len(report["runs"]) == 2
    from mla_fa3.bench.serve import Workload, make_requests

    w = report["workload"]
    expected = make_requests(Workload(w["num_requests"], tuple(w["prompt_len"]), tuple(w["output_len"]),
                                      w["request_rate"], w["seed"], w["vocab_size"]))
    for run in report["runs"]:
        s, reqs, steps = run["summary"], run["requests"], run["steps"]
        assert s["requests"] == len(reqs) == 6
        # token counts add up: prompts as generated, every request ran to max_new_tokens (no EOS)
        assert sorted((r["prompt_tokens"], r["output_tokens"]) for r in reqs) == \
            sorted((len(e.prompt), e.max_new_tokens) for e in expected)
        assert s["input_tokens"] == sum(len(e.prompt) for e in expected)
        assert s["output_tokens"] == sum(e.max_new_tokens for e in expected)
        # every prompt token and every sampled token's input went through a step exactly once
        assert sum(st["prefill_tokens"] for st in steps) + sum(st["decode_rows"] for st in steps) == \
            s["input_tokens"] + s["output_tokens"] - s["requests"] + run_recomputed(reqs, steps)
        assert all(st["num_tokens"] <= 24 for st in steps)
        for r in reqs:
            assert 0 <= r["ttft_s"] <= r["e2e_s"]
        assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"] + 1e-9
        assert sum(s["kernels"].values()) == s["steps"] == len(steps)
    rows = list(csv.DictReader(open(out / "serve_requests.csv")))
    assert len(rows) == 12
    assert (out / "serve_steps.csv").exists()
    pytest.importorskip("matplotlib")
    assert (out / "serve_latency.png").stat().st_size > 0 and (out / "serve_timeline.png").stat().st_size > 0


def run_recomputed(reqs, steps) -> int:
    """Tokens computed again after preemptions (none in a pool sized for every request)."""
    assert sum(r["preemptions"] for r in reqs) == 0
    return 0
