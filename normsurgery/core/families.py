"""The one family table: for each supported ``model_type`` its adapter, every stock class it
loads and saves (each with its head: the module path of the output layer, relative to the class,
and that head's objective), and the facts about its config and modules that passes and pruning
need: its RMSNorm class and gain offset, the config keys of its positions and its norms' eps,
the flags that give its linears biases, and the per-layer config entries pruning must follow.
:func:`layout` reads a model into a :class:`Layout`.

A checkpoint is loaded with the class its config's ``architectures`` names and saved with the
same class: a base model (``LlamaModel``) has no head and its output is the last hidden state;
a classifier keeps its classifier.

What a norm module computes is read from its class (exact type matches only: a subclass may
compute something else): its kind (one of ``layout.NORM_KINDS``) and gain offset (the gain is
offset + weight: Gemma's RMSNorm scales by 1 + w). A class not in the table is kind "other"
with an unknown offset, so no pass folds it.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from typing import Callable

from torch import nn

from . import adapters, algebra
from .errors import SurgeryError
from .layout import Layout
from .runtime import CompensatedLayerNorm, CRMSNorm, RMSNorm


@dataclass(frozen=True)
class Head:
    objective: str  # one of layout.OBJECTIVES
    path: str | None  # the output layer, relative to the class; None for a base model


#: the auto class that builds each objective's classes (``auto_map`` names the runtime class under it)
AUTO_CLASS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
              "sequence-classification": "AutoModelForSequenceClassification",
              "token-classification": "AutoModelForTokenClassification", "none": "AutoModel"}


@dataclass(frozen=True)
class Pruning:
    """What removing layers must change in a config besides ``num_hidden_layers``."""

    lists: tuple[str, ...] = ()  # keys holding one entry per layer: kept entries only
    counted: tuple[str, ...] = ()  # keys counting the first layers of a kind (Qwen2's max_window_layers)
    index_flags: tuple[str, ...] = ()  # flags under which a layer's index enters what it computes
    indices: tuple[str, ...] = ()  # keys listing layer indices (Qwen2-MoE's mlp_only_layers): kept ones, renumbered
    strides: tuple[str, ...] = ()  # keys n making every n-th layer of a kind: renumbering needs n == 1


@dataclass(frozen=True)
class Family:
    adapter: Callable[..., Layout]
    lm_class: str  # the class a config without ``architectures`` gets, e.g. "LlamaForCausalLM"
    classes: dict[str, Head]  # every class normsurgery loads and saves for this family
    rmsnorm: tuple[str, float] | None = None  # the family's RMSNorm class in its modeling module, gain offset
    layernorm: str | None = None  # the family's bias-free LayerNorm class (float32 statistics), e.g. CohereLayerNorm
    module: str | None = None  # its transformers.models package when not named model_type (gemma3_text: gemma3)
    positions_key: str = "max_position_embeddings"
    eps_keys: tuple[str, ...] = ()  # config keys the stock norms read their eps from
    bias_flags: tuple[str, ...] = ()  # config flags that give the stock linears biases
    pruning: Pruning = Pruning()
    # the causal LM's logits are its head's linear output as it is (no scale or soft cap after it)
    plain_logits: bool = True
    gguf: str | None = None  # llama.cpp's architecture for the stock shapes (``gguf``); None: not written

    def positions(self, config) -> int | None:
        """The longest sequence the model's positions allow (None: no limit known)."""
        return getattr(config, self.positions_key, None)


def _classes(lm: str, base: str, *, lm_head: str = "lm_head", objective: str = "causal-lm",
             seq: tuple[str, str] | None = None, tok: tuple[str, str] | None = None) -> dict[str, Head]:
    """The family's classes: its LM class, its base model and its classifiers (class, head path)."""
    table = {lm: Head(objective, lm_head), base: Head("none", None)}
    for kind, entry in (("sequence-classification", seq), ("token-classification", tok)):
        if entry:
            table[entry[0]] = Head(kind, entry[1])
    return table


