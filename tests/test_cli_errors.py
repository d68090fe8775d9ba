"""Every error a new user can hit in ``mla-fa3 validate`` / ``generate``: one line on stderr that names
the file or flag, exit status 2, and nothing loaded first (``load_model`` is patched to fail if reached
for the errors that can be seen before loading).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mla_fa3 import cli
from mla_fa3.cli import commands
from mla_fa3.models import loader
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_hf_checkpoint(random_hf_model("tiny_v2", seed=3), str(tmp_path_factory.mktemp("ckpt")))


def _truncate(d):
    f = os.path.join(d, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    return f


def _garbage(d):
    f = os.path.join(d, "model.safetensors")
    with open(f, "wb") as fh:
        fh.write(b"this is not a safetensors file")
    return f


def _bad_json(name):
    def edit(d):
        f = os.path.join(d, name)
        with open(f, "w") as fh:
            fh.write('{"model_type": "deepseek_v2", ')
        return f
    return edit


def _no_model_type(d):
    f = os.path.join(d, "config.json")
    cfg = json.load(open(f))
    del cfg["model_type"]
    json.dump(cfg, open(f, "w"))
    return f


def _no_tokenizer(d):
    for name in os.listdir(d):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            os.remove(os.path.join(d, name))
    return "--prompt"


def _no_chat_template(d):
    _no_tokenizer(d)
    from mla_fa3.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer(256)
    tok.chat_template = None
    tok.save_pretrained(d)
    return "--chat"


GEN = ["generate", "--quiet", "--prompt-ids", "1", "2", "3", "--max-new-tokens", "2"]
TEXT = ["generate", "--quiet", "--prompt", "hello world", "--max-new-tokens", "2"]
VAL = ["validate", "--quiet", "--steps", "1"]

# name: (edit of a copy of the checkpoint -> what the message must name (None: a flag in `words`),
#        argv, words the message must hold, whether loading the model is allowed before the error)
CASES = {
    "truncated_safetensors": (_truncate, GEN, ["truncated or corrupt"], False),
    "not_safetensors": (_garbage, GEN, ["truncated or corrupt"], False),
    "truncated_safetensors_validate": (_truncate, VAL, ["truncated or corrupt"], False),
    "bad_config_json": (_bad_json("config.json"), GEN, ["not valid JSON"], False),
    "bad_generation_config_json": (_bad_json("generation_config.json"), GEN, ["not valid JSON"], False),
    "no_model_type": (_no_model_type, GEN, ["model_type"], False),
    "no_model_type_validate": (_no_model_type, VAL, ["model_type"], False),
    "device_cuda_without_cuda": (None, GEN + ["--device", "cuda"], ["--device cuda", "CUDA is not available"], False),
    "device_tpu": (None, GEN + ["--device", "tpu"], ["--device", "'tpu'"], False),
    "cuda_graph_on_cpu": (None, GEN + ["--cuda-graph"], ["--cuda-graph", "--device cuda"], False),
    "cuda_graph_on_cpu_validate": (None, VAL + ["--cuda-graph"], ["--cuda-graph"], False),
    "eos_out_of_vocab": (None, GEN + ["--eos-token-id", "99999"], ["--eos-token-id 99999", "[0, 256)"], False),
    "prompt_id_out_of_vocab": (None, ["generate", "--quiet", "--prompt-ids", "1", "256"], ["--prompt-ids 256"], False),
    "past_max_position": (None, GEN[:-1] + ["300"], ["max_position_embeddings 256", "--allow-past-max-position"],
                          False),
    "abbreviated_flag": (None, ["generate", "--quiet", "--prompt-id", "1"], ["--prompt-id"], False),
    "prompt_and_ids": (None, GEN + ["--prompt", "hello"], ["--prompt", "not allowed with"], False),
    "chat_without_prompt": (None, GEN + ["--chat"], ["--chat needs --prompt"], False),
    "no_tokenizer": (_no_tokenizer, TEXT, ["tokenizer", "--prompt-ids"], False),
    "no_chat_template": (_no_chat_template, TEXT + ["--chat"], ["no chat template"], False),
    "page_size_not_a_power_of_2": (None, GEN + ["--page-size", "3"], ["--page-size", "power of 2", "3"], False),
    "page_size_not_a_power_of_2_validate": (None, VAL + ["--page-size", "12"], ["--page-size", "12"], False),
    "kv_scale_negative": (None, GEN + ["--kv-dtype", "fp8", "--kv-scale", "-1"], ["--kv-scale", "> 0"], False),
    "kv_scale_nan_validate": (None, VAL + ["--kv-dtype", "fp8", "--kv-scale", "nan"], ["--kv-scale", "nan"], False),
    "kv_scale_without_fp8": (None, GEN + ["--kv-scale", "0.5"], ["--kv-scale", "--kv-dtype fp8"], False),
    "flashmla_page_16": (None, GEN + ["--decode-kernel", "flashmla", "--page-size", "16"],
                         ["--decode-kernel flashmla", "--page-size 64"], False),
    "fa3_on_fp8": (None, GEN + ["--decode-kernel", "fa3", "--kv-dtype", "fp8"], ["--decode-kernel fa3", "fp8"],
                   False),
    "unknown_flag": (None, GEN + ["--no-such-flag"], ["--no-such-flag", "mla-fa3 generate --help"], False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error_is_one_line_naming_the_file_or_flag(case, ckpt, tmp_path, monkeypatch, capsys):
    edit, argv, words, may_load = CASES[case]
    d = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, d)
    named = edit(d) if edit is not None else None
    if not may_load:
        def refuse(*args, **kwargs):
            raise AssertionError("the model was loaded before the error")
        monkeypatch.setattr(loader, "load_model", refuse)
    rc = cli.main([*argv, "--checkpoint", d])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert rc == 2, captured.err
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and "Traceback" not in captured.err and captured.out == ""
    for word in words + ([named] if named else []):
        assert word in lines[0], (word, lines[0])


def test_past_max_position_allowed_with_the_flag_and_a_warning(ckpt, capsys):
    prompt = [str(i % 200) for i in range(250)]  # 250 + 10 > max_position_embeddings 256
    rc = cli.main(["generate", "--checkpoint", ckpt, "--prompt-ids", *prompt, "--max-new-tokens", "10",
                   "--allow-past-max-position", "--json"])
    captured = capsys.readouterr()
    assert rc == 0 and len(json.loads(captured.out)["token_ids"]) == 10
    assert "past max_position_embeddings 256" in captured.err


def test_engine_refuses_past_max_position(ckpt):
    from mla_fa3.serve.engine import Engine

    model = loader.load_model(ckpt)
    with pytest.raises(ValueError, match="max_position_embeddings 256"):
        Engine(model, max_batch_size=1, max_context=300).generate([[1] * 250], 10)
    with pytest.raises(ValueError, match="eos_token_id"):
        Engine(model, max_batch_size=1, max_context=300).generate([[1]], 2, eos_token_id="2")


def test_loader_errors_name_the_file(ckpt, tmp_path):
    d = str(tmp_path / "c")
    shutil.copytree(ckpt, d)
    f = _truncate(d)
    with pytest.raises(loader.CheckpointError, match="truncated or corrupt") as info:
        loader.load_model(d)
    assert f in str(info.value)
    shutil.rmtree(d)
    shutil.copytree(ckpt, d)
    f = _bad_json("config.json")(d)
    with pytest.raises(loader.CheckpointError, match="not valid JSON") as info:
        loader.read_config(d)
    assert f in str(info.value)


def test_missing_torch_is_a_one_line_hint(monkeypatch, capsys):
    def no_torch(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(commands, "validate", no_torch)
    assert cli.main(["validate"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "torch is not installed" in err and "README" in err


def test_make_stamp_is_per_interpreter(tmp_path):
    """The Makefile's stamp name carries a hash of the interpreter's sys.prefix (a new venv installs again)."""
    import hashlib
    import subprocess
    import sys

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    want = ".venv-stamp-" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    out = subprocess.run(["make", "-n", "-B", "-C", root, "install", f"PYTHON={sys.executable}"],
                         capture_output=True, text=True, timeout=60)  # -n -B: print the recipe, run nothing
    assert out.returncode == 0, out.stderr
    assert f"touch {want}" in out.stdout
    bad = subprocess.run(["make", "-n", "-C", root, "install", f"PYTHON={tmp_path}/no-python"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "make a venv first" in bad.stderr
