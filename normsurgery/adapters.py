"""Model adapters: where each family keeps its embeddings, norms, writers, readers and head.

An adapter turns a loaded Hugging Face model into a :class:`Layout`, plain data that passes
read. Passes never name a model's attributes; they ask the layout.

Placement:
- ``pre``: x += f(norm(x)) for each sublayer in turn (GPT-2, Llama, ...);
- ``parallel``: x += attn(norm_a(x)) + mlp(norm_m(x)) in one step (GPT-NeoX, Phi; Phi shares
  one norm between both, which is just a norm site with both sublayers' readers);
- ``post``: x = norm(x + f(x)) (BERT): the stream itself is normalised, so norm passes refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.pytorch_utils import Conv1D

from .errors import SurgeryError


@dataclass(frozen=True)
class NormSite:
    """A norm over the residual stream and the linear layers that read its output."""

    path: str
    readers: tuple[str, ...]
    role: str  # "attn", "mlp", "attn+mlp", "final", "embed", "post"


@dataclass(frozen=True)
class AttentionSite:
    """One block's self-attention: its projections and head layout, read from current shapes.

    Separate ``q``/``k``/``v`` or one fused ``qkv``: ``qkv_order`` "blocks" stacks all q rows,
    then all k, then all v (GPT-2); "heads" stacks q, k, v per head (GPT-NeoX). Query head h
    reads key/value head h // (num_heads // num_kv_heads). ``count_attrs`` are the module
    attributes its forward reads that follow the head counts, each with its quantity: "heads",
    "kv_heads", "groups" (query heads per kv head) or "width" (heads * head_dim).
    """

    path: str
    o: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_order: str = "separate"  # "separate" | "blocks" | "heads"
    count_attrs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MlpSite:
    """One block's MLP: down(act(up x)), or down(act(gate x) * up x) when ``gate`` is set."""

    up: str
    down: str
    act: str  # path of the activation module
    gate: str | None = None


@dataclass(frozen=True)
class Layout:
    family: str
    placement: str  # "pre" | "parallel" | "post"
    norm_type: str  # "layernorm" | "rmsnorm"
    hidden_size: int
    layers: str  # path of the ModuleList of blocks
    token_embedding: str
    embeddings: tuple[str, ...]  # embeddings whose rows are added to the stream
    writers: tuple[str, ...]  # linears whose outputs are added to the stream
    norms: tuple[NormSite, ...]  # every stream norm, final norm last
    head: str | None  # the LM head (reads the final norm)
    tied: bool  # head shares its weight with the token embedding
    norm_offset: float = 0.0  # gain = offset + weight (Gemma: 1)
    qk_norms: tuple[str, ...] = ()  # per-head norms inside attention: not foldable
    attention: tuple[AttentionSite, ...] = ()  # one per block
    mlps: tuple[MlpSite, ...] = ()  # one per block
    # (quantity, config key) the stock __init__ builds widths from: "intermediate", "heads",
    # "kv_heads", "head_dim" (only where the stock code reads head_dim from the config)
    config_widths: tuple[tuple[str, str], ...] = ()

    @property
    def final_norm(self) -> NormSite | None:
        return self.norms[-1] if self.norms and self.norms[-1].role == "final" else None


def _gpt2(model) -> Layout:
    c = model.config
    h = "transformer.h"
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.n_layer):
        b = f"{h}.{i}"
        norms += [NormSite(f"{b}.ln_1", (f"{b}.attn.c_attn",), "attn"),
                  NormSite(f"{b}.ln_2", (f"{b}.mlp.c_fc",), "mlp")]
        writers += [f"{b}.attn.c_proj", f"{b}.mlp.c_proj"]
        attn = model.get_submodule(f"{b}.attn")
        n = _in_features(attn.c_proj) // attn.head_dim
        attention.append(AttentionSite(f"{b}.attn", f"{b}.attn.c_proj", attn.head_dim, n, n,
                                       qkv=f"{b}.attn.c_attn", qkv_order="blocks",
                                       count_attrs=(("num_heads", "heads"), ("split_size", "width"))))
        mlps.append(MlpSite(f"{b}.mlp.c_fc", f"{b}.mlp.c_proj", f"{b}.mlp.act"))
    norms.append(NormSite("transformer.ln_f", ("lm_head",), "final"))
    return Layout("gpt2", "pre", "layernorm", c.n_embd, h, "transformer.wte",
                  ("transformer.wte", "transformer.wpe"), tuple(writers), tuple(norms),
                  "lm_head", _tied(model), attention=tuple(attention), mlps=tuple(mlps),
                  config_widths=(("intermediate", "n_inner"),))


