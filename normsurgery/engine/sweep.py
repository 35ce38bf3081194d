"""The sweep: one executor over parts. Every model convert, verify, prune and heal read, rewrite,
check and write goes through it, whether the whole model is in memory or one part at a time.

A :class:`Work` is a model cut into parts (:func:`plan.plan`): a :class:`CheckpointWork`'s is a
model of a checkpoint (``source.Source``) built on the meta device (no memory for weights), a
:class:`ModelWork`'s a model given in memory. "In memory" is the plan of one part
holding the whole model, loaded once and kept (``resident``). A part is *entered* (its tensors
read from the files, cast to the working dtype, then brought to a level: the first ``level``
rewrite steps applied to it with the Layout restricted to it: ``scan.run_step``) and *left*
(freed, unless resident). So:

- outputs (:meth:`Work.outputs`): a forward pass whose hooks enter each part before its first
  module runs and leave it after its last; the outputs are the whole model's;
- writing (``writer.write_parts``): each part entered at the last level, its tensors cast to the
  storage dtype (``precision.for_storage``: checked for overflow and underflow) and appended to
  the output shards, then freed; where every step says what it reads (``registry.Pass.reads``),
  the part's other parameters are never read, their stored bytes copied (:meth:`Work.unread`);
- the written folder is checked as any checkpoint is read: a :class:`Work` over it, with the
  stock class where loading with plain transformers is claimed (``writer.save_work``,
  ``check.check_written``).

The arithmetic of a part is the same in either plan, tensor for tensor, so both write the same
tensors. Memory is about one part plus one tensor being read or written when streaming.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..core import devices, memory, registry
from ..io.loader import Loader
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.families import layout
from ..core.norms import faithful_norms
from ..core.parity import Comparison, HeadInput, jittered, outputs
from .plan import Part, Step, StepSpec, check_applies, plan
from ..core.registry import PassContext, PassReport
from .scan import run_step, scan_ahead
from ..io.shards import Reader as ShardReader, inside


class Work:
    """The executor over a model's parts (see the module docstring), in either of its two modes:
    :class:`CheckpointWork` reads the parts from a checkpoint and frees them, :class:`ModelWork`
    wraps a model already in memory (one resident part, nothing read). A part entered is brought
    to a level of the rewrite ``steps``; ``context``: what the steps' passes are given; ``device``:
    where the forwards run. ``on_load(model, part, keys_of)``: called once a part read is at the
    level asked for (``keys_of(name, parameter)``: the checkpoint keys it was read from).
    ``meter``: counts its forwards.

    ``changed``: the parameters a step changed (:func:`changed`), by identity, none kept alive:
    they are written from memory; one read and left alone is copied as stored
    (``writer.write_parts``). Nothing is set on the model's parameters."""

    spends = False  # writing a part spends it (read from a checkpoint), or leaves the model as it was (given)
    restore: Callable[[], None] | None = None  # undoes what reading changed in the model (float64 norms)
    on_load: Callable | None = None

    def __init__(self, source: Source | None, model, device: torch.device, *, dtype: torch.dtype | None = None,
                 streamed: bool = False, alone: bool = False, meter: Meter | None = None):
        self.source, self.model, self.device, self.streamed, self.alone = source, model, device, streamed, alone
        self.dtype = dtype or next(model.parameters()).dtype
        self.parts = plan(model, layout(model), streamed, alone)
        self.resident = not streamed
        self.level: dict[Part, int] = {}  # parts held, and how many steps they went through
        self.rewritten: set[Part] = set()  # parts freed after a step rewrote them
        self.steps: list[StepSpec] = []
        self.context = PassContext()
        self.known: dict[tuple[int, int], dict] = {}  # (step, stage) -> the whole-model facts its scans gathered
        self.reports: dict[int, dict[Part, PassReport]] = defaultdict(dict)  # step -> part -> its report
        self.changed = WeakIdKeyDictionary()  # parameter -> True
        self.meter = Meter() if meter is None else meter

    def replan(self) -> None:
        """The parts again, after the model's blocks changed (``prune_model``); parts held are kept
        (a one-part plan) or must have been left."""
        held = {part.scope: level for part, level in self.level.items()}
        self.parts = plan(self.model, layout(self.model), self.streamed, self.alone)
        self.level = {p: held[p.scope] for p in self.parts if p.scope in held}

    def read(self, part: Part, unread: frozenset[int] = frozenset()) -> bool:
        """Read ``part`` unless held, but the parameters ``unread`` (ids); True when read now."""
        raise NotImplementedError

    def stored(self, p):
        """The stored tensor parameter ``p`` was read from (``checkpoint.Loader.stored``), or None."""
        raise NotImplementedError

    def leave(self, part: Part, force: bool = False) -> None:
        """Free ``part`` (a resident part only when ``force``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free every part."""
        raise NotImplementedError

    def unread(self, part: Part, level: int, copied: Callable) -> dict[int, tuple]:
        """{id: (parameter, version)} of ``part``'s parameters left unread on entering it."""
        raise NotImplementedError

    def fresh(self) -> Work:
        """A new work over the same plan and steps, nothing read yet (streamed: where scans read)."""
        raise NotImplementedError

    def enter(self, part: Part, level: int = 0, copied: Callable | None = None) -> None:
        """Read ``part`` (unless held) and apply steps up to ``level`` to it, their scans run first
        (``scan.scan_ahead``). ``copied(p)``: True where parameter ``p`` can be written without
        being read (its stored bytes); then those no step declares it reads (``registry.Pass.reads``)
        stay unread, on the meta device (:meth:`unread`)."""
        scan_ahead(self, level)
        unread = self.unread(part, level, copied) if copied is not None else {}
        read = self.read(part, frozenset(unread))
        if self.level[part] > level:
            raise SurgeryError(f"internal: part {part.scope[:1]} is at step {self.level[part]}, past {level}")
        with RefuseUnread() if unread else nullcontext():
            for i in range(self.level[part], level):
                step = self.steps[i]
                check_applies(self.model, step.pass_name, layout(self.model, part.scope))
                before = versions(self.model)
                report = run_step(self, i, part.scope)
                everything = step.kind == "trained" or not step.tracked
                self.changed.update((p, True) for p in changed(self.model, before, everything))
                if report is not None:  # a part rewritten again (read again) reports again
                    self.reports[i][part] = report
                self.level[part] = i + 1
        if unread:
            left_unread(self.model, part, unread)
        if read and self.on_load is not None:
            self.on_load(self.model, part, self.stored_keys)

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
        head = compact_head(self) if compact and not jitter and level == 0 else None
        with self.meter.timed(), self.running(level), jittered(self.model) if jitter else nullcontext(), \
                capture(head) if head is not None else nullcontext() as seen:
            out = outputs(self.model, ids, self.device)
        memory.trim()  # the forward's activations, freed after the last part: back to the system
        return out if head is None else head_input(self, head, seen)

    def load_all(self, level: int = 0):
        """The whole model in memory at ``level`` (one-part plans: the model to train or mask)."""
        if self.streamed:
            raise SurgeryError("internal: load_all on a streamed plan")
        self.enter(self.parts[0], level)
        return self.model


