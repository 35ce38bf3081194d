"""flashnorm: fold norm gains (and LayerNorm biases) into the next linear layers (Graef et al. 2024).

RMS(x) W = (x / rms(x)) diag(g) W: W* = diag(g) W and the norm's gain becomes 1. For LayerNorm
the bias folds into the readers' biases (c + W b); the norm keeps its mean removal and 1/std.
"""

from __future__ import annotations

from ..layout import Layout
from ..registry import PassContext, PassReport
from .norms import fold_into_readers, foldable, output_note, refuse_norms, refuse_post_ln, untie_if_touched


def applies(model, layout: Layout) -> str | None:
    return refuse_post_ln(layout) or refuse_norms(layout, ("layernorm", "rmsnorm"))


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("flashnorm")
    sites = foldable(layout)
    touched = {r for s in sites for r in s.readers}
    report.notes += untie_if_touched(model, layout, touched)
    for site in sites:
        fold_into_readers(model, layout, site)
    report.notes.append(f"folded {len(sites)} norms into {len(touched)} readers; their gains are 1")
    report.notes += output_note(layout)
    if layout.qk_norms:
        report.notes.append(f"left {len(layout.qk_norms)} QK-norms as they are: rotary embeddings mix "
                            "pairs of dimensions after them, so their gains cannot be folded")
    report.metrics["norms_folded"] = len(sites)
    report.metrics["qk_norms_left"] = len(layout.qk_norms)
    return report
