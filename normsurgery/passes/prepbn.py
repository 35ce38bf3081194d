"""prepbn: progressive LayerNorm/RMSNorm to re-parameterised BatchNorm (SLAB, Guo et al. 2024).

Each stream norm becomes lam * Norm(x) + (1 - lam) * RepBN(x), RepBN(x) = BN(x) + eta * x, and the
model fine-tunes on its language-modelling loss (:func:`normsurgery.engine.training.train`):
- lam = 1 for ``warmup`` steps, then decays linearly to 0 over ``decay`` steps (default 4/5 of
  the budget: short decays gave NaNs in the reference code), then 0 to the end;
- when the decay starts each RepBN is set equal to its norm with a frozen divisor s (the mean
  per-token std, or rms, of the norm's input on calibration windows): with channel means mu_c
  and variances v_c there, gamma_c = g_c sqrt(v_c + eps) / s, beta_c = b_c + g_c (mu_c - m) / s
  (m = mean_c mu_c for LayerNorm, 0 for RMSNorm), eta = 0, so RepBN(x) = g (x - m) / s + b;
- batch statistics are per channel over the batch's real tokens (``attention_mask`` padding
  excluded);
- ``final_aux=W`` (not the default) adds W times norms.aux_loss of the final norm's input to the
  training loss from the decay's start (remove-ln's variant for the same position: every token
  pulled toward one scale, so the fixed statistics divide them alike);
- at the end, with the weights frozen, the running statistics are re-estimated exactly (mean and
  biased variance over every real token of the calibration windows), the model switches to them
  (eval mode) and bn-fold folds every RepBN into its readers: no statistic is computed at run time.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
from torch import nn

from ..core import calibration, devices
from ..core.families import layout as layout_of, positions
from ..core.layout import Layout
from ..core.errors import SurgeryError
from ..core.registry import PassContext, PassReport
from ..core.runtime import RepBN
from . import PrepbnOptions, bn_fold
from .norms import (Control, adaptive, aux_loss, control_report, distillation, distilled_report, refuse_experts,
                    refuse_norms, refuse_output_norms, refuse_post_ln, token_divisors)


class ProgressiveNorm(nn.Module):
    """lam * norm(x) + (1 - lam) * repbn(x); only the side(s) with a non-zero weight run.
    ``aux_weight`` > 0 (final_aux, the final norm): each training forward keeps ``aux``, that weight
    times norms.aux_loss of its input's per-token divisors."""

    def __init__(self, norm: nn.Module, repbn: RepBN, kind: str, offset: float, eps: float):
        super().__init__()
        self.norm, self.repbn, self.kind, self.offset, self.eps = norm, repbn, kind, offset, eps
        self.lam = 1.0
        self.aux_weight = 0.0
        self.aux: torch.Tensor | None = None

    def forward(self, x):
        self.aux = (self.aux_weight * aux_loss(token_divisors(x, self.kind == "layernorm", self.eps))
                    if self.training and self.aux_weight > 0 else None)
        if self.lam >= 1.0:
            return self.norm(x)
        if self.lam <= 0.0:
            return self.repbn(x)
        return self.lam * self.norm(x) + (1.0 - self.lam) * self.repbn(x)


def lam_at(step: int, warmup: int, decay: int) -> float:
    """lam of optimizer step ``step`` (0-based): 1 for ``warmup`` steps, then linear to 0."""
    if step < warmup:
        return 1.0
    return max(0.0, 1.0 - (step - warmup + 1) / max(1, decay))


def schedule(steps: int, warmup: int | None, decay: int | None) -> tuple[int, int]:
    """(warmup, decay) with the defaults (None, not given): 1/10 and 4/5 of ``steps``."""
    warmup = steps // 10 if warmup is None else warmup
    decay = (4 * steps) // 5 if decay is None else decay
    if warmup + decay > steps:
        raise SurgeryError(f"prepbn: warm-up {warmup} + decay {decay} steps exceed the budget of {steps}: "
                           "lam would not reach 0")
    if decay < 1:
        raise SurgeryError("prepbn: the decay needs at least one step")
    return warmup, decay


