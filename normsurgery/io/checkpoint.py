"""Checkpoints in: a folder (or a cached hub id) resolved once into a :class:`Source`, and its
tensors read into a model one part at a time by a :class:`Loader`.

A :class:`Source` holds every fact later steps need, found once: the folder, its config, its
weight files with their parsed headers, the dtype the weights are stored in, the family and the
class (head) the config names, and the tokenizer. Every later step takes it, never a path.

A model is built on the meta device from the config (:meth:`Source.meta_model`: no memory for
weights) with the class its ``architectures`` names (causal or masked LM, base model, sequence or
token classifier: ``families.FAMILIES``), or its normsurgery subclass when the config records
rebuilt modules; a sentence-transformers checkpoint whose config names the masked LM its encoder
was pretrained as while its file holds the base model alone is read as that base class, as
sentence-transformers reads it, with a note (:func:`_base_when_headless`). The :class:`Loader`
maps each parameter to its tensor in the files the way ``from_pretrained`` does (its key
renamings, the base model's prefix added or removed, a mixture's experts stored one tensor each
merged into the stacked parameter: :class:`Stored`), reads a part's parameters (all of them: the
whole model, one part) cast to a working dtype, and frees them again. A missing weight is an error
naming it (transformers would initialise it at random and only log it); so are a mis-shaped one,
NaN or Inf weights, and a tensor of a module the class has not (a head, another base model: the
config names the wrong class). A buffer older transformers saved (BERT's
``embeddings.position_ids``, a rotary ``inv_freq`` per layer) is skipped as ``from_pretrained``
skips it; any other unexpected tensor is left unread, as ``from_pretrained`` leaves it, with a
:class:`~normsurgery.core.errors.SurgeryWarning` naming it (the CLI: one ``warning:`` line).

A rewritten model whose modules differ from its stock architecture is saved with a list of
module records in ``config.normsurgery["modules"]``, the runtime copied beside the weights as
``modeling_normsurgery.py`` and an ``auto_map`` naming it (:func:`stamp`, :func:`finish`), so
``from_pretrained(..., trust_remote_code=True)`` rebuilds it with only transformers installed.
Records marked ``stock_equivalent`` compute the same function as the stock module on this model
(an RMSNorm on a zero-mean stream is a LayerNorm): plain ``from_pretrained`` may then load it,
which is claimed only once the written folder, loaded with the stock class, gave the same outputs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.initialization import no_init_weights

from ..core import devices, memory, runtime
from ..core.errors import SurgeryError, SurgeryNote, SurgeryWarning
from ..core.families import AUTO_CLASS, Head, class_name, family, head_of, positions, stock_class_name, stock_class_of, stock_objective
from .output import WEIGHT_SUFFIXES, copied_folders
from .shards import Index, Reader, inside

RUNTIME_FILE = "modeling_normsurgery.py"
NOT_COPIED = {"config.json", RUNTIME_FILE}
#: historic buffers: names old checkpoints store that no current module has, so the general rule
#: (the model's own buffers, :func:`_stale`) cannot cover them. Only GPT-2's attention constant
#: ``attn.masked_bias`` (GPT-J's, GPT-NeoX's ``attention.masked_bias`` too), which transformers dropped
HISTORIC_BUFFERS = (".masked_bias",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def resolve(src: str | os.PathLike) -> Path:
    """A checkpoint folder: ``src`` itself, or the snapshot of a hub id in the local cache."""
    path = Path(src).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SurgeryError(f"{src} is not a checkpoint folder: it has no config.json")
        return path
    if path.exists():
        raise SurgeryError(f"{src} is a file; give the checkpoint's folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(src), local_files_only=True))
    except Exception:
        if _looks_local(src) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(src)):  # not owner/name
            raise SurgeryError(f"no checkpoint at {src!r}: no such folder") from None
        raise SurgeryError(f"no checkpoint at {src!r}: not a folder, and not a hub id in the local Hugging Face "
                           "cache (normsurgery reads local files only and never downloads, as if offline): "
                           f"download it first, e.g. `hf download {src} --local-dir DIR`, and pass DIR") from None


def _looks_local(src) -> bool:
    """``src`` names a local path, not a hub id: it starts with ``./``, ``../``, ``/`` or ``~``,
    or it has a folder part that exists (``models/nope`` beside ``models/``)."""
    text = str(src)
    return text.startswith(("./", "../", "/", "~")) or (os.sep in text and Path(text).expanduser().parent.is_dir())


def weight_files(path: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files: an index's shards (which must exist), or the safetensors files, or, when
    ``allow_pickle``, the pickle ones (which can run code when loaded otherwise)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SurgeryError(f"{index} is not a valid safetensors index ({e})") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SurgeryError(f"{path}: the index names missing shards: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise SurgeryError(f"{path} holds no weights (no *.safetensors or pytorch_model*.bin)")
    if files[0].suffix == ".bin" and not allow_pickle:
        raise SurgeryError(f"{path} stores its weights as pickle ({files[0].name}), which can run code when "
                           "loaded: convert it to safetensors, or pass --allow-pickle to load it with "
                           "torch.load(weights_only=True)")
    return files


def load_config(path: Path, any_family: bool = False):
    """The config, of a family and class normsurgery handles (else a SurgeryError saying so;
    ``any_family``: also of a family without an adapter whose stock class ``verify`` can run,
    ``families.stock_class_name``). A checkpoint that needs the runtime names its family
    ``normsurgery_<family>`` (see :func:`save_config`): read with the stock family's config class."""
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SurgeryError(f"cannot read {file}: {_first_line(e)}") from None
    kind = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(kind, str):
        raise SurgeryError(f"{file} is not a model config: " + ("it has no model_type" if isinstance(data, dict)
                           else f"it holds a JSON {type(data).__name__}, not an object"))
    stock = runtime.stock_model_type(kind)
    if (stock or kind) not in transformers.CONFIG_MAPPING:
        raise SurgeryError(f"{file}: model type {kind!r} is not one transformers {transformers.__version__} knows")
    try:
        if stock is None:
            cfg = transformers.AutoConfig.from_pretrained(path)
        else:
            data["model_type"] = stock
            data["auto_map"] = {k: v for k, v in data.get("auto_map", {}).items() if k != "AutoConfig"}
            cfg = transformers.CONFIG_MAPPING[stock].from_dict(data)
    except Exception as e:
        raise SurgeryError(f"cannot read {file}: {_first_line(e)}") from None
    (stock_class_name if any_family else class_name)(cfg)
    return cfg


