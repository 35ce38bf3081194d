"""A step on a part, and the whole-model facts its stages need first (their scans).

A step runs its pass's ``run``, or its stages in turn, each after its scans: a scan collects on
every part brought to where its stage starts, and gathers what it collected into facts about the
whole model (index sets, thresholds), known once for every work over one plan (``Work.fresh``
shares them). Streamed, every scan a part's steps need runs before the part is read
(:func:`scan_ahead`): a scan holds one part at a time, its own. Written against :class:`Sweep`,
what it uses of a ``sweep.Work`` (which imports this module: the one direction).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ..core.families import layout
from ..core.layout import Layout
from .plan import Part, StepSpec, check_applies
from ..core.registry import PassContext, PassReport, Stage


class Sweep(Protocol):
    """What a step and its scans use of the executor (``sweep.Work``): its model, steps and the
    context their passes are given, whether it holds the whole model (``resident``), the facts
    known of it, and, streamed, a fresh work over the same plan to read parts in."""

    model: Any
    steps: list[StepSpec]
    context: PassContext
    resident: bool
    known: dict[tuple[int, int], dict]
    parts: list[Part]

    def fresh(self) -> Sweep: ...

    def enter(self, part: Part, level: int = 0, copied: Callable | None = None) -> None: ...

    def leave(self, part: Part, force: bool = False) -> None: ...

    def close(self) -> None: ...


def run_step(work: Sweep, i: int, scope: tuple[str, ...], stages: int | None = None) -> PassReport | None:
    """Step ``i`` of ``work`` on the part ``scope``: its ``run``, or its first ``stages`` stages
    (default: all), each after its scans (:func:`facts`) with the Layout as the stage finds it. A
    staged step that has no stages (a mask not asked for) reports None."""
    step, model, ctx = work.steps[i], work.model, work.context
    if step.stages is None:
        ctx.options = step.options
        return step.run(model, layout(model, scope), ctx)
    todo = step.stages(step.options, layout(model))
    report = PassReport(step.pass_name) if todo else None
    for k, stage in enumerate(todo[:stages]):
        known = facts(work, i, k, todo)
        ctx.options, ctx.facts = step.options, known
        stage.run(model, layout(model, scope), ctx, report)
    return report


def scan_ahead(work: Sweep, level: int) -> None:
    """Streamed, the facts of every stage of the steps before ``level``: their scans read every
    part in works of their own, so run before ``work`` reads a part, none holds a part of
    ``work`` beside its own. In memory, nothing: a scan collects on the resident model when its
    stage comes."""
    if work.resident:
        return
    for i, step in enumerate(work.steps[:level]):
        todo = step.stages(step.options, layout(work.model)) if step.stages is not None else []
        if todo:
            facts(work, i, len(todo) - 1, todo)


def facts(work: Sweep, i: int, k: int, stages: list[Stage]) -> dict:
    """What stage ``k`` of step ``i`` and those before it know of the whole model: each stage's
    scans collect on every part brought to where the stage starts (the steps before ``i``, then
    stages before ``k``), once for every work over this plan (``Work.fresh`` shares them). In
    memory the one part is the model itself, already there; streamed, the parts of a work of their
    own are read, brought there, collected and freed one at a time."""
    if (i, k) in work.known:
        return work.known[(i, k)]
    known = dict(facts(work, i, k - 1, stages)) if k else {}
    scans = stages[k].scans
    if scans:
        ctx, collected = work.context, [[] for _ in scans]

        def collect(model, scope):
            ctx.options, ctx.facts = work.steps[i].options, known
            for c, scan in zip(collected, scans):
                c.append(scan.collect(model, layout(model, scope), ctx))
        whole = _collect_all(work, i, k, collect)
        ctx.options, ctx.facts = work.steps[i].options, known
        for c, scan in zip(collected, scans):
            known.update(scan.gather(c, whole, ctx))
    work.known[(i, k)] = known
    return known


def _collect_all(work: Sweep, i: int, k: int, collect: Callable) -> Layout:
    """``collect(model, scope)`` on every part at step ``i``'s stage ``k``: the resident model
    itself, or the parts of a fresh work read one at a time (each checked to be one step ``i``'s
    pass applies to, as ``Work.enter`` checks it). Returns the whole model's Layout."""
    if work.resident:
        collect(work.model, ())
        return layout(work.model)
    sweep = work.fresh()
    try:
        for part in sweep.parts:
            sweep.enter(part, i)
            check_applies(sweep.model, sweep.steps[i].pass_name, layout(sweep.model, part.scope))
            run_step(sweep, i, part.scope, k)
            collect(sweep.model, part.scope)
            sweep.leave(part)
    finally:
        sweep.close()
    return layout(sweep.model)
