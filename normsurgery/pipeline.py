"""One executor over parts: every model convert, verify, prune and heal read, rewrite, check and
write goes through it, whether the whole model is in memory or one part at a time.

A :class:`Work` is a model of a checkpoint (``checkpoint.Source``) built on the meta device (no
memory for weights) and cut into parts (:func:`plan`): every block; the embeddings with the
first block; the final norm and head with the last (all four in one part when a tied head shares
the embedding). "In memory" is the plan of one part holding the whole model, loaded once and
kept (``resident``). A part is *entered* (its tensors read from the files, cast to the working
dtype, then brought to a level: the first ``level`` rewrite steps applied to it with the Layout
restricted to it) and *left* (freed, unless resident). So:

- outputs (:meth:`Work.outputs`): a forward pass whose hooks enter each part before its first
  module runs and leave it after its last; the outputs are the whole model's;
- writing (:meth:`Work.write`): each part entered at the last level, its tensors cast to the
  storage dtype (``precision.for_storage``: checked for overflow and underflow) and appended to
  the output shards, then freed;
- the written folder is checked as any checkpoint is read: a :class:`Work` over it, with the
  stock class where loading with plain transformers is claimed (:func:`save_work`).

The arithmetic of a part is the same in either plan, tensor for tensor, so both write the same
tensors. Memory is about one part plus one tensor being read or written when streaming.
"""

from __future__ import annotations

import copy
import time
import zlib
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import devices, memory, modelcard, precision, registry
from .checkpoint import (Loader, Source, check_finite, claims, finish, load_dtype, mark_not_stock, save_config, stamp,
                         write_config)
from .errors import SurgeryError
from .options import MAX_SHARD_SIZE
from .families import layout, positions
from .layout import Layout
from .norms import faithful_norms
from .output import writing, written
from .parity import (DRAWS, TOLERANCE, Comparison, HeadInput, beyond, coarser, compare, dtype_name, jittered,
                     needs_rounding_tolerance, null_summary, output_kind, outputs, probe_ids, rounding_tolerance,
                     tolerance)
from .progress import Progress, no_progress
from .registry import PassContext, PassReport
from .shards import Reader as ShardReader, ShardWriter, header_room, inside, saved_tensors


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
                               + ((lay.head,) if lay.head else ())))
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


