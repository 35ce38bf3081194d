"""export --to gguf, what is written: a checkpoint as one GGUF file for llama.cpp (checked in
llama.cpp by ``gguf``).

What is written (:func:`gguf_plan`, from the Layout of the checkpoint's meta model; nothing is read):
- stock widths: the family's own llama.cpp architecture (``families.Family.gguf``); fewer layers
  are the same architecture with the new ``block_count``;
- per-layer widths (minimize, squeeze: MLP units or heads removed unevenly): ``deci``, which
  builds layer i from ``feed_forward_length[i]``, ``attention.head_count[i]`` and
  ``attention.head_count_kv[i]`` (arrays of n_layer entries) with llama's tensors, RMSNorm and
  SwiGLU;
- LN-free (remove-ln, its norms ``runtime.NoNorm``): the eps trick. GGUF has one norm epsilon;
  with eps = 1e12 and gains g = 1e6, RMSNorm(x) = x g / sqrt(mean(x^2) + 1e12) = x (1 + mean(x^2)
  / 1e12)^(-1/2), which is x to a relative mean(x^2) / 2e12; LayerNorm on a centred stream (the
  fold centred every writer) the same. The gains are stored in F32 (1e6 overflows F16), as
  every 1-D tensor is. remove-ln's ``export=stock`` output already holds eps = 1e12 and gains
  g 1e6 / s: written as it is.
- the tokenizer (byte-level BPE: vocabulary, merges, token types, special tokens, the
  pre-tokenizer llama.cpp knows by name, :data:`PRE_TOKENIZERS`) and the chat template.

llama.cpp's normal RoPE rotates pairs of consecutive values, transformers' rotates the two halves
of each head: for those architectures the q and k rows of each head are permuted (what
convert_hf_to_gguf.py does). What GGUF cannot express is refused, one line, before writing.

Written tensor by tensor (``loader.Loader``: each read from the files when written, then
freed): memory bounded by a tensor.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..core import algebra, devices
from ..io.loader import Loader
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.families import FAMILIES, family, layout
from ..core.layout import Layout
from ..core.runtime import NoNorm

#: the eps trick (module docstring): eps and the gain that make a norm the identity
TRICK_EPS, TRICK_GAIN = 1e12, 1e6


@dataclass(frozen=True)
class Arch:
    """What llama.cpp's architecture computes, as far as writing it needs."""

    rope: str  # "normal" (pairs of consecutive values: q/k rows permuted), "neox" (halves) or "none"
    norm: str  # "rms" or "layer" (with biases)
    per_layer: bool = False  # each layer from its own counts (arrays)
    biases: bool = True  # loads linear biases


ARCHES = {"llama": Arch("normal", "rms"), "qwen2": Arch("neox", "rms"), "gpt2": Arch("none", "layer"),
          "deci": Arch("normal", "rms", per_layer=True, biases=False)}

#: tokenizer.json's pre-tokenizer (with no normalizer) -> llama.cpp's pre-tokenizer of that regex
_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_SPLIT = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}%s| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
         "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
