"""``ops.tree_attention``'s Triton kernel (``ops/tree_attention_triton.py``): the tree part of a speculative tree step.

Oracle: an fp64 loop over requests, query rows and heads that softmaxes each row over exactly the keys its mask
shows (nothing of the code under test). On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``,
this file as a script in a subprocess) in fp32 and fp16 — not bf16, whose ``tl.dot`` the interpreter gets wrong
(triton-lang/triton#11584); the GPU case below covers bf16 against the same oracle with the project's precision rule.
The torch form (the reference) runs the same cases in-process. Cases: ancestor masks of chains, stars and random trees, random masks with rows that see nothing, m != n, 1 to 128
heads (both tile heights), DeepSeek's 512 + 64 latent row, strided q, softcap, an e4m3 cache with its scale, and NaN
in every slot no query sees (poisoned rows, a future draft step's slots).
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreter_main, run_cases, run_under_interpreter
from mla_cases import check_bf16_rule
from tree_cases import ancestors_mask, chain, random_tree, star

from mla_fa3 import ops
from mla_fa3.ops.fp8 import quantize_e4m3
from mla_fa3.ops.types import KernelUnavailableError

FP8 = torch.float8_e4m3fn
NAN = float("nan")


def tree_masks(kind: str, bs: int, n: int, seed: int) -> torch.Tensor:
    """[bs, n, n] bool: each request's draft tree as SGLang verifies it (row i sees its ancestors and itself), or
    (``random``) arbitrary masks of m = n + 3 rows, one row of each request seeing nothing and one key seen by none."""
    rng = random.Random(seed)
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        mask = torch.rand(bs, n + 3, n, generator=g) < 0.5
        mask[:, 1] = False
        mask[:, :, -1] = False  # a tree key no row sees (its slot is poisoned: check_against_oracle)
        return mask
    make = {"chain": chain, "star": star, "tree": lambda k: random_tree(k, rng)}[kind]
    return torch.stack([ancestors_mask(make(n)) for _ in range(bs)])


def inputs(bs, m, n, H, r, dr, dtype, *, kv_dtype=None, seed=0, slots_total=None):
    """q_lat / q_rope as strided views (slices of wider tensors, as the absorbed q is), the pool's rows with NaN in
    every slot that is not one of a request's tree keys, distinct slots per request."""
    g = torch.Generator().manual_seed(seed)
    T = bs * m
    q_lat = torch.randn(T, H, r + 8, generator=g).to(dtype)[..., 4: 4 + r]
    q_rope = torch.randn(T, H, dr + 8, generator=g).to(dtype)[..., 2: 2 + dr]
    S = slots_total or 2 * bs * n + 5
    kv = torch.full((S, r + dr), NAN)
    key_slots = torch.randperm(S, generator=g)[: bs * n].view(bs, n)
    rows = torch.randn(bs * n, r + dr, generator=g)
    kv_scale = None
    if kv_dtype == FP8:
        kv_scale = torch.tensor([rows.abs().max().item() / 448.0])
        kv = torch.empty(S, r + dr, dtype=FP8)
        kv.view(torch.uint8).fill_(0x7F)  # e4m3's NaN (the quantization maps NaN to 0)
        kv[key_slots.reshape(-1)] = quantize_e4m3(rows, kv_scale)
    else:
        kv[key_slots.reshape(-1)] = rows
        kv = kv.to(dtype)
    return q_lat, q_rope, kv, key_slots, kv_scale


