"""convert: apply registered passes to a checkpoint, check what it computes, save.

Weights are rewritten in a working dtype (float32, or float64 on request or for float64
checkpoints; every rewrite does its own algebra in float64; half precision is refused) and cast
to the storage dtype as they are written. The checks compare what the model's class outputs
(logits, or a base model's last hidden state) on probe text:
- overall: the written folder, read back (with the plain stock class where loading with plain
  transformers is claimed), against the reference: the input, or what the last step that changes
  the function on purpose (a mask, a trained pass) left; weights stored coarser than the
  arithmetic are allowed what storing in that dtype costs the reference (``parity``). An exact
  rewrite out of tolerance is not saved (``force`` saves it anyway);
- per step, for recipes of several steps: each step's outputs against those before it, in the
  working dtype.
They run in the natural order: the reference's and the steps' outputs
measured first (:class:`Checks`), the steps judged (an exact one out of tolerance refuses before
anything is written), the rewrite written, then the folder read back and compared with the outputs
in hand (``engine.check.CheckPlan``: data, no call back up into this module).
A one-step convert thus costs two forward passes (the reference and the written folder), plus
one where a tolerance beyond the arithmetic's must be measured (only when the first comparison
exceeds the arithmetic's own: the re-rounded reference, or the jittered one); the reference's
outputs are computed once and serve the tolerance too. The result (and ``--json``) reports the
forwards run and their seconds (``forwards``, ``seconds_check``; streamed: with the reads of the
parts they entered).

Plans (``plan``, ``sweep``): every pass blockwise, the model is read and rewritten one part at a time
(``streaming=None`` chooses it: it is the faster path at every size measured, and bounded in
memory), except where a pass scans the whole model first (minimize, mask, compensated-ln: one
more read per scan) and the model fits in memory; a pass that needs the whole model (training,
scores from a forward) gets the one-part plan, refused when the model would not fit in memory.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.version import __version__
from ..core import devices, memory, precision
from .. import passes as _passes  # noqa: F401  (passes: the built-in passes)
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.families import family
from ..core.layout import LM_OBJECTIVES
from ..core.options import PROBE_LENGTH, PROBE_SAMPLES, ConvertOptions, options_of
from ..core.parity import TOLERANCE, Comparison, beyond, coarser, compare, dtype_name, output_kind, probe_ids
from ..engine.check import CheckPlan, Reader, Tolerances, source_reader
from ..engine.plan import Step, StepSpec, check_applies, check_before_reading, plan, steps_of
from ..core.progress import Progress, no_progress
from ..engine.runner import Job, job_scope
from ..engine.sweep import CheckpointWork, ModelWork, Work, steps_with
from ..io.texts import text_of
from ..core.registry import Later, PassContext, check_text, load_recipe, parse_pass  # noqa: F401  (API)
from ..engine.processes import is_main_process
from ..engine.train_state import state_dir
from ..engine.teacher import frozen_distillation
from ..engine.training import heldout_ce, train
from ..engine.writer import Record, Saved, Storage, save_work
from .verify import as_dtype


@dataclass
class Result:
    steps: list[Step]
    work_dtype: str
    storage_dtype: str
    parity: Comparison | None = None  # the written folder vs the reference (the input, or the model the
    # last reference-changing or trained step left)
    from_input: Comparison | None = None  # that reference vs the input, when a step changed the function
    baseline: dict | None = None  # the null distribution the written folder's tolerance was measured
    # from (parity.Comparison.null), when one was needed
    saved: dict | None = None
    source: str | None = None
    streaming: str | None = None  # why it was rewritten one part at a time (None: in memory)
    kept_float32: list[str] | None = None  # tensors that do not fit the storage dtype, stored in float32
    warnings: list[str] | None = None
    device: dict | None = None  # where it computed (devices.describe)
    memory: dict | None = None  # bytes each plan needs, stated before loading (plan_memory)
    forwards: int = 0  # forward passes run for the checks (the reference, the written folder, a baseline)
    seconds_check: float = 0.0  # what they took (streamed: with the reads of the parts they entered)
    against: str = "the input"  # what the written folder was compared with (``parity``), in words

    @property
    def ok(self) -> bool:
        steps_ok = all(s.parity is None or s.parity.ok for s in self.steps if s.kind == "exact")
        return steps_ok and (self.parity is None or self.parity.ok)

    def as_dict(self) -> dict:
        def c(x):
            return x.as_dict() if x else None
        return {"source": self.source, "ok": self.ok, "work_dtype": self.work_dtype,
                "storage_dtype": self.storage_dtype, "steps": [s.as_dict() for s in self.steps],
                "parity": c(self.parity), "from_input": c(self.from_input), "baseline": self.baseline,
                "saved": self.saved,
                "streaming": self.streaming, "kept_float32": self.kept_float32, "warnings": self.warnings,
                "device": self.device, "memory": self.memory, "forwards": self.forwards,
                "seconds_check": self.seconds_check, "against": self.against}


#: the least top-1 agreement with the model before it that a step changing the function on purpose
#: (kind "reference": a mask, minimize's or compensated-ln's pruning) keeps before the result warns
#: that it is likely damaged (exit code 0: it was asked for). Measured on the probe of the trained
#: demo Llama (4 windows of 64 tokens): mild prunes keep 0.93-0.96 (mask sparsity 0.1: 0.957;
#: minimize prune_units 0.01 to 0.05: 0.934-0.938; sparsity 0.3: 0.863), destructive ones fall
#: below (sparsity 0.5: 0.766, 0.7: 0.438; prune_units 0.1: 0.664, 0.2: 0.559), while units chosen
#: by=activation stay above (0.1: 0.902, 0.3: 0.812). SmolLM2-135M-Instruct: prune_units 0.1 by
#: magnitude, whose output generated garbage, 0.152 (0.01: 0.219; sparsity 0.1: 0.770), and
#: prune_units 0.05 by=activation 0.844.
DAMAGING_TOP1 = 0.8


def work_dtype_for(storage: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    if requested is not None and requested not in TOLERANCE:
        raise SurgeryError(f"--work-dtype {dtype_name(requested)}: rewrites are done in float32 or "
                           "float64 (half precision would round every intermediate result, and parity could not "
                           "be checked); the weights are cast back to their storage dtype once, at the end")
    return requested or (torch.float64 if storage == torch.float64 else torch.float32)


def in_memory_bytes(source: Source, dtype: torch.dtype) -> float:
    """About what the one-part plan needs: every tensor in ``dtype``, half as much again for the
    rewrite's and the cast's temporaries, and 1 GiB for the rest."""
    return source.index.numel * torch.finfo(dtype).bits // 8 * 1.5 + 2**30


def check_levels(steps: list[StepSpec], cast: bool) -> list[int]:
    """The levels whose outputs the checks keep (:func:`_step_outputs`): the reference (0) and, with
    several steps, one that changes the function, or a ``cast`` to a coarser storage dtype to
    check apart, every step's."""
    every = len(steps) > 1 or steps[0].kind != "exact" or cast
    return [0] + (list(range(1, len(steps) + 1)) if every else [])


