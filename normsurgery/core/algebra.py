"""Weight algebra shared by the passes, in the precision each result needs: sums (means, W b)
accumulate in float64 or are corrected to its accuracy; a whole matrix shifted by a mean or
scaled by a gain is changed in place in its stored dtype (no float64 copy of it), each entry
rounded once more than an exact result would be.

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


def weight(mod: nn.Module, dtype: torch.dtype | None = WORK) -> torch.Tensor:
    """W as [out, in] in float64 (embeddings: [rows, d], each row a vector the stream gets);
    ``dtype`` None: the tensor held, no copy (selecting entries is exact in any dtype)."""
    w = mod.weight.detach()
    w = w.T if isinstance(mod, Conv1D) else w
    return w if dtype is None else w.to(dtype)


def is_linear(mod: nn.Module) -> bool:
    """nn.Linear or GPT-2's Conv1D: y = W x + c."""
    return isinstance(mod, (nn.Linear, Conv1D))


def written_matrix(mod: nn.Module, dtype: torch.dtype | None = WORK) -> torch.Tensor:
    """The weight in float64 (``dtype``: :func:`weight`'s) with one row per entry of the vectors
    the module writes: a linear's W [out, in]; an embedding's table transposed, [d, rows]."""
    w = weight(mod, dtype)
    return w.T if isinstance(mod, nn.Embedding) else w


def written_axis(mod: nn.Module) -> int:
    """The axis of the stored weight that runs over a written vector's entries (an embedding's
    rows and Conv1D's [in, out] run over dim 1)."""
    return 1 if isinstance(mod, (Conv1D, nn.Embedding)) else 0


def out_width(mod: nn.Module) -> int:
    """Entries of each vector the module writes (an embedding: its row width)."""
    return mod.weight.shape[written_axis(mod)]


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


def mean(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of ``w`` along ``dim`` (kept), to the precision of ``w``'s dtype without a float64
    copy of ``w``: float64 as is; float32 summed in float32 (torch sums in cascades), then
    corrected by the mean of the residuals, so the error is far below float32's rounding of the
    result; half precision through float32."""
    if w.dtype == torch.float64:
        return w.mean(dim, keepdim=True)
    x = w if w.dtype == torch.float32 else w.float()
    m = x.mean(dim, keepdim=True)
    return m + (x - m).mean(dim, keepdim=True)


def centre_outputs(mod: nn.Module) -> None:
    """Make every vector the module writes zero-mean: W <- W - mean_out(W), c <- c - mean(c).

    For an embedding the rows are the written vectors: each row loses its mean. Done in place
    in the stored layout and dtype.
    """
    w = mod.weight
    with torch.no_grad():
        w.sub_(mean(w, written_axis(mod)).to(w.dtype))
        c = getattr(mod, "bias", None)
        if c is not None and not isinstance(mod, nn.Embedding):
            c.sub_(mean(c, 0).to(c.dtype))


def fold_affine_into_reader(reader: nn.Module, gain: torch.Tensor, shift: torch.Tensor | None) -> None:
    """Reader of z = gain * n + shift becomes a reader of n: W <- W diag(gain), c <- c + W shift.

    W shift is summed in float64; W diag(gain) is scaled in place in the stored dtype."""
    w = reader.weight
    if shift is not None:
        ws = (shift.to(WORK) @ w.to(WORK)) if isinstance(reader, Conv1D) else (w.to(WORK) @ shift.to(WORK))
        c = bias(reader)
        set_bias(reader, (c if c is not None else 0) + ws)
    if isinstance(reader, Conv1D):
        with torch.no_grad():
            w.mul_(gain.to(w.dtype)[:, None])
    else:
        scale_inputs(w, gain)


def scale_inputs(w: torch.Tensor, gain: torch.Tensor) -> None:
    """W <- W diag(gain) in place, W [..., out, in] (a linear's weight, or stacked experts')."""
    with torch.no_grad():
        w.mul_(gain.to(w.dtype))


def untie(model, layout) -> bool:
    """Give the head its own copy of the embedding it is tied to (``layout.tied``); True when it was."""
    if not layout.tied:
        return False
    head = model.get_submodule(layout.head)
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    model.config.tie_word_embeddings = False
    text = model.config.get_text_config()
    if text is not model.config:
        text.tie_word_embeddings = False
    return True


def rotate_outputs(mod: nn.Module, q: torch.Tensor) -> None:
    """Every vector the module writes v becomes Q v: a linear's W <- Q W and c <- Q c; an
    embedding's rows e <- Q e (table E <- E Qᵀ). Computed in float64, stored in the module's dtype."""
    m = written_matrix(mod)
    q = q.to(m.device, WORK)
    w = q @ m
    set_weight(mod, w.T if isinstance(mod, nn.Embedding) else w)
    c = bias(mod)
    if c is not None and not isinstance(mod, nn.Embedding):
        set_bias(mod, q @ c)


def rotate_inputs(mod: nn.Module, q: torch.Tensor) -> None:
    """A reader of z becomes the same function of Q z: W <- W Qᵀ (bias unchanged)."""
    w = weight(mod)
    set_weight(mod, w @ q.to(w.device, WORK).T)