class Work:
    """A model whose parts are read from the checkpoint ``source`` as they are entered (see the
    module docstring). Given ``model``: a model already in memory (one resident part; ``source``,
    if any, is where it came from: its side files are copied on saving). ``device``: where the
    parts read go and the forwards run (``devices.choose``; a model given computes where it is).
    ``on_load(model, part, keys_of)``: called once a part read is at the level asked for
    (``keys_of(name, parameter)``: the checkpoint keys it was read from)."""

    def __init__(self, source: Source | None, dtype: torch.dtype | None = None, *, streamed: bool = False,
                 alone: bool = False, stock: bool = False, model=None, on_load: Callable | None = None,
                 device: torch.device | str | None = None):
        self.source, self.streamed = source, streamed
        read = model is None
        if read and device is None:
            raise SurgeryError("internal: a work that reads a checkpoint needs the device its parts go to")
        self.model = source.meta_model(dtype, stock) if read else model
        self.device = torch.device(device) if read else devices.of(model)
        self.dtype = dtype or next(self.model.parameters()).dtype
        self.restore = faithful_norms(self.model) if read and self.dtype == torch.float64 else None
        self.loader = Loader(self.model, source, self.dtype, self.device) if read else None
        self.alone = alone
        self.parts = plan(self.model, layout(self.model), streamed, alone)
        self.resident = not streamed
        self.steps: list[StepSpec] = []
        self.context = PassContext()
        self.known: dict[tuple[int, int], dict] = {}  # (step, stage) -> the whole-model facts its scans gathered
        self.reports: dict[int, dict[Part, PassReport]] = defaultdict(dict)  # step -> part -> its report
        self.on_load = on_load
        self.level: dict[Part, int] = {}  # parts held, and how many steps they went through
        self.rewritten: set[Part] = set()  # parts freed after a step rewrote them
        self.rounded: set[str] = set()  # tensors :meth:`write` cast to a narrower dtype (the rest: as stored)
        if self.loader is None:
            self.level = {p: 0 for p in self.parts}
        if streamed:
            memory.map_large_blocks()  # freed parts go back to the system at once

    # -- parts -----------------------------------------------------------------------------

    def replan(self) -> None:
        """The parts again, after the model's blocks changed (``prune_model``); parts held are kept
        (a one-part plan) or must have been left."""
        held = {part.scope: level for part, level in self.level.items()}
        self.parts = plan(self.model, layout(self.model), self.streamed, self.alone)
        self.level = {p: held[p.scope] for p in self.parts if p.scope in held}

    def fresh(self) -> Work:
        """A new work over the same checkpoint, plan and steps, nothing read yet: a rewritten part
        (its modules changed) cannot be read again into the same model."""
        work = Work(self.source, self.dtype, streamed=self.streamed, device=self.device)
        work.steps, work.context, work.known = self.steps, self.context, self.known
        return work

    def enter(self, part: Part, level: int = 0) -> None:
        """Read ``part`` (unless held) and apply steps up to ``level`` to it."""
        if part in self.rewritten:
            raise SurgeryError(f"internal: part {part.scope[:1]} was rewritten and freed: it cannot be read again")
        read = part not in self.level
        if read:
            self.loader.load(part.scope)
            self.level[part] = 0
        if self.level[part] > level:
            raise SurgeryError(f"internal: part {part.scope[:1]} is at step {self.level[part]}, past {level}")
        for i in range(self.level[part], level):
            step = self.steps[i]
            check_applies(self.model, step.pass_name, layout(self.model, part.scope))
            before = versions(self.model)
            report = self._run(i, part.scope)
            mark_changed(self.model, before, everything=step.kind == "trained" or not step.tracked)
            if report is not None:  # a part rewritten again (read again) reports again
                self.reports[i][part] = report
            self.level[part] = i + 1
        if read and self.on_load is not None:
            self.on_load(self.model, part, self._stored_keys)

    def _run(self, i: int, scope: tuple[str, ...], stages: int | None = None) -> PassReport | None:
        """Step ``i`` on the part ``scope``: its ``run``, or its first ``stages`` stages (default:
        all), each after its scans (:meth:`facts`) with the Layout as the stage finds it. A staged
        step that has no stages (a mask not asked for) reports None."""
        step, model, ctx = self.steps[i], self.model, self.context
        if step.stages is None:
            ctx.options = step.options
            return step.run(model, layout(model, scope), ctx)
        todo = step.stages(step.options, layout(model))
        report = PassReport(step.pass_name) if todo else None
        for k, stage in enumerate(todo[:stages]):
            facts = self.facts(i, k, todo)
            ctx.options, ctx.facts = step.options, facts
            stage.run(model, layout(model, scope), ctx, report)
        return report

    def facts(self, i: int, k: int, stages: list[registry.Stage]) -> dict:
        """What stage ``k`` of step ``i`` and those before it know of the whole model: each stage's
        scans collect on every part brought to where the stage starts (the steps before ``i``,
        then stages before ``k``), once for every work over this plan (:meth:`fresh` shares them).
        In memory the one part is the model itself, already there; streamed, the parts of a work
        of their own are read, brought there, collected and freed one at a time."""
        if (i, k) in self.known:
            return self.known[(i, k)]
        facts = dict(self.facts(i, k - 1, stages)) if k else {}
        scans = stages[k].scans
        if scans:
            ctx, collected = self.context, [[] for _ in scans]

            def collect(model, scope):
                ctx.options, ctx.facts = self.steps[i].options, facts
                for c, scan in zip(collected, scans):
                    c.append(scan.collect(model, layout(model, scope), ctx))
            if self.resident:
                collect(self.model, ())
                whole = layout(self.model)
            else:
                sweep = self.fresh()
                try:
                    for part in sweep.parts:
                        sweep.enter(part, i)
                        sweep._run(i, part.scope, k)
                        collect(sweep.model, part.scope)
                        sweep.leave(part)
                finally:
                    sweep.close()
                whole = layout(sweep.model)
            ctx.options, ctx.facts = self.steps[i].options, facts
            for c, scan in zip(collected, scans):
                facts.update(scan.gather(c, whole, ctx))
        self.known[(i, k)] = facts
        return facts

    def _stored_keys(self, name: str, p) -> tuple[str, ...]:
        """The checkpoint's keys parameter ``p`` (named ``name``) was read from."""
        stored = self.loader.stored(p)
        return tuple(stored.keys) if stored is not None else (name,)

    def leave(self, part: Part, force: bool = False) -> None:
        """Free ``part`` (a resident part only when ``force``)."""
        if part in self.level and (force or not self.resident) and self.loader is not None:
            self.loader.free(part.scope)
            if self.level.pop(part):
                self.rewritten.add(part)

    def close(self) -> None:
        """Free every part; the loader gives its spare tensors back and closes the files (a part
        entered later reads them again)."""
        for part in list(self.level):
            self.leave(part, force=True)
        if self.loader is not None:
            self.loader.close()

    @contextmanager
    def running(self, level: int = 0):
        """While active, a forward pass enters each part (at ``level``) before it runs and leaves
        it after (hooks on the base model, the blocks and the model)."""
        with part_by_part(self.model, self.parts, lambda p: self.enter(p, level), self.leave):
            yield self.model

    def outputs(self, ids: torch.Tensor, level: int = 0, jitter: bool = False, compact: bool = False):
        """What the model outputs on ``ids`` with steps up to ``level`` applied (``jitter``: under
        ``parity.jittered``), entering and leaving each part as the forward goes. A resident model is
        brought to ``level`` first: a step may run forward passes of its own (training).

        ``compact``: where the logits are a plain linear head's, read as stored (level 0, nothing
        altered on loading), a :class:`parity.HeadInput` instead: the head's input, its rows read
        from the checkpoint a slab at a time when compared (no positions x vocabulary tensor)."""
        if self.resident:
            self.enter(self.parts[0], level)
        head = self._compact_head() if compact and not jitter and level == 0 else None
        with FORWARDS.timed(), self.running(level), jittered(self.model) if jitter else nullcontext(), \
                capture(head) if head is not None else nullcontext() as seen:
            out = outputs(self.model, ids, self.device)
        memory.trim()  # the forward's activations, freed after the last part: back to the system
        if head is None:
            return out
        key, vocab = self.loader.stored(head.weight).keys[0], head.weight.shape[0]
        reader, dtype = ShardReader(self.loader.source.index), self.dtype
        rows = lambda i, j: reader.read_rows(key, i, j, dtype)  # noqa: E731
        return HeadInput(seen["hidden"], rows, seen["bias"], vocab)

    def _compact_head(self):
        """The head module when this model's logits are a plain linear map of the head's input
        stored as one tensor (:meth:`outputs`), else None."""
        if self.loader is None or self.on_load is not None:
            return None
        lay = layout(self.model)
        if lay.head is None or lay.objective != "causal-lm" or not lay.plain_logits:
            return None
        head = self.model.get_submodule(lay.head)
        if type(head) is not torch.nn.Linear:
            return None
        stored = self.loader.stored(head.weight)
        if stored is None or stored.stack is not None or self.loader.source.index[stored.keys[0]].tensor is not None:
            return None
        if self.resident and getattr(head.weight, CHANGED, False):
            return None
        return head

    def load_all(self, level: int = 0):
        """The whole model in memory at ``level`` (one-part plans: the model to train or mask)."""
        if self.streamed:
            raise SurgeryError("internal: load_all on a streamed plan")
        self.enter(self.parts[0], level)
        return self.model

    def write(self, writer: ShardWriter, storage: torch.dtype, level: int, lost: list,
              progress: Progress = no_progress) -> None:
        """Every part at ``level``, cast to ``storage`` (each tensor checked: ``lost`` collects
        those that do not fit), appended to ``writer``, then freed: a model read is spent (a model
        given in memory is left as it was, its tensors cast to new memory where they are)."""
        for i, part in enumerate(self.parts):
            progress("write", i, len(self.parts))
            if self._copy_untouched(part, level, writer, storage):
                progress("write", i + 1, len(self.parts))
                continue
            self.enter(part, level)
            saved = saved_tensors(self.model, part.scope or None)
            users = Counter(t.untyped_storage().data_ptr() for t in saved.values())
            params = dict(self.model.named_parameters(remove_duplicate=False))
            for name, t in saved.items():  # a storage two names write is cast, not spent
                key = self._unchanged(params.get(name), storage)
                if key is not None:  # read (and checked) on entering, no pass changed it: its bytes
                    writer.copy(name, self.loader.reader, key)
                    continue
                spend = self.loader is not None and users[t.untyped_storage().data_ptr()] == 1
                narrowed = t.is_floating_point() and torch.finfo(t.dtype).bits > torch.finfo(storage).bits
                t = precision.for_storage(name, t, storage, lost, spend) if t.is_floating_point() else t
                if narrowed and t.dtype == storage:
                    self.rounded.add(name)
                writer.add(name, t)
            saved = t = None  # no view left: the loader reuses the part's tensors
            if self.loader is not None:  # a model given in memory stays as it was
                self.leave(part, force=True)
            progress("write", i + 1, len(self.parts))

    def _unchanged(self, p, storage: torch.dtype, held: bool = True) -> str | None:
        """The stored key whose bytes are what writing parameter ``p`` in ``storage`` would write,
        or None: ``p`` was read from one stored tensor (not merged from several, not pickled) in a
        dtype that holds it exactly, is written in the dtype it is stored in, and no step changed
        it (:func:`mark_changed`); ``held``: it is in memory (else: not read yet, on the meta
        device)."""
        if p is None or self.loader is None or (p.device.type == "meta") == held:
            return None
        stored = self.loader.stored(p)
        if stored is None or stored.stack is not None or getattr(p, CHANGED, False):
            return None
        e = self.loader.source.index[stored.keys[0]]
        if e.tensor is not None or tuple(p.shape) != e.shape:
            return None
        if e.dtype.is_floating_point:
            exact = e.dtype == self.dtype or (torch.finfo(self.dtype).bits > torch.finfo(e.dtype).bits
                                              and self.dtype != torch.bfloat16)
            if e.dtype != storage or not exact:
                return None
        elif e.dtype != p.dtype:
            return None
        return stored.keys[0]

    def _copy_untouched(self, part: Part, level: int, writer: ShardWriter, storage: torch.dtype) -> bool:
        """Write ``part`` without reading it when no step is to run on it (``level`` 0: a prune's
        kept blocks under their new names, a checkpoint written unchanged) and each of its tensors
        is one stored tensor written as stored (:meth:`_unchanged`): its bytes are copied, each
        chunk checked for NaN or Inf as reading it would. False: it must be read."""
        if self.loader is None or level != 0 or part in self.level or part in self.rewritten:
            return False
        params = dict(self.model.named_parameters(remove_duplicate=False))
        keys = {}
        for name in saved_tensors(self.model, part.scope or None, meta=True):
            keys[name] = self._unchanged(params.get(name), storage, held=False)
            if keys[name] is None:  # a buffer, a merged tensor, a cast: read it
                return False
        source = self.loader.source
        for name, key in keys.items():
            writer.copy(name, self.loader.reader, key, lambda t, key=key: check_finite(t, key, source))
        return True

    def step_reports(self, i: int) -> tuple[list[str], dict]:
        """Step ``i``'s notes (merged over parts: :func:`merge_notes`) and metrics (integers summed
        over parts): the same in every plan."""
        reports = list(self.reports[i].values())
        metrics = {}
        for r in reports:
            for k, v in r.metrics.items():
                if k in metrics and k not in r.same:
                    v = (metrics[k] + v if k in r.joined else _add(metrics[k], v) if k in r.sums
                         else metrics[k] + v if _summed(v) else v)
                metrics[k] = v
        return merge_notes(reports), metrics


