"""Every MLA prefill path, forced, against transformers on the tiny configs (CPU, fp32).

At the test sizes ``prefill_path="auto"`` always picks the absorbed path, so the MHA paths would be
compared with transformers only on the GPU. Here each path is forced through the backend the engine
uses — ``prefill_path="absorbed"``; ``"mha"`` without a cached prefix (one-shot MHA over the
decompressed new tokens); ``"mha"`` with chunked prefill (``max_prefill_tokens``) so later chunks see
a cached prefix, decompressed in a workspace of a few tokens (several chunks merged by LSE) — and the
oracle is transformers' own model, run once over ``prompt + our tokens`` (teacher forcing, no KV
cache). Prefill logits (every prompt position) and every decode step's logits (which read the latent
cache that the prefill path wrote) must be within ``REL_TOL`` of HF's, and the greedy tokens equal.
Each case also asserts, from ``backend.explain()``, that the forced path really ran.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from mla_fa3.backend import MLABackend
from mla_fa3.serve.engine import Engine
from mla_fa3.policy.paths import AttentionPath
from mla_fa3.models.loader import load_model
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

REL_TOL = 1e-4  # fp32 vs fp32: only the summation order differs
NEW_TOKENS = 6

# name -> (prefill_path, page size, prompt lengths, max_prefill_tokens, workspace tokens, paths that must run)
PATHS = {
    "absorbed": ("absorbed", 4, (13, 7, 21), None, 8192, {AttentionPath.ABSORBED}),
    "absorbed_chunked_prefill": ("absorbed", 4, (13, 7, 21), 8, 8192, {AttentionPath.ABSORBED}),
    "mha_oneshot": ("mha", 4, (13, 7, 21), None, 8192, {AttentionPath.MHA_ONESHOT}),
    "mha_chunked_workspace4": ("mha", 4, (13, 7, 21), 8, 4, {AttentionPath.MHA_ONESHOT, AttentionPath.MHA_CHUNKED}),
    "mha_chunked_page1_workspace3": ("mha", 1, (11, 17), 6, 3, {AttentionPath.MHA_ONESHOT, AttentionPath.MHA_CHUNKED}),
}
CONFIGS = ("tiny_v3", "tiny_v2", "v3_mla_dims")

_CACHE: dict = {}


def _models(config: str):
    if config not in _CACHE:
        hf = random_hf_model(config, seed=99)
        with tempfile.TemporaryDirectory() as d:
            _CACHE[config] = (hf, load_model(save_hf_checkpoint(hf, d, tokenizer=False)))
    return _CACHE[config]


def _prompts(vocab: int, lengths, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _engine(model, prefill_path: str, page: int, lengths, max_prefill, workspace: int):
    """An Engine whose backend forces ``prefill_path`` with a ``workspace``-token MHA chunk budget;
    every model call records (mode, path, prefix chunks) from ``backend.explain()``."""
    engine = Engine(model, page_size=page, max_batch_size=len(lengths), max_context=max(lengths) + NEW_TOKENS,
                    max_prefill_tokens=max_prefill)
    engine.backend = engine.loop.backend = MLABackend(req_to_token_pool=engine.req_to_token_pool, kv_pool=engine.kv_pool, page_size=page,
                                device=engine.device, num_heads=model.config.num_attention_heads,
                                mla_dims=model.config.mla_dims, prefill_path=prefill_path,
                                prefill_workspace_tokens=workspace)
    seen = []

    def run(*args, **kwargs):
        out = model(*args, **kwargs)
        rec = engine.backend.explain()
        seen.append((rec.mode, rec.path, getattr(rec.decision, "num_chunks", 0)))
        return out

    engine.model = engine.loop.model = run
    return engine, seen


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", list(PATHS))
def test_forced_prefill_path_matches_transformers(case, config):
    prefill_path, page, lengths, max_prefill, workspace, must_run = PATHS[case]
    if config == "v3_mla_dims":
        lengths = lengths[:2]  # the real MLA dims are 16x wider: two requests are enough
    hf, ours = _models(config)
    prompts = _prompts(ours.config.vocab_size, lengths)
    engine, seen = _engine(ours, prefill_path, page, lengths, max_prefill, workspace)
    res = engine.generate(prompts, NEW_TOKENS, return_logits=True, return_prefill_logits=True)

    prefill_steps = [(path, chunks) for mode, path, chunks in seen if mode != "DECODE"]
    # every forced path ran; a MIXED step whose prefill chunk is one token over a prefix counts it as a
    # decode row (absorbed by design: decompressing a prefix for one query never pays)
    assert must_run <= {path for path, _ in prefill_steps} <= must_run | {AttentionPath.ABSORBED}, prefill_steps
    assert all(path in must_run or mode == "MIXED" for mode, path, _ in seen if mode != "DECODE"), seen
    if AttentionPath.MHA_CHUNKED in must_run:  # the workspace really split the prefix
        assert max(chunks for _, chunks in prefill_steps) >= 2, prefill_steps
    assert all(mode == "DECODE" and path is AttentionPath.ABSORBED for mode, path, _ in seen[len(prefill_steps):])

    for b, (p, toks) in enumerate(zip(prompts, res.token_ids)):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p + toks[:-1]]), use_cache=False).logits[0]
        n = len(p)
        err = _rel(res.prefill_logits[b], ref[:n])
        assert err <= REL_TOL, f"{case}/{config} request {b}: prefill logits rel err {err:.2e}"
        for i in range(NEW_TOKENS):
            err = _rel(res.logits[b][i], ref[n - 1 + i])
            assert err <= REL_TOL, f"{case}/{config} request {b} step {i}: rel err {err:.2e}"
        assert toks == ref[n - 1:].argmax(dim=-1).tolist(), f"{case}/{config} request {b}: greedy tokens"
