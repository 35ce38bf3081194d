"""remove-ln as the training runs it: the schedule's events made step by step (:class:`Run`,
``removal_schedule``), the final norm's removal variants (:func:`final_variants`), the held-out CE
by predicting position, and the divisors' first values (:func:`calibrate`). The maths:
``remove_ln``'s docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import devices
from ..core.analysis import evaluating
from ..core.errors import SurgeryError
from ..core.parity import outputs
from ..core.registry import PassReport
from . import RemoveLnOptions
from . import removal_schedule as schedule
from .removable_norm import RemovableNorm, freeze_until, made, remeasure, wait_for_recovery

def keep_final(options: dict) -> bool:
    """Whether ``keep=final``: the final norm stays the model's own, computing."""
    return options.get("keep") == "final"



class Run:
    """The schedule as the training runs it: ``on_step`` makes the events (fixed gaps, or waiting
    for recovery), sets the final norm's blend and the weight of its auxiliary loss; just before
    the final removal and before position 0's, the held-out CE by predicting position is measured
    (and, remeasure, the final divisor). Everything it decides follows from the step and the
    norms' buffers, so a resumed run decides the same."""

    def __init__(self, model, norms: list[RemovableNorm], events, o: dict, gap: int, held: torch.Tensor,
                 calib: torch.Tensor, heldout_ce):
        self.model, self.norms, self.events, self.o = model, norms, events, o
        self.variants = final_variants(o, events)
        self.gap, self.held, self.calib, self.heldout_ce = gap, held, calib, heldout_ce
        self.waiting = o["wait"] > 0
        self.until = schedule.deadline(o["steps"]) if self.waiting else events[-1][0]
        self.final = next(((rn, rn.paths.index("final")) for rn in norms if "final" in rn.paths), None)
        self.by_position: dict[str, dict] = {}

    def evaluations(self) -> dict:
        """The training's evaluation steps: each stage's start (fixed), or every eval_every steps
        (waiting: the stages' steps are not known before)."""
        if self.waiting:
            return {"eval_every": self.o["eval_every"]}
        e = self.events
        return {"eval_steps": tuple(sorted({e[i][0] for i in range(len(e)) if i == 0 or e[i][1] != e[i - 1][1]}))}

    def before(self, stage: str) -> None:
        if self.final is not None and stage in ("final", "position 0"):
            when = "before" if stage == "final" else "after"
            self.by_position[when] = position_ce(self.model, self.held, self.o["batch_size"])
        if stage == "final" and self.variants["final_divisor"] == "remeasure":
            remeasure(self.final[0], self.final[1], lambda: _forward_eval(self.model, self.calib))

    def on_step(self, step: int, model) -> dict:
        if self.waiting:
            ce = lambda: self.heldout_ce(self.model, self.held, self.o["batch_size"], "causal-lm")  # noqa: E731
            row = wait_for_recovery(self.norms, self.events, step, self.gap, self.until, self.o["wait"], ce,
                                    self.before)
        else:
            row = freeze_until(self.norms, self.events, step, self.before)
        for rn in self.norms:  # block_aux: each block norm's input, from its first frozen path on
            if self.final is None or rn is not self.final[0]:
                rn.aux_weight = self.o["block_aux"] if bool(rn.frozen.any()) else 0.0
        if self.final is None:
            return row
        rn, p = self.final
        blend = self.variants["final_blend"]
        if blend > 0 and int(rn.removed_at[p]) >= 0:
            rn.blend[p] = row["final_blend"] = min(1.0, (step - int(rn.removed_at[p]) + 1) / blend)
        if self.variants["final_aux"] > 0:
            if rn.aux is not None:  # the previous step's term, unweighted: how far the scales spread
                row["final_aux_loss"] = float(rn.aux.detach()) / rn.aux_weight
            event = self.variants["aux_event"]
            rn.aux_weight = self.variants["final_aux"] if event is not None and len(
                made(self.norms, self.events)) > event else 0.0
        return row

    def extra(self) -> dict:
        """The training loop's extra loss: the auxiliary terms of the norms pulled (the final
        norm's, final_aux; the block norms', block_aux), None while none is."""
        if (self.final is None or self.variants["final_aux"] <= 0) and self.o["block_aux"] <= 0:
            return {}

        def terms():
            pulled = [rn.aux for rn in self.norms if rn.aux is not None]
            return sum(pulled) if pulled else None

        return {"extra_loss": terms}

    def stop_pulling(self) -> None:
        for rn in self.norms:
            rn.aux_weight, rn.aux = 0.0, None

    def schedule_metrics(self, start: int, final_gap: int) -> dict:
        ran = made(self.norms, self.events)
        return {"start": start, "gap": self.gap,
                **({"wait": self.o["wait"], "deadline": self.until} if self.waiting else {"final_gap": final_gap}),
                "last_removal": ran[-1][0] if ran else None, "removals": [at for at, _, _ in ran]}

    def variant_notes(self) -> list[str]:
        v = self.variants
        if self.final is None or (v["final_divisor"] == "ema" and v["final_aux"] <= 0 and v["final_blend"] <= 0):
            return []
        return ["final norm: divisor " + ("re-measured just before it was frozen (position 0 left out)"
                                          if v["final_divisor"] == "remeasure" else "the moving average")
                + (f", blended in from each token's own over {v['final_blend']} steps" if v["final_blend"] > 0 else "")
                + (f"; auxiliary loss on its input, weight {v['final_aux']:g}, from step "
                   f"{made(self.norms, self.events)[v['aux_event']][0]}" if v["final_aux"] > 0 else "")]

    def position_report(self, report: PassReport) -> None:
        if self.by_position:
            report.metrics["final_positions"] = self.by_position
            report.notes.append("held-out CE by predicting position, " + " and ".join(
                f"{when} the final stage ({', '.join(f'{k}: {v:.4f}' for k, v in ces.items())})"
                for when, ces in self.by_position.items()))


