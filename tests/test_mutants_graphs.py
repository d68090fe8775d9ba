"""Contracts of ``mla_fa3.graphs`` that the mutation pass found unchecked (docs/MUTATION.md).

The runner is driven on the CPU through a recording stand-in for the backend, so each test checks the
documented protocol (which capture calls are made, which sizes are accepted) and nothing of the
backend itself.
"""

from __future__ import annotations

import pytest
import torch

from mla_fa3.batch import ForwardMode
from mla_fa3.graphs.runner import GraphRunner


class _Recorder:
    """The backend's graph protocol, recorded: init_cuda_graph_state, then one capture call per graph."""

    def __init__(self, kernels=None):
        self.device = torch.device("cpu")
        self.calls: list[tuple] = []
        if kernels is not None:
            self.graph_kernels = lambda: list(kernels)

    def init_cuda_graph_state(self, max_bs, max_context, **kw):
        self.calls.append(("state", max_bs, max_context))

    def init_forward_metadata_capture_cuda_graph(self, bs, mode, *, num_draft_tokens, **kw):
        self.calls.append(("capture", bs, kw.get("kernel")))


def _runner(backend, **kw):
    args = dict(batch_sizes=[1, 2], mode=ForwardMode.DECODE, max_context=8, device="cpu")
    args.update(kw)
    return GraphRunner(backend, lambda batch, inputs: None, **args)


def test_one_graph_per_kernel_when_the_backend_lists_several():
    backend = _Recorder(kernels=["fa3", "flashmla"])
    _runner(backend)
    # largest size first, one capture per (size, kernel)
    assert backend.calls == [("state", 2, 8), ("capture", 2, "fa3"), ("capture", 2, "flashmla"),
                             ("capture", 1, "fa3"), ("capture", 1, "flashmla")]


@pytest.mark.parametrize("kernels", [None, ["fa3"]])
def test_one_graph_per_size_when_the_backend_lists_one_kernel_or_none(kernels):
    backend = _Recorder(kernels=kernels)
    _runner(backend)
    assert backend.calls == [("state", 2, 8), ("capture", 2, None), ("capture", 1, None)]


def test_max_context_equal_to_the_tokens_per_request_is_accepted():
    # TARGET_VERIFY with k = 3 draft tokens: a context of exactly 3 tokens fits, 2 does not.
    backend = _Recorder()
    runner = _runner(backend, mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=3, max_context=3)
    assert runner.max_context == 3 and runner.tokens_per_request == 3
    with pytest.raises(ValueError, match="max_context must be >= 3"):
        _runner(_Recorder(), mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=3, max_context=2)


def test_tree_buffers_check_the_shape_against_the_mode():
    from types import SimpleNamespace

    from mla_fa3.graphs.tree_buffers import TreeBuffers
    from mla_fa3.tree import MAX_TREE_TOKENS, DraftTreeError

    cap = SimpleNamespace(with_encoder=False, max_bs=3, packed=torch.zeros(1))
    registry = {}
    # DRAFT_DECODE: m = num_draft_tokens queries over n tree keys (n may differ from m)
    buf = TreeBuffers.for_capture(registry, cap, ForwardMode.DRAFT_DECODE, 2, (2, 5))
    assert (buf.num_queries, buf.num_keys) == (2, 5) and tuple(buf.mask.shape) == (3, 2, 5)
    assert buf.mask[:, :, 0].all() and not buf.mask[:, :, 1:].any()  # the padding tree: key 0 only
    assert TreeBuffers.for_capture(registry, cap, ForwardMode.DRAFT_DECODE, 2, (2, 5)) is buf
    TreeBuffers.for_capture(registry, cap, ForwardMode.TARGET_VERIFY, 3, (3, 3))
    for mode, k, shape in ((ForwardMode.DRAFT_DECODE, 2, (3, 5)), (ForwardMode.TARGET_VERIFY, 3, (3, 4))):
        with pytest.raises(DraftTreeError, match="tree_shape must be"):
            TreeBuffers.for_capture(registry, cap, mode, k, shape)
    with pytest.raises(DraftTreeError, match="no cross-attention form"):
        TreeBuffers.for_capture({}, SimpleNamespace(with_encoder=True, max_bs=3, packed=torch.zeros(1)),
                                ForwardMode.DRAFT_DECODE, 2, (2, 5))
    for m, n in ((0, 4), (2, MAX_TREE_TOKENS + 1), (True, 4)):
        with pytest.raises(DraftTreeError, match=r"must be an int in \[1, "):
            TreeBuffers.allocate(2, (m, n), torch.device("cpu"))
