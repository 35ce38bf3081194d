"""prune: remove the transformer blocks that change the residual stream least.

Residual states: h_l is the input of block l (l = 0..L-1) and h_L the last block's output, which
is the final norm's input (never ``output_hidden_states[-1]``: that one is already normalised).
Per token t, cos_ij(t) = <h_i(t), h_j(t)> / (|h_i(t)| |h_j(t)|), computed in float64 token by
token (a (L+1) x (L+1) Gram matrix per token, never token x token).

- angular (Gromov et al. 2024): the block of n layers starting at l scores
  d(l, n) = mean_t arccos(cos_{l,l+n}(t)) / pi, in [0, 1]; the block with the smallest d goes.
- block-influence (ShortGPT, Men et al. 2024): layer l scores BI_l = 1 - mean_t cos_{l,l+1}(t);
  the n layers with the smallest BI go (not necessarily contiguous).
- last: the n layers just before the final one (L-1-n .. L-2), a baseline that needs no text.

Means run over every real token of every calibration window (padding masked out). Removing
blocks renumbers each remaining module's ``layer_idx`` (the KV cache is indexed by it) and
shortens ``num_hidden_layers`` and every per-layer config list, so the result is a plain
checkpoint of the same architecture.
"""

from __future__ import annotations

import inspect
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from .families import layout
from .progress import Progress, no_progress
from .errors import SurgeryError

METHODS = ("angular", "block-influence", "last")


@dataclass
class LayerScores:
    """Similarity of the residual states h_0..h_L over the calibration tokens."""

    angular: torch.Tensor  # [L+1, L+1]: mean_t arccos(cos_ij(t)) / pi, symmetric, zero diagonal
    influence: torch.Tensor  # [L]: BI_l = 1 - mean_t cos_{l,l+1}(t)
    tokens: int
    seconds: float

    @property
    def num_layers(self) -> int:
        return len(self.influence)

    def block_distance(self, n: int) -> torch.Tensor:
        """d(l, n) for l = 0..L-n: the angular distance across the block of n layers at l."""
        return torch.stack([self.angular[l, l + n] for l in range(self.num_layers - n + 1)])

    def as_dict(self) -> dict:
        return {"angular": self.angular.tolist(), "block_influence": self.influence.tolist(),
                "tokens": self.tokens, "seconds": self.seconds}


@dataclass
class Selection:
    """Which layers go, and the candidate scores behind the choice (for the table and plot)."""

    method: str
    n: int
    layers: tuple[int, ...]  # removed, ascending
    candidates: list[str]  # "3-4" (a block) or "3" (one layer)
    scores: list[float] | None  # one per candidate; None when no scores were computed
    chosen: list[int]  # indices into candidates

    def as_dict(self) -> dict:
        return {"method": self.method, "n": self.n, "layers": list(self.layers),
                "candidates": self.candidates, "scores": self.scores,
                "chosen": [self.candidates[i] for i in self.chosen]}


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


def device_of(model) -> torch.device:
    """Where the model computes: its first parameter's device, or (a streamed model, whose
    parameters wait on the meta device until their block runs) its first real buffer's, or CPU."""
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Run the base model only (no head: the scores read hidden states, and a base model or a
    classifier without a pad token works the same), without a KV cache."""
    base = model.base_model
    kw = {"use_cache": False} if "use_cache" in inspect.signature(base.forward).parameters else {}
    base(input_ids=input_ids.to(device_of(model)),
         attention_mask=None if attention_mask is None else attention_mask.to(device_of(model)), **kw)


@torch.no_grad()
def residual_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """h_0..h_L for one batch, in the model's dtype."""
    with residual_capture(model) as states:
        _forward(model, input_ids, attention_mask)
    return list(states)


