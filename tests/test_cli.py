"""The ``mla-fa3`` command line: validate (exit status), generate --json (tokens == HF greedy), bench dispatch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_fa3 import cli
from mla_fa3 import hf_compare
from mla_fa3.models.fp8 import quantize_block_fp8
from mla_fa3.models.tiny import TINY_CONFIGS, random_hf_model, save_hf_checkpoint


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()  # the CLI sets 1 thread on CPU
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    hf = random_hf_model("tiny_v2", seed=21)
    return hf, save_hf_checkpoint(hf, str(tmp_path_factory.mktemp("ckpt")))


def test_validate_tiny_default_passes(capsys):
    assert cli.main(["validate", "--quiet", "--steps", "4", "--page-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "greedy tokens identical to transformers: yes" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 4  # one row per step


def test_validate_checkpoint_json(tiny_checkpoint, capsys):
    _, path = tiny_checkpoint
    assert cli.main(["validate", "--quiet", "--checkpoint", path, "--steps", "3", "--json",
                     "--max-prefill-tokens", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["greedy_identical"] and len(report["rows"]) == 4


def test_validate_exit_status_is_nonzero_on_failure(monkeypatch, capsys):
    monkeypatch.setitem(hf_compare.TOLERANCES, torch.float32, (0.0, 1.0, 1.0))  # unreachable: rel err 0
    assert cli.main(["validate", "--quiet", "--steps", "2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_generate_json_equals_transformers_greedy(tiny_checkpoint, capsys):
    hf, path = tiny_checkpoint
    prompt = [5, 17, 200, 3, 99, 42]
    assert cli.main(["generate", "--quiet", "--checkpoint", path, "--prompt-ids", *map(str, prompt),
                     "--max-new-tokens", "10", "--page-size", "1", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["token_ids"]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):  # HF greedy, recomputing the whole sequence each step (no cache)
            seq.append(int(hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert tokens == seq[len(prompt):]


def test_generate_bad_checkpoint_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["generate", "--quiet", "--checkpoint", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_bench_dispatches_argv(monkeypatch):
    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        return 0

    fake = types.ModuleType("mla_fa3.bench.decode")
    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "mla_fa3.bench.decode", fake)
    assert cli.main(["bench", "decode", "--batch", "4", "--heads", "16"]) == 0
    assert seen["argv"] == ["--batch", "4", "--heads", "16"]


def test_validate_fp8_checkpoint(tiny_checkpoint, tmp_path, capsys):
    """An FP8 block-quantized checkpoint: the HF reference is filled with the dequantized tensors."""
    _, path = tiny_checkpoint
    d = tmp_path / "fp8"
    shutil.copytree(path, d)
    tensors = load_file(str(d / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight") and "experts" in n]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8(tensors[name], (128, 128))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["validate", "--quiet", "--checkpoint", str(d), "--steps", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_cli_config_names_match_the_embedded_configs():
    assert set(cli.TINY_NAMES) == set(TINY_CONFIGS)


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "mla_fa3", "validate", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--checkpoint" in out.stdout and "--page-size" in out.stdout
