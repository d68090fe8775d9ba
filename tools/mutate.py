"""Mutation testing of mla_fa3 on the CPU, outside CI (stdlib only: ``ast``, ``subprocess``).

For each module of a package it plants one mutant at a time in a scratch copy of the repository, runs the
tests that exercise that package, and records whether the tests noticed:

    killed    the test subset failed (or the mutant could not even be imported)
    survived  the test subset passed: either an equivalent mutant or a gap in the tests
    timeout   the subset ran past the per-mutant limit (an infinite loop, usually; counted as killed)

Mutation operators (each mutant changes one place):

    binop      + <-> -,  * <-> /,  // -> *   (also in augmented assignments)
    compare    < <-> <=,  > <-> >=,  == <-> !=,  is <-> is not,  in <-> not in
    boolop     and <-> or
    const      integer or float n -> n+1, n-1, 0;  True <-> False
    slice      a bound of a slice, a computed index, or a range() bound moved by +1 / -1
    argswap    the two positional arguments of a call swapped, when both are of the same kind
    guard      an early-exit guard (``if c: raise/return/continue/break``) dropped (``if False``) or negated

Not mutated: docstrings and strings, f-strings, annotations, ``if TYPE_CHECKING`` / ``__main__`` blocks, and
data tables (literal lists, tuples, dicts of 8 entries or more: the measured decode times, name maps).
``mla_fa3/bench/`` and ``mla_fa3/cli/`` are skipped (benchmark drivers and the command line: their CPU
tests are smoke runs, so a score there would say little about the library).

The source tree is never touched: ``--work`` receives a copy of the tracked files (``git ls-files``), the
mutant is written there, tests run there with ``PYTHONPATH`` pointing at it (checked before the pass), and
the original file is put back after each mutant. Sampling: ``--per-module N`` takes a seeded random sample of
N mutants per module (all of them when a module has fewer); the CSV and the summary say how many were
enumerated and how many ran.

    python tools/mutate.py --per-module 5 --seed 43 --out /tmp/mut_out          # the whole pass
    python tools/mutate.py --packages kv --per-module 0 --out /tmp/mut_kv       # every kv mutant
    python tools/mutate.py --show 'mla_fa3/kv/pools.py:120:8:compare:0'           # print one mutant
    python tools/mutate.py --rerun /tmp/mut_out/mutants.csv --status survived      # rerun the survivors
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTEST_FLAGS = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu and not long"]

# Package -> the test files that exercise it (the first ones are the closest, so -x stops early).
PACKAGES: dict[str, dict] = {
    "ops": {
        "modules": ["mla_fa3/ops/*.py"],
        "tests": ["test_ops.py", "test_ops_validation.py", "test_ops_fallback.py", "test_store_rows.py",
                  "test_head_matmul.py", "test_fp8_quant.py", "test_splitkv.py", "test_splitkv_projection.py",
                  "test_tree_attention_triton.py", "test_gluon_decode_compile.py", "test_layout.py",
                  "test_mutants_ops.py"],
    },
    "kv": {
        "modules": ["mla_fa3/kv/*.py"],
        "tests": ["test_kv_pools.py", "test_kv_allocator.py", "test_kv_req_to_token.py", "test_kv_ownership.py",
                  "test_fp8_quant.py", "test_mutants_kv.py"],
    },
    "graphs": {
        "modules": ["mla_fa3/graphs/*.py"],
        "tests": ["test_graphs_capture.py", "test_graph_runner.py", "test_tree_graph_runner.py",
                  "test_fp8_splitkv.py", "test_backend.py", "test_mutants_graphs.py"],
    },
    "policy": {
        "modules": ["mla_fa3/policy/*.py"],
        "tests": ["test_decode_csv.py", "test_decode_kernel.py", "test_decode_kernel_splitkv.py",
                  "test_prefill_cost.py", "test_backend_splitkv.py", "test_replay_host_path.py",
                  "test_fa3_schedule.py", "test_fp8_splitkv.py", "test_fp8_cache.py", "test_mutants_policy.py"],
    },
    "serve": {
        "modules": ["mla_fa3/serve/*.py"],
        "tests": ["test_serve_scheduler.py", "test_serve_memory.py", "test_serve_loop.py",
                  "test_serve_metrics_oracle.py", "test_cli_errors.py", "test_mutants_serve.py"],
    },
    "models": {
        "modules": ["mla_fa3/models/*.py"],
        "tests": ["test_models.py", "test_loader.py", "test_prefill_paths_hf.py", "test_mutants_models.py"],
    },
    "top": {
        "modules": ["mla_fa3/*.py", "mla_fa3/hf_compare/*.py"],
        "tests": ["test_batch.py", "test_metadata.py", "test_absorb.py", "test_backend.py", "test_backend_errors.py",
                  "test_boundaries.py", "test_chunked_prefix.py", "test_mha_fallback.py",
                  "test_mha_fallback_cross.py", "test_prefill_planning.py", "test_prefill_graph.py",
                  "test_tree_steps.py", "test_tree_errors.py", "test_graphs_capture.py", "test_kv_ownership.py",
                  "test_kv_accuracy.py", "test_hf_compare.py", "test_fp8_cache.py", "test_validate_fp8_cache.py",
                  "test_validate_fp8_checkpoint.py", "test_fa3_schedule.py", "test_replay_host_path.py",
                  "test_mutants_top.py"],
    },
    "integrations": {
        "modules": ["mla_fa3/integrations/*.py", "mla_fa3/integrations/sglang/*.py"],
        "tests": ["test_sglang_plugin.py", "test_sglang_tree.py", "test_sglang_draft.py", "test_sglang_draft_extend.py",
                  "test_layout.py", "test_mutants_integrations.py"],
    },
}
SKIPPED = "mla_fa3/bench/ and mla_fa3/cli/"
DATA_TABLE = 8  # literal lists / tuples / dicts of this many entries or more are data tables: not mutated

_TINY = ("the tiny random model's data (a config value or an init scale in models.tiny): any value gives a valid "
         "model, which ours and the transformers reference then both run, and the tests compare the two")

# Survivors judged equivalent, by mutant id (module:line:col:kind:n of the pass recorded in docs/MUTATION.md)
# with the text before / after, so an entry stops matching when the code moves: a moved survivor is judged again.
EQUIVALENT: dict[str, tuple[str, str, str]] = {
    "mla_fa3/graphs/capture.py:228:17:slice:0": (
        "o + length", "((o + length) + 1)",
        "zeroes one more staged int after enc_first_col: past the end of the staging array (NumPy clips the "
        "slice) or local_cu_seqlens_q[0], which is 0 by definition and written again by _stage_local"),
    "mla_fa3/graphs/runner.py:103:37:const:0": (
        "1", "(2)",
        "seq_len_fill's default: the padding rows' length, any value in [q, max_context] is harmless and their "
        "outputs are discarded; no contract names 1"),
    "mla_fa3/policy/decode_table.py:76:56:argswap:0": (
        "self.fa3_ms, self.flashmla_ms", "self.flashmla_ms, self.fa3_ms",
        "min() of two floats is symmetric (Measured refuses NaN times, so no NaN ordering)"),
    "mla_fa3/policy/kernel_choice.py:58:17:binop:0": (
        "math.ceil(2.0 ** ((bucket + 1) / r)) - 1", "(math.ceil(2.0 ** ((bucket + 1) / r)) + 1)",
        "only the start of the search: the loop below walks hi down to the bucket's largest size from either start"),
    "mla_fa3/policy/decode_kernel.py:255:45:compare:0": (
        "dists <= best + TIE_DISTANCE", "(dists < best + TIE_DISTANCE)",
        "differs only for a distance equal to best + 0.05 to the last bit; distances are float64 sums of log2 "
        "terms of measured shapes, which do not land there"),
    "mla_fa3/serve/configs.py:35:50:const:0": (
        "2048", "(2049)", "moe_intermediate_size=2048 // 8: 2049 // 8 is 256 too"),
    "mla_fa3/serve/loop.py:113:56:const:0": (
        "True", "False",
        "CUDA only: torch.cuda.Event(enable_timing=...) of the eager step's timing, a branch taken on CUDA devices "
        "only (the GPU tests run it)"),
    "mla_fa3/models/moe.py:99:33:binop:0": (
        "weights.sum(dim=-1, keepdim=True) + 1e-20", "(weights.sum(dim=-1, keepdim=True) - 1e-20)",
        "the top-k sum of softmax / sigmoid scores is far above 1e-20 (every chosen sigmoid score would have to be "
        "below 1e-20, logits under -46): +/- 1e-20 rounds away"),
    "mla_fa3/batch.py:158:41:const:1": (
        "1", "(0)",
        "turns the decode shortcut of _default_positions off: the general formula gives seq - 1 for one new token "
        "per request too"),
    "mla_fa3/serve/scheduler.py:151:20:const:1": (
        "0", "(-1)",
        "the first Request.seq: seq only orders requests (max() for the victim, sort() of running), and starting "
        "the counter at -1 keeps every order"),
    "mla_fa3/models/tiny.py:53:70:const:0": ("1e-6", "(1.000001)", _TINY),
    "mla_fa3/models/tiny.py:105:56:const:2": ("0.1", "(0.0)", _TINY),
    "mla_fa3/models/tiny.py:113:56:const:2": ("0.02", "(0.0)", _TINY),
    "mla_fa3/integrations/sglang/adapter.py:67:95:const:1": (
        "0", "(-1)",
        "num_draft_tokens without speculative decoding (or 0 -> or -1): read only for verify steps and EAGLE trees "
        "(topk > 1), which SGLang sends only with speculative decoding on, and then the setting is a number"),
    "mla_fa3/ops/fa3.py:201:107:const:0": (
        "True", "False", "CUDA only: an argument of sgl_kernel's flash_attn_with_kvcache, called on an FA3 device only"),
    "mla_fa3/ops/pdl.py:25:51:const:1": (
        "0", "(-1)", "CUDA only: the major compute capability of a CUDA device (programmatic dependent launch)"),
    "mla_fa3/pages.py:76:21:argswap:0": (
        "values, live", "live, values", "torch.mul commutes; int x bool promotes to the int dtype in either order"),
    "mla_fa3/pages.py:101:60:const:1": (
        "0", "(-1)",
        "max(seq - 1, -1) differs from max(seq - 1, 0) only at seq_len 0, where q_len is 0 too and the row has no "
        "block either way"),
    "mla_fa3/prefill_plan.py:301:19:const:1": (
        "0", "(-1)", "rows is 1-D: rows.shape[-1] is rows.shape[0]"),
    "mla_fa3/kv_accuracy.py:198:53:const:0": (
        "1", "(2)",
        "the seed of the study's random prompts (seed + 1 -> seed + 2): any seed draws valid prompts; no contract "
        "names it"),
    "mla_fa3/prefill_graph.py:137:15:binop:0": (
        "pk + (tuple(q.shape), q.dtype, q.device, rows.dtype, None if latent is None else latent.dtype,\n"
        "                     kv_scale is None)",
        "(pk - (tuple(q.shape), q.dtype, q.device, rows.dtype, None if latent is None else latent.dtype, "
        "kv_scale is None))",
        "CUDA only: after PrefillGraphs._shape_key, which returns None off CUDA / FA3 (prefill graphs are captured on the GPU only)"),
    "mla_fa3/prefill_graph.py:161:11:compare:0": ("entry is None", "(entry is not None)", "CUDA only: after PrefillGraphs._shape_key, which returns None off CUDA / FA3 (prefill graphs are captured on the GPU only)"),
    "mla_fa3/prefill_graph.py:190:11:compare:0": ("self._pool is None", "(self._pool is not None)", "CUDA only: after PrefillGraphs._shape_key, which returns None off CUDA / FA3 (prefill graphs are captured on the GPU only)"),
    "mla_fa3/ops/splitkv_config.py:29:14:const:1": (
        "64", "(63)", "NARROW_ROWS compares rows = heads x query tokens per program, a power of two (16, 32, 64, "
        "128): < 63 and < 64 agree on all of them"),
    "mla_fa3/ops/splitkv_config.py:93:91:const:1": (
        "64", "(63)", "max_registers' lower bound; the same check requires a multiple of 8, so 63 is refused either way"),
    "mla_fa3/tree.py:156:103:const:1": (
        "1", "(0)", "num_steps' lower bound; num_steps 0 is refused by the next check (step must lie in [0, num_steps))"),
}


@dataclass
class Mutant:
    module: str      # path relative to the repository
    line: int        # 1-based line of the change
    col: int         # 0-based column (characters) of the change
    kind: str
    index: int       # n-th mutant of this kind at this place
    start: int       # byte offsets of the replaced segment in the file
    end: int
    before: str
    after: str
    end_line: int = 0  # last line of the changed code

    @property
    def ident(self) -> str:
        return f"{self.module}:{self.line}:{self.col}:{self.kind}:{self.index}"

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.after.encode() + source[self.end:]


# ---------------------------------------------------------------------------------------------- enumeration

_BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult}
_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _kind(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"Constant:{type(node.value).__name__}"
    return type(node).__name__


class _Enumerator:
    def __init__(self, module: str, source: bytes):
        self.module = module
        self.source = source
        self.tree = ast.parse(source)
        lines = source.split(b"\n")
        self.line_start = [0]
        for ln in lines:
            self.line_start.append(self.line_start[-1] + len(ln) + 1)
        self.skip: set[int] = set()  # id() of nodes whose subtree is not mutated
        self.mutants: list[Mutant] = []

    # -- helpers
    def _off(self, line: int, col: int) -> int:
        return self.line_start[line - 1] + col

    def _seg(self, node: ast.AST) -> tuple[int, int]:
        return self._off(node.lineno, node.col_offset), self._off(node.end_lineno, node.end_col_offset)

    def _text(self, node: ast.AST) -> str:
        s, e = self._seg(node)
        return self.source[s:e].decode()

    def _add(self, node: ast.AST, kind: str, after: str, seg_node: ast.AST | None = None) -> None:
        seg_node = seg_node or node
        s, e = self._seg(seg_node)
        before = self.source[s:e].decode()
        if after == before:
            return
        line_text = self.source[self.line_start[node.lineno - 1]:self._off(node.lineno, node.col_offset)]
        col = len(line_text.decode(errors="replace"))
        index = sum(1 for m in self.mutants if m.line == node.lineno and m.col == col and m.kind == kind)
        self.mutants.append(Mutant(self.module, node.lineno, col, kind, index, s, e, before, after,
                                   seg_node.end_lineno))

    def _replace(self, node: ast.AST, new: ast.AST, kind: str) -> None:
        self._add(node, kind, "(" + ast.unparse(new) + ")")

    # -- skipping
    def _mark_skips(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                    if a.annotation is not None:
                        self.skip.add(id(a.annotation))
                for a in (node.args.vararg, node.args.kwarg):
                    if a is not None and a.annotation is not None:
                        self.skip.add(id(a.annotation))
                if node.returns is not None:
                    self.skip.add(id(node.returns))
            elif isinstance(node, ast.AnnAssign):
                self.skip.add(id(node.annotation))
            elif isinstance(node, ast.JoinedStr):
                self.skip.add(id(node))
            elif isinstance(node, ast.If):
                t = ast.unparse(node.test)
                if t in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or t.startswith("__name__ =="):
                    self.skip.add(id(node))
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                self.skip.add(id(node))  # docstrings and bare constants
            elif isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
                if len(node.keys if isinstance(node, ast.Dict) else node.elts) >= DATA_TABLE:
                    self.skip.add(id(node))  # a data table (measured times, name maps): data, not logic

    def _walk(self, node: ast.AST):
        if id(node) in self.skip:
            return
        yield node
        for child in ast.iter_child_nodes(node):
            yield from self._walk(child)

    # -- the operators
    def run(self) -> list[Mutant]:
        self._mark_skips()
        for node in self._walk(self.tree):
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
                if not (_is_str(node.left) or _is_str(node.right)):
                    self._replace(node, ast.BinOp(node.left, _BINOP_SWAP[type(node.op)](), node.right), "binop")
            elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAP and not _is_str(node.value):
                new = ast.AugAssign(node.target, _BINOP_SWAP[type(node.op)](), node.value)
                self._add(node, "binop", ast.unparse(new))
            elif isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    if type(op) in _CMP_SWAP:
                        ops = list(node.ops)
                        ops[i] = _CMP_SWAP[type(op)]()
                        self._replace(node, ast.Compare(node.left, ops, node.comparators), "compare")
            elif isinstance(node, ast.BoolOp):
                other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
                self._replace(node, ast.BoolOp(other, node.values), "boolop")
            elif isinstance(node, ast.Constant):
                v = node.value
                if isinstance(v, bool):
                    self._add(node, "const", repr(not v))
                elif isinstance(v, (int, float)):
                    seen = set()
                    for new in (v + 1, v - 1, type(v)(0)):
                        if new != v and new not in seen:
                            seen.add(new)
                            self._add(node, "const", f"({new!r})")
            elif isinstance(node, ast.Subscript):
                self._subscript(node)
            elif isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.If):
                self._guard(node)
        return self.mutants

    def _shift(self, bound: ast.AST) -> None:
        if isinstance(bound, ast.Constant):
            return  # the const operator moves literal bounds already
        if isinstance(bound, ast.Name) and bound.id[:1].isupper():
            return  # a type parameter (Optional[Foo]), not an index
        text = self._text(bound)
        for d in ("+ 1", "- 1"):
            self._add(bound, "slice", f"(({text}) {d})")

    def _subscript(self, node: ast.Subscript) -> None:
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for p in parts:
            if isinstance(p, ast.Slice):
                for b in (p.lower, p.upper):
                    if b is not None:
                        self._shift(b)
            elif isinstance(p, (ast.Name, ast.BinOp, ast.UnaryOp, ast.Attribute, ast.Call)) and len(parts) == 1:
                self._shift(p)

    def _call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "range" and not node.keywords:
            for b in node.args[:2]:
                self._shift(b)
        args = node.args
        if (len(args) == 2 and not any(isinstance(a, ast.Starred) for a in args)
                and _kind(args[0]) == _kind(args[1]) and not _is_str(args[0])):
            a, b = self._text(args[0]), self._text(args[1])
            if a != b:
                s0, _ = self._seg(args[0])
                _, e1 = self._seg(args[1])
                middle = self.source[self._seg(args[0])[1]:self._seg(args[1])[0]].decode()
                before = self.source[s0:e1].decode()
                after = b + middle + a
                line_text = self.source[self.line_start[args[0].lineno - 1]:s0]
                col = len(line_text.decode(errors="replace"))
                index = sum(1 for m in self.mutants if m.line == args[0].lineno and m.col == col
                            and m.kind == "argswap")
                self.mutants.append(Mutant(self.module, args[0].lineno, col, "argswap", index, s0, e1,
                                           before, after, args[1].end_lineno))

    def _guard(self, node: ast.If) -> None:
        last = node.body[-1]
        if not isinstance(last, (ast.Raise, ast.Return, ast.Continue, ast.Break)):
            return
        text = self._text(node.test)
        self._add(node.test, "guard", "False")
        self._add(node.test, "guard", f"not ({text})")


def enumerate_mutants(module: str, source: bytes) -> list[Mutant]:
    return _Enumerator(module, source).run()


# ---------------------------------------------------------------------------------------------- coverage

# A pytest plugin (``-p mutate`` with this folder on PYTHONPATH; active when MLA_FA3_MUTATE_TRACE names a file):
# which lines of mla_fa3 each test runs, which tests start subprocesses (the Triton interpreter runs), and how
# long each test took. A mutant then runs only the tests that execute its lines.
_TRACE = None


class _Tracer:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.current = "<import>"
        self.lines: dict[str, set] = {}
        self.spawners: set[str] = set()
        self.seconds: dict[str, float] = {}
        self.failed: list[str] = []

    def global_trace(self, frame, event, arg):
        if frame.f_code.co_filename.startswith(self.prefix):
            self.lines.setdefault(self.current, set()).add((frame.f_code.co_filename, frame.f_lineno))
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.lines.setdefault(self.current, set()).add((frame.f_code.co_filename, frame.f_lineno))
        return self.local_trace


def pytest_configure(config):
    global _TRACE
    if not os.environ.get("MLA_FA3_MUTATE_TRACE"):
        return
    import threading
    _TRACE = _Tracer(os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "mla_fa3") + os.sep)
    popen_init = subprocess.Popen.__init__

    def spy(self, *a, **k):
        _TRACE.spawners.add(_TRACE.current)
        popen_init(self, *a, **k)

    subprocess.Popen.__init__ = spy
    sys.settrace(_TRACE.global_trace)
    threading.settrace(_TRACE.global_trace)


def pytest_runtest_logstart(nodeid, location):
    if _TRACE is not None:
        _TRACE.current = nodeid


def pytest_runtest_logreport(report):
    if _TRACE is not None:
        _TRACE.seconds[report.nodeid] = _TRACE.seconds.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            _TRACE.failed.append(report.nodeid)


def pytest_runtest_logfinish(nodeid, location):
    if _TRACE is not None:
        _TRACE.current = "<between>"


def pytest_sessionfinish(session, exitstatus):
    if _TRACE is None:
        return
    sys.settrace(None)
    root = os.environ["PYTHONPATH"].split(os.pathsep)[0] + os.sep
    lines = {}
    for test, seen in _TRACE.lines.items():
        per = lines.setdefault(test, {})
        for f, ln in seen:
            per.setdefault(f[len(root):], []).append(ln)
    data = {"lines": lines, "spawners": sorted(_TRACE.spawners), "seconds": _TRACE.seconds,
            "failed": _TRACE.failed}
    Path(os.environ["MLA_FA3_MUTATE_TRACE"]).write_text(json.dumps(data))


class Coverage:
    """Which tests of a package's subset to run for a mutant."""

    def __init__(self, data: dict):
        self.seconds = data["seconds"]
        self.spawners = [t for t in data["spawners"] if t in self.seconds]
        self.by_line: dict[tuple[str, int], list[str]] = {}
        self.by_module: dict[str, list[str]] = {}
        for test, per in data["lines"].items():
            if test not in self.seconds:
                continue  # lines run at import or between tests
            for mod, lns in per.items():
                self.by_module.setdefault(mod, []).append(test)
                for ln in lns:
                    self.by_line.setdefault((mod, ln), []).append(test)
        self.order = {t: i for i, t in enumerate(self.seconds)}

    def select(self, m: Mutant, end_line: int) -> tuple[list[str], str]:
        """(tests, why): those running a line of the mutant; else those touching its module, plus the tests
        that start subprocesses (the Triton interpreter runs, which no in-process trace sees)."""
        tests = set()
        for ln in range(m.line, end_line + 1):
            tests.update(self.by_line.get((m.module, ln), ()))
        if tests:
            return sorted(tests, key=self.order.get), "line"
        tests = set(self.by_module.get(m.module, ())) | set(self.spawners)
        return sorted(tests, key=self.order.get), "module+subprocess"

    def budget(self, tests: list[str]) -> float:
        return sum(self.seconds.get(t, 1.0) for t in tests)


