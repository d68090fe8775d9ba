"""The card's streaming read ceiling, and what a static split of the bytes over the SMs costs at the end (the tail).

    python benchmarks/stream_read.py [--out FILE.csv] [--mb 75.5,151,302,1208] [--per-sm 1,2,4]

The decode kernels' roofline figures divide bytes by a bandwidth; this measures the bandwidth a plain read gets on
the card in hand, and whether splitting the bytes evenly over the SMs up front (what every split-KV schedule does:
FA3's, FlashMLA's, ours) leaves SMs idle at the end while others still stream. One Triton kernel reads a buffer in
64 KB chunks and sums them (int32, wrapping; the sum is checked against torch's, so every chunk is read exactly
once):

    static    program p reads chunks [p · n / P, (p + 1) · n / P): the split-KV way, decided before the launch
    dynamic   programs take ``--grain`` chunks at a time from an atomic counter until none is left (the last program
              to finish resets the counter, so a CUDA graph replays it as it is)

P = SMs x ``--per-sm``. Each variant is timed as a CUDA-graph replay of at least 16 calls over windows of the buffer
that rotate past the L2 (``bench.timing``), beside ``torch``'s device-to-device copy of the same bytes (its rate
counts the bytes read and written). One extra call per variant records every program's start and end
(``%globaltimer``) and SM: ``tail_us`` is the last program's end minus the median program's end; ``sm_tb_s_min`` /
``sm_tb_s_max`` the slowest and fastest program's own read rate, x the number of programs (how far the SMs' shares
of the bandwidth differ). Sizes are the latent bytes of the decode shapes (bs x ctx x 576 x 2 B: 75.5 MB = bs 1 x
64k, 151 = bs 4 x 32k, 302 = bs 4 x 64k, 1208 = bs 16 x 64k). GPU only; the kernel's CPU test runs it under Triton's
interpreter (``tests/test_stream_read.py``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mla_fa3.bench.timing import time_per_call  # noqa: E402

CHUNK = 16384  # int32 values a chunk: 64 KB
BLOCK = 4096  # int32 values a load step of one program (16 KB; a chunk is 4 steps, unrolled)
L2_BYTES = 50 * 2 ** 20


@triton.jit
def _stream_kernel(X, n_chunks, Sums, Counter, Done, Stamps, CHUNK_: tl.constexpr, BLOCK_: tl.constexpr,
                   DYNAMIC: tl.constexpr, GRAIN: tl.constexpr, STAMP: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if STAMP:
        t0 = tl.extra.cuda.globaltimer()
    offs = tl.arange(0, BLOCK_)
    acc = tl.zeros([BLOCK_], tl.int32)
    done = tl.full([], 0, tl.int32)  # chunks this program read
    if DYNAMIC:
        c = tl.atomic_add(Counter, GRAIN)
        while c < n_chunks:
            for g in range(GRAIN):
                if c + g < n_chunks:
                    base = X + (c + g).to(tl.int64) * CHUNK_
                    for j in tl.static_range(CHUNK_ // BLOCK_):
                        acc += tl.load(base + j * BLOCK_ + offs)
                    done += 1
            c = tl.atomic_add(Counter, GRAIN)
        if tl.atomic_add(Done, 1) == nprog - 1:  # every program is past its last grab: reset for the next call
            tl.store(Counter, 0)
            tl.store(Done, 0)
    else:
        lo = (pid.to(tl.int64) * n_chunks) // nprog  # int64: the loop's chunk index and its offset
        hi = ((pid.to(tl.int64) + 1) * n_chunks) // nprog
        for c in range(lo, hi):
            base = X + c * CHUNK_
            for j in tl.static_range(CHUNK_ // BLOCK_):
                acc += tl.load(base + j * BLOCK_ + offs)
            done += 1
    tl.store(Sums + pid, tl.sum(acc, 0))
    if STAMP:
        t1 = tl.extra.cuda.globaltimer()
        tl.store(Stamps + pid * 4, t0)
        tl.store(Stamps + pid * 4 + 1, t1)
        tl.store(Stamps + pid * 4 + 2, tl.extra.cuda.smid().to(tl.int64))
        tl.store(Stamps + pid * 4 + 3, done.to(tl.int64))


class StreamRead:
    """One variant's launch over int32 buffers of a multiple of ``CHUNK`` values (state kept for graph replays)."""

    def __init__(self, programs: int, dynamic: bool, grain: int = 1, num_warps: int = 8, device="cuda"):
        if programs < 1 or grain < 1:
            raise ValueError(f"programs and grain must be >= 1, got {programs}, {grain}")
        self.programs, self.dynamic, self.grain, self.num_warps = programs, dynamic, grain, num_warps
        self.sums = torch.zeros(programs, dtype=torch.int32, device=device)
        self.counter = torch.zeros(2, dtype=torch.int32, device=device)  # [next chunk, programs done]
        self.stamps = torch.zeros(programs, 4, dtype=torch.int64, device=device)

    def __call__(self, x: torch.Tensor, stamp: bool = False) -> torch.Tensor:
        if x.dtype != torch.int32 or x.dim() != 1 or x.numel() % CHUNK or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous 1-D int32 tensor of a multiple of {CHUNK} values")
        _stream_kernel[(self.programs,)](x, x.numel() // CHUNK, self.sums, self.counter, self.counter[1:],
                                         self.stamps, CHUNK_=CHUNK, BLOCK_=BLOCK, DYNAMIC=self.dynamic,
                                         GRAIN=self.grain, STAMP=stamp, num_warps=self.num_warps)
        return self.sums


