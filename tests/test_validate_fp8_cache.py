"""``validate --kv-dtype fp8``: our FP8 path judged against the e4m3 reference, the cost of e4m3 reported apart.

Oracles: transformers' own model in float64 (the e4m3 reference with nothing rounded must be it, for the V2 and
the V3 layouts and for chunked prefill steps), and the checkpoint's own tensors for the scale it names. The
judge must fail on a defect: errors planted in our FP8 path — rows stored with a wrong scale, rows stored in
the wrong slots, the cache read with a wrong descale — each make ``run_validate`` FAIL, while the path as it
is PASSES with every step within fp32 rounding of the reference.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_fa3 import cli, ops
from mla_fa3.hf_compare import RowRun, StepRun, e4m3_reference_logits, format_report, report_json, run_validate
from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

FAST = dict(steps=2, prompt_lengths=(6, 4), page_size=64, kv_dtype="fp8")


@pytest.fixture(autouse=True)
def _restore_threads():
    old = torch.get_num_threads()  # the CLI sets 1 thread on CPU
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("config", ["tiny_v3", "tiny_v2"])
def test_the_reference_without_rounding_is_transformers(config):
    """kv_scales=None: the reference's own attention (absorbed, float64) over any step sequence — prompt chunks
    over a prefix, decode rows of several requests in one forward — gives transformers' float64 logits."""
    hf = random_hf_model(config, seed=5)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 3)]
    toks = [torch.randint(0, 256, (4,), generator=g).tolist() for _ in prompts]
    steps = [StepRun((RowRun(0, 0, 4), RowRun(1, 0, 3)), "splitkv"),  # request 0 in two chunks, request 1 whole
             StepRun((RowRun(0, 4, 3), RowRun(1, 3, 1)), "flashmla"),  # a MIXED step: a chunk and a decode row
             *[StepRun((RowRun(0, 6 + k, 1), RowRun(1, 3 + k, 1)), "flashmla") for k in (1, 2, 3)]]
    got = e4m3_reference_logits(hf, prompts, toks, steps, None).logits
    ref = hf.double()
    ref.set_experts_implementation("eager")  # the grouped-mm experts do not take float64
    with torch.no_grad():
        for p, t, lg in zip(prompts, toks, got):
            want = ref(input_ids=torch.tensor([p + t[:-1]]), use_cache=False).logits[0]
            # transformers' eager attention takes its softmax in float32 even in a float64 model: 1e-7, not 1e-16
            assert lg.shape == want.shape and torch.allclose(lg, want, rtol=0, atol=1e-6 * float(want.abs().max()))


def _max_rel(report) -> float:
    return max(r.rel for r in report.rows)


@pytest.mark.parametrize("kernel, page, chunk", [("flashmla", 64, None), ("splitkv", 16, 3)])
def test_fp8_path_passes_against_the_e4m3_reference(kernel, page, chunk):
    report = run_validate(**dict(FAST, page_size=page), decode_kernel=kernel, max_prefill_tokens=chunk)
    run = report.fp8
    assert report.passed and report.reference == "e4m3 reference float64"
    assert _max_rel(report) < 1e-5 and report.thresholds == (1e-4, 0.99999, 1.0)  # fp32 rounding, every step
    assert run.cache.ok and run.cache.values > 0 and run.query.ok
    assert (run.query.values > 0) == (kernel == "flashmla")  # only FlashMLA's FP8 read rounds the query
    assert list(run.kernels) == [kernel] and run.scale_source == "calibrated" and all(s > 0 for s in run.kv_scales)
    if chunk:  # prompts in chunks of 3 tokens: MIXED steps, and the reference followed them
        assert any(len({x.is_decode for x in s.rows}) == 2 for s in run.steps)
    text = format_report(report)
    assert "FP8 scale: calibrated on the prompts" in text and "what FP8 costs on this model" in text
    assert "\nPASS: vs the e4m3 reference" in text
    data = json.loads(report_json(report))
    assert data["passed"] and data["fp8"]["scale_source"] == "calibrated" and data["fp8"]["stored_cache"]["ok"]
    assert len(data["fp8"]["vs_transformers"]["rows"]) == len(data["rows"]) == 3
    cost = data["fp8"]["vs_transformers"]
    assert 0 <= cost["top1_agreement"] <= 1 and cost["positions"] == 6 + 4 + 2 * 2


def test_the_scale_is_the_checkpoints_when_it_has_one(tmp_path):
    path = save_hf_checkpoint(random_hf_model("tiny_v3", seed=2), str(tmp_path))
    tensors = load_file(f"{path}/model.safetensors")
    for i, s in enumerate((0.011, 0.013, 0.017)):
        tensors[f"model.layers.{i}.self_attn.kv_scale"] = torch.tensor(s)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    report = run_validate(path, **FAST, decode_kernel="splitkv")
    assert report.passed and report.fp8.scale_source == "checkpoint"
    assert report.fp8.kv_scales == pytest.approx([0.011, 0.013, 0.017])
    assert "FP8 scale: the checkpoint's: 0.011, 0.013, 0.017" in format_report(report)
    given = run_validate(path, **FAST, decode_kernel="splitkv", kv_scales=0.05)
    assert given.fp8.scale_source == "given" and given.fp8.kv_scales == pytest.approx([0.05] * 3)


def _store_with(transform):
    store = ops.store_e4m3

    def planted(out, loc, x, scale, **kw):
        loc, scale = transform(loc, scale)
        return store(out, loc, x, scale, **kw)

    return planted


@pytest.mark.parametrize("plant", ["store_scale_x2", "rows_in_swapped_slots", "read_descale_x2"])
def test_a_planted_error_in_the_fp8_path_fails(plant, monkeypatch):
    if plant == "store_scale_x2":
        monkeypatch.setattr(ops, "store_e4m3", _store_with(lambda loc, s: (loc, s * 2)))
    elif plant == "rows_in_swapped_slots":  # each step's rows written to one another's slots
        monkeypatch.setattr(ops, "store_e4m3", _store_with(lambda loc, s: (loc.flip(0), s)))
    else:
        read = ops.flash_mla_with_kvcache
        monkeypatch.setattr(ops, "flash_mla_with_kvcache",
                            lambda *a, descale_k=None, **kw: read(*a, descale_k=descale_k * 2, **kw))
    report = run_validate(**FAST, decode_kernel="flashmla")
    assert not report.passed and "\nFAIL: vs the e4m3 reference" in format_report(report)
    if plant == "read_descale_x2":  # layer 0 stored right, read wrong: the logits show it (and the later layers'
        assert _max_rel(report) > 0.1  # rows, computed from what layer 0 read)
        assert not (report.fp8.cache.first_wrong or "").startswith("layer 0,")
    else:  # stored wrong: the stored rows are not e4m3 of the reference's
        assert not report.fp8.cache.ok and "<- wrong" in format_report(report)


def test_cli_validate_fp8_exit_status(monkeypatch, capsys):
    assert cli.main(["validate", "--quiet", "--kv-dtype", "fp8", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "what FP8 costs on this model (vs transformers float32, no FP8):\n  top-1 agreement" in out
    monkeypatch.setattr(ops, "store_e4m3", _store_with(lambda loc, s: (loc, s * 2)))
    assert cli.main(["validate", "--quiet", "--kv-dtype", "fp8", "--steps", "2", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["passed"] and not data["fp8"]["stored_cache"]["ok"]