def _gpt_neox(model) -> Layout:
    c = model.config
    h = "gpt_neox.layers"
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        norms += [NormSite(f"{b}.input_layernorm", (f"{b}.attention.query_key_value",), "attn"),
                  NormSite(f"{b}.post_attention_layernorm", (f"{b}.mlp.dense_h_to_4h",), "mlp")]
        writers += [f"{b}.attention.dense", f"{b}.mlp.dense_4h_to_h"]
        attn = model.get_submodule(f"{b}.attention")
        n = _in_features(attn.dense) // attn.head_size
        attention.append(AttentionSite(f"{b}.attention", f"{b}.attention.dense", attn.head_size, n, n,
                                       qkv=f"{b}.attention.query_key_value", qkv_order="heads"))
        mlps.append(MlpSite(f"{b}.mlp.dense_h_to_4h", f"{b}.mlp.dense_4h_to_h", f"{b}.mlp.act"))
    norms.append(NormSite("gpt_neox.final_layer_norm", ("lm_head",), "final"))
    placement = "parallel" if c.use_parallel_residual else "pre"
    return Layout("gpt_neox", placement, "layernorm", c.hidden_size, h, "gpt_neox.embed_in",
                  ("gpt_neox.embed_in",), tuple(writers), tuple(norms), "lm_head", _tied(model),
                  attention=tuple(attention), mlps=tuple(mlps),
                  config_widths=(("intermediate", "intermediate_size"),))


def _opt(model) -> Layout:
    c = model.config
    d = "model.decoder"
    h = f"{d}.layers"
    decoder = model.get_submodule(d)
    pre = c.do_layer_norm_before
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        qkv = tuple(f"{b}.self_attn.{p}_proj" for p in "qkv")
        norms += [NormSite(f"{b}.self_attn_layer_norm", qkv, "attn" if pre else "post"),
                  NormSite(f"{b}.final_layer_norm", (f"{b}.fc1",), "mlp" if pre else "post")]
        writers += [f"{b}.self_attn.out_proj", f"{b}.fc2"]
        attn = model.get_submodule(f"{b}.self_attn")
        n = _in_features(attn.out_proj) // attn.head_dim
        attention.append(AttentionSite(f"{b}.self_attn", f"{b}.self_attn.out_proj", attn.head_dim, n, n,
                                       *qkv, count_attrs=(("num_heads", "heads"),)))
        mlps.append(MlpSite(f"{b}.fc1", f"{b}.fc2", f"{b}.activation_fn"))
    project_in = getattr(decoder, "project_in", None) is not None
    embeddings = (f"{d}.embed_positions",) if project_in else (f"{d}.embed_tokens", f"{d}.embed_positions")
    if project_in:
        writers.insert(0, f"{d}.project_in")
    if getattr(decoder, "final_layer_norm", None) is not None:
        reader = f"{d}.project_out" if getattr(decoder, "project_out", None) is not None else "lm_head"
        norms.append(NormSite(f"{d}.final_layer_norm", (reader,), "final"))
    return Layout("opt", "pre" if pre else "post", "layernorm", c.hidden_size, h, f"{d}.embed_tokens",
                  embeddings, tuple(writers), tuple(norms), "lm_head", _tied(model),
                  attention=tuple(attention), mlps=tuple(mlps), config_widths=(("intermediate", "ffn_dim"),))


