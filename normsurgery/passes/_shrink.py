"""Shrinking a model to fewer rows or columns, keeping module classes: the slicing primitives
and the removal of what ``analysis`` finds dead (MLP units, attention heads, residual channels).

Every module is seen as y = W x + c with W [out, in] (algebra's convention); an embedding's
"outputs" are its columns (the stream coordinates it writes). Size attributes that the module's
forward reads (Conv1D's ``nf``, Linear's ``in_features``, ...) follow the new shapes, the same
attributes the runtime sets when it rebuilds a saved checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import algebra, analysis
from ..io.checkpoint import config_refusal
from ..core.layout import AttentionSite, Layout, MlpSite, NormSite
from ..core.runtime import SIZE_ATTRS, CompensatedLayerNorm, RMSNorm


def set_matrix(mod: nn.Module, w: torch.Tensor, c: torch.Tensor | None = None) -> None:
    """Write W [out, in] (embeddings: [rows, d]) and, when given, c; sync the size attributes."""
    algebra.set_weight(mod, w)
    if c is not None:
        algebra.set_bias(mod, c)
    for cls, attrs in SIZE_ATTRS.items():
        if isinstance(mod, cls):
            for k, v in attrs(list(mod.weight.shape)).items():
                setattr(mod, k, v)


def keep_outputs(mod: nn.Module, idx: torch.Tensor) -> None:
    """Keep the outputs ``idx``: rows of W and entries of c (an embedding: its columns)."""
    w = algebra.weight(mod, None)  # selecting entries: exact in the dtype held, no float64 copy
    if isinstance(mod, nn.Embedding):
        set_matrix(mod, w[:, idx])
        return
    c = algebra.bias(mod)
    set_matrix(mod, w[idx], None if c is None else c[idx])


def keep_inputs(mod: nn.Module, idx: torch.Tensor) -> None:
    """Keep the inputs ``idx``: columns of W."""
    set_matrix(mod, algebra.weight(mod, None)[:, idx])


def add_to_bias(mod: nn.Module, delta: torch.Tensor) -> None:
    """c <- c + delta, creating c (zeros) on a linear that had none."""
    c = algebra.bias(mod)
    algebra.set_bias(mod, (c if c is not None else torch.zeros_like(delta)) + delta)


def size(params, storage_bytes: int | None = None) -> tuple[int, int]:
    """(parameter count, bytes) of distinct parameters (a tied weight counts once); floating-point
    values count ``storage_bytes`` each when given (the checkpoint's dtype, not the working one)."""
    seen = {id(p): p for p in params}.values()
    return sum(p.numel() for p in seen), sum(
        p.numel() * (storage_bytes if storage_bytes and p.is_floating_point() else p.element_size()) for p in seen)


def sizes(model, layout: Layout, storage_bytes: int | None = None) -> dict:
    """Parameters and bytes (``size``) per block and for everything outside the blocks, of what
    ``layout`` holds (one part's scope, or the whole model)."""
    blocks = [(f"{layout.layers_path}.{i}", b) for i, b in enumerate(model.get_submodule(layout.layers_path))]
    held = {id(p): p for n, p in model.named_parameters(remove_duplicate=False) if layout.holds(n)}
    inside = {id(p) for path, b in blocks for p in b.parameters()}
    per_layer = [size(b.parameters(), storage_bytes) for path, b in blocks if layout.holds(path)]
    other = size((p for i, p in held.items() if i not in inside), storage_bytes)
    total = size(held.values(), storage_bytes)
    return {"layers": [{"params": n, "bytes": b} for n, b in per_layer],
            "other": {"params": other[0], "bytes": other[1]},
            "total": {"params": total[0], "bytes": total[1]}}


def mlp(model, site: MlpSite) -> tuple[int, int]:
    dead, const = analysis.mlp_dead(model, site)
    if bool(dead.all()):
        dead[0] = False  # a layer keeps one unit: it goes on computing its own output
        const[0] = 0
    down = model.get_submodule(site.down)
    if bool(const.any()):
        add_to_bias(down, algebra.weight(down) @ const)
    keep = (~dead).nonzero().flatten()
    if site.stacked:  # gate's rows, then up's
        keep_outputs(model.get_submodule(site.up), torch.cat([keep, len(dead) + keep]))
    for path in () if site.stacked else (site.up, site.gate):
        if path:
            keep_outputs(model.get_submodule(path), keep)
    keep_inputs(down, keep)
    return len(dead), len(keep)


def attention(model, site: AttentionSite, plan: tuple[list[int], list[int]]) -> tuple[int, int]:
    """Keep the (query heads, kv heads) of ``plan`` (``analysis.head_plans``)."""
    _, const = analysis.heads_dead(model, site)
    kept, kept_kv = plan
    o = model.get_submodule(site.o)
    gone = [h for h in range(site.num_heads) if h not in kept]
    if gone and bool(const[gone].any()):
        add_to_bias(o, const[gone].sum(0))
    parts = {"q": kept, "k": kept_kv, "v": kept_kv}
    if site.qkv_order == "separate":
        for part, heads in parts.items():
            path, rows = analysis.qkv_rows(site, part, heads)
            keep_outputs(model.get_submodule(path), rows)
    else:
        rows = torch.cat([analysis.qkv_rows(site, part, heads)[1] for part, heads in parts.items()]).sort().values
        keep_outputs(model.get_submodule(site.qkv), rows)
    keep_inputs(o, torch.cat([analysis.head_idx(h, site.head_dim) for h in kept]))
    for path, part in site.per_head:
        owner, _, name = path.rpartition(".")
        mod = model.get_submodule(owner)
        old = getattr(mod, name)
        setattr(mod, name, nn.ModuleList(old[h] for h in parts[part]) if isinstance(old, nn.ModuleList)
                else nn.Parameter(old.detach()[torch.tensor(parts[part], device=old.device)].clone(),
                                  requires_grad=old.requires_grad))
    counts = {"heads": len(kept), "kv_heads": len(kept_kv), "groups": len(kept) // len(kept_kv),
              "width": len(kept) * site.head_dim}
    attn = model.get_submodule(site.path)
    for attr, quantity in site.count_attrs:
        setattr(attn, attr, counts[quantity])
    return len(kept), len(kept_kv)


def channels(model, layout: Layout, removable: torch.Tensor) -> tuple[int, int]:
    keep = (~removable).nonzero().flatten()
    for site in layout.norms:
        norm = model.get_submodule(site.path)
        b = None if getattr(norm, "bias", None) is None else norm.bias.detach().to(algebra.WORK)
        if b is not None:
            fold = removable.to(b.device)
            if site.kind in analysis.CENTRING:
                fold = fold & (torch.zeros_like(fold) if norm.weight is None else norm.weight == 0)
            for r in site.readers:
                reader = model.get_submodule(r)
                delta = algebra.weight(reader)[:, fold] @ b[fold]
                if bool(delta.any()):
                    add_to_bias(reader, delta)
        model.set_submodule(site.path, compensated(norm, site, keep))
        for r in site.readers:
            keep_inputs(model.get_submodule(r), keep)
    for path in layout.embeddings + layout.writers:
        keep_outputs(model.get_submodule(path), keep)
    if layout.tied and layout.holds(layout.token_embedding):
        model.get_submodule(layout.head).weight = model.get_submodule(layout.token_embedding).weight
    return len(removable), len(keep)


def compensated(norm, site: NormSite, keep: torch.Tensor) -> nn.Module:
    """The norm over the kept channels with the full vector's statistics."""
    w = norm.weight.detach()
    k = keep.to(w.device)
    if site.kind in analysis.CENTRING:
        full = getattr(norm, "full_dim", w.shape[0])
        new = CompensatedLayerNorm(len(keep), full, eps=site.eps, bias=norm.bias is not None)
    else:
        full = getattr(norm, "divisor", w.shape[0])
        new = RMSNorm(len(keep), eps=site.eps, bias=getattr(norm, "bias", None) is not None,
                      offset=site.offset, divisor=full)
    new.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w[k])
        if new.bias is not None:
            new.bias.copy_(norm.bias.detach()[k])
    return new


