"""Contracts of ``mla_fa3.models`` that the mutation pass found unchecked (docs/MUTATION.md): named errors
before any compute, and values worked by hand.
"""

from __future__ import annotations

import pytest
import torch

from mla_fa3.batch import ForwardBatch
from mla_fa3.models.deepseek import DeepseekForCausalLM
from mla_fa3.models.fp8 import dequantize_block_fp8
from mla_fa3.serve.configs import model_config


def test_forward_refuses_input_ids_of_another_token_count():
    model = DeepseekForCausalLM(model_config("tiny"), device="meta")  # the check runs before any weight is read
    batch = ForwardBatch.decode([0, 1], [5, 7], [11, 12], "cpu")  # two requests: 2 tokens
    ids, pos = torch.tensor([1, 2, 3]), torch.tensor([4, 6, 7])
    with pytest.raises(ValueError, match="input_ids must hold batch.num_tokens = 2 tokens, got 3"):
        model(ids, pos, batch, backend=None)


def test_dequantize_block_fp8_refuses_a_weight_that_is_not_2d():
    w = torch.ones(2, 4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight must be 2-D \[out, in\], got shape \[2, 4, 4\]"):
        dequantize_block_fp8(w, torch.ones(1, 1), (128, 128))


def test_dequantize_block_fp8_hand_worked():
    # [3, 5] weight, blocks of 2 x 4: scales [[1, 2], [4, 8]] expand over rows {0,1},{2} and cols {0..3},{4}
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [-1.0, 0.5, 0.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0, 12.0]])
    s = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    got = dequantize_block_fp8(w.to(torch.float8_e4m3fn), s, (2, 4))
    want = torch.tensor([[1.0, 2.0, 3.0, 4.0, 10.0], [-1.0, 0.5, 0.0, 6.0, 14.0], [32.0, 36.0, 40.0, 44.0, 96.0]])
    assert torch.equal(got, want)


def test_greedy_routing_ignores_the_expert_groups():
    import math
    from types import SimpleNamespace

    from mla_fa3.models.moe import Router

    # 4 experts in 2 groups ({0, 1}, {2, 3}), logits [4, 1, 3, 2]: greedy top-2 is experts 0 and 2 across the
    # groups (group-limited routing with topk_group 1 would keep group {0, 1} only: experts 0 and 1).
    cfg = SimpleNamespace(n_routed_experts=4, num_experts_per_tok=2, scoring_func="softmax", topk_method="greedy",
                          n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, hidden_size=1)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[4.0], [1.0], [3.0], [2.0]]))
    weights, idx = router(torch.ones(1, 1))
    assert idx.tolist() == [[0, 2]]
    z = sum(math.exp(v) for v in (4, 1, 3, 2))
    assert weights[0].tolist() == pytest.approx([math.exp(4) / z, math.exp(3) / z], rel=1e-6)
    cfg.topk_method = "group_limited_greedy"  # the control: the same router limited to the best group
    limited = Router(cfg)
    limited.load_state_dict(router.state_dict())
    assert limited(torch.ones(1, 1))[1].tolist() == [[0, 1]]


def _hf_yarn_inv_freq(dim, theta, factor, l0, beta_fast, beta_slow):
    """HF transformers' YaRN inverse frequencies (``_compute_yarn_parameters``, truncate=True), in float64."""
    import math

    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def corr(turns):
        return dim * math.log(l0 / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1 / (factor * pos)) * (1 - extrapolate) + (1 / pos) * extrapolate


@pytest.mark.parametrize("dim,theta,l0,beta_fast", [(64, 10000.0, 4096, 32.0), (16, 100.0, 2 ** 20, 2.0 ** 18)])
def test_yarn_inverse_frequencies_match_hf_including_the_clamped_range(dim, theta, l0, beta_fast):
    # The second case puts the correction range past the last dimension: HF clamps it to dim - 1.
    from mla_fa3.models.rope import RopeScaling, _inv_freq_and_attention_factor

    rope = RopeScaling(rope_type="yarn", theta=theta, factor=4.0, original_max_position_embeddings=l0,
                       beta_fast=beta_fast, beta_slow=1.0)
    got, _ = _inv_freq_and_attention_factor(dim, rope)
    torch.testing.assert_close(got.double(), _hf_yarn_inv_freq(dim, theta, 4.0, l0, beta_fast, 1.0),
                               rtol=2e-6, atol=0)


def test_rope_scaling_defaults_are_deepseek_pretraining():
    from mla_fa3.models.rope import RopeScaling

    r = RopeScaling()  # HF's YaRN defaults; DeepSeek-V2/V3 pre-trained on 4096-token contexts
    assert (r.theta, r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow) == \
        (10000.0, 1.0, 4096, 32.0, 1.0)
