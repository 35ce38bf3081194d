"""Self-contained runtime for rewritten checkpoints.

This file is copied verbatim beside the weights as ``modeling_normsurgery.py`` when a rewrite
cannot be expressed by the stock architecture, so it may import only torch and transformers.
A checkpoint's ``config.normsurgery["modules"]`` lists the modules that differ from the stock
architecture; :func:`apply_structure` rebuilds them before the weights are loaded.
"""

import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

#: prefix of the model type of a checkpoint that needs this runtime
RUNTIME_TYPE = "normsurgery_"


def _stats_dtype(x):
    """Half-precision statistics overflow: take them in float32; keep float32/float64 as is."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class RMSNorm(nn.Module):
    """y = (offset + w) * x / sqrt(sum(x^2) / divisor + eps) + b, in the input's dtype.

    ``divisor`` defaults to the width; a stream stored with some channels removed keeps the
    original width as divisor so the statistic is that of the full vector (whose removed entries
    are zero). ``offset`` is 1 for Gemma-style norms that scale by (1 + w).
    """

    def __init__(self, dim, eps=1e-5, bias=False, offset=0.0, divisor=None):
        super().__init__()
        self.dim, self.eps, self.offset = dim, eps, offset
        self.divisor = divisor or dim
        self.weight = nn.Parameter(torch.ones(dim) - offset)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def spec(self):
        return {"dim": self.dim, "eps": self.eps, "bias": self.bias is not None,
                "offset": self.offset, "divisor": self.divisor}

    def forward(self, x):
        s = x.to(_stats_dtype(x))
        inv = torch.rsqrt(s.pow(2).sum(-1, keepdim=True) / self.divisor + self.eps)
        y = (s * inv).to(x.dtype) * (self.weight + self.offset)
        return y if self.bias is None else y + self.bias


class CRMSNorm(nn.Module):
    """Pre-CRMSNorm (Jiang et al. 2023): y = x~ / sqrt((|x~|^2 + (sum x~)^2) / (dim + 1) + eps).

    The stream is zero-mean in dim + 1 dimensions and stored without its last coordinate
    x_d = -sum(x~); this is RMSNorm of the full vector, restricted to the stored coordinates.
    Weightless: the gains and biases live in the readers.
    """

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps

    def spec(self):
        return {"dim": self.dim, "eps": self.eps}

    def forward(self, x):
        s = x.to(_stats_dtype(x))
        ms = (s.pow(2).sum(-1, keepdim=True) + s.sum(-1, keepdim=True).pow(2)) / (self.dim + 1)
        return (s * torch.rsqrt(ms + self.eps)).to(x.dtype)


class CompensatedLayerNorm(nn.Module):
    """LayerNorm over the dim kept channels of a full_dim stream whose other entries are zero.

    With m = sum(x') / D and v = (sum((x' - m)^2) + (D - d') m^2) / D (= sum(x'^2) / D - m^2),
    the mean and biased variance of the full D-vector: y = w * (x' - m) / sqrt(v + eps) + b.
    """

    def __init__(self, dim, full_dim, eps=1e-5, bias=True):
        super().__init__()
        self.dim, self.full_dim, self.eps = dim, full_dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def spec(self):
        return {"dim": self.dim, "full_dim": self.full_dim, "eps": self.eps, "bias": self.bias is not None}

    def forward(self, x):
        s = x.to(_stats_dtype(x))
        m = s.sum(-1, keepdim=True) / self.full_dim
        c = s - m
        v = (c.pow(2).sum(-1, keepdim=True) + (self.full_dim - self.dim) * m.pow(2)) / self.full_dim
        y = (c * torch.rsqrt(v + self.eps)).to(x.dtype) * self.weight
        return y if self.bias is None else y + self.bias


class NoNorm(nn.Module):
    """A removed normalization: y = x. Its constant divisor, gain and bias live in the readers."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def spec(self):
        return {"dim": self.dim}

    def forward(self, x):
        return x


class RepBN(nn.Module):
    """Re-parameterised BatchNorm (SLAB, Guo et al. 2024): y = BN(x) + eta * x over the last axis.

    BN(x) = gamma * (x - m) / sqrt(v + eps) + beta, per channel. In training mode m, v are the
    mean and biased variance over the batch's tokens, all leading axes flattened, only those
    where ``token_mask`` (a bool tensor of the leading shape, set from outside) is true; the
    running statistics move towards them by ``momentum``. In eval mode m, v are the running
    statistics, so y = a * x + c with a = gamma / sqrt(v + eps) + eta and
    c = beta - gamma * m / sqrt(v + eps): no statistic is computed per token.
    """

    def __init__(self, dim, eps=1e-5, momentum=0.1):
        super().__init__()
        self.dim, self.eps, self.momentum = dim, eps, momentum
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eta = nn.Parameter(torch.zeros(()))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.token_mask = None

    def spec(self):
        return {"dim": self.dim, "eps": self.eps, "momentum": self.momentum}

    def affine(self):
        """(a, c) of the eval-mode map y = a * x + c."""
        inv = torch.rsqrt(self.running_var + self.eps)
        return self.weight * inv + self.eta, self.bias - self.weight * self.running_mean * inv

    def forward(self, x):
        if not self.training:
            a, c = self.affine()
            return x * a.to(x.dtype) + c.to(x.dtype)
        s = x.to(_stats_dtype(x))
        flat = s.reshape(-1, self.dim)
        if self.token_mask is not None:
            flat = flat[self.token_mask.reshape(-1).to(flat.device)]
        mean = flat.mean(0)
        var = (flat - mean).pow(2).mean(0)
        with torch.no_grad():
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
            self.running_var.lerp_(var.to(self.running_var.dtype), self.momentum)
        y = ((s - mean) * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight + self.bias
        return y + self.eta * x


class ChannelAffine(nn.Module):
    """y = weight * x + bias per channel: a frozen BatchNorm / RepBN on a Post-LN stream, where no
    linear reader can absorb it (a multiply-add per channel, no statistics)."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def spec(self):
        return {"dim": self.dim}

    def forward(self, x):
        return x * self.weight + self.bias


class NoOp(nn.Module):
    """A sublayer that computes nothing: y = 0 (DeciLM's ``no_op`` attention or MLP, whose tensors
    are not stored). ``pair``: returned as attention returns, (y, no weights)."""

    def __init__(self, pair=False):
        super().__init__()
        self.pair = pair

    def spec(self):
        return {"pair": self.pair}

    def forward(self, hidden_states, *args, **kwargs):
        y = torch.zeros_like(hidden_states)
        return (y, None) if self.pair else y


MODULES = {"RMSNorm": RMSNorm, "CRMSNorm": CRMSNorm, "CompensatedLayerNorm": CompensatedLayerNorm, "NoNorm": NoNorm,
           "RepBN": RepBN, "ChannelAffine": ChannelAffine, "NoOp": NoOp}

#: size attributes that must follow a resized parameter, by module class
SIZE_ATTRS = {
    nn.Linear: lambda w: {"out_features": w[0], "in_features": w[1]},
    Conv1D: lambda w: {"nx": w[0], "nf": w[1]},
    nn.Embedding: lambda w: {"num_embeddings": w[0], "embedding_dim": w[1]},
    nn.LayerNorm: lambda w: {"normalized_shape": (w[0],)},
}


def resize(module, params):
    """Give ``module`` parameters of new shapes (None drops one), keeping its class and code."""
    ref = next(module.parameters())
    for name, shape in params.items():
        value = None if shape is None else nn.Parameter(torch.empty(shape, device=ref.device, dtype=ref.dtype))
        setattr(module, name, value)
    for cls, attrs in SIZE_ATTRS.items():
        if isinstance(module, cls) and params.get("weight"):
            for k, v in attrs(list(params["weight"])).items():
                setattr(module, k, v)


def apply_structure(model, records):
    """Rebuild recorded modules: {path, class, kwargs} replaces one with a runtime module,
    {path, params} resizes its parameters in place, {path, length} cuts a module list to its first
    entries, {path, attrs} sets attributes."""
    for rec in records:
        if "class" in rec:
            ref = next(model.get_submodule(rec["path"]).parameters(), None)
            new = MODULES[rec["class"]](**rec["kwargs"])
            if ref is not None:
                new = new.to(device=ref.device, dtype=ref.dtype)
            new.stock_equivalent = bool(rec.get("stock_equivalent"))
            model.set_submodule(rec["path"], new)
        if "length" in rec:
            del model.get_submodule(rec["path"])[rec["length"]:]
        if "params" in rec:
            resize(model.get_submodule(rec["path"]), rec["params"])
        if rec.get("attrs"):
            module = model.get_submodule(rec["path"])
            for name, value in rec["attrs"].items():
                setattr(module, name, value)
            module._normsurgery_attrs = dict(rec["attrs"])  # so a re-save records them again
    return model


def block_records(config, mlp_width):
    """The records (:func:`apply_structure`) that turn Llama's layers into those of DeciLM's
    ``config.block_configs``: a no-op sublayer a :class:`NoOp` without its norm, a live one's key
    and value projections ``hidden / n_heads_in_group`` heads wide and its MLP
    ``mlp_width(ffn_mult)`` units wide."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    out = []
    for i, block in enumerate(config.block_configs):
        layer = f"model.layers.{i}"
        a, f = block.attention, block.ffn
        if a.no_op:
            out += [{"path": f"{layer}.self_attn", "class": "NoOp", "kwargs": {"pair": True}},
                    {"path": f"{layer}.input_layernorm", "class": "NoNorm", "kwargs": {"dim": hidden}}]
        else:
            kv = heads // a.n_heads_in_group
            bias = [kv * head_dim] if config.attention_bias else None
            out += [{"path": f"{layer}.self_attn.{p}", "params": {"weight": [kv * head_dim, hidden], "bias": bias}}
                    for p in ("k_proj", "v_proj")]
            out.append({"path": f"{layer}.self_attn", "attrs": {"num_key_value_groups": a.n_heads_in_group}})
        if f.no_op:
            out += [{"path": f"{layer}.mlp", "class": "NoOp", "kwargs": {}},
                    {"path": f"{layer}.post_attention_layernorm", "class": "NoNorm", "kwargs": {"dim": hidden}}]
            continue
        width, bias = mlp_width(f.ffn_mult), config.mlp_bias
        out += [{"path": f"{layer}.mlp.{p}", "params": {"weight": [width, hidden], "bias": [width] if bias else None}}
                for p in ("gate_proj", "up_proj")]
        out.append({"path": f"{layer}.mlp.down_proj", "params": {"weight": [hidden, width],
                                                                 "bias": [hidden] if bias else None}})
    return out


def surgery_class(base):
    """A subclass of a stock model class that rebuilds the recorded modules after __init__; its
    config class is the family's :func:`surgery_config`."""

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        apply_structure(self, (getattr(config, "normsurgery", None) or {}).get("modules", []))

    config_class = surgery_config(base.config_class)
    cls = type("NormSurgery" + base.__name__, (base,), {"__init__": __init__, "config_class": config_class})
    _inherit_weight_renames(base.__name__, cls.__name__)
    return cls


def _inherit_weight_renames(base_name, name):
    """transformers renames some on-disk keys by class name (GPT-NeoX's embed_out -> lm_head):
    give the subclass the same renames."""
    try:
        from transformers import conversion_mapping as cm
    except ImportError:  # transformers before 5 renames nothing by class name
        return
    mapping = cm.get_checkpoint_conversion_mapping(base_name)
    if mapping:
        cm.register_checkpoint_conversion_mapping(name, mapping, overwrite=True)


def surgery_config(base):
    """The stock config class ``base`` under the model type ``normsurgery_<family>``, which stock
    transformers does not know: a checkpoint that needs this runtime names it, so loading it
    without ``trust_remote_code=True`` fails instead of building the stock modules.

    Its ``__name__`` is the stock one (``auto_map`` and pickle find it as ``NormSurgery<Config>``,
    its ``__qualname__``). The model class's ``config_class`` is this class, and
    ``AutoModel*.register`` (transformers 5.17 calls it on every remote-code load, 5.24 only for
    a family it does not know) refuses a model whose ``config_class.__name__`` is not that of the
    config being loaded: the stock class, for a checkpoint whose modules all compute the stock
    function."""
    name = "NormSurgery" + base.__name__
    if name not in globals():
        cls = type(name, (base,), {"model_type": RUNTIME_TYPE + base.model_type, "__qualname__": name})
        cls.__name__ = base.__name__
        globals()[name] = cls
    return globals()[name]


def stock_model_type(model_type):
    """The stock family of a ``normsurgery_<family>`` model type (None for any other)."""
    if isinstance(model_type, str) and model_type.startswith(RUNTIME_TYPE):
        return model_type[len(RUNTIME_TYPE):]
    return None


def __getattr__(name):
    """``NormSurgery<StockClass>`` (a model or config class), made on first use (``auto_map``
    names these)."""
    base = name.removeprefix("NormSurgery")
    if base == name or not hasattr(transformers, base):
        raise AttributeError(name)
    stock = getattr(transformers, base)
    if issubclass(stock, transformers.PretrainedConfig):
        return surgery_config(stock)
    cls = globals()[name] = surgery_class(stock)
    return cls

__all__ = ["RMSNorm", "CRMSNorm", "CompensatedLayerNorm", "NoNorm", "RepBN", "ChannelAffine", "NoOp", "apply_structure",
           "block_records", "resize", "surgery_class"]
