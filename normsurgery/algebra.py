"""Weight algebra shared by the passes, done in float64 and written back once per call.

Every linear is seen as y = W x + c with W of shape [out, in], whatever its storage
(nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out]).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

WORK = torch.float64
#: relative-error tolerance of arithmetic in a dtype on weights it holds exactly (exact rewrites
#: are checked against it: 1e-10 in float64 checks the algebra, 1e-5 in float32 its rounding)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def weight(mod: nn.Module) -> torch.Tensor:
    """W as [out, in] in float64 (embeddings: [rows, d], each row a vector the stream gets)."""
    w = mod.weight.detach()
    return (w.T if isinstance(mod, Conv1D) else w).to(WORK)


def out_width(mod: nn.Module) -> int:
    """Entries of each vector the module writes (an embedding: its row width)."""
    w = mod.weight
    return w.shape[1] if isinstance(mod, (Conv1D, nn.Embedding)) else w.shape[0]


def in_width(mod: nn.Module) -> int:
    return mod.weight.shape[0] if isinstance(mod, Conv1D) else mod.weight.shape[1]


def set_weight(mod: nn.Module, w: torch.Tensor) -> None:
    w = w.T if isinstance(mod, Conv1D) else w
    with torch.no_grad():
        if mod.weight.shape == w.shape:
            mod.weight.copy_(w.to(mod.weight.dtype))
        else:
            mod.weight = nn.Parameter(w.to(mod.weight.dtype).contiguous(), requires_grad=mod.weight.requires_grad)


def bias(mod: nn.Module) -> torch.Tensor | None:
    b = getattr(mod, "bias", None)
    return None if b is None else b.detach().to(WORK)


def set_bias(mod: nn.Module, b: torch.Tensor) -> None:
    """Write c, creating the parameter for an nn.Linear that had none."""
    with torch.no_grad():
        if getattr(mod, "bias", None) is None:
            mod.bias = nn.Parameter(b.to(mod.weight.dtype))
        elif mod.bias.shape == b.shape:
            mod.bias.copy_(b.to(mod.bias.dtype))
        else:
            mod.bias = nn.Parameter(b.to(mod.bias.dtype))


def has_bias(mod: nn.Module) -> bool:
    return getattr(mod, "bias", None) is not None


def centre_outputs(mod: nn.Module) -> None:
    """Make every vector the module writes zero-mean: W <- W - mean_out(W), c <- c - mean(c).

    For an embedding the rows are the written vectors: each row loses its mean.
    """
    w = weight(mod)
    if isinstance(mod, nn.Embedding):
        set_weight(mod, w - w.mean(dim=1, keepdim=True))
        return
    set_weight(mod, w - w.mean(dim=0, keepdim=True))
    c = bias(mod)
    if c is not None:
        set_bias(mod, c - c.mean())


def fold_affine_into_reader(reader: nn.Module, gain: torch.Tensor, shift: torch.Tensor | None) -> None:
    """Reader of z = gain * n + shift becomes a reader of n: W <- W diag(gain), c <- c + W shift."""
    w = weight(reader)
    if shift is not None:
        c = bias(reader)
        set_bias(reader, (c if c is not None else 0) + w @ shift.to(WORK))
    set_weight(reader, w * gain.to(WORK))


def untie(model) -> bool:
    """Give the LM head its own copy of the tied embedding; True when it was tied."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text = model.config.get_text_config()
    if text is not model.config:
        text.tie_word_embeddings = False
    return True
