"""SGLang's own DeepSeek model through SGLang's offline ``Engine`` on ``--attention-backend mla_fa3`` vs ``fa3`` vs
transformers (fp32), on a tiny random DeepSeek-V3 with DeepSeek-V3's attention dims (16 heads, r 512, d_nope 128,
d_rope 64, d_v 128; ``mla_fa3.models.tiny``'s ``v3_mla_dims``).

    python benchmarks/sglang_engine_check.py --out out/engine_check.json [--quick]

Per configuration (backend x page size x KV dtype, optionally speculative decoding over DeepSeek's MTP layer with
EAGLE topk K — ``:eagleK``, whose greedy output must equal the target's; CUDA graphs on): the greedy continuation of a prompt long
enough that its later prefill chunks run SGLang's chunked-prefix MHA path (``--chunked-prefill-size`` 256,
``SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD`` 64), compared token by token with transformers' greedy continuation; and
teacher-forced top-1 agreement over the prompt and that continuation (SGLang's top-1 at every input position
against transformers' argmax). A configuration run after SGLang's fa3 on the same page size and KV dtype is also
compared with it (``vs_fa3_greedy``, ``vs_fa3_top1``: the same attention on the same model should give the same
tokens; an EAGLE configuration's greedy tokens must be fa3's without speculation).

A greedy continuation that leaves transformers' is checked against transformers again, on its own prefix: each of its
tokens should be transformers' fp32 argmax given the tokens before it (``own_prefix_argmax``). A token that is not
(``off_argmax``: position, token, argmax, the fp32 logit gap) is explained only as a near tie (gap <= ``NEAR_TIE``)
or, at the first divergence (where the context is still transformers' text), by SGLang's fa3 teacher-forced over
that text choosing the same token: the bf16 model's own pick there, by another computation than decode's; anything
else is ``unexplained`` and the configuration is not ``consistent``. GPU only; needs SGLang 0.5.17 and sgl-kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


MAX_POSITIONS = 4096
# fp32 logit gap under which a bf16 engine may pick either token: bf16 spaces logits of magnitude 4-8 0.031 apart
NEAR_TIE = 0.05
# SGLang's NEXTN draft layer normalizes through fused_eh_norm, which takes hidden sizes in (256, 8192], multiples of
# 256 (the tiny config's 256 stops the draft's CUDA-graph capture): every configuration's checkpoint has 512
HIDDEN = 512
# DeepSeek-V3's own config.json keys that transformers 5's DeepseekV3Config no longer writes and SGLang's DeepseekV2
# model reads (models/deepseek_v2.py: MoE layer placement and the noaux_tc router, which is transformers' V3 router)
SGLANG_CONFIG_KEYS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1,
                          aux_loss_alpha=0.001, seq_aux=True)


def _checkpoint(path: str, seed: int):
    """The tiny V3 checkpoint both engines load (hidden size ``HIDDEN``), saved at ``path``: returns (path, the
    transformers model it was saved from). Its YaRN rope is stretched to the whole
    ``MAX_POSITIONS`` (original 1024 x factor 4): SGLang's DeepSeek YaRN tables cover original x factor positions
    and read past them unchecked, transformers computes any position (the project's tiny configs stop at 64 x 4 =
    256 positions, shorter than this prompt)."""
    from mla_fa3.models.tiny import TINY_CONFIGS, random_hf_model, save_hf_checkpoint

    rope = dict(TINY_CONFIGS["v3_mla_dims"]["rope_scaling"])
    rope["original_max_position_embeddings"] = MAX_POSITIONS // int(rope["factor"])
    model = random_hf_model("v3_mla_dims", seed=seed, max_position_embeddings=MAX_POSITIONS, rope_scaling=rope,
                            hidden_size=HIDDEN)
    model.config.eos_token_id = None
    save_hf_checkpoint(model, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for key, value in SGLANG_CONFIG_KEYS.items():
        cfg.setdefault(key, value)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path, model


def _prompt(n: int) -> list[int]:
    """The prompt every run uses: ``n`` token ids drawn from seed 1."""
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _with_nextn(ckpt: str, path: str, seed: int) -> str:
    """A copy of ``ckpt`` with DeepSeek's multi-token-prediction layer (``num_nextn_predict_layers`` 1), which
    SGLang's NEXTN / EAGLE speculative decoding drafts with: ``model.layers.{N}`` (N = num_hidden_layers) holds the
    last decoder layer's weights again plus random ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``. A
    draft of no skill: greedy output must still equal the target's (verification accepts only its own argmax)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    weights = load_file(os.path.join(path, "model.safetensors"))
    last = f"model.layers.{n - 1}."
    for name, w in list(weights.items()):
        if name.startswith(last):
            weights[f"model.layers.{n}." + name[len(last):]] = w.clone()
    g = torch.Generator().manual_seed(seed)
    dtype = weights["model.embed_tokens.weight"].dtype
    weights[f"model.layers.{n}.enorm.weight"] = torch.ones(h, dtype=dtype)
    weights[f"model.layers.{n}.hnorm.weight"] = torch.ones(h, dtype=dtype)
    weights[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(h, dtype=dtype)
    weights[f"model.layers.{n}.eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(dtype)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _hf_reference(model, prompt: list[int], new: int) -> tuple[list[int], list[int]]:
    """transformers fp32: greedy continuation, then the argmax at every position of prompt + continuation."""
    model = model.to("cuda")
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        cont = out[0, len(prompt):].tolist()
        logits = model(out).logits[0]
    return cont, logits.argmax(-1).tolist()  # argmax[i]: the token after position i


def off_argmax(logits: torch.Tensor, tokens: list[int]) -> list[tuple[int, int, int, float]]:
    """``(position, token, argmax, gap)`` of each generated token that is not the argmax of its row of ``logits``
    ``[len(tokens), vocab]`` (row i: the distribution of token i given the prompt and ``tokens[:i]``); gap: the
    argmax's logit minus the token's."""
    rows = []
    for i, t in enumerate(tokens):
        a = int(logits[i].argmax())
        if a != t:
            rows.append((i, t, a, round(float(logits[i, a] - logits[i, t]), 4)))
    return rows


def explain_off_argmax(off: list[tuple[int, int, int, float]], first_divergence: int | None,
                       fa3_pick: int | None) -> list[str]:
    """Why each :func:`off_argmax` token may still be the engine computing right: 'near tie' (gap <= ``NEAR_TIE``),
    'fa3 teacher-forced' (at ``first_divergence``, where the context is transformers' text and SGLang's fa3,
    teacher-forced over it, picked the same token: ``fa3_pick``), else 'unexplained'."""
    why = []
    for pos, token, _, gap in off:
        if gap <= NEAR_TIE:
            why.append("near tie")
        elif pos == first_divergence and fa3_pick == token:
            why.append("fa3 teacher-forced")
        else:
            why.append("unexplained")
    return why


def _own_prefix_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers fp32 over ``prompt + tokens``: row i is the distribution of ``tokens[i]`` given what precedes it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=next(model.parameters()).device)).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].double().cpu()


