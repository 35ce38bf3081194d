"""Model adapters: where each family keeps its embeddings, norms, writers, readers and head.

One function per model shape, called with the model, the prefix of its base model's modules
(``families.base_prefix``: "model." in ``LlamaForCausalLM``, "" in ``LlamaModel``) and the path
of its head (None for a base model, whose final norm then has no reader: its output is the
model's output). Each returns the family-specific part of a :class:`Layout` (paths and
placement); ``families.layout`` adds what is read off the live modules the same way for every
family (norm kinds, offsets, eps, stream width, objective, tied head).
"""

from __future__ import annotations

import dataclasses

from .algebra import in_width
from .errors import SurgeryError
from .layout import AttentionSite, Layout, MlpSite, NormSite


def gpt2(model, p: str, head: str | None) -> Layout:
    c = model.config
    h = f"{p}h"
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.n_layer):
        b = f"{h}.{i}"
        norms += [NormSite(f"{b}.ln_1", (f"{b}.attn.c_attn",), "attn"),
                  NormSite(f"{b}.ln_2", (f"{b}.mlp.c_fc",), "mlp")]
        writers += [f"{b}.attn.c_proj", f"{b}.mlp.c_proj"]
        attn = model.get_submodule(f"{b}.attn")
        n = in_width(attn.c_proj) // attn.head_dim
        attention.append(AttentionSite(f"{b}.attn", f"{b}.attn.c_proj", attn.head_dim, n, n,
                                       qkv=f"{b}.attn.c_attn", qkv_order="blocks",
                                       count_attrs=(("num_heads", "heads"), ("split_size", "width"))))
        mlps.append(MlpSite(f"{b}.mlp.c_fc", f"{b}.mlp.c_proj", f"{b}.mlp.act"))
    norms.append(NormSite(f"{p}ln_f", _readers(head), "final"))
    return Layout("gpt2", "pre", 0, c.n_embd, h, f"{p}wte", (f"{p}wte", f"{p}wpe"), tuple(writers),
                  tuple(norms), head, False, attention=tuple(attention), mlps=tuple(mlps),
                  config_widths=(("intermediate", "n_inner"),))


def gpt_neox(model, p: str, head: str | None) -> Layout:
    c = model.config
    h = f"{p}layers"
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        norms += [NormSite(f"{b}.input_layernorm", (f"{b}.attention.query_key_value",), "attn"),
                  NormSite(f"{b}.post_attention_layernorm", (f"{b}.mlp.dense_h_to_4h",), "mlp")]
        writers += [f"{b}.attention.dense", f"{b}.mlp.dense_4h_to_h"]
        attn = model.get_submodule(f"{b}.attention")
        n = in_width(attn.dense) // attn.head_size
        attention.append(AttentionSite(f"{b}.attention", f"{b}.attention.dense", attn.head_size, n, n,
                                       qkv=f"{b}.attention.query_key_value", qkv_order="heads"))
        mlps.append(MlpSite(f"{b}.mlp.dense_h_to_4h", f"{b}.mlp.dense_4h_to_h", f"{b}.mlp.act"))
    norms.append(NormSite(f"{p}final_layer_norm", _readers(head), "final"))
    placement = "parallel" if c.use_parallel_residual else "pre"
    return Layout("gpt_neox", placement, 0, c.hidden_size, h, f"{p}embed_in",
                  (f"{p}embed_in",), tuple(writers), tuple(norms), head, False,
                  attention=tuple(attention), mlps=tuple(mlps),
                  config_widths=(("intermediate", "intermediate_size"),))


def opt(model, p: str, head: str | None) -> Layout:
    c = model.config
    d = f"{p}decoder"
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
        n = in_width(attn.out_proj) // attn.head_dim
        attention.append(AttentionSite(f"{b}.self_attn", f"{b}.self_attn.out_proj", attn.head_dim, n, n,
                                       *qkv, count_attrs=(("num_heads", "heads"),)))
        mlps.append(MlpSite(f"{b}.fc1", f"{b}.fc2", f"{b}.activation_fn"))
    project_in = getattr(decoder, "project_in", None) is not None
    embeddings = (f"{d}.embed_positions",) if project_in else (f"{d}.embed_tokens", f"{d}.embed_positions")
    if project_in:
        writers.insert(0, f"{d}.project_in")
    if getattr(decoder, "final_layer_norm", None) is not None:
        out = getattr(decoder, "project_out", None) is not None
        norms.append(NormSite(f"{d}.final_layer_norm", (f"{d}.project_out",) if out else _readers(head), "final"))
    return Layout("opt", "pre" if pre else "post", 0, c.hidden_size, h, f"{d}.embed_tokens",
                  embeddings, tuple(writers), tuple(norms), head, False,
                  attention=tuple(attention), mlps=tuple(mlps), config_widths=(("intermediate", "ffn_dim"),))


