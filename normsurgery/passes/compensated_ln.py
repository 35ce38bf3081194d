"""compensated-ln: remove residual channels no writer writes; the norms keep the statistics of
the full D-vector (LayerNorm -> CompensatedLayerNorm: mean = sum(x') / D,
var = sum(x'^2) / D - mean^2; RMSNorm divides by D). The channel part of ``minimize`` alone."""

from __future__ import annotations

from ..layout import Layout
from ..registry import PassContext, PassReport
from . import minimize
from .minimize import applies, reference  # noqa: F401  (applies and masks first as minimize does)


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    return minimize.shrink(model, layout, "compensated-ln", blocks=False, storage_bytes=ctx.storage_bytes)
