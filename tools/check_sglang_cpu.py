#!/usr/bin/env python3
"""Check that SGLang (tools/install_sglang_cpu.sh) imports on this machine's torch.

Applies tests/sglang_cpu_shim.prepare_sglang_import(), then tries each import our SGLang plugin's
tests need and prints OK/FAIL per line (with the exception). Exit 1 if any required one fails.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.append(os.path.join(ROOT, ".sglang-cpu"))  # where tools/install_sglang_cpu.sh puts SGLang's CPU import set

# (module, names, required)
IMPORTS = [
    ("sglang.srt.layers.attention.attention_registry",
     ["ATTENTION_BACKENDS", "register_attention_backend"], True),
    ("sglang.srt.layers.attention.base_attn_backend", ["AttentionBackend"], True),
    ("sglang.srt.server_args",
     ["ServerArgs", "add_attention_backend_choices", "add_chunked_prefix_cache_attention_backend"],
     True),
    ("sglang.srt.mem_cache.memory_pool", ["MLATokenToKVPool", "ReqToTokenPool"], True),
    ("sglang.srt.model_executor.forward_batch_info",
     ["ForwardBatch", "ForwardMode", "CaptureHiddenMode"], True),
    ("sglang.srt.models.deepseek_common.utils", ["FORWARD_ABSORB_CORE_ATTENTION_BACKENDS"], True),
    ("sglang.srt.models.deepseek_common.attention_backend_handler",
     ["AttentionBackendRegistry", "MHA_ONE_SHOT_SUPPORTED_BACKENDS"], True),
    ("sglang.srt.layers.radix_attention", ["RadixAttention"], True),
    ("sglang.test.kits.attention_unittest.attention_methods.mla_attention", [], True),
    ("sglang.test.kits.attention_unittest.runner_modes", [], True),
    ("sglang.srt.models.deepseek_v2", ["DeepseekV2ForCausalLM"], False),
]


def _report(ok: bool, what: str, dt: float, err: BaseException | None, required: bool) -> None:
    tag = "OK  " if ok else ("FAIL" if required else "WARN")
    line = f"{tag} {what} ({dt:.1f}s)"
    if err is not None:
        line += f": {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    print(line, flush=True)


def _check(what: str, fn, required: bool, verbose: bool) -> bool:
    t0 = time.perf_counter()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - report every failure, SystemExit included
        _report(False, what, time.perf_counter() - t0, e, required)
        if verbose:
            traceback.print_exc()
        return False
    _report(True, what, time.perf_counter() - t0, None, required)
    return True


def _import(mod: str, names: list[str]):
    def fn():
        m = importlib.import_module(mod)
        for n in names:
            getattr(m, n)
    return fn


def _pools():
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        pool = MLATokenToKVPool(
            size=64, page_size=1, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64,
            layer_num=2, device="cpu", enable_memory_saver=False,
        )
        buf = pool.get_key_buffer(0)
        assert buf.dtype == dtype and tuple(buf.shape) == (65, 1, 576), (buf.dtype, buf.shape)
    ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)


def _cli():
    import argparse as ap
    from sglang.srt.server_args import ServerArgs, add_attention_backend_choices

    add_attention_backend_choices(["mla_fa3_check"])
    p = ap.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(["--model-path", "x", "--attention-backend", "mla_fa3_check"])
    assert ns.attention_backend == "mla_fa3_check"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true", help="print tracebacks")
    args = ap.parse_args()

    try:
        import torch
        from sglang_cpu_shim import prepare_sglang_import

        prepare_sglang_import()
    except Exception as e:  # noqa: BLE001
        print(f"FAIL torch / tests/sglang_cpu_shim: {type(e).__name__}: {e}")
        return 1
    print(f"torch {torch.__version__} (cuda {torch.version.cuda})", flush=True)
    failed = 0
    for mod, names, required in IMPORTS:
        what = mod + (f" ({', '.join(names)})" if names else "")
        if not _check(what, _import(mod, names), required, args.verbose) and required:
            failed += 1
    if not _check("MLATokenToKVPool bf16 + fp8_e4m3fn, ReqToTokenPool on cpu", _pools, True,
                  args.verbose):
        failed += 1
    _check("ServerArgs.add_cli_args + a registered backend name", _cli, False, args.verbose)
    print(f"{'FAILED' if failed else 'all required imports OK'} ({failed} required failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
