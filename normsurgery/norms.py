"""What a norm module computes: its kind, gain offset and eps, read from a table of known classes.

A module's class decides its kind (one of ``layout.NORM_KINDS``) and its gain offset (the gain
is offset + weight: Gemma's RMSNorm scales by 1 + w). A class not in the table is kind
"other" with an unknown offset, so no pass folds it. Exact type matches only: a subclass may
compute something else.
"""

from __future__ import annotations

import importlib
from typing import Callable

from torch import nn

from .errors import SurgeryError
from .runtime import CompensatedLayerNorm, CRMSNorm, RMSNorm

#: transformers' RMSNorm classes (module, class) with their gain offset
_HF_RMSNORMS = {
    ("llama", "LlamaRMSNorm"): 0.0,
    ("mistral", "MistralRMSNorm"): 0.0,
    ("qwen2", "Qwen2RMSNorm"): 0.0,
    ("qwen3", "Qwen3RMSNorm"): 0.0,
    ("gemma", "GemmaRMSNorm"): 1.0,
}
_TABLE: dict[type, tuple[str, Callable[[nn.Module], float]]] = {}


def _table() -> dict[type, tuple[str, Callable[[nn.Module], float]]]:
    if not _TABLE:
        _TABLE.update({
            nn.LayerNorm: ("layernorm", lambda m: 0.0),
            RMSNorm: ("rmsnorm", lambda m: m.offset),
            CRMSNorm: ("crmsnorm", lambda m: 0.0),
            CompensatedLayerNorm: ("compensated-layernorm", lambda m: 0.0),
        })
        for (family, name), offset in _HF_RMSNORMS.items():
            mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            _TABLE[getattr(mod, name)] = ("rmsnorm", lambda m, o=offset: o)
    return _TABLE


def kind_of(mod: nn.Module) -> tuple[str, float | None]:
    """(kind, gain offset) of a norm module; ("other", None) for a class not in the table."""
    entry = _table().get(type(mod))
    return (entry[0], entry[1](mod)) if entry else ("other", None)


def eps_of(mod: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):
        if hasattr(mod, name):
            return float(getattr(mod, name))
    return None


def is_stock_rmsnorm(mod: nn.Module) -> bool:
    """A transformers RMSNorm class (which computes in float32 whatever its input dtype)."""
    return kind_of(mod)[0] == "rmsnorm" and not isinstance(mod, RMSNorm)


def rmsnorm_like(mod: nn.Module, *, bias: bool | None = None, stock_equivalent: bool = False) -> RMSNorm:
    """A runtime RMSNorm with ``mod``'s width, eps, offset, device and dtype (weights copied
    where ``mod`` has them)."""
    kind, offset = kind_of(mod)
    eps = eps_of(mod)
    if eps is None or offset is None:
        raise SurgeryError(f"cannot read the eps and gain offset of {type(mod).__name__}")
    has_bias = getattr(mod, "bias", None) is not None if bias is None else bias
    new = RMSNorm(mod.weight.shape[0], eps=eps, bias=has_bias, offset=offset if kind == "rmsnorm" else 0.0)
    new.stock_equivalent = stock_equivalent
    new.to(device=mod.weight.device, dtype=mod.weight.dtype)
    new.load_state_dict(mod.state_dict(), strict=False)
    return new


def faithful_norms(model) -> Callable[[], None]:
    """Swap transformers' RMSNorms for runtime.RMSNorm, which keeps the input dtype (in place),
    so a float64 run is float64 throughout.

    Returns a function that puts the stock modules back, with whatever weights the faithful
    ones hold by then (so a model can be rewritten in float64, then saved as stock).
    """
    swapped = []
    for name, mod in list(model.named_modules()):
        if is_stock_rmsnorm(mod):
            new = rmsnorm_like(mod)
            model.set_submodule(name, new)
            swapped.append((name, mod, new))

    def restore() -> None:
        for name, stock, new in swapped:
            if model.get_submodule(name) is new:
                stock.weight.data = new.weight.data.to(stock.weight.dtype)
                model.set_submodule(name, stock)

    return restore
