"""Masks that put exact zeros into a model (unstructured magnitude; structured: MLP units,
attention heads, residual channels) and the release that gives the zeros left inside kept
tensors back to training.

A parameter mask maps parameter names to keep tensors of the parameter's shape (nonzero keeps);
applying it multiplies each parameter by it. A channel mask is a keep vector over the d
residual channels. Applying it zeroes, for every removed channel j, what writes j (embedding
columns, writer rows and bias entries) and j's gain in every stream norm. The stream is then 0
in j, and a LayerNorm's output there is the constant b_j (g_j * (0 - mean) / std + b_j with
g_j = 0), which its readers may still see: that constant is part of the function. The model
after :func:`apply` is "the masked model" that minimization reproduces exactly.

A unit or head mask zeroes what the unit or head writes: unit j's column of ``down``, head h's
columns of ``o``; ``minimize`` then removes it (and a KV head once all its query heads go).
Scores, by criterion:
- ``magnitude``: unit j scores |up_j| |gate_j| |down_:j| (row and column 2-norms; no gate: 1),
  head h scores |o_:h|_F |v_g(h)|_F (its output columns and its KV head's value rows);
- ``activation`` (calibration tokens): what a unit or head writes into the stream, in energy:
  unit j scores a_j^2 |down_:j|^2, head h the sum over its columns c of o of a_c^2 |o_:c|^2,
  a the RMS of that input coordinate over the tokens (``analysis.input_rms``).
With grouped KV heads whole groups go (the score of a group: the sum of its heads'), since a KV
head is shared by its query heads. Residual channels score by the energy written into them.

Mask files are safetensors: parameter names, plus ``residual_channels`` for a channel mask.
"""

from __future__ import annotations

import torch
from torch import nn

from . import algebra, analysis, devices
from .errors import SurgeryError
from .layout import Layout

CHANNELS = "residual_channels"


def block_weights(model, layout: Layout) -> dict[str, nn.Parameter]:
    """The weight matrices of every linear inside the blocks ``layout`` holds (embeddings and head
    excluded)."""
    out = {}
    for name, mod in model.get_submodule(layout.layers_path).named_modules():
        if algebra.is_linear(mod) and layout.holds(f"{layout.layers_path}.{name}"):
            out[f"{layout.layers_path}.{name}.weight"] = mod.weight
    return out


def magnitude(model, layout: Layout, sparsity: float) -> dict[str, torch.Tensor]:
    """Per matrix, zero the round(sparsity * numel) entries of smallest |w| (ties by position); ``sparsity``
    in [0, 1), checked with the options that give it (``MaskOptions``, ``SqueezeOptions``)."""
    masks = {}
    for name, w in block_weights(model, layout).items():
        masks[name] = drop_smallest(w, round(sparsity * w.numel()))
    return masks


#: entries per block when :func:`_past_nth_true` scans a mask (its only index work: one block's)
BLOCK = 1 << 20


def drop_smallest(w: torch.Tensor, k: int) -> torch.Tensor:
    """Keep mask (bool, ``w``'s shape and device) without the ``k`` entries of smallest |w|, ties
    broken by position: exactly ``keep[|w|.flatten().argsort(stable=True)[:k]] = False``.

    By threshold, in O(numel) and without an index per entry: t = the k-th smallest |w|; every
    |w| < t goes, every |w| > t stays, and of the entries with |w| == t the first (in flattened
    order) k - count(|w| < t) go, the rest stay. (NaN-free ``w``; any float dtype and device.)"""
    n = w.numel()
    keep = torch.ones(n, dtype=torch.bool, device=w.device)
    if k <= 0:
        return keep.view(w.shape)
    if k >= n:
        return keep.zero_().view(w.shape)
    t = _kth_abs(w, k)
    mag = w.detach().abs().flatten()
    torch.gt(mag, t, out=keep)
    tie = mag == t
    del mag
    below = n - int(keep.count_nonzero()) - int(tie.count_nonzero())
    p = _past_nth_true(tie, k - below)  # of the ties the first k - below go (at least one)
    keep[p:] |= tie[p:]
    return keep.view(w.shape)


def _kth_abs(w: torch.Tensor, k: int) -> float:
    """The k-th smallest |w| (1-based, 1 <= k <= numel), exactly (a value of |w|)."""
    v = w.detach().flatten()
    if v.device.type != devices.HOST:
        return torch.kthvalue(v.abs(), k).values.item()
    # host: NumPy's in-place introselect (torch.kthvalue on CPU allocates int64 indices)
    a = v.abs() if v.dtype in (torch.float32, torch.float64) else v.float().abs_()  # exact widening
    x = a.numpy()  # host
    x.partition(k - 1)
    return float(x[k - 1])


