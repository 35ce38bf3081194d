"""mask: put exact zeros into a model by a mask file or a criterion (changes the function on purpose).

The masked model is the reference a following exact pass must reproduce: ``minimize`` and
``compensated-ln`` run this first when given mask options, then shrink it exactly.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from ..core import calibration, masks
from ..core.errors import SurgeryError
from ..core.families import positions
from ..core.layout import Layout
from ..core.registry import PassContext, PassReport, Scan, Stage
from . import MaskOptions
from .norms import refuse_experts, refuse_norms, refuse_output_norms, refuse_post_ln

#: calibration windows for by=activation
CALIBRATION = 32
#: the options' defaults (``MaskOptions``): minimize and compensated-ln give theirs, which are the same
OPTIONS = asdict(MaskOptions())


def applies(model, layout: Layout) -> str | None:
    reason = (refuse_post_ln(layout) or refuse_output_norms(layout) or refuse_experts(layout)
              or refuse_norms(layout, ("layernorm", "rmsnorm", "compensated-layernorm")))
    if reason:
        return reason
    if not layout.attention or len(layout.mlps) != len(layout.attention):
        return (f"the {layout.family} adapter does not describe its attention and MLP blocks"
                + (f": {layout.undescribed}" if layout.undescribed else ""))
    return None


def wants_mask(options: dict) -> bool:
    return any(options.get(k) for k in ("mask", "sparsity", "prune_channels", "prune_units", "prune_heads"))


def calibration_windows(model, ctx: PassContext) -> torch.Tensor:
    """The context's calibration windows, or CALIBRATION windows of its text."""
    if ctx.calibration is not None:
        return ctx.calibration
    if not ctx.text:
        raise SurgeryError("by=activation scores units and heads on calibration text: give --text FILE")
    ids = calibration.tokenize(ctx.tokenizer, ctx.text)
    length = min(len(ids), calibration.fit_seq_len(positions(model.config), 0))
    return calibration.windows(ids, length, CALIBRATION, "the calibration text")


def whole(options: dict) -> str | None:
    """Why these options need the whole model in memory: units and heads scored by activation run
    a forward over the model's calibration text (None: the mask runs part by part)."""
    options = {**OPTIONS, **options}
    if options["by"] == "activation" and (options["prune_units"] or options["prune_heads"]):
        return "by=activation scores units and heads on a forward pass over the whole model"
    return None


def stages(options: dict, layout: Layout) -> list[Stage]:
    """One stage; ``prune_channels`` first scans the energy every writer writes into each channel."""
    channels = (Scan(lambda model, lay, ctx: masks.channel_energies(model, lay), _least_written),)
    return [Stage(_mask, channels if options.get("prune_channels") else ())]


def _least_written(collected: list, layout: Layout, ctx: PassContext) -> dict:
    return {"keep": masks.prune_channels([e for part in collected for e in part], ctx.options["prune_channels"])}


def _mask(model, layout: Layout, ctx: PassContext, report: PassReport) -> None:
    """Zero, in the part ``layout`` holds, what the mask file and criteria say (see the module doc)."""
    options = {**OPTIONS, **ctx.options}
    structured = options["prune_units"] or options["prune_heads"]
    rms = (masks.activations(model, layout, calibration_windows(model, ctx))
           if structured and options["by"] == "activation" else None)
    params, channels = {}, None
    if options["mask"]:
        params, channels, names = masks.load(options["mask"], layout.holds)
        known = dict(model.named_parameters(remove_duplicate=False))
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SurgeryError(f"the mask names {unknown[0]!r}, which this model does not have")
        report.count(f"mask {options['mask']}: {{params}} parameters"
                     + ("" if channels is None else f", {int((channels == 0).sum())} channels"), params=len(params))
    if options["sparsity"]:
        _combine(params, masks.magnitude(model, layout, options["sparsity"]))
        report.notes.append(f"magnitude sparsity {options['sparsity']:g} in every linear inside the blocks")
    for key, prune, what in (("prune_units", masks.prune_units, "MLP units"),
                             ("prune_heads", masks.prune_heads, "KV heads (with their query heads)")):
        if options[key]:
            _combine(params, prune(model, layout, options[key], rms))
            report.notes.append(f"zeroed the {options[key]:g} lowest-scoring {what} in every layer "
                                f"(by {options['by']})")
    if options["prune_channels"]:
        keep = ctx.facts["keep"]
        channels = keep if channels is None else keep & channels.bool()
        report.notes.append(f"pruned the {options['prune_channels']} least-written residual channels")
    report.metrics.update(masks.apply(model, layout, params, channels))
    report.same = ("channels",)


def _combine(params: dict, new: dict) -> None:
    """Add the parameter masks ``new`` to ``params``: an entry stays only if both keep it."""
    for name, keep in new.items():
        params[name] = keep & params[name].bool() if name in params else keep
