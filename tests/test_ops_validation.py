"""Boundary checks of ``mla_fa3.ops``: every bad input raises a named ValueError/TypeError before any kernel.

Each case mutates one argument of a valid call; the message must start with that argument's name.
FA3-only restrictions are checked through ``validate`` directly (no GPU here), and the dispatch
helpers (``set_impl`` / ``use_impl`` / ``last_impl`` / ``KernelUnavailableError``) are covered too.
"""

from __future__ import annotations

import pytest
import torch

from mla_fa3 import ops
from mla_fa3.ops import reference, validate
from mla_fa3.ops.types import Impl

I32, I64 = torch.int32, torch.int64


def kvcache_args(*, H=4, h_kv=2, d=16, dv=8, bs=2, ps=4, varlen=True, dtype=torch.float32):
    """A valid flash_attn_with_kvcache call: (args tuple, kwargs dict)."""
    q = torch.randn(5, H, d, dtype=dtype) if varlen else torch.randn(bs, 2, H, d, dtype=dtype)
    kw = dict(page_table=torch.zeros(bs, 3, dtype=I32), cache_seqlens=torch.full((bs,), 4, dtype=I32))
    if varlen:
        kw.update(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=I32), max_seqlen_q=3)
    return [q, torch.randn(6, ps, h_kv, d, dtype=dtype), torch.randn(6, ps, h_kv, dv, dtype=dtype)], kw


def _mut(arg=None, index=None, **kw_updates):
    """A mutation: replace positional ``index`` with ``arg`` and/or update keyword arguments."""
    def apply(args, kw):
        if index is not None:
            args[index] = arg(args) if callable(arg) else arg
        for k, v in kw_updates.items():
            if callable(v):
                kw[k] = v(args, kw)
            elif v is _DROP:
                kw.pop(k)
            else:
                kw[k] = v
    return apply


_DROP = object()

