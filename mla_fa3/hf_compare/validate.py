"""Validate our DeepSeek model on the MLA backend against transformers' own model (``mla-fa3 validate``).

Procedure, for a checkpoint directory (or a tiny random DeepSeek-V3 written to a temp dir):

1. ours = ``load_model(dir)`` (our loader, FP8 dequantized) driven by :class:`mla_fa3.serve.engine.Engine`:
   prefill (all prompt logits kept), then ``steps`` batched paged DECODE steps, greedy;
2. the reference = transformers' ``DeepseekV{2,3}ForCausalLM`` in float32 with eager attention
   (:mod:`.reference`: ``from_pretrained``, or for an FP8 block-scaled checkpoint the weights read and
   dequantized there, independently of our loader);
3. the reference runs ONE full forward over ``prompt + our tokens`` per prompt (teacher forcing):
   row ``L - 1 + i`` holds the logits HF computes for new token ``i`` given exactly our prefix, so
   "every step's argmax agrees" is the same statement as "HF greedy generates the same tokens".

Per step (step 0 = prefill, every prompt position; step i = decode step i) the table reports
max |ours - ref|, the relative error ``max|ours - ref| / max|ref|``, the cosine similarity of the
logit rows and how many requests' greedy tokens agree. Thresholds come from the dtype (:data:`TOLERANCES`).
In bf16 / fp16 the same reference cast to that dtype is run too (the *baseline*: what torch itself gets
in that precision, MoE routing flips included): a step also passes when our error is at most twice the
baseline's (``rel <= 2 rel_base``, ``1 - cos <= 2 (1 - cos_base)``).

Over every compared position the report also gives the top-1 agreement and the mean logit cosine, and keeps
them position by position (:class:`PositionScores`, against transformers) for paired comparisons
(``mla_fa3.kv_accuracy``). With ``forced_tokens`` the decode steps are teacher-forced in our engine too.

**FP8 latent cache** (``kv_dtype="fp8"``). Rounding the cache to e4m3 (3 mantissa bits) moves the logits
for real: on the tiny random models most decode steps by 0.02-0.2 relative, and single steps by 0.3-1 with
top-1 flips — the steps where the rounding tips a routed-expert choice. So transformers cannot be the judge.
The judged reference is the *e4m3 reference* (:mod:`.fp8_reference`): transformers' model in float64 over
exactly the roundings our path makes (the cache as stored, FlashMLA's query), following the steps our engine
ran, with the thresholds of :data:`TOLERANCES` (96 runs of the tiny models, 4 seeds x 2 configs x 3 scales x 4
kernel / page settings, agree to 1.1e-6 relative at most). In bf16 / fp16 the baseline is the e4m3 reference
run in that dtype, compared rank by rank (our k-th worst step within twice the baseline's k-th worst): the
model dtype's rounding tips routing decisions at different steps in the two runs. The cost of e4m3 itself
is reported apart: the same steps against transformers (no quantization), top-1 agreement, relative error and
cosine (:class:`FP8Run`). The scale is ``kv_scales`` when given, else the checkpoint's, else calibrated on the
prompts (``Engine.calibrate_kv_scales``: per layer, the prefill's absmax / 448); the report says which.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from mla_fa3.hf_compare.fp8_reference import TIE_WINDOW, CodeCheck, StepRun, e4m3_reference_logits, record_steps
from mla_fa3.hf_compare.reference import hf_reference_model, teacher_forced_logits
from mla_fa3.models.loader import check_checkpoint, load_model

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCES", "StepRow", "PositionScores", "FP8Run", "ValidateReport",
           "run_validate", "format_report", "report_json", "position_scores"]

# dtype -> (max relative logit error, min cosine, min fraction of agreeing greedy tokens)
TOLERANCES = {
    torch.float32: (1e-4, 0.99999, 1.0),
    torch.float16: (2e-2, 0.999, 0.9),
    torch.bfloat16: (6e-2, 0.995, 0.9),
}

@dataclass
class StepRow:
    step: int  # 0 = prefill, i = decode step i
    max_abs: float
    rel: float
    cosine: float  # smallest cosine similarity of a logit row in this step
    agree: int  # requests whose greedy token agrees with HF's argmax
    total: int
    base_rel: float | None = None  # the baseline's (HF in the low dtype) relative error, when run
    base_cosine: float | None = None
    top1: int = 0  # compared positions (logit rows) whose argmax equals HF's
    positions: int = 0  # logit rows compared (prefill: every prompt position; decode: one per request)
    cos_sum: float = 0.0  # sum of the rows' logit cosines

    def within(self, rel_tol: float, cos_tol: float) -> bool:
        rel_ok = self.rel <= rel_tol or (self.base_rel is not None and self.rel <= 2 * self.base_rel)
        cos_ok = self.cosine >= cos_tol or (self.base_cosine is not None
                                            and 1 - self.cosine <= 2 * (1 - self.base_cosine))
        return rel_ok and cos_ok


@dataclass
class PositionScores:
    """Every compared logit row, request by request: the prompt's positions, then decode steps 1 .. steps."""

    ours_top1: torch.Tensor  # [N] int64 cpu: our argmax
    ref_top1: torch.Tensor  # [N] int64 cpu: transformers' (float32) argmax
    cosine: torch.Tensor  # [N] float64 cpu: cosine similarity of our logit row and the reference's
    decode: torch.Tensor  # [N] bool cpu: a decode step's row (False: a prompt position, from the prefill)
    base_top1: torch.Tensor | None = None  # [N] int64 cpu: transformers in the model dtype (bf16 / fp16 runs)

    @property
    def hits(self) -> torch.Tensor:
        """[N] bool: our argmax equals transformers'."""
        return self.ours_top1 == self.ref_top1

    def __len__(self) -> int:
        return self.ours_top1.numel()