def outputs_bytes(source: Source, steps: list[StepSpec], dtype: torch.dtype) -> int:
    """What the checks' outputs hold at once, in either plan: the probe's positions x the output's
    width (an LM's vocabulary: Gemma-3's 262k columns are 268 MB per output in float32) in
    ``dtype``, at least float32, for each output held whole: every level kept after the
    reference (:func:`check_levels`), one read of a reference for a tolerance (a null draw, the
    jittered reference), and, unless a plain LM head lets them be kept as its input
    (``sweep.compact_head``), the reference's and the written folder's."""
    text = source.config.get_text_config()
    objective = source.head.objective
    width = (text.vocab_size if objective in LM_OBJECTIVES else text.hidden_size if objective == "none"
             else getattr(source.config, "num_labels", 2))
    compact = objective == "causal-lm" and family(source.family).plain_logits
    held = len(check_levels(steps, coarser(source.storage, dtype))) - 1 + 1 + (0 if compact else 2)
    return PROBE_SAMPLES * _length(source) * width * max(4, dtype.itemsize) * held


def plan_memory(work: Work, outputs: int = 0) -> dict:
    """What each plan needs, stated before anything is read, in bytes: "streamed": the largest
    part's tensors in the working dtype, a tied embedding and head counted twice (a rewrite that
    changes one unties them: the output stores both), and ``outputs``, the checks' outputs
    (:func:`outputs_bytes`; the loader gives the last part's tensors back before reading the next:
    the 2.7 GB bf16 Llama's 467 MB largest part, 470 MB measured above the imports without a
    check); "in_memory": :func:`in_memory_bytes` and ``outputs``; "outputs"; "parts": how many."""
    from ..core.families import layout
    from ..io.shards import inside

    size = torch.finfo(work.dtype).bits // 8
    named = list(work.model.named_parameters(remove_duplicate=False))
    parts = plan(work.model, layout(work.model), True)
    largest = max(sum(p.numel() for n, p in named if inside(n, part.scope)) * size for part in parts)
    return {"in_memory": int(in_memory_bytes(work.source, work.dtype)) + outputs, "streamed": int(largest) + outputs,
            "outputs": outputs, "parts": len(parts)}