def config_refusal(config, **changes) -> str | None:
    """Why ``config``'s class would refuse it with ``changes`` set (transformers' strict configs
    check their values, e.g. hidden_size a multiple of the head count, on saving and on loading),
    None where it accepts them or checks nothing. ``config`` itself is left as it is."""
    if getattr(config, "validate", None) is None:
        return None
    trial = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(trial, key, value)
    try:
        trial.validate()
    except Exception as e:  # huggingface_hub's StrictDataclassClassValidationError, ValueError, ...
        return " ".join(str(e.__cause__ or e).split())
    return None


def save_config(config, folder: Path) -> None:
    """``config.json``. A checkpoint whose recorded modules do not all compute the stock function
    names its family ``normsurgery_<family>``, which stock transformers does not know, and maps
    ``AutoConfig`` to the runtime: a plain ``from_pretrained`` then fails loudly (asking for
    ``trust_remote_code=True``) instead of loading the stock class with weights missing or
    ignored, and ``trust_remote_code=True`` or :func:`load` load it."""
    config.save_pretrained(folder)
    file = folder / "config.json"
    data = legacy_keys(json.loads(file.read_text()))
    modules = (getattr(config, "normsurgery", None) or {}).get("modules") or []
    if not all(r.get("stock_equivalent") for r in modules):
        data["model_type"] = runtime.RUNTIME_TYPE + data["model_type"]
        data.setdefault("auto_map", {})["AutoConfig"] = f"{RUNTIME_FILE[:-3]}.NormSurgery{type(config).__name__}"
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def legacy_keys(data: dict) -> dict:
    """``data`` (a config.json) with the RoPE keys that runtimes reading the keys before
    transformers 5 look for at the top level, from transformers 5's one ``rope_parameters`` dict
    (not nested per layer type): ``rope_theta`` (MLX-LM builds RoPE with base 10000 without it),
    ``partial_rotary_factor``, and ``rope_scaling`` (a copy of ``rope_parameters``, which
    transformers reads first) where the RoPE type is not the default. Read back, transformers
    builds the same config."""
    rope = data.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return data
    data["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        data["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if rope.get("rope_type", "default") != "default":
        data["rope_scaling"] = dict(rope)
    return data


def write_config(model, folder: Path, dtype: torch.dtype) -> None:
    """config.json (stating ``dtype``, what the weights load as; :func:`save_config`) and, for a
    model that generates, generation_config.json."""
    model.config.dtype = dtype
    save_config(model.config, folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)


def widest(dtypes) -> torch.dtype:
    """The floating dtype that holds every value of ``dtypes`` (float32 for float16 with bfloat16)."""
    dtypes = set(dtypes)
    best = max(dtypes, key=lambda d: torch.finfo(d).bits)
    return best if len(dtypes) == 1 or torch.finfo(best).bits > 16 else torch.float32


def load_dtype(model) -> torch.dtype:
    """The dtype ``model`` loads back in: its parameters' (the widest when mixed)."""
    return widest({p.dtype for p in model.parameters() if p.is_floating_point()})


@dataclass
class Source:
    """A checkpoint, resolved once (see the module docstring)."""

    name: str  # as the user gave it, for messages
    path: Path
    config: object
    index: Index
    allow_pickle: bool = False

    @classmethod
    def open(cls, src, allow_pickle: bool = False, any_family: bool = False) -> Source:
        """``src`` (a folder, a cached hub id, or a Source) resolved and checked (``any_family``:
        a family without an adapter too, whose stock class ``verify`` runs: :func:`load_config`)."""
        if isinstance(src, Source):
            return src
        path = resolve(src)
        config = load_config(path, any_family)
        source = cls(str(src), path, config, Index(weight_files(path, allow_pickle)), allow_pickle)
        _base_when_headless(source)
        return source

    @property
    def family(self) -> str:
        return self.config.model_type

    @property
    def class_name(self) -> str:
        return stock_class_name(self.config)

    @property
    def head(self) -> Head:
        return family(self.family).classes[self.class_name]

    @property
    def head_output(self) -> str:
        """What the class outputs: "logits" for a head, "last hidden state" for a base model."""
        return "logits" if self.head.path is not None else "last hidden state"

    @cached_property
    def storage(self) -> torch.dtype:
        """The floating dtype the weights are stored in. Mixed dtypes (tensors kept in float32
        beside float16 ones, ``precision``): the config's dtype when it is one of them, as
        ``from_pretrained`` would load it, else the widest, which holds every tensor exactly."""
        stored = self.index.floating_dtypes()
        dt = getattr(self.config, "dtype", None) or torch.float32
        dt = getattr(torch, dt) if isinstance(dt, str) else dt
        if len(stored) == 1 or (stored and dt not in stored):
            return widest(stored)
        return dt

    @cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer, or None when it has none."""
        if not any((self.path / f).is_file() for f in TOKENIZER_FILES):
            return None
        try:
            return transformers.AutoTokenizer.from_pretrained(self.path, trust_remote_code=False)  # never a prompt
        except Exception:
            return None

    @property
    def positions(self) -> int | None:
        """The longest sequence the model's positions allow (None: no limit known)."""
        return positions(self.config)

    def model_class(self, stock: bool = False):
        """The stock class the config names, or (unless ``stock``) its normsurgery subclass when
        the config records rebuilt modules."""
        base = getattr(transformers, self.class_name)
        if not stock and (getattr(self.config, "normsurgery", None) or {}).get("modules"):
            return getattr(runtime, "NormSurgery" + base.__name__)
        return base

    def meta_model(self, dtype: torch.dtype, stock: bool = False):
        """The model (rebuilt modules included unless ``stock``) with its parameters on the meta
        device; buffers (rotary frequencies) are real. Eval mode."""
        return _meta(self.model_class(stock), self.config, dtype)


def _meta(cls, config, dtype: torch.dtype):
    """A ``cls`` built from ``config`` with its parameters on the meta device (:meth:`Source.meta_model`)."""
    from accelerate import init_empty_weights

    cfg = copy.deepcopy(config)
    if dtype == torch.float64:  # mixtures of experts: the default grouped_mm takes no float64
        cfg._experts_implementation = "eager"
    with init_empty_weights(), no_init_weights():  # initialising meta tensors costs 0.7 s on GPT-2
        model = cls._from_config(cfg, dtype=dtype)
    model.tie_weights()  # as from_pretrained does: a tied head is the embedding's parameter
    return model.eval()


def _base_when_headless(source: Source) -> None:
    """A sentence-transformers checkpoint loaded as sentence-transformers loads it. Their files hold
    the base model (a pooler included) while the config keeps the class the encoder was pretrained
    as (all-mpnet-base-v2: ``MPNetForMaskedLM``), and sentence-transformers reads them with
    ``AutoModel``, the family's base class. When the config names a masked LM (or the folder is a
    sentence-transformers model, ``modules.json``), the files hold none of its head's own weights
    and every weight of the base class, ``source`` is read as that base class (its config's
    ``architectures`` say so, and a rewrite saves it as that class: the head is not there), with a
    :class:`~normsurgery.core.errors.SurgeryNote` saying so. A head partly stored, or a base model with
    weights missing, is left to the :class:`Loader`'s errors."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    named, base = source.class_name, MODEL_MAPPING_NAMES.get(source.family)
    if not isinstance(base, str) or base == named or not hasattr(transformers, base) or not (
            stock_objective(named) == "masked-lm" or (source.path / "modules.json").is_file()):
        return
    model = _meta(getattr(transformers, named), source.config, torch.float32)
    missing = _unstored(model, _model_keys(model, source))
    inner = {id(p) for p in model.base_model.parameters()}
    head = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in inner}
    if not missing or set(missing) != head:
        return
    config = copy.deepcopy(source.config)
    config.architectures = [base]
    model = _meta(getattr(transformers, base), config, torch.float32)
    if _unstored(model, _model_keys(model, source)):
        return
    source.config.architectures = [base]
    warnings.warn(f"{source.name}: the file holds the base model without {named}'s head: loaded as {base}, as "
                  "sentence-transformers does", SurgeryNote, stacklevel=3)


def load(src, dtype: torch.dtype | None = None, *, stock: bool = False, allow_pickle: bool = False,
         device: torch.device | str = "cpu"):
    """Load a checkpoint (a path, cached hub id or :class:`Source`; rewritten or stock) whole, with
    the class its ``architectures`` names, in ``dtype`` (default: its storage dtype), on ``device``,
    eval mode. ``stock``: with the plain stock class, as ``from_pretrained`` without normsurgery would."""
    source = Source.open(src, allow_pickle)
    dtype = dtype or source.storage
    model = source.meta_model(dtype, stock)
    loader = Loader(model, source, dtype, device)
    loader.load(())
    loader.close()
    return model


class Loader:
    """Puts the parameters of a part of ``model`` (a meta model of ``source``) on it, read from the
    files and cast to ``dtype`` (floats), and frees them again.

    Each parameter's tensors are found once, by the names the model has then
    (``from_pretrained``'s renamings and merges; the base model's prefix added or removed), and
    follow the parameter object through loading and freeing, so modules may be moved or
    renumbered afterwards (``prune_model``) and still read the right tensors. Persistent buffers
    stored in the files are read too. Working tensors a freed part gives back are reused by the
    next part of the same shapes (first touching fresh pages costs more than the arithmetic: a 46
    MB float32 tensor, 28 ms fresh, 4 ms reused).

    ``device`` (``devices``): where the part's tensors go; another than the CPU, each tensor is
    read into a host buffer (reused by the next tensor of its shape) and copied there."""

    def __init__(self, model, source: Source, dtype: torch.dtype, device: torch.device | str):
        self.model, self.source, self.dtype = model, source, dtype
        self.device = torch.device(device)
        devices.place_buffers(model, self.device)
        self.reader = Reader(source.index)
        self.keys: dict[int, tuple[weakref.ref, Stored]] = {}  # id(parameter) -> (the parameter, its tensors)
        self.buffers: dict[str, Stored] = {}  # buffer name -> its tensors
        self.spare: dict[tuple, list[torch.Tensor]] = {}  # freed tensors by (shape, dtype), for reuse
        names = _model_keys(model, source)
        used = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            stored = names.get(name)
            if stored is not None and id(p) not in self.keys:
                self.keys[id(p)] = (weakref.ref(p), stored)
                used.update(stored.keys)
        missing = _unstored(model, names)
        persistent = set(model.state_dict())
        for name, _ in model.named_buffers():
            if name in persistent and names.get(name) is not None:
                self.buffers[name] = names[name]
                used.update(names[name].keys)
        renamed = {k: n for n, s in names.items() for k in s.keys}
        unexpected = sorted(k for k in source.index.keys() if k not in used and not _stale(k, renamed.get(k, k), model))
        foreign = [k for k in unexpected if _outside(renamed.get(k, k), model)]
        shapes = sorted(s.label for p, s in self._entries() if tuple(p.shape) != s.shape(source.index))
        cls = type(model).__name__.removeprefix("NormSurgery")
        problems = []
        if missing:
            problems.append(f"missing {_few(missing)} (transformers would fill them at random)")
        if shapes:
            problems.append(f"mis-shaped {_few(shapes)}")
        if foreign:
            tops = sorted({_top(renamed.get(k, k), model) for k in foreign})
            problems.append(f"unexpected {_few(foreign)} ({cls} has no module {', '.join(tops)}: the checkpoint "
                            f"was saved by another class, with a head or base model that the {cls} its config "
                            "names has not)")
        kept = (getattr(source.config, "normsurgery", None) or {}).get("kept_float32") or ()
        if kept and dtype.is_floating_point and torch.finfo(dtype).bits < 32:
            more = f" (and {len(kept) - 1} more)" if len(kept) > 1 else ""
            raise SurgeryError(f"{source.name}: {kept[0]}{more} overflow {dtype}: convert kept them in float32 "
                               "(--on-overflow keep-float32); load the checkpoint in float32")
        if problems:
            raise SurgeryError(f"cannot load {source.name} as {cls}: weights {'; '.join(problems)}")
        if unexpected:  # transformers loads past them and reports them; so do we
            warnings.warn(f"{source.name}: weights unexpected {_few(unexpected)}: no module of {cls} reads them; "
                          "loaded without them, as transformers loads it", SurgeryWarning, stacklevel=2)

    def _entries(self):
        for ref, key in self.keys.values():
            p = ref()
            if p is not None:
                yield p, key

    def stored(self, p) -> Stored | None:
        entry = self.keys.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def uses(self, scope):
        """Distinct parameters inside ``scope`` (() : all): (parameter, [(module, attribute, full name)])."""
        uses = {}
        for path, mod in self.model.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None:
                    uses.setdefault(id(p), (p, []))[1].append((mod, attr, f"{path}.{attr}" if path else attr))
        return [(p, u) for p, u in uses.values() if not scope or any(inside(full, scope) for *_, full in u)]

    def _replace(self, old, new, uses) -> None:
        stored = self.stored(old)
        self.keys.pop(id(old), None)
        if stored is not None:
            self.keys[id(new)] = (weakref.ref(new), stored)
        for mod, attr, _ in uses:
            mod._parameters[attr] = new

    def load(self, scope: tuple[str, ...], unread: frozenset[int] = frozenset()) -> None:
        """Read the parameters (and stored buffers) of ``scope`` (() : the whole model), floats cast
        to the working dtype, into the tensors the last :meth:`free` gave back where shapes agree;
        the rest of those go back to the system first. Parameters whose ids are in ``unread`` stay
        on the meta device."""
        todo = []
        for p, uses in self.uses(scope):
            if p.device.type != "meta" or id(p) in unread:
                continue
            stored = self.stored(p)
            if stored is None:
                raise SurgeryError(f"{uses[0][2]} has no tensor in {self.source.name}")
            shape, dtype = stored.shape(self.source.index), self.source.index[stored.keys[0]].dtype
            dtype = self.dtype if dtype.is_floating_point else dtype
            spare = self.spare.get((shape, dtype))
            todo.append((p, uses, stored, spare.pop(0) if spare else None, shape, dtype))
        self.spare.clear()
        staging: dict[tuple, torch.Tensor] = {}  # another device: one host buffer per shape
        for p, uses, stored, out, shape, dtype in todo:
            if self.device.type != "cpu":
                out = staging.get((shape, dtype))
            out = stored.read_into(self.reader, torch.empty(shape, dtype=dtype) if out is None else out)
            check_finite(out, stored.label, self.source)
            if self.device.type != "cpu":
                staging[(shape, dtype)] = out
                out = out.to(self.device)
            self._replace(p, nn.Parameter(out, requires_grad=p.requires_grad), uses)
        for name, stored in self.buffers.items():
            if not scope or inside(name, scope):
                buf = self.model.get_buffer(name)
                buf.copy_(stored.read_into(self.reader, torch.empty(stored.shape(self.source.index),
                                                                     dtype=buf.dtype)))

    def free(self, scope: tuple[str, ...]) -> None:
        """Put ``scope``'s parameters back on the meta device. A tensor nothing else holds (no
        view of it is alive) is kept for the next :meth:`load`."""
        for p, uses in self.uses(scope):
            if p.device.type == "cpu" and memory.owned(p):
                self.spare.setdefault((tuple(p.shape), p.dtype), []).append(p.detach())
            self._replace(p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad), uses)
        memory.trim()

    def close(self) -> None:
        """Give the tensors kept for reuse back to the system and close the files (no part follows)."""
        self.spare.clear()
        self.reader.close()
        memory.trim()


@dataclass(frozen=True)
class Stored:
    """Where one tensor of the model lies in the files: one key (``groups == ((key,),)``), or the
    tensors ``from_pretrained`` merges into it (a mixture of experts stored one tensor per expert):
    for each stored pattern (Mixtral's ``w1`` then ``w3``) its experts' keys in order, stacked
    along ``stack``, the stacks concatenated along ``cat`` (transformers' ``MergeModulelist`` then
    ``Concatenate``): ``W[e, :I] = w1_e, W[e, I:] = w3_e`` for a ``gate_up_proj`` [E, 2I, D]."""

    groups: tuple[tuple[str, ...], ...]
    stack: int | None = None
    cat: int = 0

    @property
    def keys(self) -> list[str]:
        return [k for g in self.groups for k in g]

    @property
    def label(self) -> str:
        """For messages: the key, or the first and last of those merged."""
        keys = self.keys
        return keys[0] if self.stack is None else f"{keys[0]} .. {keys[-1]} (merged)"

    def _pieces(self, index: Index) -> list[tuple[str, int, int, int, tuple[int, ...]]] | None:
        """(key, expert, offset along ``cat``, size along it, shape) of each tensor merged; None
        when their shapes do not merge."""
        pieces, offset, rest = [], 0, None
        for group in self.groups:
            shapes = {index[k].shape for k in group}
            if len(shapes) != 1:
                return None
            shape = list(shapes.pop())
            shape.insert(self.stack, len(group))
            size = shape[self.cat]
            shape[self.cat] = None
            if rest not in (None, shape):
                return None
            rest = shape
            pieces += [(k, e, offset, size, index[k].shape) for e, k in enumerate(group)]
            offset += size
        return pieces

    def shape(self, index: Index) -> tuple[int, ...] | None:
        """The tensor's shape (None: the stored tensors do not merge)."""
        if self.stack is None:
            return index[self.keys[0]].shape
        pieces = self._pieces(index)
        if pieces is None:
            return None
        shape = list(pieces[0][4])
        shape.insert(self.stack, len(self.groups[0]))
        shape[self.cat] = pieces[-1][2] + pieces[-1][3]
        return tuple(shape)

    def read_into(self, reader: Reader, out: torch.Tensor) -> torch.Tensor:
        """The values into ``out`` (this shape), each stored tensor read straight into its slice."""
        if self.stack is None:
            return reader.read_into(self.keys[0], out)
        for key, expert, offset, size, _ in self._pieces(reader.index):
            view = out.narrow(self.cat, offset, size).select(self.stack, expert)
            if view.is_contiguous():
                reader.read_into(key, view)
            else:
                view.copy_(reader.read(key, out.dtype))
        return out


def _model_keys(model, source: Source) -> dict[str, Stored]:
    """{model state-dict name: its tensors in the files}, renamed as ``from_pretrained`` renames,
    and merged as it merges them (:class:`Stored`): the experts of a mixture stored one tensor
    per expert, in the order of their numbers, which must run 0, 1, ... with none missing."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (Concatenate, MergeModulelist, WeightConverter, WeightRenaming,
                                                 rename_source_key)

    conversions = get_model_conversion_mapping(model, add_legacy=True)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = {p: c for c in conversions if isinstance(c, WeightConverter) for p in c.source_patterns}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    names, merged = {}, defaultdict(lambda: defaultdict(list))  # name -> source pattern -> [(expert, key)]
    for key in source.index.keys():
        name, pattern = rename_source_key(key, renamings, list(dict.fromkeys(converters.values())), prefix, meta)
        if pattern is None:
            names.setdefault(name, Stored(((key,),)))
            continue
        ops = converters[pattern].operations
        kinds = [type(op) for op in ops]
        if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]) or (
                len(ops) == 1 and len(converters[pattern].source_patterns) > 1):
            raise SurgeryError(f"{source.name}: {key} is stored in a layout transformers converts when loading "
                               f"({pattern} -> {name} by {', '.join(k.__name__ for k in kinds)}), which normsurgery "
                               "does not read")
        number = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        merged[name][pattern].append((int(number.group(1)) if number else -1, key))
    for name, groups in merged.items():
        if name in names:
            raise SurgeryError(f"{source.name} stores {name} both whole and one tensor per expert")
        converter = converters[next(iter(groups))]
        ops = converter.operations
        stored = []
        for pattern in converter.source_patterns:
            found = sorted(groups.get(pattern, ()))
            if not found:
                raise SurgeryError(f"{source.name}: weights missing {name}'s {pattern} (stored one per expert)")
            if [e for e, _ in found] != list(range(len(found))):
                raise SurgeryError(f"{source.name}: the experts of {name} stored as {pattern} are numbered "
                                   f"{[e for e, _ in found]}, not 0 to {len(found) - 1}")
            stored.append(tuple(k for _, k in found))
        names[name] = Stored(tuple(stored), ops[0].dim, ops[-1].dim if len(ops) > 1 else 0)
    return names


def _unstored(model, names: dict[str, Stored]) -> list[str]:
    """The names of ``model``'s parameters (every name a tied one has) with no tensor in ``names``."""
    stored = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in names}
    return sorted({n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in stored})


