"""remove-ln: remove every normalization by staged fine-tuning (Heimersheim 2024; Baroni et al. 2025).

While a norm is live it is computed exactly and its divisor d(x) = sqrt(var(x) + eps) (LayerNorm)
or sqrt(mean(x^2) + eps) (RMSNorm), averaged over the tokens of each training batch, is tracked
as an exponential moving average s (momentum 0.9; evaluation batches do not move it; several
processes average their batches' divisors first). Removing a norm freezes s: LayerNorm becomes
the affine map (x - mean(x)) / s * g + b, RMSNorm x / s * g.

Each norm's readers form paths with their own constant: "mlp", "qk" and "v" where a block has
separate q/k/v projections ("attn" for a fused qkv), "final". The whole model fine-tunes on its
language-modelling loss (training.train) while the paths freeze on a schedule
(removal_schedule): the MLP path of each block in turn, then the q/k (or fused) paths, then the v
paths, then the final norm, a gap of steps between removals, or (``wait=M``) each removal once the
held-out CE is back within M of its level before the previous one. Position 0 carries a much
larger residual norm (attention sink): a frozen path keeps a separate constant for it until the
last removal drops that special case.

Then the frozen model is folded exactly: every writer is centred (so mean(x) = 0 on the stream;
only where a LayerNorm was), the readers take W diag(g / s) and c + W b, and each norm becomes
runtime.NoNorm, the identity: the saved model computes no statistic of the stream. The fold is
checked against the frozen-norm model in float64 and float32 before anything is saved.

``export=stock`` instead keeps the stock norm classes with eps = 1e12 and gains g * 1e6 / s (the
published checkpoints' trick): (x - mean) / sqrt(var + 1e12) * g 1e6 / s = (x - mean) g / s
up to a relative var / 2e12. Its error against the norm-free model is measured and reported;
it is refused in fp16/bf16, where gains near 1e6 overflow or lose their precision.

``keep=final`` (not the default) removes the block norms only: the final norm is never installed
as a RemovableNorm, so it stays the model's stock norm, computing its statistic and trained with
the rest; the schedule has no final event (position 0's special case is still dropped last), and
the notes and metrics (``kept``) say so. It is refused with ``export=stock`` (the stock classes
read one epsilon from the config, and the kept norm needs its own).

The final norm's removal (issue 37): by default (``final_aux=3``) the training loss carries an
auxiliary loss on the final norm's input (below; its measurements against the control are in
README). ``final_divisor=remeasure`` sets the final norm's frozen divisor, just before it is frozen, from a
measurement on the model as it is then (eval mode, the same 8 training windows the divisors start
from), position 0 left out of the average (and its own constant re-measured at position 0),
instead of the moving average's last value. ``final_aux=W`` (default 3; 0: off) adds W times an auxiliary loss on the
final norm's input to the training loss, from the first removal of the last block stage (the v
paths, or the q/k ones) to the end: the mean squared relative deviation of each token's divisor
(rms, or std for LayerNorm) from their mean over positions >= 1 (``aux_loss``; position 0 left
out), pulling every token toward one scale so a constant divides them all alike (Heimersheim
2024 and Baroni et al. 2025 use the absolute form on GPT-2, weight 0.1 to 0.01).
``final_blend=S`` turns the final norm's divisor from each token's own into the constant over S
steps, (1 - a) d(x) + a s with a rising from 1/S to 1, instead of at once (the fixed schedule; S at
most the final stage's length). ``untie=true``
gives a tied head its own copy of the embedding before training (vocabulary x width parameters
more), so the unembedding can absorb the scale the final norm's divisor gave; the default export
unties it anyway when the final norm folds into the head. ``block_aux=W`` adds the same auxiliary
loss on each block norm's input, W times, from that norm's first removal on: a token whose scale
runs away from the batch's is pulled back. A gated MLP, down(act(gate x) * up x), is quadratic in
the scale of x once its norm divides by a constant, so one such token can grow without bound
(measured: a GQA Llama's stream reached 10^10 times the rest and the run diverged); a plain MLP is
not. The default (-1) is therefore ``GATED_BLOCK_AUX`` where the layout's MLPs are gated
(``Layout.gated_mlp``) and 0 elsewhere (on a GPT-2 it cost +0.010; README, issue 37).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import algebra
from ..core.calibration import fit_seq_len, split_heldout, tokenize, windows
from ..core.errors import SurgeryError
from ..core.families import positions
from ..core.layout import Layout
from ..core.parity import compare, outputs
from ..core.registry import PassContext, PassReport
from . import removal_schedule as schedule
from .norms import (Control, adaptive, control_report, distillation, distilled_report, refuse_experts, refuse_norms,
                    refuse_output_norms, refuse_post_ln)
from .removable_norm import STOCK_EPS, RemovableNorm, export_stock, fold_checked, install, made, removal_paths
from .remove_ln_run import Run, calibrate, final_variants, keep_final


def removed_layout(layout: Layout, options: dict) -> Layout:
    """The layout of the norms the pass removes: every norm, or (keep=final) all but the final one,
    which then stays the model's stock norm, trained with the rest, and no schedule event."""
    if not keep_final(options):
        return layout
    return dataclasses.replace(layout, norms=[s for s in layout.norms if s.role != "final"])



