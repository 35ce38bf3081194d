"""Slicing linears, embeddings and norms to fewer rows or columns, keeping their classes.

Every module is seen as y = W x + c with W [out, in] (algebra's convention); an embedding's
"outputs" are its columns (the stream coordinates it writes). Size attributes that the module's
forward reads (Conv1D's ``nf``, Linear's ``in_features``, ...) follow the new shapes, the same
attributes the runtime sets when it rebuilds a saved checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import algebra
from ..runtime import SIZE_ATTRS


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
    w = algebra.weight(mod)
    if isinstance(mod, nn.Embedding):
        set_matrix(mod, w[:, idx])
        return
    c = algebra.bias(mod)
    set_matrix(mod, w[idx], None if c is None else c[idx])


def keep_inputs(mod: nn.Module, idx: torch.Tensor) -> None:
    """Keep the inputs ``idx``: columns of W."""
    set_matrix(mod, algebra.weight(mod)[:, idx])


def add_to_bias(mod: nn.Module, delta: torch.Tensor) -> None:
    """c <- c + delta, creating c (zeros) on a linear that had none."""
    c = algebra.bias(mod)
    algebra.set_bias(mod, (c if c is not None else torch.zeros_like(delta)) + delta)


def replace(model, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def size(params) -> tuple[int, int]:
    """(parameter count, bytes) of distinct parameters (a tied weight counts once)."""
    seen = {id(p): p for p in params}.values()
    return sum(p.numel() for p in seen), sum(p.numel() * p.element_size() for p in seen)


def sizes(model, layers: str) -> dict:
    """Parameters and bytes per block and for everything outside the blocks."""
    blocks = model.get_submodule(layers)
    inside = {id(p) for p in blocks.parameters()}
    per_layer = [size(b.parameters()) for b in blocks]
    other = size(p for p in model.parameters() if id(p) not in inside)
    total = size(model.parameters())
    return {"layers": [{"params": n, "bytes": b} for n, b in per_layer],
            "other": {"params": other[0], "bytes": other[1]},
            "total": {"params": total[0], "bytes": total[1]}}