def _stale(key: str, name: str, model) -> bool:
    """Whether the stored ``key`` (``name`` in the model, renamed as ``from_pretrained`` renames)
    is a buffer older transformers saved, which ``from_pretrained`` skips without a word: one of
    the model's buffers, persistent or not (BERT's ``embeddings.position_ids``, now not
    persistent); one stored per layer that the model now holds once (a rotary embedding's
    ``inv_freq``, once per attention module before: the buffer's own module and name, wherever
    it lies); a name the class ignores (``_keys_to_ignore_on_load_unexpected``: GPT-2's
    ``attn.bias``); or one of the :data:`HISTORIC_BUFFERS`."""
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    if name in buffers or key.endswith(HISTORIC_BUFFERS):
        return True
    moved = {".".join(n.split(".")[-2:]) for n in buffers}
    if any(name == m or name.endswith("." + m) for m in moved):
        return True
    return any(re.search(p, key) or re.search(p, name)
               for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def _tops(model) -> set[str]:
    """The first components of the model's names (its children, its own tensors)."""
    return ({n for n, _ in model.named_children()} | {n for n, _ in model.named_parameters(recurse=False)}
            | {n for n, _ in model.named_buffers(recurse=False)})


def _top(name: str, model) -> str:
    """The module of ``model`` that ``name`` would lie in, the base model's prefix added or removed as
    ``from_pretrained`` adds or removes it (for a name no tensor of the model has)."""
    top, _, rest = name.partition(".")
    prefix = getattr(model, "base_model_prefix", None) or ""
    tops = _tops(model)
    if top in tops:
        return top
    if prefix and top == prefix and prefix not in tops and rest:  # a head model's base in a base model
        return rest.partition(".")[0]
    return top


def _outside(name: str, model) -> bool:
    """Whether ``name`` lies outside every module of ``model``: the checkpoint was saved by a class
    with a module (a head, another base model) that ``model`` has not."""
    top = _top(name, model)
    if top in _tops(model):
        return False
    prefix = getattr(model, "base_model_prefix", None) or ""
    base = getattr(model, prefix, None) if prefix in _tops(model) else None
    return base is None or top not in _tops(base)  # a base model's tensor stored without its prefix: inside


def check_finite(t: torch.Tensor, key: str, source: Source) -> None:
    """Refuse NaN or Inf weights: every check downstream would compare NaN with NaN. A sum is NaN
    or infinite when an entry is (or when it overflows: then each entry is tested)."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
        return
    raise SurgeryError(f"{source.name} holds NaN or Inf weights: {key}")


def _few(keys: list[str], most: int = 5) -> str:
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


# ---------------------------------------------------------------------------------------------
# what a rewritten checkpoint records


def structure_records(model) -> list[dict]:
    """What differs from the stock architecture built from the same config.

    Runtime modules are recorded by class and constructor kwargs; stock modules with other
    parameter shapes by their new shapes; a module list shorter than the stock one (per-head
    modules of fewer heads) by its length; any module's ``_normsurgery_attrs`` as attributes.
    """
    cfg = copy.deepcopy(model.config)
    cfg.normsurgery = None
    with torch.device("meta"), no_init_weights():
        stock = stock_class_of(model)(cfg)
    stock_modules = dict(stock.named_modules())
    records = []
    for name, mod in model.named_modules():
        rec = {"path": name}
        if type(mod).__name__ in runtime.MODULES and isinstance(mod, runtime.MODULES[type(mod).__name__]):
            rec.update({"class": type(mod).__name__, "kwargs": mod.spec(),
                        "stock_equivalent": bool(getattr(mod, "stock_equivalent", False))})
        else:
            ref = stock_modules.get(name)
            own = {k: tuple(p.shape) for k, p in mod.named_parameters(recurse=False)}
            theirs = {} if ref is None else {k: tuple(p.shape) for k, p in ref.named_parameters(recurse=False)}
            if ref is None and own:
                raise SurgeryError(f"cannot record {name}: the stock architecture has no such module")
            if isinstance(mod, nn.ModuleList) and ref is not None and len(ref) > len(mod):
                rec["length"] = len(mod)
                rec["stock_equivalent"] = False
            if own != theirs:
                rec["params"] = {k: list(own[k]) if k in own else None for k in {*own, *theirs}}
                rec["stock_equivalent"] = False
        if getattr(mod, "_normsurgery_attrs", None):
            rec["attrs"] = dict(mod._normsurgery_attrs)
            rec["stock_equivalent"] = False
        if len(rec) > 1:
            records.append(rec)
    return records


def stamp(model, record: dict | None) -> list[dict]:
    """Write into ``model.config`` what a rewritten checkpoint needs: the module records, the
    ``auto_map`` naming the runtime when there are any, ``record`` and the stock architecture.
    Reads only classes and shapes (a model on the meta device will do). Returns the records."""
    records = structure_records(model)
    cfg = model.config
    base = stock_class_of(model)
    auto_map = dict(getattr(cfg, "auto_map", None) or {})
    for name in (*AUTO_CLASS.values(), "AutoConfig"):
        auto_map.pop(name, None)
    if records:
        auto_map[AUTO_CLASS[head_of(model).objective]] = f"{RUNTIME_FILE[:-3]}.NormSurgery{base.__name__}"
    _set_or_drop(cfg, "auto_map", auto_map)
    _set_or_drop(cfg, "normsurgery", {**(record or {}), "modules": records} if (record or records) else None)
    cfg.architectures = [base.__name__]
    return records


def finish(folder: Path, records: list[dict], source: Source | None = None) -> None:
    """The runtime beside the weights when modules were rebuilt; the source's side files
    (tokenizer, generation config, ...: every file but the config, the weights and ours) and the
    subfolders ``output.copied_folders`` names (sentence-transformers modules), as they are."""
    if records:
        shutil.copyfile(runtime.__file__, folder / RUNTIME_FILE)
    if source is not None:
        for f in source.path.iterdir():
            if f.is_file() and f.name not in NOT_COPIED and not f.name.startswith(".") \
                    and not f.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(f, folder / f.name)
        for f in copied_folders(source.path):
            shutil.copytree(f, folder / f.name)


def mark_not_stock(model, records: list[dict], folder: Path) -> None:
    """The plain-class claim was false: say so in the folder's config and on the modules."""
    for r in records:
        r["stock_equivalent"] = False
        model.get_submodule(r["path"]).stock_equivalent = False
    save_config(model.config, folder)


def claims(records: list[dict], reload: dict | None = None) -> dict:
    """What a save says about loading: without a ``reload`` check nothing is claimed."""
    return {"custom_modules": len(records),
            "plain_transformers": None if reload is None else reload["loader"] == "plain transformers",
            "reload": reload}


def _set_or_drop(cfg, name, value) -> None:
    if value:
        setattr(cfg, name, value)
    elif hasattr(cfg, name):
        delattr(cfg, name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
