"""Apply registered passes to a model or a checkpoint, check parity, save.

Weights are rewritten in a working dtype (float32, or float64 on request or for float64
checkpoints; every rewrite does its own algebra in float64; half precision is refused) and cast
back to the storage dtype once, just before saving. Parity is measured on what the model's class
outputs (logits, or a base model's last hidden state) per pass against the outputs just before
it, and overall against the last reference, within the working dtype's arithmetic tolerance.
The saved folder is loaded back and compared before any claim about how it loads is made
(``checkpoint.save``): with the rewritten model's outputs, or, when the weights were cast to a
narrower storage dtype, with the reference's, within the input's own rounding in that dtype
(``verify.tolerance_for``): the cast is measured on what was written, in the same forward.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import __version__, checkpoint, precision, registry
from . import streaming as streaming_mod
from .errors import SurgeryError
from .families import layout
from .layout import Layout
from .norms import faithful_norms
from .progress import Progress, no_progress
from .registry import PassContext, load_recipe, parse_pass, read_recipe  # noqa: F401  (API)
from .training import heldout_ce, is_main_process, train
from .verify import (TOLERANCE, Comparison, compare_logits, jittered, logits, needs_rounding_tolerance,
                     output_kind, outputs_check, probe_ids, reload_check, rounding_tolerance, tolerance_for)


@dataclass
class Step:
    name: str
    kind: str
    options: dict[str, Any]
    notes: list[str]
    metrics: dict[str, Any]
    parity: Comparison | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "options": self.options, "notes": self.notes,
                "metrics": self.metrics, "parity": self.parity.as_dict() if self.parity else None}


@dataclass
class Result:
    steps: list[Step]
    work_dtype: str
    storage_dtype: str
    parity: Comparison | None = None  # converted vs the reference (the input, or the model the last
    # reference-changing or trained step left), in the working dtype
    cast: Comparison | None = None  # converted in the storage dtype vs the reference
    cast_baseline: Comparison | None = None  # original in the storage dtype vs original: the rounding
    # the cast's tolerance is measured from
    saved: dict | None = None
    source: str | None = None
    streaming: str | None = None  # why it was rewritten one block at a time (None: in memory)
    kept_float32: list[str] | None = None  # tensors that do not fit the storage dtype, stored in float32
    warnings: list[str] | None = None

    @property
    def ok(self) -> bool:
        steps_ok = all(s.parity is None or s.parity.ok for s in self.steps if s.kind == "exact")
        return steps_ok and all(c is None or c.ok for c in (self.parity, self.cast))

    def as_dict(self) -> dict:
        def c(x):
            return x.as_dict() if x else None
        return {"source": self.source, "ok": self.ok, "work_dtype": self.work_dtype,
                "storage_dtype": self.storage_dtype, "steps": [s.as_dict() for s in self.steps],
                "parity": c(self.parity), "cast": c(self.cast), "cast_baseline": c(self.cast_baseline),
                "saved": self.saved, "streaming": self.streaming, "kept_float32": self.kept_float32,
                "warnings": self.warnings}


def check_applicable(model, name: str, lay: Layout | None = None) -> registry.Pass:
    """The pass ``name``, when it applies to ``model`` (``lay``: its layout, or a part's)."""
    p = registry.get(name)
    reason = p.applies(model, layout(model) if lay is None else lay)
    if reason:
        raise SurgeryError(f"pass {name} does not apply to this {model.config.model_type} model: {reason}")
    return p


def apply_passes(model, passes: list[tuple[str, dict[str, Any]]], *, ids: torch.Tensor | None = None,
                 tolerance: float | None = None, context: PassContext | None = None,
                 progress: Progress = no_progress, reference: torch.Tensor | None = None) -> list[Step]:
    """Run ``passes`` in order on ``model`` (in place). With ``ids``, each pass's parity is
    measured against the logits before it (``reference``: those of the model as given, when
    already computed); an exact pass out of ``tolerance`` is reported, not raised. A pass's own
    reference step (a mask first) is a step of its own, kind "reference"."""
    return _run_passes(model, passes, ids, tolerance, context or PassContext(), progress, reference)[0]


def _run_passes(model, passes, ids, tolerance, context, progress, before):
    """(steps, the outputs of the last reference: the input's, or those after the last step
    that changed the function on purpose; the outputs after the last step)."""
    steps = []
    reason = None if tolerance is None else _arithmetic(model, tolerance)
    context.train = context.train or train
    context.heldout_ce = context.heldout_ce or heldout_ce
    if ids is not None and before is None:
        before = logits(model, ids)
    anchor = before

    def step(name, kind, opts, report):
        nonlocal before, anchor
        s = Step(name, kind, opts, report.notes, report.metrics)
        if ids is not None:
            after = logits(model, ids)
            s.parity = compare_logits(before, after, output_kind(model))
            if kind == "exact":
                s.parity.tolerance, s.parity.reason = tolerance, reason
            before = after
            if kind != "exact":
                anchor = after
        steps.append(s)

    for i, (name, options) in enumerate(passes):
        p = check_applicable(model, name)
        opts = registry.check_options(p, options)
        progress(f"pass {name}", i, len(passes))
        context.options = opts
        made = p.reference(model, layout(model), context) if p.reference else None
        if made is not None:
            step(f"{name} (reference)", "reference", opts, made)
        step(name, p.kind, opts, p.apply(model, layout(model), context))
    progress("passes", len(passes), len(passes))
    return steps, anchor, before


def work_dtype_for(storage: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    if requested is not None and requested not in TOLERANCE:
        raise SurgeryError(f"--work-dtype {str(requested).removeprefix('torch.')}: rewrites are done in float32 or "
                           "float64 (half precision would round every intermediate result, and parity could not "
                           "be checked); the weights are cast back to their storage dtype once, at the end")
    return requested or (torch.float64 if storage == torch.float64 else torch.float32)


def _arithmetic(model, tolerance: float | None) -> str:
    """Why the per-step tolerance is what it is."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if tolerance is not None and tolerance != TOLERANCE.get(next(model.parameters()).dtype):
        return "given"
    why = "checks the algebra" if dtype == "float64" else "its rounding"
    return f"{dtype} arithmetic (the working dtype): {why}"


def convert(src, out, passes: list[tuple[str, dict[str, Any]]], *, force: bool = False,
            verify: bool = True, work_dtype: torch.dtype | None = None, text: str | None = None,
            tolerance: float | None = None, max_shard_size: str = "5GB",
            progress: Progress = no_progress, streaming: bool | None = None,
            on_overflow: str = "refuse") -> Result:
    """Load ``src``, apply ``passes``, check parity, cast back, save to ``out`` atomically.

    ``streaming``: True rewrites one block at a time (``streaming.py``; blockwise passes only),
    False loads the whole model, None streams when the model would not fit in memory (the
    result's ``streaming`` says why). ``on_overflow``: what to do with a rewritten tensor that
    does not fit a half-precision storage dtype (``precision.cast_back``): refuse, or keep it
    in float32."""
    if not passes:
        raise SurgeryError("no passes given: use --pass NAME or --recipe FILE")
    if on_overflow not in precision.POLICIES:
        raise SurgeryError(f"on_overflow={on_overflow!r}: choose one of {', '.join(precision.POLICIES)}")
    for name, options in passes:
        registry.check_options(registry.get(name), options)
    path = checkpoint.resolve(src)
    checkpoint.check_output(Path(out), force, path)
    storage = checkpoint.storage_dtype(path)
    dtype = work_dtype_for(storage, work_dtype)
    why = "asked for (--streaming)" if streaming else None
    if streaming is None:
        why = streaming_mod.too_big([path], dtype, 1.5)
    if why:
        return streaming_mod.convert(src, path, out, passes, storage=storage, dtype=dtype, force=force,
                                     verify=verify, text=text, tolerance=tolerance,
                                     max_shard_size=max_shard_size, progress=progress, reason=why,
                                     on_overflow=on_overflow)
    progress("load", 0, 1)
    model = checkpoint.load(path, dtype)
    tokenizer = checkpoint.load_tokenizer(path)
    progress("load", 1, 1)
    check_applicable(model, passes[0][0])
    restore_norms = faithful_norms(model) if dtype == torch.float64 else None
    ids = probe_ids(model, tokenizer, text, 4, _length(model)) if verify else None
    reference = logits(model, ids) if verify else None
    result = Result([], str(dtype).removeprefix("torch."), str(storage).removeprefix("torch."), source=str(src))
    kind = output_kind(model)
    if verify and storage != dtype:
        cast_tol, cast_reason, result.cast_baseline = tolerance_for(model, ids, storage, reference)
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    workdir = Path(out).parent / f".{Path(out).name}.train-state"  # trained passes' resumable state
    context = PassContext(tokenizer=tokenizer, text=text, workdir=workdir,
                          train_progress=lambda done, total, loss: progress("train", done, total))
    result.steps, anchor, last = _run_passes(model, passes, ids, tol, context, progress, reference)
    if verify:
        progress("verify", 0, 1)
        # with one step its own check is the overall one
        result.parity = (compare_logits(anchor, last, kind) if len(result.steps) > 1
                         else copy.copy(result.steps[0].parity))
        exact = any(s.kind == "exact" for s in result.steps)
        result.parity.tolerance = tol if exact else None
        result.parity.reason = _arithmetic(model, tol) if exact else None
        checks = [s.parity for s in result.steps if s.kind == "exact"] + ([result.parity] if exact else [])
        if needs_rounding_tolerance(checks, dtype, tolerance):  # a deep model rounds more on its own
            with jittered(model):
                tol, why = rounding_tolerance(last, logits(model, ids), dtype, kind)
            for c in checks:
                c.tolerance, c.reason = tol, why
        progress("verify", 1, 1)
        if not result.ok and not force:
            bad = [s for s in result.steps if s.kind == "exact" and s.parity and not s.parity.ok]
            what = (f"pass {bad[0].name} broke parity: relative error {bad[0].parity.relative:.2e}" if bad else
                    f"the passes together drifted: relative error {result.parity.relative:.2e} against the reference")
            raise SurgeryError(f"{what} > {tol:.0e}; nothing was saved (--force saves anyway)")
    if restore_norms:
        restore_norms()
        last = None  # the stock norms round differently: the reload check runs the model again
    if not is_main_process():  # one of several training processes: the main one saves
        return result
    kept = precision.cast_back(model, storage, on_overflow)
    if kept:
        result.kept_float32 = [k.name for k in kept]
        result.warnings = [precision.warning(kept, storage)]
    progress("save", 0, 1)
    record = {"version": __version__, "source": str(src), "passes": [
        {"name": s.name, "options": s.options, "notes": s.notes,
         "relative_error": s.parity.relative if s.parity else None} for s in result.steps],
        **({"kept_float32": result.kept_float32} if kept else {})}
    check = None
    if verify and storage != dtype:
        check = _stored_check(result, anchor, ids, kind, cast_tol, cast_reason, force)
    elif verify:
        check = reload_check(model, ids, last)
    precision.store(model, storage, kept)
    result.saved = checkpoint.save(model, out, source=path, force=force, record=record,
                                   max_shard_size=max_shard_size, check=check, release=True)
    shutil.rmtree(workdir, ignore_errors=True)
    progress("save", 1, 1)
    return result


def _stored_check(result: Result, reference: torch.Tensor, ids: torch.Tensor, kind: str, tolerance: float,
                  reason: str, force: bool):
    """The saved folder's check when the weights were cast to a narrower storage dtype: the model
    loaded back from it against the reference, within the cast's tolerance: the cast and the
    reload measured in one forward, on what was written (``result.cast``). Out of tolerance,
    nothing is saved, unless ``force``: then it is saved and ``result.cast`` says so."""
    cast = outputs_check(reference, ids, kind, tolerance, f"{reason}; measured on the saved folder, loaded back")

    def check(reloaded) -> Comparison:
        result.cast = cast(reloaded)
        if force and not result.cast.ok:
            return dataclasses.replace(result.cast, tolerance=None)
        return result.cast

    return check


def _length(model) -> int:
    c = model.config
    return min(64, getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", 64))