def planned_widths(model, layout: Layout) -> dict:
    """The widths of ``layout``'s blocks as they stand: MLP units, and (heads, kv heads, head
    dim) of each attention (:func:`record_widths` of the whole model's)."""
    return {"mlp": [algebra.in_width(model.get_submodule(m.down)) for m in layout.mlps],
            "heads": [(a.num_heads, a.num_kv_heads, a.head_dim) for a in layout.attention]}


def record_widths(model, layout: Layout, widths: dict) -> list[str]:
    """Write uniform widths (``widths``: :func:`planned_widths` over every block of the model)
    into the config where its keys can say them; head counts it cannot say, or its class refuses
    (``checkpoint.config_refusal``), go into each of ``layout``'s attention modules'
    ``_normsurgery_attrs`` (set again after loading)."""
    notes = []
    cfg, keys = model.config, dict(layout.config_widths)
    mlp, heads = set(widths["mlp"]), set(widths["heads"])
    if len(mlp) == 1 and "intermediate" in keys and getattr(cfg, keys["intermediate"]) != min(mlp):  # (as heads)
        setattr(cfg, keys["intermediate"], min(mlp))
        notes.append(f"config {keys['intermediate']} = {getattr(cfg, keys['intermediate'])}")
    stock = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    if len(heads) == 1 and {"heads", "kv_heads", "head_dim"} <= set(keys):
        (h, kv, hd), = heads
        if (h, kv) != stock:  # (a part after the first finds it written)
            counts = {keys["heads"]: h, keys["kv_heads"]: kv, keys["head_dim"]: hd}
            refused = config_refusal(cfg, **counts)
            if refused is None:
                for key, value in counts.items():
                    setattr(cfg, key, value)
                notes.append(f"config {keys['heads']} = {h}, {keys['kv_heads']} = {kv}")
                stock = (h, kv)
            else:  # the attention modules record their counts, as where blocks differ
                notes.append(f"config keeps {keys['heads']} = {getattr(cfg, keys['heads'])}: {type(cfg).__name__} "
                             f"refuses {h} ({refused}); each attention records its head counts")
    for a in layout.attention:
        attn = model.get_submodule(a.path)
        if (a.num_heads, a.num_kv_heads) != stock and a.count_attrs:
            attn._normsurgery_attrs = {attr: getattr(attn, attr) for attr, _ in a.count_attrs}
        elif hasattr(attn, "_normsurgery_attrs"):
            del attn._normsurgery_attrs
    return notes
