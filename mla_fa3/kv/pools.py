"""The per-layer KV token pools, and the page-size / device checks they share with the allocator.

Symbols: ``P`` pages of ``p`` = ``page_size`` slots each (``p`` = 1 or a power of two), so ``S = P * p``
slots; slot ``s`` lives on page ``s // p`` at offset ``s % p``. ``r`` = kv_lora_rank, ``d_rope`` =
qk_rope_head_dim (MLA); ``h_kv``, ``d``, ``d_v`` the KV heads and head dims (regular MHA). Slots come
from ``kv`` (``PagedAllocator``, ``ReqToTokenPool``), which re-exports every name here.

- :class:`MLATokenPool` — the latent cache: per layer one ``[S, r + d_rope]`` buffer whose rows are
  ``[c_kv | k_rope]``; ``paged(layer)`` views it as ``[P, p, 1, r + d_rope]`` (one KV head) and
  ``c_kv_paged`` / ``k_rope_paged`` slice the last dim — zero-copy views that FA3 takes as
  ``v_cache`` / ``k_cache`` of the absorbed path; rows stored by ``ops.store_rows`` (one launch on CUDA). Optionally
  FP8 e4m3 with a per-layer per-tensor scale (``ops/fp8.py``; stored by ``ops.store_e4m3``: one fused launch on
  CUDA): half the bytes per token;
  read by FlashMLA's FP8 decode or the split-KV kernel and, dequantized chunk by chunk, by the MHA prefill.
- :class:`MHATokenPool` — regular K/V per layer, optionally FP8 e4m3 with per-layer per-tensor scales:
  stored ``k8 = clamp(k / k_scale, -448, 448)``, read back as ``k8 * k_scale`` (the kernels' descale).

Hot-path rule: nothing here reads a CUDA tensor's value unless ``debug_checks=True``; range checks on
slot indices run on the host when the indices are CPU tensors. A CUDA ``loc`` out of range without
``debug_checks`` is not caught: on CUDA the store's kernel skips such a row (nothing is written past the buffer).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mla_fa3 import ops
from mla_fa3.host import to_device
from mla_fa3.checks import check_int
from mla_fa3.kv.fp8 import check_scale, propose_scale
from mla_fa3.ops.fp8 import FP8_DTYPE, FP8_E4M3_MAX, dequantize_e4m3

__all__ = ["MLATokenPool", "MHATokenPool", "check_page_size", "same_device", "FP8_E4M3_MAX"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_page_size(page_size: int) -> int:
    """``page_size`` must be 1 or a power of two; returns it."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1 \
            or page_size & (page_size - 1):
        raise ValueError(f"page_size must be 1 or a power of two, got {page_size!r}")
    return page_size


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` (the current device) name the same place; tensors report ``cuda:0``."""
    if a == b:  # the common case (two torch.device objects), without constructing anything
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        cur = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index



def _rows_2d(x: Tensor) -> Tensor:
    """x [T, W] as ``ops.store_e4m3`` / ``ops.store_rows`` read it: a contiguous last dim, fp32/fp16/bf16 (others:
    to fp32; a float pool stores others by indexed assignment instead, without this)."""
    if x.dtype not in _FLOAT_DTYPES:
        x = x.float()
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


class _TokenPoolBase:
    """Shared geometry and the ``loc`` / ``layer`` checks of the token pools."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, device: torch.device | str,
                 debug_checks: bool):
        self.num_layers = check_int(num_layers, "num_layers")
        self.num_pages = check_int(num_pages, "num_pages")
        self.page_size = check_page_size(page_size)
        self.num_slots = num_pages * page_size
        self.device = torch.device(device)
        self.debug_checks = debug_checks

    def _buffers(self) -> list[Tensor]:
        raise NotImplementedError

    def clear_pages(self, page_ids) -> None:
        """Zero pages ``page_ids`` (a list or CPU tensor of page ids) in every layer.

        Call it when pages go back to the allocator. FA3 and FlashMLA read whole pages and multiply the
        slots past a sequence's end by a zero probability, so a non-finite value an earlier request left
        there would leak (0 * NaN) into the page's next owner; zeroed free pages keep that tail finite.
        """
        ids = torch.as_tensor(page_ids, dtype=torch.int64).reshape(-1)
        if ids.device.type != "cpu":
            raise ValueError(f"page_ids must be on the CPU (host list or tensor), got {ids.device}")
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.num_pages:
            raise ValueError(f"page_ids must be in [0, {self.num_pages}), got values in [{lo}, {hi}]")
        ids = ids.to(self.device, non_blocking=True)
        for buf in self._buffers():
            raw = buf.view(torch.uint8) if buf.element_size() == 1 else buf  # fp8: all-zero bits = 0.0
            self._paged(raw).index_fill_(0, ids, 0)

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_loc(self, loc: Tensor) -> None:
        """dtype/shape always; value range on the host for CPU ``loc``, or with ``debug_checks`` (syncs)."""
        if not isinstance(loc, Tensor):
            raise TypeError(f"loc must be a torch.Tensor, got {type(loc).__name__}")
        if loc.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"loc must be int64 (or int32), got {loc.dtype}")
        if loc.dim() != 1:
            raise ValueError(f"loc must be 1-D, got shape {tuple(loc.shape)}")
        if loc.device.type != "cpu" and not same_device(loc.device, self.device):
            raise ValueError(f"loc must be on {self.device} (or the CPU), got {loc.device}")
        if loc.numel() and (loc.device.type == "cpu" or self.debug_checks):
            lo, hi = int(loc.min()), int(loc.max())
            if lo < 0 or hi >= self.num_slots:
                raise ValueError(f"loc must be in [0, {self.num_slots}), got values in [{lo}, {hi}]")

    def _check_rows(self, x: object, name: str, rows: int, width: tuple[int, ...]) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
        if tuple(x.shape) != (rows, *width):
            raise ValueError(f"{name} must have shape {(rows, *width)}, got {tuple(x.shape)}")
        if not same_device(x.device, self.device):
            raise ValueError(f"{name} must be on {self.device}, got {x.device}")
        return x

    def _paged(self, buf: Tensor) -> Tensor:
        return buf.view(self.num_pages, self.page_size, *buf.shape[1:])


class MLATokenPool(_TokenPoolBase):
    """Latent KV cache: ``kv_buffer[layer]`` [S, r + d_rope] of ``kv_dtype`` (default ``dtype``).

    ``dtype`` (bf16 / fp16 / fp32) is the compute dtype: what the set methods receive and what
    :meth:`dequantized` gives. ``kv_dtype=torch.float8_e4m3fn`` stores every row quantized
    (``ops/fp8.py``) with a per-layer per-tensor scale ``scale[layer]`` ([1] float32, device; default
    1.0 — set it from the checkpoint or a calibration with :meth:`set_scales`): the stored row is
    ``e4m3(clamp(x / s, ±448))``, read back as ``float(x8) · s``. A non-finite element of a stored row
    is saturated (±inf -> ±448, NaN -> 0: the cache never holds NaN); with ``debug_checks=True`` it
    raises ValueError instead (reads the device), before anything is written.

    Calibration: :meth:`observe_absmax` starts recording each layer's absmax of the rows stored (before
    quantization, device op); :meth:`proposed_scales` turns it into scales (``absmax / 448``).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
                 qk_rope_head_dim: int, dtype: torch.dtype, device: torch.device | str, *,
                 kv_dtype: torch.dtype | None = None, debug_checks: bool = False,
                 kv_buffers: Sequence[Tensor] | None = None):
        """``kv_buffers``: wrap an engine's own per-layer buffers instead of allocating (no copy): one
        ``[num_pages * page_size, r + d_rope]`` tensor of ``kv_dtype`` per layer, contiguous, on ``device``
        (SGLang's ``MLATokenToKVPool.kv_buffer``, viewed; ``integrations.sglang``)."""
        super().__init__(num_layers, num_pages, page_size, device, debug_checks)
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
        if kv_dtype not in (None, FP8_DTYPE, dtype):  # the kernels read the cache in q's dtype, or e4m3
            raise TypeError(f"kv_dtype must be None, torch.float8_e4m3fn or dtype ({dtype}), got {kv_dtype}")
        self.kv_lora_rank = check_int(kv_lora_rank, "kv_lora_rank")
        self.qk_rope_head_dim = check_int(qk_rope_head_dim, "qk_rope_head_dim")
        self.width = kv_lora_rank + qk_rope_head_dim
        self.dtype = dtype  # compute dtype
        self.kv_dtype = kv_dtype or dtype  # storage dtype
        self.is_fp8 = self.kv_dtype == FP8_DTYPE
        if kv_buffers is None:
            self.kv_buffer = [torch.zeros(self.num_slots, self.width, dtype=self.kv_dtype, device=self.device)
                              for _ in range(num_layers)]
        else:
            self.kv_buffer = self._check_buffers(kv_buffers)
        fp8 = self.is_fp8
        # [1] float32 per layer (in-place updates keep CUDA graphs valid); None for a floating pool
        self.scale: list[Tensor] | None = [torch.ones(1, dtype=torch.float32, device=self.device)
                                           for _ in range(num_layers)] if fp8 else None
        self.absmax: Tensor | None = None  # [num_layers] float32 while observing (calibration)

    def _buffers(self) -> list[Tensor]:
        return self.kv_buffer

    def _check_buffers(self, kv_buffers: Sequence[Tensor]) -> list[Tensor]:
        """The wrapped buffers, after checks naming the argument (shape, dtype, device, layout)."""
        bufs = list(kv_buffers)
        if len(bufs) != self.num_layers:
            raise ValueError(f"kv_buffers must hold one buffer per layer ({self.num_layers}), got {len(bufs)}")
        want = (self.num_slots, self.width)
        for i, b in enumerate(bufs):
            if not isinstance(b, Tensor):
                raise TypeError(f"kv_buffers[{i}] must be a torch.Tensor, got {type(b).__name__}")
            if tuple(b.shape) != want:
                raise ValueError(f"kv_buffers[{i}] must be [num_pages * page_size, r + d_rope] = {list(want)}, "
                                 f"got {tuple(b.shape)}")
            if b.dtype != self.kv_dtype:
                raise TypeError(f"kv_buffers[{i}] must be {self.kv_dtype} (the storage dtype), got {b.dtype}")
            if not same_device(b.device, self.device):
                raise ValueError(f"kv_buffers[{i}] must be on {self.device}, got {b.device}")
            if not b.is_contiguous():
                raise ValueError(f"kv_buffers[{i}] must be contiguous (pages are views of it)")
        return bufs

    # ------------------------------------------------------------------ FP8 scales
    def set_scales(self, scales: Sequence[float] | float, layer: int | None = None) -> None:
        """Set the FP8 scales: one float for ``layer``, or one per layer (``layer=None``). In place.

        Raises ValueError for a floating pool and for a missing, non-positive or non-finite scale. Rows
        already stored keep the codes of their old scale: set the scales before the pool holds tokens
        (after a calibration prefill, free its pages and prefill again).
        """
        if not self.is_fp8:
            raise ValueError("scales only exist for a kv_dtype=torch.float8_e4m3fn latent pool")
        if layer is not None:
            self._check_layer(layer)
            values = {layer: check_scale(scales, f"scales (layer {layer})")}
        else:
            if isinstance(scales, (int, float)) or not isinstance(scales, Sequence) or len(scales) != self.num_layers:
                raise ValueError(f"scales must hold one scale per layer ({self.num_layers}), got {scales!r}")
            values = {i: check_scale(v, f"scales[{i}]") for i, v in enumerate(scales)}
        for i, v in values.items():  # all checked before any is written
            self.scale[i].fill_(v)

    def observe_absmax(self, enable: bool = True) -> None:
        """Start (reset to 0) or stop recording each layer's absmax of the stored rows (calibration)."""
        self.absmax = torch.zeros(self.num_layers, dtype=torch.float32, device=self.device) if enable else None

    def proposed_scales(self, headroom: float = 1.0) -> list[float]:
        """Per-layer scales from the observed absmax: ``absmax · headroom / 448`` (reads the device)."""
        if self.absmax is None:
            raise ValueError("no absmax observed: call observe_absmax() and run a prefill first")
        return [propose_scale(a, headroom) for a in self.absmax.tolist()]

    # ------------------------------------------------------------------ store
    def _store(self, layer: int, rows: Tensor, x: Tensor, rest: Tensor | None = None) -> None:
        """buf[rows] = x (whole rows) or [x | rest] (c_kv and k_rope) in the storage dtype (quantized when FP8; the
        absmax observed when calibrating).

        FP8: ``ops.store_e4m3`` — on CUDA one fused Triton launch (divide, saturate, cast, scatter; both parts);
        a float pool: ``ops.store_rows`` (one launch on CUDA, the cast to the storage dtype in it) for fp32 / fp16 /
        bf16 rows."""
        parts = (x,) if rest is None else (x, rest)
        if self.absmax is not None and x.numel():
            a = self.absmax[layer: layer + 1]
            for p in parts:
                torch.maximum(a, p.detach().abs().amax().float().reshape(1), out=a)
        buf = self.kv_buffer[layer]
        if rest is not None and (rest.dtype != x.dtype or x.dtype not in _FLOAT_DTYPES):
            x, rest = torch.cat([x, rest], dim=-1), None  # one row tensor in the promoted dtype (an exact upcast)
        rest = None if rest is None else _rows_2d(rest)
        if self.is_fp8:
            ops.store_e4m3(buf, rows, _rows_2d(x), self.scale[layer], rest=rest)
        elif x.dtype in _FLOAT_DTYPES:
            ops.store_rows(buf, rows, _rows_2d(x), rest=rest)  # the storage dtype (kv_dtype) may differ from dtype
        else:
            buf[rows] = x.to(buf.dtype)

    def _check_finite(self, *named: tuple[str, Tensor]) -> None:
        """FP8 + debug_checks: a non-finite element raises (reads the device) before anything is written."""
        if not (self.is_fp8 and self.debug_checks):
            return
        for name, x in named:
            if x.numel() and not bool(torch.isfinite(x).all()):
                raise ValueError(f"{name} holds non-finite values (NaN/inf); an FP8 latent pool with "
                                 "debug_checks refuses them (without debug_checks they saturate: inf -> ±448·scale, "
                                 "NaN -> 0)")

    def set_kv(self, layer: int, loc: Tensor, c_kv: Tensor, k_rope: Tensor) -> None:
        """Write ``c_kv`` [T, r] and ``k_rope`` [T, d_rope] at slots ``loc`` [T] (cast / quantized)."""
        self._check_layer(layer)
        self._check_loc(loc)
        t = loc.shape[0]
        self._check_rows(c_kv, "c_kv", t, (self.kv_lora_rank,))
        self._check_rows(k_rope, "k_rope", t, (self.qk_rope_head_dim,))
        self._check_finite(("c_kv", c_kv), ("k_rope", k_rope))
        self._store(layer, to_device(loc, self.device, torch.int64), c_kv, k_rope)  # one launch on CUDA

    def set_latent(self, layer: int, loc: Tensor, latent: Tensor) -> None:
        """Write whole rows ``latent`` [T, r + d_rope] (``c_kv | k_rope`` already concatenated)."""
        self._check_layer(layer)
        self._check_loc(loc)
        self._check_rows(latent, "latent", loc.shape[0], (self.width,))
        self._check_finite(("latent", latent))
        self._store(layer, to_device(loc, self.device, torch.int64), latent)

    # ------------------------------------------------------------------ read
    def paged(self, layer: int) -> Tensor:
        """[P, p, 1, r + d_rope] view of the layer's buffer (storage dtype; no copy)."""
        self._check_layer(layer)
        return self._paged(self.kv_buffer[layer]).unsqueeze(2)

    def c_kv_paged(self, layer: int) -> Tensor:
        """[P, p, 1, r] view: the latent part (FA3's ``v_cache`` on the absorbed path)."""
        return self.paged(layer)[..., : self.kv_lora_rank]

    def k_rope_paged(self, layer: int) -> Tensor:
        """[P, p, 1, d_rope] view: the RoPE key part (FA3's ``k_cache`` on the absorbed path)."""
        return self.paged(layer)[..., self.kv_lora_rank:]

    def layer_scale(self, layer: int) -> Tensor | None:
        """The layer's FP8 scale ([1] float32, device; the kernels' descale), None for a floating pool."""
        self._check_layer(layer)
        return None if self.scale is None else self.scale[layer]

    def dequantized(self, layer: int, slots: Sequence[int] | Tensor | None = None) -> Tensor:
        """Rows of the given slots (all when None) in the compute dtype: ``float(x8) · scale`` for FP8."""
        self._check_layer(layer)
        rows = self.kv_buffer[layer]
        if slots is not None:
            rows = rows[to_device(torch.as_tensor(slots, dtype=torch.int64), self.device)]
        if not self.is_fp8:
            return rows.to(self.dtype)
        return dequantize_e4m3(rows, self.scale[layer], self.dtype)


class MHATokenPool(_TokenPoolBase):
    """Regular K/V: ``k_buffer[layer]`` [S, h_kv, d], ``v_buffer[layer]`` [S, h_kv, d_v].

    ``kv_dtype=torch.float8_e4m3fn`` stores ``clamp(x / scale, ±448)`` in e4m3 with per-layer
    per-tensor scales ``k_scale[layer]`` / ``v_scale[layer]`` ([1] float32, device; default 1.0, set
    them from the checkpoint with :meth:`set_scales`). Kernels dequantize with these as descales:
    :meth:`descales` expands them to FA3's ``[bs, h_kv]``. ``k_scale``/``v_scale`` are ``None`` for a
    floating pool.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: torch.dtype | None = None, *, debug_checks: bool = False):
        super().__init__(num_layers, num_pages, page_size, device, debug_checks)
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
        if kv_dtype not in (None, torch.float8_e4m3fn, *_FLOAT_DTYPES):
            raise TypeError(f"kv_dtype must be None, torch.float8_e4m3fn or a float dtype, got {kv_dtype}")
        self.num_kv_heads = check_int(num_kv_heads, "num_kv_heads")
        self.head_dim = check_int(head_dim, "head_dim")
        self.v_head_dim = check_int(v_head_dim, "v_head_dim")
        self.dtype = dtype  # compute dtype (what set_kv receives, what dequantization gives)
        self.kv_dtype = kv_dtype or dtype  # storage dtype
        self.is_fp8 = self.kv_dtype == torch.float8_e4m3fn
        self.k_buffer = [torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=self.kv_dtype,
                                     device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(self.num_slots, num_kv_heads, v_head_dim, dtype=self.kv_dtype,
                                     device=self.device) for _ in range(num_layers)]
        ones = [torch.ones(1, dtype=torch.float32, device=self.device) for _ in range(2 * num_layers)]
        self.k_scale: list[Tensor] | None = ones[:num_layers] if self.is_fp8 else None
        self.v_scale: list[Tensor] | None = ones[num_layers:] if self.is_fp8 else None

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Set the layer's FP8 per-tensor scales (in place: CUDA graphs keep seeing the same tensors)."""
        self._check_layer(layer)
        if not self.is_fp8:
            raise ValueError("k_scale/v_scale only exist for a kv_dtype=torch.float8_e4m3fn pool")
        k_scale, v_scale = check_scale(k_scale, "k_scale"), check_scale(v_scale, "v_scale")
        self.k_scale[layer].fill_(k_scale)
        self.v_scale[layer].fill_(v_scale)

    def descales(self, layer: int, batch_size: int) -> tuple[Tensor, Tensor] | tuple[None, None]:
        """``(k_descale, v_descale)`` as [bs, h_kv] float32 expanded views, or ``(None, None)``."""
        self._check_layer(layer)
        if not self.is_fp8:
            return None, None
        shape = (batch_size, self.num_kv_heads)
        return self.k_scale[layer].expand(shape), self.v_scale[layer].expand(shape)

    def _store(self, buf: Tensor, loc: Tensor, x: Tensor, scale: Tensor | None) -> None:
        """buf[loc] = x in the storage dtype (FP8: ``ops.store_e4m3`` over the flattened heads)."""
        if scale is None:
            buf[loc] = x.to(self.kv_dtype)
            return
        ops.store_e4m3(buf.view(buf.shape[0], -1), loc, _rows_2d(x.reshape(x.shape[0], -1)), scale)

    def _buffers(self) -> list[Tensor]:
        return self.k_buffer + self.v_buffer

    def set_kv(self, layer: int, loc: Tensor, k: Tensor, v: Tensor) -> None:
        """Write ``k`` [T, h_kv, d] and ``v`` [T, h_kv, d_v] at slots ``loc`` [T] (quantized when FP8)."""
        self._check_layer(layer)
        self._check_loc(loc)
        t = loc.shape[0]
        self._check_rows(k, "k", t, (self.num_kv_heads, self.head_dim))
        self._check_rows(v, "v", t, (self.num_kv_heads, self.v_head_dim))
        loc = to_device(loc, self.device, torch.int64)
        self._store(self.k_buffer[layer], loc, k, self.k_scale[layer] if self.is_fp8 else None)
        self._store(self.v_buffer[layer], loc, v, self.v_scale[layer] if self.is_fp8 else None)

    def k_paged(self, layer: int) -> Tensor:
        """[P, p, h_kv, d] view of the layer's K buffer (storage dtype; no copy)."""
        self._check_layer(layer)
        return self._paged(self.k_buffer[layer])

    def v_paged(self, layer: int) -> Tensor:
        """[P, p, h_kv, d_v] view of the layer's V buffer (storage dtype; no copy)."""
        self._check_layer(layer)
        return self._paged(self.v_buffer[layer])

    def dequantized(self, layer: int, slots: Sequence[int] | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """K, V of the given slots (all when None) in the compute dtype: ``stored * scale`` for FP8."""
        self._check_layer(layer)
        k, v = self.k_buffer[layer], self.v_buffer[layer]
        if slots is not None:
            idx = to_device(torch.as_tensor(slots, dtype=torch.int64), self.device)
            k, v = k[idx], v[idx]
        if not self.is_fp8:
            return k.to(self.dtype), v.to(self.dtype)
        return dequantize_e4m3(k, self.k_scale[layer], self.dtype), dequantize_e4m3(v, self.v_scale[layer], self.dtype)