def _llama_like(model) -> Layout:
    c = model.config
    h = "model.layers"
    norms, writers, qk = [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        attn = tuple(f"{b}.self_attn.{p}_proj" for p in "qkv")
        norms += [NormSite(f"{b}.input_layernorm", attn, "attn"),
                  NormSite(f"{b}.post_attention_layernorm", (f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"), "mlp")]
        writers += [f"{b}.self_attn.o_proj", f"{b}.mlp.down_proj"]
        attn_mod = model.get_submodule(f"{b}.self_attn")
        qk += [f"{b}.self_attn.{n}" for n in ("q_norm", "k_norm") if hasattr(attn_mod, n)]
    norms.append(NormSite("model.norm", ("lm_head",), "final"))
    offset = 1.0 if c.model_type == "gemma" else 0.0
    attention = tuple(_separate_attention(model, f"{h}.{i}.self_attn", "o_proj")
                      for i in range(c.num_hidden_layers))
    mlps = tuple(MlpSite(f"{h}.{i}.mlp.up_proj", f"{h}.{i}.mlp.down_proj", f"{h}.{i}.mlp.act_fn",
                         gate=f"{h}.{i}.mlp.gate_proj") for i in range(c.num_hidden_layers))
    widths = (("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
              ("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"))
    return Layout(c.model_type, "pre", "rmsnorm", c.hidden_size, h, "model.embed_tokens",
                  ("model.embed_tokens",), tuple(writers), tuple(norms), "lm_head", _tied(model),
                  norm_offset=offset, qk_norms=tuple(qk), attention=attention, mlps=mlps,
                  config_widths=widths)


def _phi(model) -> Layout:
    c = model.config
    h = "model.layers"
    norms, writers, qk = [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        readers = tuple(f"{b}.self_attn.{p}_proj" for p in "qkv") + (f"{b}.mlp.fc1",)
        norms.append(NormSite(f"{b}.input_layernorm", readers, "attn+mlp"))
        writers += [f"{b}.self_attn.dense", f"{b}.mlp.fc2"]
        if c.qk_layernorm:
            qk += [f"{b}.self_attn.q_layernorm", f"{b}.self_attn.k_layernorm"]
    norms.append(NormSite("model.final_layernorm", ("lm_head",), "final"))
    attention = tuple(_separate_attention(model, f"{h}.{i}.self_attn", "dense")
                      for i in range(c.num_hidden_layers))
    mlps = tuple(MlpSite(f"{h}.{i}.mlp.fc1", f"{h}.{i}.mlp.fc2", f"{h}.{i}.mlp.activation_fn")
                 for i in range(c.num_hidden_layers))
    return Layout("phi", "parallel", "layernorm", c.hidden_size, h, "model.embed_tokens",
                  ("model.embed_tokens",), tuple(writers), tuple(norms), "lm_head", _tied(model),
                  qk_norms=tuple(qk), attention=attention, mlps=mlps,
                  config_widths=(("intermediate", "intermediate_size"),))


def _bert(model) -> Layout:
    c = model.config
    h = "bert.encoder.layer"
    norms = [NormSite("bert.embeddings.LayerNorm", (), "embed")]
    writers = []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        norms += [NormSite(f"{b}.attention.output.LayerNorm", (), "post"),
                  NormSite(f"{b}.output.LayerNorm", (), "post")]
        writers += [f"{b}.attention.output.dense", f"{b}.output.dense"]
    emb = "bert.embeddings"
    return Layout("bert", "post", "layernorm", c.hidden_size, h, f"{emb}.word_embeddings",
                  (f"{emb}.word_embeddings", f"{emb}.position_embeddings", f"{emb}.token_type_embeddings"),
                  tuple(writers), tuple(norms), "cls.predictions.decoder", _tied(model))


def _separate_attention(model, path: str, o: str) -> AttentionSite:
    """Attention with separate q/k/v projections and ``num_key_value_groups`` (Llama, Phi, ...)."""
    attn = model.get_submodule(path)
    hd = attn.head_dim
    return AttentionSite(path, f"{path}.{o}", hd, _in_features(getattr(attn, o)) // hd,
                         attn.v_proj.weight.shape[0] // hd, f"{path}.q_proj", f"{path}.k_proj",
                         f"{path}.v_proj", count_attrs=(("num_key_value_groups", "groups"),))


def _in_features(mod) -> int:
    return mod.weight.shape[0] if isinstance(mod, Conv1D) else mod.weight.shape[1]


def _tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


ADAPTERS = {
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "qwen3": _llama_like,
    "gemma": _llama_like,
    "phi": _phi,
    "bert": _bert,
}

#: The auto class that loads each family with its language-modelling head.
AUTO_CLASS = {t: ("AutoModelForMaskedLM" if t == "bert" else "AutoModelForCausalLM") for t in ADAPTERS}


def check_supported(model_type: str) -> None:
    if model_type not in ADAPTERS:
        raise SurgeryError(f"no adapter for {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}")


def layout(model) -> Layout:
    """The layout of ``model``, read afresh (passes change modules, so never cache it)."""
    check_supported(model.config.model_type)
    return ADAPTERS[model.config.model_type](model)
