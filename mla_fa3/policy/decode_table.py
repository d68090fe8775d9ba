"""The measurements behind ``policy.decode_kernel``: the :class:`Measured` record and the recorded H200 table.

``MEASURED`` is generated: per shape (heads, batch, longest context, skew = mean / max KV length) the
per-layer decode times of five H200 sweeps (page 64, bf16, CUDA-graph replay), merged:

- ``docs/perf/decode_2026-12-02_run1.csv`` — FA3 and FlashMLA kernels alone, heads 16-128, bs 1-128, context
  1k-128k, equal and skewed lengths (168 rows: its 180 shapes less the 12 that a later sweep measured again);
- ``docs/perf/2026-12-03/decode_small_batch.csv`` — FA3, FlashMLA and the split-KV Triton kernel
  (``splitkv_ms``) alone, heads 16 / 128, bs 1, 2, 4, 8, context 16k-128k, equal lengths (32 rows, all replaced);
- ``docs/perf/2026-12-04/decode_whole_step_pdl.csv`` — the same 32 shapes as the backend's WHOLE step with each
  kernel forced (``bench decode --whole-step``; split-KV's schedule re-planned on the device in the graph): the
  16-head rows measured last (``decode_whole_step_16_pdl.csv``: multi-buffered loads, programmatic dependent
  launch, one-pass combine), the 128-head rows from ``2026-12-03/run5/decode_whole_step.csv`` (there the
  kernel launches in order and measured within 1 % of that run's: ``splitkv_pdl_ab_final_bf16.md``);
- ``docs/perf/2026-12-04/run4/final/decode_whole_step.csv`` — the same 32 whole steps again, after FA3's tile
  schedule moved to once per step (``ops.get_fa3_schedule``, bs <= 8) and FA3's split cap at 128 heads, bs <= 2:
  every one of those rows replaced;
- ``docs/perf/2026-12-06/h200/decode_whole_step.csv`` (the 16- and 128-head runs of one device run,
  ``whole_step_16/`` and ``whole_step_128/``, in one file) — the same 32 whole steps on the kernel of
  2026-12-06 (latent-chunked q·kᵀ, the 128-split narrow combine tile; FA3 and FlashMLA unchanged):
  every one of those rows replaced.

A shape measured by several keeps the latest sweep's row whole (its three times come from one run; see
``policy.decode_csv``); split-KV times exist only for the second sweep's shapes, ``None`` elsewhere (the
choice picks split-KV only when every one of the nearest shapes has a split-KV time). Regenerate it from
decode-benchmark CSVs (``mla-fa3 bench decode --out DIR``), oldest first::

    python -m mla_fa3.policy.decode_kernel --from-csv OLD/decode.csv --from-csv NEW/decode.csv

and paste the printed literal over ``MEASURED`` below (it needs only ``Measured`` in scope). Data only:
the choice (``explain_decode_kernel``) and the evaluation live in ``policy.decode_kernel``, the CSV reader
and the literal printer in ``policy.decode_csv``; ``decode_kernel`` re-exports ``Measured`` and ``MEASURED``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_fa3.checks import check_int, is_real

__all__ = ["Measured", "MEASURED"]


@dataclass(frozen=True)
class Measured:
    """One measured shape: per-layer decode kernel times at page 64, bf16, one query token each."""

    num_heads: int  # query heads H (one latent KV head)
    batch_size: int  # requests, one query token each
    context: int  # longest KV length in the batch (every request's for equal lengths)
    fa3_ms: float  # FA3 kernel time, ms (CUDA-graph replay)
    flashmla_ms: float  # FlashMLA kernel time, ms (CUDA-graph replay)
    source: str = "H200 anchor"  # where the numbers come from
    skew: float = 1.0  # mean / max KV length over the batch, in (0, 1]; 1 = equal lengths
    splitkv_ms: float | None = None  # the split-KV Triton kernel's time, ms (None: not measured)

    def __post_init__(self):
        for name in ("num_heads", "batch_size", "context"):
            check_int(getattr(self, name), name)
        for name in ("fa3_ms", "flashmla_ms", "splitkv_ms"):
            if name == "splitkv_ms" and self.splitkv_ms is None:
                continue
            if not (is_real(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if not (is_real(self.skew) and 0 < self.skew <= 1):
            raise ValueError(f"skew must be a number in (0, 1], got {self.skew!r}")

    @property
    def flashmla_gain(self) -> float:
        """FA3 time / FlashMLA time: > 1 when FlashMLA is faster."""
        return self.fa3_ms / self.flashmla_ms

    @property
    def splitkv_gain(self) -> float | None:
        """The faster of FA3 / FlashMLA over the split-KV time: > 1 when split-KV is faster (None: unmeasured)."""
        return None if self.splitkv_ms is None else min(self.fa3_ms, self.flashmla_ms) / self.splitkv_ms

    def shape(self) -> str:
        return f"heads {self.num_heads}, bs {self.batch_size}, ctx {self.context}, skew {self.skew:.2f}"


# The measured table (H200, sgl-kernel 0.4.5, bf16, page 64, CUDA-graph replay, per layer), from
# ``python -m mla_fa3.policy.decode_kernel --from-csv docs/perf/decode_2026-12-02_run1.csv \
#       --from-csv docs/perf/2026-12-03/decode_small_batch.csv \
#       --from-csv docs/perf/2026-12-04/decode_whole_step_pdl.csv``
# The last CSV's rows (heads 16 / 128, bs 1-8, 16k-128k, equal lengths) are WHOLE backend steps with each kernel
# forced (``bench decode --whole-step``), split-KV's schedule re-planned on the device inside the graph: at small
# batch the kernels' surroundings differ (FlashMLA's q concatenation, split-KV's planning), and the kernel alone
# picked FlashMLA / split-KV where the whole step is slower (up to 1.22x the plain FA3 step). Elsewhere rows are
# the kernel alone.

MEASURED: tuple[Measured, ...] = (
    *(Measured(h, b, ctx, fa3_ms=fa3, flashmla_ms=mla, skew=skew,
               source='bench CSV docs/perf/decode_2026-12-02_run1.csv')
      for h, b, ctx, skew, fa3, mla in (  # heads, batch, context, skew, FA3 ms, FlashMLA ms
        (16, 1, 1024, 1.0, 0.0143772, 0.0110278), (16, 1, 4096, 1.0, 0.0170358, 0.0227449),
        (16, 4, 1024, 0.4041, 0.0146598, 0.0120692), (16, 4, 1024, 1.0, 0.0149158, 0.0124809),
        (16, 4, 4096, 0.4042, 0.0181333, 0.0232356), (16, 4, 4096, 1.0, 0.0197316, 0.0200053),
        (16, 4, 16384, 0.4042, 0.0257653, 0.031408), (16, 4, 65536, 0.4042, 0.051104, 0.05632),
        (16, 4, 131072, 0.4042, 0.080224, 0.08472), (16, 16, 1024, 0.3511, 0.0160249, 0.0126151),
        (16, 16, 1024, 1.0, 0.0186649, 0.0153476), (16, 16, 4096, 0.3511, 0.0216427, 0.0203733),
        (16, 16, 4096, 1.0, 0.033728, 0.0293707), (16, 16, 16384, 0.3511, 0.044768, 0.0408),
        (16, 16, 16384, 1.0, 0.088336, 0.082448), (16, 16, 65536, 0.3511, 0.121584, 0.117056),
        (16, 16, 65536, 1.0, 0.291328, 0.295408), (16, 16, 131072, 0.3511, 0.23464, 0.218144),
        (16, 16, 131072, 1.0, 0.567856, 0.584576), (16, 64, 1024, 0.3412, 0.0225387, 0.020512),
        (16, 64, 1024, 1.0, 0.035856, 0.0314987), (16, 64, 4096, 0.3412, 0.051408, 0.039504),
        (16, 64, 4096, 1.0, 0.0896, 0.08456), (16, 64, 16384, 0.3412, 0.140128, 0.111632),
        (16, 64, 16384, 1.0, 0.294416, 0.293104), (16, 64, 65536, 0.3412, 0.501872, 0.399872),
        (16, 64, 65536, 1.0, 1.1813, 1.15101), (16, 64, 131072, 0.3412, 0.966288, 0.788096),
        (16, 64, 131072, 1.0, 2.3967, 2.2871), (16, 128, 1024, 0.3396, 0.03516, 0.030048),
        (16, 128, 1024, 1.0, 0.053968, 0.04348), (16, 128, 4096, 0.3397, 0.076448, 0.065552),
        (16, 128, 4096, 1.0, 0.155568, 0.148496), (16, 128, 16384, 0.3397, 0.238592, 0.20808),
        (16, 128, 16384, 1.0, 0.565344, 0.587072), (16, 128, 65536, 0.3397, 0.910176, 0.782864),
        (16, 128, 65536, 1.0, 2.39504, 2.29098), (16, 128, 131072, 0.3397, 1.86589, 1.56192),
        (16, 128, 131072, 1.0, 4.77635, 4.54736), (32, 1, 1024, 1.0, 0.0151165, 0.011752),
        (32, 1, 4096, 1.0, 0.0179092, 0.0234833), (32, 1, 16384, 1.0, 0.0252391, 0.0408036),
        (32, 1, 65536, 1.0, 0.0418187, 0.054848), (32, 1, 131072, 1.0, 0.061536, 0.072528),
        (32, 4, 1024, 0.4041, 0.0153252, 0.0128946), (32, 4, 1024, 1.0, 0.0157656, 0.0134833),
        (32, 4, 4096, 0.4042, 0.0183627, 0.0251093), (32, 4, 4096, 1.0, 0.0206933, 0.020416),
        (32, 4, 16384, 0.4042, 0.0267627, 0.0318773), (32, 4, 16384, 1.0, 0.0363627, 0.0347733),
        (32, 4, 65536, 0.4042, 0.05592, 0.058), (32, 4, 65536, 1.0, 0.092432, 0.089408),
        (32, 4, 131072, 0.4042, 0.090544, 0.085456), (32, 4, 131072, 1.0, 0.161008, 0.158608),
        (32, 16, 1024, 0.3511, 0.0168782, 0.0139271), (32, 16, 1024, 1.0, 0.0207342, 0.0166364),
        (32, 16, 4096, 0.3511, 0.023648, 0.0212213), (32, 16, 4096, 1.0, 0.0362827, 0.0308053),
        (32, 16, 16384, 0.3511, 0.051776, 0.042176), (32, 16, 16384, 1.0, 0.090784, 0.08392),
        (32, 16, 65536, 0.3511, 0.159232, 0.11888), (32, 16, 65536, 1.0, 0.29648, 0.296096),
        (32, 16, 131072, 0.3511, 0.335664, 0.212976), (32, 16, 131072, 1.0, 0.571472, 0.593648),
        (32, 64, 1024, 0.3412, 0.0237173, 0.0206613), (32, 64, 1024, 1.0, 0.0391787, 0.0335893),
        (32, 64, 4096, 0.3412, 0.052016, 0.040864), (32, 64, 4096, 1.0, 0.093808, 0.08584),
        (32, 64, 16384, 0.3412, 0.149296, 0.11392), (32, 64, 16384, 1.0, 0.298544, 0.30184),
        (32, 64, 65536, 0.3412, 0.558096, 0.40456), (32, 64, 65536, 1.0, 1.2189, 1.17925),
        (32, 64, 131072, 0.3412, 1.06171, 0.83584), (32, 64, 131072, 1.0, 2.42787, 2.33792),
        (32, 128, 1024, 0.3396, 0.036496, 0.030928), (32, 128, 1024, 1.0, 0.053776, 0.043776),
        (32, 128, 4096, 0.3397, 0.084656, 0.068064), (32, 128, 4096, 1.0, 0.157744, 0.148672),
        (32, 128, 16384, 0.3397, 0.30896, 0.218304), (32, 128, 16384, 1.0, 0.58536, 0.604048),
        (32, 128, 65536, 0.3397, 1.05976, 0.809744), (32, 128, 65536, 1.0, 2.44051, 2.36288),
        (32, 128, 131072, 0.3397, 2.08598, 1.64277), (32, 128, 131072, 1.0, 4.77118, 4.68342),
        (64, 1, 1024, 1.0, 0.0163657, 0.012841), (64, 1, 4096, 1.0, 0.0193355, 0.0250296),
        (64, 1, 16384, 1.0, 0.0275467, 0.0433564), (64, 1, 65536, 1.0, 0.0452747, 0.0573333),
        (64, 1, 131072, 1.0, 0.06476, 0.075848), (64, 4, 1024, 0.4041, 0.01668, 0.0142085),
        (64, 4, 1024, 1.0, 0.0173638, 0.0152489), (64, 4, 4096, 0.4042, 0.02096, 0.0262507),
        (64, 4, 4096, 1.0, 0.0248836, 0.0214382), (64, 4, 16384, 0.4042, 0.032224, 0.0340853),
        (64, 4, 16384, 1.0, 0.042768, 0.038176), (64, 4, 65536, 0.4042, 0.081488, 0.060928),
        (64, 4, 65536, 1.0, 0.098864, 0.094416), (64, 4, 131072, 0.4042, 0.140032, 0.091344),
        (64, 4, 131072, 1.0, 0.167984, 0.16744), (64, 16, 1024, 0.3511, 0.0203982, 0.0156587),
        (64, 16, 1024, 1.0, 0.0234489, 0.0202524), (64, 16, 4096, 0.3511, 0.030304, 0.0242933),
        (64, 16, 4096, 1.0, 0.0414773, 0.0351733), (64, 16, 16384, 0.3511, 0.073856, 0.046144),
        (64, 16, 16384, 1.0, 0.0964, 0.09008), (64, 16, 65536, 0.3511, 0.26152, 0.125808),
        (64, 16, 65536, 1.0, 0.301424, 0.310976), (64, 16, 131072, 0.3511, 0.481648, 0.22624),
        (64, 16, 131072, 1.0, 0.585072, 0.636256), (64, 64, 1024, 0.3412, 0.0328533, 0.0242293),
        (64, 64, 1024, 1.0, 0.0471947, 0.0402027), (64, 64, 4096, 0.3412, 0.07784, 0.047344),
        (64, 64, 4096, 1.0, 0.103536, 0.093808), (64, 64, 16384, 0.3412, 0.25808, 0.127072),
        (64, 64, 16384, 1.0, 0.308832, 0.325408), (64, 64, 65536, 0.3412, 0.905408, 0.4316),
        (64, 64, 65536, 1.0, 1.20296, 1.24427), (64, 64, 131072, 0.3412, 1.74336, 0.854112),
        (64, 64, 131072, 1.0, 2.44762, 2.45616), (64, 128, 1024, 0.3396, 0.041808, 0.034952),
        (64, 128, 1024, 1.0, 0.054384, 0.045248), (64, 128, 4096, 0.3397, 0.12536, 0.077024),
        (64, 128, 4096, 1.0, 0.158816, 0.150688), (64, 128, 16384, 0.3397, 0.49192, 0.235584),
        (64, 128, 16384, 1.0, 0.584432, 0.650848), (64, 128, 65536, 0.3397, 1.72053, 0.85128),
        (64, 128, 65536, 1.0, 2.2936, 2.48566), (64, 128, 131072, 0.3397, 3.43642, 1.70498),
        (64, 128, 131072, 1.0, 4.8097, 4.88093), (128, 1, 1024, 1.0, 0.016989, 0.0138347),
        (128, 1, 4096, 1.0, 0.0201882, 0.0195859), (128, 4, 1024, 0.4041, 0.0174391, 0.0142311),
        (128, 4, 1024, 1.0, 0.0197012, 0.0149854), (128, 4, 4096, 0.4042, 0.0238062, 0.0223911),
        (128, 4, 4096, 1.0, 0.0287236, 0.025248), (128, 4, 16384, 0.4042, 0.0457973, 0.0348533),
        (128, 4, 65536, 0.4042, 0.129296, 0.065552), (128, 4, 131072, 0.4042, 0.23984, 0.108992),
        (128, 16, 1024, 0.3511, 0.0235307, 0.0175378), (128, 16, 1024, 1.0, 0.0284, 0.0225031),
        (128, 16, 4096, 0.3511, 0.0436747, 0.029024), (128, 16, 4096, 1.0, 0.0497653, 0.0436373),
        (128, 16, 16384, 0.3511, 0.122688, 0.058448), (128, 16, 16384, 1.0, 0.133936, 0.123904),
        (128, 16, 65536, 0.3511, 0.50088, 0.167824), (128, 16, 65536, 1.0, 0.493248, 0.499808),
        (128, 16, 131072, 0.3511, 0.85568, 0.312432), (128, 16, 131072, 1.0, 1.08218, 1.00811),
        (128, 64, 1024, 0.3412, 0.038256, 0.031584), (128, 64, 1024, 1.0, 0.0413867, 0.0359573),
        (128, 64, 4096, 0.3412, 0.11568, 0.063248), (128, 64, 4096, 1.0, 0.12528, 0.11592),
        (128, 64, 16384, 0.3412, 0.47352, 0.17472), (128, 64, 16384, 1.0, 0.457088, 0.506608),
        (128, 64, 65536, 0.3412, 1.61056, 0.613456), (128, 64, 65536, 1.0, 2.1313, 2.0321),
        (128, 64, 131072, 0.3412, 3.19688, 1.39136), (128, 64, 131072, 1.0, 4.24298, 3.9925),
        (128, 128, 1024, 0.3396, 0.046744, 0.050408), (128, 128, 1024, 1.0, 0.077144, 0.068784),
        (128, 128, 4096, 0.3397, 0.135264, 0.112928), (128, 128, 4096, 1.0, 0.243392, 0.237328),
        (128, 128, 16384, 0.3397, 0.49072, 0.332128), (128, 128, 16384, 1.0, 0.970896, 1.02744),
        (128, 128, 65536, 0.3397, 1.79925, 1.38134), (128, 128, 65536, 1.0, 4.25464, 3.99821),
        (128, 128, 131072, 0.3397, 3.57616, 2.78243), (128, 128, 131072, 1.0, 8.57704, 8.01699),
    )),
    *(Measured(h, b, ctx, fa3_ms=fa3, flashmla_ms=mla, splitkv_ms=skv, skew=skew,
               source='bench CSV docs/perf/2026-12-06/h200/decode_whole_step.csv')
      for h, b, ctx, skew, fa3, mla, skv in (  # heads, batch, context, skew, FA3 / FlashMLA / split-KV ms
        (16, 1, 16384, 1.0, 0.03654, 0.0555837, 0.0291765), (16, 1, 32768, 1.0, 0.0438508, 0.0616356, 0.032988),
        (16, 1, 65536, 1.0, 0.053639, 0.0700192, 0.0428681), (16, 1, 131072, 1.0, 0.071579, 0.0870955, 0.0591177),
        (16, 2, 16384, 1.0, 0.0408545, 0.0509708, 0.0320909), (16, 2, 32768, 1.0, 0.051389, 0.0592197, 0.0428416),
        (16, 2, 65536, 1.0, 0.0704475, 0.0765978, 0.0620389), (16, 2, 131072, 1.0, 0.106407, 0.110308, 0.0946639),
        (16, 4, 16384, 1.0, 0.0502927, 0.0532698, 0.0458313), (16, 4, 32768, 1.0, 0.0683431, 0.0694146, 0.062601),
        (16, 4, 65536, 1.0, 0.102176, 0.102921, 0.0942232), (16, 4, 131072, 1.0, 0.17428, 0.170433, 0.160952),
        (16, 8, 16384, 1.0, 0.0662269, 0.0651597, 0.0630244), (16, 8, 32768, 1.0, 0.102377, 0.0988706, 0.0967327),
        (16, 8, 65536, 1.0, 0.172605, 0.165716, 0.163079), (16, 8, 131072, 1.0, 0.304047, 0.302444, 0.292519),
        (128, 1, 16384, 1.0, 0.0530228, 0.0731616, 0.058406), (128, 1, 32768, 1.0, 0.0609455, 0.0796278, 0.0761784),
        (128, 1, 65536, 1.0, 0.0802749, 0.0930536, 0.109188), (128, 1, 131072, 1.0, 0.11258, 0.119873, 0.174718),
        (128, 2, 16384, 1.0, 0.064484, 0.0831183, 0.0781306), (128, 2, 32768, 1.0, 0.0787788, 0.0960569, 0.111626),
        (128, 2, 65536, 1.0, 0.107327, 0.121822, 0.177465), (128, 2, 131072, 1.0, 0.170545, 0.174071, 0.308417),
        (128, 4, 16384, 1.0, 0.0761234, 0.0864238, 0.114421), (128, 4, 32768, 1.0, 0.103502, 0.112424, 0.180711),
        (128, 4, 65536, 1.0, 0.168601, 0.16162, 0.327107), (128, 4, 131072, 1.0, 0.294257, 0.273384, 0.591348),
        (128, 8, 16384, 1.0, 0.0986956, 0.107653, 0.187797), (128, 8, 32768, 1.0, 0.16049, 0.158766, 0.532374),
        (128, 8, 65536, 1.0, 0.275972, 0.271742, 0.778503), (128, 8, 131072, 1.0, 0.508701, 0.497247, 1.54833),
    )),
)