def _summed(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _add(a, b):
    """a + b: numbers, lists element by element, dicts key by key."""
    if isinstance(a, dict):
        return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, list):
        return [_add(x, y) for x, y in zip(a, b)]
    return a + b


def merge_notes(reports: list[PassReport]) -> list[str]:
    """The notes of the parts' reports as one report's: each distinct note once, the notes of one
    template (``PassReport.count``) as one with its integers summed; in the order each part gives
    them (a note one part adds goes before the next note of that part already placed)."""
    order: list[str] = []
    values: dict[str, dict | None] = {}
    for r in reports:
        keys = []
        for note in r.notes:
            key, v = r.counted.get(note, (note, None))
            keys.append(key)
            if key not in values:
                values[key] = None if v is None else dict(v)
            elif v is not None:
                total = values[key]
                for k, x in v.items():
                    total[k] = total.get(k, 0) + x if _summed(x) else total.get(k, x)
        for j, key in enumerate(keys):
            if key not in order:
                order.insert(next((order.index(k) for k in keys[j + 1:] if k in order), len(order)), key)
    return [key if values[key] is None else key.format(**values[key]) for key in order]


@contextmanager
def capture(head):
    """While active, ``head`` computes nothing: it records its input (``hidden``, detached) and a
    copy of its bias, and gives an empty output (no vocabulary columns)."""
    seen = {}

    def forward(x):
        seen["hidden"] = x.detach()
        seen["bias"] = None if head.bias is None else head.bias.detach().clone()
        return x.new_zeros(*x.shape[:-1], 0)

    head.forward = forward
    try:
        yield seen
    finally:
        del head.forward


