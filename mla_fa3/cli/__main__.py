"""``python -m mla_fa3.cli ...`` = the ``mla-fa3`` command line (``mla_fa3.cli.main``)."""

import sys

from mla_fa3.cli import main

sys.exit(main())
