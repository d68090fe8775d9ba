"""A backend's decode-kernel choice for each decode-like step, cached: :class:`DecodeKernelChoice`.

The kernel is the backend's setting (``fa3`` / ``flashmla`` / ``splitkv``) or, with ``auto``, the measured
table's choice for the step's host numbers: batch size, longest and mean KV length — on a bf16 pool at page 64
``policy.decode_kernel`` (FA3 / FlashMLA / split-KV), on an FP8 pool ``policy.fp8_decode`` (FlashMLA FP8 /
split-KV; split-KV alone off page 64). That choice is cached per bucket of the three numbers
(``batch_bucket``, ``kernel_bucket``): a bucket is decided once at its corners (``batch_bucket_bounds``,
``bucket_corners``; all corners in one NumPy pass, ``choose_decode_kernels``) and keeps that kernel when they
agree; where the table's choice changes inside a bucket, every step in it is decided for its exact numbers.
A serving loop whose batch gains or loses a request, and whose lengths grow by one token a step, stays in
its buckets most steps. ``graph_kernels`` lists the kernels worth a CUDA graph per batch size.
"""

from __future__ import annotations

import math

import torch

from mla_fa3 import ops
from mla_fa3.policy import decode_kernel as decode_policy
from mla_fa3.policy import fp8_decode
from mla_fa3.policy.decode_kernel import MEAN_SLACK, choose_decode_kernels, explain_decode_kernel, splitkv_possible
from mla_fa3.policy.fp8_decode import choose_fp8_decode_kernels, explain_fp8_decode_kernel, fp8_splitkv_possible
from mla_fa3.policy.paths import DECODE_KERNEL_AUTO, FLASHMLA_PAGE_SIZE, DecodeKernel

__all__ = ["DecodeKernelChoice", "kernel_bucket", "batch_bucket", "batch_bucket_bounds", "bucket_corners",
           "KERNEL_BUCKETS_PER_OCTAVE", "BATCH_BUCKETS_PER_OCTAVE"]

KERNEL_BUCKETS_PER_OCTAVE = 64  # decode-kernel cache buckets per log2 unit of max length and of skew
BATCH_BUCKETS_PER_OCTAVE = 16  # decode-kernel cache buckets per log2 unit of batch size (exact up to 22)
BATCH_BUCKET_MAX = 256  # batches up to this size are cached per bucket (<= 12 sizes each); larger ones exactly
KERNEL_CACHE_SIZE = 4096  # cached decode-kernel choices per planner (cleared when full)
_MISSING = object()


def kernel_bucket(max_seqlen_k: int, mean_seqlen_k: float | None) -> tuple[int, int]:
    """(length bucket, skew bucket) of a step: ``floor(R log2 max)`` and ``floor(-R log2 (mean / max))``,
    ``R = KERNEL_BUCKETS_PER_OCTAVE``; an unknown mean, or one >= max, counts as equal lengths (skew bucket 0)."""
    length = int(math.log2(max_seqlen_k) * KERNEL_BUCKETS_PER_OCTAVE)
    if mean_seqlen_k is None or mean_seqlen_k >= max_seqlen_k:
        return length, 0
    return length, int(-math.log2(mean_seqlen_k / max_seqlen_k) * KERNEL_BUCKETS_PER_OCTAVE)


def batch_bucket(batch_size: int) -> int:
    """``floor(B log2 batch_size)``, ``B = BATCH_BUCKETS_PER_OCTAVE``: a serving batch that gains or loses a
    request stays in its bucket (one request is under 1/16 octave from 23 requests on)."""
    return int(math.log2(batch_size) * BATCH_BUCKETS_PER_OCTAVE)


def batch_bucket_bounds(bucket: int) -> tuple[int, int]:
    """The smallest and largest batch size in ``bucket`` (equal where a bucket holds one size)."""
    r = BATCH_BUCKETS_PER_OCTAVE
    lo = max(1, math.ceil(2.0 ** (bucket / r)))
    while batch_bucket(lo) < bucket:
        lo += 1
    hi = max(lo, math.ceil(2.0 ** ((bucket + 1) / r)) - 1)
    while hi > lo and batch_bucket(hi) > bucket:
        hi -= 1
    return lo, hi


def bucket_corners(length_bucket: int, skew_bucket: int) -> list[tuple[int, float | None]]:
    """The (max, mean) corners of a bucket: its shortest and longest max length, each at the bucket's
    least and most skew (mean None: equal lengths, the top of skew bucket 0)."""
    r = KERNEL_BUCKETS_PER_OCTAVE
    lo = max(1, math.ceil(2.0 ** (length_bucket / r)))
    while kernel_bucket(lo, None)[0] < length_bucket:
        lo += 1
    hi = max(lo, math.ceil(2.0 ** ((length_bucket + 1) / r)) - 1)
    while hi > lo and kernel_bucket(hi, None)[0] > length_bucket:
        hi -= 1
    top, bottom = 2.0 ** (-skew_bucket / r), 2.0 ** (-(skew_bucket + 1) / r)
    return [(m, None if s == 1.0 else s * m) for m in sorted({lo, hi}) for s in (top, bottom)]


