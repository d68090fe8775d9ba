"""The named batch specs of the test suite (vLLM-style BATCH_SPECS), in one place.

A :class:`BatchSpec` names one step: its mode, per request the cached prefix and the new tokens, the
page size. Every table of named steps lives here, keyed by a name that becomes the test id:

* ``SPECS``: one step per mode and page size, run by every path (``NONIDLE_SPECS``: all but the idle
  step; ``CORE_SPECS``: one per mode, for sweeps that multiply specs by a costly config);
* ``LOCAL_SPECS`` + ``LOCAL_CHUNKS``: chunk borders inside the new tokens / prefixes (local attention);
* ``PREFILL_SPECS`` / ``PREFILL_GPU_SPECS`` + ``PREFILL_RUNS``: chunked-prefix prefills, with the
  workspace budget that splits their prefixes and the MLA config;
* ``CROSS_SPECS``: encoder-decoder steps (:class:`CrossSpec`, encoder lengths per request);
* ``GRAPH_SPECS`` (:class:`GraphSpec`): CUDA-graph runner rounds, with the names each runner test runs
  (``GRAPH_CPU``, ``GRAPH_GPU``, ``GRAPH_FLASHMLA``).

``MLA_CONFIGS`` names the heads and MLA dims. The caches, batches and oracles built from these specs
are in ``mla_cases.py`` (MLA), ``mha_cases.py`` (MHA and cross-attention) and ``graph_world.py``.
"""


from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from mla_fa3.batch import ForwardMode
from mla_fa3.layer import MLADims

EXT, DEC, MIX, VER = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY


@dataclass(frozen=True)
class BatchSpec:
    """One step: mode, per-request cached prefix and new tokens, page size."""

    mode: ForwardMode
    prefix_lens: tuple[int, ...]  # tokens already in the cache per request
    extend_lens: tuple[int, ...]  # new tokens per request (1 for decode rows, k for verify)
    page_size: int = 16
    reserve: int = 3  # slots allocated past each sequence's end (stale, NaN-poisoned)

    def __post_init__(self) -> None:
        if len(self.prefix_lens) != len(self.extend_lens):
            raise ValueError("prefix_lens and extend_lens must have one entry per request")
        if self.mode.is_decode_like() and any(n != 1 for n in self.extend_lens):
            raise ValueError(f"{self.mode.name} has one new token per request")
        if self.mode is VER and len(set(self.extend_lens)) > 1:
            raise ValueError("TARGET_VERIFY has the same k for every request")

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def q_rows(self) -> list[tuple[int, int]]:
        """(start, end) rows of each request's queries in a token-major q."""
        return q_rows_of(self.extend_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.prefix_lens, self.extend_lens))

    @property
    def num_draft_tokens(self) -> int:
        return self.extend_lens[0] if self.mode is VER else 0


SPECS: dict[str, BatchSpec] = {
    "small_decode": BatchSpec(DEC, (5, 17, 33), (1, 1, 1)),
    "decode_first_token": BatchSpec(DEC, (0, 2), (1, 1), page_size=1),
    "decode_page1": BatchSpec(DEC, (3, 9, 1, 12), (1, 1, 1, 1), page_size=1),
    "decode_page64_long": BatchSpec(DEC, (70, 130, 5), (1, 1, 1), page_size=64),
    "extend_no_prefix": BatchSpec(EXT, (0, 0, 0), (7, 1, 12)),
    "extend_with_prefix": BatchSpec(EXT, (20, 0, 33), (5, 9, 1)),
    "extend_page1": BatchSpec(EXT, (3, 6), (4, 2), page_size=1),
    "extend_page64_cross_page": BatchSpec(EXT, (60, 3), (9, 70), page_size=64),
    "mixed_long_prefix": BatchSpec(MIX, (70, 3, 40, 0), (6, 1, 1, 5)),
    "mixed_page64": BatchSpec(MIX, (65, 10), (1, 3), page_size=64),
    "verify_k4": BatchSpec(VER, (9, 30, 1), (4, 4, 4)),
    "verify_k3_page1": BatchSpec(VER, (5, 12), (3, 3), page_size=1),
    "verify_k2_page64": BatchSpec(VER, (63, 100), (2, 2), page_size=64),
    "draft_decode": BatchSpec(ForwardMode.DRAFT_DECODE, (11, 20), (1, 1)),
    "draft_extend": BatchSpec(ForwardMode.DRAFT_EXTEND, (12, 7), (3, 2)),
    "idle": BatchSpec(ForwardMode.IDLE, (), ()),
}
NONIDLE_SPECS = [name for name, spec in SPECS.items() if spec.mode is not ForwardMode.IDLE]
# one step per mode (+ a long page-64 decode): the subset run with costly configs
CORE_SPECS = ["small_decode", "extend_with_prefix", "mixed_long_prefix", "verify_k4", "draft_decode",
              "decode_page64_long", "idle"]

