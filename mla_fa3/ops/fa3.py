"""FlashAttention-3 / FlashMLA / merge_state_v2 from sgl-kernel: the ONLY module that imports ``sgl_kernel``.

Each wrapper takes the validated call record from ``validate.py`` and returns ``(out, lse)`` in the
library's fixed convention: lse float32, **natural log**, shaped ``out.shape[:-1]`` (``[T, H]`` varlen,
``[bs, sq, H]`` batched), ``-inf`` for a row that sees no key. The kernels differ from it in ways
fixed here, with shape-only tensor ops (no device->host sync, legal inside CUDA-graph capture):

* FA3 (``flash_attn_with_kvcache`` / ``flash_attn_varlen_func`` with ``return_softmax_lse=True``)
  returns ``(out, lse, *rest)`` with lse ``[H, T]`` (varlen) or ``[bs, H, sq]`` (batched): transposed
  to token-major here. FA3 always computes lse, so asking for it costs nothing.
* FlashMLA returns ``(out, lse [bs, H, sq])``; its kernels work in base 2 but store ``lse2 / log2(e)``,
  i.e. a natural log (checked in FlashMLA's combine kernel), so no base conversion is needed.
* FA3 and FlashMLA write ``+inf`` as the lse of a row without keys; it is rewritten to ``-inf``.
* ``merge_state_v2`` treats any infinite lse as empty but returns NaN when both sides are empty:
  such rows are rewritten to o 0, lse -inf (four elementwise kernels over o and lse) — unless the caller
  guarantees that state a has no empty row (``MergeCall.a_nonempty``: the chunked MHA prefill's running
  state, whose every row sees at least its own token).
Rows with ``bs == 0`` or no query tokens return empty tensors without launching a kernel.

Pairing: an sgl-kernel wheel is compiled against one torch ABI (``SGL_KERNEL_TORCH``). Importing this
module checks the installed pair (package metadata only, ``sgl_kernel`` itself is not imported) and
logs one line when they do not pair. :func:`why_unavailable` says why FA3 cannot run on a device
(:class:`Unavailable`); ``ops`` raises it as :class:`FA3UnavailableError` — also for ``impl=auto`` on a
CUDA tensor, where running the reference instead would be a silent 100x slowdown.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.metadata
import importlib.util
import logging
from typing import Optional, Tuple

import torch

from .types import FA3ScheduleKey, FlashMLASchedule, Impl, KernelUnavailableError
from .calls import FlashMLACall, KVCacheCall, VarlenCall

Tensor = torch.Tensor
logger = logging.getLogger(__name__)

SGL_KERNEL_TORCH = {"0.4.5": "2.11"}  # sglang-kernel release -> the torch (major.minor) its wheel is built for
_DIST_NAMES = ("sglang-kernel", "sgl-kernel")  # the PyPI names sgl-kernel has been published under
INSTALL_HINT = (
    'install the GPU extra: pip install "mla-fa3[gpu]" (torch 2.11 with sglang-kernel 0.4.5, its CUDA 13 '
    "build) and run on a Hopper (sm90) GPU; or pass impl='reference'"
)


class Unavailable(enum.Enum):
    """Why FA3 cannot run on a device."""

    NOT_CUDA = "not_cuda"  # the tensors are not on a CUDA device
    NO_CUDA = "no_cuda"  # torch sees no CUDA device
    WRONG_ARCH = "wrong_arch"  # the device is not sm90 (Hopper)
    SGL_KERNEL_MISSING = "sgl_kernel_missing"  # sgl_kernel is not installed
    VERSION_MISMATCH = "version_mismatch"  # sgl_kernel was built for another torch and does not import
    IMPORT_FAILED = "import_failed"  # sgl_kernel is installed but does not import (other causes)


class FA3UnavailableError(KernelUnavailableError):
    """FA3 cannot run on the tensors' device; ``reason`` (an :class:`Unavailable`) says why.

    Raised for ``impl='fa3'``, and for ``impl='auto'`` on a CUDA tensor (``auto`` runs the reference
    only off CUDA; on a GPU choose ``impl='reference'`` explicitly to run it there)."""

    def __init__(self, message: str, reason: Unavailable) -> None:
        super().__init__(message)
        self.reason = reason


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_sgl_kernel() -> Optional[str]:
    """The installed sgl-kernel distribution's version (package metadata), or None."""
    for name in _DIST_NAMES:
        version = _dist_version(name)
        if version is not None:
            return version
    return None