@dataclass
class FP8Run:
    """An FP8 latent cache's run: its scales, its kernels, and what e4m3 costs against transformers."""

    scale_source: str  # "given" (kv_scales), "checkpoint" (its kv scales) or "calibrated" (on the prompts)
    kv_scales: list[float]  # per layer, as used
    kernels: dict[str, int]  # decode kernel -> steps whose decode rows it read ("flashmla" also rounds q)
    hf_rows: list[StepRow]  # our run against transformers float32 (no quantization), step by step
    steps: list[StepRun]  # what each step of our engine computed (the e4m3 reference followed it)
    cache: CodeCheck  # the e4m3 rows our pool stored against the reference's own rounding
    query: CodeCheck  # FlashMLA's e4m3 queries against the reference's own rounding
    codes_judged: bool = True  # the two checks decide PASS too (float32 models; in half precision our rows can
    # differ further for real: a MoE routing decision flipped by its rounding)

    def cost(self) -> dict:
        """The cost of e4m3 against transformers: top-1 agreement (all positions, decode rows), cosine, rel err."""
        rows, dec = self.hf_rows, [r for r in self.hf_rows if r.step > 0]
        worst_cos, worst_rel = min(rows, key=lambda r: r.cosine), max(rows, key=lambda r: r.rel)
        return {"top1_agreement": sum(r.top1 for r in rows) / max(1, sum(r.positions for r in rows)),
                "positions": sum(r.positions for r in rows),
                "decode_top1_agreement": sum(r.top1 for r in dec) / max(1, sum(r.positions for r in dec)),
                "decode_positions": sum(r.positions for r in dec),
                "mean_cosine": sum(r.cos_sum for r in rows) / max(1, sum(r.positions for r in rows)),
                "min_cosine": worst_cos.cosine, "min_cosine_step": worst_cos.step,
                "median_rel": statistics.median(r.rel for r in rows), "max_rel": worst_rel.rel,
                "max_rel_step": worst_rel.step}


