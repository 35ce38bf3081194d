"""minimize: turn a masked (zero-filled) network into a smaller dense one with the same function.

The exact step of the "Squeeze-Release" paper: remove what ``analysis`` finds dead (MLP units,
attention heads, residual channels no writer writes), fold the constants dead units still
output into biases, and keep the norms' statistics those of the full D-vector (LayerNorm ->
CompensatedLayerNorm; RMSNorm keeps D as divisor). A layer keeps at least one unit and one
head. Config widths are updated where every layer agrees and the stock config can say so;
otherwise module records (and ``_normsurgery_attrs`` for head counts) make the saved checkpoint
use the self-contained loader. ``hidden_size`` stays the stock D (the compensated norms' divisor).

With mask options the pass first applies the mask (the ``mask`` pass): that changes the
function on purpose, and the masked model becomes the reference this pass must equal.
"""

from __future__ import annotations

from .. import algebra, analysis, families
from ..layout import Layout
from ..registry import PassContext, PassReport
from . import _shrink, mask


def applies(model, layout: Layout) -> str | None:
    reason = mask.applies(model, layout)
    if reason:
        return reason
    for site in layout.norms:
        for r in site.readers:
            if not algebra.is_linear(model.get_submodule(r)):
                return f"{r} is a {type(model.get_submodule(r)).__name__}, not a linear layer"
    return None


def reference(model, layout: Layout, ctx: PassContext) -> PassReport | None:
    """The masked model, when the options ask for a mask (None: the input is the reference)."""
    return mask.apply(model, layout, ctx) if mask.wants_mask(ctx.options) else None


def shrink(model, layout: Layout, name: str, blocks: bool, storage_bytes: int | None = None) -> PassReport:
    """Remove dead units (``blocks``) and dead channels; report sizes per layer (bytes: ``storage_bytes``
    per floating-point value, the checkpoint's dtype; None: as held)."""
    report = PassReport(name)
    before = _shrink.sizes(model, layout.layers_path, storage_bytes)
    widths = [{} for _ in layout.attention]
    if blocks:
        plans = analysis.head_plans(model, layout)
        for w, attn, mlp, plan in zip(widths, layout.attention, layout.mlps, plans):
            w["mlp_units"] = list(_shrink.mlp(model, mlp))
            w["heads"], w["kv_heads"] = map(list, zip((attn.num_heads, attn.num_kv_heads),
                                                      _shrink.attention(model, attn, plan)))
    # after the blocks: a removed unit may have been a channel's last writer
    dead, removable = analysis.channels(model, layout)
    stream = _shrink.channels(model, layout, removable) if bool(removable.any()) else (len(dead),) * 2
    report.notes += _shrink.record_widths(model, families.layout(model),
                                          any(w["mlp_units"][0] != w["mlp_units"][1] for w in widths if w))
    after = _shrink.sizes(model, layout.layers_path, storage_bytes)
    for i, w in enumerate(widths):
        w.update({k: [before["layers"][i][k], after["layers"][i][k]] for k in ("params", "bytes")})
    report.metrics.update({
        "layers": widths, "stream_width": list(stream),
        "other": {k: [before["other"][k], after["other"][k]] for k in ("params", "bytes")},
        "params": [before["total"]["params"], after["total"]["params"]],
        "bytes": [before["total"]["bytes"], after["total"]["bytes"]]})
    if blocks:
        units = sum(w["mlp_units"][0] - w["mlp_units"][1] for w in widths)
        heads = sum(w["heads"][0] - w["heads"][1] for w in widths)
        report.notes.append(f"removed {units} MLP units and {heads} attention heads")
    visible = int(dead.sum() - removable.sum())
    report.notes.append(f"removed {stream[0] - stream[1]} of {stream[0]} residual channels"
                        + (f"; {visible} more are unwritten but kept: "
                           + ("the model's output (a base model) has every channel" if layout.output_norm
                              else "a LayerNorm still shows them to its readers") if visible else "")
                        + (f"; config hidden_size stays {stream[0]} (the norms' divisor), the saved checkpoint "
                           "records the narrower modules and needs the self-contained loader"
                           if stream[1] < stream[0] else ""))
    report.notes.append(f"parameters {before['total']['params']:,} -> {after['total']['params']:,}, "
                        f"bytes {before['total']['bytes']:,} -> {after['total']['bytes']:,}")
    return report


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    return shrink(model, layout, "minimize", blocks=True, storage_bytes=ctx.storage_bytes)
