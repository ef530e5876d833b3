#!/usr/bin/env python3
"""Mutation testing, bounded: does the test suite notice a plausible one-line bug in the core modules?

    .venv/bin/python tools/mutate.py                      # every module below (see README.md, Tests)
    .venv/bin/python tools/mutate.py --module layout      # one module (a name from TARGETS)
    .venv/bin/python tools/mutate.py --limit 20 -j 2      # at most 20 mutants per module, 2 at a time
    .venv/bin/python tools/mutate.py --list               # the mutants, without running anything

Each mutant changes one line of one module: a comparison flipped (`<` to `<=`, `==` to `!=`, ...), an integer
constant off by one, an operand of `and`/`or` dropped or the operator swapped, a `not` dropped. The module's
test files then run in a fresh interpreter (`pytest -x`); a failure or a timeout kills the mutant.

The working tree is never written: the mutated source goes to a temporary folder, and the child interpreter
imports it in place of the real module through a meta-path finder installed before anything is imported.
Other people's test runs on the same checkout therefore never see a mutant.

Mutants that behave exactly like the original (equivalent mutants) are listed in EQUIVALENT with the reason;
the score is killed / (mutants - equivalent). Lines that are only logging are not mutated.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    path: str  # relative to the repository root
    module: str  # the name it is imported by
    tests: tuple[str, ...]  # the test files that must kill its mutants


# Fast, in-process test files only: a runner subprocess would import the unmutated module.
TARGETS = {
    "layout": Target("ollama_engine/llm/layout.py", "ollama_engine.llm.layout",
                     ("tests/test_layout.py", "tests/test_load_loop.py")),
    "memory": Target("ollama_engine/ml/memory.py", "ollama_engine.ml.memory",
                     ("tests/test_memory.py", "tests/test_layout.py", "tests/test_load_loop.py")),
    "load": Target("ollama_engine/llm/load.py", "ollama_engine.llm.load", ("tests/test_load_loop.py",)),
    "wire": Target("server/wire.py", "ollama_engine.server.wire", ("tests/test_runner_wire.py",)),
    "causal": Target("kvcache/causal.py", "ollama_engine.kvcache.causal", ("tests/test_kvcache.py",)),
    "sampler": Target("ollama_engine/sample/sampler.py", "ollama_engine.sample.sampler", ("tests/test_sample.py",)),
    "transforms": Target("ollama_engine/sample/transforms.py", "ollama_engine.sample.transforms",
                         ("tests/test_sample.py",)),
    "logprobs": Target("ollama_engine/sample/logprobs.py", "ollama_engine.sample.logprobs", ("tests/test_sample.py",)),
    "stop": Target("ollama_engine/runner/text.py", "ollama_engine.runner.text", ("tests/test_runner_text.py",)),
}

# (module, the original line stripped, the mutated line stripped) -> why no test can tell them apart.
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("causal", "for i in range(1, len(sequences) + 1):", "for i in range(0, len(sequences) + 1):"):
        "at i = 0 the first sequence equals itself: no run ends",
    ("causal", "if len(runs) > 1 and len({seq for seq, _, _ in runs}) != len(runs):",
     "if len(runs) > 0 and len({seq for seq, _, _ in runs}) != len(runs):"):
        "one run always has a unique sequence",
    ("causal", "if len(runs) > 1 and len({seq for seq, _, _ in runs}) != len(runs):",
     "if len(runs) >= 1 and len({seq for seq, _, _ in runs}) != len(runs):"):
        "one run always has a unique sequence",
    ("causal", "if len(runs) > 1 and len({seq for seq, _, _ in runs}) != len(runs):",
     "if len({seq for seq, _, _ in runs}) != len(runs):"):
        "one run always has a unique sequence",
    ("causal", "if len(runs) > 1 and len({seq for seq, _, _ in runs}) != len(runs):",
     "if len(runs) > 2 and len({seq for seq, _, _ in runs}) != len(runs):"):
        "two runs are of different sequences (adjacent runs differ by construction)",
    ("causal", "first = int(positions[0]) if count == 1 else int(positions.min())",
     "first = int(positions[0]) if count == 0 else int(positions.min())"):
        "for one position, min() is that position",
    ("causal", "first = int(positions[0]) if count == 1 else int(positions.min())",
     "first = int(positions[0]) if count == 2 else int(positions.min())"):
        "for one position, min() is that position; a batch's positions for a sequence increase",
    ("causal", "first = int(positions[0]) if count == 1 else int(positions.min())",
     "first = int(positions[0]) if count != 1 else int(positions.min())"):
        "a batch's positions for a sequence increase, so the first is the smallest",
    ("causal", "if count == 1:  # a decode step: one pass over the region, scalar stores",
     "if count == 0:  # a decode step: one pass over the region, scalar stores"):
        "the general path places one token in the same cell (a fast path only)",
    ("causal", "self._layer = 0", "self._layer = 1"):
        "every put/get follows a set_layer",
    ("causal", "self._pos[dst] = np.where(copied, self._pos[src], 0)",
     "self._pos[dst] = np.where(copied, self._pos[src], 1)"):
        "the position of a cell not in use is never read",
    ("causal", "rotation, _ = self.rotations(ctx, keys.ne[0], 0)", "rotation, _ = self.rotations(ctx, keys.ne[0], 1)"):
        "the value rotation is not used by a shift",
    ("causal", "stop = int(cells[j - 1]) + 1", "stop = int(cells[j - 1]) + 2"):
        "the extra cell is shifted by a delta of 0",
    ("layout", "num_gpu: int = -1,", "num_gpu: int = -2,"):
        "every use asks only whether num_gpu is negative",
    ("layout", "free = gpu.free_memory - reserved if gpu.free_memory > reserved else 0",
     "free = gpu.free_memory - reserved if gpu.free_memory >= reserved else 0"):
        "at equality both give 0",
    ("layout", "if requested_layers >= 0 or sched_spread:", "if requested_layers > 0 or sched_spread:"):
        "with 0 layers requested nothing is placed, integrated GPU or not",
    ("layout", "if requested_layers >= 0 or sched_spread:", "if requested_layers >= 1 or sched_spread:"):
        "with 0 layers requested nothing is placed, integrated GPU or not",
    ("layout", "high = np.float32(1000 if requested_layers >= 0 and force_request else 1)",
     "high = np.float32(1000 if requested_layers > 0 and force_request else 1)"):
        "with 0 layers requested nothing is placed, whatever the capacity",
    ("layout", "high = np.float32(1000 if requested_layers >= 0 and force_request else 1)",
     "high = np.float32(1000 if requested_layers >= 1 and force_request else 1)"):
        "with 0 layers requested nothing is placed, whatever the capacity",
    ("layout", "high = np.float32(1000 if requested_layers >= 0 and force_request else 1)",
     "high = np.float32(1001 if requested_layers >= 0 and force_request else 1)"):
        "any bound far above the converged capacity ends the search at the same layout",
    ("layout", "high = np.float32(1000 if requested_layers >= 0 and force_request else 1)",
     "high = np.float32(999 if requested_layers >= 0 and force_request else 1)"):
        "any bound far above the converged capacity ends the search at the same layout",
    ("layout", "while high - low > _SEARCH_TOLERANCE:", "while high - low >= _SEARCH_TOLERANCE:"):
        "halving from 1 or 1000 never makes high - low exactly float32(1e-6), which is not a short dyadic",
    ("memory", "widths = [max(len(row[col]) for row in rows) for col in range(2)]",
     "widths = [max(len(row[col]) for row in rows) for col in range(3)]"):
        "the width of the last column is never used",
    ("load", "num_gpu: int = -1  # layers to offload; -1: as many as fit",
     "num_gpu: int = -2  # layers to offload; -1: as many as fit"):
        "every use asks only whether num_gpu is negative",
    ("load", "for layers in range(candidate.sum() - 1, gpu_layers.sum() - 1, -1):",
     "for layers in range(candidate.sum() - 1, gpu_layers.sum() - 2, -1):"):
        "the last count tried is the current one, whose report (just seen) has room for more: it is accepted",
    ("load", "if num_gpu < 0 and candidate.sum() - gpu_layers.sum() > 1:",
     "if candidate.sum() - gpu_layers.sum() > 1:"):
        "with num_gpu set every plan has exactly min(num_gpu, layers) layers, so the difference is 0",
    ("load", "if num_gpu < 0 and candidate.sum() - gpu_layers.sum() > 1:",
     "if num_gpu < 1 and candidate.sum() - gpu_layers.sum() > 1:"):
        "with num_gpu = 0 every plan is empty, so the difference is 0",
    ("load", "if num_gpu < 0 and candidate.sum() - gpu_layers.sum() > 1:",
     "if num_gpu <= 0 and candidate.sum() - gpu_layers.sum() > 1:"):
        "with num_gpu = 0 every plan is empty, so the difference is 0",
    ("load", "if self.backoff > 1:", "if self.backoff >= 1:"):
        "the float32 sum goes from 0.90000004 to 1.0000001: it is never exactly 1",
    ("stop", "for back in range(1, min(4, len(text)) + 1):", "for back in range(1, min(3, len(text)) + 1):"):
        "a lead byte 4 bytes back ends a complete character: the answer is False either way",
    ("stop", "for back in range(1, min(4, len(text)) + 1):", "for back in range(1, min(5, len(text)) + 1):"):
        "any byte 5 back is the start of a complete character or invalid text: False either way",
    ("transforms", "if k <= 0 or k >= n:", "if k <= 0 or k > n:"):
        "with k == n the partition keeps every id, and both paths sort them by logit, ties by id",
    ("wire", 'return np.format_float_scientific(number, unique=True, trim="-", exp_digits=2).replace("e-0", "e-")',
     'return np.format_float_scientific(number, unique=True, trim="-", exp_digits=1).replace("e-0", "e-")'):
        "Go drops the leading zero of a negative exponent anyway, and positive exponents here are >= 21",
    ("wire", "if kind is float and isinstance(value, int) and not isinstance(value, bool):",
     "if kind is float and isinstance(value, int) and isinstance(value, bool):"):
        "no field is decoded as a float through _typed (the sampler options decode themselves)",
    ("wire", "if kind is float and isinstance(value, int) and not isinstance(value, bool):",
     "if kind is float and isinstance(value, int):"):
        "no field is decoded as a float through _typed (the sampler options decode themselves)",
    ("wire", "if kind is float and isinstance(value, int) and not isinstance(value, bool):",
     "if kind is float and not isinstance(value, bool):"):
        "no field is decoded as a float through _typed (the sampler options decode themselves)",
}


@dataclass(frozen=True)
class Mutant:
    target: str
    line: int  # 1-based
    original: str  # the whole line
    mutated: str  # the whole line, changed

    def key(self) -> tuple[str, str, str]:
        return (self.target, self.original.strip(), self.mutated.strip())

    def describe(self) -> str:
        return f"{TARGETS[self.target].path}:{self.line}: {self.original.strip()}  ->  {self.mutated.strip()}"


# ---------------------------------------------------------------- finding mutants

_FLIPS = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
}
_LOGGERS = {"log", "logger", "logging", "warnings"}


def _is_logging(node: ast.AST) -> bool:
    """A call such as log.info(...): changing its arguments changes only what is logged."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in _LOGGERS)


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes not to mutate: inside logging calls, annotations and docstrings."""
    skipped: set[int] = set()

    def skip(node: ast.AST) -> None:
        skipped.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if _is_logging(node):
            skip(node)
        if isinstance(node, (ast.AnnAssign, ast.arg)) and node.annotation is not None:
            skip(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            skip(node.returns)
        if isinstance(node, ast.If) and not node.orelse and all(
                isinstance(stmt, ast.Expr) and _is_logging(stmt.value) for stmt in node.body):
            skip(node.test)  # whether to log
    return skipped


def _segment(lines: list[str], node: ast.AST) -> tuple[int, int, int] | None:
    """(line index, start column, end column) of a node that sits on one line."""
    if node.lineno != node.end_lineno:
        return None
    return node.lineno - 1, node.col_offset, node.end_col_offset


def _utf8_col(line: str, col: int) -> int:
    """ast columns count UTF-8 bytes; str indexes count characters."""
    return len(line.encode()[:col].decode())


def _with_parentheses(line: str, start: int, end: int) -> tuple[int, int]:
    """Widen [start, end) over the parentheses that enclose exactly that operand."""
    while True:
        before, after = line[:start].rstrip(), line[end:].lstrip()
        if not (before.endswith("(") and after.startswith(")")):
            return start, end
        inner = line[start:end]
        if inner.count("(") != inner.count(")"):
            return start, end
        if len(before) > 1 and (before[-2].isalnum() or before[-2] in "_)]"):
            return start, end  # a call's or a subscript's parentheses, not a group
        start, end = len(before) - 1, len(line) - len(after) + 1


def _add_text(found: dict[tuple[int, str], Mutant], target: str, index: int, line: str, mutated: str) -> None:
    if mutated != line and "no mutate" not in line:
        found.setdefault((index, mutated), Mutant(target, index + 1, line, mutated))


def find_mutants(target: str) -> list[Mutant]:
    path = ROOT / TARGETS[target].path
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    skipped = _skipped_nodes(tree)
    found: dict[tuple[int, str], Mutant] = {}

    def add(index: int, start: int, end: int, replacement: str) -> None:
        line = lines[index]
        start, end = _utf8_col(line, start), _utf8_col(line, end)
        mutated = line[:start] + replacement + line[end:]
        if mutated != line and "no mutate" not in line:
            found.setdefault((index, mutated), Mutant(target, index + 1, line, mutated))

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
                if type(op) not in _FLIPS or left.end_lineno != right.lineno:
                    continue
                index = left.end_lineno - 1
                line = lines[index]
                lo, hi = _utf8_col(line, left.end_col_offset), _utf8_col(line, right.col_offset)
                gap = line[lo:hi]  # the operator, with spaces and perhaps parentheses around it
                old, new = _FLIPS[type(op)]
                if " ".join(gap.replace("(", " ").replace(")", " ").split()) != old:
                    continue
                position = gap.index(old)
                mutated = line[:lo] + gap[:position] + new + gap[position + len(old):] + line[hi:]
                found.setdefault((index, mutated), Mutant(target, index + 1, line, mutated))
        elif isinstance(node, ast.BoolOp) and _segment(lines, node):
            index = node.lineno - 1
            line = lines[index]
            if any(v.lineno != node.lineno or v.end_lineno != node.lineno for v in node.values):
                continue
            spans = [_with_parentheses(line, _utf8_col(line, v.col_offset), _utf8_col(line, v.end_col_offset))
                     for v in node.values]
            other = " or " if isinstance(node.op, ast.And) else " and "
            swapped = line[:spans[0][1]] + "".join(
                other + line[start:end] for start, end in spans[1:]) + line[spans[-1][1]:]
            _add_text(found, target, index, line, swapped)
            for i, (start, end) in enumerate(spans):
                if i + 1 < len(spans):
                    dropped = line[:start] + line[spans[i + 1][0]:]
                else:
                    dropped = line[:spans[i - 1][1]] + line[end:]
                _add_text(found, target, index, line, dropped)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and (where := _segment(lines, node)):
            index, start, end = where
            operand = lines[index][_utf8_col(lines[index], node.operand.col_offset):
                                   _utf8_col(lines[index], node.operand.end_col_offset)]
            add(index, start, end, operand)
        elif (isinstance(node, ast.Constant) and type(node.value) is int and (where := _segment(lines, node))):
            index, start, end = where
            if lines[index][_utf8_col(lines[index], start):_utf8_col(lines[index], end)] != repr(node.value):
                continue  # written as hex, with underscores, ...: keep the text honest
            add(index, start, end, str(node.value + 1))
            if node.value > 0:
                add(index, start, end, str(node.value - 1))
    return sorted((m for m in found.values() if _compiles(lines, m)), key=lambda m: (m.line, m.mutated))


def _compiles(lines: list[str], mutant: Mutant) -> bool:
    changed = [*lines[: mutant.line - 1], mutant.mutated, *lines[mutant.line :]]
    try:
        compile("\n".join(changed), "<mutant>", "exec")
    except SyntaxError:
        return False
    return True


# ---------------------------------------------------------------- running them

# Runs in the child: import `module` from `path`, then pytest. Nothing else has been imported yet.
_CHILD = textwrap.dedent("""
    import importlib.abc, importlib.util, sys

    module, path = sys.argv[1], sys.argv[2]

    class Mutated(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, target_path=None, target=None):
            return importlib.util.spec_from_file_location(module, path) if fullname == module else None

    sys.meta_path.insert(0, Mutated())
    loaded = importlib.import_module(module)
    assert loaded.__file__ == path, (loaded.__file__, path)
    import pytest
    sys.exit(pytest.main(sys.argv[3:]))
