"""HF checkpoint directory -> :class:`~mla_fa3.models.deepseek.DeepseekForCausalLM`.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). Names are HF's:

- ``model.layers.{i}.self_attn.*``, ``model.layers.{i}.mlp.*``, norms, ``model.embed_tokens.weight``,
  ``model.norm.weight``, ``lm_head.weight`` map one to one onto our parameters;
- routed experts ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (DeepSeek's own
  layout) fill slices of our stacked ``mlp.w_gate_up [E, 2I, D]`` (gate rows, then up rows) and
  ``mlp.w_down [E, D, I]``; transformers' fused in-memory layout (``mlp.experts.gate_up_proj`` /
  ``mlp.experts.down_proj``) is accepted too;
- FP8 weights (float8_e4m3fn) come with ``<name>_scale_inv`` block scales and are dequantized at load
  (``models/fp8.py``, blocks from ``quantization_config.weight_block_size``);
- per-layer FP8 KV-cache scales (one float per layer, shape ``[]`` or ``[1]``) under any one of
  ``model.layers.{i}.self_attn.kv_scale``, ``model.layers.{i}.self_attn.k_scale`` or
  ``model.layers.{i}.self_attn.attn.k_scale`` (:data:`KV_SCALE_NAMES`) land on ``model.kv_scales``
  (a list, None when the checkpoint carries none); all layers or none, finite and > 0;
- tensors of layers ``>= num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer
  ``model.layers.{N}``) and ``rotary_emb.inv_freq`` buffers are ignored on purpose.

Every name and shape is checked against the model *before* any tensor data is read; a missing,
unexpected or mis-shaped tensor raises :class:`CheckpointError` naming it. So do unreadable files: a
truncated or corrupt ``.safetensors`` file, bad JSON in ``config.json`` / the index /
``generation_config.json``, a config without ``model_type`` — each error names the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import Tensor

from mla_fa3.models.deepseek import DeepseekConfig, DeepseekForCausalLM
from mla_fa3.models.fp8 import FP8_DTYPE, dequantize_block_fp8

__all__ = ["CheckpointError", "read_config", "read_json", "eos_token_ids", "checkpoint_files", "check_checkpoint",
           "iter_checkpoint_tensors", "load_model", "KV_SCALE_NAMES"]

LoadProgress = Callable[[str, int, int], None]  # ("load", tensors copied, tensors in all)
KV_SCALE_NAMES = ("self_attn.kv_scale", "self_attn.k_scale", "self_attn.attn.k_scale")  # after model.layers.{i}.

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SCALE_SUFFIX = "_scale_inv"
_FP8_NAMES = {"F8_E4M3"}  # safetensors dtype string of float8_e4m3fn


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; ``names`` lists the offending tensors."""

    def __init__(self, message: str, names: list[str] | None = None) -> None:
        super().__init__(message)
        self.names = list(names or [])


def read_json(file: str) -> dict:
    """A JSON object from ``file``; CheckpointError naming the file when it is not one."""
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config(path: str) -> tuple[DeepseekConfig, dict]:
    """``config.json`` of a checkpoint dir -> (DeepseekConfig, the raw dict); errors name the file."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"path must be a checkpoint directory with config.json, none at {cfg_path}")
    raw = read_json(cfg_path)
    if not raw.get("model_type"):
        raise CheckpointError(f"{cfg_path} has no model_type; refusing to guess the architecture "
                              "(expected deepseek_v2, deepseek_v3 or kimi_k2)")
    try:
        return DeepseekConfig.from_hf(raw), raw
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from exc


def eos_token_ids(path: str, raw_config: dict) -> list[int]:
    """The EOS ids generation stops at: ``generation_config.json``'s ``eos_token_id`` when the file exists
    (as transformers does), else ``config.json``'s; an int or a list in either; [] when unset."""
    gen_path = os.path.join(path, "generation_config.json")
    source, where = (read_json(gen_path), gen_path) if os.path.isfile(gen_path) else (raw_config, "config.json")
    eos = source.get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{where}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def _open(file: str):
    """``safe_open`` that names the file when its header cannot be read (truncated / not safetensors)."""
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # safetensors' SafetensorError is a bare Exception subclass; OSError too
        raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> absolute shard path, from the index or the single ``model.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not os.path.isfile(shard):
                raise CheckpointError(f"shard {os.path.basename(shard)} listed in the index is missing")
        return files
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise CheckpointError(f"path {path} has neither model.safetensors nor model.safetensors.index.json")
    with _open(single) as f:
        return {name: single for name in f.keys()}


@dataclass
class _Meta:
    shape: tuple[int, ...]
    fp8: bool


