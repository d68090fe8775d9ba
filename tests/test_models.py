"""Our DeepSeek V2/V3 model on the MLA backend vs transformers' own model (the oracle), on CPU, fp32.

Every case builds transformers' DeepseekV{2,3}ForCausalLM (eager attention, float32, seeded random
weights), saves it as safetensors, loads it through OUR loader and generates greedily with the
engine (paged KV cache, reference kernels). transformers then runs one full forward over
``prompt + our tokens`` (teacher forcing, no KV cache): its row ``L - 1 + i`` is what HF computes for
new token ``i`` given our prefix. We check, per case:

- prefill logits (every prompt position) and every decode step's logits: relative error
  ``max|ours - hf| / max|hf| <= 1e-4`` (fp32 vs fp32 with a different summation order);
- greedy tokens: our token == HF's argmax at every one of the 32 steps — equivalent to HF greedy
  decoding producing the same 32 tokens (and one case checks ``hf.generate`` itself).

Components are checked against HF's modules too: YaRN frequencies / attention factor / softmax scale,
and the MoE router (V2 softmax group-limited, V3 sigmoid + correction bias, noaux_tc).
"""

from __future__ import annotations

import pytest
import torch

from mla_fa3.serve.engine import Engine
from mla_fa3.models.deepseek import DeepseekConfig
from mla_fa3.models.loader import load_model
from mla_fa3.models.moe import Router
from mla_fa3.models.rope import RotaryEmbedding
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

REL_TOL = 1e-4  # fp32 ours vs fp32 HF: only summation order differs (~1e-6 seen)
NEW_TOKENS = 32

# name -> (tiny config, page size, prompt lengths, chunked-prefill budget or None, new tokens)
SPECS = {
    "v3_page1": ("tiny_v3", 1, (9, 4, 13), None, NEW_TOKENS),
    "v3_page16_chunked_prefill": ("tiny_v3", 16, (9, 4, 21), 8, NEW_TOKENS),
    "v2_page1_chunked_prefill": ("tiny_v2", 1, (11, 5), 6, NEW_TOKENS),
    "v2_page16": ("tiny_v2", 16, (11, 5, 18), None, NEW_TOKENS),
    # the real DeepSeek-V3 MLA dims (r 512, 128/64/128, q_lora 1536, 16 heads) at tiny lengths
    "v3_mla_dims_page16": ("v3_mla_dims", 16, (6, 3), None, 5),
}



_CACHE: dict = {}


def _models(config: str):
    """(hf model fp32, our loaded model fp32) of a tiny config, built once per module."""
    if config not in _CACHE:
        import tempfile

        hf = random_hf_model(config, seed=1234)
        with tempfile.TemporaryDirectory() as d:
            ours = load_model(save_hf_checkpoint(hf, d))
        _CACHE[config] = (hf, ours)
    return _CACHE[config]


def _prompts(vocab: int, lengths, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("spec", list(SPECS))
def test_prefill_and_decode_match_transformers(spec):
    config, page_size, lengths, max_prefill, new_tokens = SPECS[spec]
    hf, ours = _models(config)
    prompts = _prompts(ours.config.vocab_size, lengths)
    engine = Engine(ours, page_size=page_size, max_batch_size=len(prompts),
                    max_context=max(lengths) + new_tokens, max_prefill_tokens=max_prefill)
    res = engine.generate(prompts, new_tokens, return_logits=True, return_prefill_logits=True)
    for b, (p, toks) in enumerate(zip(prompts, res.token_ids)):
        assert len(toks) == new_tokens
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p + toks[:-1]]), use_cache=False).logits[0]
        n = len(p)
        assert res.prefill_logits[b].shape == (n, ours.config.vocab_size)
        assert _rel(res.prefill_logits[b], ref[:n]) <= REL_TOL, f"{spec} request {b}: prefill logits"
        for i in range(new_tokens):  # i = 0: the prefill's last row; i >= 1: decode step i
            err = _rel(res.logits[b][i], ref[n - 1 + i])
            assert err <= REL_TOL, f"{spec} request {b} step {i}: rel err {err:.2e}"
        hf_greedy = ref[n - 1:].argmax(dim=-1).tolist()
        assert toks == hf_greedy, f"{spec} request {b}: greedy tokens differ from transformers"


def test_greedy_equals_transformers_generate():
    """HF's own generate loop (its KV cache, its greedy search) produces our 32 tokens."""
    hf, ours = _models("tiny_v3")
    [prompt] = _prompts(ours.config.vocab_size, (10,), seed=3)
    engine = Engine(ours, page_size=4, max_batch_size=1, max_context=64)
    ours_tokens = engine.generate([prompt], NEW_TOKENS).token_ids[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=-1)
    assert out[0, len(prompt):].tolist() == ours_tokens