# name -> (mutation, exception, message prefix = the argument's name)
KVCACHE_BAD = {
    "q_not_tensor": (_mut(index=0, arg=[1.0]), TypeError, "q"),
    "q_int": (_mut(index=0, arg=lambda a: a[0].to(I32)), ValueError, "q"),
    "q_rank2": (_mut(index=0, arg=lambda a: a[0][:, 0]), ValueError, "q"),
    "q_dtype_vs_cache": (_mut(index=0, arg=lambda a: a[0].double()), ValueError, "q dtype"),
    "k_cache_rank3": (_mut(index=1, arg=lambda a: a[1][:, 0]), ValueError, "k_cache"),
    "k_cache_head_dim": (_mut(index=1, arg=lambda a: a[1][..., :8]), ValueError, "k_cache head dim"),
    "v_cache_dtype": (_mut(index=2, arg=lambda a: a[2].double()), ValueError, "v_cache dtype"),
    "v_cache_pages": (_mut(index=2, arg=lambda a: a[2][:5]), ValueError, "v_cache"),
    "heads_not_multiple": (_mut(index=0, arg=lambda a: torch.randn(5, 3, 16)), ValueError, "q heads"),
    "page_table_int64": (_mut(page_table=lambda a, k: k["page_table"].to(I64)), ValueError, "page_table must be int32"),
    "page_table_rows": (_mut(page_table=lambda a, k: k["page_table"][:1]), ValueError, "page_table"),
    "page_table_rank1": (_mut(page_table=lambda a, k: k["page_table"][0]), ValueError, "page_table"),
    "cache_seqlens_int64": (_mut(cache_seqlens=lambda a, k: k["cache_seqlens"].to(I64)), ValueError, "cache_seqlens"),
    "cache_seqlens_list": (_mut(cache_seqlens=[4, 4]), TypeError, "cache_seqlens"),
    "cu_seqlens_q_missing": (_mut(cu_seqlens_q=_DROP), ValueError, "cu_seqlens_q"),
    "cu_seqlens_q_int64": (_mut(cu_seqlens_q=lambda a, k: k["cu_seqlens_q"].to(I64)), ValueError, "cu_seqlens_q"),
    "cu_seqlens_q_length": (_mut(cu_seqlens_q=torch.tensor([0, 5], dtype=I32)), ValueError, "cu_seqlens_q"),
    "max_seqlen_q_missing": (_mut(max_seqlen_q=_DROP), ValueError, "max_seqlen_q"),
    "max_seqlen_q_tensor": (_mut(max_seqlen_q=torch.tensor(3)), TypeError, "max_seqlen_q"),
    "qv_head_dim": (_mut(qv=lambda a, k: torch.randn(5, 4, 16)), ValueError, "qv"),
    "qv_dtype": (_mut(qv=lambda a, k: torch.randn(5, 4, 8, dtype=torch.float64)), ValueError, "qv dtype"),
    "window_not_pair": (_mut(window_size=(3,)), TypeError, "window_size"),
    "window_below_minus_one": (_mut(window_size=(-2, 0)), ValueError, "window_size"),
    "softcap_negative": (_mut(softcap=-1.0), ValueError, "softcap"),
    "softmax_scale_nan": (_mut(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    "causal_not_bool": (_mut(causal=1), TypeError, "causal"),
    "num_splits_negative": (_mut(num_splits=-1), ValueError, "num_splits"),
    "k_descale_without_fp8": (_mut(k_descale=torch.ones(2, 2)), ValueError, "k_descale"),
}


@pytest.mark.parametrize("name", list(KVCACHE_BAD))
def test_kvcache_bad_input_named_before_kernel(name, monkeypatch):
    mutate, exc, prefix = KVCACHE_BAD[name]
    args, kw = kvcache_args()
    mutate(args, kw)
    monkeypatch.setattr(reference, "flash_attn_with_kvcache", lambda call: pytest.fail("kernel ran"))
    with pytest.raises(exc) as info:
        ops.flash_attn_with_kvcache(*args, **kw)
    assert str(info.value).startswith(prefix), str(info.value)


def test_batched_q_rejects_cu_seqlens_and_wrong_batch():
    args, kw = kvcache_args(varlen=False)
    with pytest.raises(ValueError, match="^cu_seqlens_q must be None"):
        ops.flash_attn_with_kvcache(*args, **kw, cu_seqlens_q=torch.tensor([0, 2, 4], dtype=I32), max_seqlen_q=2)
    with pytest.raises(ValueError, match="^q batch dim"):
        ops.flash_attn_with_kvcache(args[0][:1], args[1], args[2], **kw)


def test_fp8_cache_needs_descales_of_shape_bs_hkv():
    args, kw = kvcache_args()
    args = [a.to(torch.float8_e4m3fn) for a in args]
    with pytest.raises(ValueError, match="^k_descale is required"):
        ops.flash_attn_with_kvcache(*args, **kw)
    with pytest.raises(ValueError, match=r"^v_descale must have shape \(2, 2\)"):
        ops.flash_attn_with_kvcache(*args, **kw, k_descale=torch.ones(2, 2), v_descale=torch.ones(2))
    with pytest.raises(ValueError, match="^k_descale must be float32"):
        ops.flash_attn_with_kvcache(*args, **kw, k_descale=torch.ones(2, 2, dtype=torch.float64),
                                    v_descale=torch.ones(2, 2))


def test_reference_checks_values_it_reads():
    args, kw = kvcache_args()
    kw["cache_seqlens"] = torch.tensor([4, 13], dtype=I32)  # 13 tokens need 4 pages of 4, table has 3
    with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] = 13"):
        ops.flash_attn_with_kvcache(*args, **kw)
    args, kw = kvcache_args()
    kw["page_table"] = torch.tensor([[0, 0, 0], [99, 0, 0]], dtype=I32)  # used entry out of range
    with pytest.raises(ValueError, match=r"^page_table\[1, :1\]"):
        ops.flash_attn_with_kvcache(*args, **kw)


# ------------------------------------------------------------------ FA3-only restrictions (validate)


def _fa3_check(args, kw):
    full = dict(qv=None, cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=True, window_size=(-1, -1),
                softcap=0.0, k_descale=None, v_descale=None, q_descale=None, num_splits=0)
    full.update(kw)
    return validate.check_kvcache(*args, **full, impl=Impl.FA3)


def test_fa3_rejects_fp32_and_accepts_bf16():
    args, kw = kvcache_args()
    with pytest.raises(ValueError, match="^q dtype torch.float32 is not supported by FA3"):
        _fa3_check(args, kw)
    args, kw = kvcache_args(dtype=torch.bfloat16)
    call = _fa3_check(args, kw)
    assert call.varlen and call.batch_size == 2 and call.softmax_scale == pytest.approx(16**-0.5)
    assert call.out_dtype is torch.bfloat16


def test_fa3_rejects_fp8_cache_with_qv():
    args, kw = kvcache_args(h_kv=1, d=64, dv=512)
    args = [a.to(torch.float8_e4m3fn) for a in args]
    kw.update(qv=torch.randn(5, 4, 512).to(torch.float8_e4m3fn), k_descale=torch.ones(2, 1), v_descale=torch.ones(2, 1))
    with pytest.raises(ValueError, match="^qv is not supported by FA3 with a torch.float8_e4m3fn cache"):
        _fa3_check(args, kw)
    ref = validate.check_kvcache(*args, **{**dict(cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None,
                                 causal=True, window_size=(-1, -1), softcap=0.0, q_descale=None, num_splits=0), **kw},
                                 impl=Impl.REFERENCE)
    assert ref.out_dtype is torch.bfloat16  # the reference takes the combination


def test_fa3_rejects_qv_with_small_v_head_dim():
    args, kw = kvcache_args(h_kv=1, d=64, dv=128, dtype=torch.bfloat16)
    kw.update(qv=torch.randn(5, 4, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^qv needs a v head dim >= 256 in FA3, got 128"):
        _fa3_check(args, kw)
    args, kw = kvcache_args(h_kv=1, d=64, dv=256, dtype=torch.bfloat16)
    kw.update(qv=torch.randn(5, 4, 256, dtype=torch.bfloat16))
    assert _fa3_check(args, kw).batch_size == 2


def test_fa3_head_dims_and_strides():
    args, kw = kvcache_args(d=12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^q head dim must be a multiple of 8"):
        _fa3_check(args, kw)
    args, kw = kvcache_args(d=128, dv=64, dtype=torch.bfloat16)  # neither (192, 128) nor (<= 64, <= 512)
    with pytest.raises(ValueError, match="^v head dim 64 with q head dim 128 is not supported by FA3"):
        _fa3_check(args, kw)
    args, kw = kvcache_args(d=64, dv=512, dtype=torch.bfloat16)
    _fa3_check(args, kw)  # the absorbed-MLA family is accepted
    args, kw = kvcache_args(d=128, dv=512, dtype=torch.bfloat16)
    kw["qv"] = torch.randn(5, 4, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^v head dim 512 with q head dim 128"):
        _fa3_check(args, kw)
    args, kw = kvcache_args(dtype=torch.bfloat16)
    args[0] = torch.randn(5, 4, 32, dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match="^q must have a contiguous last dimension"):
        _fa3_check(args, kw)


def test_fa3_varlen_and_merge_restrictions():
    q = torch.randn(3, 2, 16)
    cu = torch.tensor([0, 3], dtype=I32)
    with pytest.raises(ValueError, match="^q dtype torch.float32 is not supported by FA3 varlen"):
        validate.check_varlen(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, impl=Impl.FA3)
    o, lse = torch.randn(3, 2, 12, dtype=torch.bfloat16), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="^o_a head dim must be a multiple of 8"):
        validate.check_merge(o, lse, o, lse, impl=Impl.FA3)


# ------------------------------------------------------------------ varlen / merge / FlashMLA


def test_varlen_bad_inputs():
    q, k, v = torch.randn(4, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 8)
    cq, ck = torch.tensor([0, 1, 4], dtype=I32), torch.tensor([0, 2, 6], dtype=I32)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=3, max_seqlen_k=4)
    for bad, exc, prefix in [
        (dict(cu_seqlens_k=ck.to(I64)), ValueError, "cu_seqlens_k must be int32"),
        (dict(cu_seqlens_k=ck[:2]), ValueError, "cu_seqlens_k must have as many entries"),
        (dict(max_seqlen_k=None), TypeError, "max_seqlen_k"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ]:
        with pytest.raises(exc, match=f"^{prefix}"):
            ops.flash_attn_varlen_func(q, k, v, **{**kw, **bad})
    with pytest.raises(ValueError, match="^v must share k's"):
        ops.flash_attn_varlen_func(q, k, v[:5], **kw)
    with pytest.raises(ValueError, match="^k head dim"):
        ops.flash_attn_varlen_func(q, k[..., :8], v, **kw)
    with pytest.raises(ValueError, match="^cu_seqlens_q must rise from 0"):  # value check of the reference
        ops.flash_attn_varlen_func(q, k, v, **{**kw, "cu_seqlens_q": torch.tensor([0, 1, 3], dtype=I32)})


def test_merge_bad_inputs():
    o, lse = torch.randn(3, 2, 8), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="^lse_b must be float32"):
        ops.merge_state(o, lse, o, lse.double())
    with pytest.raises(ValueError, match=r"^lse_a must have shape \[T, H\]"):
        ops.merge_state(o, lse.t(), o, lse)
    with pytest.raises(ValueError, match="^o_b must have o_a's shape"):
        ops.merge_state(o, lse, o[:2], lse)
    with pytest.raises(ValueError, match="^o_b dtype"):
        ops.merge_state(o, lse, o.bfloat16(), lse)


def test_flash_mla_bad_inputs():
    lens = torch.tensor([5], dtype=I32)
    q, kv, table = torch.randn(1, 1, 4, 40), torch.randn(2, 8, 1, 40), torch.zeros(1, 2, dtype=I32)
    sched = ops.get_mla_decode_metadata(lens, 4)
    kw = dict(head_dim_v=32, schedule=sched, softmax_scale=0.1, causal=True)
    with pytest.raises(TypeError, match="causal"):  # no default: sgl-kernel's is False, ours was True
        ops.flash_mla_with_kvcache(q, kv, table, lens, head_dim_v=32, schedule=sched, softmax_scale=0.1)
    with pytest.raises(TypeError, match="^schedule must be a FlashMLASchedule"):
        ops.flash_mla_with_kvcache(q, kv, table, lens, **{**kw, "schedule": None})
    with pytest.raises(ValueError, match="^head_dim_v must be <="):
        ops.flash_mla_with_kvcache(q, kv, table, lens, **{**kw, "head_dim_v": 41})
    with pytest.raises(ValueError, match="^kv_cache must have one"):
        ops.flash_mla_with_kvcache(q, kv.expand(2, 8, 2, 40), table, lens, **kw)
    with pytest.raises(ValueError, match="^descale_q is required"):
        f8 = torch.float8_e4m3fn
        ops.flash_mla_with_kvcache(q.to(f8), kv.to(f8), table, lens, **kw)
    with pytest.raises(ValueError, match="^schedule was planned with is_fp8=False"):
        ops.flash_mla_with_kvcache(q.to(f8), kv.to(f8), table, lens, **kw, descale_q=torch.ones(1),
                                   descale_k=torch.ones(1))
    with pytest.raises(ValueError, match="^num_q_heads_per_kv must be >= 1"):
        ops.get_mla_decode_metadata(lens, 0)
    with pytest.raises(ValueError, match="^cache_seqlens must be int32"):
        ops.get_mla_decode_metadata(lens.long(), 4)
    call_kw = dict(head_dim_v=32, schedule=sched, softmax_scale=0.1, causal=True, descale_q=None, descale_k=None)
    with pytest.raises(ValueError, match="^schedule was planned by the reference"):
        validate.check_flash_mla(q.bfloat16(), kv.bfloat16(), table, lens, **call_kw, impl=Impl.FA3)


# ------------------------------------------------------------------ dispatch


def test_impl_selection_and_last_impl():
    assert ops.get_impl() is Impl.AUTO
    args, kw = kvcache_args()
    ops.flash_attn_with_kvcache(*args, **kw)  # AUTO on CPU -> reference
    assert ops.last_impl() is Impl.REFERENCE
    with ops.use_impl("reference") as chosen:
        assert chosen is Impl.REFERENCE and ops.get_impl() is Impl.REFERENCE
    assert ops.get_impl() is Impl.AUTO
    ops.set_impl(Impl.REFERENCE)
    try:
        assert ops.get_impl() is Impl.REFERENCE
    finally:
        ops.set_impl("auto")
    with pytest.raises(ValueError, match="^impl must be one of"):
        ops.set_impl("cuda")
    with pytest.raises(TypeError, match="^impl must be an Impl or str"):
        ops.flash_attn_with_kvcache(*args, **kw, impl=3)


@pytest.mark.skipif(ops.fa3_available(), reason="FA3 is available here")
def test_fa3_unavailable_is_actionable():
    assert not ops.fa3_available()
    args, kw = kvcache_args(dtype=torch.bfloat16)
    with pytest.raises(ops.KernelUnavailableError, match=r'pip install "mla-fa3\[gpu\]"'):
        ops.flash_attn_with_kvcache(*args, **kw, impl="fa3")
    with ops.use_impl("fa3"), pytest.raises(ops.KernelUnavailableError, match="cpu"):
        ops.merge_state(torch.zeros(1, 1, 8), torch.zeros(1, 1), torch.zeros(1, 1, 8), torch.zeros(1, 1))
    assert issubclass(ops.KernelUnavailableError, RuntimeError)