@dataclass
class ValidateReport:
    rows: list[StepRow]  # against the judged reference: transformers, or the e4m3 reference (FP8 cache)
    dtype: torch.dtype
    page_size: int
    checkpoint: str
    thresholds: tuple[float, float, float]
    prompts: list[list[int]] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    kv_dtype: str = "auto"
    positions: PositionScores | None = None  # against transformers float32
    kv_scales: list[float] | None = None  # the FP8 cache's per-layer scales, as used
    forced: bool = False  # decode teacher-forced on given tokens (not our greedy ones)
    reference: str = "transformers float32"  # what ``rows`` were judged against
    fp8: FP8Run | None = None

    @property
    def top1_agreement(self) -> float:
        """Fraction of every compared position (prefill and decode) whose argmax equals the reference's."""
        return sum(r.top1 for r in self.rows) / max(1, sum(r.positions for r in self.rows))

    @property
    def mean_cosine(self) -> float:
        return sum(r.cos_sum for r in self.rows) / max(1, sum(r.positions for r in self.rows))

    @property
    def agree_fraction(self) -> float:
        decode = [r for r in self.rows if r.step > 0] or self.rows
        return sum(r.agree for r in decode) / max(1, sum(r.total for r in decode))

    @property
    def greedy_identical(self) -> bool:
        return all(r.agree == r.total for r in self.rows)

    @property
    def ranked(self) -> bool:
        """Steps judged against the baseline rank by rank, not step by step: an FP8 cache in half precision, where
        the model dtype's rounding tips MoE routing at different steps in our run and in the baseline."""
        return self.fp8 is not None and self.rows[0].base_rel is not None

    def steps_within(self) -> bool:
        rel, cos, _ = self.thresholds
        if all(r.within(rel, cos) for r in self.rows):
            return True
        if not self.ranked:
            return False
        # the k-th worst step of ours against the k-th worst of the baseline (implied by the step-by-step rule)
        rels = zip(sorted(r.rel for r in self.rows), sorted(r.base_rel for r in self.rows))
        coss = zip(sorted(1 - r.cosine for r in self.rows), sorted(1 - r.base_cosine for r in self.rows))
        return all(o <= max(rel, 2 * b) for o, b in rels) and all(o <= max(1 - cos, 2 * b) for o, b in coss)

    @property
    def passed(self) -> bool:
        run = self.fp8
        codes_ok = run is None or not run.codes_judged or (run.cache.ok and run.query.ok)
        return self.steps_within() and self.agree_fraction >= self.thresholds[2] and codes_ok


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _fp8_thresholds(dtype: torch.dtype, device: str) -> tuple[float, float, float]:
    """:data:`TOLERANCES` of the dtype (the e4m3 reference makes the same roundings); on CUDA at least bf16's:
    the FP8 kernels compute in bf16 and FlashMLA's FP8 read also rounds the probabilities, which the reference
    leaves out (not yet run on a GPU)."""
    rel, cos, agree = TOLERANCES[dtype]
    if torch.device(device).type == "cuda":
        b_rel, b_cos, b_agree = TOLERANCES[torch.bfloat16]
        rel, cos, agree = max(rel, b_rel), min(cos, b_cos), min(agree, b_agree)
    return rel, cos, agree