def _verdict(model, prompt: list[int], tokens: list[int], first_diff: int, results: list[dict], kv: str) -> dict:
    """A diverging continuation against transformers on its own prefix, explained where it can be (module doc)."""
    off = off_argmax(_own_prefix_logits(model, prompt, tokens), tokens)
    fa3 = next((r for r in results if r["backend"] == "fa3" and r["kv"] == kv and "top1" in r), None)  # any page
    fa3_pick = None if fa3 is None else fa3["top1"][len(prompt) + first_diff]
    why = explain_off_argmax(off, first_diff, fa3_pick)
    return dict(own_prefix_argmax=f"{len(tokens) - len(off)}/{len(tokens)}",
                off_argmax=[[*o, w] for o, w in zip(off, why)], consistent="unexplained" not in why)


def _verdicts_of(paths: list[str]) -> int:
    """``--verdict``: the verdict of every diverging configuration of earlier runs' JSON files (CPU, transformers
    fp32 on the same checkpoint and prompt; fa3's teacher-forced picks from the same files)."""
    with tempfile.TemporaryDirectory(prefix="tiny_v3_") as tmp:
        _, model = _checkpoint(tmp, seed=0)
    model.eval()
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        prompt = _prompt(run["prompt_len"])
        results = [r for r in run["results"] if "tokens" in r]
        for r in results:
            if r.get("first_divergence") is not None:
                row = {k: r[k] for k in ("backend", "page", "kv", "eagle_topk", "greedy_match")}
                row.update(_verdict(model, prompt, r["tokens"], r["first_divergence"], results, r["kv"]))
                print(path, json.dumps(row), flush=True)
    return 0