# local attention: chunk borders inside the requests' new tokens / prefixes; LOCAL_CHUNKS: the chunk C
LOCAL_SPECS: dict[str, BatchSpec] = {
    "extend_borders_p4": BatchSpec(EXT, (5, 0, 13), (9, 11, 1), page_size=4),
    "decode_borders_p4": BatchSpec(DEC, (7, 8, 23, 0), (1, 1, 1, 1), page_size=4),
    "mixed_p16": BatchSpec(MIX, (30, 0, 47), (5, 20, 1), page_size=16),
    "verify_p1": BatchSpec(VER, (6, 13), (4, 4), page_size=1),
    "draft_extend_p1": BatchSpec(ForwardMode.DRAFT_EXTEND, (7, 2), (3, 9), page_size=1),
    "extend_p64": BatchSpec(EXT, (60, 3), (9, 70), page_size=64),
}
LOCAL_CHUNKS: dict[str, int] = {"extend_borders_p4": 8, "decode_borders_p4": 8, "mixed_p16": 16, "verify_p1": 8,
                                "draft_extend_p1": 4, "extend_p64": 64}

# chunked-prefix prefill on CPU: prefixes that split into workspace-sized chunks (borders mid-page, chunks
# spanning requests, decode rows of a mixed step)
PREFILL_SPECS: dict[str, BatchSpec] = {
    "oneshot_no_prefix": SPECS["extend_no_prefix"],
    "prefix_page_border_chunks": BatchSpec(EXT, (32, 48), (4, 3)),
    "budget_splits_mid_page": BatchSpec(EXT, (37, 0, 50), (3, 4, 6)),
    "chunk_spans_requests": BatchSpec(EXT, (5, 3, 0, 7, 2), (2, 1, 3, 4, 2)),
    "page1_many_chunks": BatchSpec(EXT, (9, 13), (2, 5), page_size=1),
    "page64_cross_page": BatchSpec(EXT, (60, 130), (9, 70), page_size=64),
    "page64_budget_mid_page": BatchSpec(EXT, (100, 30), (3, 2), page_size=64),
    "budget_covers_all": BatchSpec(EXT, (20, 33), (5, 9)),
    "mixed_decode_rows_split": SPECS["mixed_long_prefix"],
    "mixed_page64": BatchSpec(MIX, (65, 10, 90), (1, 3, 1), page_size=64),
    "deepseek_v3_dims": BatchSpec(EXT, (21, 0), (3, 2)),
}
# the same on the H200, at lengths a GPU is for
PREFILL_GPU_SPECS: dict[str, BatchSpec] = {
    "oneshot_v3": BatchSpec(EXT, (0, 0, 0), (300, 17, 129), page_size=64),
    "chunked_page64_v3": BatchSpec(EXT, (1000, 0, 2100), (130, 64, 200), page_size=64),
    "chunked_mid_page_v3": BatchSpec(EXT, (700, 5, 0, 333), (33, 7, 12, 90), page_size=64),
    "page1_v3": BatchSpec(EXT, (90, 47), (20, 9), page_size=1),
    "page16_v3_h128": BatchSpec(EXT, (150, 3), (11, 40), page_size=16),
    "mixed_v3": BatchSpec(MIX, (800, 1500, 0, 333), (64, 1, 48, 1), page_size=64),
}


class PrefillRun(NamedTuple):
    """How a prefill spec runs: the workspace budget (tokens per prefix chunk) and the MLA config."""

    workspace_tokens: int
    cfg: str


