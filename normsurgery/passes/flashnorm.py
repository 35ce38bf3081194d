"""flashnorm: fold norm gains (and LayerNorm biases) into the next linear layers (Graef et al. 2024).

RMS(x) W = (x / rms(x)) diag(g) W: W* = diag(g) W and the norm's gain becomes 1. For LayerNorm
the bias folds into the readers' biases (c + W b); the norm keeps its mean removal and 1/std.

A tied head shares the embedding, so folding the final norm into it unties it (the output
stores the embedding twice); ``keep_tied=true`` leaves the final norm's gain in place instead (on
an untied head it changes nothing, and the report says so).
"""

from __future__ import annotations

from ..core.layout import Layout, NormSite
from ..core.registry import PassContext, PassReport
from .norms import fold_into_readers, foldable, output_note, refuse_norms, refuse_post_ln, untie_if_touched


def applies(model, layout: Layout) -> str | None:
    return refuse_post_ln(layout) or refuse_norms(layout, ("layernorm", "rmsnorm"))


def tied_final(layout: Layout) -> bool:
    """Whether folding the final norm would write into a head tied to the embedding."""
    final = layout.final_norm
    return layout.tied and final in foldable(layout) and layout.head in final.readers


def folded(layout: Layout, options: dict) -> tuple[NormSite, ...]:
    """The norms folded: every foldable one, but a tied head's final norm with ``keep_tied``."""
    sites = foldable(layout)
    if options.get("keep_tied") and tied_final(layout):
        return tuple(s for s in sites if s is not layout.final_norm)
    return sites


def readers(sites: tuple[NormSite, ...]) -> set[str]:
    """The linears the gains of ``sites`` fold into."""
    return {r for s in sites for r in s.readers}


def reads(layout: Layout, options: dict) -> set[str]:
    """What a fold reads and writes: the norms folded and their readers (a tied head is the
    embedding's tensor, untied from it there)."""
    sites = folded(layout, options)
    return {s.path for s in sites} | readers(sites)


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("flashnorm")
    sites = folded(layout, ctx.options)
    final = layout.final_norm
    keep = ctx.options.get("keep_tied")
    if tied_final(layout):
        if keep:
            report.notes.append(f"kept {final.path}'s gain (keep_tied=true): {layout.head} stays tied to "
                                f"{layout.token_embedding}, so the output keeps the input's size and tying")
        else:
            report.notes.append("keep_tied=true would keep the head tied and the final norm's gain")
    elif keep:
        report.notes.append(f"keep_tied=true changed nothing: {layout.head} is not tied to {layout.token_embedding}, "
                            "so folding the final norm into it unties nothing (its gain is folded as without it)")
    touched = readers(sites)
    report.notes += untie_if_touched(model, layout, touched)
    for site in sites:
        fold_into_readers(model, layout, site)
    report.count("folded {norms} norms into {readers} readers; their gains are 1", norms=len(sites),
                 readers=len(touched))
    output_note(report, layout)
    if layout.qk_norms:
        report.count("left {n} QK-norms as they are: rotary embeddings mix pairs of dimensions after them, so "
                     "their gains cannot be folded", n=len(layout.qk_norms))
    report.metrics["norms_folded"] = len(sites)
    report.metrics["qk_norms_left"] = len(layout.qk_norms)
    return report
