"""transformers' own model of a checkpoint, the reference of ``mla-fa3 validate``, independent of our loader.

A plain checkpoint loads through ``from_pretrained`` (float32, eager attention). An FP8 block-scaled
checkpoint (``quantization_config.quant_method == "fp8"``) is not read through transformers' FP8 path (it
needs ``accelerate``, not a dependency here, and takes the block size from the scale grid's shape, which a
partial edge block breaks), so the reference is built from the config and filled here, with nothing of
``mla_fa3.models.loader`` / ``models.fp8`` on the way: the tensors are read
with ``safetensors`` itself (the index or the single file) and a quantized weight ``q`` [out, in] with its
``weight_scale_inv`` ``s`` [ceil(out / bo), ceil(in / bi)] (blocks ``[bo, bi]`` from
``quantization_config.weight_block_size``) becomes

    W[i, j] = float32(q[i, j]) * s[i // bo, j // bi]          (written below as a gather of s by block index)

so a wrong dequantization in our loader shows up as a difference from this reference instead of being
copied into it. HF's parameter names are filled one to one (per-expert weights stacked where transformers
fuses them).
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors import safe_open

from mla_fa3.models.loader import CheckpointError

__all__ = ["hf_reference_model", "dequantize_blocks", "read_reference_tensors", "teacher_forced_logits"]

_SCALE = "_scale_inv"


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"
                      ) -> torch.Tensor:
    """``q`` [out, in] (e4m3) and its block scales -> float32 [out, in]: ``q[i, j] · s[i // bo, j // bi]``."""
    bo, bi = block
    out, inp = q.shape
    want = (math.ceil(out / bo), math.ceil(inp / bi))
    if q.dim() != 2 or tuple(scale_inv.shape) != want:
        raise CheckpointError(f"{name}{_SCALE} has shape {list(scale_inv.shape)}; a weight of shape {list(q.shape)} "
                              f"in blocks {[bo, bi]} needs {list(want)}", [name + _SCALE])
    block_row = torch.arange(out) // bo  # [out]: the block row of each weight row
    block_col = torch.arange(inp) // bi  # [in]
    return q.to(torch.float32) * scale_inv.to(torch.float32)[block_row[:, None], block_col[None, :]]


def _files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from ``model.safetensors.index.json`` or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, shard) for name, shard in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def read_reference_tensors(path: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as float32 (HF names), e4m3 weights dequantized by :func:`dequantize_blocks`;
    the ``*_scale_inv`` tensors are consumed, not returned."""
    files = _files(path)
    raw: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            raw.update((name, f.get_tensor(name)) for name in f.keys())
    out = {}
    for name, t in raw.items():
        if name.endswith(_SCALE):
            continue
        if t.dtype == torch.float8_e4m3fn:
            if name + _SCALE not in raw:
                raise CheckpointError(f"{name + _SCALE} missing for the FP8 tensor {name}", [name + _SCALE])
            t = dequantize_blocks(t, raw[name + _SCALE], block, name)
        out[name] = t.to(torch.float32)
    return out


def _fill(hf_model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors (HF names) into an HF model, stacking per-expert weights if it fuses them."""
    with torch.no_grad():
        for name, dest in hf_model.state_dict().items():
            if name in tensors:
                dest.copy_(tensors[name])
            elif name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                prefix = name.rsplit(".", 1)[0]
                parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
                for e in range(dest.shape[0]):
                    dest[e].copy_(torch.cat([tensors[f"{prefix}.{e}.{p}.weight"] for p in parts], dim=0))
            elif not name.endswith("rotary_emb.inv_freq"):
                raise CheckpointError(f"the HF reference model needs {name}, not in the checkpoint", [name])


def hf_reference_model(path: str, device: torch.device | str = "cpu"):
    """transformers' model of ``path`` in float32, eager attention (FP8 weights: module docstring)."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config")
    if not quant:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                  dtype=torch.float32)
        return model.to(device).eval()
    if quant.get("quant_method") != "fp8":
        raise CheckpointError(f"{path}/config.json: quantization_config.quant_method "
                              f"{quant.get('quant_method')!r} is not the block-scaled 'fp8' the reference reads")
    block = tuple(int(b) for b in quant.get("weight_block_size") or (128, 128))
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    hf_cfg.quantization_config = None
    hf_cfg.__dict__.pop("quantization_config", None)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    _fill(model, read_reference_tensors(path, block))
    return model.to(device).eval()


def teacher_forced_logits(hf, prompts, token_ids, device) -> list[torch.Tensor]:
    """Per prompt: HF logits [len(prompt) + n_new - 1, V] float32 cpu over prompt + the new tokens (all but
    the last)."""
    out = []
    for p, toks in zip(prompts, token_ids):
        ids = torch.tensor([p + toks[:-1]], device=device)
        out.append(hf(input_ids=ids, use_cache=False).logits[0].float().cpu())
    return out
