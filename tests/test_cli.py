"""The ``mla-fa3`` command line: validate (exit status), generate --json (tokens == HF greedy), text in and
out through the checkpoint's tokenizer (oracle: transformers' tokenizer and model), EOS from
generation_config.json, --help / --version, bench dispatch. Error cases: tests/test_cli_errors.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import mla_fa3
from mla_fa3 import cli
from mla_fa3.cli.parser import TINY_NAMES
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
    assert set(TINY_NAMES) == set(TINY_CONFIGS)


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "mla_fa3", "validate", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--checkpoint" in out.stdout and "--page-size" in out.stdout


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers greedy, recomputing the whole sequence each step (no cache): the new tokens."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_generate_text_in_text_out_equals_transformers(tiny_checkpoint, capsys):
    hf, path = tiny_checkpoint
    text = "Hello world tell me about the latent cache"
    tok = _hf_tokenizer(path)
    prompt = tok(text)["input_ids"]
    assert len(prompt) == 8 and tok.unk_token_id not in prompt  # the tiny tokenizer knows these words
    want = _hf_greedy(hf, prompt, 8)
    assert cli.main(["generate", "--quiet", "--checkpoint", path, "--prompt", text, "--max-new-tokens", "8",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == prompt and out["token_ids"] == want
    assert out["text"] == tok.decode(want, skip_special_tokens=True) and out["text"]
    assert cli.main(["generate", "--quiet", "--checkpoint", path, "--prompt", text, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() == out["text"]  # plain output: the new text only


def test_generate_chat_uses_the_chat_template(tiny_checkpoint, capsys):
    hf, path = tiny_checkpoint
    tok = _hf_tokenizer(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "write a story"}], add_generation_prompt=True,
                                  tokenize=True)
    prompt = ids if isinstance(ids, list) else ids["input_ids"]
    assert cli.main(["generate", "--quiet", "--checkpoint", path, "--prompt", "write a story", "--chat",
                     "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == prompt and prompt[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert out["token_ids"] == _hf_greedy(hf, prompt, 5)


def test_generation_config_eos_is_honoured(tiny_checkpoint, tmp_path, capsys):
    hf, path = tiny_checkpoint
    prompt = [5, 17, 200, 3, 99, 42]
    full = _hf_greedy(hf, prompt, 10)
    eos = full[3]
    d = tmp_path / "eos"
    shutil.copytree(path, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos, 255]}))
    argv = ["generate", "--quiet", "--checkpoint", str(d), "--prompt-ids", *map(str, prompt),
            "--max-new-tokens", "10", "--json"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == full[: full.index(eos) + 1]
    assert cli.main(argv + ["--ignore-eos"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == full
    assert cli.main(argv + ["--eos-token-id", str(full[1])]) == 0  # the flag wins over the file
    assert json.loads(capsys.readouterr().out)["token_ids"] == full[: full.index(full[1]) + 1]


def test_version_and_defaults_in_help(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mla-fa3 {mla_fa3.__version__}"
    assert cli.main(["generate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: 16)" in help_text and "(default: float32)" in help_text and "--prompt TEXT" in help_text


def test_version_is_written_once_and_py_typed_ships():
    import pathlib
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = pathlib.Path(__file__).resolve().parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mla_fa3.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", mla_fa3.__version__)
    assert (root / "mla_fa3" / "py.typed").is_file()
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["mla_fa3"]


def test_progress_bars_only_on_a_terminal(tiny_checkpoint, monkeypatch, capsys):
    """tqdm bars for loading and generation on a TTY; none with --quiet or when stderr is not a TTY."""
    _, path = tiny_checkpoint
    argv = ["generate", "--checkpoint", path, "--prompt-ids", "1", "2", "3", "--max-new-tokens", "5"]
    assert cli.main(argv) == 0  # capsys: not a terminal
    err = capsys.readouterr().err
    assert "decode" not in err and "step" not in err and len(err.splitlines()) <= 1  # at most "loading ..."
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "load:" in err and "decode:" in err and re.search(r"/\d+ \[", err)  # bars with their step totals
    assert cli.main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("config", ["tiny_v3", "tiny_v2"])
def test_checkpoint_command_writes_what_generate_and_transformers_load(config, tmp_path, capsys):
    """``mla-fa3 checkpoint``: the embedded config's random model of --seed, with its tokenizer and
    generation_config; generate on it gives transformers' greedy tokens on the same directory."""
    from transformers import AutoModelForCausalLM

    d = str(tmp_path / "tiny")
    assert cli.main(["checkpoint", "--out", d, "--config", config, "--seed", "7"]) == 0
    assert d in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(d))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("DeepseekV3ForCausalLM" if config == "tiny_v3" else "DeepseekV2ForCausalLM")
    want = dict(random_hf_model(config, seed=7).named_parameters())
    got = dict(hf.named_parameters())
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert cli.main(["generate", "--quiet", "--checkpoint", d, "--prompt-ids", "1", "2", "3", "--max-new-tokens",
                     "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == _hf_greedy(hf, [1, 2, 3], 4)
    text = "tell me about the latent cache"
    assert cli.main(["generate", "--quiet", "--checkpoint", d, "--prompt", text, "--max-new-tokens", "4",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == _hf_tokenizer(d)(text)["input_ids"]


def test_checkpoint_command_refuses_a_directory_in_use(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["checkpoint", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--out" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def _options(help_text: str) -> dict[str, str]:
    """Option -> its help text, from the "options:" section of argparse's --help."""
    out: dict[str, str] = {}
    current = None
    for line in help_text.split("\noptions:\n", 1)[1].splitlines():
        head = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if head:
            current = head.group(1).split()[0].rstrip(",")
            out[current] = head.group(2) or ""
        elif current and line.strip():
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


@pytest.mark.parametrize("command", ["checkpoint", "validate", "generate", "plan"])
def test_help_states_each_default_once_and_every_flag_has_help(command, capsys):
    assert cli.main([command, "--help"]) == 0
    options = _options(capsys.readouterr().out)
    assert len(options) > 2
    for flag, text in options.items():
        assert text, f"{flag} has no help"
        assert "(default: None)" not in text and "(default: False)" not in text, (flag, text)
        assert text.count("default") <= 1, (flag, text)
    if command == "generate":
        assert "default" not in options["--checkpoint"]  # required
        assert all(key in options["--json"] for key in ('"token_ids"', '"text"', '"prompt_ids"'))


def test_validate_shows_no_transformers_bars_off_a_terminal(tiny_checkpoint, capsys):
    """transformers' own "Loading weights" bar follows ours: none with --quiet, none when stderr is not a TTY."""
    from transformers.utils import logging as hf_logging

    _, path = tiny_checkpoint
    before = hf_logging.is_progress_bar_enabled()
    assert cli.main(["validate", "--quiet", "--checkpoint", path, "--steps", "1"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["validate", "--checkpoint", path, "--steps", "1"]) == 0  # capsys: not a terminal
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err and "loading" in err  # the log lines stay
    assert hf_logging.is_progress_bar_enabled() == before
