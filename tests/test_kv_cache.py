"""ReqToTokenPool, PagedAllocator, MLATokenPool, MHATokenPool against plain-Python models of them.

The allocator fuzz keeps its own model (per request a Python list of the slots handed out) and
checks after every operation: no slot owned twice, page 0 never handed out, token j of a request at
offset j % p of the request's (j // p)-th page, req_to_token equal to the model, free + owned pages
partitioning 1 .. P-1, and an exhausted allocation changing nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from mla_fa3.kv.pools import FP8_E4M3_MAX, MHATokenPool, MLATokenPool
from mla_fa3.kv.req_to_token import OutOfSlotsError, ReqToTokenPool, encoder_region_columns
from mla_fa3.kv.allocator import PagedAllocator


# ---------------------------------------------------------------------------------- allocator
def _check_invariants(alloc: PagedAllocator, pool: ReqToTokenPool, model: dict[int, list[int]]) -> None:
    p = alloc.page_size
    seen: set[int] = set()
    owned_pages: set[int] = set()
    for req, slots in model.items():
        assert pool.req_to_token[req, : len(slots)].tolist() == slots
        assert pool.req_to_token[req, len(slots):].eq(0).all()
        for j, s in enumerate(slots):
            assert s not in seen, f"slot {s} handed out twice"
            seen.add(s)
            assert s // p != 0, "page 0 handed out"
            assert s % p == j % p, "token not at its page offset"
            assert s // p == slots[j - j % p] // p, "a page's tokens are split over pages"
        pages = alloc.request_pages(req)
        assert [slots[i] // p for i in range(0, len(slots), p)] == pages[: -(-len(slots) // p)]
        assert not owned_pages & set(pages)
        owned_pages |= set(pages)
    assert 0 not in owned_pages
    assert len(owned_pages) + alloc.num_free_pages() == alloc.num_pages - 1


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allocator_fuzz(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    pool = ReqToTokenPool(6, 96, "cpu")
    alloc = PagedAllocator(1 + 40 // page_size + 3, page_size, "cpu")
    rows = pool.alloc(6)
    model: dict[int, list[int]] = {r: [] for r in rows}
    exhausted = 0
    for _ in range(300):
        req = rng.choice(rows)
        op = rng.random()
        if op < 0.65:
            cur = len(model[req])
            start = cur if rng.random() < 0.8 else rng.randint(max(0, cur - 3), cur)  # rewinds too
            n = rng.randint(0, 9)
            if start + n > 96:
                continue
            before = (pool.req_to_token.clone(), alloc.num_free_pages(), alloc.request_pages(req))
            try:
                slots = alloc.alloc_for_request(pool, req, start, n)
            except OutOfSlotsError as exc:
                exhausted += 1
                assert "pages" in str(exc)
                assert torch.equal(pool.req_to_token, before[0])
                assert (alloc.num_free_pages(), alloc.request_pages(req)) == before[1:]
            else:
                assert slots.dtype == torch.int64 and slots.shape == (n,)
                if start < cur:  # rewound: the old slots are reused, in place
                    assert slots[: cur - start].tolist() == model[req][start:cur][: n]
                model[req] = model[req][:start] + slots.tolist() + model[req][start + n:]
        elif op < 0.8:
            keep = rng.randint(0, len(model[req]))
            alloc.truncate_request(pool, req, keep)
            model[req] = model[req][:keep]
        else:
            alloc.free_request(pool, req)
            model[req] = []
        _check_invariants(alloc, pool, model)
    assert exhausted > 0, "the fuzz never reached exhaustion: shrink the pool"


def test_alloc_continues_the_last_partial_page() -> None:
    pool = ReqToTokenPool(2, 32, "cpu")
    pool.alloc(2)
    alloc = PagedAllocator(8, 4, "cpu")
    a = alloc.alloc_for_request(pool, 1, 0, 3).tolist()
    b = alloc.alloc_for_request(pool, 1, 3, 2).tolist()
    assert b[0] == a[0] + 3  # token 3 fills the first page
    assert b[1] // 4 != a[0] // 4 and b[1] % 4 == 0  # token 4 opens a new page at offset 0
    assert alloc.num_free_pages() == 7 - 2


def test_encoder_region_then_decoder_starts_on_a_page_border() -> None:
    pool = ReqToTokenPool(1, 64, "cpu")
    pool.alloc(1)
    alloc = PagedAllocator(10, 8, "cpu")
    enc = alloc.alloc_for_request(pool, 0, 0, 5)
    col = encoder_region_columns(5, 8)
    assert col == 8 and encoder_region_columns(16, 8) == 16 and encoder_region_columns(0, 8) == 0
    dec = alloc.alloc_for_request(pool, 0, col, 3)
    assert dec[0] % 8 == 0 and dec[0] // 8 != enc[0] // 8
    assert pool.req_to_token[0, 5:8].eq(0).all()


@pytest.mark.parametrize("page_size", [0, 3, 6, -4, True, 2.0])
def test_page_size_must_be_a_power_of_two(page_size) -> None:
    with pytest.raises(ValueError, match="page_size"):
        PagedAllocator(8, page_size, "cpu")
    with pytest.raises(ValueError, match="page_size"):
        MLATokenPool(1, 8, page_size, 4, 2, torch.float32, "cpu")


def test_allocator_named_errors() -> None:
    pool = ReqToTokenPool(2, 16, "cpu")
    pool.alloc(2)
    alloc = PagedAllocator(4, 4, "cpu")
    with pytest.raises(ValueError, match="start"):
        alloc.alloc_for_request(pool, 0, 4, 1)  # would skip a whole page
    with pytest.raises(ValueError, match="req_idx"):
        alloc.alloc_for_request(pool, 2, 0, 1)
    with pytest.raises(ValueError, match="max_context"):
        alloc.alloc_for_request(pool, 0, 0, 17)
    with pytest.raises(OutOfSlotsError, match="pages"):
        alloc.alloc_for_request(pool, 0, 0, 16)  # 4 pages asked, 3 usable
    assert isinstance(OutOfSlotsError("x"), ValueError)
    pages = alloc.alloc_pages(2)
    with pytest.raises(ValueError, match="ids"):
        alloc.free_pages([0])
    alloc.free_pages(pages)
    with pytest.raises(ValueError, match="already free"):
        alloc.free_pages(pages[:1])


def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert sorted(rows) == [0, 1, 2]
    with pytest.raises(OutOfSlotsError, match="n = 1"):
        pool.alloc(1)
    pool.req_to_token[rows[1]] = 7
    pool.free(rows[1])
    assert pool.req_to_token[rows[1]].eq(0).all() and pool.available_size() == 1
    with pytest.raises(ValueError, match="idx"):
        pool.free(rows[1])
    assert pool.alloc(1) == [rows[1]]


# ---------------------------------------------------------------------------------- pools
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_pool_set_kv_reads_back_through_paged_views(dtype, page_size) -> None:
    g = torch.Generator().manual_seed(0)
    r, dr, pages = 12, 4, 8
    pool = MLATokenPool(2, pages, page_size, r, dr, dtype, "cpu")
    loc = torch.randperm(pages * page_size, generator=g)[:7]
    c_kv, k_rope = torch.randn(7, r, generator=g), torch.randn(7, dr, generator=g)
    pool.set_kv(1, loc, c_kv, k_rope)
    paged, ckv_v, kr_v = pool.paged(1), pool.c_kv_paged(1), pool.k_rope_paged(1)
    assert paged.shape == (pages, page_size, 1, r + dr)
    assert ckv_v.shape == (pages, page_size, 1, r) and kr_v.shape == (pages, page_size, 1, dr)
    for i, s in enumerate(loc.tolist()):
        page, off = divmod(s, page_size)
        assert torch.equal(ckv_v[page, off, 0], c_kv[i].to(dtype))
        assert torch.equal(kr_v[page, off, 0], k_rope[i].to(dtype))
    # zero-copy: the views alias the layer buffer
    assert ckv_v.data_ptr() == pool.kv_buffer[1].data_ptr()
    assert kr_v.data_ptr() == pool.kv_buffer[1].data_ptr() + r * pool.kv_buffer[1].element_size()
    assert pool.kv_buffer[0].eq(0).all()  # other layer untouched
    pool.set_latent(0, loc[:2], torch.ones(2, r + dr))
    assert pool.paged(0)[loc[0] // page_size, loc[0] % page_size].eq(1).all()


def test_mla_pool_named_errors() -> None:
    pool = MLATokenPool(1, 4, 4, 8, 2, torch.bfloat16, "cpu")
    loc = torch.tensor([1, 2])
    ok_c, ok_r = torch.zeros(2, 8), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="loc must be in"):
        pool.set_kv(0, torch.tensor([1, 16]), ok_c, ok_r)
    with pytest.raises(ValueError, match="loc must be in"):
        pool.set_kv(0, torch.tensor([-1, 2]), ok_c, ok_r)
    with pytest.raises(TypeError, match="loc"):
        pool.set_kv(0, loc.float(), ok_c, ok_r)
    with pytest.raises(ValueError, match="c_kv"):
        pool.set_kv(0, loc, torch.zeros(2, 7), ok_r)
    with pytest.raises(ValueError, match="k_rope"):
        pool.set_kv(0, loc, ok_c, torch.zeros(3, 2))
    with pytest.raises(TypeError, match="c_kv"):
        pool.set_kv(0, loc, ok_c.long(), ok_r)
    with pytest.raises(ValueError, match="layer"):
        pool.set_kv(1, loc, ok_c, ok_r)
    with pytest.raises(TypeError, match="dtype"):
        MLATokenPool(1, 4, 4, 8, 2, torch.int8, "cpu")


@pytest.mark.parametrize("page_size", [1, 8])
def test_mha_pool_set_kv_reads_back(page_size) -> None:
    g = torch.Generator().manual_seed(1)
    pool = MHATokenPool(2, 4, page_size, 2, 8, 6, torch.float32, "cpu")
    loc = torch.tensor([page_size, 3 * page_size - 1 if page_size > 1 else 2])
    k, v = torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 6, generator=g)
    pool.set_kv(0, loc, k, v)
    kp, vp = pool.k_paged(0), pool.v_paged(0)
    assert kp.shape == (4, page_size, 2, 8) and vp.shape == (4, page_size, 2, 6)
    for i, s in enumerate(loc.tolist()):
        assert torch.equal(kp[s // page_size, s % page_size], k[i])
        assert torch.equal(vp[s // page_size, s % page_size], v[i])
    assert pool.k_scale is None and pool.descales(0, 3) == (None, None)
    with pytest.raises(ValueError, match="v must have shape"):
        pool.set_kv(0, loc, k, torch.zeros(2, 2, 8))


def test_mha_pool_fp8_round_trip_within_e4m3_precision() -> None:
    g = torch.Generator().manual_seed(2)
    pool = MHATokenPool(2, 8, 4, 2, 16, 16, torch.bfloat16, "cpu", kv_dtype=torch.float8_e4m3fn)
    k_scale, v_scale = 0.05, 0.2
    pool.set_scales(1, k_scale, v_scale)
    loc = torch.arange(4, 20)
    k = torch.randn(16, 2, 16, generator=g) * 3
    v = torch.randn(16, 2, 16, generator=g)
    k[0, 0, 0] = 1000.0  # beyond 448 * k_scale: clamps
    pool.set_kv(1, loc, k.bfloat16(), v.bfloat16())
    assert pool.k_buffer[1].dtype == torch.float8_e4m3fn
    k_back, v_back = pool.dequantized(1, loc)
    for x, back, scale in ((k.bfloat16().double(), k_back.double(), k_scale),
                           (v.bfloat16().double(), v_back.double(), v_scale)):
        expect = x.clamp(-FP8_E4M3_MAX * scale, FP8_E4M3_MAX * scale)
        # e4m3: 3 mantissa bits -> relative rounding <= 2^-4 for normals; subnormal step 2^-9 * scale;
        # plus the bf16 rounding of the dequantized value (2^-8 relative)
        bound = expect.abs() * (2 ** -4 + 2 ** -8) + 2 ** -9 * scale
        assert ((back - expect).abs() <= bound + 1e-12).all()
    assert k_back[0, 0, 0].item() == pytest.approx(448 * k_scale, rel=1e-2)
    kd, vd = pool.descales(1, 3)
    assert kd.shape == (3, 2) and kd.dtype == torch.float32 and float(kd[2, 1]) == pytest.approx(k_scale)
    assert float(vd[0, 0]) == pytest.approx(v_scale)
    assert float(pool.k_scale[0]) == 1.0  # other layers keep their scale
    with pytest.raises(ValueError, match="k_scale"):
        pool.set_scales(0, 0.0, 1.0)
    with pytest.raises(TypeError, match="kv_dtype"):
        MHATokenPool(1, 2, 4, 1, 8, 8, torch.bfloat16, "cpu", kv_dtype=torch.int8)


@pytest.mark.parametrize("pool_kind", ["mla", "mha_bf16", "mha_fp8"])
def test_clear_pages_zeroes_exactly_those_pages_in_every_layer(pool_kind):
    if pool_kind == "mla":
        pool = MLATokenPool(2, 6, 4, 8, 4, torch.float32, "cpu")
    else:
        kv_dtype = torch.float8_e4m3fn if pool_kind == "mha_fp8" else None
        pool = MHATokenPool(2, 6, 4, 2, 16, 16, torch.bfloat16, "cpu", kv_dtype=kv_dtype)
    bufs = pool._buffers()
    for buf in bufs:
        buf.view(torch.uint8).fill_(0x7F)  # NaN bit patterns everywhere (fp32, bf16 and e4m3)
    pool.clear_pages([4, 1])
    for buf in bufs:
        pages = buf.view(torch.uint8).view(pool.num_pages, -1)
        for page in range(pool.num_pages):
            expect = 0 if page in (1, 4) else 0x7F
            assert bool((pages[page] == expect).all()), (page, expect)
        assert bool((buf.float().view(pool.num_pages, -1)[[1, 4]] == 0).all())
    with pytest.raises(ValueError, match="^page_ids must be in"):
        pool.clear_pages([6])