# per PREFILL_SPECS / PREFILL_GPU_SPECS name. FA3 needs head dims that are multiples of 8 and runs the
# absorbed path (qv) only for kv_lora_rank >= 256, so every GPU case uses DeepSeek-V3 dims.
PREFILL_RUNS: dict[str, PrefillRun] = {
    "oneshot_no_prefix": PrefillRun(16, "tiny"),
    "prefix_page_border_chunks": PrefillRun(16, "tiny"),
    "budget_splits_mid_page": PrefillRun(24, "tiny"),
    "chunk_spans_requests": PrefillRun(16, "odd_small"),
    "page1_many_chunks": PrefillRun(4, "tiny"),
    "page64_cross_page": PrefillRun(64, "tiny"),
    "page64_budget_mid_page": PrefillRun(96, "tiny"),
    "budget_covers_all": PrefillRun(1024, "tiny"),
    "mixed_decode_rows_split": PrefillRun(32, "tiny"),
    "mixed_page64": PrefillRun(64, "odd_small"),
    "deepseek_v3_dims": PrefillRun(16, "deepseek_v3"),
    "oneshot_v3": PrefillRun(256, "deepseek_v3"),
    "chunked_page64_v3": PrefillRun(512, "deepseek_v3"),
    "chunked_mid_page_v3": PrefillRun(200, "deepseek_v3"),
    "page1_v3": PrefillRun(32, "deepseek_v3"),
    "page16_v3_h128": PrefillRun(48, "deepseek_v3_h128"),
    "mixed_v3": PrefillRun(384, "deepseek_v3"),
}


@dataclass(frozen=True)
class CrossSpec:
    """One decoder step of an encoder-decoder batch."""

    mode: ForwardMode  # EXTEND, MIXED or DECODE
    encoder_lens: tuple[int, ...]  # E_b encoder tokens per request
    prefix_lens: tuple[int, ...]  # decoder tokens already cached
    extend_lens: tuple[int, ...]  # new decoder tokens (queries)
    page_size: int = 16
    write_encoder: bool = False  # the step carries the encoder K/V (stored at encoder_out_cache_loc)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.prefix_lens, self.extend_lens))

    def encoder_cols(self, b: int) -> int:
        p = self.page_size
        return -(-self.encoder_lens[b] // p) * p


CROSS_SPECS: dict[str, CrossSpec] = {
    "one_encoder_extend_write": CrossSpec(EXT, (13,), (0,), (6,), write_encoder=True),
    "one_encoder_decode": CrossSpec(DEC, (40,), (5,), (1,)),
    "several_extend_write_p1": CrossSpec(EXT, (5, 17, 1), (0, 0, 0), (4, 1, 7), page_size=1, write_encoder=True),
    "several_decode_p16": CrossSpec(DEC, (33, 7, 16, 50), (3, 9, 0, 20), (1, 1, 1, 1)),
    "several_mixed_p64": CrossSpec(MIX, (70, 5, 64), (10, 0, 4), (1, 6, 1), page_size=64),
    "several_extend_prefix_write_p16": CrossSpec(EXT, (9, 20), (4, 0), (3, 5), write_encoder=True),
    "empty_encoder_decode": CrossSpec(DEC, (0, 9), (2, 4), (1, 1)),
}


@dataclass(frozen=True)
class GraphSpec:
    """A CUDA-graph runner case: a round at the largest captured size, then a smaller live batch."""

    mode: ForwardMode  # DECODE, TARGET_VERIFY or DRAFT_DECODE
    page_size: int
    sizes: tuple[int, ...]  # captured batch sizes
    live: int  # live batch size of the second round
    k: int = 1  # draft tokens per request (TARGET_VERIFY)
    steps: int = 1  # draft steps (DRAFT_DECODE)
    cfg: str | None = None  # MLA config the case is about; None: the test's own (tiny on CPU, DeepSeek-V3 on GPU)


GRAPH_SPECS: dict[str, GraphSpec] = {
    "decode_p1": GraphSpec(DEC, 1, (2, 4, 8), live=3),
    "decode_p16": GraphSpec(DEC, 16, (2, 4, 8), live=3),
    "decode_p64": GraphSpec(DEC, 64, (4, 8), live=1),
    "verify_k3_p1": GraphSpec(VER, 1, (2, 4, 8), live=3, k=3),
    "verify_k3_p16": GraphSpec(VER, 16, (2, 4, 8), live=3, k=3),
    "verify_k4_p1": GraphSpec(VER, 1, (4, 8), live=2, k=4),
    "verify_k4_p64": GraphSpec(VER, 64, (4, 8), live=2, k=4),
    "draft_3steps_p1": GraphSpec(ForwardMode.DRAFT_DECODE, 1, (2, 4, 8), live=3, steps=3),
    "draft_3steps_p16": GraphSpec(ForwardMode.DRAFT_DECODE, 16, (2, 4, 8), live=3, steps=3),
    "draft_2steps_p64": GraphSpec(ForwardMode.DRAFT_DECODE, 64, (4, 8), live=3, steps=2),
    "v3_dims_decode_p64": GraphSpec(DEC, 64, (2, 4), live=3, cfg="deepseek_v3"),
    "flashmla_decode_p64": GraphSpec(DEC, 64, (2, 4, 8), live=3),
    "flashmla_verify_k2_p64": GraphSpec(VER, 64, (4, 8), live=3, k=2),
    "flashmla_128heads_p64": GraphSpec(DEC, 64, (4, 8), live=2, cfg="deepseek_v3_h128"),
}
GRAPH_CPU = ["decode_p1", "decode_p16", "decode_p64", "verify_k3_p16", "verify_k4_p1", "draft_3steps_p16",
             "draft_2steps_p64", "v3_dims_decode_p64"]
GRAPH_GPU = ["decode_p1", "decode_p16", "decode_p64", "verify_k3_p1", "verify_k3_p16", "verify_k4_p64",
             "draft_3steps_p1", "draft_3steps_p16", "draft_2steps_p64"]
GRAPH_FLASHMLA = ["flashmla_decode_p64", "flashmla_verify_k2_p64", "flashmla_128heads_p64"]


@dataclass(frozen=True)
class MLAConfig:
    """Heads and MLA dims of a test layer."""

    num_heads: int
    dims: MLADims

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.dims.qk_head_dim)


