#!/usr/bin/env python
"""The family x pass matrix of docs/families.md, from running the passes (not typed by hand).

For every family of the tests (``tests/models.py``: tiny random models in float64 whose norms,
biases and multipliers are not the defaults) and every exact pass (and rotate's recipes): the
pass's refusal, or max |logits' - logits| / max |logits| of the rewritten model against the
unmodified one.

Usage (from the repository root):
  HF_HUB_OFFLINE=1 .venv/bin/python scripts/family_matrix.py           # print the table
  HF_HUB_OFFLINE=1 .venv/bin/python scripts/family_matrix.py --write   # and put it in docs/families.md

tests/test_docs.py fails while the committed matrix differs from what this prints (digits aside:
the last digit of a float64 error follows the machine's rounding).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's normsurgery and test models

import normsurgery as ns  # noqa: E402
import normsurgery.passes  # noqa: E402, F401  (declares the passes)
from normsurgery.core import registry  # noqa: E402
from normsurgery.core.families import layout  # noqa: E402
from normsurgery.core.norms import faithful_norms  # noqa: E402

from models import CONFIGS, rel, tiny_model, token_ids  # noqa: E402

START, END = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"


def cell(family: str, steps: list[tuple[str, dict]]) -> tuple[str, str | None]:
    """(table cell, the first refusal or None) for the passes ``steps`` run in turn."""
    model = tiny_model(family)
    faithful_norms(model)
    new = copy.deepcopy(model)
    for name, options in steps:
        reason = registry.get(name).applies(new, layout(new))
        if reason:
            return "refused", f"{name}: {reason}"
        ns.apply_passes(new, [(name, options)])
    return f"exact ({rel(model, new, token_ids()):.0e})", None


def columns() -> dict[str, list[tuple[str, dict]]]:
    """Every exact pass alone, and rotate after the pass that folds the gains (its recipe)."""
    cols = {p.name: [(p.name, {})] for p in registry.all_passes() if p.kind == "exact"}
    cols["pre-rmsnorm:fold=true, rotate"] = [("pre-rmsnorm", {"fold": True}), ("rotate", {})]
    cols["flashnorm, rotate"] = [("flashnorm", {}), ("rotate", {})]
    return cols


def matrix() -> str:
    cols = columns()
    reasons: dict[str, int] = {}
    rows = ["| family | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for family in CONFIGS:
        cells = []
        for steps in cols.values():
            text, reason = cell(family, steps)
            if reason:
                text += f" [{reasons.setdefault(reason, len(reasons) + 1)}]"
            cells.append(text)
        rows.append(f"| {family} | " + " | ".join(cells) + " |")
    notes = [f"{n}. {r}" for r, n in reasons.items()]
    return "\n".join(rows + [""] + notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the matrix in docs/families.md")
    text = matrix()
    print(text)
    if ap.parse_args().write:
        page = ROOT / "docs" / "families.md"
        old = page.read_text()
        head, rest = old.split(START)
        _, tail = rest.split(END)
        page.write_text(f"{head}{START}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()