def _accumulate(states: list[torch.Tensor], weight: torch.Tensor, ang: torch.Tensor, cos_adj: torch.Tensor) -> None:
    """Add sum_t w_t arccos(cos_ij(t))/pi to ``ang`` and sum_t w_t cos_{l,l+1}(t) to ``cos_adj``."""
    n_states, d = len(states), states[0].shape[-1]
    flat = [s.reshape(-1, d) for s in states]
    w = weight.reshape(-1).to(torch.float64)
    keep = w > 0
    chunk = max(1, (1 << 26) // (n_states * d))  # float64 unit vectors held per chunk: ~512 MB at most
    idx = keep.nonzero().squeeze(1)
    for start in range(0, len(idx), chunk):
        rows = idx[start:start + chunk].to(flat[0].device)
        u = torch.stack([f[rows].to(torch.float64) for f in flat], 1)  # [t, L+1, d]
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        cos = torch.einsum("tid,tjd->tij", u, u).clamp(-1.0, 1.0)  # per-token Gram matrix
        wt = w[rows.cpu()].to(cos.device)
        ang += torch.einsum("t,tij->ij", wt, torch.arccos(cos) / math.pi).cpu()
        cos_adj += torch.einsum("t,ti->i", wt, torch.diagonal(cos, 1, 1, 2)).cpu()


@torch.no_grad()
def score_layers(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 batch_size: int = 8, progress: Progress = no_progress) -> LayerScores:
    """Angular distances between all residual states and every layer's block influence.

    ``input_ids`` is [windows, tokens]; ``attention_mask`` (1 = real token) masks padding.
    """
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise SurgeryError("calibration needs a non-empty [windows, tokens] batch of token ids")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    n_layers = len(blocks_of(model))
    ang = torch.zeros(n_layers + 1, n_layers + 1, dtype=torch.float64)
    cos_adj = torch.zeros(n_layers, dtype=torch.float64)
    tokens = int(mask.sum())
    if tokens == 0:
        raise SurgeryError("the calibration batch has no unmasked tokens")
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    total = len(input_ids)
    try:
        with residual_capture(model) as states:
            for start in range(0, total, batch_size):
                ids, m = input_ids[start:start + batch_size], mask[start:start + batch_size]
                progress("score", start, total)
                _forward(model, ids, m)
                _accumulate(states, m, ang, cos_adj)
    finally:
        model.train(was_training)
    progress("score", total, total)
    ang /= tokens
    return LayerScores(ang, 1.0 - cos_adj / tokens, tokens, time.perf_counter() - t0)


def count_layers(num_layers: int, layers: int | None = None, fraction: float | None = None) -> int:
    """How many layers to remove, from ``layers`` or ``fraction`` (rounded); at least 1, at most L-1."""
    if (layers is None) == (fraction is None):
        raise SurgeryError("give exactly one of --layers N or --fraction F")
    if fraction is not None:
        if not 0.0 < fraction < 1.0:
            raise SurgeryError(f"--fraction must be between 0 and 1 (exclusive), got {fraction:g}")
        layers = round(fraction * num_layers)
        if layers == 0:
            raise SurgeryError(f"--fraction {fraction:g} of {num_layers} layers rounds to 0 layers")
    if layers < 1:
        raise SurgeryError(f"cannot remove {layers} layers: give at least 1")
    if layers >= num_layers:
        raise SurgeryError(f"cannot remove {layers} layers: the model has {num_layers} "
                           f"(at most {num_layers - 1} can go)")
    return layers


def select_layers(method: str, n: int, scores: LayerScores | None = None,
                  num_layers: int | None = None) -> Selection:
    """The layers ``method`` removes. angular and block-influence need ``scores``; last does not."""
    if method not in METHODS:
        raise SurgeryError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    L = scores.num_layers if scores is not None else num_layers
    if L is None:
        raise SurgeryError("select_layers needs scores or num_layers")
    count_layers(L, layers=n)
    if method == "block-influence":
        if scores is None:
            raise SurgeryError("block-influence needs calibration scores")
        bi = scores.influence.tolist()
        chosen = sorted(sorted(range(L), key=lambda i: (bi[i], i))[:n])
        return Selection(method, n, tuple(chosen), [str(i) for i in range(L)], bi, chosen)
    candidates = [f"{l}" if n == 1 else f"{l}-{l + n - 1}" for l in range(L - n + 1)]
    d = scores.block_distance(n).tolist() if scores is not None else None
    if method == "angular":
        if d is None:
            raise SurgeryError("angular needs calibration scores")
        start = min(range(len(d)), key=lambda l: (d[l], l))
    else:
        start = L - 1 - n
        if scores is None:
            candidates = candidates[start:start + 1]
            return Selection(method, n, tuple(range(start, start + n)), candidates, None, [0])
    return Selection(method, n, tuple(range(start, start + n)), candidates, d, [start])


def prune_model(model, layers: Iterable[int]) -> dict:
    """Remove the blocks ``layers`` in place; returns what changed (for the checkpoint's record).

    Remaining blocks keep their order; block j of the result gets ``layer_idx = j`` in every
    module that has one; ``num_hidden_layers`` and per-layer config lists (``layer_types``) shrink.
    """
    lay = layout(model)
    blocks = model.get_submodule(lay.layers_path)
    L = len(blocks)
    remove = sorted(set(int(i) for i in layers))
    if not remove:
        raise SurgeryError("no layers to remove")
    bad = [i for i in remove if not 0 <= i < L]
    if bad:
        raise SurgeryError(f"layer {bad[0]} does not exist: the model has layers 0..{L - 1}")
    keep = [i for i in range(L) if i not in remove]
    if not keep:
        raise SurgeryError(f"cannot remove all {L} layers")
    cfg = model.config
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) and any(k != j for j, k in enumerate(keep)):
        raise SurgeryError("this model scales each layer's attention by 1/(layer index + 1) "
                           "(scale_attn_by_inverse_layer_idx): renumbering its layers would change them")
    per_layer = [k for k, v in vars(cfg).items()
                 if "layer" in k and isinstance(v, (list, tuple)) and len(v) == L]
    new = nn.ModuleList([blocks[i] for i in keep])
    for j, block in enumerate(new):
        for mod in block.modules():
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = j
    model.set_submodule(lay.layers_path, new)
    cfg.num_hidden_layers = len(keep)
    for k in per_layer:
        old = getattr(cfg, k)
        setattr(cfg, k, type(old)(old[i] for i in keep))
    mwl = getattr(cfg, "max_window_layers", None)
    if isinstance(mwl, int) and mwl < L:  # Qwen2: layers at index >= this may use sliding windows
        cfg.max_window_layers = sum(1 for i in keep if i < mwl)
    return {"removed": remove, "kept": keep, "layers_before": L, "layers_after": len(keep),
            "config_lists": per_layer}