def choose_plan(source: Source, steps: list[StepSpec], dtype: torch.dtype, streaming: bool | None,
                device: torch.device, outputs: int = 0) -> str | None:
    """Why the model is rewritten one part at a time (None: in memory, one part, on ``device``). A
    pass whose stages scan the whole model first (minimize, mask, compensated-ln) reads every part
    once more per scan when streamed: it streams when the model does not fit in memory
    (``outputs``: what the checks' outputs hold, :func:`outputs_bytes`)."""
    whole = [s for s in steps if s.whole]
    if streaming is False:
        return None
    need = in_memory_bytes(source, dtype) + outputs
    free, where = memory.room(device)
    numbers = (f"in memory this needs about {need / 2**30:.1f} GiB ({source.index.numel / 1e9:.2f}B parameters in "
               f"{dtype_name(dtype)}), {free / 2**30:.1f} GiB are available{where}")
    if streaming is None:
        if (whole or any(s.stages for s in steps)) and need <= free:
            return None
        why = "every pass rewrites one part at a time: bounded memory, and faster" if need <= free else numbers
    else:
        why = "asked for (--streaming)"
    if whole:  # the advice names only what fits
        advice = ("--in-memory loads the whole model" if need <= free else
                  "it cannot run on this machine" if streaming is None else f"{numbers}: it cannot run on this machine")
        raise SurgeryError(f"pass {whole[0].pass_name} cannot run one block at a time ({whole[0].whole}), and "
                           f"streaming was chosen: {why}; {advice}")
    return why


@job_scope
def convert(src, out, passes: list[tuple[str, dict[str, Any]]], options: ConvertOptions | None = None, *,
            text: str | Path | None = None, progress: Progress = no_progress, **keywords) -> Result:
    """Read ``src``, apply ``passes``, save to ``out`` atomically, checked (see the module docstring),
    with ``options`` (``ConvertOptions``, or its fields as ``keywords``: ``force=True``). Rewrites,
    forwards and training run on ``device`` (each part moved there as it is read, written from host memory).

    ``streaming``: True rewrites one part at a time (blockwise passes only), False loads the whole
    model, None chooses (the result's ``streaming`` says why). ``on_overflow``: what to do with a
    rewritten tensor that does not fit a half-precision storage dtype (``precision``): refuse, or
    keep it in float32. ``text``: the checks' text (default: the bundled sample), a ``str`` being
    the text itself and a ``pathlib.Path`` a file to read."""
    o = options_of(ConvertOptions, options, keywords)
    force, verify, tolerance, streaming, on_overflow = o.force, o.verify, o.tolerance, o.streaming, o.on_overflow
    work_dtype, shard_bytes, allow_pickle, device = as_dtype(o.work_dtype), o.shard_bytes, o.allow_pickle, o.device
    text = text_of(text)
    if not passes:
        raise SurgeryError("no passes given: use --pass NAME or --recipe FILE")
    precision.check_policy([], torch.float32, on_overflow)
    steps = steps_of(passes)
    check_text(passes, text is not None)  # a usage error: before anything is read
    job = Job.open(src, out, force=force, allow_pickle=allow_pickle, device=device)
    work, result = _planned(job, steps, work_dtype, streaming, text, state_dir(out), progress, verify)
    checks = _checks(work, text, tolerance, verify, progress)
    if work.resident:
        _in_memory(work, checks)
    if not is_main_process():  # one of several training processes: the main one saves
        return result
    if not work.resident and checks.t is not None:
        _step_outputs(work, checks)  # streamed: read before anything is written
    result.warnings = _judge_steps(work, checks.parities, force) or None
    saved = save_work(work, out, storage=Storage(job.source.storage, on_overflow, shard_bytes),
                      record=_record(result, checks.parities), check=_check_plan(work, checks), force=force,
                      progress=progress)
    shutil.rmtree(state_dir(out), ignore_errors=True)
    return _finished(result, saved, checks, work)