#: set on a parameter a rewrite step changed (its values, or its tensor replaced): it is written
#: from memory; one read and left alone is copied as stored (:meth:`Work.write`)
CHANGED = "_normsurgery_changed"


def versions(model) -> dict[int, tuple]:
    """{id(parameter): (parameter, version counter, data pointer)} of ``model``'s parameters in
    memory, before a step runs (:func:`mark_changed` after it)."""
    return {id(p): (p, p._version, p.data_ptr()) for p in model.parameters() if p.device.type != "meta"}


def mark_changed(model, before: dict[int, tuple], everything: bool = False) -> None:
    """Mark (:data:`CHANGED`) each parameter in memory that a step changed since ``before``
    (:func:`versions`): written in place (torch counts in-place writes in ``_version``, those
    under ``no_grad`` too; not those through ``.data``, which no built-in pass makes:
    ``registry.Pass.tracked``), given another tensor (``.data =``), or new; ``everything``: all of
    them (a trained step: the optimiser may write in any way; a pass not known to be tracked)."""
    for p in model.parameters():
        if p.device.type == "meta":
            continue
        was = before.get(id(p))
        if everything or was is None or was[0] is not p or was[1] != p._version or was[2] != p.data_ptr():
            setattr(p, CHANGED, True)


@contextmanager
def part_by_part(model, parts: list[Part], enter: Callable[[Part], None], leave: Callable[[Part], None]):
    """Hooks that, during a forward pass, ``enter`` each part before its first stage runs and
    ``leave`` it after its last."""
    lay = layout(model)
    blocks = model.get_submodule(lay.layers_path)
    n = len(blocks)
    starts = {min(p.stages): p for p in parts}
    ends = {max(p.stages): p for p in parts}

    def start(stage):
        if stage in starts:
            enter(starts[stage])

    def end(stage):
        if stage in ends:
            leave(ends[stage])

    def before_block(i):
        def hook(module, args):
            if i == 0:
                end(-1)
            start(i)
        return hook

    def after_block(i):
        def hook(module, args, output):
            end(i)
            if i == n - 1:
                start(n)
        return hook

    # the embeddings come first, whether the model runs whole (OPT's calls its decoder, not its
    # base model) or its base model alone (scoring)
    handles = [model.register_forward_pre_hook(lambda m, a: start(-1)),
               model.base_model.register_forward_pre_hook(lambda m, a: start(-1)),
               model.register_forward_hook(lambda m, a, o: end(n))]
    for i, b in enumerate(blocks):
        handles += [b.register_forward_pre_hook(before_block(i)), b.register_forward_hook(after_block(i))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def check_applies(model, name: str, lay: Layout | None = None) -> registry.Pass:
    """The pass ``name``, when it applies to ``model`` (``lay``: its layout, or a part's)."""
    p = registry.get(name)
    reason = p.applies(model, layout(model) if lay is None else lay)
    if reason:
        raise SurgeryError(f"pass {name} does not apply to this {layout(model).family} model: {reason}")
    return p


def check_before_reading(model, steps: list[StepSpec]) -> None:
    """Each pass's own ``check`` of its options against the model's Layout, before any weight is
    read (``model``: built on the meta device will do)."""
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


# ---------------------------------------------------------------------------------------------
# checks: the reference, the tolerance, the written folder


class Meter:
    """Forward passes run for checks in this process, and the seconds they took (streamed: the
    parts they read included): a command reads the difference across its run."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    @contextmanager
    def timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - start

    def since(self, mark: tuple[int, float]) -> tuple[int, float]:
        """(forwards, seconds) since ``mark`` (:meth:`mark`)."""
        return self.count - mark[0], self.seconds - mark[1]

    def mark(self) -> tuple[int, float]:
        return self.count, self.seconds


#: every model forward the executor runs (:meth:`Work.outputs`, :func:`model_reader`)
FORWARDS = Meter()


Reader = Callable[..., torch.Tensor]  # (dtype=, jitter=, on_load=) -> a reference's outputs on the probe


class Tolerances:
    """Judges comparisons with a reference's outputs on ``ids`` in ``dtype`` arithmetic (``parity``'s
    rules). What a tolerance needs beyond the arithmetic's own is measured only when a comparison
    exceeds that (then once), by ``read``: the reference read again (:func:`source_reader`, or
    :func:`model_reader` for a model in memory), since the model that gave the outputs compared
    may be rewritten or spent by then.

    - weights stored coarser than the arithmetic: the null distribution of what storing in that
      dtype costs the reference, ``parity.DRAWS`` reads of it with the tensors ``differ`` names
      (checkpoint keys, or a function giving them once needed; None: all) perturbed as storing
      rounds them (``precision.perturb``); relative error and KL each within a factor of the
      draws' largest (``parity.storage_tolerance``);
    - a float32 comparison beyond 1e-5: ``ROUNDING_FACTOR`` x the reference's own rounding (every
      linear output jittered by one ulp);
    - half-precision arithmetic: ``ROUNDING_FACTOR`` x its own rounding against float32."""

    def __init__(self, read: Reader | None, ids: torch.Tensor, dtype: torch.dtype,
                 reference: torch.Tensor | Callable[[], torch.Tensor | None] | None = None,
                 given: float | None = None, output: str = "logits",
                 streamed: bool = False, device: torch.device | str | None = None,
                 differ: frozenset[str] | Callable[[], frozenset[str] | None] | None = None):
        self.read, self.ids, self.dtype, self.streamed = read, ids, dtype, streamed
        # where a written folder is read back to be compared (None: no folder is: check_written refuses)
        self.device = None if device is None else torch.device(device)
        self._reference, self.given, self.output = reference, given, output
        self.differ = differ
        self.perturbed = "the reference with the tensors that differ"  # what the null perturbs, in words
        self.measured: dict[Any, Any] = {}

    def around(self, reference: torch.Tensor, read: Reader, differ: frozenset[str], what: str) -> Tolerances:
        """The same rules with another reference: ``read`` gives its outputs (``reference``), and
        its null perturbs the tensors ``differ`` names (``what``: those, in words)."""
        t = Tolerances(read, self.ids, self.dtype, reference, self.given, self.output, self.streamed, self.device,
                       differ)
        t.perturbed = what
        return t

    @property
    def reference(self) -> torch.Tensor:
        """The reference's outputs: given (a tensor, or a function returning them once computed
        elsewhere, e.g. by the check's own first forward; None: not yet), else read again."""
        if callable(self._reference):
            self._reference = self._reference()
        if self._reference is None:
            self._reference = self.read()
        return self._reference

    def null(self, storage: torch.dtype) -> list[Comparison]:
        """What rounding alone does: the reference against itself with the tensors that differ
        perturbed as storing in ``storage`` rounds them, ``DRAWS`` seeded draws (half arithmetic:
        the reference run in float32, once)."""
        if storage not in self.measured:
            if self.dtype not in TOLERANCE:
                self.measured[storage] = [compare(self.reference, self.read(dtype=torch.float32), self.output)]
            else:
                differ = self.differ() if callable(self.differ) else self.differ
                self.measured[storage] = [
                    compare(self.reference, self.read(on_load=_perturbing(storage, seed, differ)), self.output)
                    for seed in range(DRAWS)]
        return self.measured[storage]

    def baseline(self, storage: torch.dtype) -> Comparison | None:
        """The null measured for ``storage``, each statistic at its worst (None: not measured)."""
        return null_summary(self.measured[storage]) if storage in self.measured else None

    def judge(self, c: Comparison, storage: torch.dtype | None = None) -> Comparison:
        """``c``, a comparison with the reference of weights stored in ``storage`` (default: the
        arithmetic's dtype), with its tolerance and the reason for it."""
        if self.given is not None:
            return c.judged(self.given, "given")
        storage = storage or self.dtype
        floor = TOLERANCE.get(self.dtype)
        if c.relative == 0:
            return c.judged(floor or 0.0, f"{dtype_name(self.dtype)} arithmetic: identical outputs")
        if floor is not None and c.relative <= floor:
            why = "checks the algebra" if self.dtype == torch.float64 else "its rounding"
            held = (f" (within it: what storing in {dtype_name(storage)} costs was not needed)"
                    if coarser(storage, self.dtype) else " on weights it holds exactly")
            return c.judged(floor, f"{dtype_name(self.dtype)} arithmetic: {why}{held}")
        if self.read is None:  # nothing to measure more with: the arithmetic's own (none for half)
            return c.judged(floor or 0.0, f"{dtype_name(self.dtype)} arithmetic (no reference to measure more with)")
        c.judged(*tolerance(self.dtype, storage, lambda: self.null(storage), self.perturbed))
        if self.dtype in TOLERANCE and storage in self.measured:
            worst = self.baseline(storage)
            c.null = {"draws": len(self.measured[storage]), "perturbed": self.perturbed, "relative": worst.relative,
                      "kl": worst.kl, "top1": worst.top1}
        if needs_rounding_tolerance([c], self.dtype, None):  # a deep model rounds more on its own
            if "jitter" not in self.measured:
                self.measured["jitter"] = rounding_tolerance(self.reference, self.read(jitter=True), self.dtype,
                                                             self.output)
            c.judged(*self.measured["jitter"])
        return c


