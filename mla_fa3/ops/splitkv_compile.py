"""Phase 1 of split-KV (``splitkv_kernel_triton._splitkv_partial_kernel``) compiled for Hopper without a GPU, and a
census of its loop: what the compiler made of the launch config, readable on a CPU machine.

``compile_for_hopper(config)`` compiles phase 1 as ``splitkv_partials`` launches it for DeepSeek's latent (512 + 64
columns, page 64, a bf16 q over a bf16 or e4m3 cache), with the constexprs of ``splitkv_triton.phase1_meta`` and the
specialization Triton's launcher gives such a launch (every pointer and every stride but the page table's a
multiple of 16). ``loop_census(kernel)`` counts, in the PTX of the key loop (the longest backward branch's body):

    cp_async      16-byte asynchronous copies into shared memory (the key tile's loads, multi-buffered)
    wait_groups   the ``cp.async.wait_group N`` values: N > 0 leaves N copy groups in flight while a tile is consumed
    barriers      ``bar.sync`` (CTA barriers: the cross-warp reductions and layout exchanges of one key block)
    mma           ``mma.sync`` per warp
    global_loads  ``ld.global`` (synchronous loads; a key tile loaded this way waits out its latency every block)

Measured with it (Triton 3.6 and 3.9, sm_90, the 16-head bf16 row of ``CONFIG_TABLE``): a 32-key block is 18
copies per thread in 5 groups, ``wait_group 5`` (one block in flight while one is consumed; the next block's copies
issue after the dots), 9 CTA barriers (7 with Triton 3.9), 68 mma.sync per warp — docs/DECODE_KERNEL.md. ``python -m
mla_fa3.ops.splitkv_compile`` prints it for the table's 16-head configs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .splitkv_combine_triton import _splitkv_combine_kernel, combine_meta
from .splitkv_config import KernelConfig, choose_config
from .splitkv_kernel_triton import _splitkv_partial_kernel
from .splitkv_triton import phase1_meta

LATENT, ROPE, PAGE = 512, 64, 64
# the kernel's pointer arguments (its other non-constexpr arguments are int32 but for ``scale_log2``)
_POINTERS = ("Q", "QR", "KV", "PageTable", "SeqLens", "Work", "NumWork", "PartO", "PartLse2", "DescaleQ", "DescaleK",
             "Counters", "Probe")
_NOT_ALIGNED = ("num_counters", "stride_ptb")  # ints the launcher need not see as multiples of 16


@dataclass(frozen=True)
class LoopCensus:
    """Counts in the PTX of phase 1's key loop (see the module docstring)."""

    cp_async: int
    wait_groups: Tuple[int, ...]
    barriers: int
    mma: int
    global_loads: int

    @property
    def multi_buffered(self) -> bool:
        """The key tiles arrive by asynchronous copies with at least one group left in flight."""
        return self.cp_async > 0 and any(n > 0 for n in self.wait_groups)


