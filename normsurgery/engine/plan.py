"""The plan of a sweep: the parts a model is cut into (:func:`plan`) and the rewrite steps applied
to each (:func:`steps_of`), with what is refused before any weight is read
(:func:`check_before_reading`, :func:`check_applies`).

A part is every block; the embeddings with the first block; the final norm, the head and what else
runs after the blocks (``Layout.after``: a pooler) with the last (all in one part when a tied head
shares the embedding). "In memory" is the plan of one part holding the whole model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from ..core import registry
from ..core.errors import SurgeryError
from ..core.families import layout
from ..core.layout import Layout
from ..core.parity import Comparison
from ..core.registry import PassReport
from ..io.shards import inside


@dataclass(frozen=True)
class Part:
    """Module paths entered together (() : the whole model), and the stages of a forward pass
    they take part in (-1: before the blocks, i: block i, L: after the blocks)."""

    scope: tuple[str, ...]
    stages: tuple[int, ...]


def plan(model, lay: Layout, streamed: bool, alone: bool = False) -> list[Part]:
    """The parts (see the module docstring); not ``streamed``: one part, the whole model.
    ``alone``: the two ends are parts of their own (reading only: a pass needs every part to hold
    norms)."""
    n = len(model.get_submodule(lay.layers_path))
    if not streamed:
        return [Part((), tuple(range(-1, n + 1)))]
    blocks = [f"{lay.layers_path}.{i}" for i in range(n)]
    back = tuple(dict.fromkeys(((lay.final_norm.path, *lay.final_norm.readers) if lay.final_norm else ())
                               + ((lay.head,) if lay.head else ()) + lay.after))
    front, ends = [], defaultdict(set)
    for name, p in model.named_parameters(remove_duplicate=False):
        mod = name.rpartition(".")[0]
        if inside(name, (lay.layers_path,)):
            continue
        ends[id(p)].add(inside(mod, back))
        if not inside(mod, back) and mod not in front:
            front.append(mod)
    tied = any(len(e) > 1 for e in ends.values())
    if alone:
        blocks = [Part((b,), (i,)) for i, b in enumerate(blocks)]
        ends = [Part((*front, *back), (-1, n))] if tied else [Part(tuple(front), (-1,)), Part(back, (n,))]
        return ends + blocks
    first = Part((*front, blocks[0]), (-1, 0))
    last = Part((blocks[-1], *back), (n - 1, n))
    middle = [Part((b,), (i,)) for i, b in enumerate(blocks)][1:-1]
    if n == 1 or tied:
        return [Part(tuple(dict.fromkeys(first.scope + last.scope)), (-1, 0, n - 1, n)), *middle]
    return [first, *middle, last]


@dataclass
class StepSpec:
    """A rewrite step: a pass's ``apply`` (or its ``reference``, a mask first), or its stages."""

    name: str  # as reported: "minimize", "minimize (reference)"
    kind: str  # registry.KINDS
    options: dict[str, Any]
    run: Callable[..., PassReport | None] | None
    pass_name: str  # the registered pass
    stages: Callable[..., list[registry.Stage]] | None = None  # (options, layout) -> the stages, in place of run
    whole: str | None = None  # why it needs the whole model in memory (None: it runs part by part)
    tracked: bool = False  # registry.Pass.tracked: its writes are seen (else every parameter counts as changed)


#: what a trained step's metrics say of its held-out loss (and, where it ran, the vanilla control's)
HELDOUT = {"ce_before", "ce_after", "tokens"}
CONTROL = ("ce_control", "gap_to_control", "control_tokens")


@dataclass
class Step:
    """A step as it ran: its notes and metrics (its parts' reports merged: ``sweep.steps_with``)
    and its parity, the model's outputs after it against those before it (where measured)."""

    name: str
    kind: str
    options: dict[str, Any]
    notes: list[str]
    metrics: dict[str, Any]
    parity: Comparison | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "options": self.options, "notes": self.notes,
                "metrics": self.metrics, "parity": self.parity.as_dict() if self.parity else None}

    def record(self) -> dict:
        """What a saved config records of it (under "normsurgery", "passes")."""
        p, m = self.parity, self.metrics
        return {"name": self.name, "options": self.options, "notes": self.notes,
                "relative_error": p.relative if p else None, "tolerance": p.tolerance if p else None,
                "reason": p.reason if p else None,
                **({"heldout": {k: m[k] for k in (*HELDOUT, *CONTROL) if k in m}} if HELDOUT <= m.keys() else {})}


def check_applies(model, name: str, lay: Layout | None = None) -> registry.Pass:
    """The pass ``name``, when it applies to ``model`` (``lay``: its layout, or a part's)."""
    p = registry.get(name)
    reason = p.applies(model, layout(model) if lay is None else lay)
    if reason:
        raise SurgeryError(f"pass {name} does not apply to this {layout(model).family} model: {reason}")
    return p


def check_before_reading(model, steps: list[StepSpec]) -> None:
    """Before any weight is read (``model``: built on the meta device will do): the first pass
    applies to the whole model (:func:`check_applies`: its refusal counts what the whole Layout
    holds, in every plan, not what the first part holds), and each pass's own ``check`` of its
    options against the model's Layout."""
    if steps:
        check_applies(model, steps[0].pass_name)
    lay = None
    for s in steps:
        p = registry.get(s.pass_name)
        if p.check is not None and s.kind != "reference":
            lay = lay or layout(model)
            reason = None if p.applies(model, lay) else p.check(model, lay, s.options)  # (else: applies says why)
            if reason:
                raise SurgeryError(reason)


def steps_of(passes: list[tuple[str, dict]]) -> list[StepSpec]:
    """The passes as steps, each pass's reference step (a mask first) before it."""
    steps = []
    for name, options in passes:
        p = registry.get(name)
        opts = registry.check_options(p, options)
        whole = ("it trains the whole model" if p.kind == "trained" else
                 "it rewrites the whole model at once" if not p.blockwise else
                 p.whole(opts) if p.whole is not None else None)
        if p.reference is not None or p.reference_stages is not None:
            steps.append(StepSpec(f"{name} (reference)", "reference", opts, p.reference, name, p.reference_stages,
                                  whole, p.tracked))
        steps.append(StepSpec(name, p.kind, opts, p.apply, name, p.stages, whole, p.tracked))
    return steps