def anchor(work: Work, ids: torch.Tensor, level: int = 0) -> Callable[[], torch.Tensor]:
    """The outputs at ``level`` a written folder is compared with: computed now when the model is
    held in memory (writing spends it), else read once the parts are written."""
    if work.resident:
        out = work.outputs(ids, level)
        return lambda: out
    return lambda: work.outputs(ids, level)


def source_reader(source: Source, ids: torch.Tensor, dtype: torch.dtype, streamed: bool,
                  device: torch.device | str) -> Reader:
    def read(dtype: torch.dtype = dtype, jitter: bool = False, on_load: Callable | None = None) -> torch.Tensor:
        return read_outputs(source, ids, dtype, streamed, jitter=jitter, on_load=on_load, device=device,
                            compact=True)
    return read


def model_reader(model, ids: torch.Tensor) -> Reader:
    """Reads a model held in memory (a copy of it, where its weights change)."""
    def read(dtype: torch.dtype | None = None, jitter: bool = False, on_load: Callable | None = None):
        if any(p.device.type == "meta" for p in model.parameters()):
            raise SurgeryError("internal: the model was written (spent) before its tolerance was measured")
        m = model if dtype is None and on_load is None else copy.deepcopy(model).to(dtype or model.dtype)
        if on_load is not None:
            on_load(m, Part((), ()), lambda name, p: (name,))
        with FORWARDS.timed(), jittered(m) if jitter else nullcontext():
            return outputs(m, ids)
    return read