def _decoder(prefix: str, lm: str | None = None, tok_head: str = "score") -> dict[str, Head]:
    """Llama-style classes: {P}ForCausalLM, {P}Model, {P}ForSequenceClassification (score) and
    {P}ForTokenClassification."""
    return _classes(lm or f"{prefix}ForCausalLM", f"{prefix}Model",
                    seq=(f"{prefix}ForSequenceClassification", "score"),
                    tok=(f"{prefix}ForTokenClassification", tok_head))


LN_EPS, RMS_EPS = ("layer_norm_eps",), ("rms_norm_eps",)
SLIDING = Pruning(lists=("layer_types",), counted=("max_window_layers",))

FAMILIES = {
    "gpt2": Family(adapters.gpt2, "GPT2LMHeadModel", _decoder("GPT2", "GPT2LMHeadModel", "classifier"),
                   positions_key="n_positions", eps_keys=("layer_norm_epsilon",),
                   pruning=Pruning(index_flags=("scale_attn_by_inverse_layer_idx",)), gguf="gpt2"),
    "gpt_neox": Family(adapters.gpt_neox, "GPTNeoXForCausalLM", _decoder("GPTNeoX", tok_head="classifier"),
                       eps_keys=LN_EPS, bias_flags=("attention_bias",)),
    "opt": Family(adapters.opt, "OPTForCausalLM",
                  _classes("OPTForCausalLM", "OPTModel", seq=("OPTForSequenceClassification", "score")),
                  bias_flags=("enable_bias",)),
    "llama": Family(adapters.llama_like, "LlamaForCausalLM", _decoder("Llama"), rmsnorm=("LlamaRMSNorm", 0.0),
                    eps_keys=RMS_EPS, bias_flags=("attention_bias", "mlp_bias"), gguf="llama"),
    "mistral": Family(adapters.llama_like, "MistralForCausalLM", _decoder("Mistral"),
                      rmsnorm=("MistralRMSNorm", 0.0), eps_keys=RMS_EPS, pruning=Pruning(lists=("layer_types",)),
                      gguf="llama"),
    "qwen2": Family(adapters.llama_like, "Qwen2ForCausalLM", _decoder("Qwen2"), rmsnorm=("Qwen2RMSNorm", 0.0),
                    eps_keys=RMS_EPS, pruning=SLIDING, gguf="qwen2"),
    "qwen3": Family(adapters.llama_like, "Qwen3ForCausalLM", _decoder("Qwen3"), rmsnorm=("Qwen3RMSNorm", 0.0),
                    eps_keys=RMS_EPS, bias_flags=("attention_bias",), pruning=SLIDING),
    "gemma": Family(adapters.llama_like, "GemmaForCausalLM", _decoder("Gemma"), rmsnorm=("GemmaRMSNorm", 1.0),
                    eps_keys=RMS_EPS, bias_flags=("attention_bias",)),
    "gemma2": Family(adapters.sandwich, "Gemma2ForCausalLM", _decoder("Gemma2"), rmsnorm=("Gemma2RMSNorm", 1.0),
                     eps_keys=RMS_EPS, bias_flags=("attention_bias",), pruning=Pruning(lists=("layer_types",)),
                     plain_logits=False),
    "gemma3_text": Family(adapters.sandwich, "Gemma3ForCausalLM",
                          _classes("Gemma3ForCausalLM", "Gemma3TextModel",
                                   seq=("Gemma3TextForSequenceClassification", "score")),
                          rmsnorm=("Gemma3RMSNorm", 1.0), module="gemma3", eps_keys=RMS_EPS,
                          bias_flags=("attention_bias",), pruning=Pruning(lists=("layer_types",)), plain_logits=False),
    "phi3": Family(adapters.fused, "Phi3ForCausalLM", _decoder("Phi3"), rmsnorm=("Phi3RMSNorm", 0.0),
                   eps_keys=RMS_EPS),
    "mixtral": Family(adapters.llama_like, "MixtralForCausalLM", _decoder("Mixtral"),
                      rmsnorm=("MixtralRMSNorm", 0.0), eps_keys=RMS_EPS),
    "qwen2_moe": Family(adapters.llama_like, "Qwen2MoeForCausalLM", _decoder("Qwen2Moe"),
                        rmsnorm=("Qwen2MoeRMSNorm", 0.0), eps_keys=RMS_EPS, bias_flags=("qkv_bias",),
                        pruning=Pruning(lists=("layer_types",), counted=("max_window_layers",),
                                        indices=("mlp_only_layers",), strides=("decoder_sparse_step",))),
    "granite": Family(adapters.llama_like, "GraniteForCausalLM", _classes("GraniteForCausalLM", "GraniteModel"),
                      rmsnorm=("GraniteRMSNorm", 0.0), eps_keys=RMS_EPS, bias_flags=("attention_bias", "mlp_bias"),
                      plain_logits=False),
    "smollm3": Family(adapters.llama_like, "SmolLM3ForCausalLM", _decoder("SmolLM3"), rmsnorm=("SmolLM3RMSNorm", 0.0),
                      eps_keys=RMS_EPS, bias_flags=("attention_bias", "mlp_bias"),
                      pruning=Pruning(lists=("layer_types", "no_rope_layers"))),
    "olmo2": Family(adapters.post_norms, "Olmo2ForCausalLM",
                    _classes("Olmo2ForCausalLM", "Olmo2Model", seq=("Olmo2ForSequenceClassification", "score")),
                    rmsnorm=("Olmo2RMSNorm", 0.0), eps_keys=RMS_EPS, bias_flags=("attention_bias",)),
    "starcoder2": Family(adapters.starcoder2, "Starcoder2ForCausalLM",
                         _classes("Starcoder2ForCausalLM", "Starcoder2Model",
                                  seq=("Starcoder2ForSequenceClassification", "score"),
                                  tok=("Starcoder2ForTokenClassification", "score")),
                         eps_keys=("norm_epsilon",), bias_flags=("use_bias",)),
    "stablelm": Family(adapters.stablelm, "StableLmForCausalLM", _decoder("StableLm"), eps_keys=LN_EPS,
                       bias_flags=("use_qkv_bias",)),
    "gptj": Family(adapters.gptj, "GPTJForCausalLM",
                   _classes("GPTJForCausalLM", "GPTJModel", seq=("GPTJForSequenceClassification", "score")),
                   positions_key="n_positions", eps_keys=("layer_norm_epsilon",), plain_logits=False),
    "cohere": Family(adapters.cohere, "CohereForCausalLM", _classes("CohereForCausalLM", "CohereModel"),
                     layernorm="CohereLayerNorm", eps_keys=("layer_norm_eps",), bias_flags=("attention_bias",),
                     plain_logits=False),
    "falcon": Family(adapters.falcon, "FalconForCausalLM",
                     _classes("FalconForCausalLM", "FalconModel", seq=("FalconForSequenceClassification", "score"),
                              tok=("FalconForTokenClassification", "classifier")),
                     eps_keys=("layer_norm_epsilon",), bias_flags=("bias",), plain_logits=False),
    "phi": Family(adapters.phi, "PhiForCausalLM", _decoder("Phi"), eps_keys=LN_EPS),
    "bert": Family(adapters.bert, "BertForMaskedLM",
                   _classes("BertForMaskedLM", "BertModel", lm_head="cls.predictions.decoder",
                            objective="masked-lm", seq=("BertForSequenceClassification", "classifier"),
                            tok=("BertForTokenClassification", "classifier")), eps_keys=LN_EPS, plain_logits=False),
    "mpnet": Family(adapters.mpnet, "MPNetForMaskedLM",
                    _classes("MPNetForMaskedLM", "MPNetModel", lm_head="lm_head.decoder", objective="masked-lm",
                             seq=("MPNetForSequenceClassification", "classifier.out_proj"),
                             tok=("MPNetForTokenClassification", "classifier")), eps_keys=LN_EPS, plain_logits=False),
}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise SurgeryError(f"no adapter for {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def positions(config) -> int | None:
    """The longest sequence the model's positions allow (None: no limit known); a family without
    an adapter (``verify`` only): the usual key, ``max_position_embeddings``."""
    fam = FAMILIES.get(config.model_type)
    return fam.positions(config) if fam is not None else getattr(config, "max_position_embeddings", None)


def class_name(config) -> str:
    """The stock class the config's ``architectures`` names (its family's LM class when it names
    none); a class normsurgery does not handle is a SurgeryError."""
    fam = family(config.model_type)
    names = [a.removeprefix("NormSurgery") for a in getattr(config, "architectures", None) or []]
    if not names:
        return fam.lm_class
    if len(names) > 1 or names[0] not in fam.classes:
        raise SurgeryError(f"the checkpoint's architectures {', '.join(names)} is not a class normsurgery handles "
                           f"for {config.model_type}; supported: {', '.join(fam.classes)}")
    return names[0]


def architecture(config) -> tuple[str, str]:
    """(family, stock class) the family table reads from a config: what a rewrite keeps (a family
    without an adapter: :func:`stock_class_name`)."""
    return config.model_type, stock_class_name(config)


def stock_class_name(config) -> str:
    """:func:`class_name` for a family with an adapter. For one without, which only ``verify``
    reads (comparing what the stock class outputs, which needs no layout): the one class the
    config's ``architectures`` names (none: the base model ``AutoModel`` builds), a transformers
    class that reads token ids alone and outputs logits (LM or classifier, :func:`stock_objective`)
    or a last hidden state; anything else is a SurgeryError saying why."""
    if config.model_type in FAMILIES:
        return class_name(config)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    names = getattr(config, "architectures", None) or []
    base = MODEL_MAPPING_NAMES.get(config.model_type)
    name = names[0] if len(names) == 1 else base if not names and isinstance(base, str) else None
    what = f"{config.model_type} has no adapter, so verify compares what its stock class outputs, but"
    if name is None:
        raise SurgeryError(f"{what} its config names {', '.join(names) or 'no class'} and there is no single "
                           "class to load")
    if not hasattr(transformers, name):
        raise SurgeryError(f"{what} transformers {transformers.__version__} has no class {name} (normsurgery runs "
                           "no code from checkpoints)")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "vocab_size", None) is None:
        raise SurgeryError(f"{what} {name} does not read token ids alone (an encoder-decoder, or a model without "
                           "a vocabulary)")
    if stock_objective(name) is None:
        raise SurgeryError(f"{what} {name} is not a causal or masked LM, sequence or token classifier, or base "
                           "model: its outputs are not ones verify compares")
    return name


