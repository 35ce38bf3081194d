"""minimize: turn a masked (zero-filled) network into a smaller dense one with the same function.

The exact step of the "Squeeze-Release" paper: remove what ``analysis`` finds dead (MLP units,
attention heads, residual channels no writer writes), fold the constants dead units still
output into biases, and keep the norms' statistics those of the full D-vector (LayerNorm ->
CompensatedLayerNorm; RMSNorm keeps D as divisor). A layer keeps at least one unit and one
head. Config widths are updated where every layer agrees and the stock config can say so;
otherwise module records (and ``_normsurgery_attrs`` for head counts) make the saved checkpoint
use the self-contained loader. ``hidden_size`` stays the stock D (the compensated norms' divisor).

Two stages, each run part by part after a scan of the whole model (``registry.Stage``), so a
checkpoint larger than memory is minimized one block at a time: the blocks (their dead units and
heads; blocks that share their head counts first scan the least every block must keep), then the
stream (its channels: the scan, of the blocks as the first stage left them, finds which channels
any writer writes and which widths the blocks have).

With mask options the pass first applies the mask (the ``mask`` pass): that changes the
function on purpose, and the masked model becomes the reference this pass must equal.
"""

from __future__ import annotations

from ..core import algebra, analysis
from ..core.layout import Layout
from ..core.registry import PassContext, PassReport, Scan, Stage
from . import _shrink, mask
from .mask import whole  # noqa: F401  (the mask first: by=activation needs the whole model)


def applies(model, layout: Layout) -> str | None:
    reason = mask.applies(model, layout)
    if reason:
        return reason
    for site in layout.norms:
        for r in site.readers:
            if not algebra.is_linear(model.get_submodule(r)):
                return f"{r} is a {type(model.get_submodule(r)).__name__}, not a linear layer"
    return None


def reference_stages(options: dict, layout: Layout) -> list[Stage]:
    """The mask, when the options ask for one (none: the input is the reference)."""
    return mask.stages(options, layout) if mask.wants_mask(options) else []


def stages(options: dict, layout: Layout) -> list[Stage]:
    heads = (Scan(_head_plans, _least),) if layout.shared_head_counts else ()
    return [Stage(_blocks, heads), STREAM]


def _head_plans(model, layout: Layout, ctx: PassContext) -> list:
    return [analysis.head_plan(analysis.heads_dead(model, a)[0], a.num_kv_heads) for a in layout.attention]


def _least(collected: list, layout: Layout, ctx: PassContext) -> dict:
    plans = [p for part in collected for p in part]
    return {"least": analysis.least_heads(plans)} if plans else {}


def _blocks(model, layout: Layout, ctx: PassContext, report: PassReport) -> None:
    """Remove the dead MLP units and attention heads of ``layout``'s blocks."""
    _before(model, layout, ctx, report)
    widths = report.metrics["layers"]
    for w, attn, mlp, plan in zip(widths, layout.attention, layout.mlps,
                                  analysis.head_plans(model, layout, ctx.facts.get("least"))):
        w["mlp_units"] = list(_shrink.mlp(model, mlp))
        w["heads"], w["kv_heads"] = map(list, zip((attn.num_heads, attn.num_kv_heads),
                                                  _shrink.attention(model, attn, plan)))
    report.count("removed {units} MLP units and {heads} attention heads",
                 units=sum(w["mlp_units"][0] - w["mlp_units"][1] for w in widths),
                 heads=sum(w["heads"][0] - w["heads"][1] for w in widths))


def _before(model, layout: Layout, ctx: PassContext, report: PassReport) -> None:
    """The part's sizes before the first stage rewrites it, into ``report`` (once)."""
    if "layers" not in report.metrics:
        report.metrics["layers"], report.metrics["before"] = [{} for _ in layout.attention], _shrink.sizes(
            model, layout, ctx.storage_bytes)


def _evidence(model, layout: Layout, ctx: PassContext) -> tuple:
    return analysis.stream_evidence(model, layout), _shrink.planned_widths(model, layout)


def _removable(collected: list, layout: Layout, ctx: PassContext) -> dict:
    dead, removable = analysis.channels(None, layout, [e for e, _ in collected])
    return {"dead": dead, "removable": removable,
            "widths": {k: [x for _, w in collected for x in w[k]] for k in ("mlp", "heads")}}


def _stream(model, layout: Layout, ctx: PassContext, report: PassReport) -> None:
    """Remove the residual channels no writer writes (``ctx.facts``: the scan's), record the
    widths, and report the part's sizes before and after."""
    _before(model, layout, ctx, report)
    dead, removable = ctx.facts["dead"], ctx.facts["removable"]
    stream = _shrink.channels(model, layout, removable) if bool(removable.any()) else (len(dead),) * 2
    report.notes += _shrink.record_widths(model, layout, ctx.facts["widths"])
    before, after = report.metrics.pop("before"), _shrink.sizes(model, layout, ctx.storage_bytes)
    for i, w in enumerate(report.metrics["layers"]):
        w.update({k: [before["layers"][i][k], after["layers"][i][k]] for k in ("params", "bytes")})
    report.metrics.update({
        "stream_width": list(stream),
        "other": {k: [before["other"][k], after["other"][k]] for k in ("params", "bytes")},
        "params": [before["total"]["params"], after["total"]["params"]],
        "bytes": [before["total"]["bytes"], after["total"]["bytes"]]})
    report.sums, report.joined = ("other", "params", "bytes"), ("layers",)
    visible = int(dead.sum() - removable.sum())
    report.notes.append(f"removed {stream[0] - stream[1]} of {stream[0]} residual channels"
                        + (f"; {visible} more are unwritten but kept: "
                           + ("the model's output (a base model) has every channel" if layout.output_norm
                              else "a LayerNorm still shows them to its readers") if visible else "")
                        + (f"; config hidden_size stays {stream[0]} (the norms' divisor), the saved checkpoint "
                           "records the narrower modules and needs the self-contained loader"
                           if stream[1] < stream[0] else ""))
    report.count("parameters {before:,} -> {after:,}, bytes {bytes_before:,} -> {bytes_after:,}",
                 before=before["total"]["params"], after=after["total"]["params"],
                 bytes_before=before["total"]["bytes"], bytes_after=after["total"]["bytes"])


#: the stream's stage (minimize's second, compensated-ln's only)
STREAM = Stage(_stream, (Scan(_evidence, _removable),))
