"""A checkpoint's tensors read into a model built on the meta device (``Source.meta_model``), one
part at a time: the :class:`Loader` maps each parameter to its tensors in the files
(:mod:`~normsurgery.io.stored`), reads a part's parameters (all of them: the whole model, one part)
cast to a working dtype, and frees them again; :func:`load` reads a whole model. A missing weight
is an error naming it (transformers would initialise it at random and only log it); so are a
mis-shaped one, NaN or Inf weights, and a tensor of a module the class has not (a head, another
base model: the config names the wrong class). A buffer older transformers saved (BERT's
``embeddings.position_ids``, a rotary ``inv_freq`` per layer) is skipped as ``from_pretrained``
skips it; any other unexpected tensor is left unread, as ``from_pretrained`` leaves it, with a
:class:`~normsurgery.core.errors.SurgeryWarning` naming it (the CLI: one ``warning:`` line).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from ..core import devices, memory
from ..core.errors import SurgeryError, SurgeryWarning
from .shards import Reader, inside
from .source import Source
from .stored import Stored, model_keys, outside, stale, top_module, unstored


def load(src, dtype: torch.dtype | None = None, *, stock: bool = False, allow_pickle: bool = False,
         device: torch.device | str = devices.HOST):
    """Load a checkpoint (a path, cached hub id or :class:`Source`; rewritten or stock) whole, with
    the class its ``architectures`` names, in ``dtype`` (default: its storage dtype), on ``device``
    (``devices``; default: host memory, as ``from_pretrained`` loads), eval mode. ``stock``: with
    the plain stock class, as ``from_pretrained`` without normsurgery would."""
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

    ``device`` (``devices``): where the part's tensors go; another than host memory, each tensor is
    read into a host buffer (reused by the next tensor of its shape) and copied there."""

    def __init__(self, model, source: Source, dtype: torch.dtype, device: torch.device | str):
        self.model, self.source, self.dtype = model, source, dtype
        self.device = torch.device(device)
        devices.place_buffers(model, self.device)
        self.reader = Reader(source.index)
        self.keys: dict[int, tuple[weakref.ref, Stored]] = {}  # id(parameter) -> (the parameter, its tensors)
        self.buffers: dict[str, Stored] = {}  # buffer name -> its tensors
        self.spare: dict[tuple, list[torch.Tensor]] = {}  # freed tensors by (shape, dtype), for reuse
        names = model_keys(model, source)
        used = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            stored = names.get(name)
            if stored is not None and id(p) not in self.keys:
                self.keys[id(p)] = (weakref.ref(p), stored)
                used.update(stored.keys)
        missing = unstored(model, names)
        persistent = set(model.state_dict())
        for name, _ in model.named_buffers():
            if name in persistent and names.get(name) is not None:
                self.buffers[name] = names[name]
                used.update(names[name].keys)
        shapes = sorted(s.label for p, s in self._entries() if tuple(p.shape) != s.shape(source.index))
        _refuse(model, source, dtype, names, used, missing, shapes)

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
            if self.device.type != devices.HOST:
                out = staging.get((shape, dtype))
            out = stored.read_into(self.reader, torch.empty(shape, dtype=dtype) if out is None else out)
            check_finite(out, stored.label, self.source)
            if self.device.type != devices.HOST:
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
            if p.device.type == devices.HOST and memory.owned(p):
                self.spare.setdefault((tuple(p.shape), p.dtype), []).append(p.detach())
            self._replace(p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad), uses)
        memory.trim()

    def close(self) -> None:
        """Give the tensors kept for reuse back to the system and close the files (no part follows)."""
        self.spare.clear()
        self.reader.close()
        memory.trim()

def _refuse(model, source: Source, dtype: torch.dtype, names: dict[str, Stored], used: set[str],
            missing: list[str], shapes: list[str]) -> None:
    """Refuse in one line to load ``source`` into ``model`` (``names``: where its tensors lie, ``used``:
    the keys read) with weights ``missing``, mis-shaped (``shapes``), of a module the class has not,
    or kept in float32 where ``dtype`` is narrower; warn of the unexpected tensors left unread."""
    renamed = {k: n for n, s in names.items() for k in s.keys}
    unexpected = sorted(k for k in source.index.keys() if k not in used and not stale(k, renamed.get(k, k), model))
    foreign = [k for k in unexpected if outside(renamed.get(k, k), model)]
    cls = type(model).__name__.removeprefix("NormSurgery")
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)} (transformers would fill them at random)")
    if shapes:
        problems.append(f"mis-shaped {_few(shapes)}")
    if foreign:
        tops = sorted({top_module(renamed.get(k, k), model) for k in foreign})
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
                      "loaded without them, as transformers loads it", SurgeryWarning, stacklevel=3)


def check_finite(t: torch.Tensor, key: str, source: Source) -> None:
    """Refuse NaN or Inf weights: every check downstream would compare NaN with NaN. A sum is NaN
    or infinite when an entry is (or when it overflows: then each entry is tested)."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
        return
    raise SurgeryError(f"{source.name} holds NaN or Inf weights: {key}")


def _few(keys: list[str], most: int = 5) -> str:
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")