def llama_like(model, p: str, head: str | None, *, attn_norm: str | None = "input_layernorm",
               mlp_norm: str | None = "post_attention_layernorm", output_norms: tuple[str, ...] = (),
               fused: bool = False, mlp_names: tuple[str | None, str, str, str] = ("gate_proj", "up_proj",
                                                                                 "down_proj", "act_fn")) -> Layout:
    """Llama-style decoders; ``attn_norm`` and ``mlp_norm`` name the sub-blocks' input norms (None:
    the sub-block reads the stream itself), ``output_norms`` the norms on the sub-blocks' outputs
    (sandwich norms: x += norm_out(f(norm_in(x)))); ``fused``: one ``qkv_proj`` and one
    stacked gate and up (``mlp_names``' up) read the norms (Phi-3). An MLP with ``experts`` is a
    mixture of experts (Mixtral, Qwen2-MoE): see :func:`_experts`; the blocks are then not
    described. ``mlp_names``: the MLP's (gate or None, up, down, activation)."""
    c = model.config
    h = f"{p}layers"
    norms, writers, qk, experts = [], [], [], []
    gate, up, down, act = mlp_names
    attn_in = ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj")
    mlp_in = tuple(n for n in (gate, up) if n)
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        if hasattr(model.get_submodule(f"{b}.mlp"), "experts"):
            experts.append(f"{b}.mlp")
            mlp_readers, mlp_writers = _experts(model, f"{b}.mlp")
        else:
            mlp_readers, mlp_writers = tuple(f"{b}.mlp.{r}" for r in mlp_in), (f"{b}.mlp.{down}",)
        norms += [NormSite(f"{b}.{n}", readers, role) for n, readers, role in (
            (attn_norm, tuple(f"{b}.self_attn.{r}" for r in attn_in), "attn"), (mlp_norm, mlp_readers, "mlp")) if n]
        norms += [NormSite(f"{b}.{n}", (), "output") for n in output_norms]
        writers += [f"{b}.self_attn.o_proj", *mlp_writers]
        attn_mod = model.get_submodule(f"{b}.self_attn")
        qk += [f"{b}.self_attn.{n}" for n in ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
               if getattr(attn_mod, n, None) is not None]
    norms.append(NormSite(f"{p}norm", _readers(head), "final"))
    blocks = () if experts else range(c.num_hidden_layers)
    attention = tuple((_fused_attention if fused else _separate_attention)(model, f"{h}.{i}.self_attn")
                      for i in blocks)
    mlps = tuple(MlpSite(f"{h}.{i}.mlp.{up}", f"{h}.{i}.mlp.{down}", f"{h}.{i}.mlp.{act}",
                         gate=f"{h}.{i}.mlp.{up}" if fused else gate and f"{h}.{i}.mlp.{gate}", stacked=fused)
                 for i in blocks)
    widths = (("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
              ("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"))
    return Layout(c.model_type, "pre", 0, c.hidden_size, h, f"{p}embed_tokens",
                  (f"{p}embed_tokens",), tuple(writers), tuple(norms), head, False,
                  qk_norms=tuple(qk), attention=attention, mlps=mlps,
                  config_widths=widths, experts=tuple(experts), shared_head_counts=fused)


def _experts(model, path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(readers, writers) of a mixture-of-experts MLP: its router (``gate``), every routed expert
    (stacked ``experts.gate_up_proj`` [experts, 2 I, d] and ``experts.down_proj``) and, where
    there is one, the shared expert and its gate (Qwen2-MoE): all read the MLP's input norm."""
    mlp = model.get_submodule(path)
    readers = [f"{path}.gate", f"{path}.experts.gate_up_proj"]
    writers = [f"{path}.experts.down_proj"]
    if hasattr(mlp, "shared_expert"):
        readers += [f"{path}.shared_expert.gate_proj", f"{path}.shared_expert.up_proj", f"{path}.shared_expert_gate"]
        writers.append(f"{path}.shared_expert.down_proj")
    return tuple(readers), tuple(writers)


def sandwich(model, p: str, head: str | None) -> Layout:
    """Gemma 2 and 3: a norm before and after each sub-block (``post_attention_layernorm`` is
    the attention's output norm, ``pre_feedforward_layernorm`` the MLP's input norm)."""
    return llama_like(model, p, head, mlp_norm="pre_feedforward_layernorm",
                      output_norms=("post_attention_layernorm", "post_feedforward_layernorm"))


def post_norms(model, p: str, head: str | None) -> Layout:
    """OLMo 2: norms only on the sub-blocks' outputs, x += norm_out(f(x)), and a final norm."""
    return llama_like(model, p, head, attn_norm=None, mlp_norm=None,
                      output_norms=("post_attention_layernorm", "post_feedforward_layernorm"))


def starcoder2(model, p: str, head: str | None) -> Layout:
    """StarCoder2: Llama's shape with LayerNorms and a gateless MLP (``c_fc``, ``c_proj``)."""
    return llama_like(model, p, head, mlp_names=(None, "c_fc", "c_proj", "act"))


def stablelm(model, p: str, head: str | None) -> Layout:
    """StableLM: Llama's shape with LayerNorms; with ``use_parallel_residual`` one norm feeds the
    attention and the MLP, x += attn(n(x)) + mlp(n(x)) (placement "parallel"). Its attention reads
    its own head counts, and its head_dim is hidden_size // num_attention_heads (so head counts
    stay out of the config). With ``qk_layernorm`` each head has its own LayerNorm module, in a
    list that follows the heads."""
    c = model.config
    lay = _parallel(model, p, head) if c.use_parallel_residual else llama_like(model, p, head)
    counts = (("num_heads", "heads"), ("num_key_value_heads", "kv_heads"), ("num_key_value_groups", "groups"))
    norms = (("q_layernorm.norms", "q"), ("k_layernorm.norms", "k")) if c.qk_layernorm else ()
    attention = tuple(dataclasses.replace(a, count_attrs=counts, per_head=tuple((f"{a.path}.{n}", part)
                                                                                for n, part in norms))
                      for a in lay.attention)
    return dataclasses.replace(lay, attention=attention, config_widths=(("intermediate", "intermediate_size"),))


def cohere(model, p: str, head: str | None) -> Layout:
    """Cohere (Command-R): parallel blocks, x += attn(n(x)) + mlp(n(x)), n a bias-free LayerNorm
    (``CohereLayerNorm``); the head's ``logit_scale`` multiplies the logits after the head, so a
    fold into the head leaves it as is. With ``use_qk_norm`` the QK norms' gains are [heads,
    head_dim] (one row per head): they follow the heads."""
    lay = _parallel(model, p, head)
    if not model.config.use_qk_norm:
        return lay
    return dataclasses.replace(lay, attention=tuple(dataclasses.replace(
        a, per_head=((f"{a.path}.q_norm.weight", "q"), (f"{a.path}.k_norm.weight", "k"))) for a in lay.attention))


def _parallel(model, p: str, head: str | None) -> Layout:
    """Llama's modules in parallel blocks: ``input_layernorm`` feeds the attention and the gated
    MLP (placement "parallel")."""
    lay = llama_like(model, p, head, mlp_norm=None)
    norms = tuple(dataclasses.replace(s, readers=s.readers + (f"{s.path.rsplit('.', 1)[0]}.mlp.gate_proj",
                                                             f"{s.path.rsplit('.', 1)[0]}.mlp.up_proj"),
                                      role="attn+mlp") if s.role == "attn" else s for s in lay.norms)
    return dataclasses.replace(lay, placement="parallel", norms=norms)


def fused(model, p: str, head: str | None) -> Layout:
    """Phi-3: Llama's shape with fused ``qkv_proj`` and ``gate_up_proj`` (gate rows, then up)
    readers. Its attention finds the query rows by the config's ``num_attention_heads``, which
    every block shares: they all keep as many heads (``shared_head_counts``)."""
    return llama_like(model, p, head, fused=True, mlp_names=(None, "gate_up_proj", "down_proj", "activation_fn"))


def phi(model, p: str, head: str | None) -> Layout:
    c = model.config
    h = f"{p}layers"
    norms, writers, qk = [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        readers = tuple(f"{b}.self_attn.{p}_proj" for p in "qkv") + (f"{b}.mlp.fc1",)
        norms.append(NormSite(f"{b}.input_layernorm", readers, "attn+mlp"))
        writers += [f"{b}.self_attn.dense", f"{b}.mlp.fc2"]
        if c.qk_layernorm:
            qk += [f"{b}.self_attn.q_layernorm", f"{b}.self_attn.k_layernorm"]
    norms.append(NormSite(f"{p}final_layernorm", _readers(head), "final"))
    attention = tuple(_separate_attention(model, f"{h}.{i}.self_attn", "dense")
                      for i in range(c.num_hidden_layers))
    mlps = tuple(MlpSite(f"{h}.{i}.mlp.fc1", f"{h}.{i}.mlp.fc2", f"{h}.{i}.mlp.activation_fn")
                 for i in range(c.num_hidden_layers))
    return Layout("phi", "parallel", 0, c.hidden_size, h, f"{p}embed_tokens",
                  (f"{p}embed_tokens",), tuple(writers), tuple(norms), head, False,
                  qk_norms=tuple(qk), attention=attention, mlps=mlps,
                  config_widths=(("intermediate", "intermediate_size"),))


def gptj(model, p: str, head: str | None) -> Layout:
    """GPT-J: parallel blocks, one LayerNorm for both, x += attn(ln_1(x)) + mlp(ln_1(x)). Its
    attention reshapes by head_dim alone (hidden_size // n_head, so head counts stay out of the
    config); ``num_attention_heads`` is kept true."""
    c = model.config
    h = f"{p}h"
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.n_layer):
        b = f"{h}.{i}"
        qkv = tuple(f"{b}.attn.{r}_proj" for r in "qkv")
        norms.append(NormSite(f"{b}.ln_1", qkv + (f"{b}.mlp.fc_in",), "attn+mlp"))
        writers += [f"{b}.attn.out_proj", f"{b}.mlp.fc_out"]
        attn = model.get_submodule(f"{b}.attn")
        n = in_width(attn.out_proj) // attn.head_dim
        attention.append(AttentionSite(f"{b}.attn", f"{b}.attn.out_proj", attn.head_dim, n, n, *qkv,
                                       count_attrs=(("num_attention_heads", "heads"),)))
        mlps.append(MlpSite(f"{b}.mlp.fc_in", f"{b}.mlp.fc_out", f"{b}.mlp.act"))
    norms.append(NormSite(f"{p}ln_f", _readers(head), "final"))
    return Layout("gptj", "parallel", 0, c.n_embd, h, f"{p}wte", (f"{p}wte",), tuple(writers), tuple(norms),
                  head, False, attention=tuple(attention), mlps=tuple(mlps),
                  config_widths=(("intermediate", "n_inner"),))


def falcon(model, p: str, head: str | None) -> Layout:
    """Falcon: sequential blocks (``parallel_attn`` false: ``input_layernorm`` before the attention,
    ``post_attention_layernorm`` before the MLP) or parallel ones, x += attn(n_a(x)) + mlp(n_m(x)),
    with one norm (``input_layernorm``) or, in the new decoder architecture with
    ``num_ln_in_parallel_attn`` 2, two (``ln_attn``, ``ln_mlp``). The fused ``query_key_value``
    reads the attention's norm: per kv head its query heads, k and v ("groups") in the new decoder
    architecture, all q then one k and one v with ``multi_query``, else q, k, v per head. The
    attention reads its own head counts (the rotary width comes from the config's). With ``alibi``
    the blocks are not described: each head's slope follows its index among the config's heads.
    Flag combinations whose stock forward reads norms it never built are refused."""
    c = model.config
    h = f"{p}h"
    two = c.new_decoder_architecture and c.num_ln_in_parallel_attn == 2
    if c.new_decoder_architecture and not c.parallel_attn:
        raise SurgeryError("falcon with new_decoder_architecture and parallel_attn=false is not a model normsurgery "
                           "understands (its stock forward reads norms it never built, or skips one)")
    if c.parallel_attn and not c.new_decoder_architecture and c.num_ln_in_parallel_attn == 2:
        raise SurgeryError("falcon with num_ln_in_parallel_attn=2 needs new_decoder_architecture: its stock forward "
                           "reads input_layernorm, which it never built")
    norms, writers, attention, mlps = [], [], [], []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        qkv, fc = (f"{b}.self_attention.query_key_value",), (f"{b}.mlp.dense_h_to_4h",)
        if not c.parallel_attn:
            norms += [NormSite(f"{b}.input_layernorm", qkv, "attn"),
                      NormSite(f"{b}.post_attention_layernorm", fc, "mlp")]
        elif two:
            norms += [NormSite(f"{b}.ln_attn", qkv, "attn"), NormSite(f"{b}.ln_mlp", fc, "mlp")]
        else:
            norms.append(NormSite(f"{b}.input_layernorm", qkv + fc, "attn+mlp"))
        writers += [f"{b}.self_attention.dense", f"{b}.mlp.dense_4h_to_h"]
        attention.append(_falcon_attention(model, f"{b}.self_attention"))
        mlps.append(MlpSite(fc[0], f"{b}.mlp.dense_4h_to_h", f"{b}.mlp.act"))
    undescribed = "alibi: each head's slope follows its index among the config's heads" if c.alibi else ""
    norms.append(NormSite(f"{p}ln_f", _readers(head), "final"))
    return Layout("falcon", "parallel" if c.parallel_attn else "pre", 0, c.hidden_size, h, f"{p}word_embeddings",
                  (f"{p}word_embeddings",), tuple(writers), tuple(norms), head, False,
                  attention=() if c.alibi else tuple(attention), mlps=() if c.alibi else tuple(mlps),
                  config_widths=(("intermediate", "ffn_hidden_size"),), undescribed=undescribed)


def _falcon_attention(model, path: str) -> AttentionSite:
    """Falcon's fused ``query_key_value``: its order and kv heads from the flags and current shapes."""
    attn = model.get_submodule(path)
    hd = attn.head_dim
    n = in_width(attn.dense) // hd
    if attn.new_decoder_architecture:
        kv, order = (attn.query_key_value.weight.shape[0] // hd - n) // 2, "groups"
    else:
        kv, order = (1, "blocks") if attn.multi_query else (n, "heads")
    return AttentionSite(path, f"{path}.dense", hd, n, kv, qkv=f"{path}.query_key_value", qkv_order=order,
                         count_attrs=(("num_heads", "heads"), ("num_kv_heads", "kv_heads")))


def bert(model, p: str, head: str | None, *,
         attention: tuple[str, str] = ("attention.output.dense", "attention.output.LayerNorm"),
         embeddings: tuple[str, ...] = ("word_embeddings", "position_embeddings", "token_type_embeddings")) -> Layout:
    """BERT: Post-LN blocks, x = LN(x + f(x)), after an embedding LayerNorm; ``attention``: the attention's
    output linear and norm, ``embeddings``: the tables added to the stream."""
    c = model.config
    h = f"{p}encoder.layer"
    norms = [NormSite(f"{p}embeddings.LayerNorm", (), "embed")]
    writers = []
    for i in range(c.num_hidden_layers):
        b = f"{h}.{i}"
        norms += [NormSite(f"{b}.{attention[1]}", (), "post"),
                  NormSite(f"{b}.output.LayerNorm", (), "post")]
        writers += [f"{b}.{attention[0]}", f"{b}.output.dense"]
    emb = f"{p}embeddings"
    # after the blocks: the base model's pooler, the head's module around its output layer (a masked
    # LM's transform, MPNet's classifier dense)
    after = ((f"{p}pooler",) if getattr(model.base_model, "pooler", None) is not None else ()) + \
        ((head.rpartition(".")[0],) if head and "." in head else ())
    return Layout(c.model_type, "post", 0, c.hidden_size, h, f"{emb}.word_embeddings",
                  tuple(f"{emb}.{e}" for e in embeddings), tuple(writers), tuple(norms), head, False, after=after)


def mpnet(model, p: str, head: str | None) -> Layout:
    """MPNet: BERT's blocks, the attention's output linear ``attention.attn.o`` and norm
    ``attention.LayerNorm``, no token types. Its relative position bias
    (``encoder.relative_attention_bias``, a column per head) is the encoder's, shared by every
    block: removing blocks keeps it."""
    return bert(model, p, head, attention=("attention.attn.o", "attention.LayerNorm"),
                embeddings=("word_embeddings", "position_embeddings"))


def _separate_attention(model, path: str, o: str = "o_proj") -> AttentionSite:
    """Attention with separate q/k/v projections and ``num_key_value_groups`` (Llama, Phi, ...)."""
    attn = model.get_submodule(path)
    hd = attn.head_dim
    return AttentionSite(path, f"{path}.{o}", hd, in_width(getattr(attn, o)) // hd,
                         attn.v_proj.weight.shape[0] // hd, f"{path}.q_proj", f"{path}.k_proj",
                         f"{path}.v_proj", count_attrs=(("num_key_value_groups", "groups"),))


def _fused_attention(model, path: str) -> AttentionSite:
    """Phi-3's attention: ``qkv_proj`` stacks the q rows, then k, then v ("blocks"); the kv
    heads are what the rows after the queries hold."""
    attn = model.get_submodule(path)
    hd = attn.head_dim
    n = in_width(attn.o_proj) // hd
    kv = (attn.qkv_proj.weight.shape[0] - n * hd) // (2 * hd)
    return AttentionSite(path, f"{path}.o_proj", hd, n, kv, qkv=f"{path}.qkv_proj", qkv_order="blocks",
                         count_attrs=(("num_key_value_heads", "kv_heads"), ("num_key_value_groups", "groups")))


def _readers(head: str | None) -> tuple[str, ...]:
    """What reads the final norm: the head, or nothing when the norm's output is the model's."""
    return () if head is None else (head,)
