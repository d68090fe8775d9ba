"""``python -m mla_fa3 ...`` = the ``mla-fa3`` command line (mla_fa3.cli)."""

import sys

from mla_fa3.cli import main

sys.exit(main())