def trace_package(work: Path, pkg: str, out: Path, timeout: float) -> Coverage:
    """Run the package's subset once, traced, on the unmutated copy (the baseline: it must pass)."""
    path = out / f"trace_{pkg}.json"
    env = test_env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(Path(__file__).resolve().parent)])
    env["MLA_FA3_MUTATE_TRACE"] = str(path)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutate",
                          "-m", "not gpu and not long", *package_tests(work, pkg)], cwd=work, env=env,
                         capture_output=True, text=True, timeout=timeout)
    tail = (res.stdout + res.stderr).strip().splitlines()
    print(f"[baseline] {pkg}: exit {res.returncode} in {time.monotonic() - t0:.0f}s traced "
          f"({tail[-1] if tail else ''})", flush=True)
    data = json.loads(path.read_text())
    if res.returncode != 0 or data["failed"]:
        sys.exit(f"baseline of {pkg} does not pass on the unmutated copy: {data['failed'][:5]}\n"
                 + "\n".join(tail[-30:]))
    return Coverage(data)


# ---------------------------------------------------------------------------------------------- the pass

def package_modules(root: Path, name: str) -> list[str]:
    spec = PACKAGES[name]
    out = []
    for pattern in spec["modules"]:
        for p in sorted(root.glob(pattern)):
            rel = p.relative_to(root).as_posix()
            if rel in spec.get("exclude", []) or "/bench/" in rel:
                continue
            out.append(rel)
    return out