def _past_nth_true(mask: torch.Tensor, m: int) -> int:
    """Position just past the m-th True (m >= 1) of the 1-D bool ``mask`` (which has >= m): blocks of
    :data:`BLOCK` counted in order, then a cumulative sum inside the one block that holds it."""
    seen = 0
    for start in range(0, mask.numel(), BLOCK):
        block = mask[start:start + BLOCK]
        c = int(block.count_nonzero())
        if seen + c >= m:
            return start + int(torch.searchsorted(block.cumsum(0), m - seen)) + 1
        seen += c
    raise ValueError(f"mask has {seen} True entries, fewer than {m}")


#: rows of a writer's matrix squared in float64 at once (channel_energies)
SLAB = 256


def channel_energies(model, layout: Layout) -> list[torch.Tensor]:
    """Energy each of ``layout``'s embeddings and writers writes into each residual channel: the
    sum of squares of its row j (and bias entry j; an embedding's column j), in float64, in
    layout order (:func:`prune_channels` sums them over the whole model)."""
    out = []
    for path in layout.embeddings + layout.writers:
        mod = model.get_submodule(path)
        w = algebra.written_matrix(mod, None)  # in float64 a slab of rows at a time: no float64 copy of the whole
        score = torch.cat([w[i:i + SLAB].cpu().double().pow(2).sum(1) for i in range(0, len(w), SLAB)])
        c = algebra.bias(mod)
        out.append(score if c is None else score + c.cpu().double().pow(2))
    return out


def prune_channels(energies: list[torch.Tensor], k: int) -> torch.Tensor:
    """Keep vector over the residual channels without the ``k`` least-written ones, by the energy
    every writer writes into each (:func:`channel_energies` of the whole model, in its order),
    whatever the criterion of the units and heads."""
    score = torch.zeros_like(energies[0])
    for e in energies:
        score += e
    d = len(score)
    if not 0 <= k < d:
        raise SurgeryError(f"prune_channels must be in [0, {d}), got {k}")
    keep = torch.ones(d, dtype=torch.bool)
    keep[score.argsort(stable=True)[:k]] = False
    return keep


