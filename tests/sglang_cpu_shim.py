"""Make SGLang 0.5.17 importable on a CPU-only torch (tools/install_sglang_cpu.sh installs it).

Every sglang import goes through ``sglang.srt.utils.common``, which imports ``torchvision.io``; the
only torchvision for torch 2.13 on the index is a CUDA build whose import registers fake kernels for
``torchvision::nms``/``qnms``, operators that its unloadable CUDA extension would define: we define
the two schemas first (torchvision's ops still do not run; we need none). Also, sglang pins
transformers 5.12.1 and registers configs (``qwen3_asr``...) that newer transformers ship itself:
such a registration by sglang is skipped instead of raising, transformers' own class stays.
"""

from __future__ import annotations

import sys

_LIBS: list = []  # the torch.library.Library objects must stay alive, or their defs go away
_DONE = False

_TORCHVISION_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
}


def _has_op(qualname: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


def _declare_torchvision_ops() -> None:
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return  # a GPU torch: the real torchvision extension defines them
    missing = [n for n in _TORCHVISION_SCHEMAS if not _has_op(f"torchvision::{n}")]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for n in missing:
            lib.define(_TORCHVISION_SCHEMAS[n])
        _LIBS.append(lib)


def _called_from_sglang(depth: int = 12) -> bool:
    f = sys._getframe(2)
    for _ in range(depth):
        if f is None:
            return False
        if str(f.f_globals.get("__name__", "")).startswith("sglang."):
            return True
        f = f.f_back
    return False


def _tolerate_builtin_reregistration() -> None:
    try:
        from transformers.models.auto import auto_factory, configuration_auto
    except ImportError:
        return
    for cls in (configuration_auto._LazyConfigMapping, auto_factory._LazyAutoMapping):
        orig = cls.register
        if getattr(orig, "_sglang_cpu_shim", False):
            continue

        def register(self, key, value, exist_ok=False, _orig=orig):
            try:
                return _orig(self, key, value, exist_ok=exist_ok)
            except ValueError as e:
                if "already used by a Transformers" in str(e) and _called_from_sglang():
                    return None  # keep transformers' own class for this name
                raise

        register._sglang_cpu_shim = True
        cls.register = register


def prepare_sglang_import() -> None:
    """Call before the first ``import sglang``; idempotent. The torchvision part is a no-op on a
    GPU torch; the transformers part only turns sglang's duplicate registrations into no-ops."""
    global _DONE
    if _DONE:
        return
    _declare_torchvision_ops()
    _tolerate_builtin_reregistration()
    _DONE = True