@torch.inference_mode()
def run_validate(checkpoint: str | None = None, *, page_size: int = 16, dtype: torch.dtype = torch.float32,
                 steps: int = 16, device: str = "cpu", seed: int = 0, prompt_lengths=(11, 6, 17),
                 max_prefill_tokens: int | None = None, use_cuda_graph: bool = False, config: str | None = None,
                 progress: Callable[[str, int, int], None] | None = None, kv_dtype: str = "auto",
                 kv_scales=None, prompts: list[list[int]] | None = None,
                 forced_tokens: list[list[int]] | None = None, decode_kernel: str = "auto") -> ValidateReport:
    """Run the comparison (module docstring). ``checkpoint=None`` builds the embedded ``config``
    (``models.tiny.TINY_CONFIGS``; default ``tiny_v3`` on CPU, ``v3_mla_dims`` on CUDA, whose MLA
    head dims are the ones FA3 implements). What it does is logged (``logging``, INFO);
    ``progress(phase, i, n)`` follows loading ("load") and generation ("prefill", "decode").

    ``prompts``: token-id lists (default: random ones of ``prompt_lengths``, from ``seed + 1``).
    ``forced_tokens``: per prompt ``steps + 1`` new tokens to teacher-force (default: our greedy ones).
    ``kv_scales``: the FP8 cache's per-layer scales (a list, or one float for every layer; default: the
    checkpoint's, else calibrated on the prompts). ``decode_kernel``: the backend's setting ("auto", "fa3",
    "flashmla", "splitkv")."""
    from mla_fa3.serve.engine import Engine

    say = logger.info
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {[str(d) for d in TOLERANCES]}, got {dtype}")
    tmp = None
    if checkpoint is None:
        from mla_fa3.models.tiny import random_hf_model, save_hf_checkpoint

        if config is None:
            config = "tiny_v3" if torch.device(device).type == "cpu" else "v3_mla_dims"
        tmp = tempfile.TemporaryDirectory(prefix="mla_fa3_tiny_")
        say(f"building {config} with transformers (random weights, seed {seed})")
        hf = random_hf_model(config, seed=seed)
        save_hf_checkpoint(hf, tmp.name)
        path, label = tmp.name, f"{config} (embedded config, random weights)"
        hf = hf.to(device)
    else:
        path, label = checkpoint, checkpoint
        check_checkpoint(path)  # unreadable config / safetensors: one error naming the file, before transformers
        say(f"loading the transformers reference from {path}")
        hf = hf_reference_model(path, device)
    try:
        say("loading our model through mla_fa3.models.loader")
        ours = load_model(path, dtype=dtype, device=device, progress=progress)
        if prompts is None:
            prompts = _prompts(ours.config.vocab_size, tuple(prompt_lengths), seed + 1)
        prompts = [[int(t) for t in p] for p in prompts]
        engine = Engine(ours, page_size=page_size, max_batch_size=len(prompts),
                        max_context=max(map(len, prompts)) + steps + 1, max_prefill_tokens=max_prefill_tokens,
                        use_cuda_graph=use_cuda_graph, kv_dtype=kv_dtype, kv_scales=kv_scales,
                        decode_kernel=decode_kernel)
        fp8 = engine.kv_pool.is_fp8
        source = None
        if fp8:
            source = "given" if kv_scales is not None else "checkpoint" if ours.kv_scales is not None else "calibrated"
            if source == "calibrated":
                say("calibrating the FP8 cache's scales on the prompts (the checkpoint has none)")
                engine.calibrate_kv_scales(prompts)
        with record_steps(engine) if fp8 else contextlib.nullcontext() as ran:
            res = engine.generate(prompts, steps + 1, return_logits=True, return_prefill_logits=True,
                                  progress=progress, forced_tokens=forced_tokens)
        scales = [float(x) for x in engine.kv_pool.scale] if fp8 else None
        say("transformers reference forward (teacher-forced on the new tokens)")
        refs = teacher_forced_logits(hf, prompts, res.token_ids, device)
        judged, base = refs, None
        if fp8:
            say("e4m3 reference (transformers' modules in float64, the cache rounded as our pool stores it)")
            e4m3 = e4m3_reference_logits(hf, prompts, res.token_ids, ran, scales, tie_window=TIE_WINDOW[dtype])
            judged = e4m3.logits
            if dtype != torch.float32:
                say(f"e4m3 reference baseline in {dtype}")
                base = e4m3_reference_logits(hf, prompts, res.token_ids, ran, scales, dtype=dtype,
                                             tie_window=TIE_WINDOW[dtype]).logits
        elif dtype != torch.float32:
            say(f"transformers baseline in {dtype}")
            base = teacher_forced_logits(copy.deepcopy(hf).to(dtype), prompts, res.token_ids, device)
    finally:
        if tmp is not None:
            tmp.cleanup()
    rows = _rows(prompts, steps, res, judged, base)
    if not fp8:
        return ValidateReport(rows, dtype, page_size, label, TOLERANCES[dtype], prompts, res.token_ids, "auto",
                              position_scores(prompts, steps, res, refs, base), None, forced_tokens is not None)
    kernels: dict[str, int] = {}
    for step in ran:
        if any(x.is_decode for x in step.rows):
            kernels[step.kernel] = kernels.get(step.kernel, 0) + 1
    run = FP8Run(source, scales, kernels, _rows(prompts, steps, res, refs, None), ran, e4m3.cache, e4m3.query,
                 dtype == torch.float32)
    return ValidateReport(rows, dtype, page_size, label, _fp8_thresholds(dtype, device), prompts, res.token_ids,
                          "float8_e4m3fn", position_scores(prompts, steps, res, refs), scales,
                          forced_tokens is not None, "e4m3 reference float64", run)


