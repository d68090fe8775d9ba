"""The package's layering, checked by parsing every module's imports (no import is executed).

Folders and modules are layers; an import may only reach the same layer or a lower one, the module
graph has no cycle, and every dependency is a plain import that readers and tools can see: no
``importlib``/``__import__`` string imports, no module-level ``__getattr__`` (lazy re-exports).
A new module must be given a layer here — that is where its place in the architecture is decided.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mla_fa3"

# lowest first; a module may import modules of its own layer or of layers listed before it
LAYERS: list[tuple[str, ...]] = [
    ("ops", "checks", "host"),  # the kernel layer; argument checkers; host values to tensors without a sync
    ("batch", "tree"),  # what an engine hands the backend each step; speculative draft trees
    ("layer", "kv"),  # the per-layer description; KV memory (rows, pages, pools)
    ("pages",),  # page-table and local-attention index math
    ("graphs",),  # CUDA-graph capture buffers, static inputs, the graph runner, the table of captured steps
    ("batch_checks",),  # a batch held against req_to_token and the pool (rows, slots, tree), before any metadata
    ("metadata",),  # THE metadata builder
    ("policy",),  # decode-kernel choice, prefill cost model, their tables
    ("prefill_plan", "prefill_graph"),  # the MHA prefill's per-step chunks and row split; its CUDA graphs
    ("schedules",),  # the decode kernels' schedules (FlashMLA, split-KV, FA3): planned per step, re-planned per replay
    ("plan",),  # the typed per-step plan
    ("backend_config", "decode_graphs"),  # the backend's pools, decode kernel and FP8 rules, checked at
    #   construction; its CUDA-graph steps (capture, replay updates, the in-graph prologue)
    ("lse", "absorb", "absorb_tree", "chunked_prefix", "mha_fallback"),  # the compute paths
    ("backend",),  # plan once per step, route each layer
    ("draft_backend",),  # one backend per draft step
    ("models",),  # DeepSeek V2/V3 on the backend, the HF loader
    ("serve", "hf_compare", "kv_accuracy"),  # generation and serving loops; the comparisons with transformers
    ("bench",),  # H200 benchmarks
    ("integrations",),  # other engines loading the backend (the SGLang plugin): the only sglang imports
    ("cli", "__main__", "__init__"),  # the `mla-fa3` command (cli/: parser, commands; main in its __init__)
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
KERNEL_IMPORT_POINT = "mla_fa3.ops.fa3"  # the one module that imports the optional sgl_kernel submodules


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Package modules imported anywhere in the file (module level, functions, TYPE_CHECKING blocks)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("mla_fa3") and t != module and t != "mla_fa3":
                out.add(t)
    return out


MODULES = _modules()
GRAPH = {m: _imports(m, p, MODULES) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    missing = sorted({_layer(m) for m in MODULES} - set(RANK))
    assert not missing, f"give these modules/folders a layer in LAYERS: {missing}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, ts in graph.items() for t in ts
                  if RANK[_layer(t)] > RANK[_layer(m)])


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_imports_only_go_down():
    upward = upward_imports(GRAPH)
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycles():
    cycles = import_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(set(MODULES) - {KERNEL_IMPORT_POINT}))
def test_plain_imports_only(module):
    """Package dependencies are plain imports (the kernel import point, which imports the optional
    sgl_kernel by name and reads package versions, is the documented exception)."""
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            pytest.fail(f"{module} defines a module-level __getattr__ (a lazy re-export)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "importlib" or a.name.startswith("importlib.") for a in node.names):
            pytest.fail(f"{module} imports importlib (a string import hides a dependency)")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("importlib") \
                and not any(a.name in ("metadata",) for a in node.names):
            pytest.fail(f"{module} imports from importlib (a string import hides a dependency)")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            pytest.fail(f"{module} calls __import__ (only {KERNEL_IMPORT_POINT} imports sgl_kernel, by name)")


def test_the_layer_checks_can_fail():
    """The checkers see an upward import, a cycle and a relative import when they are there."""
    fake = {"mla_fa3.kv.pools": {"mla_fa3.backend"}, "mla_fa3.backend": {"mla_fa3.kv.pools"}}
    assert upward_imports(fake) == ["mla_fa3.kv.pools (kv) imports mla_fa3.backend (backend)"]
    assert import_cycles(fake) == ["mla_fa3.backend -> mla_fa3.kv.pools -> mla_fa3.backend"]
    node = ast.parse("from ..backend import MLABackend").body[0]
    assert _resolve("mla_fa3.kv.pools", PACKAGE / "kv" / "pools.py", node) == "mla_fa3.backend"


def _imports_sglang(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "sglang" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "sglang":
            return True
    return False


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_integrations_import_sglang(module):
    """SGLang is the host engine of ``integrations.sglang`` alone: nothing below it knows it exists."""
    if _layer(module) == "integrations":
        return
    assert not _imports_sglang(ast.parse(MODULES[module].read_text())), f"{module} imports sglang"


def test_the_sglang_check_can_fail():
    assert _imports_sglang(ast.parse("from sglang.srt import server_args"))
    assert _imports_sglang(ast.parse("def f():\n    import sglang.srt.utils"))
    assert not _imports_sglang(ast.parse("from mla_fa3.integrations import sglang"))
