"""What ``bench.splitkv`` tries: the candidate launch configs its ``--sweep`` times per head class, and the
``KernelConfig`` switches its ``--ab`` compares side by side (the values each is timed at by default).

A candidate is a hypothesis about the kernel (the comment above each list says which); the sweep keeps the best per
shape and prints the ``CONFIG_TABLE`` of ``ops/splitkv_config.py`` to paste.
"""

from __future__ import annotations

from typing import Sequence

from mla_fa3.ops.splitkv_config import WIDE_HEADS, KernelConfig

_C = KernelConfig
# Candidates per head class: few, each a hypothesis; ~9 compiles per class keep the sweep near 2 minutes.
# <= 32 heads, memory-bound: small tiles so 2-3 programs share an SM (latency hiding), enough waves to keep
# every SM streaming, half-precision partials (half the workspace traffic), one tile load vs two.
SWEEP_NARROW = (
    _C(block_n=32, num_warps=4, num_stages=2, waves=2.0),
    _C(block_n=32, num_warps=4, num_stages=3, waves=2.0),
    _C(block_n=32, num_warps=4, num_stages=2, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=4, num_stages=3, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=4, num_stages=3, waves=4.0, half_partials=True),
    _C(block_n=16, num_warps=4, num_stages=4, waves=3.0, half_partials=True),
    _C(block_n=64, num_warps=4, num_stages=2, waves=1.0, half_partials=True),
    _C(block_n=32, num_warps=4, num_stages=2, waves=2.0, half_partials=True, reload_kv=True),
    _C(block_n=32, num_warps=2, num_stages=3, waves=3.0, half_partials=True),
    _C(block_n=32, num_warps=8, num_stages=3, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=8, num_stages=3, waves=4.0, half_partials=True),
    # one tile in flight per program (2 stages: 56 KB of shared memory) and registers capped so that 3 or 4 programs
    # share an SM (the 3-stage config: 2 programs, 8 warps per SM, bound by latency)
    _C(block_n=32, num_warps=4, num_stages=2, waves=4.0, half_partials=True, max_registers=128),
    _C(block_n=32, num_warps=4, num_stages=2, waves=3.0, half_partials=True, max_registers=128),
    _C(block_n=32, num_warps=4, num_stages=2, waves=3.0, half_partials=True, max_registers=168),
    # phase 1 warp-specialized (the Gluon kernel, ``ops/gluon_decode.py``): a TMA producer warp streaming 64-key tiles
    # into a two-tile ring while one wgmma warpgroup computes, one program per SM; its one shape is 16 heads, bf16.
    # One wave or several in sequence (measured best at bs 16 x 64k on the H100: waves 4), bf16 partials at few
    # requests (where the partials are a third of the bytes: bs 1, 16k, one wave)
    _C(block_n=64, num_warps=4, num_stages=2, waves=1.0, warp_specialized=True),
    _C(block_n=64, num_warps=4, num_stages=2, waves=1.0, half_partials=True, warp_specialized=True),
    _C(block_n=64, num_warps=4, num_stages=2, waves=2.0, half_partials=True, warp_specialized=True),
    _C(block_n=64, num_warps=4, num_stages=2, waves=4.0, warp_specialized=True),
)
# <= 32 heads over an e4m3 cache (its tile converted in registers, per dot: more instructions per key than bf16 for
# half the bytes, so latency rather than bandwidth bounds it): the same axes, and 8 warps (fewer registers per thread,
# more warps per SM).
SWEEP_NARROW_E4M3 = (
    _C(block_n=32, num_warps=4, num_stages=3, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=4, num_stages=3, waves=3.0, half_partials=True),
    _C(block_n=16, num_warps=4, num_stages=4, waves=3.0, half_partials=True),
    _C(block_n=32, num_warps=8, num_stages=3, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=8, num_stages=3, waves=4.0, half_partials=True),
    _C(block_n=16, num_warps=8, num_stages=4, waves=2.0, half_partials=True),
    _C(block_n=16, num_warps=8, num_stages=4, waves=4.0, half_partials=True),
    _C(block_n=16, num_warps=8, num_stages=6, waves=4.0, half_partials=True),
    _C(block_n=64, num_warps=8, num_stages=2, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=4, num_stages=2, waves=3.0, half_partials=True, max_registers=168),
    _C(block_n=32, num_warps=4, num_stages=2, waves=4.0, half_partials=True, max_registers=128),
    # the warp-specialized Gluon kernel's e4m3 variant (TMA of e4m3 tiles, converted to fp16 in shared memory)
    _C(block_n=64, num_warps=4, num_stages=2, waves=1.0, half_partials=True, warp_specialized=True),
    _C(block_n=64, num_warps=4, num_stages=2, waves=2.0, half_partials=True, warp_specialized=True),
)
# > 32 heads, compute-bound: 64 rows per program (acc 64 x 512 fp32 over 8 or 16 warps); the latent tile
# loaded once for both dots, or twice (each load then pipelined into shared memory for one dot).
SWEEP_WIDE = (
    _C(block_n=64, num_warps=8, num_stages=2, waves=1.0),
    _C(block_n=64, num_warps=8, num_stages=3, waves=2.0),
    _C(block_n=32, num_warps=8, num_stages=3, waves=2.0),
    _C(block_n=64, num_warps=8, num_stages=2, waves=2.0, reload_kv=True),
    _C(block_n=32, num_warps=8, num_stages=2, waves=2.0, reload_kv=True),
    _C(block_n=64, num_warps=16, num_stages=2, waves=2.0),
    _C(block_n=32, num_warps=16, num_stages=3, waves=2.0, reload_kv=True),
    _C(block_n=64, num_warps=8, num_stages=2, waves=2.0, half_partials=True),
    _C(block_n=32, num_warps=4, num_stages=3, waves=2.0, max_rows=32),
    # the page id read one block ahead (multi-buffered tile loads; q's 72 KB and the buffers share shared memory:
    # 64-key blocks with 3 stages need 288 KB). Measured on an H100: no faster than the table's (docs/PERFORMANCE.md)
    _C(block_n=64, num_warps=8, num_stages=2, waves=1.0, prefetch_pages=True),
    _C(block_n=32, num_warps=8, num_stages=3, waves=1.0, prefetch_pages=True),
)