def _planned(job: Job, steps: list[StepSpec], work_dtype: torch.dtype | None, streaming: bool | None, text: str,
             workdir: Path, progress: Progress, verify: bool = True) -> tuple[Work, Result]:
    """The work over ``job``'s source (its plan chosen, what the Layout already refuses refused
    before any weight is read) and the result it starts (``verify``: the checks' outputs counted)."""
    source, where = job.source, job.device
    dtype = work_dtype_for(source.storage, work_dtype)
    outputs = outputs_bytes(source, steps, dtype) if verify else 0
    why = choose_plan(source, steps, dtype, streaming, where, outputs)
    work = CheckpointWork(source, dtype, streamed=why is not None, device=where)
    check_before_reading(work.model, steps)  # what the config and Layout already refuse: before the weights
    needs = plan_memory(work, outputs)
    if why is not None:
        checked = f", the checks' outputs {_size(outputs)} of it" if outputs >= 2**30 / 200 else ""
        why += (f" (about {_size(needs['streamed'])} at a time in {needs['parts']} parts{checked}; in memory "
                f"about {_size(needs['in_memory'], 1)})")
    work.steps, work.context = steps, PassContext(
        tokenizer=Later(lambda: source.tokenizer), text=text, workdir=workdir, train=train, heldout_ce=heldout_ce,
        distillation=frozen_distillation,
        storage_bytes=source.storage.itemsize,
        train_progress=lambda done, total, loss: progress("train", done, total, f"loss {loss:.4f}"))
    result = Result([], dtype_name(dtype), dtype_name(source.storage), source=source.name, streaming=why,
                    device=devices.describe(where), memory=needs, against=_against(steps, dtype, source.storage))
    return work, result


def _size(n: float, digits: int = 2) -> str:
    """Bytes for people: GiB (``digits`` decimals), or MB under 0.1 GiB (where GiB would say 0.00)."""
    return f"{n / 2**30:.{digits}f} GiB" if n >= 0.1 * 2**30 else f"{n / 1e6:.1f} MB"


@dataclass
class Checks:
    """What convert's checks carry, in the order they run: the rules (``t``, around the input; None:
    nothing is checked), whether the storage dtype is coarser than the arithmetic (``cast``: the
    rewrite is checked before its cast, each step apart), the outputs measured ({level: outputs},
    :func:`_step_outputs`) and each step's parity ({step: parity}), measured before anything is
    written; ``progress``: where the measuring says how far it is."""

    t: Tolerances | None
    cast: bool
    progress: Progress = no_progress
    outs: dict[int, torch.Tensor] = field(default_factory=dict)
    parities: dict[int, Comparison] = field(default_factory=dict)


def _checks(work: Work, text: str | None, tolerance: float | None, verify: bool, progress: Progress) -> Checks:
    """The checks of ``work``'s convert (``verify`` False: none): the rules around the input, whose
    outputs are ``outs[0]`` once measured, on the probe of ``text``."""
    source = work.source
    checks = Checks(None, coarser(source.storage, work.dtype), progress)
    if verify:
        ids = probe_ids(source.tokenizer, source.config.vocab_size, text, PROBE_SAMPLES, _length(source))
        read = source_reader(source, ids, work.dtype, work.streamed, work.device, work.meter)
        checks.t = Tolerances(read, ids, work.dtype, lambda: checks.outs.get(0), tolerance, source.head_output)
    return checks


def _in_memory(work: Work, checks: Checks) -> None:
    """The one-part plan: the model read, every step run (in every process), and the outputs and
    parities the checks need measured on the way (:func:`_step_outputs`)."""
    work.load_all()
    check_applies(work.model, work.steps[0].pass_name)
    if checks.t is not None:
        _step_outputs(work, checks)
    work.enter(work.parts[0], len(work.steps))  # every step runs here, in every process


def _check_plan(work: Work, checks: Checks) -> CheckPlan | None:
    """How the written folder is checked: against the outputs already measured, of the rewrite
    before its cast, or of what the last step that changes the function left (the input where none
    does); None: it is not."""
    if checks.t is None:
        return None
    steps, storage = work.steps, work.source.storage
    level = len(steps) if checks.cast else _anchor_level(steps)
    return CheckPlan(checks.t, checks.outs[level], _failure(steps, storage if checks.cast else None))