def _perturbing(storage: torch.dtype, seed: int, keys: frozenset[str] | None) -> Callable:
    """An ``on_load``: every floating parameter of the part entered that was read from one of
    ``keys`` (None: every one) perturbed as storing in ``storage`` rounds it (``precision.perturb``),
    seeded by draw and name, so every plan draws the same."""
    def perturb(model, part: Part, keys_of: Callable) -> None:
        for name, p in model.named_parameters():
            if (p.device.type != "meta" and p.is_floating_point() and (not part.scope or inside(name, part.scope))
                    and (keys is None or any(k in keys for k in keys_of(name, p)))):
                precision.perturb(p.data, storage, seed * 7919 + zlib.crc32(name.encode()))
    return perturb


def read_outputs(source: Source, ids: torch.Tensor, dtype: torch.dtype, streamed: bool, *, stock: bool = False,
                 jitter: bool = False, on_load: Callable | None = None,
                 device: torch.device | str, compact: bool = False) -> torch.Tensor:
    """``source``'s outputs on ``ids`` in ``dtype`` on ``device``, read part by part (or whole);
    ``compact``: logits as a :class:`parity.HeadInput` where they can be (:meth:`Work.outputs`)."""
    work = Work(source, dtype, streamed=streamed, stock=stock, on_load=on_load, device=device)
    try:
        return work.outputs(ids, jitter=jitter, compact=compact)
    finally:
        work.close()