def stock_objective(name: str) -> str | None:
    """The objective (``layout.OBJECTIVES``) of the stock transformers class ``name``, read from
    the mapping of the Auto class that builds it (those of ``AUTO_CLASS``); None when none of them
    does (a question-answering head, a pre-training head...)."""
    from transformers.models.auto import modeling_auto as auto

    tables = {"causal-lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "masked-lm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
              "sequence-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
              "token-classification": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
              "none": auto.MODEL_MAPPING_NAMES}
    for kind, table in tables.items():
        if any(name == v or (isinstance(v, tuple) and name in v) for v in table.values()):
            return kind
    return None


def objective(model) -> str:
    """What ``model``'s class is trained for (``layout.OBJECTIVES``; "none": a base model, whose
    output is its last hidden state): its head in the family table, or for a family without an
    adapter, :func:`stock_objective` of its stock class. Needs no layout."""
    if model.config.model_type in FAMILIES:
        return head_of(model).objective
    name = stock_class_of(model).__name__
    kind = stock_objective(name)
    if kind is None:
        raise SurgeryError(f"{name} is not a causal or masked LM, sequence or token classifier, or base model: "
                           "its outputs are not ones normsurgery compares")
    return kind


def stock_class_of(model) -> type:
    """The stock transformers class of ``model``, through the subclasses made around it: the
    runtime's ``NormSurgery<Class>`` (bases: the class) and FSDP2's ``FSDP<Class>`` while a training
    is sharded (``fully_shard``; bases: FSDPModule, the class)."""
    cls = type(model)
    while cls.__name__.startswith(("NormSurgery", "FSDP")):
        cls = cls.__bases__[-1]
    return cls


