"""The record of which attention path and kernel a backend step took, and why (``MLABackend.explain()``).

One :class:`PathRecord` per step: written by ``init_forward_metadata`` (or the CUDA-graph capture /
replay hooks) when the step is planned, completed by the layers' ``forward`` calls with the
implementation the kernel layer actually ran (``ops.last_impl()``). Pure host data: reading it never
touches a device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["AttentionPath", "PathRecord"]


class AttentionPath(enum.Enum):
    """Which compute path served the step's layers."""

    IDLE = "idle"  # empty batch: no kernel, no pool access
    ABSORBED = "absorbed"  # absorb.forward_absorbed over the latent cache (FA3 or FlashMLA)
    MHA_ONESHOT = "mha_oneshot"  # chunked_prefix: MHA over the decompressed new tokens (no prefix)
    MHA_CHUNKED = "mha_chunked"  # chunked_prefix: MHA over a prefix decompressed chunk by chunk
    MHA_FALLBACK = "mha_fallback"  # mha_fallback: regular MHA / cross-attention layers


@dataclass
class PathRecord:
    """What the last step ran. Host values only."""

    mode: str  # ForwardMode name of the step ("DECODE", "EXTEND", ...)
    path: AttentionPath  # path of the MLA layers (MHA / CROSS layers are listed in other_paths)
    kernel: str | None  # "fa3" / "flashmla" for the absorbed path; None when no absorbed kernel runs
    reason: str  # why this path / kernel (kernel_choice / path_choice reasons, overrides, constraints)
    graph: bool = False  # the metadata came from CUDA-graph capture buffers (capture or replay)
    impl: str | None = None  # "fa3" / "reference": what mla_fa3.ops last ran for this step (None before)
    other_paths: set[AttentionPath] = field(default_factory=set)  # paths of non-MLA layers seen this step
    decision: object | None = None  # the path_choice decision object when one was consulted

    def summary(self) -> str:
        """One line for logs: ``DECODE: absorbed/fa3 (reference) — reason``."""
        kernel = f"/{self.kernel}" if self.kernel else ""
        impl = f" ({self.impl})" if self.impl else ""
        graph = " [graph]" if self.graph else ""
        others = ", also " + ", ".join(sorted(p.value for p in self.other_paths)) if self.other_paths else ""
        return f"{self.mode}: {self.path.value}{kernel}{impl}{graph}{others} — {self.reason}"