def version_mismatch(sgl_kernel_version: Optional[str] = None, torch_version: Optional[str] = None) -> Optional[str]:
    """One line when the installed sglang-kernel was built for another torch than the installed one, else None.

    Defaults: the installed versions. Releases missing from ``SGL_KERNEL_TORCH`` are not judged."""
    sk = installed_sgl_kernel() if sgl_kernel_version is None else sgl_kernel_version
    tv = torch.__version__ if torch_version is None else torch_version
    if sk is None:
        return None
    want = SGL_KERNEL_TORCH.get(sk.split("+")[0])
    have = ".".join(tv.split("+")[0].split(".")[:2])
    if want is None or have == want:
        return None
    return (f"sglang-kernel {sk} is built for torch {want}.*, but torch {tv} is installed: pair them with "
            f"pip install \"torch=={want}.*\" \"sglang-kernel=={sk}\" (the mla-fa3[gpu] extra), or install "
            f"the sglang-kernel release built for torch {have}")


def report_version_mismatch() -> Optional[str]:
    """Log the one-line pairing message (run once at import); returns it, or None when the pair is fine."""
    message = version_mismatch()
    if message is not None:
        logger.warning("mla_fa3.ops: %s", message)
    return message


@functools.lru_cache(maxsize=None)
def import_error() -> Optional[str]:
    """None when ``sgl_kernel.flash_attn`` imports, else the import failure as text (cached)."""
    try:
        import sgl_kernel.flash_attn  # noqa: F401
    except Exception as exc:  # ImportError, or an OSError from a CUDA/torch mismatch
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def why_unavailable(device: torch.device) -> Optional[Tuple[Unavailable, str]]:
    """None when FA3 can run on ``device``, else (reason, a one-line explanation)."""
    if device.type != "cuda":
        return Unavailable.NOT_CUDA, f"the tensors are on {device}, FA3 needs a CUDA device"
    if not torch.cuda.is_available():
        return Unavailable.NO_CUDA, "CUDA is not available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if cap != (9, 0):
        return Unavailable.WRONG_ARCH, f"{device} has compute capability {cap}, FA3 needs (9, 0) (Hopper)"
    error = import_error()
    if error is None:
        return None
    if importlib.util.find_spec("sgl_kernel") is None:
        return Unavailable.SGL_KERNEL_MISSING, "sgl_kernel is not installed"
    mismatch = version_mismatch()
    if mismatch is not None:
        return Unavailable.VERSION_MISMATCH, f"sgl_kernel does not import ({error}): {mismatch}"
    return Unavailable.IMPORT_FAILED, f"sgl_kernel does not import ({error})"


def unavailable_error(device: torch.device, *, auto: bool = False) -> Optional[FA3UnavailableError]:
    """The error to raise when FA3 cannot run on ``device`` (None when it can); ``auto``: impl=auto asked."""
    why = why_unavailable(device)
    if why is None:
        return None
    reason, text = why
    prefix = "impl=auto on a CUDA tensor, but FA3 is unavailable" if auto else "FA3 unavailable"
    hint = INSTALL_HINT + (" to run the slow pure-torch reference on the GPU on purpose" if auto else "")
    return FA3UnavailableError(f"{prefix}: {text}; {hint}", reason)


def unavailable_message(device: torch.device) -> str:
    """Why impl=FA3 cannot run on ``device``, with what to do about it ("" when it can)."""
    error = unavailable_error(device)
    return "" if error is None else str(error)


