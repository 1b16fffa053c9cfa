"""The house's rules a linter does not check: functions a reader takes in at once, and an engine the worker holds
through its protocol (hpc.runtime.engine.types.Engine), never asked with hasattr/getattr."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hpc"
MAX_FUNCTION_LINES = 80


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(ROOT.rglob("*.py"))]


def long_functions(modules) -> list[str]:
    return [f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in modules for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def engine_probes(modules) -> list[str]:
    """hasattr(x, ...) / getattr(x, ...) where x names an engine (`engine`, `self.engine`, `deps.engine`, ...)."""
    found = []
    for path, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("hasattr", "getattr") and node.args \
                    and "engine" in ast.unparse(node.args[0]).lower():
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {ast.unparse(node)}")
    return found


@pytest.mark.unit
def test_no_function_is_longer_than_80_lines():
    assert long_functions(_modules()) == []


@pytest.mark.unit
def test_no_engine_is_asked_what_it_can_do_with_hasattr_or_getattr():
    assert engine_probes(_modules()) == []


@pytest.mark.unit
def test_the_rules_catch_what_they_forbid():
    """Each rule fails on a module that breaks it (a check that cannot fail checks nothing)."""
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    broken = ast.parse(f"def f():\n{long_body}\n\n"
                       "def g(deps):\n    return hasattr(deps.engine, 'load_image') or getattr(self_engine, 'x')\n")
    path = ROOT / "example.py"
    assert [line.split(" ", 1)[1] for line in long_functions([(path, broken)])] == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert len(engine_probes([(path, broken)])) == 2