def final_variants(options: dict, events) -> dict:
    """The final norm's removal variants (``final_divisor``, ``final_aux``, ``final_blend``) and the
    index of the event the auxiliary loss starts at (the first removal of the last block stage).
    keep=final has no final removal: there they are off, and a value other than the default is
    refused in one line; a blend must end before position 0's removal, on the fixed schedule."""
    names = ("final_divisor", "final_aux", "final_blend")
    chosen = {k: options[k] for k in names}
    if keep_final(options):
        if chosen != {k: getattr(RemoveLnOptions, k) for k in names}:
            raise SurgeryError("remove-ln: final_divisor, final_aux and final_blend change the final norm's removal, "
                               "and keep=final keeps it")
        chosen = {"final_divisor": "ema", "final_aux": 0.0, "final_blend": 0}
    if chosen["final_blend"] > 0:
        at = {stage: step for step, stage, _ in events}
        if options["wait"] > 0:
            raise SurgeryError("remove-ln: final_blend needs the fixed schedule (the final stage's length is known "
                               "before it starts); drop wait")
        if "final" in at and chosen["final_blend"] > at["position 0"] - at["final"]:
            raise SurgeryError(f"remove-ln: final_blend={chosen['final_blend']} steps do not fit in the final stage "
                               f"({at['position 0'] - at['final']} steps: final_gap); give a larger final_gap or a "
                               "shorter blend")
    last = next((e[1] for e in reversed(events) if e[1] in schedule.STAGES), None)
    return {**chosen, "final_aux": float(chosen["final_aux"]),
            "aux_event": next((i for i, e in enumerate(events) if e[1] == last), None)}


POSITION_GROUPS = (("0", 0, 1), ("1-7", 1, 8), ("8+", 8, None))  # predicting position: name, from, to


@torch.no_grad()
def position_ce(model, windows: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Held-out CE (nats/token) of ``windows`` [n, T] by the position that predicts: position 0
    (the attention sink, predicting token 1), positions 1-7, 8 onwards (POSITION_GROUPS); eval
    mode (``parity.outputs``)."""
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for s in range(0, len(windows), batch_size):
        ids = windows[s:s + batch_size]
        logits = outputs(model, ids)[:, :-1].double().cpu()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        total += ce.view(ids.shape[0], -1).sum(0)
    total /= len(windows)
    return {name: float(total[a:b].mean()) for name, a, b in POSITION_GROUPS}


@torch.no_grad()
def _forward_eval(model, batch: torch.Tensor) -> None:
    """One forward of ``batch`` in eval mode (the training mode restored)."""
    with evaluating(model):
        model(input_ids=batch.to(devices.of(model)))


@torch.no_grad()
def calibrate(model, norms: list[RemovableNorm], batch: torch.Tensor) -> None:
    """Start every divisor EMA at its value on a few training windows."""
    for rn in norms:
        rn.calibrating = True
    try:
        with evaluating(model):
            model(input_ids=batch.to(devices.of(model)))
    finally:
        for rn in norms:
            rn.calibrating = False
