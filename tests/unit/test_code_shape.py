"""The shape the services' code keeps: short functions, and a gateway class that runs one generation's lifecycle
(routing lives in gateway.router, input checks in gateway.core.Inputs). A function that outgrows the bound is
a sign that it does two things; split it where it does."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "verify_service", "draft_service")
MAX_FUNCTION_LINES = 60
MAX_GATEWAY_CLASS_LINES = 300


def _defs(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node


def _lines(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("package", SERVICES)
def test_no_service_function_is_longer_than_the_bound(package):
    long = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in _defs(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) and _lines(node) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_lines(node)} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_gateway_class_keeps_to_one_generations_lifecycle():
    tree = ast.parse((ROOT / "gateway" / "core.py").read_text())
    (gateway,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Gateway"]
    assert _lines(gateway) <= MAX_GATEWAY_CLASS_LINES


def test_the_bound_is_measured():
    """The counting itself: a function of 61 lines is caught, decorators included."""
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    tree = ast.parse(f"@decorator\ndef f():\n{body}\n    return 0\n")
    (f,) = list(_defs(tree))
    assert _lines(f) == 61 > MAX_FUNCTION_LINES
