"""Norm modules made from others: a runtime RMSNorm like a stock norm, and a model whose
transformers RMSNorms and bias-free LayerNorms (Cohere's) are swapped for ones that keep the
input dtype (float64 checks).

What a norm computes (kind, gain offset, eps) is read from the family table
(``families.norm_kind``, ``families.norm_eps``).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .errors import SurgeryError
from .families import norm_eps, norm_kind
from .runtime import RMSNorm


def is_stock_rmsnorm(mod: nn.Module) -> bool:
    """A transformers RMSNorm class (which computes in float32 whatever its input dtype)."""
    return norm_kind(mod)[0] == "rmsnorm" and not isinstance(mod, RMSNorm)


def is_stock_layernorm(mod: nn.Module) -> bool:
    """A transformers bias-free LayerNorm class over one axis (computes in float32 whatever its
    input dtype); a per-head one (2-D weight, Cohere's QK norms) has no torch equivalent."""
    return norm_kind(mod)[0] == "layernorm" and type(mod) is not nn.LayerNorm and mod.weight.dim() == 1


def layernorm_like(mod: nn.Module) -> nn.LayerNorm:
    """A torch LayerNorm without bias with ``mod``'s width, eps, weights, device and dtype."""
    new = nn.LayerNorm(mod.weight.shape[0], eps=norm_eps(mod), bias=False, device=mod.weight.device,
                       dtype=mod.weight.dtype)
    new.weight.data.copy_(mod.weight.data)
    return new


def rmsnorm_like(mod: nn.Module, *, bias: bool | None = None, stock_equivalent: bool = False) -> RMSNorm:
    """A runtime RMSNorm with ``mod``'s width, eps, offset, device and dtype (weights copied
    where ``mod`` has them)."""
    kind, offset = norm_kind(mod)
    eps = norm_eps(mod)
    if eps is None or offset is None:
        raise SurgeryError(f"cannot read the eps and gain offset of {type(mod).__name__}")
    has_bias = getattr(mod, "bias", None) is not None if bias is None else bias
    new = RMSNorm(mod.weight.shape[0], eps=eps, bias=has_bias, offset=offset if kind == "rmsnorm" else 0.0)
    new.stock_equivalent = stock_equivalent
    new.to(device=mod.weight.device, dtype=mod.weight.dtype)
    new.load_state_dict(mod.state_dict(), strict=False)
    return new


def faithful_norms(model) -> Callable[[], None]:
    """Swap transformers' RMSNorms for runtime.RMSNorm and their bias-free LayerNorms for torch's,
    which keep the input dtype (in place), so a float64 run is float64 throughout.

    Returns a function that puts the stock modules back, with whatever weights the faithful
    ones hold by then (so a model can be rewritten in float64, then saved as stock), wherever
    they are then (pruning renumbers the blocks).
    """
    swapped = {}  # id(faithful module) -> the stock module it replaced
    for name, mod in list(model.named_modules()):
        new = rmsnorm_like(mod) if is_stock_rmsnorm(mod) else layernorm_like(mod) if is_stock_layernorm(mod) else None
        if new is not None:
            model.set_submodule(name, new)
            swapped[id(new)] = (mod, new)

    def restore() -> None:
        for name, mod in list(model.named_modules()):
            stock, new = swapped.get(id(mod), (None, None))
            if new is mod:
                stock.weight.data = new.weight.data.to(stock.weight.dtype)
                model.set_submodule(name, stock)

    return restore