PRE_TOKENIZERS = (
    ("gpt-2", [_GPT2]),
    ("smollm", [{"type": "Digits", "individual_digits": True}, _GPT2]),
    ("qwen2", [{"type": "Split", "pattern": {"Regex": _SPLIT % ""}, "behavior": "Isolated", "invert": False},
               {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]),
    ("llama-bpe", [{"type": "Split", "pattern": {"Regex": _SPLIT % "{1,3}"}, "behavior": "Isolated",
                    "invert": False}, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]),
)


# ----------------------------------------------------------------------------- the plan


@dataclass
class Item:
    """One GGUF tensor: its name, shape ([out, in] for a matrix) and how its float32 values are made."""

    name: str
    shape: tuple[int, ...]
    param: str | None = None  # the model parameter it holds
    make: Callable[[], torch.Tensor] | None = None  # or its values, made here (the eps trick's gains)
    flip: bool = False  # stored [in, out] (GPT-2's Conv1D): transposed
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # reorders rows (q/k for normal RoPE)

    def as_written(self, stored: torch.Tensor) -> torch.Tensor:
        """The parameter's stored values as this tensor holds them."""
        w = stored.T if self.flip else stored
        return (self.rows(w) if self.rows else w).contiguous()


@dataclass
class Plan:
    arch: str
    meta: dict  # metadata: writer method name -> value
    items: list[Item]
    eps_trick: bool
    widths: dict  # per-layer heads, kv heads, MLP units (for the report)


def gguf_plan(source: Source) -> tuple[Plan, object]:
    """The plan of ``source`` and its meta model; a SurgeryError (one line) for what GGUF cannot express."""
    fam = family(source.family)
    if fam.gguf is None:
        raise SurgeryError(f"GGUF: normsurgery writes no llama.cpp architecture for {source.family} "
                           f"(written: {', '.join(sorted(n for n, f in FAMILIES.items() if f.gguf))})")
    model = source.meta_model(torch.float32)
    lay = layout(model)
    _refuse(source, lay)
    if getattr(model.get_submodule(lay.head), "bias", None) is not None:
        raise SurgeryError(f"GGUF cannot express {source.name}: its head has a bias (remove-ln folds the final "
                           "LayerNorm's bias into it), which llama.cpp does not add; remove-ln:export=stock keeps "
                           "it in the norm")
    arch = fam.gguf
    widths = _widths(model, lay)
    if any(len(set(v)) > 1 for v in widths.values()):
        arch = _per_layer(source, model, lay, arch, widths)
    eps, trick = _epsilon(source.name, model, lay, ARCHES[arch])
    meta = _metadata(source, lay, ARCHES[arch], widths, eps)
    items = _items(model, lay, ARCHES[arch])
    return Plan(arch, meta, items, trick, widths), model


def _refuse(source: Source, lay: Layout) -> None:
    """What llama.cpp's architectures do not compute, refused with the reason."""
    c = source.config
    why = None
    if lay.objective != "causal-lm" or lay.head is None:
        why = f"{source.class_name} is no causal LM (llama.cpp's GGUF holds a language model's head)"
    elif not lay.plain_logits:
        why = "its logits are scaled or soft-capped after the head, which llama.cpp's architecture does not do"
    elif lay.stream_width != lay.hidden_size:
        why = (f"its stream holds {lay.stream_width} of {lay.hidden_size} channels (removed channels: its norms "
               "divide by the full width, llama.cpp's by the stored one)")
    elif lay.qk_norms:
        why = f"it has {len(lay.qk_norms)} per-head QK-norms, which the architecture written has not"
    elif getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
        why = f"it attends within a sliding window ({c.sliding_window}), which the architecture written ignores"
    elif (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default") != "default":
        why = f"RoPE scaling {c.rope_parameters['rope_type']!r} is not written (only plain RoPE)"
    elif len(lay.attention) != len(lay.mlps) or not lay.attention:
        why = "its adapter does not describe its attention and MLP blocks"
    if why:
        raise SurgeryError(f"GGUF cannot express {source.name}: {why}")


def _widths(model, lay: Layout) -> dict:
    """Per layer: query heads, key/value heads, MLP units (from the modules' current shapes)."""
    return {"heads": [a.num_heads for a in lay.attention], "kv_heads": [a.num_kv_heads for a in lay.attention],
            "units": [algebra.out_width(model.get_submodule(m.up)) for m in lay.mlps],
            "head_dim": [a.head_dim for a in lay.attention]}


def _per_layer(source: Source, model, lay: Layout, arch: str, widths: dict) -> str:
    """``deci`` for per-layer widths of a RMSNorm / SwiGLU family; refused otherwise."""
    why = None
    if len(set(widths["head_dim"])) > 1:
        why = "its layers' heads differ in width, and GGUF has one key length"
    elif ARCHES[arch].norm != "rms" or lay.mlps[0].gate is None:
        why = "its layers differ in width, and llama.cpp builds per-layer widths only in deci (RMSNorm, SwiGLU)"
    elif not ARCHES["deci"].biases and any(getattr(model.get_submodule(p), "bias", None) is not None
                                           for a in lay.attention for p in (a.q, a.k, a.v, a.qkv, a.o) if p):
        why = "its layers differ in width and its attention has biases, which llama.cpp's deci does not load"
    if why:
        raise SurgeryError(f"GGUF cannot express {source.name}: {why}")
    return "deci"


#: the norm kind (``layout.NORM_KINDS``) each of ``Arch.norm`` computes
NORM_KIND = {"rms": "rmsnorm", "layer": "layernorm"}


def _epsilon(name: str, model, lay: Layout, a: Arch) -> tuple[float, bool]:
    """The one norm epsilon GGUF holds, and whether it is the eps trick (every norm removed)."""
    removed = [isinstance(model.get_submodule(s.path), NoNorm) for s in lay.norms]
    if all(removed):
        return TRICK_EPS, True
    live = [s for s, r in zip(lay.norms, removed) if not r]
    if any(removed):
        raise SurgeryError(f"GGUF cannot express {name}: {live[0].path} computes its norm beside {sum(removed)} "
                           "removed ones, and GGUF has one norm epsilon (the removed ones need 1e12)")
    for s in lay.norms:
        mod = model.get_submodule(s.path)
        if s.kind != NORM_KIND[a.norm] or s.offset != 0.0 or getattr(mod, "divisor", _width(model, s)) != \
                _width(model, s) or (a.norm == "rms" and getattr(mod, "bias", None) is not None):
            raise SurgeryError(f"GGUF cannot express {name}: {s.path} is a {s.kind} norm ({type(mod).__name__}), "
                               f"which llama.cpp's {NORM_KIND[a.norm]} does not compute")
    eps = {s.eps for s in lay.norms}
    if len(eps) != 1:
        raise SurgeryError(f"GGUF cannot express {name}: its norms use {len(eps)} epsilons, and GGUF has one")
    return eps.pop(), False


def _width(model, site) -> int:
    return model.get_submodule(site.path).weight.shape[0]


def _metadata(source: Source, lay: Layout, a: Arch, widths: dict, eps: float) -> dict:
    """The architecture's hyperparameters, as ``GGUFWriter.add_<key>(value)``; per-layer counts as
    arrays of n_layer entries where the architecture reads them so (deci)."""
    c = source.config
    n = len(lay.attention)
    per = (lambda v: [int(x) for x in v]) if a.per_layer else (lambda v: int(v[0]))
    head_dim = widths["head_dim"][0]
    meta = {"context_length": int(source.positions or 2048), "embedding_length": int(lay.hidden_size),
            "block_count": n, "feed_forward_length": per(widths["units"]), "head_count": per(widths["heads"]),
            "head_count_kv": per(widths["kv_heads"]), "vocab_size": int(c.vocab_size)}
    if a.norm == "rms":
        meta["layer_norm_rms_eps"] = float(eps)
    else:
        meta["layer_norm_eps"] = float(eps)
    if a.rope != "none":
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
        meta.update(rope_freq_base=float(theta), rope_dimension_count=int(head_dim))
    if a.per_layer or head_dim * widths["heads"][0] != lay.hidden_size:
        meta.update(key_length=int(head_dim), value_length=int(head_dim))
    return meta


def _items(model, lay: Layout, a: Arch) -> list[Item]:
    """Every tensor to write, in llama.cpp's names, each reading its values when written."""
    items = [_item(model, "token_embd", lay.token_embedding, "weight")]
    items += [_item(model, "position_embd", p, "weight") for p in lay.embeddings if p != lay.token_embedding]
    norms = {s.role: [] for s in lay.norms}
    for s in lay.norms:
        norms[s.role].append(s)
    for i, (att, mlp) in enumerate(zip(lay.attention, lay.mlps)):
        blk = f"blk.{i}"
        items += _norm(model, f"{blk}.attn_norm", norms["attn"][i].path, a)
        if att.qkv:
            items += _linear(model, f"{blk}.attn_qkv", att.qkv)
        else:
            items += _linear(model, f"{blk}.attn_q", att.q, _rope_rows(a, att.num_heads))
            items += _linear(model, f"{blk}.attn_k", att.k, _rope_rows(a, att.num_kv_heads))
            items += _linear(model, f"{blk}.attn_v", att.v)
        items += _linear(model, f"{blk}.attn_output", att.o)
        items += _norm(model, f"{blk}.ffn_norm", norms["mlp"][i].path, a)
        if mlp.gate:
            items += _linear(model, f"{blk}.ffn_gate", mlp.gate)
        items += _linear(model, f"{blk}.ffn_up", mlp.up)
        items += _linear(model, f"{blk}.ffn_down", mlp.down)
    items += _norm(model, "output_norm", norms["final"][0].path, a)
    if not lay.tied:
        items += _linear(model, "output", lay.head)
    return items


def _item(model, name: str, path: str, attr: str, rows=None) -> Item:
    """The parameter ``path.attr`` as ``name.attr``, [out, in] for a linear's weight."""
    mod = model.get_submodule(path)
    p = getattr(mod, attr)
    flip = attr == "weight" and algebra.written_axis(mod) == 1 and algebra.is_linear(mod)
    shape = tuple(reversed(p.shape)) if flip else tuple(p.shape)
    return Item(f"{name}.{attr}", shape, param=f"{path}.{attr}", flip=flip, rows=rows)


def _linear(model, name: str, path: str, rows=None) -> list[Item]:
    mod = model.get_submodule(path)
    out = [_item(model, name, path, "weight", rows)]
    if getattr(mod, "bias", None) is not None:
        out.append(_item(model, name, path, "bias", rows))
    return out


def _norm(model, name: str, path: str, a: Arch) -> list[Item]:
    """A norm's gain (and LayerNorm's bias); a removed norm (NoNorm) gets the eps trick's gain
    TRICK_GAIN and a zero bias."""
    mod = model.get_submodule(path)
    if isinstance(mod, NoNorm):
        gain = [Item(f"{name}.weight", (mod.dim,), make=lambda d=mod.dim: torch.full((d,), TRICK_GAIN))]
        return gain + ([Item(f"{name}.bias", (mod.dim,), make=lambda d=mod.dim: torch.zeros(d))]
                       if a.norm == "layer" else [])
    out = [_item(model, name, path, "weight")]
    if getattr(mod, "bias", None) is not None:
        out.append(_item(model, name, path, "bias"))
    return out


def _rope_rows(a: Arch, heads: int):
    """Normal RoPE: each head's rows from transformers' (first half, second half) order to pairs."""
    if a.rope != "normal":
        return None
    return lambda w: permute(w, heads)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered (h, 2, d/2) -> (h, d/2, 2): row j of the first half and row j of
    the second become rows 2j and 2j + 1 (convert_hf_to_gguf.py's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- storage types


def qtype(dtype: str, shape: tuple[int, ...]):
    """The GGML type a tensor is stored in: 1-D tensors (norms, biases) F32; matrices in ``dtype``
    (Q8_0 needs rows of whole 32-value blocks: F16 otherwise)."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2 or dtype == "f32":
        return Q.F32
    if dtype == "q8_0" and shape[-1] % 32:
        return Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[dtype]


#: entries encoded or rounded at a time (a matrix a block of rows at a time): numpy's temporaries stay
#: a few times 4 MB instead of a few times the tensor (a 32000 x 2048 embedding in float32: 262 MB)
CHUNK = 1 << 20


def _chunks(rows: int, width: int):
    step = max(1, CHUNK // max(width, 1))
    return ((i, min(i + step, rows)) for i in range(0, rows, step))


def _encode_rows(x: np.ndarray, q) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if q == Q.F32:
        return x
    if q == Q.F16:
        return x.astype(np.float16)
    return quants.quantize(x, q)


def encode(values: torch.Tensor, q) -> np.ndarray:
    """float32 values as stored in GGML type ``q`` (a matrix: [rows, bytes or entries of a row]),
    encoded a block of rows at a time."""
    x = values.detach().to(devices.HOST, torch.float32).contiguous().numpy()  # host
    if x.ndim < 2:
        return _encode_rows(x, q)
    rows = x.reshape(-1, x.shape[-1])
    out = None
    for i, j in _chunks(*rows.shape):
        part = _encode_rows(rows[i:j], q)
        if out is None:
            out = np.empty((rows.shape[0], *part.shape[1:]), part.dtype)
        out[i:j] = part
    return out


def rounded(values: torch.Tensor, q, out: torch.Tensor | None = None) -> torch.Tensor:
    """``values`` as llama.cpp reads them back after :func:`encode` (float32), a block of rows at
    a time, into ``out`` (``values`` itself will do: rounded in place; default: a new tensor)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    out = torch.empty(values.shape, dtype=torch.float32) if out is None else out
    width = values.shape[-1] if values.dim() else 1
    src, dst = values.reshape(-1, width), out.view(-1, width) if out.is_contiguous() else out
    half = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(q)  # torch rounds to nearest even, as ggml
    for i, j in _chunks(src.shape[0], width):
        if half is not None or q == Q.F32:
            dst[i:j].copy_(src[i:j].detach().to(half or torch.float32))
            continue
        x = src[i:j].detach().to(devices.HOST, torch.float32).numpy()  # host
        dst[i:j].copy_(torch.from_numpy(quants.dequantize(_encode_rows(x, q), q).astype(np.float32).reshape(x.shape)))
    return out


FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's LlamaFileType ("mostly", 1-D in F32)


# ----------------------------------------------------------------------------- the tokenizer


@dataclass
class Vocab:
    """The tokenizer as llama.cpp reads it (``gpt2``: byte-level BPE)."""

    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[str]
    types: list[int]  # gguf.TokenType per token
    special: object  # gguf.SpecialVocab: merges, special token ids, add_bos/add_eos, chat template


def vocab(source: Source) -> Vocab:
    """The checkpoint's tokenizer, refused (one line) where llama.cpp would tokenize differently:
    only a byte-level BPE ``tokenizer.json`` without a normalizer, whose pre-tokenizer is one of
    :data:`PRE_TOKENIZERS`. Tokens in id order (ids the vocabulary lacks: ``[PADi]``, unused);
    added tokens are control tokens when special, user-defined otherwise (convert_hf_to_gguf.py's
    ``get_vocab_base``)."""
    import gguf

    tok = source.tokenizer
    path = source.path / "tokenizer.json"
    if tok is None or not path.is_file():
        raise SurgeryError(f"GGUF: {source.name} has no tokenizer.json (llama.cpp's GGUF holds the tokenizer)")
    spec = json.loads(path.read_text())
    kind = (spec.get("model") or {}).get("type")
    if kind != "BPE" or spec.get("normalizer") is not None or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise SurgeryError(f"GGUF: the tokenizer is {kind or 'unknown'} with normalizer "
                           f"{(spec.get('normalizer') or {}).get('type')}; normsurgery writes byte-level BPE "
                           "tokenizers only (as llama.cpp's gpt2 tokenizer model reads them)")
    pre = pre_tokenizer(spec.get("pre_tokenizer"))
    n = int(source.config.vocab_size)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = {i: a for i, a in tok.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    special = gguf.SpecialVocab(source.path, load_merges=True, n_vocab=n)
    probe = tok("a")["input_ids"]  # what transformers adds around a text, as llama.cpp must
    special.add_special_token = {"bos": bool(probe) and probe[0] == tok.bos_token_id and tok.bos_token_id is not None
                                 and probe[:1] != tok("a", add_special_tokens=False)["input_ids"][:1],
                                 "eos": bool(probe) and probe[-1] == tok.eos_token_id and len(probe) > 1}
    return Vocab(pre, tokens, [int(t) for t in types], special)


def pre_tokenizer(spec: dict | None) -> str:
    """llama.cpp's name for the pre-tokenizer ``spec`` (tokenizer.json's), compared by the fields
    that decide the split; refused with the reason when it knows none."""
    steps = (spec or {}).get("pretokenizers") if (spec or {}).get("type") == "Sequence" else [spec]
    for name, known in PRE_TOKENIZERS:
        if steps and len(steps) == len(known) and all(
                s and all(s.get(k) == v for k, v in want.items()) for s, want in zip(steps, known)):
            return name
    raise SurgeryError(f"GGUF: llama.cpp has no pre-tokenizer known to match this tokenizer's "
                       f"({json.dumps(spec)[:120]}); normsurgery knows {', '.join(n for n, _ in PRE_TOKENIZERS)}")


# ----------------------------------------------------------------------------- writing


def write(source: Source, model, p: Plan, voc: Vocab, path: Path, dtype: str,
          change: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> int:
    """``p`` and ``voc`` written to ``path`` in ``dtype``: metadata and tensor infos first, then each
    tensor read from the checkpoint, transformed, encoded and written before the next is read.
    ``change(name, values)``: a last change to a tensor's values (the tests' wrong weight).
    Returns the bytes written."""
    import gguf

    w = gguf.GGUFWriter(path, p.arch)
    w.add_name(source.path.name)
    w.add_file_type(FILE_TYPES[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in p.meta.items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(voc.pre)
    w.add_token_list(voc.tokens)
    w.add_token_types(voc.types)
    voc.special.add_to_gguf(w, quiet=True)
    types = [qtype(dtype, it.shape) for it in p.items]
    for it, q in zip(p.items, types):
        block, size = gguf.GGML_QUANT_SIZES[q]
        w.add_tensor_info(it.name, gguf.quant_shape_to_byte_shape(it.shape, q), np.dtype(np.uint8),
                          math.prod(it.shape) // block * size, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with reading(source, model) as read:
        for it, q in zip(p.items, types):
            values = it.make() if it.make else it.as_written(read(it.param))
            if change is not None:
                values = change(it.name, values)
            w.write_tensor_data(encode(values, q))
            del values
    w.close()
    return path.stat().st_size


@contextmanager
def reading(source: Source, model):
    """``read(param)``: one parameter of the meta ``model`` read from the checkpoint's files in
    float32 (a fresh tensor each time: memory bounded by one)."""
    loader = Loader(model, source, torch.float32, devices.HOST)  # host values, written into the file
    try:
        def read(name: str) -> torch.Tensor:
            p = model.get_parameter(name)
            out = torch.empty(p.shape, dtype=torch.float32)
            return loader.stored(p).read_into(loader.reader, out)

        yield read
    finally:
        loader.close()
