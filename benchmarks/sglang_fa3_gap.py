"""Where the time goes when ``mla_fa3`` and SGLang's ``fa3`` both run FA3 for a decode step (128 heads, bs 64, 32k:
0.86–0.91x on an H100, docs/PERFORMANCE.md "Inside SGLang").

    python benchmarks/sglang_fa3_gap.py [--heads 128 --bs 64 --ctx 32768]

Times, each captured in a CUDA graph and replayed (median of ``--iters``), over the same SGLang pool:
  fa3_layer      SGLang's fa3 backend, the whole layer call (store + attention)
  ours_layer     mla_fa3's adapter, the whole layer call (store + attention)
  fa3_kernel_sg  sgl_kernel's FA3 with SGLang fa3's metadata tensors (page table, lengths, cu_seqlens)
  fa3_kernel_us  sgl_kernel's FA3 with our metadata tensors
  ours_store     our store of the new latent rows alone
GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mla_fa3.bench.timing import time_graph  # noqa: E402


def _us(fn, iters: int) -> float:
    return 1e3 * time_graph(fn, warmup=3, iters=iters)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    from benchmarks.sglang_backends import decode_world, sglang_ready, step_inputs

    if not sglang_ready("sglang_fa3_gap"):
        return 2
    from sgl_kernel.flash_attn import flash_attn_with_kvcache
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

    fx = decode_world(kit, ForwardMode.DECODE, args.heads, args.bs, args.ctx, False)
    bs, H, layer, fb = fx.bs, fx.heads, fx.layer, fx.fb
    q_lat, q_rope, c_kv, k_rope = step_inputs(bs, H)
    kv = fx.runner.token_to_kv_pool.kv_buffer[0].view(-1, 64, 1, 576)
    res = {}
    for name in ("fa3", "mla_fa3"):
        backend = ATTENTION_BACKENDS[name](fx.runner)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
            backend.init_forward_metadata_out_graph(fb, in_capture=True)
            backend.init_forward_metadata_in_graph(fb)
            # a replay's update: the batch's own lengths into the captured buffers (at capture, mla_fa3 sizes them
            # for the graph and holds fill values; fa3 reads the batch's lengths at capture already)
            backend.init_forward_metadata_out_graph(fb)
            def layer_step():  # as SGLang's runner captures it: the backend's in-graph half, then the layer
                backend.init_forward_metadata_in_graph(fb)
                layer(q_lat.view(bs, -1), c_kv, c_kv, fb, q_rope=q_rope, k_rope=k_rope)

            res[f"{'fa3' if name == 'fa3' else 'ours'}_layer"] = _us(layer_step, args.iters)
            md = backend.forward_metadata
            if name == "fa3":
                tabs = (md.page_table, md.cache_seqlens_int32, md.cu_seqlens_q, md.max_seq_len_q)
                key = "fa3_kernel_sg"
            else:
                tabs = (md.page_table, md.cache_seqlens, md.cu_seqlens_q, md.max_seqlen_q)
                key = "fa3_kernel_us"
                pool = backend.mla_pool
                res["ours_store"] = _us(lambda: pool.set_kv(0, fb.out_cache_loc, c_kv.view(bs, 512),
                                                                    k_rope.view(bs, 64)), args.iters)
                print("our page table", tuple(md.page_table.shape), md.page_table.stride(), "plan:",
                      backend.explain().summary())
            print(name, "page table", tuple(tabs[0].shape), "max_seqlen_q", tabs[3])
            res[key] = _us(lambda: flash_attn_with_kvcache(
                q=q_rope.view(bs, H, 64), k_cache=kv[..., 512:], v_cache=kv[..., :512], qv=q_lat.view(bs, H, 512),
                page_table=tabs[0], cache_seqlens=tabs[1], cu_seqlens_q=tabs[2], max_seqlen_q=tabs[3],
                softmax_scale=layer.scaling, causal=True), args.iters)
    for k, v in res.items():
        print(f"{k:16s} {v:9.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
