"""EAGLE with topk > 1 through the SGLang adapter: a TARGET_VERIFY step whose k draft tokens per request form a tree,
read from ``spec_info.custom_mask`` as SGLang's EAGLE writes it, on the CPU (our reference kernels).

Oracle: ``tests/oracle.dense_attention`` (fp64) of each request with the mask written out from the tree's parent
array in the test (``tree_cases.ancestors_mask``: every prefix key, then token j iff j is i or an ancestor of i),
over keys built from the tensors the test made. The custom masks are laid out here from SGLang's documented layouts
(``speculative/eagle_utils.py``, ``build_tree_kernel_efficient``: FULL_MASK, request b's ``k x (S_b + k)`` block
row-major with its prefix columns True; QLEN_ONLY, ``k x k`` per request). The masks SGLang's own draft pipeline and
tree builder write are read against the tree its verification walks in tests/test_sglang_tree_builder.py.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_world import (D_ROPE, R, case, check_close, kit, kit_fixture, needs_sglang, run_split_form,
                                runner_like)
from tests.tree_cases import ancestors_mask, chain, random_tree, star, tree_of

pytestmark = needs_sglang

if kit is not None:
    from sglang.srt.layers.attention.verify_mask import VerifyMask
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    from mla_fa3.integrations.sglang.adapter import SGLangMLABackend
    from mla_fa3.integrations.sglang.convert import UnsupportedStepError, verify_tree
    from mla_fa3.tree import DraftTreeError

PREFIXES = (14, 5, 30)
FILL = 1  # SGLang's CUDA-graph padding rows: seq_lens = the backend's fill value


def _trees(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [chain(k), star(k), random_tree(k, rng)][: len(PREFIXES)]


def _full_mask(prefixes, trees) -> torch.Tensor:
    """SGLang's FULL_MASK: per request a k x (S_b + k) block, row-major, prefix columns True."""
    blocks = [torch.cat([torch.ones(len(t), s, dtype=torch.bool), ancestors_mask(t)], 1).flatten()
              for s, t in zip(prefixes, trees)]
    return torch.cat(blocks)


def _qlen_only(trees) -> torch.Tensor:
    return torch.cat([ancestors_mask(t).flatten() for t in trees])


def _tree_fixture(k: int, topk: int, custom_mask, *, dtype=torch.bfloat16, page_size=16, prefixes=PREFIXES,
                  live=None, device="cpu", num_heads=4, max_context_len=128, fp8=False):
    """The kit's TARGET_VERIFY batch (SGLang's seq_lens exclude the k draft tokens) and an adapter built for EAGLE with
    ``topk`` over the kit's pools; ``live``: the requests ``spec_info.positions`` counts (default all)."""
    c = case("TARGET_VERIFY", prefix_lens=prefixes, extend_lens=(k,) * len(prefixes), page_size=page_size,
             num_heads=num_heads, name=f"tree_k{k}_p{page_size}_{len(prefixes)}")
    fx = kit_fixture(c, dtype=dtype, device=device, max_context_len=max_context_len, fp8=fp8)
    if custom_mask is not None:
        custom_mask = custom_mask.to(device)
    fb = fx.forward_batch
    fb.seq_lens = torch.tensor(c.prefix_lens, dtype=torch.int32, device=device)
    fb.seq_lens_cpu = fb.seq_lens.cpu()
    fb.spec_info = SimpleNamespace(draft_token_num=k, topk=topk, custom_mask=custom_mask,
                                   positions=torch.zeros((live or len(prefixes)) * k, dtype=torch.int64,
                                                         device=device))
    backend = SGLangMLABackend(runner_like(fx, server_args=dict(speculative_eagle_topk=topk,
                                                                speculative_num_draft_tokens=k,
                                                                speculative_algorithm="EAGLE")))
    return fx, backend


def _oracle_masks(trees, prefixes=PREFIXES):
    return [torch.cat([torch.ones(len(t), s, dtype=torch.bool), ancestors_mask(t)], 1)
            for s, t in zip(prefixes, trees)]


@pytest.mark.parametrize("layout", ["full_mask", "qlen_only"])
@pytest.mark.parametrize("k", [4, 8])
def test_tree_verify_matches_the_full_mask_oracle(layout, k):
    """Each draft token sees the whole prefix and exactly its ancestors: chain, star and a random tree in one batch."""
    trees = _trees(k, seed=k)
    mask = _full_mask(PREFIXES, trees) if layout == "full_mask" else _qlen_only(trees)
    fx, backend = _tree_fixture(k, 2, mask)
    check_close(*run_split_form(fx, backend=backend, masks=_oracle_masks(trees)))
    assert backend.explain().tree == (k, k)


