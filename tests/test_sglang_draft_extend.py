"""EAGLE's draft extend (SGLang 0.5.17 ``DRAFT_EXTEND_V2``) on mla_fa3 through the SGLang adapter, on the CPU.

The draft model extends each request by a window of n tokens at the end of its row (SGLang's ``seq_lens`` include
them), causal over its prefix. The adapter serves SGLang's fixed window as a chain verify's shape (same kernels, FP8
reads, CUDA graphs) and unequal windows as an extend (bf16 cache; refused by name on FP8). Oracle:
``tests/oracle.dense_attention`` (fp64) of each request, causal bottom-right, over keys recomputed by the kit's module
from its hidden states (``sglang_world.run_split_form``); for an FP8 pool over the e4m3-rounded keys.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_world import case, check_close, kit, kit_fixture, needs_sglang, run_split_form

pytestmark = needs_sglang

if kit is not None:
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from mla_fa3.integrations.sglang.convert import UnsupportedStepError, to_mla_batch

PREFIXES = (14, 5, 30)
FILL = 1  # SGLang's CUDA-graph padding rows: seq_lens = the backend's fill value


def _fixture(n, *, page_size=16, prefixes=PREFIXES, widths=None, fp8=False):
    widths = widths or (n,) * len(prefixes)
    c = case("DRAFT_EXTEND_V2", prefix_lens=prefixes, extend_lens=widths, page_size=page_size,
             name=f"draft_extend_n{n}_p{page_size}_{'fp8' if fp8 else 'bf16'}_{len(prefixes)}")
    return kit_fixture(c, fp8=fp8)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_fixed_window_matches_the_causal_oracle(page_size, n):
    fx = _fixture(n, page_size=page_size)
    check_close(*run_split_form(fx))
    record = fx.backend.explain()
    assert record.mode == "TARGET_VERIFY" and record.tree is None  # the chain verify's shape, k = n


def test_fixed_window_over_the_fp8_pool():
    """The e4m3 pool read in place (FlashMLA FP8 at page 64 rounds q to e4m3: the wider bound of the FP8 decode
    test, from e4m3's relative step on q)."""
    fx = _fixture(3, page_size=64, fp8=True)
    out, oracle, tol = run_split_form(fx)
    if fx.backend.explain().kernel == "flashmla":
        torch.testing.assert_close(out, oracle, atol=max(tol, 0.08 * oracle.abs().max().item()), rtol=0)
    else:
        check_close(out, oracle, tol)


def test_unequal_windows_run_as_an_extend_and_are_refused_on_fp8():
    fx = _fixture(3, widths=(3, 1, 4))
    check_close(*run_split_form(fx))
    assert fx.backend.explain().mode == "DRAFT_EXTEND"
    fp8 = _fixture(3, widths=(3, 1, 4), page_size=64, fp8=True)
    with pytest.raises(UnsupportedStepError, match="unequal windows over the FP8 latent cache"):
        fp8.backend.init_forward_metadata(fp8.forward_batch)


def test_width_comes_from_the_runner_when_the_batch_has_no_host_lengths():
    """The draft-extend graph runner's replay view has no extend_seq_lens_cpu: the width is spec_info's copy, else
    num_tokens_per_req, else the server's speculative_num_draft_tokens; padding rows are raised to the width."""
    fx = _fixture(3)
    fb = copy.copy(fx.forward_batch)
    fb.extend_seq_lens_cpu = None
    fb.seq_lens = torch.tensor([17, FILL, 33], dtype=torch.int32)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    for spec, configured in ((SimpleNamespace(extend_seq_lens_cpu=[3, 3, 3]), 0),
                             (SimpleNamespace(num_tokens_per_req=3), 0), (None, 3)):
        fb.spec_info = spec
        ours = to_mla_batch(fb, device=torch.device("cpu"), num_draft_tokens=configured)
        assert ours.forward_mode.name == "TARGET_VERIFY" and ours.num_draft_tokens == 3
        assert ours.seq_lens_cpu.tolist() == [17, 3, 33] and ours.seq_lens.tolist() == [17, 3, 33]
    fb.spec_info = None
    with pytest.raises(UnsupportedStepError, match="window width is unknown"):
        to_mla_batch(fb, device=torch.device("cpu"), num_draft_tokens=0)


def test_replay_view_holds_the_live_rows_slots_only():
    """SGLang's draft-extend graph runner hands the backend ``out_cache_loc[:num_tokens]``: the live rows' windows
    only, the batch padded past them. The padding rows get SGLang's padding slot 0; a slot count that is not whole
    windows, or more than the batch holds, is a named error."""
    fx = _fixture(3)
    fb = copy.copy(fx.forward_batch)
    live = fb.out_cache_loc.clone()
    fb.batch_size = 4
    fb.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(1, dtype=fb.req_pool_indices.dtype)])
    fb.seq_lens = torch.tensor([17, 8, 33, FILL], dtype=torch.int32)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    fb.extend_seq_lens_cpu = None
    fb.spec_info = SimpleNamespace(extend_seq_lens_cpu=[3, 3, 3, 3])
    ours = to_mla_batch(fb, device=torch.device("cpu"), num_draft_tokens=3)
    assert ours.out_cache_loc.tolist() == live.tolist() + [0, 0, 0]
    assert ours.seq_lens_cpu.tolist() == [17, 8, 33, 3]
    for slots in (live[:-1], torch.cat([live, live[:6]])):
        fb.out_cache_loc = slots
        with pytest.raises(UnsupportedStepError, match="out_cache_loc holds"):
            to_mla_batch(fb, device=torch.device("cpu"), num_draft_tokens=3)


def test_cuda_graph_capture_then_replay_with_a_padding_row():
    """SGLang's draft-extend CUDA-graph protocol: state for 4 requests, capture on fill-value rows of width 3, then
    a replay of 3 live requests padded to 4 (the padding row at seq_lens = FILL, raised to the window; its kit row
    holds a 3-token sequence, so the oracle covers it too): every row matches the causal oracle."""
    n, bs = 3, 4
    prefixes = PREFIXES + (0,)
    fx = _fixture(n, prefixes=prefixes)
    backend = fx.backend
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * n)
        cap = copy.copy(fx.forward_batch)  # the captured shape: bs requests of width n at the fill value
        cap.seq_lens = torch.full((bs,), FILL, dtype=torch.int32)
        cap.seq_lens_cpu = cap.seq_lens.clone()
        cap.extend_seq_lens_cpu = None
        cap.spec_info = SimpleNamespace(num_tokens_per_req=n)
        backend.init_forward_metadata_out_graph(cap, in_capture=True)
        backend.init_forward_metadata_in_graph(cap)
        assert backend.explain().graph and backend.explain().mode == "TARGET_VERIFY"
    fb = fx.forward_batch
    fb.seq_lens = fb.seq_lens.clone()
    fb.seq_lens[3] = FILL
    fb.seq_lens_cpu = fb.seq_lens.clone()
    fb.extend_seq_lens_cpu = None
    fb.spec_info = SimpleNamespace(num_tokens_per_req=n, extend_seq_lens_cpu=[n] * bs)
    check_close(*run_split_form(fx, replay=True))
    assert backend.explain().graph
