"""Shared pytest setup: GPU-marked tests skip cleanly without CUDA sm90 + sgl_kernel."""

import pytest
import torch

# Tiny ops run fastest single-threaded (and CI has 2 shared cores).
torch.set_num_threads(1)


def _fa3_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import sgl_kernel.flash_attn  # noqa: F401
    except Exception:
        return False
    return True


FA3_READY = _fa3_ready()


def pytest_collection_modifyitems(config, items):
    if FA3_READY:
        return
    skip = pytest.mark.skip(reason="needs CUDA sm90 and sgl_kernel (FA3)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked long (the 10,000-batch engine fuzz)")


def pytest_configure(config):
    config.addinivalue_line("markers", "long: long fuzz runs; skipped unless --long")


def pytest_runtest_setup(item):
    if "long" in item.keywords and not item.config.getoption("--long"):
        pytest.skip("long run: pass --long")