def _rows(prompts, steps: int, res, refs, bases) -> list[StepRow]:
    """Step 0 (every prompt position of the prefill) and decode steps 1 .. steps of a generation against ``refs``
    (per prompt [L + steps, V], the layout of ``teacher_forced_logits``) and ``bases`` (same, or None)."""
    bases = bases or [None] * len(prompts)
    rows = [_row(0, [(pl, ref[: len(p)], None if b is None else b[: len(p)])
                     for p, pl, ref, b in zip(prompts, res.prefill_logits, refs, bases)])]
    for i in range(1, steps + 1):
        sl = [slice(len(p) - 1 + i, len(p) + i) for p in prompts]
        rows.append(_row(i, [(lg[i: i + 1], ref[s], None if b is None else b[s])
                             for s, lg, ref, b in zip(sl, res.logits, refs, bases)]))
    return rows


def position_scores(prompts, steps: int, res, refs, bases=None) -> PositionScores:
    """Score a generation (``Engine.generate`` with both logit kinds, ``steps + 1`` new tokens) against
    :func:`teacher_forced_logits` ``refs`` (and ``bases``, transformers in the model dtype, or None), row by
    row: prompt positions 0 .. L-1 (the prefill's logits), then decode step i = 1 .. steps (the logits of
    new token i, HF's row L - 1 + i)."""
    ours = [torch.cat([pl, lg[1: steps + 1]]) for pl, lg in zip(res.prefill_logits, res.logits)]
    refs = [ref[: len(p) + steps] for p, ref in zip(prompts, refs)]
    o, r = torch.cat(ours).double(), torch.cat(refs).double()
    decode = torch.cat([torch.arange(len(p) + steps) >= len(p) for p in prompts])
    base = None if bases is None else torch.cat([b[: len(p) + steps] for p, b in zip(prompts, bases)]).argmax(-1)
    return PositionScores(o.argmax(-1), r.argmax(-1), F.cosine_similarity(o, r, dim=-1), decode, base)


