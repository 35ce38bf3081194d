"""The one family table: for each supported ``model_type`` its adapter, its stock class with the
language-modelling head (the class rewritten checkpoints subclass in the runtime) and that
head's objective. :func:`layout` reads a model into a :class:`Layout`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import transformers

from . import adapters, algebra, norms
from .errors import SurgeryError
from .layout import Layout


@dataclass(frozen=True)
class Family:
    adapter: Callable[..., Layout]
    lm_class: str  # the stock class with the LM head, e.g. "LlamaForCausalLM"
    objective: str  # what that head is trained for: "causal-lm" | "masked-lm"

    @property
    def auto_class(self) -> str:
        return "AutoModelForMaskedLM" if self.objective == "masked-lm" else "AutoModelForCausalLM"


FAMILIES = {
    "gpt2": Family(adapters._gpt2, "GPT2LMHeadModel", "causal-lm"),
    "gpt_neox": Family(adapters._gpt_neox, "GPTNeoXForCausalLM", "causal-lm"),
    "opt": Family(adapters._opt, "OPTForCausalLM", "causal-lm"),
    "llama": Family(adapters._llama_like, "LlamaForCausalLM", "causal-lm"),
    "mistral": Family(adapters._llama_like, "MistralForCausalLM", "causal-lm"),
    "qwen2": Family(adapters._llama_like, "Qwen2ForCausalLM", "causal-lm"),
    "qwen3": Family(adapters._llama_like, "Qwen3ForCausalLM", "causal-lm"),
    "gemma": Family(adapters._llama_like, "GemmaForCausalLM", "causal-lm"),
    "phi": Family(adapters._phi, "PhiForCausalLM", "causal-lm"),
    "bert": Family(adapters._bert, "BertForMaskedLM", "masked-lm"),
}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise SurgeryError(f"no adapter for {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def check_supported(model_type: str) -> None:
    family(model_type)


def layout(model, scope: tuple[str, ...] = ()) -> Layout:
    """The layout of ``model``, read afresh (passes change modules, so never cache it); with
    ``scope``, restricted to those modules (``Layout.restrict``). Reads only classes, shapes
    and attributes, so it works on a model whose parameters are on the meta device."""
    fam = family(model.config.model_type)
    lay = fam.adapter(model).restrict(scope)
    sites = []
    for s in lay.norms:
        mod = model.get_submodule(s.path)
        kind, offset = norms.kind_of(mod)
        sites.append(dataclasses.replace(s, kind=kind, offset=offset, eps=norms.eps_of(mod)))
    # read inside the scope: elsewhere a part rewritten earlier may have another width
    width = algebra.out_width(model.get_submodule((lay.writers or lay.embeddings)[0]))
    objective = fam.objective if isinstance(model, getattr(transformers, fam.lm_class)) else "none"
    return dataclasses.replace(lay, norms=tuple(sites), stream_width=width, objective=objective)