class DecodeKernelChoice:
    """The decode kernel of each decode-like step of one backend (host numbers only, never a device value).

    decode_kernel: a :class:`DecodeKernel` or ``DECODE_KERNEL_AUTO``; num_heads: of the MLA layers (the
    table's heads coordinate); kv_fp8: an e4m3 latent pool (FlashMLA FP8 or split-KV); whole_row_kernels: FlashMLA
    and split-KV can read the pool's latent row; impl / device: where split-KV would run.
    """

    def __init__(self, *, decode_kernel: DecodeKernel | str, page_size: int, num_heads: int | None, kv_fp8: bool,
                 whole_row_kernels: bool, impl: ops.Impl | None, device: torch.device):
        self.decode_kernel = decode_kernel
        self.page_size = page_size
        self.num_heads = num_heads
        self.kv_fp8 = kv_fp8
        self.whole_row_kernels = whole_row_kernels
        self.impl = impl
        self.device = device
        # (batch bucket, length bucket, skew bucket, split-KV usable) -> (kernel, reason) or None (mixed bucket)
        self._kernel_cache: dict[tuple, tuple[DecodeKernel, str] | None] = {}
        self._splitkv_ok: dict = {}  # ops implementation setting -> split-KV runs here (see _splitkv_usable)
        self._graph_kernels: tuple[bool, tuple[DecodeKernel, ...]] | None = None  # (split-KV usable, kernels)
        self._table = self._measured()  # the measured table the caches were filled from

    def choose_decode_kernel(self, batch_size: int, max_seqlen_k: int,
                             mean_seqlen_k: float | None = None) -> tuple[DecodeKernel, str]:
        """The absorbed kernel of a decode-like / verify step (host numbers only; mean None = unknown).

        With ``auto`` on page 64 the measured table's choice (``policy.decode_kernel``, a nearest-neighbour
        search over the table: ~25 us) is cached per (bucket of the batch size, ``1 / BATCH_BUCKETS_PER_OCTAVE``
        of a log2 unit wide — exact up to 22 requests, exact again past ``BATCH_BUCKET_MAX`` —, bucket of
        ``max_seqlen_k``, bucket of the skew ``mean / max``), buckets ``1 / KERNEL_BUCKETS_PER_OCTAVE`` of a log2
        unit wide (:func:`kernel_bucket`). A bucket is chosen once, at its corners (every batch size of it, each
        at :func:`bucket_corners`; one NumPy pass, ~0.2 ms on a 2-core CPU): when
        they all pick one kernel the bucket keeps that choice, else (the table's choice changes inside
        it) every step in it is chosen for its exact numbers. Anything but a step's host numbers (a mean
        outside ``(0, max]``, a non-int) goes to the policy unchanged, which answers or raises."""
        if self.decode_kernel != DECODE_KERNEL_AUTO:
            fp8 = " on the FP8 latent pool" if self.kv_fp8 else ""
            return self.decode_kernel, f"decode_kernel={self.decode_kernel.value} (backend setting){fp8}"
        if self.page_size != FLASHMLA_PAGE_SIZE:
            if self.kv_fp8:  # split-KV is the one kernel that reads it (checked at construction, and here again:
                # with impl None the backend follows the global ops setting, which may have changed since)
                choice = explain_fp8_decode_kernel(self.num_heads, 1, 1, self.page_size,
                                                   allow_splitkv=self._splitkv_usable())
                return choice.kernel, f"auto: {choice.reason}"
            return DecodeKernel.FA3, f"auto: page_size {self.page_size} != {FLASHMLA_PAGE_SIZE} -> FA3"
        if not self.whole_row_kernels:
            return DecodeKernel.FA3, "auto: the latent row is not FlashMLA's 512 + 64 -> FA3"
        allow = self._splitkv_usable()
        self._check_table()
        if type(batch_size) is not int or type(max_seqlen_k) is not int or not (
                mean_seqlen_k is None or (type(mean_seqlen_k) in (float, int)
                                          and 0 < mean_seqlen_k <= max_seqlen_k * (1 + MEAN_SLACK))):
            # not a step's host numbers: the policy itself answers (or raises its named error)
            return self._choose_uncached(max(batch_size, 1), max(max_seqlen_k, 1), mean_seqlen_k, allow)
        bs = max(batch_size, 1)
        length_bucket, skew_bucket = kernel_bucket(max(max_seqlen_k, 1), mean_seqlen_k)
        # batches up to BATCH_BUCKET_MAX share a bucket (every size in it checked at a miss), larger ones are exact
        sizes = batch_bucket(bs) if bs <= BATCH_BUCKET_MAX else -bs
        key = (sizes, length_bucket, skew_bucket, allow)
        hit = self._kernel_cache.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._bucket_choice(key[0], length_bucket, skew_bucket, allow)
            if len(self._kernel_cache) >= KERNEL_CACHE_SIZE:
                self._kernel_cache.clear()
            self._kernel_cache[key] = hit
        if hit is None:  # the table's choice changes inside this bucket: choose for these exact numbers
            return self._choose_uncached(bs, max(max_seqlen_k, 1), mean_seqlen_k, allow)
        return hit

    def _check_table(self) -> None:
        """Forget the cached choices when the measured table was replaced (a re-fit loaded at run time)."""
        if self._measured() is not self._table:
            self._table = self._measured()
            self._kernel_cache.clear()
            self._graph_kernels = None

    def _bucket_choice(self, batch_bucket_: int, length_bucket: int, skew_bucket: int,
                       allow_splitkv: bool) -> tuple[DecodeKernel, str] | None:
        """The choice at the bucket's first corner when all its corners choose the same kernel, else None.
        Corners: every batch size of the bucket (the set of equally-near table shapes can change between
        two sizes, so its two ends are not enough; a negative bucket is one exact size), each at the
        length / skew corners — all in one NumPy pass."""
        lo, hi = batch_bucket_bounds(batch_bucket_) if batch_bucket_ >= 0 else (-batch_bucket_, -batch_bucket_)
        corners = [(b, m, mean) for b in range(lo, hi + 1) for m, mean in bucket_corners(length_bucket, skew_bucket)]
        choose = choose_fp8_decode_kernels if self.kv_fp8 else choose_decode_kernels
        kernels = choose(self.num_heads, corners, allow_splitkv=allow_splitkv)  # one NumPy pass
        if len(set(kernels)) != 1:
            return None
        return self._choose_uncached(*corners[0], allow_splitkv)  # the reason, at the first corner

    def _choose_uncached(self, batch_size: int, max_seqlen_k: int, mean_seqlen_k: float | None,
                         allow_splitkv: bool) -> tuple[DecodeKernel, str]:
        """``auto`` on page 64: the measured table's choice for these exact numbers (no cache)."""
        explain = explain_fp8_decode_kernel if self.kv_fp8 else explain_decode_kernel
        choice = explain(self.num_heads, batch_size, max_seqlen_k, self.page_size, mean_seqlen_k=mean_seqlen_k,
                         allow_splitkv=allow_splitkv)
        return choice.kernel, f"auto: {choice.reason}"

    def graph_kernels(self) -> tuple[DecodeKernel, ...]:
        """Kernels worth a graph per batch size: those the per-step choice can pick on page 64, else one.

        Split-KV only where the measured table can pick it (a ``splitkv_ms`` column) and its kernel runs here."""
        allow = self._splitkv_usable()
        self._check_table()
        if self._graph_kernels is None or self._graph_kernels[0] != allow:
            self._graph_kernels = (allow, self._graph_kernels_uncached())
        return self._graph_kernels[1]

    def _graph_kernels_uncached(self) -> tuple[DecodeKernel, ...]:
        if self.decode_kernel != DECODE_KERNEL_AUTO:
            return (self.decode_kernel,)
        if self.kv_fp8:
            if self.page_size != FLASHMLA_PAGE_SIZE:
                return (DecodeKernel.SPLITKV,)
            if self._splitkv_usable() and self.num_heads is not None and fp8_splitkv_possible(self.num_heads):
                return (DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV)
            return (DecodeKernel.FLASHMLA,)
        if self.page_size != FLASHMLA_PAGE_SIZE or not self.whole_row_kernels:
            return (DecodeKernel.FA3,)
        if self._splitkv_usable() and self.num_heads is not None and splitkv_possible(self.num_heads):
            return (DecodeKernel.FA3, DecodeKernel.FLASHMLA, DecodeKernel.SPLITKV)
        return (DecodeKernel.FA3, DecodeKernel.FLASHMLA)

    def pool_reader(self) -> DecodeKernel:
        """The absorbed kernel that can read this backend's pool when no step numbers are at hand (an FP8 extend
        step without decode rows names it): the setting, else split-KV off page 64 on an FP8 pool, else FlashMLA
        on an FP8 pool, else FA3."""
        if self.decode_kernel != DECODE_KERNEL_AUTO:
            return self.decode_kernel
        if self.kv_fp8:
            return DecodeKernel.SPLITKV if self.page_size != FLASHMLA_PAGE_SIZE else DecodeKernel.FLASHMLA
        return DecodeKernel.FA3

    def _measured(self) -> tuple:
        """The measured table this backend's choice reads (replaced at run time by a re-fit)."""
        return fp8_decode.MEASURED_FP8 if self.kv_fp8 else decode_policy.MEASURED

    def _splitkv_usable(self) -> bool:
        """Whether the split-KV kernel runs here, cached per ops implementation setting (the backend's, or
        the global one it follows when None)."""
        key = ops.get_impl() if self.impl is None else self.impl
        hit = self._splitkv_ok.get(key)
        if hit is None:
            hit = self._splitkv_ok[key] = ops.splitkv_available(self.device, self.impl)
        return hit