class ModelWork(Work):
    """A model already in memory: one resident part, held from the start, computed where it is;
    ``source``, if any, is where it came from (its side files are copied on saving). Writing it
    leaves it as it was."""

    def __init__(self, model, source: Source | None = None):
        super().__init__(source, model, devices.of(model))
        self.level = {p: 0 for p in self.parts}

    def read(self, part: Part, unread: frozenset[int] = frozenset()) -> bool:
        return False  # every part is held

    def stored(self, p):
        return None

    def leave(self, part: Part, force: bool = False) -> None:
        pass  # the model stays

    def close(self) -> None:
        pass

    def unread(self, part: Part, level: int, copied: Callable) -> dict[int, tuple]:
        return {}


class CheckpointWork(Work):
    """A model of the checkpoint ``source`` built on the meta device, its parts read (onto
    ``device``, in ``dtype``; ``stock``: the stock class) and freed part by part (see the module
    docstring). ``streamed``: a part per block (else one, resident); ``alone``: the two ends parts
    of their own (reading only)."""

    spends = True

    def __init__(self, source: Source, dtype: torch.dtype, *, streamed: bool = False, alone: bool = False,
                 stock: bool = False, on_load: Callable | None = None, device: torch.device | str,
                 meter: Meter | None = None):
        model = source.meta_model(dtype, stock)
        super().__init__(source, model, torch.device(device), dtype=dtype, streamed=streamed, alone=alone,
                         meter=meter)
        self.restore = faithful_norms(model) if dtype == torch.float64 else None
        self.loader = Loader(model, source, dtype, self.device)
        self.on_load = on_load
        if streamed:
            memory.map_large_blocks()  # freed parts go back to the system at once

    def fresh(self) -> CheckpointWork:
        """A new work over the same checkpoint, plan and steps, nothing read yet: a rewritten part
        (its modules changed) cannot be read again into the same model."""
        work = CheckpointWork(self.source, self.dtype, streamed=self.streamed, device=self.device, meter=self.meter)
        work.steps, work.context, work.known = self.steps, self.context, self.known
        return work

    def read(self, part: Part, unread: frozenset[int] = frozenset()) -> bool:
        """Read ``part`` unless held (then at level 0), but the parameters whose ids are in
        ``unread``; True when it was read now."""
        if part in self.rewritten:
            raise SurgeryError(f"internal: part {part.scope[:1]} was rewritten and freed: it cannot be read again")
        if part in self.level:
            return False
        self.loader.load(part.scope, unread)
        self.level[part] = 0
        return True

    def stored_keys(self, name: str, p) -> tuple[str, ...]:
        """The checkpoint's keys parameter ``p`` (named ``name``) was read from."""
        stored = self.loader.stored(p)
        return tuple(stored.keys) if stored is not None else (name,)

    def stored(self, p):
        return self.loader.stored(p)

    def leave(self, part: Part, force: bool = False) -> None:
        if part in self.level and (force or not self.resident):
            self.loader.free(part.scope)
            if self.level.pop(part):
                self.rewritten.add(part)

    def close(self) -> None:
        """Free every part; the loader gives its spare tensors back and closes the files (a part
        entered later reads them again)."""
        for part in list(self.level):
            self.leave(part, force=True)
        self.loader.close()

    def unread(self, part: Part, level: int, copied: Callable) -> dict[int, tuple]:
        """{id: (parameter, version)} of the parameters of ``part`` (not held yet) that the steps up
        to ``level`` leave alone, each pass saying what it reads (``registry.Pass.reads``; none
        if one does not say), and ``copied`` can write as stored; empty when the part is held or
        read to compute outputs (``on_load``)."""
        if self.on_load is not None or part in self.level:
            return {}
        needed: set[str] = set()
        for step in self.steps[:level]:
            reads = registry.get(step.pass_name).reads
            if reads is None:
                return {}
            needed |= reads(layout(self.model, part.scope), step.options)
        scope = tuple(needed)
        return {id(p): (p, p._version) for p, uses in self.loader.uses(part.scope)
                if p.device.type == "meta" and not any(inside(full, scope) for *_, full in uses) and copied(p)}