def check_written(folder: Path, records: list[dict], tolerances: Tolerances, anchor: torch.Tensor,
                  storage: torch.dtype, model, force: bool = False,
                  failure: Callable[[Comparison], str] | None = None, rounded: set[str] = frozenset()) -> dict:
    """Load ``folder`` back (with the plain stock class first, where every record says it computes
    the same function) and compare its outputs with ``anchor`` (weights stored in ``storage``). A
    false plain claim is corrected in the folder; a folder that does not compute the anchor's
    function is an error, unless ``force``: then it stays and its comparison says so. Returns what
    was checked.

    ``storage`` coarser than the arithmetic: ``anchor`` is the model before the cast, and the
    folder may differ from it by what the cast of the tensors it rounded (``rounded``) costs: the
    null distribution is measured around the folder itself, those tensors perturbed as the cast
    rounds (the same statistics, whether the model before the cast is still held or was spent
    writing)."""
    t = tolerances
    if t.device is None:
        raise SurgeryError("internal: the tolerances of a written folder's check need the device it is read to")
    cast = t.dtype in TOLERANCE and coarser(storage, t.dtype)

    def check(stock: bool) -> Comparison:
        def read(dtype: torch.dtype = t.dtype, jitter: bool = False, on_load: Callable | None = None):
            return read_outputs(Source.open(folder), t.ids, dtype, t.streamed, stock=stock, jitter=jitter,
                                on_load=on_load, device=t.device, compact=True)
        out = read()
        c = compare(anchor, out, t.output)
        if not cast:
            return t.judge(c, storage)
        what = f"the written folder with the {len(rounded)} tensors the cast rounded"
        return t.around(out, read, frozenset(rounded), what).judge(c, storage)

    plain = None
    if all(r.get("stock_equivalent") for r in records):
        plain = check(stock=True)
        if plain.ok or (force and not records):
            return {"loader": "plain transformers", "comparison": plain.as_dict()}
        mark_not_stock(model, records, folder)
    if not records:
        raise SurgeryError(failure(plain) if failure else f"the saved checkpoint does not compute what was checked "
                           f"before saving ({beyond(plain)}); nothing was saved")
    ours = check(stock=False)
    if not ours.ok and not force:
        raise SurgeryError(failure(ours) if failure else f"the saved checkpoint, loaded back with normsurgery's "
                           f"runtime, does not compute what was checked before saving ({beyond(ours)}); nothing "
                           "was saved")
    return {"loader": "trust_remote_code=True or normsurgery.load", "comparison": ours.as_dict(),
            "plain_transformers": None if plain is None else plain.as_dict()}


# ---------------------------------------------------------------------------------------------
# saving


@dataclass
class Saved:
    """What :func:`save_work` wrote and checked."""

    info: dict  # the folder, its files, claims
    comparison: Comparison | None  # the written folder against the anchor
    kept_float32: list[str]
    warning: str | None


@dataclass
class Check:
    """How :func:`save_work` checks what it wrote: the folder read back and its outputs compared with
    ``anchor()`` (called once the parts are written) by ``tolerances`` (no anchor: nothing is read
    back, and nothing is claimed); ``before_check`` runs between the writing and the reading (the
    steps' own checks), anchor or not; ``failure(comparison)`` words the error when the folder
    differs."""

    tolerances: Tolerances | None = None
    anchor: Callable[[], torch.Tensor] | None = None
    before_check: Callable[[], None] | None = None
    failure: Callable[[Comparison], str] | None = None