def wrapped_sum(x: torch.Tensor) -> int:
    """Σ x as int32 arithmetic wraps (mod 2^32, signed): the oracle over the buffer, and the kernel's total over its
    per-program sums."""
    s = int(x.to(torch.int64).sum().item()) & 0xFFFFFFFF
    return s - 2 ** 32 if s >= 2 ** 31 else s


def stamp_stats(stamps: torch.Tensor, chunk_bytes: int) -> dict:
    """From one stamped call's [programs, 4] (start ns, end ns, SM, chunks): span, tail and per-program rates."""
    t0, t1, _, chunks = (stamps[:, i].tolist() for i in range(4))
    ends = sorted(t1)
    rates = [c * chunk_bytes / max(b - a, 1) * 1e-3 for a, b, c in zip(t0, t1, chunks) if c > 0]  # TB/s (B/ns / 1e3)
    n = len(t0)
    return dict(span_us=(max(t1) - min(t0)) / 1e3, start_spread_us=(max(t0) - min(t0)) / 1e3,
                tail_us=(ends[-1] - statistics.median(ends)) / 1e3,
                sm_tb_s_min=min(rates) * n if rates else 0.0, sm_tb_s_max=max(rates) * n if rates else 0.0,
                chunks_min=min(chunks), chunks_max=max(chunks))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="CSV file to write")
    p.add_argument("--mb", default="75.497472,150.994944,301.989888,1207.959552", help="bytes read per call, MB")
    p.add_argument("--per-sm", default="1,2,4", help="programs per SM")
    p.add_argument("--grain", default="1,4", help="chunks per grab of the dynamic variant")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_read: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sizes = [int(round(float(m) * 1e6)) // (CHUNK * 4) * CHUNK * 4 for m in args.mb.split(",")]
    total = max(max(sizes), min(3 * L2_BYTES, 4 * max(sizes)))
    buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (total // 4,), dtype=torch.int32, device=dev)
    name = torch.cuda.get_device_name(dev)
    print(f"{name}, {sms} SMs, triton {triton.__version__}", flush=True)
    rows = []
    for size in sizes:
        n = size // 4
        windows = [buf[i * n:(i + 1) * n] for i in range(max(1, min(math.ceil(3 * L2_BYTES / size), total // size)))]
        dst = torch.empty(n, dtype=torch.int32, device=dev)
        copy_us = 1e3 * time_per_call(lambda: [dst.copy_(w) for w in windows], len(windows), warmup=3,
                                      iters=args.iters)
        variants = [(f"static x{k}", StreamRead(sms * k, False)) for k in map(int, args.per_sm.split(","))]
        variants += [(f"dynamic x{k} grain {g}", StreamRead(sms * k, True, g))
                     for k in map(int, args.per_sm.split(",")) for g in map(int, args.grain.split(","))]
        for label, run in variants:
            got = wrapped_sum(run(windows[0]))
            want = wrapped_sum(windows[0])
            if got != want:
                print(f"{label}: sum {got} != torch's {want}: not every chunk read once", file=sys.stderr)
                return 1
            us = 1e3 * time_per_call(lambda run=run: [run(w) for w in windows], len(windows), warmup=3,
                                     iters=args.iters)
            run(windows[0], stamp=True)
            torch.cuda.synchronize()
            st = stamp_stats(run.stamps.cpu(), CHUNK * 4)
            rows.append(dict(card=name, mb=round(size / 1e6, 1), variant=label, programs=run.programs, us=round(us, 2),
                             tb_s=round(size / us / 1e6, 3), copy_us=round(copy_us, 2),
                             copy_tb_s=round(2 * size / copy_us / 1e6, 3),
                             **{k: round(v, 3) if isinstance(v, float) else v for k, v in st.items()}))
            print(", ".join(f"{k} {v}" for k, v in rows[-1].items() if k != "card"), flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