def _read_meta(files: dict[str, str]) -> dict[str, _Meta]:
    """Shapes and FP8-ness of every tensor, from the safetensors headers only (no data read)."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    meta = {}
    for file, names in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name} is in the index but not in {os.path.basename(file)}",
                                          [name])
                sl = f.get_slice(name)
                meta[name] = _Meta(tuple(sl.get_shape()), sl.get_dtype() in _FP8_NAMES)
    return meta


def _kv_scale_layer(name: str) -> int | None:
    """The layer of a per-layer KV-cache scale tensor name, else None."""
    m = _LAYER.match(name)
    if m and name[m.end():] in KV_SCALE_NAMES:
        return int(m.group(1))
    return None


def _kv_scale_names(meta: dict[str, "_Meta"], cfg: DeepseekConfig) -> dict[int, str]:
    """layer -> its KV-scale tensor name; all layers or none, one name per layer, one element each."""
    found: dict[int, str] = {}
    for name in sorted(meta):
        layer = _kv_scale_layer(name)
        if layer is None or layer >= cfg.num_hidden_layers:
            continue
        if layer in found:
            raise CheckpointError(f"layer {layer} has two KV scales: {found[layer]} and {name}", [found[layer], name])
        if math.prod(meta[name].shape) != 1:
            raise CheckpointError(f"{name} must hold one float (per-tensor KV scale), got shape "
                                  f"{list(meta[name].shape)}", [name])
        found[layer] = name
    if found and len(found) != cfg.num_hidden_layers:
        missing = [f"model.layers.{i}.{KV_SCALE_NAMES[0]}" for i in range(cfg.num_hidden_layers) if i not in found]
        raise CheckpointError(f"KV scales are given for {len(found)} of {cfg.num_hidden_layers} layers; missing: "
                              f"{', '.join(missing[:5])}", missing)
    return found


def _read_kv_scales(path: str, names: dict[int, str]) -> list[float] | None:
    """The per-layer KV scales (checked finite and > 0), or None when the checkpoint has none."""
    if not names:
        return None
    files, out = checkpoint_files(path), []
    for layer in sorted(names):
        name = names[layer]
        with safe_open(files[name], framework="pt") as f:
            value = float(f.get_tensor(name).float().reshape(-1)[0])
        if not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{name} must be a finite float > 0, got {value}", [name])
        out.append(value)
    return out


def _is_ignored(name: str, cfg: DeepseekConfig) -> bool:
    if _kv_scale_layer(name) is not None:
        return True  # read separately (_read_kv_scales)
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return True  # MTP / extra layers beyond the decoder stack
    return name.endswith("rotary_emb.inv_freq")


def _block_size(raw_config: dict) -> tuple[int, int]:
    qc = raw_config.get("quantization_config") or {}
    block = qc.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def iter_checkpoint_tensors(path: str, cfg: DeepseekConfig, raw_config: dict, *,
                            dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, CPU tensor) for every used tensor: FP8 weights dequantized to ``dtype``, the
    others as stored (the caller casts; router weights are meant to stay float32)."""
    files = checkpoint_files(path)
    block = _block_size(raw_config)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in files.items():
        if not name.endswith(_SCALE_SUFFIX) and not _is_ignored(name, cfg):
            by_file[file].append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                t = f.get_tensor(name)
                if t.dtype == FP8_DTYPE:
                    scale_name = name + _SCALE_SUFFIX
                    if scale_name not in files:
                        raise CheckpointError(f"{scale_name} missing for the FP8 tensor {name}", [scale_name])
                    with _open(files[scale_name]) as fs:
                        scale = fs.get_tensor(scale_name)
                    try:
                        t = dequantize_block_fp8(t, scale, block, dtype=dtype)
                    except (ValueError, TypeError) as exc:
                        raise CheckpointError(f"{scale_name}: {exc}", [scale_name]) from exc
                yield name, t


