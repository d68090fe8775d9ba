"""``validate`` on an FP8 block-scaled checkpoint: the transformers reference is dequantized independently of our
loader, so a wrong dequantization in the loader makes validate FAIL (it used to be copied into the reference).

The checkpoint quantizes every projection (attention, dense and expert MLPs) in blocks of [16, 32], so that
each weight has several blocks in both directions, partial ones at the edges. Oracles: the block formula
worked element by element in the test (for the reference's dequantizer), transformers' model filled with it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mla_fa3.models.loader as loader
from mla_fa3.hf_compare import dequantize_blocks, format_report, run_validate
from mla_fa3.models.fp8 import dequantize_block_fp8, quantize_block_fp8
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

BLOCK = (16, 32)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = save_hf_checkpoint(random_hf_model("tiny_v3", seed=4), str(tmp_path_factory.mktemp("fp8")))
    tensors = load_file(f"{path}/model.safetensors")
    for name in [n for n in tensors if n.endswith(("proj.weight", "proj_with_mqa.weight"))]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8(tensors[name], BLOCK)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return path, tensors


def test_the_reference_dequantizes_blocks_element_by_element(fp8_checkpoint):
    _, tensors = fp8_checkpoint
    q, s = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"], \
        tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert q.shape == (48, 64) and s.shape == (3, 2)
    want = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            want[i, j] = float(q[i, j].float()) * float(s[i // BLOCK[0], j // BLOCK[1]])
    # e4m3 (4 significant bits) x float32 (24) is exact in float64: the float32 result is that, rounded once
    assert torch.equal(dequantize_blocks(q, s, BLOCK), want.float())


def _rolled_scales(weight, scale_inv, block_size=(128, 128), *, dtype=torch.float32):
    """A plausible indexing slip: each block takes the scale of its neighbour along the input dimension."""
    return dequantize_block_fp8(weight, scale_inv.roll(1, dims=1), block_size, dtype=dtype)


@pytest.mark.parametrize("planted", [False, True])
def test_a_wrong_dequantization_in_our_loader_fails_validate(fp8_checkpoint, planted, monkeypatch):
    path, _ = fp8_checkpoint
    if planted:  # our loader only: were the reference filled through it, both would agree and validate would pass
        monkeypatch.setattr(loader, "dequantize_block_fp8", _rolled_scales)
    report = run_validate(path, steps=2, prompt_lengths=(6, 4), page_size=4)
    assert report.passed is not planted
    assert ("FAIL" if planted else "PASS") in format_report(report).splitlines()[-1]
    if planted:
        assert max(r.rel for r in report.rows) > 1e-2  # far outside fp32 rounding
    else:
        assert max(r.rel for r in report.rows) < 1e-5



def test_a_checkpoint_without_weight_block_size_reads_as_blocks_of_128(tmp_path):
    """A block-FP8 config that omits ``weight_block_size`` means DeepSeek's [128, 128] (transformers' default): the
    reference's weight is the block formula at [128, 128], worked element by element here (the tiny weights are
    smaller than one block: one scale each)."""
    from mla_fa3.hf_compare import hf_reference_model

    path = save_hf_checkpoint(random_hf_model("tiny_v3", seed=5), str(tmp_path))
    tensors = load_file(f"{path}/model.safetensors")
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8(tensors[name], (128, 128))
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8"}  # no weight_block_size
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    q, s = tensors[name], tensors[name + "_scale_inv"]
    assert s.shape == (1, 1)
    want = q.double() * float(s[0, 0])
    got = dict(hf_reference_model(path).named_parameters())[name]
    assert torch.equal(got.detach(), want.float())  # exact in float64, rounded once to the model's float32
