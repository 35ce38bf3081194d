"""Imports run one way: core below passes/, passes/ below orchestration, the CLI on top."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "normsurgery"
FLOORS = {  # floor of each module; a module may import only from its floor or below
    "core": 0, "registry": 0, "passes": 1, "orchestration": 2, "api": 3, "cli": 4,
}
ORCHESTRATION = {"convert", "verify", "prune", "heal", "training", "streaming"}


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


def module_level_imports(path: Path, module: str):
    """Absolute names of the normsurgery modules imported at module level (not inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                yield target
            else:
                yield from (f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("normsurgery"):
            yield node.module


def test_imports_run_downward():
    wrong = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        for target in module_level_imports(path, module):
            if floor(target) > floor(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself can fail: a core module importing a pass is caught."""
    fake = tmp_path / "masks.py"
    fake.write_text("from .passes.norms import fold_into_readers\n")
    targets = list(module_level_imports(fake, "normsurgery.masks"))
    assert targets == ["normsurgery.passes.norms"] and floor(targets[0]) > floor("normsurgery.masks")
