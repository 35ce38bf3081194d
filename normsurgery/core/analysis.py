"""Read-only analysis of a model: its dead units, and its residual states on given tokens.

Dead units of a masked (zero-filled) model, used by ``inspect`` and by the minimization passes
(which remove what they find):
- MLP hidden unit i: down's column i is zero (nothing leaves it); or, ungated, up's row i is zero,
  so the unit outputs the constant act(c_i), foldable into down's bias; or, gated, gate's row
  and bias are zero (act(0) = 0) or up's row and bias are zero.
- Query head h: its columns of the output projection are zero; or its value head's rows are
  zero, so it outputs the constant value bias c_v (softmax weights sum to 1), foldable into the
  output bias. A key/value head goes only with all the query heads that share it; the remaining
  groups then lose the same number of dead query heads each, so every kv head keeps G' query
  heads and grouped attention (query h reads kv h // G') still applies.
- Residual channel j that no writer writes (embedding columns, writer rows and biases zero):
  the stream is 0 there. An RMSNorm's output in j is then its bias b_j (0 without one); a
  LayerNorm's is g_j * (0 - mean) / std + b_j, so j is removable only where g_j = 0 (the
  constant b_j then folds into the readers' biases) or every reader's column j is zero.
  A base model outputs its final norm's every channel: none is removable there.

Outliers (``inspect --outliers``): for each residual state h_0..h_L on calibration text and each
linear's weight rows, the largest entry over the row's RMS, max_j |x_j| / sqrt(mean_j x_j^2)
(at most sqrt(n); about sqrt(2 ln n) for a Gaussian row), and its kurtosis m4 / m2^2 (moments
about 0; 3 for a Gaussian), each averaged over rows (tokens, or output channels).
"""

from __future__ import annotations

import functools

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import algebra, devices
from .families import layout
from .layout import AttentionSite, Layout, MlpSite

#: norm kinds whose output in an unwritten channel depends on the other channels
CENTRING = ("layernorm", "compensated-layernorm")