MLA_CONFIGS: dict[str, MLAConfig] = {
    "deepseek_v3": MLAConfig(16, MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)),
    "deepseek_v3_h128": MLAConfig(128, MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                               v_head_dim=128)),  # GPU tests only
    "odd_small": MLAConfig(3, MLADims(kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20)),
    "tiny": MLAConfig(4, MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
}


def q_rows_of(extend_lens) -> list[tuple[int, int]]:
    """(start, end) rows of each request's queries in a token-major q with ``extend_lens`` tokens each."""
    out, start = [], 0
    for n in extend_lens:
        out.append((start, start + n))
        start += n
    return out


# ---------------------------------------------------------------- the FP8 latent cache (page 64: FlashMLA FP8)
FP8_SPECS = {
    "decode": BatchSpec(ForwardMode.DECODE, (70, 130, 5, 0), (1, 1, 1, 1), page_size=64),
    "verify_k3": BatchSpec(ForwardMode.TARGET_VERIFY, (63, 100, 2), (3, 3, 3), page_size=64),
    "draft_decode": BatchSpec(ForwardMode.DRAFT_DECODE, (11, 90), (1, 1), page_size=64),
    "extend_no_prefix": BatchSpec(ForwardMode.EXTEND, (0, 0), (7, 12), page_size=64),
    "extend_chunked_prefix": BatchSpec(ForwardMode.EXTEND, (60, 3, 130), (9, 70, 5), page_size=64),
    "mixed": BatchSpec(ForwardMode.MIXED, (65, 10, 130, 0), (1, 3, 1, 5), page_size=64),
    "draft_extend": BatchSpec(ForwardMode.DRAFT_EXTEND, (12, 7), (3, 2), page_size=64),
    "extend_all_decode_rows": BatchSpec(ForwardMode.EXTEND, (20, 30), (1, 1), page_size=64),
}