def save_work(work: Work, out, *, storage: torch.dtype, record: Callable[[Comparison | None], dict],
              check: Check | None = None, level: int | None = None, force: bool = False, on_overflow: str = "refuse",
              max_shard_size: str | int = MAX_SHARD_SIZE, progress: Progress = no_progress,
              extra: Callable[[Path], None] | None = None) -> Saved:
    """Write ``work`` (at ``level``, default its last) to ``out`` atomically: the weights cast to
    ``storage`` (a tensor that does not fit it is refused or kept in float32, ``on_overflow``),
    the config with ``record(comparison)`` (the folder's check, or None), the overall parity and
    the module records, the runtime where modules were rebuilt, the source's side files
    (``extra(folder)`` adds more); then the folder read back and checked as ``check`` says
    (:class:`Check`). The work is spent."""
    from transformers.utils.hub import convert_file_size_to_int

    level = len(work.steps) if level is None else level
    history = earlier_records(getattr(work.model.config, "normsurgery", None))  # before stamp replaces it
    with writing(out, force=force, source=work.source.path if work.source is not None else None) as stage:
        lost = []
        writer = ShardWriter(stage.path, convert_file_size_to_int(max_shard_size),
                             header_room(saved_tensors(work.model, meta=True)))
        work.write(writer, storage, level, lost, progress)
        files = writer.close()
        precision.check_policy(lost, storage, on_overflow)
        kept = [x.name for x in lost]
        work.close()  # the spare tensors too: the checks' forwards read parts of their own
        check = check or Check()
        reference = check.anchor() if check.anchor is not None else None
        if check.before_check is not None:
            check.before_check()
        if work.restore:
            work.restore()
        loads_as = torch.float32 if kept else storage
        records = stamp(work.model, {"kept_float32": kept} if kept else None)
        write_config(work.model, stage.path, loads_as)
        finish(stage.path, records, work.source)
        if extra is not None:
            extra(stage.path)
        reload = None
        if reference is not None:
            progress("check", 0, 1)
            reload = check_written(stage.path, records, check.tolerances, reference, storage, work.model, force,
                                   check.failure, work.rounded)
            progress("check", 1, 1)
        comparison = None if reload is None else Comparison(
            **{k: v for k, v in reload["comparison"].items() if k not in ("ok", "failed")})
        done = record(comparison)  # a plain save (no record) writes the config save_pretrained writes
        done = {**done, **({"parity": overall(reload)} if reload and done else {}),
                **({"kept_float32": kept} if kept else {}), **({"history": history} if history else {})}
        stamp(work.model, done)
        save_config(work.model.config, stage.path)
        modelcard.write(stage.path, done, reload, work.model.config, Path(out).name)
    info = written(out, stage, {**claims(records, reload), "shards": len(files)})
    return Saved(info, comparison, kept, precision.warning(lost, storage) if lost else None)


def overall(reload: dict) -> dict:
    """The record's overall parity: how the written folder loads and what it computes against the
    reference (statistics, tolerances and verdict)."""
    c = reload["comparison"]
    keys = ("output", "relative", "kl", "top1", "cosine", "tolerance", "kl_tolerance", "reason", "ok", "failed")
    return {"loader": reload["loader"], **{k: c.get(k) for k in keys}}


def earlier_records(record: dict | None) -> list[dict]:
    """The steps that made the input, earliest first: its record's own history, then its record
    (without the module records, which describe that folder's modules: the output's are its own)."""
    if not record:
        return []
    own = {k: v for k, v in record.items() if k not in ("history", "modules")}
    return [*(record.get("history") or []), *([own] if own else [])]


def save(model, out, *, record: dict | None = None, ids: torch.Tensor | None = None, source=None,
         force: bool = False, max_shard_size: str | int = MAX_SHARD_SIZE, extra: Callable[[Path], None] | None = None,
         progress: Progress = no_progress) -> dict:
    """Save a model held in memory (rewritten, pruned, healed) to ``out`` with :func:`save_work`,
    checked: the folder read back, on the model's device, against the model's outputs on ``ids``
    (default: random tokens); ``source`` (a checkpoint): where it came from, whose side files are copied. The model
    is spent. Returns what was written (the folder, its files, how it loads)."""
    source = None if source is None else Source.open(source)
    if ids is None:
        ids = probe_ids(None, model.config.vocab_size, None, 2, min(32, positions(model.config) or 32))
    dtype = next(model.parameters()).dtype
    restore = faithful_norms(model) if dtype == torch.float64 else None  # as the folder is read back
    reference = outputs(model, ids)
    if restore:
        restore()
    tolerances = Tolerances(model_reader(model, ids), ids, dtype, reference, output=output_kind(model),
                            device=devices.of(model))
    return save_work(Work(source, model=model), out, storage=load_dtype(model), record=lambda _: record or {},
                     check=Check(tolerances, lambda: reference), force=force, max_shard_size=max_shard_size,
                     extra=extra, progress=progress).info
