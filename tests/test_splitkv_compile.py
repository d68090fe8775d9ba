"""Split-KV's phase 1 compiled for sm_90 on the CPU (``ops/splitkv_compile.py``): no GPU needed.

The kernel's speed at small batch rests on its key tiles arriving by asynchronous copies with one tile left in
flight while another is consumed (until 2026-12-03 a page id read in the same iteration kept a single buffer: 40.4
µs against 28.4 at 16 heads, bs 1, 64k). The table's 16-head configs must compile to such a loop, over a bf16 and an
e4m3 cache, with and without ``follows_store``; the configs that give it up (no page-id read-ahead, one stage) must
be seen to. Skipped where triton (>= 3.6) or its NVIDIA backend is missing.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 6):
    pytest.skip(f"triton {triton.__version__} < 3.6", allow_module_level=True)
pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")

from mla_fa3.ops.splitkv_compile import compile_for_hopper, loop_census  # noqa: E402
from mla_fa3.ops.splitkv_config import choose_config  # noqa: E402


@pytest.mark.parametrize("kv8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("follows_store", [False, True])
def test_the_tables_16_head_configs_stream_their_key_tiles(kv8, follows_store):
    config = choose_config(16, 4, 32768, kv_fp8=kv8)
    census = loop_census(compile_for_hopper(config, kv8=kv8, follows_store=follows_store))
    assert census.multi_buffered, census
    assert census.global_loads <= 1, census  # the next block's page id alone; the tile comes by cp.async
    assert census.mma > 0, census


@pytest.mark.parametrize("kv8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("page", [1, 16])
def test_pages_smaller_than_a_key_block_still_stream_their_tiles(kv8, page):
    """SGLang's default page size is 1: a page id per key (read one block ahead, a few synchronous loads of ids per
    block), the tile itself still by asynchronous copies with one block in flight."""
    config = choose_config(16, 4, 32768, kv_fp8=kv8)
    census = loop_census(compile_for_hopper(config, kv8=kv8, page=page))
    contiguous = loop_census(compile_for_hopper(config, kv8=kv8))
    assert census.multi_buffered and census.cp_async == contiguous.cp_async, (census, contiguous)
    assert census.mma == contiguous.mma and census.global_loads < census.cp_async, census


def test_the_census_sees_a_loop_that_waits_out_each_tile():
    config = choose_config(16, 4, 32768)
    no_read_ahead = loop_census(compile_for_hopper(config.with_(prefetch_pages=False)))
    assert not no_read_ahead.multi_buffered and set(no_read_ahead.wait_groups) == {0}, no_read_ahead
    one_stage = loop_census(compile_for_hopper(config.with_(num_stages=1)))
    assert one_stage.cp_async == 0 and one_stage.global_loads >= 18, one_stage  # 32 x 576 bf16 / 128 threads / 16 B


@pytest.mark.parametrize("pdl", [False, True])
def test_the_timeline_stamps_compile_into_both_phases(pdl):
    """``splitkv_partials(probe=)`` and ``combine_splits(probe=)`` (``benchmarks/splitkv_probe.py``) for sm_90: each
    program reads ``%smid`` once and ``%globaltimer`` at its start, at its first key load or first read of a
    partial (after ``griddepcontrol.wait`` under PDL) and at its end; without the probe neither is read."""
    from mla_fa3.ops.splitkv_compile import compile_combine_for_hopper

    config = choose_config(16, 4, 32768)
    for compiled, plain in ((compile_for_hopper(config, pdl=pdl, probe=True), compile_for_hopper(config, pdl=pdl)),
                            (compile_combine_for_hopper(pdl=pdl, probe=True), compile_combine_for_hopper(pdl=pdl))):
        ptx = compiled.asm["ptx"]
        assert ptx.count("%globaltimer") == 3 and ptx.count("%smid") == 1, ptx.count("%globaltimer")
        assert "%globaltimer" not in plain.asm["ptx"] and "%smid" not in plain.asm["ptx"]
        if pdl:
            waits = [i for i, line in enumerate(ptx.splitlines()) if "griddepcontrol.wait" in line]
            stamps = [i for i, line in enumerate(ptx.splitlines()) if "%globaltimer" in line]
            assert len(waits) == 1 and stamps[0] < waits[0] < stamps[1], (waits, stamps)


@pytest.mark.parametrize("half_partials", [True, False], ids=["bf16", "fp32"])
def test_the_combine_drops_its_partial_lines_after_a_barrier(half_partials):
    """``combine_splits(discard=True)`` (``KernelConfig.discard_partials``): after its loads — behind a CTA barrier,
    since a discarded line is undefined — one predicated ``discard.global.L2`` of 128 bytes per line of its column
    block (bf16 partials: one line of 64 columns, fp32: two), in a loop over the splits; without it none."""
    from mla_fa3.ops.splitkv_compile import compile_combine_for_hopper

    ptx = compile_combine_for_hopper(half_partials=half_partials, discard=True).asm["ptx"]
    plain = compile_combine_for_hopper(half_partials=half_partials).asm["ptx"]
    assert "discard.global.L2" not in plain
    assert ptx.count("discard.global.L2") == (1 if half_partials else 2), ptx.count("discard.global.L2")
    assert "@p discard.global.L2" in ptx
    lines = ptx.splitlines()
    first = next(i for i, line in enumerate(lines) if "discard.global.L2" in line)
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    loop_end = max(i for i, line in enumerate(lines[:first])  # the splits loop's backward branch, before the discards
                   if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)) and labels.get(m.group(1), i) < i)
    assert any("bar.sync" in line for line in lines[loop_end:first]), "no barrier between the loads and the discards"