def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(max abs error, relative error, smallest row cosine) of x against ref, in float64."""
    x, ref = x.double(), ref.double()
    diff = (x - ref).abs().max().item()
    cos = F.cosine_similarity(x, ref, dim=-1).min().item()
    return diff, diff / max(ref.abs().max().item(), 1e-30), cos


def _row(step: int, items) -> StepRow:
    """items: (ours [n, V], ref [n, V], baseline [n, V] or None) per request. Token agreement: the last
    row's argmax against the reference's (our new token from that row, unless teacher-forced; step 0: the
    prompt's last position, which gives the first new token)."""
    max_abs = rel = 0.0
    cos = 1.0
    base_rel, base_cos = 0.0, 1.0
    has_base = False
    agree = total = top1 = positions = 0
    cos_sum = 0.0
    for ours, ref, base in items:
        top1 += int((ours.argmax(dim=-1) == ref.argmax(dim=-1)).sum())
        positions += ours.shape[0]
        cos_sum += float(F.cosine_similarity(ours.double(), ref.double(), dim=-1).sum())
        d, r, c = _errors(ours, ref)
        max_abs, rel, cos = max(max_abs, d), max(rel, r), min(cos, c)
        if base is not None:
            has_base = True
            _, r, c = _errors(base, ref)
            base_rel, base_cos = max(base_rel, r), min(base_cos, c)
        agree += int(int(ref[-1].argmax()) == int(ours[-1].argmax()))
        total += 1
    return StepRow(step, max_abs, rel, cos, agree, total,
                   base_rel if has_base else None, base_cos if has_base else None, top1, positions, cos_sum)


def _header(report: ValidateReport) -> list[str]:
    return [f"checkpoint: {report.checkpoint}",
            f"dtype: {str(report.dtype).replace('torch.', '')}   kv cache: {report.kv_dtype}   "
            f"page_size: {report.page_size}   "
            f"requests: {len(report.prompts)} (prompt lengths {[len(p) for p in report.prompts]})"]


def _rule(report: ValidateReport) -> str:
    rel_t, cos_t, agree_t = report.thresholds
    rule = f"rel err <= {rel_t:g}, cosine >= {cos_t:g}"
    if report.ranked:
        rule = f"({rule}) or, step errors ranked, each within 2x the baseline's of the same rank"
    elif report.rows[0].base_rel is not None:
        rule = f"({rule}) or within 2x the baseline's error"
    return f"{rule}; token agreement >= {agree_t:.0%}"


def format_report(report: ValidateReport) -> str:
    """The human-readable table plus a PASS / FAIL line (FP8 cache: :func:`_format_fp8`)."""
    if report.fp8 is not None:
        return _format_fp8(report)
    rel_t, cos_t, _ = report.thresholds
    lines = _header(report) + [
        f"{'step':>7} {'max abs err':>12} {'rel err':>10} {'min cos':>10} {'token agree':>12}"
        + ("   baseline rel / cos (HF in this dtype)" if report.rows[0].base_rel is not None else "")]
    for r in report.rows:
        name = "prefill" if r.step == 0 else str(r.step)
        line = f"{name:>7} {r.max_abs:12.3e} {r.rel:10.3e} {r.cosine:10.6f} {r.agree:>7}/{r.total:<4}"
        if r.base_rel is not None:
            line += f"   {r.base_rel:10.3e} / {r.base_cosine:.6f}"
        lines.append(line + ("" if r.within(rel_t, cos_t) else "   <- over threshold"))
    what = "top-1 at every step (teacher-forced)" if report.forced else "greedy tokens"
    lines.append(f"{what} identical to transformers: {'yes' if report.greedy_identical else 'no'} "
                 f"(decode agreement {report.agree_fraction:.1%})")
    lines.append(f"top-1 agreement over {sum(r.positions for r in report.rows)} positions (prefill + decode): "
                 f"{report.top1_agreement:.1%}; mean logit cosine {report.mean_cosine:.6f}")
    lines.append(f"{'PASS' if report.passed else 'FAIL'}: thresholds {_rule(report)}")
    return "\n".join(lines)


_SOURCES = {"given": "given", "checkpoint": "the checkpoint's",
            "calibrated": "calibrated on the prompts (prefill absmax / 448; the checkpoint has none)"}


def _format_fp8(report: ValidateReport) -> str:
    """FP8 cache: each step against the e4m3 reference (judged) and against transformers (what e4m3 costs)."""
    run, (rel_t, cos_t, _) = report.fp8, report.thresholds
    kernels = ", ".join(f"{k} ({n} steps{'; its FP8 read rounds q to e4m3 too' if k == 'flashmla' else ''})"
                        for k, n in run.kernels.items())
    lines = _header(report) + [
        f"FP8 scale: {_SOURCES[run.scale_source]}: {', '.join(f'{s:.4g}' for s in run.kv_scales)} (per layer)",
        f"decode kernel: {kernels or 'none (no decode step)'}",
        f"{'':>7} {'vs the e4m3 reference (judged)':^31} | {'vs transformers (no FP8)':^31}",
        f"{'step':>7} {'rel err':>10} {'min cos':>10} {'top-1':>9} | {'rel err':>10} {'min cos':>10} {'top-1':>9}"
        + ("   baseline rel / cos (the e4m3 reference in this dtype)" if report.ranked else "")]
    for r, h in zip(report.rows, run.hf_rows):
        name = "prefill" if r.step == 0 else str(r.step)
        mark = "" if r.within(rel_t, cos_t) or report.steps_within() else "   <- over threshold"
        lines.append(f"{name:>7} {r.rel:10.2e} {r.cosine:10.6f} {f'{r.top1}/{r.positions}':>9} | "
                     f"{h.rel:10.2e} {h.cosine:10.6f} {f'{h.top1}/{h.positions}':>9}"
                     + (f"   {r.base_rel:10.2e} / {r.base_cosine:.6f}" if report.ranked else "") + mark)
    for what, c in (("stored cache rows", run.cache), ("FlashMLA's e4m3 queries", run.query)):
        if c.values and c.ok:
            lines.append(f"{what}: all {c.values} values are e4m3 of the reference's"
                         + (f" ({c.ties} the other code at a rounding midpoint)" if c.ties else ""))
        elif c.values:
            note = "   <- wrong" if run.codes_judged else " (not judged in half precision)"
            lines.append(f"{what}: {c.wrong} of {c.values} values are not e4m3 of the reference's "
                         f"(first: {c.first_wrong}){note}")
    verdict = "PASS" if report.passed else "FAIL"
    lines.append(f"{verdict}: vs the e4m3 reference (transformers in float64, the same e4m3 roundings): "
                 f"{_rule(report)}")
    c = run.cost()
    lines += ["what FP8 costs on this model (vs transformers float32, no FP8):",
              f"  top-1 agreement {c['top1_agreement']:.1%} of {c['positions']} positions (decode "
              f"{c['decode_top1_agreement']:.1%} of {c['decode_positions']}); "
              f"logit cosine mean {c['mean_cosine']:.6f}, "
              f"min {c['min_cosine']:.6f} (step {c['min_cosine_step']}); rel err median {c['median_rel']:.2e}, max "
              f"{c['max_rel']:.2e} (step {c['max_rel_step']})"]
    if run.cache.saturated:
        lines.append(f"  {run.cache.saturated} of the {run.cache.values} cached values were out of the scale's range "
                     "(|x| > 464 x scale, stored as ±448 x scale)")
    return "\n".join(lines)


def report_json(report: ValidateReport) -> str:
    out = {"passed": report.passed, "reference": report.reference, "thresholds": list(report.thresholds),
           "greedy_identical": report.greedy_identical, "kv_dtype": report.kv_dtype, "kv_scales": report.kv_scales,
           "forced": report.forced, "top1_agreement": report.top1_agreement, "mean_cosine": report.mean_cosine,
           "rows": [r.__dict__ for r in report.rows], "token_ids": report.token_ids}
    if report.fp8 is not None:
        run = report.fp8
        out["fp8"] = {"scale_source": run.scale_source, "kv_scales": run.kv_scales, "decode_kernels": run.kernels,
                      "codes_judged": run.codes_judged,
                      "stored_cache": dict(run.cache.__dict__, ok=run.cache.ok),
                      "flashmla_queries": dict(run.query.__dict__, ok=run.query.ok),
                      "vs_transformers": dict(run.cost(), rows=[r.__dict__ for r in run.hf_rows]),
                      "steps": [{"kernel": s.kernel, "rows": [[x.request, x.start, x.length] for x in s.rows]}
                                for s in run.steps]}
    return json.dumps(out)