def check(model, layout: Layout, options: dict) -> str | None:
    """Before any weight is read (``model`` may be on the meta device): a λ schedule the step
    budget cannot hold."""
    try:
        schedule(options["steps"], options["warmup"], options["decay"])
    except SurgeryError as e:
        return str(e)
    return None


def masked_tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x [..., C] as [N, C] rows, only where ``mask`` (the leading shape, bool) is true."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if mask is None else flat[mask.reshape(-1).to(flat.device)]


def attach_token_mask(model, repbns: list[RepBN]):
    """Give each RepBN the real-token mask of every forward: the ``attention_mask`` [B, T]
    passed to ``model`` (None when absent: every token is real). Returns the hook handle."""

    def hook(module, args, kwargs):
        m = kwargs.get("attention_mask")
        m = m.bool() if m is not None and m.ndim == 2 else None
        for bn in repbns:
            bn.token_mask = m

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@torch.no_grad()
def input_moments(model, modules: list[nn.Module], windows: torch.Tensor, batch_size: int = 8,
                  attention_mask: torch.Tensor | None = None,
                  per_token: list[tuple[str, float]] | None = None) -> list[dict]:
    """Per module, over the real tokens its input carries on ``windows``: channel mean ``mean``
    and biased variance ``var`` (float64, exact over all tokens); with ``per_token`` (kind, eps)
    per module also the mean per-token divisor ``s``: sqrt(var_tok + eps) for "layernorm",
    sqrt(mean_tok(x^2) + eps) for "rmsnorm"."""
    sums = [{"n": 0, "s1": 0.0, "s2": 0.0, "div": 0.0} for _ in modules]
    mask_now = {}

    def hook_for(i):
        def hook(module, args):
            x = masked_tokens(args[0].detach().to(torch.float64), mask_now.get("m"))
            acc = sums[i]
            acc["n"] += x.shape[0]
            acc["s1"] = acc["s1"] + x.sum(0)
            acc["s2"] = acc["s2"] + x.pow(2).sum(0)
            if per_token:
                kind, eps = per_token[i]
                spread = x.var(-1, unbiased=False) if kind == "layernorm" else x.pow(2).mean(-1)
                acc["div"] += torch.sqrt(spread + eps).sum().item()
        return hook

    handles = [m.register_forward_pre_hook(hook_for(i)) for i, m in enumerate(modules)]
    device = devices.of(model)
    try:
        for s in range(0, len(windows), batch_size):
            kw = {}
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask[s:s + batch_size].to(device)
                mask_now["m"] = kw["attention_mask"].bool()
            model(input_ids=windows[s:s + batch_size].to(device), **kw)
    finally:
        for h in handles:
            h.remove()
    out = []
    for acc in sums:
        mean = acc["s1"] / acc["n"]
        out.append({"mean": mean, "var": (acc["s2"] / acc["n"] - mean.pow(2)).clamp_min(0.0),
                    "s": acc["div"] / acc["n"], "n": acc["n"]})
    return out


@torch.no_grad()
def init_from_norms(model, progs: list[ProgressiveNorm], windows: torch.Tensor, batch_size: int = 8) -> None:
    """Set every RepBN equal to its norm with a frozen divisor (module docstring), the running
    statistics to the channel moments of the norm's input on ``windows`` (model in eval mode)."""
    was = model.training
    model.eval()
    try:
        stats = input_moments(model, [p.norm for p in progs], windows, batch_size,
                              per_token=[(p.kind, p.repbn.eps) for p in progs])
    finally:
        model.train(was)
    for prog, st in zip(progs, stats):
        norm, bn = prog.norm, prog.repbn
        g = norm.weight.detach().double() + prog.offset
        b = norm.bias.detach().double() if getattr(norm, "bias", None) is not None else torch.zeros_like(g)
        m = st["mean"].mean() if prog.kind == "layernorm" else 0.0
        s = st["s"]
        bn.weight.copy_(g * torch.sqrt(st["var"] + bn.eps) / s)
        bn.bias.copy_(b + g * (st["mean"] - m) / s)
        bn.eta.zero_()
        bn.running_mean.copy_(st["mean"])
        bn.running_var.copy_(st["var"])


