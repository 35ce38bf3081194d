"""rotate: an orthogonal change of basis of the residual stream (QuaRot, SpinQuant, SliceGPT).

With every stream norm a gain-free RMSNorm, RMS(Q x) = Q x / sqrt(|Q x|^2 / d + eps) = Q RMS(x)
for an orthogonal Q. So the stream x becomes Q x when every writer writes Q v instead of v
(embedding rows, positional ones too, and output projections with their biases: W <- Q W,
c <- Q c) and every reader of a norm reads W Qᵀ: W Qᵀ Q RMS(x) = W RMS(x). A norm's bias s (kept
where its reader has none) becomes Q s. A tied head is the token embedding, whose rows E Qᵀ are
exactly the rotated head: it stays tied. QK-norms act inside attention, after the readers, and
are untouched. Q (``rotation.rotation``) is a randomised Hadamard matrix (``kind=hadamard``) or a
seeded random orthogonal one (``kind=random``); the same (kind, width, seed) gives the same Q in
every part of a streamed model.
"""

from __future__ import annotations

import functools

import torch

from ..core import algebra, rotation
from ..core.errors import SurgeryError
from ..core.layout import Layout
from ..core.registry import PassContext, PassReport
from .norms import refuse_experts, refuse_output_norms, refuse_post_ln


def applies(model, layout: Layout) -> str | None:
    """None when every stream norm is an RMSNorm with one gain for all channels and a reader."""
    post = refuse_post_ln(layout) or refuse_output_norms(layout) or refuse_experts(layout)
    if post:
        return post
    if layout.output_norm is not None:
        return (f"{layout.output_norm.path} gives the model's output (a base model): rotating the stream "
                "would rotate the output")
    for site in layout.norms:
        if site.kind == "layernorm":
            return (f"{site.path} is a LayerNorm (its mean removal does not commute with a rotation): run "
                    "pre-rmsnorm with fold=true first (--pass pre-rmsnorm --fold --pass rotate)")
        if site.kind != "rmsnorm" or site.offset is None:
            return f"{site.path} is a {site.kind}: rotation needs a gain-free RMSNorm over the whole stream"
        w = model.get_submodule(site.path).weight  # on the meta device until its part is read
        if w is not None and not w.is_meta and w.numel() and not bool((w == w.reshape(-1)[0]).all()):
            kept = site is layout.final_norm and layout.tied  # what flashnorm:keep_tied=true leaves
            return (f"{site.path} has per-channel gains (Q (g * n) != g * (Q n)): fold them into the "
                    "readers first (--pass flashnorm --pass rotate)" + (
                        f"; flashnorm:keep_tied=true leaves this final norm's gain (to keep {layout.head} tied), "
                        "which rotate refuses: drop keep_tied (flashnorm then unties the head)" if kept else ""))
    return None


@functools.lru_cache(maxsize=2)
def _q(kind: str, width: int, seed: int) -> torch.Tensor:
    try:
        return rotation.rotation(kind, width, seed)
    except ValueError as e:
        raise SurgeryError(f"rotate: {e}; kind=random rotates any width") from None


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    kind, seed = ctx.options.get("kind", "hadamard"), int(ctx.options.get("seed", 0))
    d = layout.stream_width
    q = _q(kind, d, seed)
    report = PassReport("rotate")
    for path in layout.embeddings + layout.writers:
        algebra.rotate_outputs(model.get_submodule(path), q)
    readers = [r for s in layout.norms for r in s.readers if not (layout.tied and r == layout.head)]
    for path in readers:
        algebra.rotate_inputs(model.get_submodule(path), q)
    for site in layout.norms:
        norm = model.get_submodule(site.path)
        if getattr(norm, "bias", None) is not None:
            with torch.no_grad():
                norm.bias.copy_(q.to(norm.bias.device) @ norm.bias.detach().to(algebra.WORK))
        if hasattr(norm, "stock_equivalent"):  # the rotated stream is no longer zero-mean: not a LayerNorm
            norm.stock_equivalent = False
    base = rotation.hadamard_base(d) if kind == "hadamard" else None
    what = (f"a randomised Hadamard matrix ({'Sylvester' if base == 1 else f'Paley {base} x Sylvester'})"
            if kind == "hadamard" else "a random orthogonal matrix")
    report.count(f"rotated the {d}-channel stream by {what}, seed {seed}: {{embeddings}} embeddings and "
                 "{writers} writers on the output side, {readers} readers on the input side",
                 embeddings=len(layout.embeddings), writers=len(layout.writers), readers=len(readers))
    if layout.tied and layout.head in {r for s in layout.norms for r in s.readers}:
        report.notes.append(f"{layout.head} is tied to {layout.token_embedding}: the rotated embedding is the "
                            "rotated head, so it stays tied")
    if layout.qk_norms:
        report.count("{n} QK-norms act inside attention, after the readers: unchanged", n=len(layout.qk_norms))
    report.metrics["rotated_writers"] = len(layout.embeddings) + len(layout.writers)
    report.metrics["rotated_readers"] = len(readers)
    return report
