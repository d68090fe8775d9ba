"""The one rule of every benchmark about the machine it runs on (``mla-fa3 bench decode | prefill | serve | fp8``).

The benchmarks time the CUDA kernels (FA3, FlashMLA, split-KV) on a Hopper GPU. Without CUDA a benchmark either

* refuses: one line on stderr naming the way out, exit status 2, nothing built (``refused``); or, asked for with
  ``--device cpu``,
* runs a *smoke run*: the same code on the pure-torch reference kernels over small shapes (each benchmark's
  ``SMOKE`` set, in place of its default and ``--quick`` sets; shapes given on the command line run as given), a
  few iterations each, about a minute at most on two cores, progress on stderr, ``SMOKE_LABEL`` as the first line
  of stdout (``start_smoke``), and nothing meant to be pasted into a table (no re-fitted cost constants, no policy
  table literals): CPU timings of the reference say nothing about the GPU kernels.

The kernel benchmarks that have no CPU path (``python -m mla_fa3.bench.splitkv``, ``splitkv_phases``, ``plain_step``:
Triton and FA3 only) refuse in the same one line (``refused(..., cpu_smoke=False)``).
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

__all__ = ["SMOKE_LABEL", "add_device_argument", "refused", "start_smoke"]

SMOKE_LABEL = "CPU smoke run (reference kernels): timings are not performance figures"
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _device(text: str) -> str:
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"must be cuda, cuda:N or cpu, got {text!r}")
    return text


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device``: cuda (the default, on every machine) or cuda:N, or cpu for a smoke run."""
    parser.add_argument("--device", type=_device, default="cuda",
                        help="cuda or cuda:N (default cuda), or cpu: a smoke run of the code on the reference "
                             "kernels (small shapes, about a minute; no performance figures)")


def _refusal(device: str, cpu_smoke: bool) -> str | None:
    if device == "cpu" and cpu_smoke:
        return None
    if not cpu_smoke and (device == "cpu" or not torch.cuda.is_available()):
        return (f"CUDA is not available (torch {torch.__version__}): this benchmark times the Triton / FA3 kernels, "
                "which run on a CUDA GPU only (no CPU smoke run)")
    if not torch.cuda.is_available():
        return (f"CUDA is not available for --device {device} (torch {torch.__version__}); pass --device cpu for a "
                "smoke run on the reference kernels")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)"
    return None


def refused(prog: str, device: str = "cuda", *, cpu_smoke: bool = True) -> bool:
    """True, after one line on stderr (``PROG: error: ...`` naming the way out), when the benchmark cannot run on
    ``device`` here; the caller returns exit status 2 before building anything. ``cpu_smoke``: whether the
    benchmark has a ``--device cpu`` smoke run to point to."""
    reason = _refusal(device, cpu_smoke)
    if reason is None:
        return False
    print(f"{prog}: error: {reason}", file=sys.stderr)
    return True


def start_smoke(device: str) -> bool:
    """Whether this is a smoke run (``device`` is the CPU); if so ``SMOKE_LABEL`` goes out first on stdout, before
    any progress line (flushed)."""
    if device != "cpu":
        return False
    print(SMOKE_LABEL, flush=True)
    return True
