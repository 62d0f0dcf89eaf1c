"""The house rules on the code's shape (issue 31): modules of at most 400 lines, functions of
at most 60, in ``orchestrator/`` and ``launch/``. What is still over is listed below, each
with why it remains; a new one fails, and so does an entry that no longer is over (remove
it): the lists only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "launch")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Module -> why it is still over MAX_MODULE_LINES.
LONG_MODULES: dict[str, str] = {}

# "path::Qualified.name" -> why it is still over MAX_FUNCTION_LINES.
LONG_FUNCTIONS: dict[str, str] = {}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in ``tree``, nested ones included."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                found.append((name, node.end_lineno - node.lineno + 1))
            found += _functions(node, f"{name}.")
        else:
            found += _functions(node, prefix)
    return found


def _long_modules() -> dict[str, int]:
    out = {}
    for path in _sources():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            out[_rel(path)] = lines
    return out


def _long_functions() -> dict[str, int]:
    out = {}
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, lines in _functions(tree):
            if lines > MAX_FUNCTION_LINES:
                out[f"{_rel(path)}::{name}"] = lines
    return out


def test_no_new_module_over_400_lines() -> None:
    found = _long_modules()
    new = {m: n for m, n in found.items() if m not in LONG_MODULES}
    assert not new, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {new}"
    stale = sorted(set(LONG_MODULES) - set(found))
    assert not stale, f"no longer over {MAX_MODULE_LINES} lines: remove from LONG_MODULES {stale}"


def test_no_new_function_over_60_lines() -> None:
    found = _long_functions()
    new = {f: n for f, n in found.items() if f not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them): {new}"
    stale = sorted(set(LONG_FUNCTIONS) - set(found))
    assert not stale, (
        f"no longer over {MAX_FUNCTION_LINES} lines: remove from LONG_FUNCTIONS {stale}"
    )


def test_the_rules_see_the_code() -> None:
    """The scan reads the packages (a wrong root would pass every rule vacuously)."""
    names = {_rel(p) for p in _sources()}
    assert {"orchestrator/guard.py", "launch/cli.py", "orchestrator/health.py"} <= names
    lengths = {
        f"{_rel(p)}::{name}": n
        for p in _sources()
        for name, n in _functions(ast.parse(p.read_text(encoding="utf-8")))
    }
    assert lengths["orchestrator/guard.py::Guard.__init__"] > 10
    assert set(LONG_FUNCTIONS) <= set(_long_functions())
