"""minimize and compensated-ln: turn a masked (zero-filled) network into a smaller dense one.

Exact removals (the "Squeeze-Release" paper's minimization step):
- MLP hidden unit i: down's column i is zero (nothing leaves it); or, ungated, up's row i is zero,
  so the unit outputs the constant act(c_i), folded into down's bias; or, gated, gate's row
  and bias are zero (act(0) = 0) or up's row and bias are zero.
- Query head h: its columns of the output projection are zero; or its value head's rows are
  zero, so it outputs the constant value bias c_v (softmax weights sum to 1), and W_o[:, h] c_v
  is folded into the output bias. A key/value head goes only with all the query heads that
  share it; the remaining groups then lose the same number of dead query heads each, so every
  kv head keeps G' query heads and HF's grouped attention (query h reads kv h // G') applies.
- Residual channel j that no writer writes (embedding columns, writer rows and biases zero):
  the stream is 0 there. An RMSNorm's output in j is then its bias b_j (0 without one); a
  LayerNorm's is g_j * (0 - mean) / std + b_j, so j may go only where g_j = 0 (the constant b_j
  folded into the readers' biases) or every reader's column j is zero. The kept d' channels
  keep the statistics of the full D-vector: LayerNorm becomes CompensatedLayerNorm (mean =
  sum / D, var = sum((x' - mean)^2) / D + (D - d') mean^2 / D); RMSNorm only needs D as its
  divisor (runtime.RMSNorm's ``divisor``).
A layer keeps at least one unit and one head. Config widths are updated where every layer
agrees and the stock config can say so; otherwise the module records (and ``_normsurgery_attrs``
for head counts) make the saved checkpoint use the self-contained loader. ``hidden_size`` in
the config stays the stock D (the compensated norms need it as divisor; records carry d').

``compensated-ln`` does the channel part alone (dead channels out, norms compensated).
Options make the zeros first: a mask file, ``sparsity`` (unstructured, ``by`` magnitude) or
``prune_channels`` K; the reference is then the masked model, checked on a probe batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .. import adapters, algebra, masks
from ..adapters import AttentionSite, Layout, MlpSite
from ..registry import PassContext, PassReport, register
from ..runtime import CompensatedLayerNorm, CRMSNorm, RMSNorm
from . import _shrink
from .norms import eps_of, is_rmsnorm, offset_of, refuse_post_ln

OPTIONS = {"mask": "", "sparsity": 0.0, "by": "magnitude", "prune_channels": 0}


@dataclass
class LayerDead:
    layer: int
    mlp_units: int
    dead_units: list[int]
    heads: int
    kv_heads: int
    dead_heads: list[int]
    removable_heads: list[int]  # after the grouped-KV rule
    removable_kv_heads: list[int]
    unwritten_channels: list[int]  # channels this layer's writers leave zero


@dataclass
class DeadReport:
    width: int  # residual channels stored
    layers: list[LayerDead] = field(default_factory=list)
    dead_channels: list[int] = field(default_factory=list)  # no writer writes them
    removable_channels: list[int] = field(default_factory=list)  # dead, and no reader sees them vary


def _zero(t: torch.Tensor, dim: int) -> torch.Tensor:
    return (t == 0).all(dim)


def _bias_or_zeros(mod, n: int) -> torch.Tensor:
    c = algebra.bias(mod)
    return c if c is not None else torch.zeros(n, dtype=algebra.WORK, device=mod.weight.device)


def _layernorm_like(mod) -> bool:
    return isinstance(mod, (nn.LayerNorm, CompensatedLayerNorm))


# ---- MLP units ------------------------------------------------------------------------------

def _mlp_dead(model, site: MlpSite) -> tuple[torch.Tensor, torch.Tensor]:
    """(removable units, the constant each one still outputs: nonzero only where folded)."""
    up, down = model.get_submodule(site.up), model.get_submodule(site.down)
    act = model.get_submodule(site.act)
    wu, wd = algebra.weight(up), algebra.weight(down)
    cu = _bias_or_zeros(up, wu.shape[0])
    dead = _zero(wd, 0)
    const = torch.zeros_like(cu)
    if site.gate is None:
        value = act(cu)
        silent = _zero(wu, 1) & ((value == 0) | algebra.has_bias(down))
        const = torch.where(silent & ~dead, value, const)
        dead = dead | silent
    else:
        gate = model.get_submodule(site.gate)
        wg = algebra.weight(gate)
        cg = _bias_or_zeros(gate, wg.shape[0])
        at_zero = act(torch.zeros(1, dtype=algebra.WORK, device=wg.device)).item()
        dead = dead | (_zero(wg, 1) & (cg == 0) & (at_zero == 0)) | (_zero(wu, 1) & (cu == 0))
    return dead, const


def _shrink_mlp(model, site: MlpSite) -> tuple[int, int]:
    dead, const = _mlp_dead(model, site)
    if bool(dead.all()):
        dead[0] = False
    down = model.get_submodule(site.down)
    if bool(const.any()):
        _shrink.add_to_bias(down, algebra.weight(down) @ const)
    keep = (~dead).nonzero().flatten()
    for path in (site.up, site.gate):
        if path:
            _shrink.keep_outputs(model.get_submodule(path), keep)
    _shrink.keep_inputs(down, keep)
    return len(dead), len(keep)


# ---- attention heads ------------------------------------------------------------------------

def _head_idx(h: int, hd: int) -> torch.Tensor:
    return torch.arange(h * hd, (h + 1) * hd)


def _rows(site: AttentionSite, part: str, heads) -> tuple[str, torch.Tensor]:
    """The module and its output rows that hold ``part`` (q, k or v) of ``heads``."""
    hd = site.head_dim
    if site.qkv_order == "separate":
        idx = [_head_idx(h, hd) for h in heads]
        return getattr(site, part), torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    p = "qkv".index(part)
    if site.qkv_order == "blocks":
        idx = [p * site.num_heads * hd + _head_idx(h, hd) for h in heads]
    else:  # "heads": q, k, v of each head together
        idx = [h * 3 * hd + p * hd + torch.arange(hd) for h in heads]
    return site.qkv, torch.cat(idx)


def _heads_dead(model, site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor]:
    """(dead query heads, each dead head's constant contribution to the output, [heads, d])."""
    hd, groups = site.head_dim, site.num_heads // site.num_kv_heads
    o = model.get_submodule(site.o)
    wo = algebra.weight(o)
    dead = torch.zeros(site.num_heads, dtype=torch.bool)
    const = torch.zeros(site.num_heads, wo.shape[0], dtype=algebra.WORK, device=wo.device)
    for h in range(site.num_heads):
        cols = _head_idx(h, hd).to(wo.device)
        if bool(_zero(wo[:, cols], 0).all()):
            dead[h] = True
            continue
        path, rows = _rows(site, "v", [h // groups])
        v = model.get_submodule(path)
        wv = algebra.weight(v)
        rows = rows.to(wv.device)
        if bool(_zero(wv[rows], 1).all()):
            contribution = wo[:, cols] @ _bias_or_zeros(v, wv.shape[0])[rows]
            if algebra.has_bias(o) or not bool(contribution.any()):
                dead[h], const[h] = True, contribution
    return dead, const


def _head_plan(dead: torch.Tensor, kv_heads: int) -> tuple[list[int], list[int]]:
    """(kept query heads, kept kv heads): whole groups go when all their query heads are dead;
    the other groups each drop the same number m of dead query heads (at least one head stays)."""
    groups = len(dead) // kv_heads
    dead_in = [[h for h in range(g * groups, (g + 1) * groups) if dead[h]] for g in range(kv_heads)]
    kept_kv = [g for g in range(kv_heads) if len(dead_in[g]) < groups] or [0]
    m = min(min(len(dead_in[g]) for g in kept_kv), groups - 1)
    drop = {h for g in kept_kv for h in dead_in[g][:m]}
    kept = [h for g in kept_kv for h in range(g * groups, (g + 1) * groups) if h not in drop]
    return kept, kept_kv


def _shrink_attention(model, site: AttentionSite) -> tuple[int, int]:
    dead, const = _heads_dead(model, site)
    kept, kept_kv = _head_plan(dead, site.num_kv_heads)
    o = model.get_submodule(site.o)
    gone = [h for h in range(site.num_heads) if h not in kept]
    if gone and bool(const[gone].any()):
        _shrink.add_to_bias(o, const[gone].sum(0))
    parts = {"q": kept, "k": kept_kv, "v": kept_kv}
    if site.qkv_order == "separate":
        for part, heads in parts.items():
            path, rows = _rows(site, part, heads)
            _shrink.keep_outputs(model.get_submodule(path), rows)
    else:
        rows = torch.cat([_rows(site, part, heads)[1] for part, heads in parts.items()]).sort().values
        _shrink.keep_outputs(model.get_submodule(site.qkv), rows)
    _shrink.keep_inputs(o, torch.cat([_head_idx(h, site.head_dim) for h in kept]))
    counts = {"heads": len(kept), "kv_heads": len(kept_kv), "groups": len(kept) // len(kept_kv),
              "width": len(kept) * site.head_dim}
    attn = model.get_submodule(site.path)
    for attr, quantity in site.count_attrs:
        setattr(attn, attr, counts[quantity])
    return len(kept), len(kept_kv)


# ---- residual channels ----------------------------------------------------------------------

def _written(model, paths) -> torch.Tensor:
    written = None
    for path in paths:
        mod = model.get_submodule(path)
        w = algebra.weight(mod)
        if isinstance(mod, nn.Embedding):
            col = (w != 0).any(0)
        else:
            col = (w != 0).any(1) | (_bias_or_zeros(mod, w.shape[0]) != 0)
        written = col.cpu() if written is None else written | col.cpu()
    return written


def _channels(model, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(dead channels, removable channels) over the stored stream."""
    dead = ~_written(model, layout.embeddings + layout.writers)
    removable = dead.clone()
    for site in layout.norms:
        norm = model.get_submodule(site.path)
        if not _layernorm_like(norm):
            continue  # RMSNorm: 0 in, its bias (a constant) out
        gain_zero = torch.zeros_like(dead) if norm.weight is None else (norm.weight == 0).cpu()
        unread = torch.ones_like(dead)
        for r in site.readers:
            unread &= _zero(algebra.weight(model.get_submodule(r)), 0).cpu()
        removable &= gain_zero | unread
    return dead, removable


def _shrink_channels(model, layout: Layout, removable: torch.Tensor) -> tuple[int, int]:
    keep = (~removable).nonzero().flatten()
    for site in layout.norms:
        norm = model.get_submodule(site.path)
        b = None if getattr(norm, "bias", None) is None else norm.bias.detach().to(algebra.WORK)
        if b is not None:
            fold = removable.to(b.device)
            if _layernorm_like(norm):
                fold = fold & (torch.zeros_like(fold) if norm.weight is None else norm.weight == 0)
            for r in site.readers:
                reader = model.get_submodule(r)
                delta = algebra.weight(reader)[:, fold] @ b[fold]
                if bool(delta.any()):
                    _shrink.add_to_bias(reader, delta)
        _shrink.replace(model, site.path, _compensated(norm, layout, keep))
        for r in site.readers:
            _shrink.keep_inputs(model.get_submodule(r), keep)
    for path in layout.embeddings + layout.writers:
        _shrink.keep_outputs(model.get_submodule(path), keep)
    if layout.tied:
        model.get_submodule(layout.head).weight = model.get_submodule(layout.token_embedding).weight
    return len(removable), len(keep)


def _compensated(norm, layout: Layout, keep: torch.Tensor) -> nn.Module:
    """The norm over the kept channels with the full vector's statistics."""
    w = norm.weight.detach()
    k = keep.to(w.device)
    if _layernorm_like(norm):
        full = norm.full_dim if isinstance(norm, CompensatedLayerNorm) else norm.normalized_shape[0]
        new = CompensatedLayerNorm(len(keep), full, eps=eps_of(norm), bias=norm.bias is not None)
    else:
        full = norm.divisor if isinstance(norm, RMSNorm) else w.shape[0]
        new = RMSNorm(len(keep), eps=eps_of(norm), bias=getattr(norm, "bias", None) is not None,
                      offset=offset_of(norm, layout), divisor=full)
    new.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w[k])
        if new.bias is not None:
            new.bias.copy_(norm.bias.detach()[k])
    return new


# ---- inspection -----------------------------------------------------------------------------

def dead_units(model, layout: Layout) -> DeadReport:
    """Dead MLP units, attention heads and residual channels, per layer (nothing is changed)."""
    dead_ch, removable = _channels(model, layout)
    report = DeadReport(len(dead_ch), dead_channels=dead_ch.nonzero().flatten().tolist(),
                        removable_channels=removable.nonzero().flatten().tolist())
    for i, (attn, mlp) in enumerate(zip(layout.attention, layout.mlps)):
        units, _ = _mlp_dead(model, mlp)
        heads, _ = _heads_dead(model, attn)
        kept, kept_kv = _head_plan(heads, attn.num_kv_heads)
        report.layers.append(LayerDead(
            i, len(units), units.nonzero().flatten().tolist(), attn.num_heads, attn.num_kv_heads,
            heads.nonzero().flatten().tolist(), [h for h in range(attn.num_heads) if h not in kept],
            [g for g in range(attn.num_kv_heads) if g not in kept_kv],
            (~_written(model, (attn.o, mlp.down))).nonzero().flatten().tolist()))
    return report


# ---- config and records ---------------------------------------------------------------------

def _record_widths(model, layout: Layout, mlp_changed: bool) -> list[str]:
    """Write uniform widths into the config where its keys can say them; head counts it cannot
    say go into each attention module's ``_normsurgery_attrs`` (set again after loading)."""
    notes = []
    cfg, keys = model.config, dict(layout.config_widths)
    widths = {algebra.weight(model.get_submodule(m.down)).shape[1] for m in layout.mlps}
    if mlp_changed and len(widths) == 1 and "intermediate" in keys:
        setattr(cfg, keys["intermediate"], widths.pop())
        notes.append(f"config {keys['intermediate']} = {getattr(cfg, keys['intermediate'])}")
    counts = {(a.num_heads, a.num_kv_heads) for a in layout.attention}
    stock = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    if len(counts) == 1 and counts != {stock} and {"heads", "kv_heads", "head_dim"} <= set(keys):
        (h, kv), = counts
        setattr(cfg, keys["heads"], h)
        setattr(cfg, keys["kv_heads"], kv)
        setattr(cfg, keys["head_dim"], layout.attention[0].head_dim)
        notes.append(f"config {keys['heads']} = {h}, {keys['kv_heads']} = {kv}")
        stock = (h, kv)
    for a in layout.attention:
        attn = model.get_submodule(a.path)
        if (a.num_heads, a.num_kv_heads) != stock and a.count_attrs:
            attn._normsurgery_attrs = {attr: getattr(attn, attr) for attr, _ in a.count_attrs}
        elif hasattr(attn, "_normsurgery_attrs"):
            del attn._normsurgery_attrs
    return notes


# ---- the passes -----------------------------------------------------------------------------

def applies(model, layout: Layout) -> str | None:
    reason = refuse_post_ln(layout)
    if reason:
        return reason
    if not layout.attention or len(layout.mlps) != len(layout.attention):
        return f"the {layout.family} adapter does not describe its attention and MLP blocks"
    for site in layout.norms:
        mod = model.get_submodule(site.path)
        if isinstance(mod, CRMSNorm) or not (_layernorm_like(mod) or is_rmsnorm(mod)):
            return f"{site.path} is a {type(mod).__name__}: only LayerNorm and RMSNorm streams can lose channels"
        for r in site.readers:
            if not isinstance(model.get_submodule(r), (nn.Linear, Conv1D)):
                return f"{r} is a {type(model.get_submodule(r)).__name__}, not a linear layer"
    return None


def _make_mask(model, layout: Layout, options: dict) -> tuple[dict, torch.Tensor | None, list[str]]:
    masks.check_criterion(options["by"])
    params, channels, notes = {}, None, []
    if options["mask"]:
        params, channels = masks.load(options["mask"])
        notes.append(f"mask {options['mask']}: {len(params)} parameters"
                     + ("" if channels is None else f", {int((channels == 0).sum())} channels"))
    if options["sparsity"]:
        for name, keep in masks.magnitude(model, layout, options["sparsity"]).items():
            params[name] = keep & params[name].bool() if name in params else keep
        notes.append(f"{options['by']} sparsity {options['sparsity']:g} in every linear inside the blocks")
    if options["prune_channels"]:
        keep = masks.prune_channels(model, layout, options["prune_channels"], options["by"])
        channels = keep if channels is None else keep & channels.bool()
        notes.append(f"pruned the {options['prune_channels']} least-written residual channels")
    return params, channels, notes


def _probe(model) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids.to(model.device)).logits.to(torch.float64)


def _run(model, layout: Layout, ctx: PassContext, name: str, blocks: bool) -> PassReport:
    report = PassReport(name)
    before = _shrink.sizes(model, layout.layers)
    params, channels, report.notes = _make_mask(model, layout, {**OPTIONS, **ctx.options})
    reference = None
    if params or channels is not None:
        masks.apply(model, layout, params, channels)
        reference = _probe(model)
    widths = [{} for _ in layout.attention]
    if blocks:
        for w, attn, mlp in zip(widths, layout.attention, layout.mlps):
            w["mlp_units"] = list(_shrink_mlp(model, mlp))
            w["heads"], w["kv_heads"] = map(list, zip((attn.num_heads, attn.num_kv_heads),
                                                      _shrink_attention(model, attn)))
    dead, removable = _channels(model, layout)  # after the blocks: a removed unit may have been a channel's last writer
    stream = _shrink_channels(model, layout, removable) if bool(removable.any()) else (len(dead),) * 2
    report.notes += _record_widths(model, adapters.layout(model),
                                   any(w["mlp_units"][0] != w["mlp_units"][1] for w in widths if w))
    after = _shrink.sizes(model, layout.layers)
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
                        + (f"; {visible} more are unwritten but a LayerNorm still shows them to its readers"
                           if visible else "")
                        + (f"; config hidden_size stays {stream[0]} (the norms' divisor), the saved checkpoint "
                           "records the narrower modules and needs the self-contained loader"
                           if stream[1] < stream[0] else ""))
    report.notes.append(f"parameters {before['total']['params']:,} -> {after['total']['params']:,}, "
                        f"bytes {before['total']['bytes']:,} -> {after['total']['bytes']:,}")
    if reference is not None:
        d = ((reference - _probe(model)).abs().max() / reference.abs().max()).item()
        report.metrics.update({"reference": "masked", "relative_error_vs_masked": d})
        report.notes.append(f"the mask changed the function: this output equals the masked model "
                            f"(relative logit error {d:.1e} on a probe batch), not the input")
    return report


@register("minimize", "Remove dead MLP units, attention heads and residual channels (exact; optional mask first)",
          "exact", "Pre-LN and parallel models of every supported family", applies, options=OPTIONS)
def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    return _run(model, layout, ctx, "minimize", blocks=True)


@register("compensated-ln", "Remove dead residual channels, norms keeping the full width's statistics (exact)",
          "exact", "Pre-LN and parallel models of every supported family", applies, options=OPTIONS)
def apply_channels(model, layout: Layout, ctx: PassContext) -> PassReport:
    return _run(model, layout, ctx, "compensated-ln", blocks=False)


@register("mask", "Zero weights by a mask file or criterion (changes the function; minimize then shrinks)",
          "trained", "Pre-LN and parallel models of every supported family", applies, options=OPTIONS)
def apply_mask(model, layout: Layout, ctx: PassContext) -> PassReport:
    report = PassReport("mask")
    params, channels, report.notes = _make_mask(model, layout, {**OPTIONS, **ctx.options})
    report.metrics.update(masks.apply(model, layout, params, channels))
    return report
