"""The one family table: for each supported ``model_type`` its adapter and every stock class it
loads and saves, each with its head (the module path of the output layer, relative to the
class) and that head's objective. :func:`layout` reads a model into a :class:`Layout`.

A checkpoint is loaded with the class its config's ``architectures`` names and saved with the
same class: a base model (``LlamaModel``) has no head and its output is the last hidden state;
a classifier keeps its classifier.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable


from . import adapters, algebra, norms
from .errors import SurgeryError
from .layout import Layout


@dataclass(frozen=True)
class Head:
    objective: str  # one of layout.OBJECTIVES
    path: str | None  # the output layer, relative to the class; None for a base model


#: the auto class that builds each objective's classes (``auto_map`` names the runtime class under it)
AUTO_CLASS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
              "sequence-classification": "AutoModelForSequenceClassification",
              "token-classification": "AutoModelForTokenClassification", "none": "AutoModel"}


@dataclass(frozen=True)
class Family:
    adapter: Callable[..., Layout]
    lm_class: str  # the class a config without ``architectures`` gets, e.g. "LlamaForCausalLM"
    classes: dict[str, Head]  # every class normsurgery loads and saves for this family


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


FAMILIES = {
    "gpt2": Family(adapters.gpt2, "GPT2LMHeadModel", _decoder("GPT2", "GPT2LMHeadModel", "classifier")),
    "gpt_neox": Family(adapters.gpt_neox, "GPTNeoXForCausalLM", _decoder("GPTNeoX", tok_head="classifier")),
    "opt": Family(adapters.opt, "OPTForCausalLM",
                  _classes("OPTForCausalLM", "OPTModel", seq=("OPTForSequenceClassification", "score"))),
    "llama": Family(adapters.llama_like, "LlamaForCausalLM", _decoder("Llama")),
    "mistral": Family(adapters.llama_like, "MistralForCausalLM", _decoder("Mistral")),
    "qwen2": Family(adapters.llama_like, "Qwen2ForCausalLM", _decoder("Qwen2")),
    "qwen3": Family(adapters.llama_like, "Qwen3ForCausalLM", _decoder("Qwen3")),
    "gemma": Family(adapters.llama_like, "GemmaForCausalLM", _decoder("Gemma")),
    "phi": Family(adapters.phi, "PhiForCausalLM", _decoder("Phi")),
    "bert": Family(adapters.bert, "BertForMaskedLM",
                   _classes("BertForMaskedLM", "BertModel", lm_head="cls.predictions.decoder",
                            objective="masked-lm", seq=("BertForSequenceClassification", "classifier"),
                            tok=("BertForTokenClassification", "classifier"))),
}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise SurgeryError(f"no adapter for {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def check_supported(model_type: str) -> None:
    family(model_type)


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
    """(family, stock class) the family table reads from a config: what a rewrite keeps."""
    return config.model_type, class_name(config)


def stock_class_of(model) -> type:
    """The stock transformers class of ``model`` (a runtime ``NormSurgery<Class>`` subclass's base)."""
    cls = type(model)
    while cls.__name__.startswith("NormSurgery"):
        cls = cls.__bases__[0]
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
        kind, offset = norms.kind_of(mod)
        sites.append(dataclasses.replace(s, kind=kind, offset=offset, eps=norms.eps_of(mod)))
    # read inside the scope: elsewhere a part rewritten earlier may have another width
    width = algebra.out_width(model.get_submodule((lay.writers or lay.embeddings)[0]))
    tied = head.path is not None and model.get_submodule(head.path).weight is \
        model.get_submodule(lay.token_embedding).weight
    return dataclasses.replace(lay, norms=tuple(sites), stream_width=width, objective=head.objective, tied=tied)