def oracle(q_lat, q_rope, kv, key_slots, mask, scale, softcap=0.0, kv_scale=None):
    """(out [T, H, r], lse [T, H]) in fp64: per row and head, the softmax over exactly the visible keys."""
    bs, m, n = mask.shape
    T, H, r = q_lat.shape
    out = torch.zeros(T, H, r, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for b in range(bs):
        for i in range(m):
            t, vis = b * m + i, mask[b, i].nonzero().flatten()
            if not len(vis):
                continue
            rows = kv[key_slots[b, vis]].double() * (1.0 if kv_scale is None else kv_scale.double())
            s = scale * (q_lat[t].double() @ rows[:, :r].T + q_rope[t].double() @ rows[:, r:].T)  # [H, |V|]
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            lse[t] = torch.logsumexp(s, dim=-1)
            out[t] = torch.softmax(s, dim=-1) @ rows[:, :r]
    return out, lse


def check_against_oracle(bs, m_kind, n, H, r, dr, dtype, *, kv_dtype=None, softcap=0.0, seed=0, impl="triton"):
    mask = tree_masks(m_kind, bs, n, seed)
    m = mask.shape[1]
    q_lat, q_rope, kv, key_slots, kv_scale = inputs(bs, m, n, H, r, dr, dtype, kv_dtype=kv_dtype, seed=seed)
    unseen = key_slots[~mask.any(dim=1)]
    if kv.dtype == FP8:
        kv.view(torch.uint8)[unseen] = 0x7F
    else:
        kv[unseen] = NAN
    scale = (r + dr) ** -0.5
    out, lse = ops.tree_attention(q_lat, q_rope, kv, key_slots, mask, softmax_scale=scale, softcap=softcap,
                                  kv_scale=kv_scale, impl=impl)
    ref_out, ref_lse = oracle(q_lat, q_rope, kv, key_slots, mask, scale, softcap, kv_scale)
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows that see no key: lse -inf exactly there"
    assert bool(torch.isfinite(out).all()), "NaN from a slot no query sees reached the output"
    vmax = ref_out.abs().max().item() + 1e-30
    # fp32: IEEE dots; fp16: P and the output rounded to fp16 (2^-11 each, relative to the values' scale)
    tol = 1e-5 if dtype == torch.float32 else 3 * 2.0 ** -11
    err = (out.double() - ref_out).abs().max().item()
    assert err <= tol * max(vmax, 1.0), f"out error {err:.3e} > {tol * max(vmax, 1.0):.3e}"
    fin = torch.isfinite(ref_lse)
    lerr = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert lerr <= 1e-4 * max(1.0, ref_lse[fin].abs().max().item()), f"lse error {lerr:.3e}"


def prefix_and_union(q_lat, q_rope, kv, key_slots, mask, scale, *, kv_scale=None, P=5, seed=0, dtype=torch.float64):
    """A prior state for ``prior=``: each row's own prefix of P random latent rows (rows t % 3 == 2 have none), as
    (o_P [T, H, r] fp64, lse_P [T, H] fp64), and the attention over the UNION of those prefix rows and the row's
    visible tree keys in one softmax, computed in ``dtype`` (fp64: the oracle; bf16: the torch-bf16 baseline)."""
    bs, m, n = mask.shape
    T, H, r = q_lat.shape
    g = torch.Generator().manual_seed(seed + 1)
    pre = torch.randn(T, P, kv.shape[1], generator=g)
    o_p = torch.zeros(T, H, r, dtype=torch.float64)
    lse_p = torch.full((T, H), float("-inf"), dtype=torch.float64)
    out = torch.zeros(T, H, r, dtype=dtype)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for b in range(bs):
        for i in range(m):
            t, vis = b * m + i, mask[b, i].nonzero().flatten()
            rows_p = pre[t, : 0 if t % 3 == 2 else P].double()
            rows_t = kv[key_slots[b, vis]].double() * (1.0 if kv_scale is None else kv_scale.double())
            rows = torch.cat([rows_p, rows_t])
            if len(rows_p):
                s_p = scale * (q_lat[t].double() @ rows_p[:, :r].T + q_rope[t].double() @ rows_p[:, r:].T)
                lse_p[t], o_p[t] = torch.logsumexp(s_p, -1), torch.softmax(s_p, -1) @ rows_p[:, :r]
            if len(rows):
                rk = rows.to(dtype)
                s = (q_lat[t].to(dtype) @ rk[:, :r].T + q_rope[t].to(dtype) @ rk[:, r:].T) * scale
                lse[t] = torch.logsumexp(s.double(), -1)
                out[t] = torch.softmax(s.float(), -1).to(dtype) @ rk[:, :r]
    return o_p, lse_p, out, lse


def check_prior_against_oracle(bs, m_kind, n, H, r, dr, dtype, *, kv_dtype=None, seed=0, impl="triton"):
    """``prior=(o_P, lse_P)``: the merged state is the fp64 softmax over the union of the prior's keys and the visible
    tree keys (o_P handed over rounded to q's dtype); a row without prior keys gets the tree part alone, a row that
    sees no tree key gets o_P, a row with neither gets 0 and lse -inf."""
    mask = tree_masks(m_kind, bs, n, seed)
    q_lat, q_rope, kv, key_slots, kv_scale = inputs(bs, mask.shape[1], n, H, r, dr, dtype, kv_dtype=kv_dtype,
                                                    seed=seed)
    scale = (r + dr) ** -0.5
    o_p, lse_p, ref_out, ref_lse = prefix_and_union(q_lat, q_rope, kv, key_slots, mask, scale, kv_scale=kv_scale,
                                                    seed=seed)
    prior = (o_p.to(dtype).transpose(0, 1).contiguous().transpose(0, 1), lse_p.float().t().contiguous().t())
    out, lse = ops.tree_attention(q_lat, q_rope, kv, key_slots, mask, softmax_scale=scale, kv_scale=kv_scale,
                                  prior=prior, impl=impl)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows with no key at all: lse -inf exactly"
    if m_kind == "random":  # the case really holds a row with neither prior nor tree keys
        assert bool(torch.isneginf(ref_lse).any()) and bool(torch.isfinite(ref_lse).any())
    vmax = ref_out.abs().max().item() + 1e-30
    tol = 1e-5 if dtype == torch.float32 else 4 * 2.0 ** -11  # fp16: o_P, P and the output rounded once each
    err = (out.double() - ref_out).abs().max().item()
    assert err <= tol * max(vmax, 1.0), f"merged out error {err:.3e} > {tol * max(vmax, 1.0):.3e}"
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4 * max(1.0, ref_lse[fin].abs().max().item())


PRIOR_CASES = {  # name: (bs, mask kind, n, H, r, d_rope, kwargs); random masks: rows that see no tree key
    "prior_random_masks": (2, "random", 7, 4, 32, 16, {}),
    "prior_tree_16h": (2, "tree", 9, 16, 32, 16, {}),
    "prior_e4m3_cache": (2, "tree", 9, 16, 32, 16, {"kv_dtype": FP8}),
}

CASES = {  # name: (bs, mask kind, n, H, r, d_rope, kwargs)
    "chain_2x16h": (2, "chain", 8, 16, 32, 16, {}),
    "star_3x2h": (3, "star", 5, 2, 32, 16, {}),
    "random_tree_2x3h": (2, "tree", 13, 3, 40, 8, {}),
    "random_masks_m_ne_n": (2, "random", 7, 4, 32, 16, {}),
    "one_key": (2, "chain", 1, 16, 32, 16, {}),
    "64_keys_1h": (1, "tree", 64, 1, 32, 16, {}),
    "128_heads": (1, "tree", 6, 128, 32, 16, {}),
    "deepseek_row": (1, "tree", 8, 16, 512, 64, {}),
    "softcap": (2, "tree", 9, 4, 32, 16, {"softcap": 2.5}),
    "e4m3_cache": (2, "tree", 9, 16, 32, 16, {"kv_dtype": FP8}),
}


def _more_keys_than_the_kernel_takes():
    """impl='triton' with n > MAX_KEYS tree keys: a named error, not a silent switch to the torch form."""
    from mla_fa3.ops.tree_attention_triton import MAX_KEYS

    n = MAX_KEYS + 1
    q_lat, q_rope, kv, key_slots, _ = inputs(1, 2, n, 1, 16, 16, torch.float32)
    mask = torch.ones(1, 2, n, dtype=torch.bool)
    try:
        ops.tree_attention(q_lat, q_rope, kv, key_slots, mask, softmax_scale=0.3, impl="triton")
    except ValueError as exc:
        assert f"at most {MAX_KEYS} tree keys" in str(exc), exc
    else:
        raise AssertionError(f"impl='triton' took {n} tree keys")


SPLIT_CASES = {  # name: (bs, mask kind, n, H, r, d_rope, kwargs, prior?); r of 2+ column blocks, output split
    "split_deepseek_row": (1, "tree", 8, 16, 512, 64, {}, False),
    "split_random_masks_r128": (2, "random", 7, 4, 128, 16, {}, False),
    "split_prior_e4m3_r128": (2, "tree", 9, 16, 128, 16, {"kv_dtype": FP8}, True),
}


def _split_output(name, args, kw, prior):
    """A case with the output columns split over programs (the rule forced on: every grid counts as small)."""
    from mla_fa3.ops import tree_attention_triton as tk

    saved, tk.SPLIT_BELOW_PROGRAMS = tk.SPLIT_BELOW_PROGRAMS, 1 << 20
    try:
        bs, kind, n, H, r = args[:5]
        m = n + 3 if kind == "random" else n
        assert tk.out_splits_for(bs * -(-m * H // tk.block_m_for(H)), r, min(64, r)) > 1, name
        (check_prior_against_oracle if prior else check_against_oracle)(*args, **kw)
    finally:
        tk.SPLIT_BELOW_PROGRAMS = saved


def _interpreter_run() -> dict:
    checks = []
    for name, (bs, kind, n, H, r, dr, kw) in CASES.items():
        for dt in (torch.float32, torch.float16):
            if name in ("deepseek_row", "128_heads") and dt is torch.float16:
                continue  # interpreter time; the fp32 case covers the tile shapes
            checks.append((f"{name}/{dt}", lambda a=(bs, kind, n, H, r, dr, dt), kw=kw: check_against_oracle(*a, **kw)))
    checks.append(("more_than_128_keys_refused", _more_keys_than_the_kernel_takes))
    for name, (bs, kind, n, H, r, dr, kw) in PRIOR_CASES.items():
        for dt in (torch.float32, torch.float16):
            checks.append((f"{name}/{dt}",
                           lambda a=(bs, kind, n, H, r, dr, dt), kw=kw: check_prior_against_oracle(*a, **kw)))
    for name, (bs, kind, n, H, r, dr, kw, prior) in SPLIT_CASES.items():
        checks.append((f"{name}/{torch.float32}", lambda name=name, a=(bs, kind, n, H, r, dr, torch.float32), kw=kw,
                       prior=prior: _split_output(name, a, kw, prior)))
    return run_cases(checks)


def test_tree_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    assert run_under_interpreter(__file__, timeout=400) == {}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_form_matches_the_oracle(name):
    """The torch form (impl='reference', every device's fallback) on the same cases, in-process."""
    bs, kind, n, H, r, dr, kw = CASES[name]
    check_against_oracle(bs, kind, n, H, r, dr, torch.float32, impl="reference", **kw)


@pytest.mark.parametrize("name", list(PRIOR_CASES))
def test_reference_form_merges_a_prior_state(name):
    bs, kind, n, H, r, dr, kw = PRIOR_CASES[name]
    check_prior_against_oracle(bs, kind, n, H, r, dr, torch.float32, impl="reference", **kw)


def test_a_bad_prior_is_refused_by_name():
    q_lat, q_rope, kv, key_slots, _ = inputs(1, 3, 3, 2, 16, 8, torch.float32)
    mask = tree_masks("chain", 1, 3, 0)
    o, lse = torch.zeros(3, 2, 16), torch.zeros(3, 2)
    for prior, message in (((o,), "prior must be None or a tuple"), ((o[:, :1], lse), "prior's o must be"),
                           ((o, lse.double()), "prior's lse must be"), ((o, lse[:2]), "prior's lse must be")):
        with pytest.raises((TypeError, ValueError), match=message):
            ops.tree_attention(q_lat, q_rope, kv, key_slots, mask, softmax_scale=0.3, prior=prior, impl="reference")


def test_triton_asked_for_on_the_cpu_is_a_named_error():
    q_lat, q_rope, kv, key_slots, _ = inputs(1, 3, 3, 2, 16, 8, torch.float32)
    with pytest.raises(KernelUnavailableError, match="tree attention"):
        ops.tree_attention(q_lat, q_rope, kv, key_slots, tree_masks("chain", 1, 3, 0), softmax_scale=0.3,
                           impl="triton")


def test_output_split_rule_and_its_bad_values():
    """``out_splits_for``: powers of two up to 4 within r's column blocks while the grid is small (never with the
    threshold at 0); a bad ``out_splits`` is a named error before any launch."""
    pytest.importorskip("triton")
    from mla_fa3.ops import tree_attention_triton as tk

    saved = tk.SPLIT_BELOW_PROGRAMS
    try:
        tk.SPLIT_BELOW_PROGRAMS = 0
        assert tk.out_splits_for(1, 512, 64) == 1
        tk.SPLIT_BELOW_PROGRAMS = 64
        assert [tk.out_splits_for(p, 512, 64) for p in (2, 16, 20, 40, 64, 500)] == [4, 4, 4, 2, 1, 1]
        assert tk.out_splits_for(2, 128, 64) == 2 and tk.out_splits_for(2, 32, 32) == 1
    finally:
        tk.SPLIT_BELOW_PROGRAMS = saved
    q_lat, q_rope, kv, key_slots, _ = inputs(1, 3, 3, 2, 128, 16, torch.float32)
    for bad in (0, 3, 4, True, 2.0):
        with pytest.raises(ValueError, match="out_splits must be a power of two in \\[1, 2\\]"):
            tk.tree_attention(q_lat, q_rope, kv, key_slots, tree_masks("chain", 1, 3, 0), softmax_scale=0.3,
                              softcap=0.0, kv_scale=None, out_splits=bad)


@pytest.mark.gpu
def test_tree_kernel_fp32_dots_are_ieee_on_the_gpu():
    """fp32 inputs at DeepSeek's row: IEEE fp32 dots, within 1e-5 of the fp64 oracle (TF32 would be ~1e-3 off; the
    interpreter cannot tell them apart)."""
    mask = tree_masks("tree", 2, 16, 5)
    q_lat, q_rope, kv, key_slots, _ = inputs(2, 16, 16, 16, 512, 64, torch.float32, seed=5)
    scale = 576 ** -0.5
    ref, ref_lse = oracle(q_lat, q_rope, kv, key_slots, mask, scale)
    out, lse = ops.tree_attention(*[x.cuda() for x in (q_lat, q_rope, kv, key_slots, mask)], softmax_scale=scale,
                                  impl="triton")
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= 1e-5 * max(ref.abs().max().item(), 1.0), f"fp32 out error {err:.3e}: not IEEE fp32 dots"
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= 1e-4 * max(1.0, ref_lse.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("prior", [False, True])
def test_split_output_is_bitwise_the_single_group_on_the_gpu(prior):
    """Every output column group recomputes the same score tile: out and lse equal the unsplit launch's bit for bit
    (16 heads, 8 draft tokens, bs 1: the small grid the split is for; bf16, DeepSeek's row)."""
    from mla_fa3.ops import tree_attention_triton as tk

    mask = tree_masks("tree", 1, 8, 3)
    args = [x.cuda() for x in inputs(1, 8, 8, 16, 512, 64, torch.bfloat16, seed=3)[:4]] + [mask.cuda()]
    g = torch.Generator().manual_seed(4)
    state = (torch.randn(8, 16, 512, generator=g).bfloat16().cuda(), torch.randn(8, 16, generator=g).cuda())
    runs = [tk.tree_attention(*args, softmax_scale=576 ** -0.5, softcap=0.0, kv_scale=None,
                              prior=state if prior else None, out_splits=k) for k in (1, 2, 4, 8)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind,n,H", [("tree", 64, 16), ("chain", 8, 128), ("random", 33, 16), ("star", 16, 128)])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_tree_kernel_bf16_on_the_gpu(kind, n, H, kv_dtype):
    """bf16 at DeepSeek's row (512 + 64): the kernel's error vs the fp64 oracle is at most twice torch's bf16 error."""
    bs = 3
    mask = tree_masks(kind, bs, n, 1)
    q_lat, q_rope, kv, key_slots, kv_scale = inputs(bs, mask.shape[1], n, H, 512, 64, torch.bfloat16, kv_dtype=kv_dtype,
                                                    seed=1)
    scale = 576 ** -0.5
    ref, ref_lse = oracle(q_lat, q_rope, kv, key_slots, mask, scale, kv_scale=kv_scale)
    dev = [x.cuda() for x in (q_lat, q_rope, kv, key_slots, mask)]
    out, lse = ops.tree_attention(*dev, softmax_scale=scale, kv_scale=None if kv_scale is None else kv_scale.cuda(),
                                  impl="triton")
    assert bool(torch.isfinite(out).all())
    # torch bf16: each op rounding to bf16 over the visible keys (the same loop as the oracle, in bf16)
    rows = kv.float() * (1.0 if kv_scale is None else kv_scale)
    torch_bf16 = torch.zeros_like(ref, dtype=torch.bfloat16)
    for b in range(bs):
        for i in range(mask.shape[1]):
            vis = mask[b, i].nonzero().flatten()
            if len(vis):
                kr = rows[key_slots[b, vis]].bfloat16()
                t = b * mask.shape[1] + i
                s = (q_lat[t] @ kr[:, :512].T + q_rope[t] @ kr[:, 512:].T) * scale
                torch_bf16[t] = torch.softmax(s.float(), dim=-1).bfloat16() @ kr[:, :512]
    check_bf16_rule(out, ref, torch_bf16, 0.9999)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind,n,H", [("tree", 64, 16), ("random", 33, 128)])
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_tree_kernel_merges_the_prefix_state_bf16_on_the_gpu(kind, n, H, kv_dtype):
    """bf16 at DeepSeek's row with a prior state (the tree step's prefix part): the merged output against the fp64
    softmax over the union, within twice the error of the same union attention in torch bf16."""
    bs = 3
    mask = tree_masks(kind, bs, n, 2)
    q_lat, q_rope, kv, key_slots, kv_scale = inputs(bs, mask.shape[1], n, H, 512, 64, torch.bfloat16,
                                                    kv_dtype=kv_dtype, seed=2)
    scale = 576 ** -0.5
    o_p, lse_p, ref, ref_lse = prefix_and_union(q_lat, q_rope, kv, key_slots, mask, scale, kv_scale=kv_scale, seed=2)
    _, _, torch_bf16, _ = prefix_and_union(q_lat, q_rope, kv, key_slots, mask, scale, kv_scale=kv_scale, seed=2,
                                           dtype=torch.bfloat16)
    dev = [x.cuda() for x in (q_lat, q_rope, kv, key_slots, mask)]
    out, lse = ops.tree_attention(*dev, softmax_scale=scale, kv_scale=None if kv_scale is None else kv_scale.cuda(),
                                  prior=(o_p.bfloat16().cuda(), lse_p.float().cuda()), impl="triton")
    assert bool(torch.isfinite(out).all())
    check_bf16_rule(out, ref, torch_bf16, 0.9999)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() <= 2e-2


if __name__ == "__main__":  # the interpreter subprocess (TRITON_INTERPRET=1 set before triton is imported)
    interpreter_main(_interpreter_run)