def check(model, layout: Layout, options: dict) -> str | None:
    """Before any weight is read (``model`` may be on the meta device): options that contradict
    each other, and a step budget the schedule cannot fit in."""
    if keep_final(options) and options["export"] == "stock":
        return ("remove-ln: keep=final cannot export=stock: the stock classes read one epsilon from the "
                "config, and the kept final norm needs its own; use the default export")
    try:
        paths = removal_paths(removed_layout(layout, options), split=options["export"] != "stock")
        final_variants(options, schedule.plan(paths, options)[3])
    except SurgeryError as e:
        return str(e)
    return None



# ----------------------------------------------------------------------------- the pass

def applies(model, layout: Layout) -> str | None:
    reason = refuse_post_ln(layout) or refuse_output_norms(layout) or refuse_experts(layout)
    if reason:
        return reason
    if layout.qk_norms:
        return (f"it has {len(layout.qk_norms)} QK-norms (per-head norms inside attention): their divisor "
                "is not a property of the residual stream, and rotary embeddings follow them")
    if layout.objective != "causal-lm":
        return f"it has no causal language-modelling head to train with (objective {layout.objective})"
    for site in layout.norms:
        if site.role not in ("attn", "mlp", "attn+mlp", "final"):
            return f"{site.path} is a {site.role} norm"
        if site.eps is None:
            return f"the epsilon of {site.path} is unknown"
    return refuse_norms(layout, ("layernorm", "rmsnorm"))


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    o = _options(model, layout, ctx)
    kept = ["final"] if keep_final(o) else []
    full, layout = layout, removed_layout(layout, o)
    ids = tokenize(ctx.tokenizer, ctx.text)
    train_ids, held_ids = split_heldout(ids, o["eval_fraction"], o["seq_len"])
    held = windows(held_ids, o["seq_len"], o["eval_samples"], "the held-out part of the text")
    workdir = ctx.workdir / "remove-ln" if ctx.workdir else None
    config = {k: o[k] for k in ("steps", "batch_size", "seq_len", "lr", "min_lr", "warmup", "weight_decay",
                                "grad_accum", "precision", "seed", "resume")}
    config.update({"eval_batch_size": o["batch_size"],
                   "save_every": o["save_every"] if workdir else 0, "state_dir": workdir})
    # a copy of the input (a control's; a teacher's with kd), before the norms are installed
    control, distilled = Control(model, ctx.workdir) if o["control"] else None, distillation(ctx, model, o)
    untied = o["untie"] and algebra.untie(model, layout)
    if untied:  # the head trains on its own: it can absorb the scale the final norm's divisor gave
        layout = dataclasses.replace(layout, tied=False)
    norms = install(model, layout, o["export"] != "stock", o["divisor"])  # a stock norm has one output
    start, gap, final_gap, events = schedule.plan([rn.paths for rn in norms], o)
    calib = windows(train_ids, o["seq_len"], 8)
    calibrate(model, norms, calib)
    run = Run(model, norms, events, o, gap, held, calib, ctx.heldout_ce)
    config = adaptive({**config, **run.evaluations()}, o, settle=run.until)
    result = ctx.train(model, train_ids, held, config, objective="causal-lm", on_step=run.on_step,
                       progress=ctx.train_progress, distillation=distilled, **run.extra())
    run.stop_pulling()
    report = PassReport("remove-ln")
    report.metrics.update({"ce_before": result.ce_before, "ce_after": result.ce_after,
                           "ce_delta": result.ce_after - result.ce_before, "steps": result.steps,
                           "tokens": result.tokens, "seconds": result.seconds, "processes": result.processes,
                           "precision": result.precision, "resumed_from": result.resumed_from,
                           "schedule": run.schedule_metrics(start, final_gap), "curve": result.curve, "kept": kept,
                           "block_aux": o["block_aux"],
                           **{k: run.variants[k] for k in ("final_divisor", "final_aux", "final_blend")}})
    report.notes += run.variant_notes()
    distilled_report(report, result, o)
    if o["block_aux"] > 0:
        report.notes.append(f"block norms: auxiliary loss on each one's input, weight {o['block_aux']:g}, from its "
                            "first removal" + (" (the default for gated MLPs)" if ctx.options["block_aux"] is None
                                               else ""))
    _fold_or_export(model, layout, norms, held[: min(4, len(held))], o["export"], report,
                    kept and next((("LayerNorm" if s.kind == "layernorm" else "RMSNorm") for s in full.norms
                                   if s.role == "final"), "norm"))
    report.notes.append(f"{result.done()}: held-out CE "
                        f"{result.ce_before:.4f} -> {result.ce_after:.4f} ({result.ce_after - result.ce_before:+.4f})")
    report.metrics["stages"] = schedule.stages_run(made(norms, events), result.curve, result.steps)
    report.notes.append("stages as run (steps: held-out CE at the stage's last evaluation): " + "; ".join(
        f"{s['stage']} {s['from']}-{s['to']}" + ("" if s["heldout_ce"] is None else f": {s['heldout_ce']:.4f}")
        for s in report.metrics["stages"])
        + (" (position 0: the first position's own frozen divisors dropped, so that every position divides by "
           "one constant)" if any(s["stage"] == "position 0" for s in report.metrics["stages"]) else ""))
    if untied:
        head = model.get_submodule(layout.head).weight
        report.metrics["untied_parameters"] = head.numel()
        report.notes.append(f"untie: {layout.head} untied from {layout.token_embedding} before training "
                            f"({head.numel():,} parameters of its own)")
    run.position_report(report)
    if control is not None:
        control_report(report, control.run(ctx, model, train_ids, held, config, "causal-lm"))
    return report


