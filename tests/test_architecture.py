"""Imports run one way: core below passes/, passes/ below orchestration, the CLI on top; no cycles.
Every import counts: at module level, inside functions, ``from . import name``."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "normsurgery"
FLOORS = {"core": 0, "passes": 1, "orchestration": 2, "api": 3, "cli": 4}
ORCHESTRATION = {"convert", "verify", "prune", "heal", "training", "plan", "scan", "sweep", "writer",
                 "check", "export", "gguf", "lens", "squeeze", "runner", "nemotron", "mlx_check"}


def floor(module: str) -> int:
    """normsurgery.X[.Y] -> its floor number."""
    parts = module.split(".")[1:]
    if not parts:
        return FLOORS["api"]
    if parts[0] in ("cli", "__main__"):
        return FLOORS["cli"]
    if parts[0] == "passes":
        return FLOORS["passes"]
    if parts[0] in ORCHESTRATION:
        return FLOORS["orchestration"]
    return FLOORS["core"]


def modules(pkg: Path = PKG) -> dict[str, Path]:
    out = {}
    for path in pkg.rglob("*.py"):
        name = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, module: str, known: set[str]):
    """The normsurgery modules ``module`` imports anywhere in its file: ``from .x import y`` is
    an edge to x (and to x.y when that is a module), ``from . import y`` to y when y is a module,
    else to the package itself."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("normsurgery"):
                target = node.module
            else:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            if node.module or len(subs) < len(node.names):
                yield target
            yield from subs
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("normsurgery"))


def graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = modules(pkg)
    return {m: {t for t in imports(p, m, set(mods)) if t in mods and t != m} for m, p in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_imports_run_downward():
    wrong = [f"{m} imports {t}" for m, targets in graph().items() for t in targets if floor(t) > floor(m)]
    assert not wrong, wrong


def test_no_import_cycles():
    assert not cycles(graph())


def test_the_checks_see_lazy_upward_imports_and_cycles(tmp_path):
    """The checks can fail: an import inside a function, ``from . import`` of the package, and a
    cycle through such imports are all seen."""
    pkg = tmp_path / "normsurgery"
    (pkg / "passes").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "passes" / "__init__.py").write_text("")
    (pkg / "masks.py").write_text("def f():\n    from .passes import norms\n")
    (pkg / "passes" / "norms.py").write_text("from .. import __version__\nfrom ..masks import f\n")
    (pkg / "algebra.py").write_text("from . import masks\n")
    edges = graph(pkg)
    assert "normsurgery.passes.norms" in edges["normsurgery.masks"]  # inside a function
    assert "normsurgery" in edges["normsurgery.passes.norms"]  # from .. import __version__: the package
    assert edges["normsurgery.algebra"] == {"normsurgery.masks"}  # from . import a module
    assert ["normsurgery.masks", "normsurgery.passes.norms"] in cycles(edges)
    assert floor("normsurgery.passes.norms") > floor("normsurgery.masks")