def test_tree_verify_over_the_fp8_pool():
    """EAGLE topk 2 with --kv-cache-dtype fp8_e4m3: the prefix and the tree keys read as e4m3 in place; the oracle
    over the e4m3-rounded keys (FlashMLA FP8 rounds q too: the wider bound of the FP8 decode test)."""
    k = 4
    trees = _trees(k, seed=3)
    fx, backend = _tree_fixture(k, 2, _qlen_only(trees), page_size=64, fp8=True)
    out, oracle, tol = run_split_form(fx, backend=backend, masks=_oracle_masks(trees))
    assert backend.explain().tree == (k, k) and backend.explain().kv_dtype != "bfloat16"
    if backend.explain().kernel == "flashmla":
        torch.testing.assert_close(out, oracle, atol=max(tol, 0.08 * oracle.abs().max().item()), rtol=0)
    else:
        check_close(out, oracle, tol)


def test_tree_verify_is_not_the_chain():
    """The same star tree read as a chain would differ: the check above can fail on a tree taken as causal."""
    k = 4
    trees = [star(k)] * len(PREFIXES)
    fx, backend = _tree_fixture(k, 2, _qlen_only(trees))
    out, tree_oracle, tol = run_split_form(fx, backend=backend, masks=_oracle_masks(trees))
    check_close(out, tree_oracle, tol)
    fx2, backend2 = _tree_fixture(k, 2, _qlen_only(trees))
    _, causal_oracle, _ = run_split_form(fx2, backend=backend2)  # same inputs (same seed), causal oracle
    assert (out - causal_oracle).abs().max().item() > 10 * tol


def test_eagle_shaped_trees_at_page_64():
    """Trees of EAGLE's shape (levels of up to topk children), k = 10, over pages of 64."""
    rng = random.Random(3)
    trees = [tree_of(3, 3, rng)[:10] for _ in PREFIXES]
    trees = [t + [0] * (10 - len(t)) for t in trees]  # pad short trees with children of the root
    fx, backend = _tree_fixture(10, 3, _qlen_only(trees), page_size=64)
    check_close(*run_split_form(fx, backend=backend, masks=_oracle_masks(trees)))


def test_verify_mask_is_offered_to_eagle_in_qlen_only_layout():
    """SGLang's EAGLE writes the draft trees into the target backend's ``verify_mask`` (eagle_worker_common):
    ours asks for k x k blocks (QLEN_ONLY) for every request row, read, and there is none without a tree."""
    k = 6
    fx, backend = _tree_fixture(k, 2, _qlen_only(_trees(k, 0)))
    vm = backend.verify_mask
    assert isinstance(vm, VerifyMask) and vm.mode == TreeMaskMode.QLEN_ONLY and vm.is_read
    rows = fx.runner.req_to_token_pool.req_to_token.shape[0]
    assert vm.max_bs == rows and vm.buffer.numel() == rows * k * k and vm.buffer.dtype == torch.bool
    assert SGLangMLABackend(runner_like(fx)).verify_mask is None


def test_tree_read_from_the_offered_buffer_and_padding_rows_are_chains():
    """A replay pads the batch past the live requests (``spec_info.positions`` counts the live ones): live rows are
    read from the buffer SGLang filled, padding rows get a chain — never the buffer's stale rows."""
    k, live, bs = 4, 2, 4
    trees = [star(k), random_tree(k, random.Random(1))]
    buf = torch.ones(8 * k * k, dtype=torch.bool)  # stale rows are all True: not a tree
    buf[: live * k * k] = _qlen_only(trees)
    fb = SimpleNamespace(spec_info=SimpleNamespace(custom_mask=buf, positions=torch.zeros(live * k)))
    tree = verify_tree(fb, bs, k, torch.tensor([7, 9, 1, 1]), torch.device("cpu"), qlen_buffer=buf)
    want = torch.stack([ancestors_mask(t) for t in trees] + [ancestors_mask(chain(k))] * (bs - live))
    assert torch.equal(tree.mask, want)


def test_full_mask_blocks_are_found_by_prefix_length():
    """FULL_MASK: request b's tree part is columns S_b .. S_b + k - 1 of its rows, after the earlier requests'
    blocks; prefix columns False there must not leak into the tree."""
    k = 3
    prefixes = [2, 5, 1]
    trees = [star(k), chain(k), random_tree(k, random.Random(2))]
    flat = _full_mask(prefixes, trees)
    fb = SimpleNamespace(spec_info=SimpleNamespace(custom_mask=flat, positions=torch.zeros(3 * k)))
    tree = verify_tree(fb, 3, k, torch.tensor(prefixes), torch.device("cpu"))
    assert torch.equal(tree.mask, torch.stack([ancestors_mask(t) for t in trees]))


def test_tree_refusals_name_what_was_sent():
    k = 4
    fx, backend = _tree_fixture(k, 2, torch.ones(5, dtype=torch.bool))  # fewer entries than any layout needs
    with pytest.raises(UnsupportedStepError, match="custom_mask has 5 entries"):
        run_split_form(fx, backend=backend)
    wrong = SimpleNamespace(spec_info=SimpleNamespace(custom_mask=torch.ones(3, 2, 2, dtype=torch.float32),
                                                      positions=torch.zeros(6)))
    with pytest.raises((UnsupportedStepError, DraftTreeError)):
        verify_tree(wrong, 3, 2, torch.tensor([1, 1, 1]), torch.device("cpu"))