def package_tests(root: Path, name: str) -> list[str]:
    return [f"tests/{t}" for t in PACKAGES[name]["tests"] if (root / "tests" / t).exists()]


def make_copy(work: Path, rev: str, extra: list[str] = ()) -> None:
    """Copy the repository at ``rev`` (a commit; ``WORKTREE``: the working tree's files, tracked and
    untracked-not-ignored) into ``work``."""
    if work.resolve() == REPO or REPO in work.resolve().parents:
        sys.exit(f"--work must lie outside the repository ({REPO})")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if rev != "WORKTREE":
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
        files = []
    else:
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                               check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = REPO / f.decode()
        if not src.is_file():
            continue
        dst = work / f.decode()
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    for f in extra:  # working-tree files laid over the copy (new tests not yet committed)
        dst = work / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst)
    sglang = REPO / ".sglang-cpu"   # the tests' SGLang CPU import set: read only, so a link is enough
    if sglang.exists():
        (work / ".sglang-cpu").symlink_to(sglang)


def test_env(work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    env.pop("TRITON_INTERPRET", None)
    return env


def check_import_path(work: Path) -> None:
    res = subprocess.run([sys.executable, "-c", "import mla_fa3; print(mla_fa3.__file__)"], cwd=work,
                         env=test_env(work), capture_output=True, text=True, check=True)
    got = Path(res.stdout.strip()).resolve()
    if work.resolve() not in got.parents:
        sys.exit(f"mla_fa3 imports from {got}, not from the copy {work}: refusing to mutate")
    print(f"mla_fa3 imports from the copy: {got}", flush=True)


def run_tests(work: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` (files or node ids) with -x; killed on a failure or an error at collection (pytest exit
    1, 2 or 3), error when pytest found nothing to run (4, 5: a selection problem, not a verdict)."""
    if len(tests) > 400:  # a long list of node ids: run their files instead (more tests, same verdict)
        tests = list(dict.fromkeys(t.split("::")[0] for t in tests))
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_FLAGS, *tests], cwd=work,
                             env=test_env(work), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    text = res.stdout + res.stderr
    tail = text.strip().splitlines()
    last = tail[-1] if tail else ""
    status = {0: "survived", 1: "killed", 2: "killed", 3: "killed"}.get(res.returncode, "error")
    if status == "error" and ("found no collectors" in text or "ERROR collecting" in text):
        status = "killed"  # a test module no longer imports: the mutant broke the library at import
    elif status == "error" and any("::" in t for t in tests):
        # a node id that the mutant made vanish (a parametrization read from the library): run the files
        files = list(dict.fromkeys(t.split("::")[0] for t in tests))
        status, secs, last = run_tests(work, files, timeout)
        return status, time.monotonic() - t0, last
    return status, time.monotonic() - t0, last


FIELDS = ["package", "module", "id", "line", "kind", "before", "after", "status", "seconds", "tests", "selected",
          "equivalent", "last_line"]


def sample(mutants: list[Mutant], n: int, seed: int, module: str) -> list[Mutant]:
    if n <= 0 or len(mutants) <= n:
        return list(mutants)
    rng = random.Random(f"{seed}:{module}")
    picked = rng.sample(range(len(mutants)), n)
    return [mutants[i] for i in sorted(picked)]


def equivalent_reason(m: dict) -> str:
    before, after, reason = EQUIVALENT.get(m["id"], ("", "", ""))
    return reason if (before, after) == (m["before"], m["after"]) else ""


def run_pass(args) -> None:
    work = Path(args.work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    make_copy(work, args.rev, args.add)
    check_import_path(work)
    csv_path = out / "mutants.csv"
    done = set()
    if args.resume and csv_path.exists():
        with open(csv_path) as f:
            done = {r["id"] for r in csv.DictReader(f)}
    else:
        with open(csv_path, "w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()
    t_start = time.monotonic()
    with open(out / "enumerated.csv", "w", newline="") as f:
        csv.writer(f).writerow(["module", "enumerated", "sampled"])
    for pkg in args.packages:
        cov = trace_package(work, pkg, out, timeout=args.baseline_timeout)
        if args.baseline_only:
            continue
        plan = []
        for mod in package_modules(work, pkg):
            if args.modules and mod not in args.modules:
                continue
            allm = enumerate_mutants(mod, (work / mod).read_bytes())
            picked = sample(allm, args.per_module, args.seed, mod)
            with open(out / "enumerated.csv", "a", newline="") as f:
                csv.writer(f).writerow([mod, len(allm), len(picked)])
            plan += [m for m in picked if m.ident not in done]
        print(f"{pkg}: {len(plan)} mutants to run", flush=True)
        for i, m in enumerate(plan, 1):
            tests, why = cov.select(m, m.end_line)
            row = run_one(work, pkg, m, tests, max(args.timeout, 2.0 * cov.budget(tests) + 30), why)
            with open(csv_path, "a", newline="") as f:
                csv.DictWriter(f, FIELDS).writerow(row)
            el = time.monotonic() - t_start
            print(f"[{pkg} {i}/{len(plan)} {el / 60:.1f} min] {row['status']:8s} {m.ident}  {m.before[:50]!r} -> "
                  f"{m.after[:50]!r} ({row['seconds']}s, {len(tests)} tests by {why})", flush=True)
    print(f"pass done in {(time.monotonic() - t_start) / 60:.1f} min", flush=True)
    summarize(csv_path, out)


def run_one(work: Path, pkg: str, m: Mutant, tests: list[str], limit: float, why: str = "files") -> dict:
    path = work / m.module
    original = path.read_bytes()
    mutated = m.apply(original)
    row = {"package": pkg, "module": m.module, "id": m.ident, "line": m.line, "kind": m.kind,
           "before": m.before, "after": m.after, "tests": len(tests), "selected": why}
    if not tests:
        row.update(status="survived", seconds=0, last_line="no test of the subset runs this code")
        row["equivalent"] = equivalent_reason(row)
        return row
    try:
        compile(mutated, m.module, "exec")
    except SyntaxError as exc:
        row.update(status="invalid", seconds=0, equivalent="", last_line=f"SyntaxError: {exc}")
        return row
    try:
        path.write_bytes(mutated)
        status, secs, last = run_tests(work, tests, limit)
    finally:
        path.write_bytes(original)
    row.update(status=status, seconds=f"{secs:.1f}", last_line=last[:200])
    row["equivalent"] = equivalent_reason(row) if status == "survived" else ""
    return row


def summarize(csv_path: Path, out: Path) -> None:
    """OUT/summary.md from the pass's rows; a survivor that OUT/rerun.csv (``--rerun`` with the new tests)
    shows killed counts as killed, in the column ``new``."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    again: dict[str, list[dict]] = {}
    for rerun_path in sorted(out.glob("rerun*.csv")):
        with open(rerun_path) as f:
            for r in csv.DictReader(f):
                again.setdefault(r["id"], []).append(r)
    for r in rows:
        runs = again.get(r["id"], [])
        dead = [a for a in runs if a["status"] in ("killed", "timeout")]
        if any(a["status"] == "gone" for a in runs):  # the code was rewritten since the pass
            r["status"] = "gone"
        elif r["status"] in ("survived", "error") and dead:
            # killed by package tests the pass did not run (killed), or only by the tests written against it (new)
            r["status"] = "killed" if any(a.get("selected") != "new tests" for a in dead) else "new"
        elif r["status"] == "error" and runs:
            r["status"] = runs[-1]["status"]
    enum_path = out / "enumerated.csv"
    enumerated = {}
    if enum_path.exists():
        with open(enum_path) as f:
            enumerated = {r["module"]: int(r["enumerated"]) for r in csv.DictReader(f)}
    lines = [f"Skipped: {SKIPPED}.", "",
             "| package | modules | enumerated | ran | killed | timeout | new | survived | equivalent | CUDA only | score |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    tot = dict(mods=0, en=0, ran=0, k=0, t=0, n=0, s=0, e=0, c=0)
    for pkg in PACKAGES:
        pr = [r for r in rows if r["package"] == pkg and r["status"] not in ("invalid", "error", "gone")]
        if not pr:
            continue
        for r in pr:
            if r["status"] == "survived":
                r["equivalent"] = equivalent_reason(r)
        mods = sorted({r["module"] for r in pr})
        en = sum(enumerated.get(m, 0) for m in mods)
        k = sum(r["status"] == "killed" for r in pr)
        t = sum(r["status"] == "timeout" for r in pr)
        n = sum(r["status"] == "new" for r in pr)
        cuda = sum(r["status"] == "survived" and r["equivalent"].startswith("CUDA only") for r in pr)
        e = sum(r["status"] == "survived" and bool(r["equivalent"]) for r in pr) - cuda
        s = sum(r["status"] == "survived" for r in pr) - e - cuda
        ne = len(pr) - e - cuda
        score = f"{(k + t + n) / ne:.0%}" if ne else "-"
        lines.append(f"| {pkg} | {len(mods)} | {en} | {len(pr)} | {k} | {t} | {n} | {s} | {e} | {cuda} | "
                     f"{k + t + n}/{ne} = {score} |")
        for key, v in zip(tot, (len(mods), en, len(pr), k, t, n, s, e, cuda)):
            tot[key] += v
    ne = tot["ran"] - tot["e"] - tot["c"]
    kill = tot["k"] + tot["t"] + tot["n"]
    lines.append(f"| all | {tot['mods']} | {tot['en']} | {tot['ran']} | {tot['k']} | {tot['t']} | {tot['n']} | "
                 f"{tot['s']} | {tot['e']} | {tot['c']} | {kill}/{ne} = {kill / max(ne, 1):.0%} |")
    gone = [r["id"] for r in rows if r["status"] == "gone"]
    if gone:
        lines += ["", f"Not counted: {len(gone)} mutants whose code was rewritten after the pass: " + ", ".join(gone)]
    errors = [r["id"] for r in rows if r["status"] == "error"]
    if errors:
        lines += ["", f"Not counted: {len(errors)} mutants whose run found no tests (rerun them on whole files): "
                  + ", ".join(errors)]
    lines += ["", "score = (killed + timeout + new) / (ran - equivalent - CUDA only). new: survivors of the pass that",
              "the tests written against them (tests/test_mutants_*.py) kill; CUDA only: code the CPU cannot reach",
              "(not equivalent; the GPU tests run it); survived: the survivors left, not judged equivalent.",
              "", "Survivors not judged equivalent:"]
    for r in rows:
        if r["status"] == "survived" and not r["equivalent"]:
            lines.append(f"- {r['id']}: {r['before']!r} -> {r['after']!r}")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


def rerun(args) -> None:
    """Run again the rows of a CSV (e.g. the survivors, after new tests were written)."""
    work = Path(args.work)
    make_copy(work, args.rev, args.add)
    check_import_path(work)
    with open(args.rerun) as f:
        rows = [r for r in csv.DictReader(f) if (not args.status or r["status"] == args.status)
                and r["package"] in args.packages]
    out_rows = []
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "rerun.csv", "w", newline="") as f:
            csv.DictWriter(f, FIELDS).writeheader()

    def record(row: dict) -> None:
        out_rows.append(row)
        if out is not None:
            with open(out / "rerun.csv", "a", newline="") as f:
                csv.DictWriter(f, FIELDS, extrasaction="ignore").writerow(row)

    for r in rows:
        m = find(work, r["id"], r["before"], r["after"], args.pass_rev)
        if m is None:
            print(f"gone      {r['id']} (the module changed)", flush=True)
            record(dict(r, status="gone", seconds=0, tests=0, selected="files", equivalent="",
                        last_line="the mutated code is no longer in the module"))
            continue
        if args.tests == ["mutants"]:  # only the package's tests written against the survivors
            tests = [f"tests/test_mutants_{r['package']}.py"]
        elif args.tests:
            tests = [f"tests/{t}" for t in args.tests]
        else:
            tests = package_tests(work, r["package"])
        row = run_one(work, r["package"], m, tests, args.timeout * 4)
        if m.ident != r["id"]:
            row["last_line"] = f"(now at {m.ident}) " + row["last_line"]
        row["id"] = r["id"]  # the pass's id, so the summary can match it (the code may have moved since)
        row["selected"] = "new tests" if args.tests == ["mutants"] else "files"
        record(row)
        print(f"{row['status']:8s}  {m.ident}  {m.before[:60]!r} -> {m.after[:60]!r} ({row['seconds']}s)",
              flush=True)


def find(root: Path, ident: str, before: str | None = None, after: str | None = None,
         pass_rev: str | None = None) -> Mutant | None:
    """The mutant named ``ident``. With ``pass_rev`` (the commit the pass ran on), the same change on a line of
    the same text wherever the code moved since (nearest such line); None when that line is gone."""
    module, line, col, kind, index = ident.rsplit(":", 4)
    if not (root / module).is_file():
        return None  # the module was removed or split since
    src = (root / module).read_bytes()
    allm = enumerate_mutants(module, src)
    if pass_rev is None:
        for m in allm:
            if m.ident == ident and (before is None or (m.before, m.after) == (before, after)):
                return m
        return None
    old = subprocess.run(["git", "show", f"{pass_rev}:{module}"], cwd=REPO, capture_output=True).stdout
    old_line = old.decode().splitlines()[int(line) - 1].strip() if old else None
    lines = src.decode().splitlines()
    same = [m for m in allm if (m.kind, m.before, m.after, m.col) == (kind, before, after, int(col))
            and lines[m.line - 1].strip() == old_line]
    return min(same, key=lambda m: abs(m.line - int(line))) if same else None


def show(ident: str) -> None:
    m = find(REPO, ident)
    if m is None:
        sys.exit(f"no mutant {ident}")
    src = (REPO / m.module).read_bytes()
    new = m.apply(src).decode().splitlines()
    old = src.decode().splitlines()
    print(f"{m.ident}\n  - {old[m.line - 1].strip()}\n  + {new[m.line - 1].strip()}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--packages", type=lambda s: s.split(","), default=list(PACKAGES),
                   help=f"comma-separated, of: {', '.join(PACKAGES)} (default: all)")
    p.add_argument("--modules", type=lambda s: s.split(","), default=None, help="only these module paths")
    p.add_argument("--per-module", type=int, default=5, help="mutants sampled per module; 0 = all (default 5)")
    p.add_argument("--seed", type=int, default=43)
    p.add_argument("--timeout", type=float, default=60, help="least per-mutant limit in seconds (default 60)")
    p.add_argument("--baseline-timeout", type=float, default=1200)
    p.add_argument("--work", default="/tmp/mla_fa3_mutants", help="scratch copy of the repository (rebuilt)")
    p.add_argument("--rev", default="HEAD",
                   help="the commit to copy (default HEAD); WORKTREE copies the working tree's files")
    p.add_argument("--out", default="/tmp/mla_fa3_mutants_out", help="folder for mutants.csv and summary.md")
    p.add_argument("--resume", action="store_true", help="keep the rows already in OUT/mutants.csv")
    p.add_argument("--baseline-only", action="store_true", help="time each package's test subset and stop")
    p.add_argument("--list", action="store_true", help="count the mutants per module and stop")
    p.add_argument("--show", metavar="ID", help="print one mutant and stop")
    p.add_argument("--summary", action="store_true", help="rewrite OUT/summary.md from OUT/mutants.csv")
    p.add_argument("--rerun", metavar="CSV", help="run again the rows of CSV (with --status to filter)")
    p.add_argument("--add", action="append", default=[], metavar="FILE",
                   help="a working-tree file to lay over the copy (repeatable), e.g. a new test file")
    p.add_argument("--tests", type=lambda s: s.split(","), default=None,
                   help="with --rerun: run these test files (names in tests/) instead of the package's")
    p.add_argument("--pass-rev", default=None, metavar="COMMIT",
                   help="with --rerun: the commit the pass ran on, to find each mutant's line where the code moved")
    p.add_argument("--status", default="", help="with --rerun: only rows of this status")
    args = p.parse_args(argv)
    for pkg in args.packages:
        if pkg not in PACKAGES:
            p.error(f"unknown package {pkg!r}; known: {', '.join(PACKAGES)}")
    if args.show:
        return show(args.show)
    if args.summary:
        return summarize(Path(args.out) / "mutants.csv", Path(args.out))
    if args.rerun:
        return rerun(args)
    if args.list:
        total = 0
        for pkg in args.packages:
            for mod in package_modules(REPO, pkg):
                n = len(enumerate_mutants(mod, (REPO / mod).read_bytes()))
                total += n
                print(f"{pkg:12s} {mod:50s} {n}")
        print(f"total {total}")
        return
    run_pass(args)


if __name__ == "__main__":
    main()