def _run_engine(ckpt: str, backend: str, page: int, kv: str, prompt: list[int], teacher: list[int], new: int,
                topk: int = 0):
    import sglang as sgl

    kw = dict(model_path=ckpt, attention_backend=backend, page_size=page, kv_cache_dtype=kv,
              sampling_backend="pytorch", grammar_backend="none", chunked_prefill_size=256,
              mem_fraction_static=0.5, cuda_graph_max_bs_decode=8, disable_prefill_cuda_graph=True,
              skip_tokenizer_init=True, log_level="error", context_length=MAX_POSITIONS, dtype="bfloat16")
    if topk:  # NEXTN (EAGLE over DeepSeek's MTP layer): 3 draft steps, topk branches, 4 draft tokens verified
        kw.update(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=4)
    engine = sgl.Engine(**kw)
    try:
        sp = dict(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        out = engine.generate(input_ids=prompt, sampling_params=sp)
        tokens = list(out["output_ids"])
        tf = engine.generate(input_ids=teacher, sampling_params=dict(temperature=0.0, max_new_tokens=1),
                             return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        top = [row[0][1] if row else None for row in tf["meta_info"]["input_top_logprobs"]]
        walls = []  # 4 x 64 tokens, three times: the first pays what a batch of 4 meets first (compiles, allocations)
        for _ in range(3):
            t0 = time.perf_counter()
            engine.generate(input_ids=[prompt] * 4, sampling_params=dict(temperature=0.0, max_new_tokens=64,
                                                                            ignore_eos=True))
            walls.append(time.perf_counter() - t0)
        wall = min(walls[1:])
    finally:
        engine.shutdown()
    return tokens, top, wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="the JSON to write (required unless --verdict)")
    p.add_argument("--verdict", nargs="+", metavar="JSON", help="CPU: the verdict of earlier runs' diverging "
                   "configurations (their JSON files), nothing run on SGLang")
    p.add_argument("--quick", action="store_true", help="page 64 only")
    p.add_argument("--configs", default="", help="backend:page:kv[:eagleK],... (e.g. fa3:64:auto,mla_fa3:64:auto,"
                   "mla_fa3:1:auto:eagle2 — speculative decoding over the MTP layer with topk K; a config after fa3's "
                   "of the same page and KV dtype is also compared with it token by token); "
                   "default: fa3 and mla_fa3 x pages x (auto, fp8_e4m3)")
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--new", type=int, default=32)
    args = p.parse_args(argv)
    if args.verdict:
        return _verdicts_of(args.verdict)
    if not args.out:
        p.error("--out is required")
    from benchmarks.sglang_backends import sglang_ready

    os.environ["SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD"] = "64"
    if not sglang_ready("sglang_engine_check"):
        return 2
    tmp = tempfile.mkdtemp(prefix="tiny_v3_")
    ckpt, model = _checkpoint(tmp, seed=0)
    prompt = _prompt(args.prompt_len)
    hf_cont, hf_argmax = _hf_reference(model, prompt, args.new)
    teacher = prompt + hf_cont
    results = []
    pages = [64] if args.quick else [1, 64]
    configs = [(f[0], int(f[1]), f[2], int(f[3][len("eagle"):]) if len(f) > 3 else 0)
               for f in (c.split(":") for c in args.configs.split(",") if c)] or \
        [(b, p, kv, 0) for p in pages for kv in ("auto", "fp8_e4m3") for b in ("fa3", "mla_fa3")]
    nextn = _with_nextn(ckpt, tmp + "_nextn", seed=2) if any(t for *_, t in configs) else None
    for backend, page, kv, topk in configs:
        row = dict(backend=backend, page=page, kv=kv, eagle_topk=topk)
        print(f"starting {json.dumps(row)}", flush=True)  # a run stopped from outside shows which configuration it was in
        t0 = time.perf_counter()
        try:
            tokens, top, wall = _run_engine(nextn if topk else ckpt, backend, page, kv, prompt, teacher, args.new,
                                            topk=topk)
            agree = sum(a == b for a, b in zip(tokens, hf_cont))
            first_diff = next((i for i, (a, b) in enumerate(zip(tokens, hf_cont)) if a != b), None)
            pairs = [(t, h) for t, h in zip(top[1:], hf_argmax[: len(teacher) - 1]) if t is not None]
            tf = sum(a == b for a, b in pairs) / max(len(pairs), 1)
            row.update(greedy_match=f"{agree}/{len(hf_cont)}", first_divergence=first_diff,
                       teacher_forced_top1=round(tf, 4), positions=len(pairs), wall_4x64_s=round(wall, 3))
            # against SGLang's fa3 on the same page size and KV dtype, when it ran before in this run: the same
            # greedy tokens, and the same top-1 at each teacher-forced position
            peer = next((r for r in results if r["backend"] == "fa3" and r["page"] == page and r["kv"] == kv
                         and "tokens" in r), None)
            if peer is not None and backend != "fa3":
                row.update(vs_fa3_greedy=f"{sum(a == b for a, b in zip(tokens, peer['tokens']))}/{len(tokens)}",
                           vs_fa3_top1=round(sum(a == b for a, b in zip(top, peer["top1"])) / max(len(top), 1), 4))
            if first_diff is not None:  # transformers again, on this continuation's own prefix; fa3's own row is
                # explained by its own teacher-forced picks (it is not among ``results`` yet)
                seen = results + [dict(backend=backend, kv=kv, top1=top)] if backend == "fa3" else results
                row.update(_verdict(model, prompt, tokens, first_diff, seen, kv))
            row.update(tokens=tokens, top1=top)
        except Exception as exc:  # noqa: BLE001 - record and go on with the next configuration
            row.update(error=f"{type(exc).__name__}: {exc}"[:400], trace=traceback.format_exc()[-1500:])
        row["run_s"] = round(time.perf_counter() - t0, 1)  # the Engine's start (graph capture, JIT builds) included
        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "top1")}), flush=True)
        results.append(row)
        _write(args.out, prompt, args.new, results)  # after every configuration: a run cut short keeps its rows
    return 0


def _write(path: str, prompt: list[int], new: int, results: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(prompt_len=len(prompt), new=new, results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