class RefuseUnread(TorchDispatchMode):
    """Refuses an operation that mixes a parameter left unread (meta) with tensors read: in place,
    torch would leave the tensor read unchanged without a word."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        metas = {t.device.type == "meta" for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if len(metas) > 1:
            raise SurgeryError(f"internal: {func} reads a parameter its pass does not declare it reads "
                               "(registry.Pass.reads): it was left unread")
        return func(*args, **kwargs)


def left_unread(model, part: Part, unread: dict[int, tuple]) -> None:
    """Refuse a part whose steps made a parameter from one left unread: every parameter still on
    the meta device must be one left unread, unchanged (its version as read)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device.type == "meta" and inside(name, part.scope):
            was = unread.get(id(p))
            if was is None or was[0] is not p or was[1] != p._version:
                raise SurgeryError(f"internal: {name} was computed from a parameter left unread (its pass does not "
                                   "declare what it reads: registry.Pass.reads)")


def compact_head(work: Work):
    """The head module when ``work``'s logits are a plain linear map of the head's input stored as
    one tensor (:meth:`Work.outputs`), else None."""
    if work.on_load is not None:
        return None
    lay = layout(work.model)
    if lay.head is None or lay.objective != "causal-lm" or not lay.plain_logits:
        return None
    head = work.model.get_submodule(lay.head)
    if type(head) is not torch.nn.Linear:
        return None
    stored = work.stored(head.weight)  # None: a model given in memory
    if stored is None or stored.stack is not None or work.source.index[stored.keys[0]].tensor is not None:
        return None
    if work.resident and head.weight in work.changed:
        return None
    return head