def _module(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception as exc:
        raise KernelUnavailableError(f"{name} does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc


def _token_major(lse: Tensor, kernel_shape: tuple, perm: tuple, want: tuple) -> Tensor:
    """Kernel lse (``kernel_shape``) -> ``want`` layout (contiguous), +inf (empty row) -> -inf, NaN kept: one kernel
    (the copy into token-major order does the fix-up; it runs in every layer that asks for the LSE)."""
    if tuple(lse.shape) == kernel_shape:
        lse = lse.permute(*perm)
    elif tuple(lse.shape) != want:
        raise RuntimeError(f"unexpected kernel lse shape {tuple(lse.shape)}, expected {kernel_shape}")
    inf = float("inf")
    if lse.requires_grad:  # autograd refuses out= (a caller running with grad on): the same values in two kernels
        return torch.nan_to_num(lse.float(), nan=float("nan"), posinf=-inf, neginf=-inf).contiguous()
    out = torch.empty(want, dtype=torch.float32, device=lse.device)
    return torch.nan_to_num(lse.float(), nan=float("nan"), posinf=-inf, neginf=-inf, out=out)


def _empty(q: Tensor, dv: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    out = torch.zeros(*q.shape[:-1], dv, dtype=dtype, device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)


def flash_attn_with_kvcache(call: KVCacheCall, *, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """FA3 paged attention -> (out, lse or None)."""
    q, dv = call.q, call.v_cache.shape[3]
    if q.numel() == 0 or call.batch_size == 0:
        return _empty(q, dv, call.out_dtype)
    fa = _module("sgl_kernel.flash_attn")
    res = fa.flash_attn_with_kvcache(
        q, call.k_cache, call.v_cache, qv=call.qv, page_table=call.page_table, cache_seqlens=call.cache_seqlens,
        cu_seqlens_q=call.cu_seqlens_q, max_seqlen_q=call.max_seqlen_q, q_descale=call.q_descale,
        k_descale=call.k_descale, v_descale=call.v_descale, softmax_scale=call.softmax_scale, causal=call.causal,
        window_size=call.window_size, softcap=call.softcap, num_splits=call.num_splits, return_softmax_lse=True,
        scheduler_metadata=call.scheduler_metadata,
    )
    out, lse = res[0], res[1]
    if not return_lse:
        return out, None
    H = q.shape[-2]
    if call.varlen:
        return out, _token_major(lse, (H, q.shape[0]), (1, 0), (q.shape[0], H))
    bs, sq = q.shape[0], q.shape[1]
    return out, _token_major(lse, (bs, H, sq), (0, 2, 1), (bs, sq, H))


def flash_attn_varlen_func(call: VarlenCall, *, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """FA3 varlen attention over contiguous K/V -> (out [T_q, H, d_v], lse [T_q, H] or None)."""
    q = call.q
    if q.shape[0] == 0 or call.batch_size == 0:
        return _empty(q, call.v.shape[2], call.out_dtype)
    fa = _module("sgl_kernel.flash_attn")
    res = fa.flash_attn_varlen_func(
        q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k,
        softmax_scale=call.softmax_scale, causal=call.causal, window_size=call.window_size, softcap=call.softcap,
        return_softmax_lse=True,
    )
    out, lse = res[0], res[1]
    if not return_lse:
        return out, None
    T, H = q.shape[0], q.shape[1]
    return out, _token_major(lse, (H, T), (1, 0), (T, H))


def merge_state(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor, *,
                a_nonempty: bool = False) -> Tuple[Tensor, Tensor]:
    """``sgl_kernel.merge_state_v2`` (lse ``[T, H]`` natural log, contiguous) with empty rows fixed.

    a_nonempty: every row of state a has keys (the caller knows it), so no row is empty on both sides
    and the rewrite is skipped.
    """
    if o_a.shape[0] == 0:
        return o_a.clone(), lse_a.clone()
    sk = _module("sgl_kernel")
    o, lse = sk.merge_state_v2(o_a.contiguous(), lse_a.contiguous(), o_b.contiguous(), lse_b.contiguous())
    if a_nonempty:
        return o, lse
    empty = torch.isinf(lse_a) & torch.isinf(lse_b)
    o.masked_fill_(empty.unsqueeze(-1), 0.0)
    lse.masked_fill_(empty, float("-inf"))
    return o, lse


@contextlib.contextmanager
def _fp8_flashmla_guard():
    """Some sgl-kernel builds disable FlashMLA's dense FP8 path (NotImplementedError): say so actionably."""
    try:
        yield
    except NotImplementedError as exc:
        raise KernelUnavailableError(
            f"this sgl-kernel build has no dense FP8 FlashMLA ({exc}); sglang-kernel 0.4.5 has it — "
            "or use a bf16 latent cache, or impl='reference'"
        ) from exc


def get_fa3_schedule(key: FA3ScheduleKey, cache_seqlens: Tensor, cu_seqlens_q: Optional[Tensor]) -> Tensor:
    """FA3's tile-scheduler metadata for the calls of ``key`` (one device kernel reading the lengths: capturable).

    The arguments are the ones ``flash_attn_with_kvcache`` derives for such a call (its paged max_seqlen_k is
    the page-table width times the page size), so both size the same splits."""
    fa = _module("sgl_kernel.flash_attn")
    return fa.get_scheduler_metadata(
        key.batch_size, key.max_seqlen_q, key.page_table_width * key.page_size, key.num_heads, key.num_heads_k,
        key.head_dim, cache_seqlens, qkv_dtype=key.dtype, headdim_v=key.head_dim_v, cu_seqlens_q=cu_seqlens_q,
        page_size=key.page_size, causal=key.causal, window_size=key.window_size, has_softcap=key.softcap,
        num_splits=key.num_splits,
    )


def get_mla_decode_metadata(cache_seqlens: Tensor, num_q_heads_per_kv: int, *, is_fp8: bool) -> FlashMLASchedule:
    """FlashMLA tile-scheduler metadata for one latent KV head (a device kernel: capturable in a CUDA graph)."""
    fm = _module("sgl_kernel.flash_mla")
    if is_fp8:
        with _fp8_flashmla_guard():
            meta, splits = fm.get_mla_metadata(cache_seqlens, num_q_heads_per_kv, 1, is_fp8_kvcache=True)
    else:
        meta, splits = fm.get_mla_metadata(cache_seqlens, num_q_heads_per_kv, 1)
    return FlashMLASchedule(impl=Impl.FA3, tile_scheduler_metadata=meta, num_splits=splits, is_fp8=is_fp8)


def flash_mla_with_kvcache(call: FlashMLACall, *, return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """FlashMLA dense decode -> (out [bs, sq, H, head_dim_v], lse [bs, sq, H] or None)."""
    q = call.q
    if q.numel() == 0:
        return _empty(q, call.head_dim_v, call.out_dtype)
    fm = _module("sgl_kernel.flash_mla")
    extra = {}
    if call.is_fp8:
        extra = dict(descale_q=call.descale_q, descale_k=call.descale_k, is_fp8_kvcache=True)
    with _fp8_flashmla_guard():
        out, lse = fm.flash_mla_with_kvcache(
            q, call.kv_cache, call.page_table, call.cache_seqlens, call.head_dim_v,
            call.schedule.tile_scheduler_metadata, call.schedule.num_splits,
            softmax_scale=call.softmax_scale, causal=call.causal, **extra,
        )
    out = out.to(call.out_dtype)  # no-op unless out_dtype asked for another dtype than the kernel's
    if not return_lse:
        return out, None
    bs, sq, H = q.shape[0], q.shape[1], q.shape[2]
    return out, _token_major(lse, (bs, H, sq), (0, 2, 1), (bs, sq, H))


report_version_mismatch()