@contextmanager
def evaluating(model):
    """While active, every module in eval mode (dropout off: a model left in training mode, as a
    model built from a config is, computes its function, not a random draw of it); each module's
    mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


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


def zero(t: torch.Tensor, dim: int) -> torch.Tensor:
    return (t == 0).all(dim)


def bias_or_zeros(mod, n: int) -> torch.Tensor:
    c = algebra.bias(mod)
    return c if c is not None else torch.zeros(n, dtype=algebra.WORK, device=mod.weight.device)



def mlp_part(model, site: MlpSite, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, c) of the MLP's ``part`` ("up" or "gate"), c zeros where there is no bias; a stacked
    gate and up: the first (gate) or second (up) half of the rows."""
    mod = model.get_submodule(getattr(site, part))
    w = algebra.weight(mod)
    c = bias_or_zeros(mod, w.shape[0])
    if site.stacked:
        half = slice(0, w.shape[0] // 2) if part == "gate" else slice(w.shape[0] // 2, None)
        w, c = w[half], c[half]
    return w, c


def mlp_dead(model, site: MlpSite) -> tuple[torch.Tensor, torch.Tensor]:
    """(removable units, the constant each one still outputs: nonzero only where folded)."""
    down, act = model.get_submodule(site.down), model.get_submodule(site.act)
    wd = algebra.weight(down)
    wu, cu = mlp_part(model, site, "up")
    dead = zero(wd, 0)
    const = torch.zeros_like(cu)
    if site.gate is None:
        value = act(cu)
        silent = zero(wu, 1) & ((value == 0) | algebra.has_bias(down))
        const = torch.where(silent & ~dead, value, const)
        dead = dead | silent
    else:
        wg, cg = mlp_part(model, site, "gate")
        at_zero = act(torch.zeros(1, dtype=algebra.WORK, device=wg.device)).item()
        dead = dead | (zero(wg, 1) & (cg == 0) & (at_zero == 0)) | (zero(wu, 1) & (cu == 0))
    return dead, const


def head_idx(h: int, hd: int) -> torch.Tensor:
    return torch.arange(h * hd, (h + 1) * hd)


def qkv_rows(site: AttentionSite, part: str, heads) -> tuple[str, torch.Tensor]:
    """The module and its output rows that hold ``part`` (q, k or v) of ``heads``."""
    hd = site.head_dim
    if site.qkv_order == "separate":
        idx = [head_idx(h, hd) for h in heads]
        return getattr(site, part), torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    p = "qkv".index(part)
    if site.qkv_order == "blocks":
        start = (0, site.num_heads, site.num_heads + site.num_kv_heads)[p] * hd
        idx = [start + head_idx(h, hd) for h in heads]
    elif site.qkv_order == "groups":  # per kv head: its G query heads, its k, its v
        g = site.num_heads // site.num_kv_heads
        idx = [((h // g) * (g + 2) + h % g if p == 0 else h * (g + 2) + g + p - 1) * hd + torch.arange(hd)
               for h in heads]
    else:  # "heads": q, k, v of each head together
        idx = [h * 3 * hd + p * hd + torch.arange(hd) for h in heads]
    return site.qkv, torch.cat(idx)


def heads_dead(model, site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor]:
    """(dead query heads, each dead head's constant contribution to the output, [heads, d])."""
    hd, groups = site.head_dim, site.num_heads // site.num_kv_heads
    o = model.get_submodule(site.o)
    wo = algebra.weight(o)
    dead = torch.zeros(site.num_heads, dtype=torch.bool)
    const = torch.zeros(site.num_heads, wo.shape[0], dtype=algebra.WORK, device=wo.device)
    for h in range(site.num_heads):
        cols = head_idx(h, hd).to(wo.device)
        if bool(zero(wo[:, cols], 0).all()):
            dead[h] = True
            continue
        path, rows = qkv_rows(site, "v", [h // groups])
        v = model.get_submodule(path)
        wv = algebra.weight(v)
        rows = rows.to(wv.device)
        if bool(zero(wv[rows], 1).all()):
            contribution = wo[:, cols] @ bias_or_zeros(v, wv.shape[0])[rows]
            if algebra.has_bias(o) or not bool(contribution.any()):
                dead[h], const[h] = True, contribution
    return dead, const


def head_plan(dead: torch.Tensor, kv_heads: int, least: tuple[int, int] = (1, 1)) -> tuple[list[int], list[int]]:
    """(kept query heads, kept kv heads): whole groups go when all their query heads are dead;
    the other groups each drop the same number m of dead query heads (at least one head stays).
    ``least``: keep at least that many kv heads (the first dead groups stay) and query heads per
    kv head (blocks that must agree on their counts)."""
    groups = len(dead) // kv_heads
    dead_in = [[h for h in range(g * groups, (g + 1) * groups) if dead[h]] for g in range(kv_heads)]
    live = [g for g in range(kv_heads) if len(dead_in[g]) < groups]
    kept_kv = sorted(live + [g for g in range(kv_heads) if g not in live][:max(least[0] - len(live), 0)])
    m = min(min(len(dead_in[g]) for g in kept_kv), groups - max(least[1], 1))
    drop = {h for g in kept_kv for h in dead_in[g][:m]}
    kept = [h for g in kept_kv for h in range(g * groups, (g + 1) * groups) if h not in drop]
    return kept, kept_kv


def head_plans(model, layout: Layout, least: tuple[int, int] | None = None) -> list[tuple[list[int], list[int]]]:
    """:func:`head_plan` of every block of ``layout``; where the blocks share their head counts
    (``shared_head_counts``) each keeps the most any block must keep: ``least`` (from
    :func:`least_heads` over the whole model's plans), else found over ``layout``'s blocks."""
    plans = [head_plan(heads_dead(model, a)[0], a.num_kv_heads) for a in layout.attention]
    if not layout.shared_head_counts or not plans:
        return plans
    least = least or least_heads(plans)
    return [head_plan(heads_dead(model, a)[0], a.num_kv_heads, least) for a in layout.attention]


def least_heads(plans: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(kv heads, query heads per kv head) the blocks sharing their head counts must each keep:
    the most any of ``plans`` keeps."""
    return max(len(kv) for _, kv in plans), max(len(q) // len(kv) for q, kv in plans)


def written(model, paths) -> torch.Tensor:
    written = None
    for path in paths:
        mod = model.get_submodule(path)
        w = algebra.written_matrix(mod)
        col = (w != 0).any(1) | (bias_or_zeros(mod, w.shape[0]) != 0)
        written = col.cpu() if written is None else written | col.cpu()
    return written


def stream_evidence(model, layout: Layout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the embeddings, writers and norms ``layout`` holds (the whole model's, or one part's)
    say of each stream channel: (written by one of them, hidden by each centring norm: its gain is
    0 or no reader reads it); None: none of them there. :func:`channels` combines the parts'."""
    hidden = None
    for site in layout.norms:
        if site.kind not in CENTRING:
            continue
        norm = model.get_submodule(site.path)  # RMSNorm: 0 in, its bias (a constant) out
        unread = torch.ones(layout.stream_width, dtype=torch.bool)
        for r in site.readers:
            unread &= zero(algebra.weight(model.get_submodule(r)), 0).cpu()
        h = unread if norm.weight is None else unread | (norm.weight == 0).cpu()
        hidden = h if hidden is None else hidden & h
    paths = layout.embeddings + layout.writers
    return (written(model, paths) if paths else None), hidden


def channels(model, layout: Layout, evidence: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dead channels, removable channels) over the stored stream: from the whole model, or from
    ``evidence`` (:func:`stream_evidence` of every part; ``layout``: the whole model's)."""
    evidence = evidence if evidence is not None else [stream_evidence(model, layout)]
    dead = ~functools.reduce(torch.logical_or, [w for w, _ in evidence if w is not None])
    if layout.output_norm is not None:  # a base model outputs every channel of its final norm
        return dead, torch.zeros_like(dead)
    removable = dead.clone()
    for _, hidden in evidence:
        if hidden is not None:
            removable &= hidden
    return dead, removable


def dead_units(model, layout: Layout) -> DeadReport:
    """Dead MLP units, attention heads and residual channels, per layer (nothing is changed)."""
    dead_ch, removable = channels(model, layout)
    report = DeadReport(len(dead_ch), dead_channels=dead_ch.nonzero().flatten().tolist(),
                        removable_channels=removable.nonzero().flatten().tolist())
    for i, (attn, mlp, (kept, kept_kv)) in enumerate(zip(layout.attention, layout.mlps, head_plans(model, layout))):
        units, _ = mlp_dead(model, mlp)
        heads, _ = heads_dead(model, attn)
        report.layers.append(LayerDead(
            i, len(units), units.nonzero().flatten().tolist(), attn.num_heads, attn.num_kv_heads,
            heads.nonzero().flatten().tolist(), [h for h in range(attn.num_heads) if h not in kept],
            [g for g in range(attn.num_kv_heads) if g not in kept_kv],
            (~written(model, (attn.o, mlp.down))).nonzero().flatten().tolist()))
    return report


# ---------------------------------------------------------------------------------------------
# residual states: h_l is the input of block l (l = 0..L-1) and h_L the last block's output, the
# final norm's input (never ``output_hidden_states[-1]``: that one is already normalised)


def blocks_of(model) -> nn.ModuleList:
    return model.get_submodule(layout(model).layers_path)


@contextmanager
def residual_capture(model):
    """Yields a list that every forward pass fills with the L+1 residual states h_0..h_L."""
    blocks = blocks_of(model)
    states: list[torch.Tensor | None] = [None] * (len(blocks) + 1)

    def pre(i):
        def hook(module, args, kwargs):
            states[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def post(module, args, output):
        states[-1] = output[0] if isinstance(output, tuple) else output

    handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles.append(blocks[-1].register_forward_hook(post))
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


def forward_base(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Run the base model only (no head: the scores read hidden states, and a base model or a
    classifier without a pad token works the same), without a KV cache, in eval mode
    (:func:`evaluating`)."""
    base = model.base_model
    kw = {"use_cache": False} if "use_cache" in inspect.signature(base.forward).parameters else {}
    device = devices.of(model)
    with evaluating(model):
        base(input_ids=input_ids.to(device),
             attention_mask=None if attention_mask is None else attention_mask.to(device), **kw)


@torch.no_grad()
def residual_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """h_0..h_L for one batch, in the model's dtype."""
    with residual_capture(model) as states:
        forward_base(model, input_ids, attention_mask)
    return list(states)


@torch.no_grad()
def input_rms(model, paths, ids: torch.Tensor, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Per module in ``paths``, the RMS over the tokens of ``ids`` [n, T] of each input
    coordinate of it (float64, on the CPU): a_j = sqrt(mean_t x_t[j]^2)."""
    sums = {p: None for p in paths}

    def hook(path):
        def add(module, args):
            x = args[0].detach().to(algebra.WORK).reshape(-1, args[0].shape[-1]).pow(2).sum(0).cpu()
            sums[path] = x if sums[path] is None else sums[path] + x
        return add

    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p)) for p in paths]
    try:
        for s in range(0, len(ids), batch_size):
            forward_base(model, ids[s:s + batch_size], None)
    finally:
        for h in handles:
            h.remove()
    return {p: (v / ids.numel()).sqrt() for p, v in sums.items()}


# ---------------------------------------------------------------------------------------------
# outliers (see the module docstring)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as float64 rows over its last axis, all-zero rows (a masked unit) left out."""
    x = x.detach().to(algebra.WORK).reshape(-1, x.shape[-1])
    return x[(x != 0).any(-1)]


def peak_ratio(x: torch.Tensor) -> float:
    """max_j |x_j| / sqrt(mean_j x_j^2) of each row of ``x`` (last axis), averaged over rows."""
    x = _rows(x)
    return float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean())


def kurtosis(x: torch.Tensor) -> float:
    """m4 / m2^2 of each row of ``x`` (moments about 0), averaged over rows."""
    x = _rows(x)
    return float((x.pow(4).mean(-1) / x.pow(2).mean(-1).pow(2)).mean())


@torch.no_grad()
def outliers(model, input_ids: torch.Tensor) -> dict:
    """Peak ratio and kurtosis of every residual state on ``input_ids`` ("stream": h_0..h_L) and of
    the weight rows (output channels) of every linear in the blocks ("weights", by path)."""
    lay = layout(model)
    stream = [{"state": i, "max_over_rms": peak_ratio(h), "kurtosis": kurtosis(h)}
              for i, h in enumerate(residual_states(model, input_ids))]
    blocks = model.get_submodule(lay.layers_path)
    weights = [{"linear": f"{lay.layers_path}.{name}", "max_over_rms": peak_ratio(algebra.weight(mod)),
                "kurtosis": kurtosis(algebra.weight(mod))}
               for name, mod in blocks.named_modules() if algebra.is_linear(mod)]
    return {"stream": stream, "weights": weights}
