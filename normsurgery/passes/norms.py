"""Helpers shared by the norm passes: what a norm module is, and folding it into its readers."""

from __future__ import annotations

import torch
from torch import nn

from .. import algebra
from ..adapters import Layout, NormSite
from ..errors import SurgeryError
from ..runtime import CRMSNorm, RMSNorm


def is_rmsnorm(mod: nn.Module) -> bool:
    """Ours, or an HF ``*RMSNorm`` class (not CRMSNorm, which normalises a d-1 stored stream)."""
    return isinstance(mod, RMSNorm) or (type(mod).__name__.endswith("RMSNorm")
                                        and not isinstance(mod, CRMSNorm))


def eps_of(mod: nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        if hasattr(mod, name):
            return float(getattr(mod, name))
    raise SurgeryError(f"cannot find the epsilon of {type(mod).__name__}")


def offset_of(mod: nn.Module, layout: Layout) -> float:
    """Gain = offset + weight: HF's Gemma norms use offset 1; ours carry it themselves."""
    return mod.offset if isinstance(mod, RMSNorm) else (layout.norm_offset if is_rmsnorm(mod) else 0.0)


def refuse_post_ln(layout: Layout) -> str | None:
    if layout.placement == "post":
        return (f"{layout.family} is Post-LN (x = LN(x + f(x))): the norms normalise the stream "
                "itself, so nothing can be moved into the layers around them")
    return None


def fold_into_readers(model, layout: Layout, site: NormSite) -> None:
    """norm -> reader becomes weightless norm -> reader with W diag(g) and c + W b.

    A reader without a bias (an LM head, say) cannot take W b: then the norm keeps b / g as its
    only parameter, since W diag(g) (n + b / g) = W (g n + b). Needs g != 0 wherever b != 0.
    """
    norm = model.get_submodule(site.path)
    readers = [model.get_submodule(r) for r in site.readers]
    offset = offset_of(norm, layout)
    gain = norm.weight.detach().to(algebra.WORK) + offset
    shift = None if getattr(norm, "bias", None) is None else norm.bias.detach().to(algebra.WORK)
    keep = shift is not None and not all(algebra.has_bias(r) for r in readers)
    if keep and bool(((gain == 0) & (shift != 0)).any()):
        raise SurgeryError(f"{site.path}: a channel has zero gain but a bias, and a reader has no bias to take it")
    for r in readers:
        algebra.fold_affine_into_reader(r, gain, None if keep else shift)
    with torch.no_grad():
        norm.weight.fill_(1.0 - offset)
        if shift is not None:
            norm.bias.copy_((shift / gain if keep else torch.zeros_like(shift)).to(norm.bias.dtype))


def untie_if_touched(model, layout: Layout, touched: set[str]) -> list[str]:
    """Untie a tied head when a pass rewrites the head or the token embedding."""
    if layout.tied and (layout.head in touched or layout.token_embedding in touched):
        algebra.untie(model)
        return [f"untied {layout.head} from {layout.token_embedding}: the rewrite changes one of "
                "them, and a shared tensor would change the other (the output stores both)"]
    return []
