"""Prefill benchmark (H200): absorbed vs chunked MHA per shape and the path auto picks.

Thin wrapper: ``python benchmarks/prefill.py --out results/prefill.csv`` == ``mla-fa3 bench prefill
--out results/prefill.csv``; see ``mla_fa3.bench.prefill`` for the shapes, columns and options.
"""

import sys

from mla_fa3.bench.prefill import main

if __name__ == "__main__":
    sys.exit(main())
