"""SGLang on the test machine: the import (with the CPU shim), the plugin's registration, and a model runner with
SGLang's own pools built by SGLang's attention test kit (``sglang/test/kits/attention_unittest``).

``SGLANG`` is None where SGLang cannot be imported (tests skip); ``kit_fixture`` builds the kit's MLA fixture
(MockMLAModelRunner: SGLang's ``ReqToTokenPool`` and ``MLATokenToKVPool``; our backend created through SGLang's
registry) at DeepSeek's latent dims by default.
"""

from __future__ import annotations

import unittest

import pytest
import torch

import sys
from pathlib import Path

from tests.sglang_cpu_shim import prepare_sglang_import

# tools/install_sglang_cpu.sh installs SGLang's CPU import set into its own folder (in the environment, its CUDA
# torchvision would break transformers outside the tests): after the environment's own paths
SGLANG_CPU_DIR = Path(__file__).resolve().parent.parent / ".sglang-cpu"
if SGLANG_CPU_DIR.is_dir() and str(SGLANG_CPU_DIR) not in sys.path:
    sys.path.append(str(SGLANG_CPU_DIR))
prepare_sglang_import()
try:
    import sglang.srt.layers.attention.attention_registry as SGLANG  # noqa: N812
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLangBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangMode
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
except Exception as exc:  # noqa: BLE001 - any import failure means: no SGLang here
    SGLANG, SGLangBatch, SGLangMode, kit = None, None, None, None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    IMPORT_ERROR = ""
    from mla_fa3.integrations.sglang import plugin

    plugin.register()
    if not torch.cuda.is_available():  # SGLang's pool writer is a Triton kernel: on the CPU, the same rows by torch
        from sglang.srt.mem_cache import memory_pool

        def _set_mla_kv_buffer_torch(kv_buffer, loc, cache_k_nope, cache_k_rope):
            t = loc.shape[0]
            rows = torch.cat([cache_k_nope.reshape(t, -1), cache_k_rope.reshape(t, -1)], dim=-1)
            kv_buffer[loc] = rows.view(t, *kv_buffer.shape[1:])

        memory_pool.set_mla_kv_buffer_triton = _set_mla_kv_buffer_torch

needs_sglang = pytest.mark.skipif(SGLANG is None, reason=f"sglang 0.5.17 not importable ({IMPORT_ERROR}); "
                                  "tools/install_sglang_cpu.sh installs it (make test does)")

R, D_ROPE = 512, 64  # DeepSeek-V3's latent dims (the kit's defaults, 32 / 0, are below FA3's qv limits)


class _Case(unittest.TestCase):
    def runTest(self):  # noqa: N802 - unittest's name
        pass


TESTCASE = _Case()


def case(mode_name: str, *, prefix_lens, extend_lens=(), page_size=16, num_heads=4, backend="mla_fa3", name=None):
    """A kit ``MLAAttentionCase`` (SGLang's dataclass)."""
    return kit.MLAAttentionCase(name=name or f"{mode_name.lower()}_{page_size}", backend=backend,
                                forward_mode=getattr(SGLangMode, mode_name), num_heads=num_heads,
                                page_size=page_size, prefix_lens=tuple(prefix_lens), extend_lens=tuple(extend_lens))


def kit_fixture(c, *, dtype=torch.bfloat16, device="cpu", fp8=False, max_context_len=128, **kw):
    """The kit's fixture for ``c`` at DeepSeek dims: runner (SGLang pools), backend, modules, batch."""
    return kit.build_mla_attention_fixture(TESTCASE, c, kv_lora_rank=R, qk_rope_head_dim=D_ROPE, hidden_size=64,
                                           max_context_len=max_context_len, dtype=dtype, device=device,
                                           fp8_kv_cache=fp8, **kw)
