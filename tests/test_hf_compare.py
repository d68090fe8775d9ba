"""``hf_compare`` position by position, and teacher-forced decoding in the engine, against transformers.

The oracle is transformers' own model run here on ``prompt + forced tokens`` (one full forward, no
cache): the report's per-position reference argmax must be its argmax, our fp32 engine must agree at
every row, and the engine must emit exactly the forced tokens (also across chunked prefill and MIXED
steps, where forced decode rows run next to prefill chunks).
"""

from __future__ import annotations

import pytest
import torch

from mla_fa3.hf_compare import format_report, run_validate
from mla_fa3.models.tiny import random_hf_model
from mla_fa3.serve.scheduler import Request


def _draw(lengths, n_new, seed=3, vocab=256):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return prompts, [torch.randint(0, vocab, (n_new,), generator=g).tolist() for _ in lengths]


@pytest.mark.parametrize("max_prefill_tokens", [None, 4])
def test_teacher_forced_positions_against_transformers(max_prefill_tokens):
    steps = 6
    prompts, forced = _draw((9, 5), steps + 1)
    report = run_validate(prompts=prompts, forced_tokens=forced, steps=steps, page_size=4, seed=0,
                          max_prefill_tokens=max_prefill_tokens)
    hf = random_hf_model("tiny_v3", seed=0)  # the model run_validate builds for seed 0
    with torch.no_grad():
        ref = [hf(input_ids=torch.tensor([p + f[:steps]]), use_cache=False).logits[0].argmax(-1)
               for p, f in zip(prompts, forced)]
    assert report.token_ids == forced and report.forced
    # the forced text is not what greedy decoding would give: forcing is what makes these the contexts
    assert any(f[i] != int(r[len(p) - 1 + i]) for p, f, r in zip(prompts, forced, ref) for i in range(steps))
    pos = report.positions
    assert len(pos) == sum(len(p) + steps for p in prompts)
    assert pos.decode.tolist() == sum(([False] * len(p) + [True] * steps for p in prompts), [])
    assert torch.equal(pos.ref_top1, torch.cat(ref))
    assert torch.equal(pos.ours_top1, torch.cat(ref)) and float(pos.cosine.min()) > 0.99999
    assert pos.base_top1 is None and report.kv_scales is None
    assert report.passed and "top-1 at every step (teacher-forced) identical to transformers: yes" in format_report(report)


def test_greedy_report_keeps_positions_and_fp8_scales():
    report = run_validate(steps=3, page_size=64, prompt_lengths=(6, 4), kv_dtype="fp8", kv_scales=0.02)
    assert not report.forced and len(report.positions) == 6 + 4 + 2 * 3
    assert report.kv_scales == pytest.approx([0.02] * 3)
    # greedy: each decode step's token is our argmax at the row before it (step 0: the prompt's last row)
    ours = report.positions.ours_top1.split([6 + 3, 4 + 3])
    for p, toks, o in zip(report.prompts, report.token_ids, ours):
        assert toks[:4] == o[len(p) - 1:].tolist()


def test_forced_tokens_are_checked():
    from mla_fa3.models.loader import load_model
    from mla_fa3.models.tiny import save_hf_checkpoint
    from mla_fa3.serve.engine import Engine
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(save_hf_checkpoint(random_hf_model("tiny_v3", seed=1), tmp))
    engine = Engine(model, page_size=4, max_batch_size=2, max_context=32)
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[1, 2]], 3, forced_tokens=[[1, 2, 3], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"forced_tokens\[0\] holds 2 tokens, fewer than max_new_tokens 3"):
        engine.generate([[1, 2]], 3, forced_tokens=[[1, 2]])
    with pytest.raises(ValueError, match=r"forced_tokens\[1\] holds token ids outside"):
        engine.generate([[1, 2], [3]], 2, forced_tokens=[[1, 2], [3, 256]])
    with pytest.raises(ValueError, match="request.forced of request 7 holds 1 tokens"):
        engine.loop.run([Request(rid=7, prompt=[1, 2], max_new_tokens=2, forced=[5])])
    assert engine.generate([[1, 2], [3]], 4, forced_tokens=[[9, 8, 7, 6, 5], [4, 3, 2, 1]]).token_ids == \
        [[9, 8, 7, 6], [4, 3, 2, 1]]  # longer lists are cut to max_new_tokens
