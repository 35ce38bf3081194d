"""Where each tensor of a model lies in a checkpoint's files, found the way ``from_pretrained``
finds it: its key renamings, the base model's prefix added or removed, a mixture's experts stored
one tensor each merged into the stacked parameter (:class:`Stored`, :func:`model_keys`); and which
stored tensors no module reads: a buffer older transformers saved (:func:`stale`, skipped as
``from_pretrained`` skips it) or a tensor of a module the class has not (:func:`outside`: a head,
another base model). The :class:`~normsurgery.io.loader.Loader` reads by these facts."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..core.errors import SurgeryError
from .shards import Index, Reader

#: historic buffers: names old checkpoints store that no current module has, so the general rule
#: (the model's own buffers, :func:`stale`) cannot cover them. Only GPT-2's attention constant
#: ``attn.masked_bias`` (GPT-J's, GPT-NeoX's ``attention.masked_bias`` too), which transformers dropped
HISTORIC_BUFFERS = (".masked_bias",)


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


def model_keys(model, source) -> dict[str, Stored]:
    """{model state-dict name: its tensors in ``source``'s files (a ``Source``)}, renamed as
    ``from_pretrained`` renames, and merged as it merges them (:class:`Stored`): the experts of a
    mixture stored one tensor per expert, in the order of their numbers, which must run 0, 1, ...
    with none missing."""
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


def unstored(model, names: dict[str, Stored]) -> list[str]:
    """The names of ``model``'s parameters (every name a tied one has) with no tensor in ``names``."""
    stored = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in names}
    return sorted({n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in stored})


def stale(key: str, name: str, model) -> bool:
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


def top_module(name: str, model) -> str:
    """The module of ``model`` that ``name`` would lie in, the base model's prefix added or removed as
    ``from_pretrained`` adds or removes it (for a name no tensor of the model has)."""
    first, _, rest = name.partition(".")
    prefix = getattr(model, "base_model_prefix", None) or ""
    tops = _tops(model)
    if first in tops:
        return first
    if prefix and first == prefix and prefix not in tops and rest:  # a head model's base in a base model
        return rest.partition(".")[0]
    return first


def outside(name: str, model) -> bool:
    """Whether ``name`` lies outside every module of ``model``: the checkpoint was saved by a class
    with a module (a head, another base model) that ``model`` has not."""
    first = top_module(name, model)
    if first in _tops(model):
        return False
    prefix = getattr(model, "base_model_prefix", None) or ""
    base = getattr(model, prefix, None) if prefix in _tops(model) else None
    return base is None or first not in _tops(base)  # a base model's tensor stored without its prefix: inside