def head_of(model) -> Head:
    name = stock_class_of(model).__name__
    classes = family(model.config.model_type).classes
    if name not in classes:
        raise SurgeryError(f"{name} is not a class normsurgery handles for {model.config.model_type}; "
                           f"supported: {', '.join(classes)}")
    return classes[name]


def auto_class(model) -> str:
    return AUTO_CLASS[head_of(model).objective]


def base_prefix(model) -> str:
    """"" when ``model`` is its base model (``LlamaModel``), else the base model's attribute and a
    dot ("model.", "transformer."): every path in the Layout starts with it."""
    return "" if model.base_model is model else f"{model.base_model_prefix}."


def layout(model, scope: tuple[str, ...] = ()) -> Layout:
    """The layout of ``model``, read afresh (passes change modules, so never cache it); with
    ``scope``, restricted to those modules (``Layout.restrict``). Reads only classes, shapes
    and attributes, so it works on a model whose parameters are on the meta device."""
    head = head_of(model)
    lay = family(model.config.model_type).adapter(model, base_prefix(model), head.path).restrict(scope)
    sites = []
    for s in lay.norms:
        mod = model.get_submodule(s.path)
        kind, offset = norm_kind(mod)
        sites.append(dataclasses.replace(s, kind=kind, offset=offset, eps=norm_eps(mod)))
    # read inside the scope: elsewhere a part rewritten earlier may have another width
    width = algebra.out_width(model.get_submodule((lay.writers or lay.embeddings)[0]))
    tied = head.path is not None and model.get_submodule(head.path).weight is \
        model.get_submodule(lay.token_embedding).weight
    fam = family(model.config.model_type)
    return dataclasses.replace(lay, norms=tuple(sites), stream_width=width, objective=head.objective, tied=tied,
                               eps_keys=fam.eps_keys, bias_flags=fam.bias_flags, plain_logits=fam.plain_logits)


