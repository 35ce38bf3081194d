"""The writer: each part of a :class:`sweep.Work` cast to the storage dtype and appended to the
output shards (:func:`write_parts`: raw bytes where a tensor is unchanged, a part no step runs on
copied unread), then the config, records and side files, and the folder read back and checked
(:func:`save_work`, :func:`save_model`), into the stage of the output its job claimed
(``runner``, ``output.staged``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..core import precision
from .check import CheckPlan, Tolerances, check_written, model_reader
from ..io.checkpoint import claims, finish, load_dtype, save_config, stamp, write_config
from ..io.loader import check_finite
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.families import positions
from ..core.norms import faithful_norms
from ..core.limits import parse_size
from ..core.options import MAX_SHARD_SIZE
from ..io.output import Claim, Staged, staged, written
from ..core.parity import Comparison, output_kind, outputs, probe_ids
from .plan import Part, Step
from ..core.progress import Progress, no_progress
from ..io.shards import ShardWriter, header_room, saved_tensors
from .sweep import ModelWork, Work, steps_with


def write_parts(work: Work, shards: ShardWriter, storage: torch.dtype, level: int, lost: list,
                progress: Progress = no_progress) -> set[str]:
    """Every part of ``work`` at ``level``, cast to ``storage`` (each tensor checked: ``lost``
    collects those that do not fit), appended to ``shards``, then freed: a model read is spent (a
    model given in memory is left as it was, its tensors cast to new memory where they are).
    Returns the tensors cast to a narrower dtype (the rest: as stored)."""
    rounded: set[str] = set()
    for i, part in enumerate(work.parts):
        progress("write", i, len(work.parts))
        if not _copy_untouched(work, part, level, shards, storage):
            work.enter(part, level, _copyable(work, part, storage))
            _write_part(work, part, shards, storage, lost, rounded)
            work.leave(part, force=True)  # a model given in memory stays as it was
        progress("write", i + 1, len(work.parts))
    return rounded


def _copyable(work: Work, part: Part, storage: torch.dtype) -> Callable:
    """Whether a parameter of ``part``, not read yet, could be written as its stored bytes: saved
    under its own name (not renamed on saving) and :func:`_unchanged` if no step changes it."""
    names = set(saved_tensors(work.model, part.scope or None, meta=True))
    saved = {id(p) for n, p in work.model.named_parameters(remove_duplicate=False) if n in names}
    return lambda p: id(p) in saved and _unchanged(work, p, storage, held=False) is not None


def _write_part(work: Work, part: Part, shards: ShardWriter, storage: torch.dtype, lost: list,
                rounded: set[str]) -> None:
    """The tensors of ``part``, entered, appended to ``shards`` (no view of them is left on
    return: the loader reuses the part's tensors)."""
    saved = saved_tensors(work.model, part.scope or None)
    users = Counter(t.untyped_storage().data_ptr() for t in saved.values())
    params = dict(work.model.named_parameters(remove_duplicate=False))
    for name, t in saved.items():  # a storage two names write is cast, not spent
        held = t.device.type != "meta"  # else left unread (``Work.enter``)
        key = _unchanged(work, params.get(name), storage, held)
        if key is not None:  # read (and checked) on entering, no pass changed it: its bytes; or left
            # unread: its bytes, each chunk checked for NaN or Inf as reading it would
            check = None if held else lambda c, key=key: check_finite(c, key, work.source)
            shards.copy(name, work.loader.reader, key, check)  # a key: a checkpoint's (``_unchanged``)
            continue
        if not held:
            raise SurgeryError(f"internal: {name} was left unread and cannot be copied as stored")
        spend = work.spends and users[t.untyped_storage().data_ptr()] == 1
        narrowed = t.is_floating_point() and torch.finfo(t.dtype).bits > torch.finfo(storage).bits
        t = precision.for_storage(name, t, storage, lost, spend) if t.is_floating_point() else t
        if narrowed and t.dtype == storage:
            rounded.add(name)
        shards.add(name, t)


def _unchanged(work: Work, p, storage: torch.dtype, held: bool = True) -> str | None:
    """The stored key whose bytes are what writing parameter ``p`` in ``storage`` would write,
    or None: ``p`` was read from one stored tensor (not merged from several, not pickled) in a
    dtype that holds it exactly, is written in the dtype it is stored in, and no step changed
    it (``Work.changed``); ``held``: it is in memory (else: not read yet, on the meta
    device)."""
    if p is None or (p.device.type == "meta") == held:
        return None
    stored = work.stored(p)  # None: a model given in memory
    if stored is None or stored.stack is not None or p in work.changed:
        return None
    e = work.source.index[stored.keys[0]]
    if e.tensor is not None or tuple(p.shape) != e.shape:
        return None
    if e.dtype.is_floating_point:
        exact = e.dtype == work.dtype or (torch.finfo(work.dtype).bits > torch.finfo(e.dtype).bits
                                          and work.dtype != torch.bfloat16)
        if e.dtype != storage or not exact:
            return None
    elif e.dtype != p.dtype:
        return None
    return stored.keys[0]


def _copy_untouched(work: Work, part: Part, level: int, shards: ShardWriter, storage: torch.dtype) -> bool:
    """Write ``part`` without reading it when no step is to run on it (``level`` 0: a prune's
    kept blocks under their new names, a checkpoint written unchanged) and each of its tensors
    is one stored tensor written as stored (:func:`_unchanged`): its bytes are copied, each
    chunk checked for NaN or Inf as reading it would. False: it must be read."""
    if level != 0 or part in work.level or part in work.rewritten:  # a model given holds every part
        return False
    params = dict(work.model.named_parameters(remove_duplicate=False))
    keys = {}
    for name in saved_tensors(work.model, part.scope or None, meta=True):
        keys[name] = _unchanged(work, params.get(name), storage, held=False)
        if keys[name] is None:  # a buffer, a merged tensor, a cast: read it
            return False
    for name, key in keys.items():
        shards.copy(name, work.loader.reader, key, lambda t, key=key: check_finite(t, key, work.source))
    return True


@dataclass
class Storage:
    """How the weights are stored: in ``dtype``, a tensor that does not fit it refused or kept in
    float32 (``on_overflow``: ``precision.check_policy``), in shards of at most ``shard_bytes`` bytes
    (``options.Sharded.shard_bytes``: parsed and checked with the options, before any work)."""

    dtype: torch.dtype
    on_overflow: str = "refuse"
    shard_bytes: int = parse_size(MAX_SHARD_SIZE)


@dataclass
class Record:
    """What the saved config records under "normsurgery", as data: ``fields``; with ``parities`` (a
    convert's: step -> its parity, where measured), "passes" after them: the work's steps as they
    report once written (``sweep.steps_with``: a lone exact step's parity is the written folder's
    own), then ``last``. Empty: the config ``save_pretrained`` writes."""

    fields: dict = field(default_factory=dict)
    parities: dict[int, Comparison] | None = None
    last: dict = field(default_factory=dict)

    def of(self, work: Work, written: Comparison | None) -> tuple[dict, list[Step]]:
        """The record of ``work`` once written (``written``: the folder's check, or None), and its steps."""
        if self.parities is None:
            return dict(self.fields), []
        steps = steps_with(work, self.parities, written)
        return {**self.fields, "passes": [s.record() for s in steps], **self.last}, steps


@dataclass
class Saved:
    """What :func:`save_work` wrote and checked."""

    info: dict  # the folder, its files, claims
    comparison: Comparison | None  # the written folder against the anchor
    kept_float32: list[str]
    warning: str | None
    steps: list[Step]  # the work's steps as recorded (:meth:`Record.of`)


def save_work(work: Work, out, *, storage: Storage, record: Record, check: CheckPlan | None = None,
              force: bool = False, progress: Progress = no_progress,
              extra: Callable[[Staged], None] | None = None) -> Saved:
    """Write ``work`` (at its last level) to ``out`` atomically: the weights as ``storage`` says,
    the config with ``record`` (:meth:`Record.of`), the overall parity and the module records, the
    runtime where modules were rebuilt, the source's side files (``extra(folder)`` adds more); then
    the folder read back and checked as ``check`` says (:class:`check.CheckPlan`: its outputs and
    tolerances measured before anything was written; None: not read back). The work is spent."""
    history = earlier_records(getattr(work.model.config, "normsurgery", None))  # before stamp replaces it
    with staged(out) as stage:  # the output its job claimed (``runner.claim_output``)
        lost = []
        shards = ShardWriter(stage.path, storage.shard_bytes,
                             header_room(saved_tensors(work.model, meta=True)))
        rounded = write_parts(work, shards, storage.dtype, len(work.steps), lost, progress)
        files = shards.close()
        precision.check_policy(lost, storage.dtype, storage.on_overflow)
        kept = [x.name for x in lost]
        work.close()  # the spare tensors too: the checks' forwards read parts of their own
        if check is not None and check.tolerances is not None and check.anchor is None:  # as stored (a prune's)
            check = replace(check, anchor=work.outputs(check.tolerances.ids))
        if work.restore:
            work.restore()
        records = stamp(work.model, {"kept_float32": kept} if kept else None)
        write_config(work.model, stage.path, torch.float32 if kept else storage.dtype)
        finish(stage.path, records, work.source)
        if extra is not None:
            extra(stage)
        reload = None
        if check is not None and check.tolerances is not None:
            progress("check", 0, 1)
            reload = check_written(stage.path, records, check, storage.dtype, work, force, rounded)
            progress("check", 1, 1)
        comparison = None if reload is None else Comparison(
            **{k: v for k, v in reload["comparison"].items() if k not in ("ok", "failed")})
        done, steps = record.of(work, comparison)  # no record: the config save_pretrained writes
        done = {**done, **({"parity": overall(reload)} if reload and done else {}),
                **({"kept_float32": kept} if kept else {}), **({"history": history} if history else {})}
        stamp(work.model, done)
        save_config(work.model.config, stage.path)
        stage.card("model", stage.path, record=done, reload=reload, config=work.model.config, name=Path(out).name)
    info = written(out, stage, {**claims(records, reload), "shards": len(files)})
    return Saved(info, comparison, kept, precision.warning(lost, storage.dtype) if lost else None, steps)


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


def save_model(model, claim: Claim, *, record: dict | None = None, ids: torch.Tensor | None = None, source=None,
               shard_bytes: int = Storage.shard_bytes, extra: Callable[[Staged], None] | None = None,
               progress: Progress = no_progress) -> dict:
    """Save a model held in memory (rewritten, pruned, healed) to the output ``claim`` (a job's:
    ``runner``) with :func:`save_work`, checked: the folder read back, on the model's device,
    against the model's outputs on ``ids`` (default: random tokens); ``source`` (a checkpoint):
    where it came from, whose side files are copied. The model is spent. Returns what was
    written (the folder, its files, how it loads)."""
    source = None if source is None else Source.open(source)
    if ids is None:
        ids = probe_ids(None, model.config.vocab_size, None, 2, min(32, positions(model.config) or 32))
    dtype = next(model.parameters()).dtype
    restore = faithful_norms(model) if dtype == torch.float64 else None  # as the folder is read back
    reference = outputs(model, ids)
    if restore:
        restore()
    tolerances = Tolerances(model_reader(model, ids), ids, dtype, reference, output=output_kind(model))
    return save_work(ModelWork(model, source), claim.path,
                     storage=Storage(load_dtype(model), shard_bytes=shard_bytes), record=Record(record or {}),
                     check=CheckPlan(tolerances, reference), force=claim.force, progress=progress, extra=extra).info
