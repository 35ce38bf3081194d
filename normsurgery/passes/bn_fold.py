"""bn-fold: fold an inference-time BatchNorm, RepBN or any per-channel affine norm into its readers.

With frozen statistics such a norm is y = a * x + c per channel (RepBN: a = gamma / sqrt(v + eps)
+ eta, c = beta - gamma * m / sqrt(v + eps)). A reader W y + b becomes (W diag(a)) x + (b + W c),
and the norm site computes nothing (NoNorm, y = x). Readers without a bias get
one: through the family's config flag where the stock architecture has one (``Layout.bias_flags``:
Llama's ``attention_bias`` / ``mlp_bias``, which also give o_proj / down_proj a bias: those stay zero),
else as a recorded parameter of the self-contained checkpoint. The final norm folds into the
LM head (untied first when tied).

Post-LN (BERT) norms sit on the residual stream itself: their output is read by the next
sublayer and carried forward by the residual, so a (x) cannot move into linear readers alone.
There the norm becomes the same affine map, a ChannelAffine (a multiply-add per channel, no
statistics): exact, but not removed.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..core import algebra
from ..core.families import stock_class_of
from ..core.layout import Layout, NormSite
from ..core.registry import PassContext, PassReport
from ..core.runtime import ChannelAffine, NoNorm, RepBN
from .norms import untie_if_touched

def affine_of(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, c) in float64 when ``mod`` is a per-channel affine map at inference, else None."""
    if isinstance(mod, RepBN):
        with torch.no_grad():
            a, c = (t.detach().to(algebra.WORK) for t in mod.affine())
        return a, c
    if isinstance(mod, nn.BatchNorm1d) and mod.track_running_stats:
        inv = torch.rsqrt(mod.running_var.to(algebra.WORK) + mod.eps)
        w = mod.weight.detach().to(algebra.WORK) if mod.affine else torch.ones_like(inv)
        b = mod.bias.detach().to(algebra.WORK) if mod.affine else torch.zeros_like(inv)
        return w * inv, b - w * mod.running_mean.to(algebra.WORK) * inv
    if isinstance(mod, ChannelAffine):
        return mod.weight.detach().to(algebra.WORK), mod.bias.detach().to(algebra.WORK)
    return None


def foldable(model, layout: Layout) -> list[NormSite]:
    return [s for s in layout.norms if affine_of(model.get_submodule(s.path)) is not None]


def applies(model, layout: Layout) -> str | None:
    if not foldable(model, layout):
        why = ("no stream norm is a per-channel affine map (RepBN, BatchNorm with running statistics or "
               "ChannelAffine): the norms compute per-token statistics")
        if layout.placement == "post":  # prepbn refuses Post-LN: it cannot prepare this model
            return (why + "; on a Post-LN model no pass here replaces them (prepbn is built for Pre-LN and "
                    "parallel decoders only): bn-fold needs a checkpoint trained with BatchNorm or RepBN norms")
        return why + " (run prepbn first)"
    return None


def _bias_flags(model, layout: Layout, new_bias: set[str]) -> list[str]:
    """Turn on each config flag under which the stock architecture gives some of ``new_bias``
    a bias; every other linear the flag gives a bias gets zeros. Returns the flags set."""
    done = []
    for flag in layout.bias_flags:
        if getattr(model.config, flag, True) is not False:
            continue
        cfg = copy.deepcopy(model.config)
        setattr(cfg, flag, True)
        with torch.device("meta"):
            stock = stock_class_of(model)(cfg)
        gains = {n for n, m in stock.named_modules()
                 if getattr(m, "bias", None) is not None and not algebra.has_bias(model.get_submodule(n))}
        gains |= {n for n in new_bias if algebra.has_bias(stock.get_submodule(n))}
        if not gains & new_bias:
            continue
        setattr(model.config, flag, True)
        for n in gains - new_bias:
            mod = model.get_submodule(n)
            w = algebra.weight(mod)
            algebra.set_bias(mod, w.new_zeros(w.shape[0]))
        done.append(flag)
    return done


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("bn-fold")
    sites = foldable(model, layout)
    into_readers = [s for s in sites if s.readers]
    touched = {r for s in into_readers for r in s.readers}
    report.notes += untie_if_touched(model, layout, touched)
    had_bias = {r for r in touched if algebra.has_bias(model.get_submodule(r))}
    for site in sites:
        mod = model.get_submodule(site.path)
        a, c = affine_of(mod)
        ref = next(iter(mod.parameters()), None)
        ref = ref if ref is not None else next(model.parameters())
        for r in site.readers:
            algebra.fold_affine_into_reader(model.get_submodule(r), a, c)
        new = (NoNorm if site.readers else ChannelAffine)(a.numel())
        new.to(device=ref.device, dtype=ref.dtype)
        if not site.readers:
            with torch.no_grad():
                new.weight.copy_(a)
                new.bias.copy_(c)
        model.set_submodule(site.path, new)
    new_bias = touched - had_bias
    flags = _bias_flags(model, layout, new_bias) if new_bias else []
    report.notes.append(f"folded {len(into_readers)} norms into {len(touched)} readers; they compute nothing now")
    if new_bias:
        report.notes.append(f"{len(new_bias)} reader(s) got a bias" + (
            f" (config {', '.join(f'{f}=true' for f in flags)}; the other linears it adds hold zeros)"
            if flags else ""))
    kept = len(sites) - len(into_readers)
    if kept:
        report.notes.append(f"{kept} Post-LN norms sit on the residual stream itself: each is now its frozen "
                            "per-channel affine map (no statistics), which linear readers cannot absorb")
    left = len(layout.norms) - len(sites)
    if left:
        report.notes.append(f"{left} norms still compute statistics (not a per-channel affine map): left as they are")
    report.metrics.update(norms_folded=len(into_readers), norms_kept_affine=kept, norms_left=left,
                          readers_given_bias=len(new_bias), config_flags=flags)
    return report
