"""benchmarks/sglang_engine_check.py's verdict on a greedy continuation that leaves transformers' (CPU; no SGLang
needed): each token is checked against transformers' fp32 argmax given the tokens before it, and a token that is not
is explained only as a near tie or by SGLang's fa3 picking it teacher-forced at the first divergence.

Oracles: hand-built logits whose argmaxes and gaps are known by construction, and transformers' own greedy
``generate`` on a tiny random DeepSeek-V3 (its tokens are the argmax on their own prefix by definition)."""

from __future__ import annotations

import torch

from benchmarks.sglang_engine_check import NEAR_TIE, _own_prefix_logits, explain_off_argmax, off_argmax
from mla_fa3.models.tiny import random_hf_model


def test_off_argmax_names_each_token_that_is_not_its_rows_argmax_with_the_gap():
    logits = torch.zeros(4, 6, dtype=torch.float64)
    logits[0, 2] = 1.0                      # token 2 is the argmax
    logits[1, 4], logits[1, 1] = 2.0, 1.25  # token 1 is 0.75 below the argmax 4
    logits[2, 5] = 0.5                      # token 5 is the argmax
    logits[3, 0], logits[3, 3] = 3.0, 2.97  # token 3 is 0.03 below the argmax 0
    assert off_argmax(logits, [2, 1, 5, 3]) == [(1, 1, 4, 0.75), (3, 3, 0, 0.03)]
    assert off_argmax(logits, [2, 4, 5, 0]) == []


def test_only_a_near_tie_or_fa3s_teacher_forced_pick_at_the_first_divergence_explains_a_token():
    gap = NEAR_TIE * 8
    off = [(8, 21, 357, gap), (9, 7, 3, NEAR_TIE), (12, 40, 41, gap)]
    assert explain_off_argmax(off, 8, 21) == ["fa3 teacher-forced", "near tie", "unexplained"]
    assert explain_off_argmax(off, 8, 357) == ["unexplained", "near tie", "unexplained"]  # fa3 picked the argmax
    assert explain_off_argmax(off, 8, None) == ["unexplained", "near tie", "unexplained"]  # no fa3 in the run
    # fa3's teacher-forced pick speaks for transformers' context only: at a later position the contexts differ
    assert explain_off_argmax([(12, 40, 41, gap)], 8, 40) == ["unexplained"]


def test_own_prefix_rows_line_up_with_the_tokens_they_predict():
    model = random_hf_model("tiny_v3", seed=3).eval()
    prompt = torch.randint(5, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    greedy = out[0, len(prompt):].tolist()
    assert off_argmax(_own_prefix_logits(model, prompt, greedy), greedy) == []  # greedy is argmax on its own prefix
    swapped = list(greedy)
    swapped[3] = (greedy[3] + 1) % model.config.vocab_size
    off = off_argmax(_own_prefix_logits(model, prompt, swapped), swapped)
    assert off[0][:3] == (3, swapped[3], greedy[3]) and off[0][3] > 0
