"""The HF checkpoint loader: FP8 block dequantization, shards, MTP layers, corrupted checkpoints.

Oracles: FP8 — the test quantizes the weights itself (e4m3, 128x128 blocks, ``scale = amax / 448``,
written here independently of ``models/fp8.py``), dequantizes them in float64 and builds a plain
float32 checkpoint from the result; the model loaded from the FP8 checkpoint must equal the model
loaded from that one (weights exactly — an fp32 product of an e4m3 value and an fp32 scale is exact
in fp64 and correctly rounded once — and logits). Corruptions must raise CheckpointError naming
the tensor.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_fa3.batch import ForwardBatch
from mla_fa3.kv.pools import MLATokenPool
from mla_fa3.kv.allocator import PagedAllocator
from mla_fa3.kv.req_to_token import ReqToTokenPool
from mla_fa3.backend import MLABackend
from mla_fa3.models.fp8 import dequantize_block_fp8
from mla_fa3.models.loader import CheckpointError, load_model
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

BLOCK = 128
E4M3_MAX = 448.0



@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_v3"))
    return save_hf_checkpoint(random_hf_model("tiny_v3", seed=5), d)


@pytest.fixture(scope="module")
def mla_dims_dir(tmp_path_factory):
    """The real V3 MLA dims: weights of several 128-blocks, with partial edge blocks (hidden 256 + 576...)."""
    d = str(tmp_path_factory.mktemp("v3_mla_dims"))
    return save_hf_checkpoint(random_hf_model("v3_mla_dims", seed=6), d)


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def _rewrite(path: str, edit) -> None:
    """Apply ``edit(dict name -> tensor)`` to the single model.safetensors of ``path``."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _quantize_blocks(w: torch.Tensor):
    """Test-side e4m3 block quantizer: per 128x128 block, scale = amax / 448; q = e4m3(w / scale)."""
    out, inp = w.shape
    nbo, nbi = math.ceil(out / BLOCK), math.ceil(inp / BLOCK)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nbo, nbi, dtype=torch.float32)
    for i in range(nbo):
        for j in range(nbi):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].double()
            s = max(blk.abs().max().item(), 1e-12) / E4M3_MAX
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale[i, j].double()).to(torch.float8_e4m3fn)
    return q, scale


def _dequant_f64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            sl = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            out[sl] = q[sl].double() * scale[i, j].double()
    return out