@torch.no_grad()
def reestimate(model, repbns: list[RepBN], windows: torch.Tensor, batch_size: int = 8,
               attention_mask: torch.Tensor | None = None) -> None:
    """Running statistics := mean and biased variance of each RepBN's input over every real token
    of ``windows``, weights frozen; each RepBN normalises with its batch's statistics meanwhile
    (as in training). Leaves the model in eval mode: every RepBN uses its running statistics."""
    model.eval()
    for bn in repbns:
        bn.train()
    hook = attach_token_mask(model, repbns)
    try:
        moments = input_moments(model, repbns, windows, batch_size, attention_mask)
    finally:
        hook.remove()
        for bn in repbns:
            bn.token_mask = None
        model.eval()
    for bn, st in zip(repbns, moments):
        bn.running_mean.copy_(st["mean"])
        bn.running_var.copy_(st["var"])


def install(model, layout: Layout, momentum: float = 0.1) -> list[ProgressiveNorm]:
    """Wrap every stream norm in a ProgressiveNorm (lam = 1: the model is unchanged)."""
    progs = []
    for site in layout.norms:
        norm = model.get_submodule(site.path)
        ref = norm.weight
        bn = RepBN(ref.shape[0], eps=site.eps, momentum=momentum).to(device=ref.device, dtype=ref.dtype)
        prog = ProgressiveNorm(norm, bn, site.kind, site.offset, site.eps)
        model.set_submodule(site.path, prog)
        progs.append(prog)
    return progs


def finish(model, layout: Layout, progs: list[ProgressiveNorm]) -> None:
    """Replace each ProgressiveNorm by its RepBN (lam has reached 0)."""
    for site, prog in zip(layout.norms, progs):
        model.set_submodule(site.path, prog.repbn)


def applies(model, layout: Layout) -> str | None:
    reason = refuse_post_ln(layout)
    if reason:
        return (reason + "; bn-fold would have to keep each frozen BatchNorm as a per-channel affine map on the "
                "stream, and prepbn is only built for Pre-LN and parallel decoders")
    reason = refuse_output_norms(layout) or refuse_experts(layout) or refuse_norms(layout, ("layernorm", "rmsnorm"))
    if reason:
        return reason
    if layout.head is None:
        return "the model has no language-modelling head to train"
    return None


def _data(ctx: PassContext, opts: dict, max_len: int | None):
    if not ctx.text:
        raise SurgeryError("prepbn trains: give it text (--text FILE)")
    seq = calibration.fit_seq_len(max_len, opts["seq_len"], "prepbn: seq_len")
    ids = calibration.tokenize(ctx.tokenizer, ctx.text)
    train_ids, held = calibration.split_heldout(ids, opts["eval_fraction"], seq)
    return (train_ids, calibration.windows(held, seq, opts["eval_samples"], "the held-out text"),
            calibration.windows(train_ids, seq, opts["calib_samples"], "the training text"), seq)


