"""The checks: a reference's outputs, the tolerance a comparison with them is judged by, and the
written folder read back and compared (:func:`check_written`).

A reference is read part by part as any checkpoint is (:func:`read_outputs`, :func:`source_reader`)
or from a model held in memory (:func:`model_reader`); :class:`Tolerances` measures what a
tolerance needs beyond the arithmetic's own only when a comparison exceeds that (then once).
"""

from __future__ import annotations

import copy
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..core import precision
from ..io.checkpoint import mark_not_stock
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.parity import DRAWS, TOLERANCE, Comparison, beyond, coarser, compare, dtype_name, jittered, needs_rounding_tolerance, null_summary, outputs, rounding_tolerance, tolerance
from .plan import Part
from ..io.shards import inside
from .sweep import CheckpointWork, Meter, Work


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
                 differ: frozenset[str] | Callable[[], frozenset[str] | None] | None = None):
        self.read, self.ids, self.dtype = read, ids, dtype
        self._reference, self.given, self.output = reference, given, output
        self.differ = differ
        self.perturbed = "the reference with the tensors that differ"  # what the null perturbs, in words
        self.measured: dict[Any, Any] = {}

    def around(self, reference: torch.Tensor, read: Reader, differ: frozenset[str], what: str) -> Tolerances:
        """The same rules with another reference: ``read`` gives its outputs (``reference``), and
        its null perturbs the tensors ``differ`` names (``what``: those, in words)."""
        t = Tolerances(read, self.ids, self.dtype, reference, self.given, self.output, differ)
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


def source_reader(source: Source, ids: torch.Tensor, dtype: torch.dtype, streamed: bool,
                  device: torch.device | str, meter: Meter | None = None, stock: bool = False) -> Reader:
    """Reads ``source`` part by part (``streamed``) or whole, on ``device`` (:func:`read_outputs`,
    compact; ``stock``: with the stock class; ``meter``: counts its forwards)."""
    def read(dtype: torch.dtype = dtype, jitter: bool = False, on_load: Callable | None = None) -> torch.Tensor:
        work = CheckpointWork(source, dtype, streamed=streamed, stock=stock, on_load=on_load, device=device,
                              meter=meter)
        return read_outputs(work, ids, jitter=jitter, compact=True)
    return read


def model_reader(model, ids: torch.Tensor) -> Reader:
    """Reads a model held in memory (a copy of it, where its weights change)."""
    def read(dtype: torch.dtype | None = None, jitter: bool = False, on_load: Callable | None = None):
        if any(p.device.type == "meta" for p in model.parameters()):
            raise SurgeryError("internal: the model was written (spent) before its tolerance was measured")
        m = model if dtype is None and on_load is None else copy.deepcopy(model).to(dtype or model.dtype)
        if on_load is not None:
            on_load(m, Part((), ()), lambda name, p: (name,))
        with jittered(m) if jitter else nullcontext():
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


def read_outputs(work: Work, ids: torch.Tensor, *, jitter: bool = False, compact: bool = False) -> torch.Tensor:
    """The outputs on ``ids`` of ``work`` (a :class:`sweep.CheckpointWork`: read part by part, or
    whole), closed after; ``compact``: logits as a :class:`parity.HeadInput` where they can be
    (:meth:`Work.outputs`)."""
    try:
        return work.outputs(ids, jitter=jitter, compact=compact)
    finally:
        work.close()


def check_written(folder: Path, records: list[dict], plan: CheckPlan, storage: torch.dtype, work: Work,
                  force: bool = False, rounded: set[str] = frozenset()) -> dict:
    """Load ``folder`` back (with the plain stock class first, where every record says it computes
    the same function) and compare its outputs with ``plan.anchor`` (weights stored in
    ``storage``). A false plain claim is corrected in the folder; a folder that does not compute
    the anchor's function is an error (:meth:`CheckPlan.refused`), unless ``force``: then it stays
    and its comparison says so. Returns what was checked. What ``plan.tolerances`` measure beyond
    the arithmetic's own (a float32 model's own rounding, a cast's null) is measured around the
    folder itself: the anchor may be a model that a step changed on purpose (pruned, trained),
    which rounds differently from the input.

    ``storage`` coarser than the arithmetic: the anchor is the model before the cast, and the
    folder may differ from it by what the cast of the tensors it rounded (``rounded``) costs: the
    null distribution is measured around the folder itself, those tensors perturbed as the cast
    rounds (the same statistics, whether the model before the cast is still held or was spent
    writing). ``work``: what was written; the folder is read in its plan, on its device, its
    ``meter`` counting the forwards."""
    t = plan.tolerances
    cast = t.dtype in TOLERANCE and coarser(storage, t.dtype)

    def check(stock: bool) -> Comparison:
        read = source_reader(Source.open(folder), t.ids, t.dtype, work.streamed, work.device, work.meter, stock)
        out = read()
        c = compare(plan.anchor, out, t.output)
        what = f"the written folder with the {len(rounded)} tensors the cast rounded" if cast else "the written folder"
        return t.around(out, read, frozenset(rounded), what).judge(c, storage)  # rounded: none without a cast

    plain = None
    if all(r.get("stock_equivalent") for r in records):
        plain = check(stock=True)
        if plain.ok or (force and not records):
            return {"loader": "plain transformers", "comparison": plain.as_dict()}
        mark_not_stock(work.model, records, folder)
    if not records:
        raise plan.refused(plain, "the saved checkpoint")
    ours = check(stock=False)
    if not ours.ok and not force:
        raise plan.refused(ours, "the saved checkpoint, loaded back with normsurgery's runtime,")
    return {"loader": "trust_remote_code=True or normsurgery.load", "comparison": ours.as_dict(),
            "plain_transformers": None if plain is None else plain.as_dict()}


@dataclass
class CheckPlan:
    """How ``writer.save_work`` checks what it wrote, as data in hand before anything is written:
    the folder read back (``check_written``) and its outputs compared with ``anchor`` by
    ``tolerances`` (None: nothing is read back, and nothing is claimed; no ``anchor``: the outputs
    of the work written, at level 0, on ``tolerances.ids``, read once its parts are written: a
    streamed prune's kept blocks as stored); ``failure``: what broke, in words, when the folder
    differs (None: the writer's own words)."""

    tolerances: Tolerances | None = None
    anchor: torch.Tensor | None = None
    failure: str | None = None

    def refused(self, c: Comparison, what: str) -> SurgeryError:
        """The error of a folder that does not compute the anchor's function (``c``; ``what``: the
        folder, in the writer's own words)."""
        if self.failure is not None:
            return SurgeryError(f"{self.failure}: {beyond(c)}; nothing was saved (--force saves anyway)")
        return SurgeryError(f"{what} does not compute what was checked before saving ({beyond(c)}); nothing was "
                            "saved")