def _finished(result: Result, saved: Saved, checks: Checks, work: Work) -> Result:
    """``result`` with what was saved, the steps as recorded, the written folder's parity, what the
    function's change measured, and the checks' forwards (the work's ``meter``)."""
    result.saved, result.parity, result.steps = saved.info, saved.comparison, saved.steps
    result.against = _against(result.steps, work.dtype, work.source.storage)  # a reference step that did nothing: gone
    result.baseline = result.parity.null if result.parity is not None else None
    level, outs = _anchor_level(work.steps), checks.outs
    if checks.t is not None and level and 0 in outs and level in outs and any(s.kind != "exact" for s in result.steps):
        result.from_input = compare(outs[0], outs[level], checks.t.output)
    if saved.kept_float32:
        result.kept_float32, result.warnings = saved.kept_float32, [*(result.warnings or []), saved.warning]
    result.forwards, result.seconds_check = work.meter.count, work.meter.seconds
    return result


def _record(result: Result, parities: dict[int, Comparison]) -> Record:
    """What the saved config records under "normsurgery": the run, then its passes as they ran (each
    step's parity where measured: ``writer.Record.of``), then the warnings."""
    return Record({"version": __version__, "source": result.source, "device": result.device,
                   **({"streaming": True} if result.streaming else {}),
                   "work_dtype": result.work_dtype, "storage_dtype": result.storage_dtype},
                  parities, {"warnings": result.warnings} if result.warnings else {})


def _against(steps: list[StepSpec] | list[Step], dtype: torch.dtype, storage: torch.dtype) -> str:
    """What the written folder is compared with, in words."""
    if coarser(storage, dtype):
        return (f"the rewrite before its cast to {dtype_name(storage)} (checked in {dtype_name(dtype)}: "
                + ("the pass's row above" if len(steps) == 1 else "each step's row above") + ")")
    changed = [s for s in steps if s.kind != "exact"]  # a mask or a trained pass: the anchor
    return (f"the model after {changed[-1].name} ({changed[-1].kind}: it changes the function on purpose)"
            if changed else "the input")


def _failure(steps: list[StepSpec], cast: torch.dtype | None) -> str:
    """What broke, where the written folder does not compute the function it is checked against
    (``cast``: the model before its cast to that dtype, each step checked already)."""
    one = len(steps) == 1 and steps[0].kind == "exact"
    return (f"the cast to {dtype_name(cast)} and the writing broke parity (the rewrite was within tolerance before "
            "it)" if cast is not None else
            f"pass {steps[0].name} broke parity" if one else "the passes together drifted from the reference")


def _step_outputs(work: Work, checks: Checks) -> None:
    """Into ``checks.outs`` ({level: outputs}) what the checks need: the reference (level 0), and
    with several steps, one that changes the function, or a cast to a coarser storage dtype to
    check apart, every step's outputs, each step applied in turn; into ``checks.parities`` each
    step's (:func:`step_parity`), measured while the model it produced can still be read. Before
    anything is written (streamed: each level read from the checkpoint)."""
    steps, t, outs, progress = work.steps, checks.t, checks.outs, checks.progress
    levels = check_levels(steps, checks.cast)
    for i, level in enumerate(levels):  # a streamed part goes through the steps once per read
        progress("outputs", i, len(levels))
        read = level_reader(work, t.ids, level)
        outs[level] = read()
        if level - 1 in outs:
            checks.parities[level - 1] = step_parity(steps[level - 1], outs[level - 1], outs[level], t, read)
    progress("outputs", len(levels), len(levels))


def level_reader(work: Work, ids: torch.Tensor, level: int) -> Reader:
    """Reads ``work``'s outputs on ``ids`` with its steps up to ``level`` applied (a resident model
    as it stands; a streamed plan from the checkpoint, its spare tensors given back at once)."""
    def read(jitter: bool = False) -> torch.Tensor:
        reading = work if work.resident else work.fresh()
        try:
            return reading.outputs(ids, level, jitter=jitter, compact=True)
        finally:
            if reading is not work:
                reading.close()
    return read