def _trained(model, layout: Layout, ctx: PassContext, opts: dict, progs: list, data: tuple, phases: tuple[int, int],
             distilled=None):
    """The training with lam on its schedule (``phases``: the warm-up's and the decay's steps), the
    RepBNs initialised from the norms at the warm-up's end, and (final_aux) the auxiliary loss on
    the final norm's input from the decay's start. ``data``: (training tokens, held-out windows,
    calibration windows, sequence length); ``distilled``: the objective's ``Distillation`` (None:
    ce). Returns (the training's result, its config, the auxiliary loss's weight)."""
    train_ids, held, calib, seq = data
    warmup, decay = phases
    repbns = [p.repbn for p in progs]
    final = next((p for site, p in zip(layout.norms, progs) if site.role == "final"), None)
    weight = opts["final_aux"] if final is not None else 0.0

    def on_step(step, m):
        if step == warmup:
            init_from_norms(m, progs, calib)
        lam = lam_at(step, warmup, decay)
        for p in progs:
            p.lam = lam
        row = {"lam": lam}
        if weight > 0:  # from the decay's start: the RepBN's fixed statistics take over
            if final.aux is not None:
                row["final_aux_loss"] = float(final.aux.detach()) / final.aux_weight
            final.aux_weight = weight if step >= warmup else 0.0
        return row

    workdir = ctx.workdir / "prepbn" if ctx.workdir else None
    config = {"steps": opts["steps"], "batch_size": opts["batch_size"], "seq_len": seq, "lr": opts["lr"],
              "seed": opts["seed"], "eval_batch_size": 8, "resume": opts["resume"], "precision": opts["precision"],
              "save_every": opts["save_every"] if workdir else 0, "state_dir": workdir}
    config = adaptive(config, opts, settle=warmup + decay)
    hook = attach_token_mask(model, repbns)
    try:
        result = ctx.train(model, train_ids, held, config, objective=layout.objective, on_step=on_step,
                           progress=ctx.train_progress, distillation=distilled,
                           **({"extra_loss": lambda: final.aux} if weight > 0 else {}))
    finally:
        hook.remove()
        if final is not None:
            final.aux_weight, final.aux = 0.0, None
    return result, config, weight


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    opts = {**asdict(PrepbnOptions()), **ctx.options}
    if ctx.train is None or ctx.heldout_ce is None:
        raise SurgeryError("prepbn needs the training loop: run it through convert or apply_passes")
    if devices.sharding():
        raise SurgeryError("prepbn rewrites its norms' weights in the middle of training (at the end of the "
                           "warm-up), which training sharded over the processes (FSDP) does not allow: run it data "
                           "parallel (without --use_fsdp / ACCELERATE_USE_FSDP)")
    warmup, decay = schedule(opts["steps"], opts["warmup"], opts["decay"])
    train_ids, held, calib, seq = _data(ctx, opts, positions(model.config))
    control = Control(model, ctx.workdir) if opts["control"] else None
    distilled = distillation(ctx, model, opts)  # the input, before the norms are replaced
    progs = install(model, layout, opts["momentum"])
    repbns = [p.repbn for p in progs]
    result, config, weight = _trained(model, layout, ctx, opts, progs, (train_ids, held, calib, seq), (warmup, decay),
                                      distilled)
    finish(model, layout, progs)
    t = time.perf_counter()
    reestimate(model, repbns, calib)
    ce = ctx.heldout_ce(model, held, objective=layout.objective)
    report = PassReport("prepbn")
    report.metrics.update(ce_before=result.ce_before, ce_trained=result.ce_after, ce_after=ce,
                          ce_delta=ce - result.ce_before, steps=result.steps, tokens=result.tokens,
                          seconds=result.seconds + time.perf_counter() - t, warmup=warmup, decay=decay,
                          lr=opts["lr"], curve=result.curve, final_aux=weight)
    distilled_report(report, result, opts)
    if weight > 0:
        report.notes.append(f"final norm: auxiliary loss on its input, weight {weight:g}, from step {warmup} (the "
                            "decay's start)")
    report.notes.append(f"{result.done()}: lam = 1 for {warmup}, decayed to 0 over {decay}; held-out CE "
                        f"{result.ce_before:.4f} -> {ce:.4f} ({ce - result.ce_before:+.4f}) after the running "
                        f"statistics were re-estimated on {len(calib)} windows ({result.ce_after:.4f} at the end of "
                        f"training, the curve's last row)")
    if opts["fold"]:
        folded = bn_fold.apply(model, layout_of(model), ctx)
        report.notes += folded.notes
        report.metrics["fold"] = folded.metrics
        report.metrics["ce_folded"] = ctx.heldout_ce(model, held, objective=layout.objective)
    else:
        report.notes.append("not folded (fold=false): the norms are eval-mode RepBN; run bn-fold to fold them")
    if control is not None:
        control_report(report, control.run(ctx, model, train_ids, held, config, layout.objective))
    return report
