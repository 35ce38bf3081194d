"""Helpers shared by the norm passes: refusals read off the Layout, folding a norm into its readers."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..core import algebra, devices
from ..core.errors import SurgeryError
from ..io.stash import Stash
from ..core.layout import Layout, NormSite


def refuse_norms(layout: Layout, kinds: tuple[str, ...]) -> str | None:
    """Why the stream norms cannot be rewritten, when one is not of ``kinds`` or its gain offset
    is unknown (None when all can)."""
    for site in layout.norms:
        if site.kind == "other" or site.offset is None:
            return (f"{site.path} is a norm class normsurgery does not know: its kind and gain offset "
                    "are unknown, so nothing is folded")
        if site.kind not in kinds:
            return f"{site.path} is a {site.kind}, not a {' or '.join(kinds)}"
    return None


def refuse_post_ln(layout: Layout) -> str | None:
    if layout.placement == "post":
        return (f"{layout.family} is Post-LN (x = LN(x + f(x))): the norms normalise the stream "
                "itself, so nothing can be moved into the layers around them")
    return None


def refuse_output_norms(layout: Layout) -> str | None:
    """Why a rewrite of the stream does not apply when sub-blocks normalise their outputs."""
    out = output_norms(layout)
    if out:
        return (f"{out[0].path} and {len(out) - 1} more norms normalise a sub-block's output before it joins the "
                "stream (sandwich norms): the stream is not the sum of the writers' outputs, so writers cannot "
                "be centred or have channels removed, and those norms have no reader")
    return None


def refuse_experts(layout: Layout) -> str | None:
    if layout.experts:
        return (f"{layout.experts[0]} is a mixture of experts: this pass does not rewrite the router and "
                "the stacked expert tensors")
    return None


def output_norms(layout: Layout) -> tuple[NormSite, ...]:
    return tuple(s for s in layout.norms if s.role == "output")


def fold_into_readers(model, layout: Layout, site: NormSite) -> None:
    """norm -> reader becomes weightless norm -> reader with W diag(g) and c + W b.

    A reader without a bias (an LM head, say) cannot take W b: then the norm keeps b / g as its
    only parameter, since W diag(g) (n + b / g) = W (g n + b). Needs g != 0 wherever b != 0.
    """
    if not site.readers:
        raise SurgeryError(f"{site.path} has no reader to fold into: its output is the model's output")
    norm = model.get_submodule(site.path)
    readers = [_reader(model, r) for r in site.readers]
    offset = site.offset
    gain = norm.weight.detach().to(algebra.WORK) + offset
    shift = None if getattr(norm, "bias", None) is None else norm.bias.detach().to(algebra.WORK)
    in_norm = shift is not None and not all(isinstance(r, nn.Module) and algebra.has_bias(r) for r in readers)
    if in_norm and bool(((gain == 0) & (shift != 0)).any()):
        raise SurgeryError(f"{site.path}: a channel has zero gain but a bias, and a reader has no bias to take it")
    for r in readers:
        if isinstance(r, nn.Parameter):  # stacked experts: no bias
            algebra.scale_inputs(r, gain)
        else:
            algebra.fold_affine_into_reader(r, gain, None if in_norm else shift)
    with torch.no_grad():
        norm.weight.fill_(1.0 - offset)
        if shift is not None:
            norm.bias.copy_((shift / gain if in_norm else torch.zeros_like(shift)).to(norm.bias.dtype))


def _reader(model, path: str) -> nn.Module | nn.Parameter:
    """A reader: a module, or a stacked experts' weight named by its parameter path."""
    parent, _, leaf = path.rpartition(".")
    return getattr(model.get_submodule(parent), leaf)


def foldable(layout: Layout) -> tuple[NormSite, ...]:
    """The norms whose gains can move into readers: all but a base model's final norm, whose
    output is the model's output, and the sub-blocks' output norms, whose output is the stream."""
    return tuple(s for s in layout.norms if s is not layout.output_norm and s.role != "output")


def output_note(report, layout: Layout) -> None:
    """Notes, on ``report``, of the norms a fold leaves because nothing reads them."""
    if layout.output_norm is not None:
        report.notes.append(f"left the final norm ({layout.output_norm.path}) as it is: it gives the model's "
                            "output (a base model), so there is no reader to fold its gain into")
    out = output_norms(layout)
    if out:
        report.count("left {n} output norms ({first}, ...) as they are: each normalises a sub-block's output, "
                     "which is added to the stream, so no linear layer reads it and its gain has nowhere to go",
                     n=len(out), first=out[0].path)


def untie_if_touched(model, layout: Layout, touched: set[str]) -> list[str]:
    """Untie a tied head when a pass rewrites the head or the token embedding."""
    if layout.tied and (layout.head in touched or layout.token_embedding in touched):
        algebra.untie(model, layout)
        return [f"untied {layout.head} from {layout.token_embedding}: the rewrite changes one of "
                "them, and a shared tensor would change the other (the output stores both)"]
    return []


