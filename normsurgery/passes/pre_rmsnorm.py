"""pre-rmsnorm: Pre-LN to Pre-RMSNorm (Jiang et al. 2023).

Centre every writer so the residual stream is zero-mean at every layer; then each LayerNorm's
mean is 0 and its variance is mean(x^2), so LN(x) == RMS(x) with the same g, b and eps.
"""

from __future__ import annotations

from ..core import algebra
from ..core.layout import Layout
from ..core.norms import rmsnorm_like
from ..core.registry import PassContext, PassReport
from .norms import fold_into_readers, foldable, output_note, refuse_norms, refuse_output_norms, refuse_post_ln, untie_if_touched


def applies(model, layout: Layout) -> str | None:
    if layout.norm_kinds == {"rmsnorm"}:
        return "the norms are already RMSNorm"
    return refuse_post_ln(layout) or refuse_output_norms(layout) or refuse_norms(layout, ("layernorm",))


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("pre-rmsnorm")
    report.notes += untie_if_touched(model, layout, set(layout.embeddings))
    for path in layout.embeddings + layout.writers:
        algebra.centre_outputs(model.get_submodule(path))
    for site in layout.norms:
        # LN on a zero-mean stream is this RMSNorm: the stock class computes it too
        model.set_submodule(site.path, rmsnorm_like(model.get_submodule(site.path), stock_equivalent=True))
        if ctx.options.get("fold") and site in foldable(layout):
            fold_into_readers(model, layout, site)
    report.count("centred {embeddings} embeddings and {writers} writers; {norms} LayerNorms are now RMSNorm"
                 + ("; gains and biases folded into the readers" if ctx.options.get("fold") else ""),
                 embeddings=len(layout.embeddings), writers=len(layout.writers), norms=len(layout.norms))
    if ctx.options.get("fold"):
        output_note(report, layout)
    report.metrics["norms_swapped"] = len(layout.norms)
    return report