def _options(model, layout: Layout, ctx: PassContext) -> dict:
    """The pass's options, refused in one line where they cannot run here; seq_len fitted to the
    model's positions."""
    o = ctx.options
    dtype = next(model.parameters()).dtype
    if o["export"] == "stock" and dtype in (torch.float16, torch.bfloat16):
        raise SurgeryError(f"remove-ln: export=stock stores gains near {math.sqrt(STOCK_EPS):.0e}, which {dtype} "
                           "cannot hold accurately; use the default export or a float32 working dtype")
    if not ctx.text:
        raise SurgeryError("remove-ln trains the model: give it text (--text FILE)")
    refused = check(model, layout, o)
    if refused:
        raise SurgeryError(refused)
    if ctx.train is None or (o["wait"] > 0 and ctx.heldout_ce is None):
        raise SurgeryError("remove-ln needs the training loop: run it through convert or apply_passes")
    return {**o, "seq_len": fit_seq_len(positions(model.config), o["seq_len"], "remove-ln: seq_len"),
            "block_aux": block_aux(o["block_aux"], layout)}


#: block_aux's value where the MLPs are gated (measured on five Llamas against their controls: README)
GATED_BLOCK_AUX = 1.0


def block_aux(value: float | None, layout: Layout) -> float:
    """The block norms' auxiliary weight: ``value``, or where it is None (not given, the default)
    GATED_BLOCK_AUX for gated MLPs and 0 for plain ones."""
    if value is not None:
        return float(value)
    return GATED_BLOCK_AUX if layout.gated_mlp else 0.0


def _fold_or_export(model, layout: Layout, norms: list[RemovableNorm], check_ids: torch.Tensor, export: str,
                    report: PassReport, kept_kind: str | None) -> None:
    """The frozen norms folded into the weights (checked), or exported as stock norms (its error
    measured); the notes and metrics in ``report``. ``kept_kind``: the final norm's kind where
    keep=final kept it."""
    if export == "stock":
        frozen = outputs(model, check_ids)
        keys = export_stock(model, layout, norms)
        err = compare(frozen, outputs(model, check_ids)).relative
        report.metrics["stock_error"] = err
        report.notes.append(f"export=stock: stock norms with {keys} = {STOCK_EPS:.0e} and gains scaled by "
                            f"1e6 / s; relative logit error against the norm-free model {err:.2e}")
        return
    report.metrics.update(fold_checked(model, layout, norms, check_ids))
    if kept_kind:
        report.notes.append(f"block norms removed; final {kept_kind} kept (it computes its statistic "
                            "as the stock norm, trained with the model)")
    took = "g / s (each norm's gain over its frozen divisor)" + (
        " and b (its bias)" if any(n.bias is not None for n in norms) else "")
    report.notes.append(f"removed {len(norms)} norms: {report.metrics['readers_folded']} readers took {took}; "
                        f"fold checked against the frozen model (relative error "
                        f"{report.metrics['fold_error_float64']:.1e} in float64, "
                        f"{report.metrics['fold_error_float32']:.1e} in float32)")