def compile_for_hopper(config: KernelConfig, *, heads: int = 16, sq: int = 1, kv8: bool = False, pdl: bool = True,
                       follows_store: bool = False, probe: bool = False, page: int = PAGE, capability: int = 90):
    """Phase 1 for ``config`` compiled for ``GPUTarget("cuda", capability, 32)`` without a GPU -> triton's
    CompiledKernel (``.asm['ttgir' | 'ptx' | 'cubin']``): a bf16 q (its rope part apart), a bf16 cache or (``kv8``)
    an e4m3 one, pages of ``page`` keys (below ``block_n``: a page id per key), bf16 partials with
    ``config.half_partials``; ``probe``: with the timeline stamps (``splitkv_partials(probe=)``)."""
    _, meta = phase1_meta(config, heads=heads, sq=sq, dv=LATENT, dr=ROPE, page=page, q8=False, kv8=kv8,
                          ieee=False, causal=True, pdl=pdl, early=pdl and follows_store, zero=False, probe=probe)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
    meta.pop("launch_pdl", None)  # a launch attribute, not a compile option
    fn = _splitkv_partial_kernel
    types = {name: "i32" for name in fn.arg_names}
    types.update({name: "*i32" for name in _POINTERS}, Probe="*i64")
    types.update(Q="*bf16", QR="*bf16", KV="*fp8e4nv" if kv8 else "*bf16", DescaleQ="*fp32", DescaleK="*fp32",
                 PartO="*bf16" if config.half_partials else "*fp32", PartLse2="*fp32", scale_log2="fp32")
    types.update({name: "constexpr" for name in meta})
    aligned = [name for name in fn.arg_names if types[name] != "constexpr" and types[name] != "fp32"
               and name not in _NOT_ALIGNED]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=fn, signature=types, constexprs=meta, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def compile_combine_for_hopper(*, bs: int = 4, heads: int = 16, half_partials: bool = True, pdl: bool = True,
                               probe: bool = False, discard: bool = False, capability: int = 90):
    """The combine of a ``bs``-request, one-token step (``splitkv_combine_triton.combine_meta``, the rule's tile)
    compiled for ``GPUTarget("cuda", capability, 32)`` without a GPU: bf16 out, bf16 partials with
    ``half_partials``, a bf16 cache; ``probe``: with the timeline stamps (``combine_splits(probe=)``); ``discard``:
    the partial lines dropped from the L2 once read (``combine_splits(discard=)``)."""
    _, meta = combine_meta(bs=bs, sq=1, heads=heads, dv=LATENT, tile=None, kv8=False, pdl=pdl, probe=probe,
                           discard=discard)
    options = {"num_warps": meta.pop("num_warps")}
    meta.pop("launch_pdl", None)
    fn = _splitkv_combine_kernel
    types = {name: "i32" for name in fn.arg_names}
    types.update(PartO="*bf16" if half_partials else "*fp32", PartLse2="*fp32", SplitOffsets="*i32", Out="*bf16",
                 Lse="*fp32", DescaleK="*fp32", W="*bf16", Ws="*fp32", Count="*i32", Probe="*i64")
    types.update({name: "constexpr" for name in meta})
    src = ASTSource(fn=fn, signature=types, constexprs=meta)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def loop_census(kernel) -> LoopCensus:
    """``LoopCensus`` of a ``compile_for_hopper`` kernel: its PTX between the key loop's label and its backward
    branch (the longest loop body; a kernel without one counts the whole PTX)."""
    ptx = kernel.asm["ptx"]
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)) and labels.get(m.group(1), i) < i]
    start, end = max(loops, key=lambda span: span[1] - span[0]) if loops else (0, len(lines))
    body = "\n".join(lines[start:end + 1])
    return LoopCensus(cp_async=len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global", body)),
                      wait_groups=tuple(int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", body)),
                      barriers=len(re.findall(r"\bbar\.sync\b", body)), mma=len(re.findall(r"\bmma\.sync\b", body)),
                      global_loads=len(re.findall(r"\bld\.global\b", body)))


def main(argv=None) -> int:
    """Print the census of the table's 16-head configs (bf16 and e4m3 cache), with and without ``follows_store``."""
    del argv
    print(f"triton {triton.__version__}, sm_90, 16 heads, one query token, page 64")
    for kv8 in (False, True):
        config = choose_config(16, 4, 32768, kv_fp8=kv8)
        for early in (False, True):
            c = loop_census(compile_for_hopper(config, kv8=kv8, follows_store=early))
            print(f"{'e4m3' if kv8 else 'bf16'} cache, {config.label()}{', follows_store' if early else ''}: "
                  f"{c.cp_async} cp.async / block, wait_group {list(c.wait_groups)}, {c.barriers} bar.sync, "
                  f"{c.mma} mma.sync, {c.global_loads} ld.global; multi-buffered: {c.multi_buffered}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