def _is_fp8_target(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3 quantizes the linear layers; embeddings, lm_head, norms and the router stay high precision."""
    return (t.dim() == 2 and name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")) \
        and "embed" not in name and "lm_head" not in name and not name.endswith("mlp.gate.weight")


@pytest.fixture(scope="module")
def fp8_pair(mla_dims_dir, tmp_path_factory):
    """(FP8 checkpoint dir, float32 checkpoint dir of the same weights dequantized in float64)."""
    fp8_dir = _copy(mla_dims_dir, tmp_path_factory.mktemp("x") / "fp8")
    deq_dir = _copy(mla_dims_dir, tmp_path_factory.mktemp("x") / "deq")
    tensors = load_file(os.path.join(mla_dims_dir, "model.safetensors"))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if _is_fp8_target(name, t):
            q, s = _quantize_blocks(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = _dequant_f64(q, s).float()
        else:
            fp8[name] = deq[name] = t
    assert sum(n.endswith("_scale_inv") for n in fp8) >= 10
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(fp8_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    json.dump(cfg, open(cfg_path, "w"))
    return fp8_dir, deq_dir


def _prefill_logits(model, ids):
    cfg = model.config
    r2t = ReqToTokenPool(1, 64, "cpu")
    alloc = PagedAllocator(8, 16, "cpu")
    pool = MLATokenPool(cfg.num_hidden_layers, 8, 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32, "cpu")
    backend = MLABackend(req_to_token_pool=r2t, kv_pool=pool, page_size=16, device="cpu")
    [row] = r2t.alloc(1)
    loc = alloc.alloc_for_request(r2t, row, 0, len(ids))
    batch = ForwardBatch.extend([row], [0], [len(ids)], loc, "cpu")
    backend.init_forward_metadata(batch)
    return model(torch.tensor(ids), batch.positions, batch, backend)


def test_fp8_checkpoint_equals_dequantized_weights(fp8_pair):
    fp8_dir, deq_dir = fp8_pair
    m8, mref = load_model(fp8_dir), load_model(deq_dir)
    ref_params = dict(mref.named_parameters())
    for name, p in m8.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    for a, b in zip(m8.attention_layers, mref.attention_layers):  # W_UK / W_UV derived from the dequantized kv_b
        assert torch.equal(a.mla_weights.w_uk, b.mla_weights.w_uk)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.testing.assert_close(_prefill_logits(m8, ids), _prefill_logits(mref, ids), rtol=0, atol=0)


def test_fp8_dequant_partial_blocks_vs_elementwise_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)
    q, s = _quantize_blocks(w)
    got = dequantize_block_fp8(q, s, (BLOCK, BLOCK))
    want = torch.empty(200, 300, dtype=torch.float64)
    for i in range(200):  # W[i, j] = q[i, j] * s[i // 128, j // 128], written out per row
        want[i] = q[i].double() * s[i // BLOCK].double().repeat_interleave(BLOCK)[:300]
    assert torch.equal(got, want.float())
    assert (got - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits
    with pytest.raises(ValueError, match="weight_scale_inv"):
        dequantize_block_fp8(q, s[:, :2], (BLOCK, BLOCK))
    with pytest.raises(TypeError, match="weight"):
        dequantize_block_fp8(w, s, (BLOCK, BLOCK))


def test_sharded_checkpoint_with_mtp_layer_loads_like_single_file(tiny_dir, tmp_path):
    """Shards + index; DeepSeek-V3's MTP layer model.layers.{N}.* is present and ignored."""
    single = load_model(tiny_dir)
    d = _copy(tiny_dir, tmp_path / "sharded")
    os.remove(os.path.join(d, "model.safetensors"))
    tensors = load_file(os.path.join(tiny_dir, "model.safetensors"))
    n_layers = single.config.num_hidden_layers
    mtp = {k.replace("model.layers.1.", f"model.layers.{n_layers}."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    mtp[f"model.layers.{n_layers}.eh_proj.weight"] = torch.zeros(4, 4)  # MTP-only names too
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": {k: tensors[k] for k in names[: len(names) // 2]},
              "model-00002-of-00002.safetensors": {**{k: tensors[k] for k in names[len(names) // 2:]}, **mtp}}
    weight_map = {}
    for fname, part in shards.items():
        save_file(part, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    sharded = load_model(d)
    for (n1, p1), (n2, p2) in zip(single.named_parameters(), sharded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


CORRUPTIONS = {
    "missing_tensor": (lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"),
                       "model.layers.1.self_attn.kv_b_proj.weight", "missing"),
    "missing_expert": (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
                       "model.layers.2.mlp.experts.3.up_proj.weight", "missing"),
    "wrong_shape": (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 95)}),
                    "model.layers.0.self_attn.o_proj.weight", "shape"),
    "unexpected_tensor": (lambda t: t.update({"model.layers.0.self_attn.mystery.weight": torch.zeros(2)}),
                          "model.layers.0.self_attn.mystery.weight", "unexpected"),
    "fp8_without_scale": (lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                              t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)}),
                          "model.layers.0.mlp.up_proj.weight_scale_inv", "missing"),
    "fp8_scale_wrong_shape": (lambda t: t.update({
        "model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(2, 2)}),
        "model.layers.0.mlp.up_proj.weight_scale_inv", "shape"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_checkpoint_names_the_tensor(case, tiny_dir, tmp_path):
    edit, name, what = CORRUPTIONS[case]
    d = _copy(tiny_dir, tmp_path / case)
    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=what) as info:
        load_model(d)
    assert name in str(info.value)
    assert name in info.value.names
    assert isinstance(info.value, ValueError)


def test_missing_files_raise_checkpoint_error(tmp_path, tiny_dir):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(tmp_path))
    d = _copy(tiny_dir, tmp_path / "noweights")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)
