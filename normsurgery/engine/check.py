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
from .sweep import Meter, Work


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
                  device: torch.device | str, meter: Meter | None = None) -> Reader:
    """Reads ``source`` part by part (:func:`read_outputs`; ``meter``: counts its forwards)."""
    def read(dtype: torch.dtype = dtype, jitter: bool = False, on_load: Callable | None = None) -> torch.Tensor:
        return read_outputs(source, ids, dtype, streamed, jitter=jitter, on_load=on_load, device=device,
                            compact=True, meter=meter)
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


def read_outputs(source: Source, ids: torch.Tensor, dtype: torch.dtype, streamed: bool, *, stock: bool = False,
                 jitter: bool = False, on_load: Callable | None = None,
                 device: torch.device | str, compact: bool = False, meter: Meter | None = None) -> torch.Tensor:
    """``source``'s outputs on ``ids`` in ``dtype`` on ``device``, read part by part (or whole);
    ``compact``: logits as a :class:`parity.HeadInput` where they can be (:meth:`Work.outputs`);
    ``meter``: counts the forward."""
    work = Work(source, dtype, streamed=streamed, stock=stock, on_load=on_load, device=device, meter=meter)
    try:
        return work.outputs(ids, jitter=jitter, compact=compact)
    finally:
        work.close()


def check_written(folder: Path, records: list[dict], tolerances: Tolerances, anchor: torch.Tensor,
                  storage: torch.dtype, model, force: bool = False,
                  failure: Callable[[Comparison], str] | None = None, rounded: set[str] = frozenset(),
                  meter: Meter | None = None) -> dict:
    """Load ``folder`` back (with the plain stock class first, where every record says it computes
    the same function) and compare its outputs with ``anchor`` (weights stored in ``storage``). A
    false plain claim is corrected in the folder; a folder that does not compute the anchor's
    function is an error, unless ``force``: then it stays and its comparison says so. Returns what
    was checked. What ``tolerances`` measure beyond the arithmetic's own (a float32 model's own
    rounding, a cast's null) is measured around the folder itself: the anchor may be a model that
    a step changed on purpose (pruned, trained), which rounds differently from the input.

    ``storage`` coarser than the arithmetic: ``anchor`` is the model before the cast, and the
    folder may differ from it by what the cast of the tensors it rounded (``rounded``) costs: the
    null distribution is measured around the folder itself, those tensors perturbed as the cast
    rounds (the same statistics, whether the model before the cast is still held or was spent
    writing). ``meter``: counts the forwards that read the folder."""
    t = tolerances
    if t.device is None:
        raise SurgeryError("internal: the tolerances of a written folder's check need the device it is read to")
    cast = t.dtype in TOLERANCE and coarser(storage, t.dtype)

    def check(stock: bool) -> Comparison:
        def read(dtype: torch.dtype = t.dtype, jitter: bool = False, on_load: Callable | None = None):
            return read_outputs(Source.open(folder), t.ids, dtype, t.streamed, stock=stock, jitter=jitter,
                                on_load=on_load, device=t.device, compact=True, meter=meter)
        out = read()
        c = compare(anchor, out, t.output)
        what = f"the written folder with the {len(rounded)} tensors the cast rounded" if cast else "the written folder"
        return t.around(out, read, frozenset(rounded), what).judge(c, storage)  # rounded: none without a cast

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


@dataclass
class Check:
    """How ``writer.save_work`` checks what it wrote: the folder read back and its outputs compared
    with ``anchor()`` (called once the parts are written) by ``tolerances`` (no anchor: nothing is
    read back, and nothing is claimed); ``before_check`` runs between the writing and the reading
    (the steps' own checks), anchor or not; ``failure(comparison)`` words the error when the folder
    differs."""

    tolerances: Tolerances | None = None
    anchor: Callable[[], torch.Tensor] | None = None
    before_check: Callable[[], None] | None = None
    failure: Callable[[Comparison], str] | None = None
