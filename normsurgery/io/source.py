"""A checkpoint (a folder, or a cached hub id) resolved once into a :class:`Source`: the folder,
its config, its weight files with their parsed headers, the dtype the weights are stored in, the
family and the class (head) the config names, and the tokenizer. Every later step takes it, never
a path.

A model is built on the meta device from the config (:meth:`Source.meta_model`: no memory for
weights) with the class its ``architectures`` names (causal or masked LM, base model, sequence or
token classifier: ``families.FAMILIES``), or its normsurgery subclass when the config records
rebuilt modules; a sentence-transformers checkpoint whose config names the masked LM its encoder
was pretrained as while its file holds the base model alone is read as that base class, as
sentence-transformers reads it, with a note (:func:`_base_when_headless`). Its tensors are read
into it by the :class:`~normsurgery.io.loader.Loader`.
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import transformers
from transformers.initialization import no_init_weights

from ..core import runtime
from ..core.errors import SurgeryError, SurgeryNote
from ..core.families import Head, family, positions, stock_class_name, stock_objective
from .checkpoint import load_config, widest
from .shards import Index
from .stored import model_keys, unstored

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
    missing = unstored(model, model_keys(model, source))
    inner = {id(p) for p in model.base_model.parameters()}
    head = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in inner}
    if not missing or set(missing) != head:
        return
    config = copy.deepcopy(source.config)
    config.architectures = [base]
    model = _meta(getattr(transformers, base), config, torch.float32)
    if unstored(model, model_keys(model, source)):
        return
    source.config.architectures = [base]
    warnings.warn(f"{source.name}: the file holds the base model without {named}'s head: loaded as {base}, as "
                  "sentence-transformers does", SurgeryNote, stacklevel=3)
