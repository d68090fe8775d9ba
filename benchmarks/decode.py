"""Decode benchmark on the H200: ``python benchmarks/decode.py --quick --out out/decode``.

Thin wrapper over :func:`mla_fa3.bench.decode.main` (also ``mla-fa3 bench decode``); see that module
for what is measured and the flags.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mla_fa3.bench.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