def test_batch_composition_does_not_change_results():
    """A request decoded alone and inside a batch of others gets the same tokens and logits."""
    _, ours = _models("tiny_v2")
    prompts = _prompts(ours.config.vocab_size, (7, 12, 3), seed=11)
    engine = Engine(ours, page_size=2, max_batch_size=3, max_context=64)
    together = engine.generate(prompts, 8, return_logits=True)
    alone = engine.generate([prompts[1]], 8, return_logits=True)
    assert together.token_ids[1] == alone.token_ids[0]
    assert _rel(together.logits[1], alone.logits[0]) <= REL_TOL


def test_graph_runner_decode_path_matches_eager_on_cpu():
    """use_cuda_graph on CPU: the graph runner's static, padded buffers run eagerly (bs 3 -> 4)."""
    _, ours = _models("tiny_v3")
    prompts = _prompts(ours.config.vocab_size, (5, 8, 2), seed=13)
    kw = dict(page_size=4, max_batch_size=4, max_context=32)
    eager = Engine(ours, **kw).generate(prompts, 6, return_logits=True)
    graphed = Engine(ours, use_cuda_graph=True, cuda_graph_batch_sizes=[1, 4], **kw).generate(
        prompts, 6, return_logits=True)
    assert graphed.token_ids == eager.token_ids
    for a, b in zip(graphed.logits, eager.logits):
        assert _rel(a, b) <= REL_TOL


def test_eos_retires_a_request_early():
    _, ours = _models("tiny_v2")
    prompts = _prompts(ours.config.vocab_size, (6, 9), seed=17)
    engine = Engine(ours, page_size=4, max_batch_size=2, max_context=32)
    full = engine.generate(prompts, 10).token_ids
    eos = full[0][3]
    stopped = engine.generate(prompts, 10, eos_token_id=eos).token_ids
    cut = [t[: t.index(eos) + 1] if eos in t else t for t in full]
    assert stopped == cut and len(stopped[0]) <= 4


@pytest.mark.parametrize("config", ["tiny_v3", "tiny_v2", "v3_mla_dims"])
def test_rope_scale_and_frequencies_match_transformers(config):
    hf, ours = _models(config)
    cfg = ours.config
    hf_rotary = hf.model.rotary_emb
    ours_rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, interleaved=cfg.rope_interleave)
    torch.testing.assert_close(ours_rotary.inv_freq, hf_rotary.inv_freq.float(), rtol=1e-6, atol=0)
    assert ours_rotary.attention_factor == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_yarn_config_is_really_exercised():
    """Guard: the V3 case has YaRN with mscale != mscale_all_dim (both factors differ from 1)."""
    _, ours = _models("tiny_v3")
    cfg = ours.config
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor > 1
    assert ours.rotary.attention_factor != pytest.approx(1.0)
    assert cfg.softmax_scale != pytest.approx(cfg.qk_head_dim ** -0.5)


@pytest.mark.parametrize("config", ["tiny_v3", "tiny_v2"])
def test_router_matches_transformers(config):
    """Selected experts (as sets) and their weights equal HF's router on random hidden states."""
    hf, ours = _models(config)
    layer = ours.config.first_k_dense_replace
    hf_gate = hf.model.layers[layer].mlp.gate
    router: Router = ours.model.layers[layer].mlp.gate
    x = torch.randn(64, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_w, hf_idx = hf_gate(x)
        w, idx = router(x)
    hf_order, order = hf_idx.argsort(dim=-1), idx.argsort(dim=-1)
    assert torch.equal(hf_idx.gather(1, hf_order), idx.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), hf_w.float().gather(1, hf_order), rtol=1e-6, atol=1e-7)


def test_config_from_hf_reads_every_field():
    hf, _ = _models("tiny_v2")
    cfg = DeepseekConfig.from_hf(hf.config)
    assert (cfg.q_lora_rank, cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group) == \
        (None, "softmax", "group_limited_greedy", 4, 2)
    raw = hf.config.to_dict()
    assert DeepseekConfig.from_hf(raw) == cfg
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekConfig.from_hf({**raw, "kv_lora_rank": None})
    with pytest.raises(ValueError, match="model_type"):
        DeepseekConfig.from_hf({**raw, "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_scaling"):
        DeepseekConfig.from_hf({**raw, "rope_parameters": {"rope_type": "longrope"}})


def test_engine_rejects_bad_requests_before_running():
    _, ours = _models("tiny_v2")
    engine = Engine(ours, page_size=4, max_batch_size=2, max_context=16)
    with pytest.raises(ValueError, match="max_context"):
        engine.generate([[1] * 10], 8)
    with pytest.raises(ValueError, match="max_batch_size"):
        engine.generate([[1], [2], [3]], 2)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        engine.generate([[ours.config.vocab_size]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], 0)
    # nothing leaked: the whole pool is free again after the rejected / finished calls
    engine.generate([[1, 2, 3]], 2)
    assert engine.req_to_token_pool.available_size() == 2
    assert engine.allocator.num_free_pages() == engine.allocator.num_pages - 1
