"""The house limits a reviewer can recount (the package, the CLI included): no module over 500
lines, no class over 120, no function over 60 lines or 8 parameters (``self``/``cls`` not
counted). Each place over a limit is listed with its line."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "normsurgery"
LIMITS = {"module": 500, "class": 120, "function": 60, "parameters": 8}


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - bool(a.args and a.args[0].arg in ("self", "cls"))


def over(path: Path) -> list[str]:
    """Every place of ``path`` over a limit, as ``file:line: what``."""
    src = path.read_text()
    where = path.relative_to(PKG.parent)
    out = []
    if len(src.splitlines()) > LIMITS["module"]:
        out.append(f"{where}: module of {len(src.splitlines())} lines")
    for node in ast.walk(ast.parse(src)):
        length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and length > LIMITS["class"]:
            out.append(f"{where}:{node.lineno}: class {node.name} of {length} lines")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if length > LIMITS["function"]:
                out.append(f"{where}:{node.lineno}: {node.name} of {length} lines")
            if parameters(node) > LIMITS["parameters"]:
                out.append(f"{where}:{node.lineno}: {node.name} with {parameters(node)} parameters")
    return out


def test_every_module_class_and_function_keeps_the_house_limits():
    found = [line for path in sorted(PKG.rglob("*.py")) for line in over(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("def f(a, b, c, d, e, f, g, h, i):\n    pass\n", "with 9 parameters"),
    ("def f():\n" + "    x = 1\n" * 60, "of 61 lines"),
    ("class C:\n" + "    x = 1\n" * 120, "class C of 121 lines"),
    ("x = 1\n" * 501, "module of 501 lines"),
])
def test_a_place_over_a_limit_is_found(tmp_path, monkeypatch, source, expected):
    monkeypatch.setattr(__import__(__name__), "PKG", tmp_path)
    (tmp_path / "m.py").write_text(source)
    assert any(expected in line for line in over(tmp_path / "m.py"))


def test_methods_do_not_count_self():
    tree = ast.parse("class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n")
    assert parameters(tree.body[0].body[0]) == 8