# ----------------------------------------------------------------------------- trained passes

def adaptive(config: dict, options: dict, settle: int) -> dict:
    """``config`` (training.TrainConfig's fields) stopping once held-out CE has gone
    ``options["patience"]`` evaluations (every ``eval_every`` steps) without improving, counted
    from step ``settle`` (when the pass's schedule stops changing the model); unchanged without
    patience: every step runs."""
    if not options["patience"]:
        return config
    return {**config, "patience": options["patience"], "eval_every": options["eval_every"], "settle": settle}


class Control:
    """The papers' comparison (Heimersheim 2024; Baroni et al. 2025): the model as it was before the
    pass (copied now), norms kept, fine-tuned on the same windows with the same budget and schedule
    of learning rates (``config``, its seed included: the same batches), no state kept; its held-out
    CE is the reference the pass's is judged against. With a ``workdir`` the copy waits on disk while
    the pass trains, and the pass's model while the control trains (``stash.Stash``): the peak is one
    training's 16 bytes per parameter, not 20. Without one (``apply_passes``), the copy is held."""

    def __init__(self, model, workdir: Path | None):
        self.original = copy.deepcopy(model)
        self.folder = None if workdir is None else Path(workdir) / "control"
        self.stash = None if self.folder is None else Stash(self.original, self.folder / "input")

    def run(self, ctx, model, train_ids, held, config: dict, objective: str):
        """The copy trained (``model``, the pass's, set aside meanwhile); returns its ``TrainResult``."""
        if self.stash is not None:
            self.stash.back()
        aside = None if self.folder is None else Stash(model, self.folder / "trained")
        config = {**config, "save_every": 0, "resume": False, "state_dir": None}
        try:
            return ctx.train(self.original, train_ids, held, config, objective=objective, progress=ctx.train_progress)
        finally:
            self.original = None  # freed before the pass's model comes back
            if aside is not None:  # each process removes its own stash (the state folder goes at the end)
                aside.back()


def distillation(ctx, model, o: dict):
    """What a trained pass's loop distils with (``train``'s ``distillation=``): for ``o["objective"]``
    kd or kd+ce, the engine's (``ctx.distillation``) from a frozen copy of ``model`` as it is now (the
    pass's input: called before the pass changes it); None for ce."""
    if o["objective"] == "ce":
        return None
    if ctx.distillation is None:
        raise SurgeryError(f"objective {o['objective']} distils from the pass's input model, through the engine: "
                           "run the pass through convert or apply_passes")
    return ctx.distillation(model, o["objective"], o["temperature"], o["ce_weight"])


def distilled_report(report, result, o: dict) -> None:
    """The objective in ``report`` and, where it distilled, the held-out KL(input || model) before and after."""
    report.metrics["objective"] = o["objective"]
    if o["objective"] != "ce":
        report.metrics.update(kl_before=result.kl_before, kl_after=result.kl_after, temperature=o["temperature"])
        report.notes.append(f"objective {o['objective']} (T {o['temperature']:g}), distilled from a frozen copy of "
                            f"the input model: held-out KL to it {result.kl_before:.4f} -> {result.kl_after:.4f}")


def control_report(report, control) -> None:
    """The control's figures in ``report`` (metrics and a note), beside the pass's ``ce_after``."""
    if control is None:
        return
    gap = report.metrics["ce_after"] - control.ce_after
    report.metrics.update(ce_control=control.ce_after, gap_to_control=gap, control_steps=control.steps,
                          control_tokens=control.tokens, control_seconds=control.seconds)
    report.notes.append(f"vanilla fine-tune at the same budget (norms kept; same text, steps, learning rates and "
                        f"batches), the papers' control: held-out CE {control.ce_before:.4f} -> "
                        f"{control.ce_after:.4f}; this pass is {gap:+.4f} from it")


def token_divisors(x: torch.Tensor, layernorm: bool, eps: float) -> torch.Tensor:
    """Each token's divisor, sqrt(var(x) + eps) (LayerNorm) or sqrt(mean(x^2) + eps) (RMSNorm),
    shape [..., T], at least float32."""
    s = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    v = torch.var_mean(s, -1, correction=0)[0] if layernorm else s.pow(2).mean(-1)
    return torch.sqrt(v + eps)


def aux_loss(d: torch.Tensor) -> torch.Tensor:
    """The final norm's auxiliary loss on per-token divisors ``d`` [..., T] (rms or std): the mean
    of (d / mean - 1)^2 over positions >= 1, the mean over those positions and the batch (of every
    process: the one mean a single process of them all would take) held constant (a relative MSE:
    its weight does not depend on the stream's scale). Position 0, the attention sink, is left out.
    Zero when every token has the same divisor: one constant then divides them all alike, as a
    norm with a fixed divisor does."""
    rest = d[..., 1:] if d.shape[-1] > 1 else d
    target = devices.mean_over_processes(rest.mean().detach().clone())
    return (rest / target - 1).pow(2).mean()