def step_parity(step: StepSpec, before: torch.Tensor, after: torch.Tensor, t: Tolerances,
                read: Reader) -> Comparison:
    """What ``step`` changed in the outputs (``before`` -> ``after``); an exact step judged by ``t``'s
    rules around the model it produced (``read``: its outputs): the rounding a float32 tolerance
    measures is that model's, not the input's, which a reference step before it may have changed
    (a pruned model rounds differently)."""
    c = compare(before, after, t.output)
    if step.kind != "exact":
        return c
    return t.around(after, read, frozenset(), f"the model after {step.name}").judge(c)


def _anchor_level(steps: list[StepSpec]) -> int:
    """The level the written folder is compared with: after the last step that changes the
    function on purpose (0: the input)."""
    return max((i + 1 for i, s in enumerate(steps) if s.kind != "exact"), default=0)


def _judge_steps(work: Work, parities: dict[int, Comparison], force: bool) -> list[str]:
    """The steps judged by their parities (``step_parity``; where measured), before anything is
    written: an exact step out of tolerance stops the convert (unless ``force``). Returns the
    warnings of those that changed the function on purpose (:func:`damage`)."""
    bad = [(work.steps[i], p) for i, p in sorted(parities.items()) if work.steps[i].kind == "exact" and not p.ok]
    if bad and not force:
        step, p = bad[0]
        advice = ("; float32 rounding is what it measures: --work-dtype float64 checks the algebra itself"
                  if work.dtype == torch.float32 and "float32" in (p.reason or "") else "")
        raise SurgeryError(f"pass {step.name} broke parity: {beyond(p)}{advice}; nothing was saved "
                           "(--force saves anyway)")
    return damage(work.steps, parities)


def damage(steps: list[StepSpec], parities: dict[int, Comparison]) -> list[str]:
    """A warning for each step that changed the function on purpose and kept less of the top-1
    predictions before it (``parities``: step -> its parity) than :data:`DAMAGING_TOP1` (logits
    only: a base model has none), with what to try instead."""
    out = []
    for i, s in enumerate(steps):
        p = parities.get(i)
        if s.kind != "reference" or p is None or p.top1 is None or p.top1 >= DAMAGING_TOP1:
            continue
        tries = (["by=activation (with --text FILE)"] if s.options.get("by") == "magnitude" else []) + [
            "a smaller fraction", "healing the output (normsurgery heal OUT HEALED --text FILE)"]
        out.append(f"{s.name} changed the model's top-1 prediction on {1 - p.top1:.0%} of the probe's tokens "
                   f"(top-1 agreement with the model before it {p.top1:.3f} < {DAMAGING_TOP1}"
                   + (f", KL {p.kl:.3g}" if p.kl is not None else "") + "): the output is likely damaged; try "
                   + ", ".join(tries))
    return out


def apply_passes(model, passes: list[tuple[str, dict[str, Any]]], *, ids: torch.Tensor | None = None,
                 tolerance: float | None = None, context: PassContext | None = None,
                 progress: Progress = no_progress) -> list[Step]:
    """Run ``passes`` in order on ``model`` in memory (in place; the one-part plan of ``sweep``).
    With ``ids``, each step's outputs are compared with those before it, an exact step judged in
    the model's arithmetic, against its own rounding measured as it stands after the step
    (reported, not raised). A pass's own reference step (a mask first) is a step of its own, kind
    "reference"."""
    work = ModelWork(model)
    work.steps = steps_of(passes)
    work.context = context or PassContext()
    work.context.train = work.context.train or train
    work.context.heldout_ce = work.context.heldout_ce or heldout_ce
    work.context.distillation = work.context.distillation or frozen_distillation
    check_applies(model, work.steps[0].pass_name)
    t = Tolerances(None, ids, next(model.parameters()).dtype, given=tolerance, output=output_kind(model))
    before, parities = None if ids is None else work.outputs(ids), {}
    for i, step in enumerate(work.steps):
        progress("passes", i, len(work.steps))
        work.enter(work.parts[0], i + 1)
        if ids is not None and (step.kind != "reference" or work.reports[i]):
            read = level_reader(work, ids, i + 1)
            after = read()
            parities[i] = step_parity(step, before, after, t, read)
            before = after
    progress("passes", len(work.steps), len(work.steps))
    return steps_with(work, parities)


def _length(source: Source) -> int:
    return min(PROBE_LENGTH, source.positions or PROBE_LENGTH)
