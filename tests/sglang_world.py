"""SGLang on the test machine: the import (with the CPU shim), the plugin's registration, and a model runner with
SGLang's own pools built by SGLang's attention test kit (``sglang/test/kits/attention_unittest``).

``SGLANG`` is None where SGLang cannot be imported (tests skip); ``kit_fixture`` builds the kit's MLA fixture
(MockMLAModelRunner: SGLang's ``ReqToTokenPool`` and ``MLATokenToKVPool``; our backend created through SGLang's
registry) at DeepSeek's latent dims by default.
"""

from __future__ import annotations

import contextlib
import unittest

import pytest
import torch

import sys
from pathlib import Path

from tests.oracle import dense_attention
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

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    HookRegistry.apply_hooks()  # what SGLang's load_plugins does after the plugins' register (the draft routes)
    if not torch.cuda.is_available():  # SGLang's pool writer is a Triton kernel: on the CPU, the same rows by torch
        from sglang.srt.mem_cache import memory_pool

        def _set_mla_kv_buffer_torch(kv_buffer, loc, cache_k_nope, cache_k_rope):
            t = loc.shape[0]
            rows = torch.cat([cache_k_nope.reshape(t, -1), cache_k_rope.reshape(t, -1)], dim=-1)
            kv_buffer[loc] = rows.view(t, *kv_buffer.shape[1:])

        memory_pool.set_mla_kv_buffer_triton = _set_mla_kv_buffer_torch

needs_sglang = pytest.mark.skipif(SGLANG is None, reason=f"sglang 0.5.17 not importable ({IMPORT_ERROR}); "
                                  "tools/install_sglang_cpu.sh installs it (make test does)")

FP8 = torch.float8_e4m3fn
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


# ------------------------------------------------------------------------------------------------- our oracles
def prefix_latents(fx):
    """The prefix rows the kit wrote, recomputed from its hidden states by its module (not read from the pool)."""
    rows = []
    for hidden in fx.prefix_hidden:
        if hidden.shape[0] == 0:
            rows.append((hidden.new_zeros(0, R), hidden.new_zeros(0, D_ROPE)))
            continue
        _, c_kv, _, k_rope = fx.actual_module.forward_absorb_prepare(hidden)
        rows.append((c_kv.reshape(-1, R), k_rope.reshape(-1, D_ROPE)))
    return rows


def run_split_form(fx, *, seed=0, scale_q=1.0, concat=False, backend=None, masks=None, replay=False):
    """One step in the form SGLang's DeepSeek sends (q_lat and q_rope apart, the new latent stored by the backend) —
    or, ``concat``, the form of backends off the absorbed-core list (one [T, H·(r + d_rope)] query, k the whole
    latent row); returns (out [T, H, r], oracle [T, H, r] fp64, tolerance). ``backend``: another adapter over the
    fixture's pools (default the fixture's); ``masks``: per request, which of its keys (prefix, then its new tokens)
    each new token sees, [n, P + n] bool (default: causal, bottom-right); ``replay``: the step is a CUDA-graph
    replay of a step captured before (SGLang's out-of-graph update, then the in-graph half), not an eager one."""
    g = torch.Generator().manual_seed(seed)
    c, fb, layer = fx.case, fx.forward_batch, fx.actual_module.attn_mqa
    T, H, dtype, dev = c.num_input_tokens, c.num_heads, fx.runner.dtype, fx.runner.device
    q_lat = (torch.randn(T, H, R, generator=g) * scale_q).to(dev, dtype)
    q_rope = (torch.randn(T, H, D_ROPE, generator=g) * scale_q).to(dev, dtype)
    c_kv = torch.randn(T, 1, R, generator=g).to(dev, dtype)
    k_rope = torch.randn(T, 1, D_ROPE, generator=g).to(dev, dtype)
    backend = backend or fx.backend
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        if replay:
            backend.init_forward_metadata_out_graph(fb)
            backend.init_forward_metadata_in_graph(fb)
        else:
            backend.init_forward_metadata(fb)
        if concat:
            out = layer(torch.cat([q_lat, q_rope], -1).reshape(T, -1), torch.cat([c_kv, k_rope], -1), c_kv, fb)
        else:
            out = layer(q_lat.reshape(T, H * R), c_kv, c_kv, fb, q_rope=q_rope, k_rope=k_rope)
    fp8 = fx.runner.kv_cache_dtype == FP8
    rounded = (lambda x: x.cpu().to(FP8).double()) if fp8 else (lambda x: x.cpu().double())
    oracle, start = [], 0
    for b, (pc, pr) in enumerate(prefix_latents(fx)):
        n = c.input_lens[b]
        keys_c = rounded(torch.cat([pc, c_kv[start:start + n, 0]]))
        keys_r = rounded(torch.cat([pr, k_rope[start:start + n, 0]]))
        o, _ = dense_attention(q_rope[start:start + n], keys_r[:, None], keys_c[:, None], qv=q_lat[start:start + n],
                               scale=layer.scaling, causal=masks is None, mask=None if masks is None else masks[b])
        oracle.append(o)
        start += n
    oracle = torch.cat(oracle)
    rounding = (oracle.to(dtype).double() - oracle).abs().max().item()
    return out.reshape(T, H, R).cpu().double(), oracle, 2 * rounding + 1e-5


def check_close(out, oracle, tol):
    err = (out - oracle).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"
    cos = torch.nn.functional.cosine_similarity(out.flatten(), oracle.flatten(), dim=0).item()
    assert cos > 0.99999


def runner_like(fx, **changes):
    """The kit's runner with some attributes (or server args: ``server_args={...}``) changed."""
    from types import SimpleNamespace

    r = fx.runner
    names = ("device", "page_size", "dtype", "model_config", "token_to_kv_pool", "req_to_token_pool",
             "use_mla_backend", "tp_size")
    sa = dict(speculative_eagle_topk=0, speculative_algorithm=None, speculative_num_draft_tokens=0, dcp_size=1)
    sa = SimpleNamespace(**{**sa, **changes.pop("server_args", {})})
    return SimpleNamespace(**{**{n: getattr(r, n) for n in names}, **changes}, server_args=sa)


class ReplayAsEagerRun:
    """SGLang's decode graph backend without a graph (``runner_backend``'s interface; tests/test_sglang_draft.py on the
    CPU, tools/draft_graph_probe.py on the GPU): ``capture_one`` runs the step once and keeps it, ``replay`` runs it
    again — each replay re-runs the step's Python, so values baked into a real graph at capture are not modelled;
    everything SGLang's draft graph runner does around the graph (padding to the captured
    size, its static buffers, the out-of-graph update it calls on our backend) is SGLang's own code."""

    def __init__(self, runner):
        self.steps = {}

    @contextlib.contextmanager
    def capture_session(self, stream=None):
        yield

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None, **kwargs):
        forward_fn()
        self.steps[shape_key] = forward_fn

    def can_run(self, forward_batch, shape_key):
        return shape_key in self.steps

    @contextlib.contextmanager
    def replay_session(self):
        yield

    def replay(self, shape_key, forward_batch, *args, **kwargs):
        return self.steps[shape_key]()

    def cleanup(self):
        pass