def _drop_lowest(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Indices of the round(fraction * n) lowest scores (at most n - 1: one always stays)."""
    k = min(round(fraction * len(scores)), len(scores) - 1)
    return scores.argsort(stable=True)[:k]


def _zero_inputs(masks: dict, mod: nn.Module, name: str, cols: torch.Tensor) -> None:
    """Mask the input columns ``cols`` of the linear ``mod`` (parameter ``name``.weight)."""
    keep = masks.setdefault(f"{name}.weight", torch.ones_like(mod.weight, dtype=torch.bool))
    keep.index_fill_(1 - algebra.written_axis(mod), cols.to(keep.device), False)


def _rows_norm(mod: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    w = algebra.weight(mod)
    return w[rows.to(w.device)].norm(dim=1).cpu()


def activations(model, layout: Layout, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input RMS of every MLP's down and attention's o over ``ids`` (the ``activation`` scores)."""
    return analysis.input_rms(model, [m.down for m in layout.mlps] + [a.o for a in layout.attention], ids)


def prune_units(model, layout: Layout, fraction: float,
                rms: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Parameter masks zeroing, in every MLP, the round(fraction * units) lowest-scoring units
    (``rms``, from :func:`activations`: by activation; else by magnitude)."""
    masks = {}
    for site in layout.mlps:
        down = model.get_submodule(site.down)
        cols = algebra.weight(down).pow(2).sum(0).cpu()
        if rms is not None:
            score = rms[site.down].pow(2) * cols
        else:
            score = cols.sqrt() * analysis.mlp_part(model, site, "up")[0].norm(dim=1).cpu()
            if site.gate:
                score = score * analysis.mlp_part(model, site, "gate")[0].norm(dim=1).cpu()
        _zero_inputs(masks, down, site.down, _drop_lowest(score, fraction))
    return masks


def prune_heads(model, layout: Layout, fraction: float,
                rms: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Parameter masks zeroing, in every attention, the round(fraction * KV heads) lowest-scoring
    KV groups (all their query heads); ``rms`` as for :func:`prune_units`."""
    masks = {}
    for site in layout.attention:
        o = model.get_submodule(site.o)
        wo, groups = algebra.weight(o), site.num_heads // site.num_kv_heads
        score = torch.zeros(site.num_kv_heads, dtype=algebra.WORK)
        for h in range(site.num_heads):
            cols = analysis.head_idx(h, site.head_dim)
            w = wo[:, cols.to(wo.device)].cpu()
            if rms is not None:
                score[h // groups] += (rms[site.o][cols].pow(2) * w.pow(2).sum(0)).sum()
            else:
                path, rows = analysis.qkv_rows(site, "v", [h // groups])
                score[h // groups] += w.norm() * _rows_norm(model.get_submodule(path), rows).norm()
        gone = _drop_lowest(score, fraction).tolist()
        cols = [analysis.head_idx(h, site.head_dim) for g in gone for h in range(g * groups, (g + 1) * groups)]
        if cols:
            _zero_inputs(masks, o, site.o, torch.cat(cols))
    return masks


@torch.no_grad()
def apply(model, layout: Layout, params: dict[str, torch.Tensor] | None = None,
          channels: torch.Tensor | None = None) -> dict[str, int]:
    """Multiply parameters by their masks and zero the removed channels (see the module doc).

    Returns how many parameter entries are zero afterwards among those masked, and the number
    of channels masked.
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    zeros = 0
    for name, keep in (params or {}).items():
        if name not in named:
            raise SurgeryError(f"the mask names {name!r}, which this model does not have")
        p = named[name]
        if tuple(keep.shape) != tuple(p.shape):
            raise SurgeryError(f"mask for {name} has shape {tuple(keep.shape)}, the parameter {tuple(p.shape)}")
        p.mul_((keep != 0).to(device=p.device, dtype=p.dtype))
        zeros += int((p == 0).sum())
    dropped = 0
    if channels is not None:
        d = layout.stream_width
        if channels.shape != (d,):
            raise SurgeryError(f"channel mask has shape {tuple(channels.shape)}, the stream {d} channels")
        gone = (channels == 0).nonzero().flatten()
        dropped = len(gone)
        for path in layout.embeddings + layout.writers:
            mod = model.get_submodule(path)
            rows = gone.to(mod.weight.device)
            mod.weight.index_fill_(algebra.written_axis(mod), rows, 0)
            if getattr(mod, "bias", None) is not None:
                mod.bias[rows] = 0
        for site in layout.norms:
            norm = model.get_submodule(site.path)
            if getattr(norm, "weight", None) is None:
                raise SurgeryError(f"{site.path} has no gain to zero: its dead channels would stay visible")
            norm.weight[gone.to(norm.weight.device)] = -site.offset
    return {"zero_entries": zeros, "channels": dropped}


@torch.no_grad()
def release(w: torch.Tensor, scale: float, gen: torch.Generator) -> int:
    """Give ``w``'s exact zeros inside live structure back to training, in place: every zero
    whose row and column (of the stored matrix) each hold a nonzero entry becomes a draw of
    N(0, (scale * s)^2), s the RMS of the tensor's nonzero entries (its surviving weights). A
    whole zero row or column is pruned structure and stays zero. Returns how many changed."""
    live = w != 0
    spots = ~live & live.any(1, keepdim=True) & live.any(0, keepdim=True)
    n = int(spots.sum())
    if n:
        s = w[live].double().pow(2).mean().sqrt().item()
        noise = torch.randn(n, generator=gen, dtype=torch.float64) * (scale * s)
        w[spots] = noise.to(device=w.device, dtype=w.dtype)
    return n


def save(path, params: dict[str, torch.Tensor] | None = None, channels: torch.Tensor | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.to(torch.bool).contiguous().cpu() for k, v in (params or {}).items()}
    if channels is not None:
        tensors[CHANNELS] = channels.to(torch.bool).cpu()
    save_file(tensors, str(path))


def load(path, holds=lambda name: True) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[str]]:
    """(parameter masks of the parameters ``holds`` says yes to, channel keep vector or None, every
    parameter name the file masks) from a safetensors mask file, reading only those masks."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = [k for k in f.keys() if k != CHANNELS]
            tensors = {k: f.get_tensor(k) for k in names if holds(k)}
            channels = f.get_tensor(CHANNELS) if CHANNELS in f.keys() else None
    except (OSError, ValueError, RuntimeError) as e:
        raise SurgeryError(f"cannot read the mask file {path}: {e}") from None
    return tensors, channels, names