def head_input(work: Work, head, seen: dict) -> HeadInput:
    """The logits as :func:`capture` saw ``head``'s input, its rows read from the checkpoint (each
    slab's read opens the file and closes it: nothing is left open once the work is closed)."""
    key, vocab, index, dtype = work.stored(head.weight).keys[0], head.weight.shape[0], work.source.index, work.dtype

    def rows(i: int, j: int) -> torch.Tensor:
        reader = ShardReader(index)
        try:
            return reader.read_rows(key, i, j, dtype)
        finally:
            reader.close()
    return HeadInput(seen["hidden"], rows, seen["bias"], vocab)


def steps_with(work: Work, parities: dict[int, Comparison], written: Comparison | None = None) -> list[Step]:
    """Each step of ``work`` with its notes, metrics and parity (``parities``: step -> its own, where
    measured; a lone exact step's, where nothing else measured it, is ``written``: the written
    folder's check); a pass's reference step that did nothing left out."""
    out = []
    for i, s in enumerate(work.steps):
        if s.kind == "reference" and not work.reports[i]:
            continue
        notes, metrics = step_reports(list(work.reports[i].values()))
        out.append(Step(s.name, s.kind, s.options, notes, metrics, parities.get(i)))
    if len(out) == 1 and out[0].kind == "exact" and out[0].parity is None:
        out[0].parity = written
    return out


def step_reports(reports: list[PassReport]) -> tuple[list[str], dict]:
    """A step's notes (merged over its parts' ``reports``: :func:`merge_notes`) and metrics
    (integers summed over parts): the same in every plan."""
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


def versions(model) -> dict[int, tuple]:
    """{id(parameter): (parameter, version counter, data pointer)} of ``model``'s parameters in
    memory, before a step runs (:func:`changed` after it)."""
    return {id(p): (p, p._version, p.data_ptr()) for p in model.parameters() if p.device.type != "meta"}


def changed(model, before: dict[int, tuple], everything: bool = False) -> list[torch.nn.Parameter]:
    """The parameters of ``model`` in memory that a step changed since ``before`` (:func:`versions`):
    written in place (torch counts in-place writes in ``_version``, those under ``no_grad`` too;
    not those through ``.data``, which no built-in pass makes: ``registry.Pass.tracked``), given
    another tensor (``.data =``), or new; ``everything``: all of them (a trained step: the
    optimiser may write in any way; a pass not known to be tracked)."""
    out = []
    for p in model.parameters():
        was = before.get(id(p))
        if p.device.type != "meta" and (everything or was is None or was[0] is not p or was[1] != p._version
                                        or was[2] != p.data_ptr()):
            out.append(p)
    return out


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

# ---------------------------------------------------------------------------------------------
# the checks' forwards, counted


class Meter:
    """Forward passes run for checks, and the seconds they took (streamed: the parts they read
    included): a :class:`Work`'s (:meth:`Work.outputs`), and those of the works that read what it
    is checked against (``check.read_outputs``); a convert reports its work's."""

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
