"""heal's teacher: the model before the cut, found from the input's record or given (--teacher),
and the objective chosen by it (``kd`` where a teacher is known, ``ce`` otherwise).

From the record (the input was pruned by layers from a model that opens here): the original is
read once, its held-out CE measured, its logits on probe windows kept, and of it only the blocks
the cut removed are held (``teacher.Cut``); the teacher is the student's own modules with those
put back (``teacher.LayerCut``: tensors shared), checked to compute what the original computed on
the probe windows (to the rounding of the dtype) before any training: an input whose kept blocks
changed since the cut (healed, edited) is refused in one line. ``--teacher PATH`` naming another
model: that model, read whole and frozen (``teacher.Frozen``: a full copy beside the student).

Figures against the teacher: KL(teacher || model) per predicted token at T = 1, before and after,
on the held-out end and on --eval-text; its share closed, (KL_before - KL_after) / KL_before (the
teacher's own KL is 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..core import devices
from ..core.errors import SurgeryError
from ..core.options import HealOptions
from ..engine.runner import Job
from ..engine.sweep import CheckpointWork
from ..engine.teacher import EVAL, Cut, Distillation, Frozen, LayerCut, Teacher, cut_of
from ..engine.training import heldout_ce
from ..engine.writer import earlier_records
from ..io.source import Source

#: probe windows the assembled teacher is checked on
PROBES = 2


@dataclass
class Teaching:
    """A heal's teacher: ``given`` (a ``Cut`` of the student: the student's tensors shared; or a
    ``Teacher`` of its own) and its ``name``. ``live``: the Teacher :meth:`over` made of it over
    the student (:func:`heal.heal_model`'s, for the figures after training)."""

    given: Cut | Teacher
    name: str
    live: Teacher | None = None

    def over(self, model, trained=()) -> Teacher:
        """The live teacher for the student ``model`` whose parameters ``trained`` train."""
        self.live = (LayerCut(model, self.given, trained) if isinstance(self.given, Cut) else
                     self.given.over(model, trained) if hasattr(self.given, "over") else self.given)
        return self.live


@dataclass
class Original:
    """What the model before the cut gave: its CE on each window set (None: not measured), its
    name or why it was not measured (None, None: the input was not pruned), the teacher, or
    ``why`` none is known."""

    ce: list | None = None
    name: str | None = None
    teaching: Teaching | None = None
    reference: tuple | None = field(default=None, repr=False)  # (probe windows, the original's logits)
    why: str = "the input has no record of a prune"


def distill_with(teacher: Teaching | None, model, trained, opts: HealOptions) -> tuple[Distillation | None, str]:
    """(what the loop distils with, the objective): ``opts.objective``, default ``kd`` with a
    ``teacher`` and ``ce`` without; the teacher made live over the student ``model`` whose
    parameters ``trained`` train (None without one)."""
    goal = opts.objective or ("kd" if teacher is not None else "ce")
    if teacher is None:
        if goal != "ce":
            raise SurgeryError(f"objective {goal} distils from a teacher, and none was given")
        return None, goal
    return Distillation(teacher.over(model, trained), goal, opts.temperature, opts.ce_weight), goal


def taught(goal: str, teacher: Teaching | None, opts: HealOptions, result) -> dict:
    """What a heal's report says of its objective: it, the teacher's name, T and the CE weight where
    they apply, and the held-out KL before and after (``result``: the ``TrainResult``)."""
    return {"objective": goal, "teacher": teacher and teacher.name,
            "temperature": opts.temperature if goal != "ce" else None,
            "ce_weight": opts.ce_weight if goal == "kd+ce" else None, "kl_before": result.kl_before,
            "kl_after": result.kl_after}


def pruned_from(source: Source) -> dict | None:
    """The latest prune step of ``source``'s record (its own or its history's), or None."""
    steps = earlier_records(getattr(source.config, "normsurgery", None))
    return next((s for s in reversed(steps) if isinstance(s.get("prune"), dict)), None)


def objective(opts: HealOptions, teaching: Teaching | None, why_none: str) -> tuple[str, str]:
    """(the objective, why): ``opts.objective`` where given, else kd with a teacher and ce without."""
    if opts.objective is not None:
        if opts.objective != "ce" and teaching is None:
            raise SurgeryError(f"--objective {opts.objective} distils from a teacher and none is known ({why_none}): "
                               "give --teacher PATH (the model before the cut), or --objective ce")
        return opts.objective, "asked (--objective)" + ("" if teaching else f"; no teacher to measure against: {why_none}")
    if teaching is None:
        return "ce", f"no teacher: {why_none}"
    return "kd", f"the default where a teacher is known ({teaching.name})"


def same_model(a: str, b: str) -> bool:
    """Whether names ``a`` and ``b`` are the same model (the same hub id, or the same folder)."""
    here = Path(a).expanduser()
    return a == b or (here.exists() and here.resolve() == Path(b).expanduser().resolve())


def find_original(job: Job, held: list, mask_token_id: int | None, opts: HealOptions) -> Original:
    """The model ``job``'s input was pruned from (its record's prune source), read once where it opens
    here: CE on each of ``held`` (window sets; None: not measured), its logits on probe windows,
    and, its cut a layer cut the input still is, the removed blocks as the teacher's (unless
    ``opts.teacher`` names another model). Then ``opts.teacher`` where given (:func:`given_teacher`)."""
    step = pruned_from(job.source)
    if step is None:
        return Original(teaching=given_teacher(job, opts))
    name, prune = step.get("source", "?"), step["prune"]
    before = prune.get("layers_before")
    try:
        original = Source.open(name, job.source.allow_pickle)
    except SurgeryError as e:
        return Original(None, f"not available: {e}", given_teacher(job, opts), why=f"{name} does not open here")
    if original.config.num_hidden_layers != before or original.config.vocab_size != job.source.config.vocab_size:
        why = (f"not available: {name} has {original.config.num_hidden_layers} layers and a vocabulary of "
               f"{original.config.vocab_size}; the record pruned {before} layers of this vocabulary")
        return Original(None, why, given_teacher(job, opts), why=why)
    model = CheckpointWork(original, original.storage, device=job.device).load_all()
    ce = [None if w is None else heldout_ce(model, w, mask_token_id=mask_token_id) for w in held]
    if opts.teacher is not None and not same_model(opts.teacher, name):
        return Original(ce, name, given_teacher(job, opts))
    removed = prune.get("removed")
    if devices.sharding() or not removed or prune.get("layers_after") != job.source.config.num_hidden_layers:
        why = ("training sharded over processes (FSDP) distils from no teacher" if devices.sharding() else
               f"the input has {job.source.config.num_hidden_layers} layers; the record's cut left "
               f"{prune.get('layers_after')}")
        return Original(ce, name, given_teacher(job, opts), why=why)
    probe = held[0][:PROBES]
    reference = Frozen(model).targets(probe.to(job.device), EVAL, 0).float().cpu()
    return Original(ce, name, Teaching(cut_of(model, removed), name), (probe, reference))


def cut_teacher(job: Job, opts: HealOptions, cut: Cut) -> tuple[Teaching | None, HealOptions, str]:
    """``prune --heal``'s teacher, (it, ``opts`` with the objective chosen, why): the blocks ``cut``
    removed from ``job``'s input (held in memory, never read again) beside the student's own, or
    ``opts.teacher`` where it names another model."""
    teaching, why = Teaching(cut, job.source.name), ""
    if devices.sharding():
        teaching, why = None, "training sharded over processes (FSDP) distils from no teacher"
    elif opts.teacher is not None and not same_model(opts.teacher, job.source.name):
        teaching = given_teacher(job, opts)
    goal, why = objective(opts, teaching, why)
    return teaching, replace(opts, objective=goal), why


def given_teacher(job: Job, opts: HealOptions) -> Teaching | None:
    """``opts.teacher`` read whole and frozen (a model of its own: a full copy beside the student),
    its vocabulary the input's; None where not given."""
    if opts.teacher is None:
        return None
    if devices.sharding():
        raise SurgeryError("--teacher with training sharded over processes (FSDP) is not supported: heal on "
                           "data-parallel processes, or --objective ce without --teacher")
    source = Source.open(opts.teacher, job.source.allow_pickle)
    if source.config.vocab_size != job.source.config.vocab_size:
        raise SurgeryError(f"--teacher {opts.teacher} has a vocabulary of {source.config.vocab_size} and the input "
                           f"{job.source.config.vocab_size}: distillation compares their distributions token by token")
    model = CheckpointWork(source, source.storage, device=job.device).load_all()
    return Teaching(Frozen(model), opts.teacher)


def check_teacher(original: Original, model, opts: HealOptions) -> None:
    """Refuse, in one line, a teacher assembled from the student ``model`` that does not compute
    what the original computed on the probe windows (to the rounding of the dtype); with
    ``--objective ce`` (the teacher only measured against) it is dropped, and why said."""
    if original.reference is None or original.teaching is None:
        return
    probe, reference = original.reference
    ref = next(model.parameters())
    got = LayerCut(model, original.teaching.given).targets(probe.to(ref.device), EVAL, 0).float().cpu()
    scale = reference.abs().max().clamp_min(1.0).item()
    error = (got - reference).abs().max().item()
    original.reference = None
    if error <= 64 * torch.finfo(ref.dtype).eps * scale:
        return
    why = (f"the teacher assembled from this input and the blocks its record says were cut does not compute what "
           f"{original.name} computes (logits differ by up to {error:.3g}): the kept blocks changed since the cut "
           "(healed or edited?)")
    if opts.objective != "ce":
        raise SurgeryError(f"{why}; give --teacher PATH, or --objective ce")
    original.teaching, original.why = None, why


def kl_closed(before: float | None, after: float | None) -> float | None:
    """(KL_before - KL_after) / KL_before: the share of the distance to the teacher closed (None where
    not measured or no distance)."""
    return None if before is None or after is None or not before > 0 else (before - after) / before