def _plan(model: DeepseekForCausalLM) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """HF name -> destination tensor (a parameter, buffer or a slice of the stacked experts), and
    fused-expert name -> the per-expert names it stands for."""
    cfg = model.config
    dest: dict[str, Tensor] = {}
    fused_alt: dict[str, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith((".w_gate_up", ".w_down")):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        dest[name] = t.data
    I = cfg.moe_intermediate_size
    for i, layer in enumerate(model.model.layers):
        if not cfg.is_moe_layer(i):
            continue
        prefix, mlp = f"model.layers.{i}.mlp", layer.mlp
        gate_up, down = [], []
        for e in range(cfg.n_routed_experts):
            dest[f"{prefix}.experts.{e}.gate_proj.weight"] = mlp.w_gate_up.data[e, :I]
            dest[f"{prefix}.experts.{e}.up_proj.weight"] = mlp.w_gate_up.data[e, I:]
            dest[f"{prefix}.experts.{e}.down_proj.weight"] = mlp.w_down.data[e]
            gate_up += [f"{prefix}.experts.{e}.gate_proj.weight", f"{prefix}.experts.{e}.up_proj.weight"]
            down.append(f"{prefix}.experts.{e}.down_proj.weight")
        dest[f"{prefix}.experts.gate_up_proj"] = mlp.w_gate_up.data
        dest[f"{prefix}.experts.down_proj"] = mlp.w_down.data
        fused_alt[f"{prefix}.experts.gate_up_proj"] = gate_up
        fused_alt[f"{prefix}.experts.down_proj"] = down
    return dest, fused_alt


def _check_names_and_shapes(meta: dict[str, _Meta], dest: dict[str, Tensor], fused_alt: dict[str, list[str]],
                            cfg: DeepseekConfig, block: tuple[int, int]) -> None:
    present = {n for n in meta if not _is_ignored(n, cfg)}
    scales = {n for n in present if n.endswith(_SCALE_SUFFIX)}
    weights = present - scales
    unexpected = sorted(n for n in weights if n not in dest)
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in the checkpoint: {', '.join(unexpected[:5])}", unexpected)
    covered = set(weights)
    for fused, parts in fused_alt.items():
        if fused in weights:
            covered.update(parts)
    required = set(dest) - set(fused_alt)
    missing = sorted(required - covered)
    if missing:
        raise CheckpointError(f"missing tensor(s) in the checkpoint: {', '.join(missing[:5])}", missing)
    for name in sorted(weights):
        want, got = tuple(dest[name].shape), meta[name].shape
        if got != want:
            raise CheckpointError(f"{name} has shape {list(got)}, the model expects {list(want)}", [name])
        scale_name = name + _SCALE_SUFFIX
        if meta[name].fp8:
            if scale_name not in scales:
                raise CheckpointError(f"{scale_name} missing for the FP8 tensor {name}", [scale_name])
            if len(want) != 2:
                raise CheckpointError(f"{name} is FP8 but not a 2-D weight", [name])
            want_s = tuple(-(-d // b) for d, b in zip(want, block))
            if meta[scale_name].shape != want_s:
                raise CheckpointError(f"{scale_name} has shape {list(meta[scale_name].shape)}, expected "
                                      f"{list(want_s)} for blocks {list(block)}", [scale_name])
    orphans = sorted(s for s in scales if s[: -len(_SCALE_SUFFIX)] not in weights
                     or not meta[s[: -len(_SCALE_SUFFIX)]].fp8)
    if orphans:
        raise CheckpointError(f"unexpected tensor(s) in the checkpoint: {', '.join(orphans[:5])}", orphans)


def check_checkpoint(path: str) -> tuple[DeepseekConfig, dict]:
    """Read ``config.json`` and every safetensors header of ``path`` (no tensor data): (config, raw dict).

    Raises CheckpointError naming the file that cannot be read. ``load_model`` does the same and more
    (names and shapes against the model); this is the cheap early check for callers that load elsewhere."""
    cfg, raw = read_config(path)
    _read_meta(checkpoint_files(path))
    return cfg, raw


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               config: DeepseekConfig | None = None, progress: LoadProgress | None = None) -> DeepseekForCausalLM:
    """Build the model of ``path/config.json`` and load its weights (FP8 dequantized to ``dtype``).

    Returns the model in eval mode with every layer's AttentionLayer prepared (W_UK / W_UV derived) and
    ``model.kv_scales`` (per-layer FP8 KV-cache scales from the checkpoint, or None).
    Raises CheckpointError (a ValueError) naming the first offending tensor or unreadable file.
    ``progress("load", i, n)`` is called after each of the n tensors is copied (the CLI draws a bar).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    cfg, raw = read_config(path)
    if config is not None:
        cfg = config
    device = torch.device(device)
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.rotary.reset_buffers()
    dest, fused_alt = _plan(model)
    block = _block_size(raw)
    meta = _read_meta(checkpoint_files(path))
    _check_names_and_shapes(meta, dest, fused_alt, cfg, block)
    total = sum(1 for n in meta if not n.endswith(_SCALE_SUFFIX) and not _is_ignored(n, cfg))
    model.kv_scales = _read_kv_scales(path, _kv_scale_names(meta, cfg))  # FP8 latent-cache scales or None
    with torch.no_grad():
        for i, (name, t) in enumerate(iter_checkpoint_tensors(path, cfg, raw, dtype=dtype)):
            dest[name].copy_(t)
            if progress is not None:
                progress("load", i + 1, total)
    model.eval()
    model.prepare_attention()
    return model