#: norm classes -> (kind, gain offset of a module): torch's and the runtime's, then every family's
#: RMSNorm and bias-free LayerNorm as :func:`_norm_table` adds them
_NORMS: dict[type, tuple[str, Callable[[nn.Module], float]]] = {}
_ADDED: set[str] = set()  # the families' modeling modules whose norm classes are in _NORMS


def _norm_table(every: bool = False) -> dict[type, tuple[str, Callable[[nn.Module], float]]]:
    """Norm classes -> (kind, gain offset of a module): torch's, the runtime's, and the RMSNorm and
    bias-free LayerNorm of every family whose modeling module is imported (``every``: of every
    family, importing their modules: 18 of them, 0.15 s of CPU a command need not pay when its
    model's module, imported to build it, holds its norms)."""
    if not _NORMS:
        _NORMS.update({nn.LayerNorm: ("layernorm", lambda m: 0.0), RMSNorm: ("rmsnorm", lambda m: m.offset),
                       CRMSNorm: ("crmsnorm", lambda m: 0.0),
                       CompensatedLayerNorm: ("compensated-layernorm", lambda m: 0.0)})
    for name, fam in FAMILIES.items():
        package = fam.module or name
        path = f"transformers.models.{package}.modeling_{package}"
        if path in _ADDED or not (fam.rmsnorm or fam.layernorm) or not (every or path in sys.modules):
            continue
        module = importlib.import_module(path)
        if fam.rmsnorm:
            cls, offset = fam.rmsnorm
            _NORMS[getattr(module, cls)] = ("rmsnorm", lambda m, o=offset: o)
        if fam.layernorm:
            _NORMS[getattr(module, fam.layernorm)] = ("layernorm", lambda m: 0.0)
        _ADDED.add(path)
    return _NORMS


def norm_kind(mod: nn.Module) -> tuple[str, float | None]:
    """(kind, gain offset) of a norm module; ("other", None) for a class not in the table (looked
    up among the families' modules imported, then among all of them)."""
    entry = _norm_table().get(type(mod)) or _norm_table(every=True).get(type(mod))
    return (entry[0], entry[1](mod)) if entry else ("other", None)


def norm_eps(mod: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):
        if hasattr(mod, name):
            return float(getattr(mod, name))
    return None
