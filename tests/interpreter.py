"""Run a test module's Triton kernels under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set
before triton is imported, so it cannot be switched on inside the pytest process).

The module's ``__main__`` block runs its cases and prints a JSON dict of failures as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def subprocess_env() -> dict:
    """This process's environment with the repository and tests/ importable and the interpreter switched off."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return env


def run_under_interpreter(path: str, timeout: int = 240) -> dict:
    """Run ``python path`` with TRITON_INTERPRET=1; returns the failures it printed ({} when all passed)."""
    res = subprocess.run([sys.executable, path], capture_output=True, text=True,
                         env=dict(subprocess_env(), TRITON_INTERPRET="1"), timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_cases(cases) -> dict:
    """Run every ``(name, check)`` of ``cases``; the failures as {name: "Error: message"} — every case reported, not
    only the first."""
    failures = {}
    for name, check in cases:
        try:
            check()
        except Exception as exc:
            failures[name] = f"{type(exc).__name__}: {exc}"
    return failures


def interpreter_main(run) -> None:
    """The subprocess side: ``run()`` returns the failures (a dict); printed as the last line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    torch.set_num_threads(1)
    print(json.dumps(run()))