def test_cuda_graph_capture_then_replay_of_a_padded_tree_step():
    """SGLang's CUDA-graph protocol for a tree verify: state for 4 requests, capture on fill-value rows with the tree
    shape (k, k), then a replay of 3 live requests padded to 4 whose trees SGLang wrote into the offered buffer (its
    other rows stale): the live rows match the tree oracle, the padding row reads a chain."""
    k, bs = 4, 4
    trees = _trees(k, seed=5)
    prefixes = PREFIXES + (FILL,)
    fx, backend = _tree_fixture(k, 2, None, prefixes=prefixes, live=len(PREFIXES))
    buf = backend.verify_mask.buffer
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * k)
        cap = copy.copy(fx.forward_batch)  # the captured step's shape: bs requests of k tokens at the fill value
        cap.seq_lens = torch.full((bs,), FILL, dtype=torch.int32)
        cap.seq_lens_cpu = cap.seq_lens.clone()
        cap.spec_info = SimpleNamespace(draft_token_num=k, topk=2, custom_mask=buf,
                                        positions=torch.zeros(bs * k, dtype=torch.int64))
        backend.init_forward_metadata_out_graph(cap, in_capture=True)
        backend.init_forward_metadata_in_graph(cap)
        assert backend.explain().graph and backend.explain().tree == (k, k)
    buf.fill_(True)  # what SGLang's build_tree_kernel_efficient does first; then it writes the live blocks
    buf[: len(trees) * k * k] = _qlen_only(trees)
    fx.forward_batch.spec_info.custom_mask = buf
    out, oracle, tol = run_split_form(fx, backend=backend, replay=True,
                                      masks=_oracle_masks(trees + [chain(k)], prefixes))
    check_close(out, oracle, tol)
    assert backend.explain().graph


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,page_size", [("fa3", 16), ("fa3", 64), ("flashmla", 64), ("splitkv", 16),
                                              ("splitkv", 64)])
def test_tree_verify_gpu(kernel, page_size, monkeypatch):
    """The tree verify on each decode kernel at 16 heads (the prefix part with k query rows, no causal mask; the tree
    part dense; merged by LSE), long prefixes: the fp64 tree oracle within twice the reference's bf16 bound."""
    monkeypatch.setenv("MLA_FA3_DECODE_KERNEL", kernel)
    k, prefixes = 8, (700, 63, 1500)
    rng = random.Random(7)
    trees = [tree_of(3, 2, rng)[:k] for _ in prefixes]
    trees = [t + [0] * (k - len(t)) for t in trees]
    fx, backend = _tree_fixture(k, 2, _qlen_only(trees), page_size=page_size, prefixes=prefixes, device="cuda",
                                num_heads=16, max_context_len=2048)
    out, oracle, tol = run_split_form(fx, backend=backend, masks=_oracle_masks(trees, prefixes))
    assert backend.explain().kernel == kernel and backend.explain().tree == (k, k)
    check_close(out, oracle, 2 * tol)


@pytest.mark.gpu
def test_tree_verify_real_cuda_graph_gpu():
    """A tree verify captured in a torch.cuda.graph (bs 4, k 6), replayed for 3 live requests whose trees SGLang
    wrote into the offered buffer: the eager answer of the same step."""
    k, bs = 6, 4
    prefixes = (300, 45, 900, FILL)
    rng = random.Random(11)
    trees = [random_tree(k, rng) for _ in range(3)]
    fx, backend = _tree_fixture(k, 2, None, page_size=64, prefixes=prefixes, live=3, device="cuda", num_heads=16,
                                max_context_len=1024)
    layer, fb, H = fx.actual_module.attn_mqa, fx.forward_batch, 16
    buf = backend.verify_mask.buffer
    buf.fill_(True)
    buf[: 3 * k * k] = _qlen_only(trees).cuda()
    fb.spec_info.custom_mask = buf
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(bs * k, H * (R + D_ROPE), device="cuda", generator=g, dtype=torch.bfloat16)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * k)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        backend.init_forward_metadata_in_graph(fb)
        layer(q, None, None, fb, save_kv_cache=False)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.init_forward_metadata_in_graph(fb)
            out = layer(q, None, None, fb, save_kv_cache=False)
        backend.init_forward_metadata_out_graph(fb)
        graph.replay()
        got = out.clone()
        backend.init_forward_metadata(fb)
        want = layer(q, None, None, fb, save_kv_cache=False)
    torch.testing.assert_close(got[: 3 * k], want[: 3 * k], atol=2e-2, rtol=2e-2)
    assert backend.explain().tree == (k, k)