# KernelConfig's switches (--ab FIELD, or FIELD=V1,V2,...) and the values each is timed at by default
AB_FIELDS = {"pdl": (True, False), "half_partials": (True, False), "reload_kv": (True, False),
             "latent_chunks": (1, 2, 4), "waves": (1.0, 2.0, 3.0), "num_stages": (2, 3, 4),
             "prefetch_pages": (True, False), "num_warps": (4, 8),
             "combine_tile": (None, (16, 64), (64, 64), (128, 32)),  # combine_tile values: rule (None) or SxC
             "block_n": (16, 32, 64), "max_registers": (None, 168, 128),  # max_registers: none (None) or a count
             "warp_specialized": (False, True), "even_splits": (False, True), "discard_partials": (False, True),
             "fit_splits": (True, False)}


def _ab_value(field: str, text: str):
    """One value of ``--ab FIELD=...`` as the field's type: a bool (1/true/on), a combine tile (``rule``: None, or
    ``SxC``), a register cap (``none``: None), else the type of the field's first default value."""
    text = text.strip()
    if field == "combine_tile":
        if text.lower() == "rule":
            return None
        splits, _, cols = text.lower().partition("x")
        if not (splits.isdigit() and cols.isdigit()):
            raise ValueError(f"--ab combine_tile: {text!r} is not 'rule' or SPLITSxCOLUMNS (e.g. 64x64)")
        return int(splits), int(cols)
    if field == "max_registers":
        return None if text.lower() == "none" else int(text)
    kind = type(AB_FIELDS[field][0])
    return text.lower() in ("1", "true", "on") if kind is bool else kind(text)


def _ab_field(field: str) -> str:
    if field not in AB_FIELDS:
        raise ValueError(f"--ab: {field!r} is not one of {sorted(AB_FIELDS)}")
    return field


def parse_ab(spec: str) -> tuple[str, tuple[dict, ...]]:
    """An ``--ab`` spec -> (its name, one dict of ``KernelConfig`` changes per value); a bad spec raises ValueError.

    ``FIELD`` (the field's default values) or ``FIELD=V1,V2,...`` (one switch), or variants that each name what they
    change, several switches at once joined by ``+``: ``num_stages=3+waves=2,num_stages=2+waves=3+max_registers=168``
    (every comma-separated item holds ``=``). The name is the fields, joined by ``+`` in the order first named. Each
    value must make a valid config from the defaults (``KernelConfig`` checks it)."""
    items = spec.split(",")
    if len(items) > 1 and all("=" in item for item in items):  # variants, each naming its fields
        variants = []
        for item in items:
            changes = {}
            for part in item.split("+"):
                field, _, text = part.partition("=")
                field = _ab_field(field.strip())
                changes[field] = _ab_value(field, text)
            variants.append(changes)
        name = "+".join(dict.fromkeys(f for changes in variants for f in changes))
    else:
        field, _, values = spec.partition("=")
        name = _ab_field(field)
        variants = [{field: v} for v in (_ab_value(field, v) for v in values.split(","))] if values else \
            [{field: v} for v in AB_FIELDS[field]]
    for changes in variants:
        KernelConfig().with_(**changes)  # each value a valid config (KernelConfig checks it)
    return name, tuple(variants)


def ab_text(changes: dict) -> str:
    """A value of ``parse_ab`` as a table cell: the value of a one-switch change (a tile as SxC, ``rule`` / ``none``
    for None), else ``FIELD=VALUE`` joined by ``+``."""
    def text(field, v):
        return "x".join(map(str, v)) if isinstance(v, tuple) else \
            {"combine_tile": "rule", "max_registers": "none"}.get(field, "None") if v is None else str(v)
    if len(changes) == 1:
        (field, v), = changes.items()
        return text(field, v)
    return "+".join(f"{field}={text(field, v)}" for field, v in changes.items())


def sweep_candidates(heads: int, fp8: bool = False) -> Sequence[KernelConfig]:
    """The sweep's configs for ``heads`` (its head class; ``fp8``: over an e4m3 cache)."""
    return SWEEP_WIDE if heads > WIDE_HEADS else SWEEP_NARROW_E4M3 if fp8 else SWEEP_NARROW