""")


def run_tests(target: Target, source_path: Path, timeout: float) -> tuple[str, float]:
    """('passed' | 'failed' | 'timeout', seconds) of the target's tests with `source_path` as the module."""
    command = [sys.executable, "-c", _CHILD, target.module, str(source_path), "-x", "-q", "-p", "no:cacheprovider",
               "-p", "no:randomly", *target.tests]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    return ("passed" if result.returncode == 0 else "failed"), time.monotonic() - start


def run_mutant(mutant: Mutant, folder: Path, timeout: float) -> tuple[Mutant, str]:
    target = TARGETS[mutant.target]
    lines = (ROOT / target.path).read_text().splitlines(keepends=True)
    ending = lines[mutant.line - 1][len(lines[mutant.line - 1].rstrip("\r\n")):]
    lines[mutant.line - 1] = mutant.mutated + ending
    path = folder / f"{mutant.target}-{mutant.line}-{abs(hash(mutant.mutated))}" / Path(target.path).name
    path.parent.mkdir()
    path.write_text("".join(lines))
    outcome, _ = run_tests(target, path, timeout)
    return mutant, {"passed": "survived", "failed": "killed", "timeout": "killed (timeout)"}[outcome]


def spread(mutants: list[Mutant], limit: int | None) -> list[Mutant]:
    """At most `limit` mutants, taken evenly through the module (the same ones every run)."""
    if limit is None or len(mutants) <= limit:
        return mutants
    step = len(mutants) / limit
    return [mutants[int(i * step)] for i in range(limit)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(TARGETS), help="only these (repeatable)")
    parser.add_argument("--limit", type=int, help="at most this many mutants per module")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at a time (default 1)")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--min-score", type=float, default=90.0, help="exit 1 below this score (percent)")
    args = parser.parse_args(argv)

    names = args.module or list(TARGETS)
    mutants = [m for name in names for m in spread(find_mutants(name), args.limit)]
    if args.list:
        for mutant in mutants:
            print(mutant.describe())
        print(f"{len(mutants)} mutants")
        return 0

    with tempfile.TemporaryDirectory(prefix="mutate-") as folder:
        timeouts = {}
        for name in names:  # the unmutated module must pass, and sets the time limit
            target = TARGETS[name]
            outcome, seconds = run_tests(target, ROOT / target.path, timeout=600)
            if outcome != "passed":
                print(f"{name}: the tests fail without any mutation ({' '.join(target.tests)}); fix them first")
                return 2
            timeouts[name] = max(30.0, 5 * seconds)  # generous: a busy machine must not kill mutants
            print(f"{name}: {sum(m.target == name for m in mutants)} mutants, tests take {seconds:.1f} s", flush=True)

        results: dict[Mutant, str] = {}
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_mutant, m, Path(folder), timeouts[m.target]) for m in mutants]
            for future in concurrent.futures.as_completed(futures):
                mutant, outcome = future.result()
                if outcome == "survived" and mutant.key() in EQUIVALENT:
                    outcome = "equivalent"
                results[mutant] = outcome
                if outcome in ("survived", "equivalent"):
                    print(f"{outcome.upper():10} {mutant.describe()}", flush=True)

    print()
    total_killed = total_counted = 0
    for name in names:
        outcomes = [outcome for mutant, outcome in results.items() if mutant.target == name]
        killed = sum(outcome.startswith("killed") for outcome in outcomes)
        counted = len(outcomes) - outcomes.count("equivalent")
        total_killed, total_counted = total_killed + killed, total_counted + counted
        print(f"{name:11} {killed:4d} killed of {counted:4d} ({outcomes.count('equivalent')} equivalent)")
    score = 100.0 * total_killed / max(total_counted, 1)
    print(f"score: {total_killed}/{total_counted} = {score:.1f}% of non-equivalent mutants killed "
          f"in {time.monotonic() - started:.0f} s")
    return 0 if score >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
