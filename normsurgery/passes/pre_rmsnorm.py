"""pre-rmsnorm: Pre-LN to Pre-RMSNorm (Jiang et al. 2023).

Centre every writer so the residual stream is zero-mean at every layer; then each LayerNorm's
mean is 0 and its variance is mean(x^2), so LN(x) == RMS(x) with the same g, b and eps.
"""

from __future__ import annotations

from torch import nn

from .. import algebra
from ..adapters import Layout
from ..registry import PassContext, PassReport, register
from ..runtime import RMSNorm
from .norms import eps_of, fold_into_readers, is_rmsnorm, refuse_post_ln, untie_if_touched


def applies(model, layout: Layout) -> str | None:
    reason = refuse_post_ln(layout)
    if reason:
        return reason
    mods = [model.get_submodule(s.path) for s in layout.norms]
    if any(is_rmsnorm(m) for m in mods):
        return "the norms are already RMSNorm"
    if not all(isinstance(m, nn.LayerNorm) for m in mods):
        return "some stream norms are not LayerNorm"
    return None


@register("pre-rmsnorm", "Pre-LN to Pre-RMSNorm: centre the writers, swap LayerNorm for RMSNorm",
          "exact", "Pre-LN and parallel LayerNorm models (GPT-2, GPT-NeoX, OPT, Phi)", applies,
          options={"fold": False})
def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("pre-rmsnorm")
    report.notes += untie_if_touched(model, layout, set(layout.embeddings))
    for path in layout.embeddings + layout.writers:
        algebra.centre_outputs(model.get_submodule(path))
    for site in layout.norms:
        ln = model.get_submodule(site.path)
        rms = RMSNorm(ln.normalized_shape[0], eps=eps_of(ln), bias=ln.bias is not None)
        rms.native_equivalent = True  # LN on a zero-mean stream is this RMSNorm
        rms.to(device=ln.weight.device, dtype=ln.weight.dtype)
        rms.load_state_dict(ln.state_dict())
        parent, _, leaf = site.path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, rms)
        if ctx.options.get("fold"):
            fold_into_readers(model, layout, site)
    report.notes.append(f"centred {len(layout.embeddings)} embeddings and {len(layout.writers)} writers; "
                        f"{len(layout.norms)} LayerNorms are now RMSNorm"
                        + ("; gains and biases folded into the readers" if ctx.options.get("fold") else ""))
    report.metrics["norms_swapped"] = len(layout.norms)
    return report
