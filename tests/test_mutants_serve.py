"""Contracts of ``mla_fa3.serve`` that the mutation pass found unchecked (docs/MUTATION.md).

Expected values are worked by hand from the documented behaviour (step counts of a greedy run, the graph
batch sizes, the named errors); the engine runs the tiny random model on the CPU.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from mla_fa3.models.loader import load_model
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint
from mla_fa3.serve.engine import Engine
from mla_fa3.serve.loop import default_graph_batch_sizes

_MODEL = {}


def _model():
    if "m" not in _MODEL:
        hf = random_hf_model("tiny_v2", seed=5)  # vocabulary 256
        with tempfile.TemporaryDirectory() as d:
            _MODEL["m"] = load_model(save_hf_checkpoint(hf, d))
    return _MODEL["m"]


def test_default_graph_batch_sizes_are_powers_of_two_and_the_max():
    assert default_graph_batch_sizes(1) == [1]
    assert default_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert default_graph_batch_sizes(12) == [1, 2, 4, 8, 12]


def test_bad_prompts_and_forced_tokens_are_named():
    eng = Engine(_model(), page_size=4, max_batch_size=2, max_context=32)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        eng.generate([[1, 2], []], 2)
    for bad in ([-1, 3], [3, 256]):  # below 0 only, above the vocabulary only
        with pytest.raises(ValueError, match=r"forced_tokens\[0\] holds token ids outside \[0, 256\)"):
            eng.generate([[1, 2]], 2, forced_tokens=[bad])


def test_progress_counts_the_steps_of_the_run():
    # 3 prompt tokens at most 2 per step: 2 prefill steps (the second gives the first new token), then 3
    # decode steps for the other 3 of the 4 new tokens: 5 steps, announced as 5 from the start.
    eng = Engine(_model(), page_size=4, max_batch_size=1, max_context=32, max_prefill_tokens=2)
    calls = []
    eng.generate([[5, 6, 7]], 4, progress=lambda phase, step, steps: calls.append((phase, step, steps)))
    assert [c[1] for c in calls] == [1, 2, 3, 4, 5]
    assert {c[2] for c in calls} == {5}
    assert [c[0] for c in calls] == ["prefill", "prefill", "decode", "decode", "decode"]


def test_prefill_logits_have_one_row_per_prompt_position_past_the_vocabulary_size():
    # a prompt longer than the vocabulary (300 > 256 tokens): every position gets its logits row
    eng = Engine(_model(), page_size=4, max_batch_size=1, max_context=320, allow_past_max_position=True)
    prompt = [(7 * i) % 256 for i in range(300)]
    out = eng.generate([prompt], 1, return_prefill_logits=True)
    assert out.prefill_logits[0].shape == (300, 256)
    assert torch.isfinite(out.prefill_logits[0]).all()


def test_memory_plan_terms_follow_the_documented_formulas():
    from mla_fa3.serve.configs import model_config
    from mla_fa3.serve.memory import plan_memory

    cfg = model_config("deepseek_v3_tp8", num_layers=4)  # 16 heads, r 512, d_nope 128, d_rope 64, d_v 128
    gib = 1 << 30
    plan = plan_memory(cfg)  # defaults: 139.8 GiB, bf16, page 64, 128 running x 131072 tokens, 1 GiB reserved
    assert plan.reserved_bytes == gib
    assert plan.headroom_bytes == int(0.05 * int(139.8 * gib))
    assert plan.kv_bytes_per_token_layer == 1152  # (512 + 64) * 2 B
    assert plan.req_to_token_bytes == 128 * 131072 * 4
    assert plan.absorbed_bytes == 4 * 16 * 512 * (128 + 128) * 2
    fixed = (plan.weights_bytes + plan.absorbed_bytes + plan.req_to_token_bytes + plan.workspace_bytes
             + plan.graph_bytes + plan.reserved_bytes + plan.headroom_bytes)
    assert plan.num_pages == (int(139.8 * gib) - fixed) // (64 * 4 * 1152)  # pages = floor(KV pool / page bytes)
    # the chunked-prefill workspace term: 2 · W · H · (d_nope + d_rope + d_v) · elem, here for W 8192 vs 4096
    half = plan_memory(cfg, prefill_workspace_tokens=4096)
    assert plan.workspace_bytes - half.workspace_bytes == 2 * 4096 * 16 * (128 + 64 + 128) * 2
    assert plan_memory(cfg, reserved_gib=3.0).reserved_bytes == 3 * gib

