"""crmsnorm: Pre-LN to Pre-CRMSNorm (Jiang et al. 2023), the residual stream stored in d-1 dims.

After pre-rmsnorm every writer is centred, so the stream x in R^d is zero-mean and its last
coordinate is x_d = -sum(x~) with x~ = x[:d-1]. Store only x~:
- writers keep their first d-1 outputs (rows of W and c; embedding columns);
- each norm's gain g and bias b are folded into its readers first (W <- W diag(g), c <- c + W b),
  then a reader of the d-vector z becomes W z = (W[:, :d-1] - W[:, d-1] 1^T) z~;
- each RMSNorm becomes CRMSNorm(d-1): z~ = x~ / sqrt((|x~|^2 + (sum x~)^2) / d + eps), the
  RMSNorm of the full vector restricted to the stored coordinates.
Attention and MLP widths stay as they were; only the stream shrinks, so the saved checkpoint
needs the self-contained loader (config.hidden_size keeps the stock d; the module records carry
the d-1 shapes).
"""

from __future__ import annotations

import torch

from ..core import algebra, families
from ..core.layout import Layout
from ..core.norms import is_stock_rmsnorm
from ..core.registry import PassContext, PassReport
from ..core.runtime import CRMSNorm
from ..io.shards import inside
from . import _shrink, pre_rmsnorm
from .norms import refuse_norms, refuse_output_norms, refuse_post_ln, untie_if_touched

#: |mean of a written vector| / max |entry| below which the stream counts as zero-mean
CENTRED = 1e-6


def _centred(model, layout: Layout) -> bool:
    for path in layout.embeddings + layout.writers:
        mod = model.get_submodule(path)
        w = algebra.written_matrix(mod)
        means = w.mean(0)
        c = algebra.bias(mod)
        if c is not None:
            means = torch.cat([means, c.mean().view(1)])
        if means.abs().max() > CENTRED * max(w.abs().max().item(), 1e-30):
            return False
    return True


def applies(model, layout: Layout) -> str | None:
    if "crmsnorm" in layout.norm_kinds:
        return "the norms are already CRMSNorm"
    reason = refuse_post_ln(layout) or refuse_output_norms(layout) or refuse_norms(layout, ("layernorm", "rmsnorm"))
    if reason:
        return reason
    if layout.output_norm is not None:
        return (f"the final norm ({layout.output_norm.path}) gives the model's output (a base model): a "
                "weightless CRMSNorm has no reader to take its gain, and the output would lose a dimension")
    if layout.norm_kinds == {"layernorm"}:
        return None  # pre-rmsnorm runs first
    mods = [model.get_submodule(s.path) for s in layout.norms]
    if layout.norm_kinds != {"rmsnorm"} or any(is_stock_rmsnorm(m) for m in mods):
        return ("the stream norms are not LayerNorm (nor pre-rmsnorm's RMSNorm): an RMSNorm model's "
                "stream is not zero-mean, and centring it would change the function")
    if any(m.divisor != m.dim for m in mods):
        return "the norms divide by more than their width (channels were removed): not a zero-mean stream"
    if not _centred(model, layout):
        return "the writers are not centred, so the stream is not zero-mean (run pre-rmsnorm on the LayerNorm model)"
    return None


def _own(model, layout: Layout) -> list:
    """The parameters of the part ``layout`` covers (all of them in memory)."""
    return [p for name, p in model.named_parameters() if not layout.scope or inside(name, layout.scope)]


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("crmsnorm")
    before = _shrink.size(_own(model, layout), ctx.storage_bytes)
    if layout.norm_kinds == {"layernorm"}:
        centred = pre_rmsnorm.apply(model, layout, PassContext(options={"fold": False}))
        report.notes += centred.notes
        report.counted.update(centred.counted)
        layout = families.layout(model, layout.scope)
    report.notes += untie_if_touched(model, layout, {layout.token_embedding})
    d = layout.stream_width
    stored = torch.arange(d - 1)
    for site in layout.norms:
        norm = model.get_submodule(site.path)
        gain = norm.weight.detach().to(algebra.WORK) + site.offset
        shift = None if norm.bias is None else norm.bias.detach().to(algebra.WORK)
        for path in site.readers:
            reader = model.get_submodule(path)
            w = algebra.weight(reader)
            if shift is not None and bool(shift.any()):
                _shrink.add_to_bias(reader, w @ shift)
            w = w * gain
            _shrink.set_matrix(reader, w[:, :-1] - w[:, -1:])
        model.set_submodule(site.path, CRMSNorm(d - 1, eps=site.eps).to(device=norm.weight.device))
    for path in layout.embeddings + layout.writers:
        _shrink.keep_outputs(model.get_submodule(path), stored)
    after = _shrink.size(_own(model, layout), ctx.storage_bytes)
    report.count(f"the residual stream is stored in {d - 1} of {d} dimensions; {{norms}} norms are weightless "
                 "CRMSNorm, their gains and biases folded into the readers; saving needs the self-contained loader "
                 f"(config hidden_size stays {d})", norms=len(layout.norms))
    report.metrics.update({"stream_width": [d, d - 1], "params": [before[0], after[0]],
                           "bytes": [before[1], after[1]]})
    report.sums = ("params", "bytes")  # [before, after] of this part: the parts' sum is the model's
    return report
