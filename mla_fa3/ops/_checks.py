"""Primitive argument checks used by ``validate.py`` (as ``chk.<name>``): shapes, dtypes, devices, host scalars.

Each raises ``ValueError`` / ``TypeError`` whose message starts with the argument's name, and reads
only tensor metadata (never values), so none of them syncs the GPU.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


Tensor = torch.Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FA3_HALF_DTYPES = (torch.float16, torch.bfloat16)
FA3_KVCACHE_DTYPES = FA3_HALF_DTYPES + (torch.float8_e4m3fn,)
MERGE_FA3_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the float inputs our Triton kernels take
FA3_MAX_HEAD_DIM = 256  # FA3's largest q/k (and plain v) head dim
FA3_MAX_QV_HEAD_DIM = 512  # largest v head dim FA3 accepts (q/k head dim <= 64: absorbed MLA)
FA3_MIN_QV_V_HEAD_DIM = 256  # FA3 runs qv (absorbed MLA) only for v head dims >= 256
FA3_HINT = "; use impl='reference' for this combination"


def device_of(x, name: str) -> torch.device:
    """The device of tensor argument ``name`` (TypeError when it is not a tensor)."""
    tensor(x, name)
    return x.device


def tensor(x, name: str) -> Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def rank(x: Tensor, name: str, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def floating(x: Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


def int32(x: Tensor, name: str) -> None:
    if x.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def same_device(x: Tensor, name: str, device: torch.device, ref: str) -> None:
    if x.device != device:
        raise ValueError(f"{name} must be on {ref}'s device {device}, got {x.device}")


def same_dtype(x: Tensor, name: str, dtype: torch.dtype, ref: str) -> None:
    if x.dtype != dtype:
        raise ValueError(f"{name} dtype must match {ref} dtype {dtype}, got {x.dtype}")


def attention_operands(q: Tensor, k: Tensor, v: Tensor, k_name: str, v_name: str, *, dtype_ref: str) -> None:
    """``k`` and ``v`` on q's device, and q, k, v of one dtype: with ``dtype_ref="q"`` k then v must match
    q's dtype; with ``dtype_ref=k_name`` v then q must match k's."""
    same_device(k, k_name, q.device, "q")
    same_device(v, v_name, q.device, "q")
    if dtype_ref == "q":
        ref, others = q, ((k, k_name), (v, v_name))
    elif dtype_ref == k_name:
        ref, others = k, ((v, v_name), (q, "q"))
    else:
        raise ValueError(f"dtype_ref must be 'q' or {k_name!r}, got {dtype_ref!r}")
    for x, name in others:
        same_dtype(x, name, ref.dtype, dtype_ref)


def index_tensor(x, name: str, ndim: int, layout: str, device: torch.device) -> Tensor:
    """An int32 lengths / offsets / page-id tensor of rank ``ndim`` on ``device``."""
    tensor(x, name)
    rank(x, name, ndim, layout)
    int32(x, name)
    same_device(x, name, device, "q")
    return x


def host_int(x, name: str, minimum: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be a host int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def last_dim_contiguous(x: Tensor, name: str, kernel: str = "FA3") -> None:
    """A contiguous last dimension (the other strides free): the row layout ``kernel`` reads."""
    if x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension for {kernel}, got strides {x.stride()}")


def window(window_size) -> Tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    left, right = window_size
    for side, val in (("left", left), ("right", right)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"window_size {side} must be an int, got {type(val).__name__}")
        if val < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {val}")
    return int(left), int(right)


def scalar(x, name: str, *, allow_none: bool = False) -> Optional[float]:
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    x = float(x)
    if not x == x or x in (float("inf"), float("-inf")):  # NaN / inf
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def softcap(softcap) -> float:
    cap = scalar(softcap, "softcap")
    if cap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {cap}")
    return cap


def flag(x, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype in FP8_DTYPES else dtype


def descale(x, name: str, shape: tuple, device: torch.device) -> Optional[Tensor]:
    if x is None:
        return None
    tensor(x, name)
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    same_device(x, name, device, "q")
    return x


def descales_fit(dtype: torch.dtype, *, required: tuple, optional: tuple) -> None:
    """fp8 inputs need every ``required`` descale; other dtypes take none of them."""
    if dtype in FP8_DTYPES:
        for x, name in required:
            if x is None:
                raise ValueError(f"{name} is required with {dtype} inputs (pass ones for unit scale)")
        return
    for x, name in required + optional:
        if x is not None:
            raise ValueError(f"{name} is only valid with float8 inputs, got {dtype}")


def fa3_head_dims(d: int, dv: int, dtype: torch.dtype, has_qv: bool) -> None:
    """FA3's head-dim rules (hopper flash_api): alignment, max 256, the two (d, d_v) families, qv."""
    align = 16 if dtype in FP8_DTYPES else 8
    if d % align or d > FA3_MAX_HEAD_DIM:
        raise ValueError(
            f"q head dim must be a multiple of {align} and <= {FA3_MAX_HEAD_DIM} for FA3, got {d}{FA3_HINT}"
        )
    if dv % align:
        raise ValueError(f"v head dim must be a multiple of {align} for FA3, got {dv}{FA3_HINT}")
    if dv != d and not ((128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= FA3_MAX_QV_HEAD_DIM)):
        raise ValueError(
            f"v head dim {dv} with q head dim {d} is not supported by FA3 (a different v head dim needs q/k in "
            f"(128, 192] with v in (96, 128], or q/k <= 64 with v <= 512){FA3_HINT}"
        )
    if dv > FA3_MAX_HEAD_DIM and dtype in FP8_DTYPES:
        raise ValueError(f"v head dim {dv} > 256 requires fp16/bf16 in FA3, got {dtype}{FA3_HINT}")
    if has_qv and d > 64:
        raise ValueError(f"q head dim must be <= 64 when qv is given (FA3), got {d}{FA3_HINT}")
    if has_qv and dv < FA3_MIN_QV_V_HEAD_DIM:
        # sgl-kernel 0.4.5 on the H200: "q_v is only supported for hdim_v >= 256"
        raise ValueError(f"qv needs a v head dim >= {FA3_MIN_QV_V_HEAD_DIM} in FA3, got {dv}{FA3_HINT}")


def seqlens_and_table(page_table, cache_seqlens, device: torch.device) -> Tuple[int, int]:
    index_tensor(page_table, "page_table", 2, "[bs, max_pages]", device)
    index_tensor(cache_seqlens, "cache_seqlens", 1, "[bs]", device)
    bs = cache_seqlens.shape[0]
    if page_table.shape[0] != bs:
        raise ValueError(
            f"page_table must have one row per request ({bs} = len(cache_seqlens)), got {page_table.shape[0]} rows"
        )
    return bs, page_table.shape[1]
