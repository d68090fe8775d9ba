"""MLATokenPool and MHATokenPool: writes read back through the paged views, FP8 scales, page clearing."""

from __future__ import annotations

import pytest
import torch

from mla_fa3.kv.pools import FP8_E4M3_MAX, MHATokenPool, MLATokenPool


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


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("parts", [(torch.bfloat16, torch.float32), (torch.float64, torch.float16),
                                   (torch.float32, torch.float32)])
def test_mla_pool_stores_each_part_as_its_own_cast_whatever_the_two_dtypes(kv_dtype, parts) -> None:
    """set_kv takes c_kv and k_rope in one store (one launch on CUDA): with parts of different dtypes each is still
    stored as it would be alone — oracle: the part cast straight to the storage dtype (bf16), or divided by the
    scale in fp32 and rounded to e4m3 (the FP8 pool) — never rounded through the other part's dtype."""
    g = torch.Generator().manual_seed(3)
    r, dr, page_size = 12, 4, 4
    pool = MLATokenPool(1, 4, page_size, r, dr, torch.bfloat16, "cpu", kv_dtype=kv_dtype)
    loc = torch.tensor([3, 9, 14])
    c_kv = (torch.randn(3, r, generator=g, dtype=torch.float64) * 3).to(parts[0])
    k_rope = (1 + torch.rand(3, dr, generator=g, dtype=torch.float64) * 2 ** -9).to(parts[1])  # bf16 / e4m3 ties
    pool.set_kv(0, loc, c_kv, k_rope)
    row = pool.paged(0).view(-1, r + dr)[loc]
    if kv_dtype == torch.bfloat16:
        want_c, want_r = c_kv.to(torch.bfloat16), k_rope.to(torch.bfloat16)
    else:
        s = float(pool.layer_scale(0))
        want_c = (c_kv.float() / s).to(torch.float8_e4m3fn)
        want_r = (k_rope.float() / s).to(torch.float8_e4m3fn)
    assert torch.equal(row[:, :r].float(), want_c.float()) and torch.equal(row[:, r:].float(), want_r.float())


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


def test_mla_pool_storage_dtype_is_the_compute_dtype_or_e4m3() -> None:
    """A floating storage dtype other than the compute dtype would hand the kernels a cache in another
    dtype than q: refused at construction, nothing allocated."""
    with pytest.raises(TypeError, match="kv_dtype must be None, torch.float8_e4m3fn or dtype"):
        MLATokenPool(1, 4, 16, 8, 4, torch.bfloat16, "cpu", kv_dtype=torch.float32)
    pool = MLATokenPool(1, 4, 16, 8, 4, torch.bfloat16, "cpu", kv_dtype=torch.bfloat16)
    x = torch.randn(3, 12, dtype=torch.bfloat16)
    pool.set_latent(0, torch.tensor([16, 17, 40]), x)
    assert torch.equal(pool.kv_buffer[0][[16, 17, 40]], x)
