"""compensated-ln: remove residual channels no writer writes; the norms keep the statistics of
the full D-vector (LayerNorm -> CompensatedLayerNorm: mean = sum(x') / D,
var = sum(x'^2) / D - mean^2; RMSNorm divides by D). The channel stage of ``minimize`` alone."""

from __future__ import annotations

from ..core.layout import Layout
from ..core.registry import Stage
from .minimize import STREAM, applies, reference_stages, whole  # noqa: F401  (applies and masks first as minimize does)


def stages(options: dict, layout: Layout) -> list[Stage]:
    return [STREAM]
