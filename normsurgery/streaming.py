"""Checkpoints larger than memory: the same passes and checks, one part of the model at a time.

The model is built on the meta device from its config (no memory for weights) and its Layout
read from that (classes and shapes only). The model is cut into parts, each holding norms: every
block, the embeddings joined to the first block, the final norm and head to the last (a head tied
to the embedding joins all four into one part). Rewriting a part: read its tensors from the input
shards, cast them to the working dtype, run each registered ``blockwise`` pass's ``applies`` and
``apply`` on the Layout restricted to the part (``Layout.restrict``), cast back to the storage
dtype, append the tensors to the output shard, free the part (back to meta). The arithmetic is
that of the in-memory path, tensor for tensor, so the outputs are bit-identical; memory is about
one part (the embeddings or head with a block) plus one tensor being read or written.

Checks carry the probe tokens through a model one part at a time: a forward pass over the meta
model whose hooks load each part before its first module runs and free it after its last (the
reference read from the input; the rewritten model converted as it runs), so both logits are the
whole models', compared as in memory. Greedy generation is not compared (each new token would
read the whole checkpoint again), nor is the cast to the storage dtype; each tensor is checked for
overflow and underflow as it is cast (``precision.for_storage``), refused or kept in float32.

Input: safetensors headers are parsed once; a tensor is read with plain reads, one file open at
a time (a memory map would count every page it touched as the process's memory until closed),
straight into its working tensor, or through one small buffer when it is cast. Working tensors a
freed part gives back are reused by the next part of the same shapes: first touching fresh pages
costs more than the arithmetic (a 46 MB float32 tensor: 28 ms fresh, 4 ms reused). The cast to
the storage dtype is done inside the working tensor's own memory (``precision.narrow_in_place``).
Output: each shard file reserves room for its header and the tensors follow
as they come; when the shard is full its header is written into that room (padded with spaces,
as the format allows), then the next shard starts; the index is written at the end.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import __version__, checkpoint, precision, registry
from .shards import DTYPES, ShardWriter, header_room, inside as _inside, write_config
from .shards import saved_tensors as tensors
from .errors import SurgeryError
from .families import layout
from .layout import Layout
from .norms import faithful_norms
from .progress import Progress, no_progress
from .registry import PassContext
from .verify import (TOLERANCE, Comparison, coarsest, compare_logits, jittered, needs_rounding_tolerance,
                     probe_ids, rounding_tolerance, storage_tolerance)

#: bytes read at a time when a tensor is cast as it is read
STAGE = 8 << 20


# ---------------------------------------------------------------------------------------------
# shards in and out


class Shards:
    """The tensors of a safetensors checkpoint, read one at a time (see the module docstring)."""

    def __init__(self, path: Path):
        self.where: dict[str, tuple[Path, int, int, torch.dtype, list[int]]] = {}
        for f in checkpoint.weight_files(path):
            if f.suffix != ".safetensors":
                raise SurgeryError(f"{f.name}: streaming reads safetensors checkpoints only")
            header, start = checkpoint.safetensors_header(f)
            for key, v in header.items():
                if key == "__metadata__":
                    continue
                if v["dtype"] not in DTYPES:
                    raise SurgeryError(f"{f.name}: tensor {key} has dtype {v['dtype']}, which streaming cannot read")
                a, b = v["data_offsets"]
                self.where[key] = (f, start + a, b - a, DTYPES[v["dtype"]], v["shape"])
        self._file, self._fh = None, None
        self._stage: torch.Tensor | None = None

    def __contains__(self, key: str) -> bool:
        return key in self.where

    @property
    def numel(self) -> int:
        return sum(torch.Size(shape).numel() for *_, shape in self.where.values())

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of ``key`` as stored."""
        *_, dtype, shape = self.where[key]
        return dtype, tuple(shape)

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """``key``'s values into ``out`` (contiguous, its shape), cast to ``out``'s dtype: read
        straight into it when the dtypes agree, else a stage at a time through one buffer kept
        for the purpose (a fresh buffer per tensor costs first touches of its pages)."""
        f, offset, _, dtype, _ = self.where[key]
        if self._file != f:
            self.close()
            self._file, self._fh = f, open(f, "rb", buffering=0)
        self._fh.seek(offset)
        if dtype == out.dtype:
            self._read(memoryview(out.view(-1).view(torch.uint8).numpy()), key)
            return out
        flat, step = out.view(-1), STAGE // dtype.itemsize
        if self._stage is None:
            self._stage = torch.empty(STAGE, dtype=torch.uint8)
        for i in range(0, flat.numel(), step):
            n = min(step, flat.numel() - i)
            self._read(memoryview(self._stage.numpy())[:n * dtype.itemsize], key)
            flat[i:i + n].copy_(self._stage[:n * dtype.itemsize].view(dtype))
        return out

    def _read(self, view: memoryview, key: str) -> None:
        done = 0
        while done < len(view):
            n = self._fh.readinto(view[done:])
            if not n:
                raise SurgeryError(f"{self._file.name} ended inside tensor {key}")
            done += n

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._file, self._fh = None, None


# ---------------------------------------------------------------------------------------------
# the model on the meta device, its parts, loading and freeing them


def meta_model(path: Path, dtype: torch.dtype):
    """The checkpoint's model (rebuilt modules included) with its parameters on the meta device;
    buffers (rotary frequencies) are real. Eval mode."""
    from accelerate import init_empty_weights

    cfg = checkpoint.load_config(path)
    with init_empty_weights():
        model = checkpoint.model_class(cfg)._from_config(cfg, dtype=dtype)
    model.tie_weights()  # as from_pretrained does: a tied head is the embedding's parameter
    return model.eval()


@dataclass(frozen=True)
class Part:
    """Module paths rewritten together, and the stages of a forward pass they take part in
    (-1: before the blocks, i: block i, L: after the blocks)."""

    scope: tuple[str, ...]
    stages: tuple[int, ...]


def plan(model, lay: Layout, alone: bool = False) -> list[Part]:
    """The parts: each block; the embeddings (every parameter outside the blocks but those of the
    final norm, its readers and the head) with the first block; the final norm, its readers and
    the head with the last; all in one part when the two ends share a parameter (a tied head).
    ``alone``: the two ends are parts of their own (for reading only: a pass needs every part
    to hold norms)."""
    n = len(model.get_submodule(lay.layers_path))
    blocks = [f"{lay.layers_path}.{i}" for i in range(n)]
    back = tuple(dict.fromkeys(((lay.final_norm.path, *lay.final_norm.readers) if lay.final_norm else ())
                               + ((lay.head,) if lay.head else ())))
    front, ends = [], defaultdict(set)
    for name, p in model.named_parameters(remove_duplicate=False):
        mod = name.rpartition(".")[0]
        if _inside(name, (lay.layers_path,)):
            continue
        ends[id(p)].add(_inside(mod, back))
        if not _inside(mod, back) and mod not in front:
            front.append(mod)
    tied = any(len(e) > 1 for e in ends.values())
    if alone:
        blocks = [Part((b,), (i,)) for i, b in enumerate(blocks)]
        ends = [Part((*front, *back), (-1, n))] if tied else [Part(tuple(front), (-1,)), Part(back, (n,))]
        return ends + blocks
    first = Part((*front, blocks[0]), (-1, 0))
    last = Part((blocks[-1], *back), (n - 1, n))
    middle = [Part((b,), (i,)) for i, b in enumerate(blocks)][1:-1]
    if n == 1 or tied:
        return [Part(tuple(dict.fromkeys(first.scope + last.scope)), (-1, 0, n - 1, n)), *middle]
    return [first, *middle, last]


class Loader:
    """Puts a part's parameters on the model from the shards (cast to ``dtype``) and frees them.

    Each parameter's tensor in the shards is found once, by the names the model had then, and
    follows the parameter object (through loading and freeing), so modules may be moved or
    renumbered afterwards (``prune_model``) and still read the right tensors."""

    def __init__(self, model, shards: Shards, dtype: torch.dtype):
        from transformers.core_model_loading import revert_weight_conversion

        self.model, self.shards, self.dtype = model, shards, dtype
        _map_large_blocks()
        prefix = getattr(model, "base_model_prefix", "")
        self.keys: dict[int, tuple[weakref.ref, str]] = {}  # id(parameter) -> (the parameter, key)
        self.spare: dict[tuple, list[torch.Tensor]] = {}  # freed tensors by (shape, dtype), for reuse
        for name, p in model.named_parameters(remove_duplicate=False):
            saved = next(iter(revert_weight_conversion(model, {name: p})))
            for key in (saved, name, saved.removeprefix(prefix + "."), f"{prefix}.{saved}"):
                if key in shards:
                    self.keys[id(p)] = (weakref.ref(p), key)
                    break

    def key(self, p) -> str | None:
        entry = self.keys.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def _uses(self, scope):
        """Distinct parameters inside ``scope``: (parameter, [(module, attribute, full name)])."""
        uses = {}
        for path, mod in self.model.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None:
                    uses.setdefault(id(p), (p, []))[1].append((mod, attr, f"{path}.{attr}" if path else attr))
        return [(p, u) for p, u in uses.values() if any(_inside(full, scope) for *_, full in u)]

    def _replace(self, old, new, uses) -> None:
        key = self.key(old)
        self.keys.pop(id(old), None)
        if key is not None:
            self.keys[id(new)] = (weakref.ref(new), key)
        for mod, attr, _ in uses:
            mod._parameters[attr] = new

    def load(self, scope: tuple[str, ...]) -> None:
        """Read the parameters of ``scope`` (floats cast to the working dtype), into the tensors
        the last :meth:`free` gave back where shapes agree (their pages are touched already);
        the rest of those go back to the system first."""
        todo = []
        for p, uses in self._uses(scope):
            if p.device.type != "meta":
                continue
            key = self.key(p)
            if key is None:
                raise SurgeryError(f"{uses[0][2]} is missing from the checkpoint")
            stored, shape = self.shards.spec(key)
            if shape != tuple(p.shape):
                raise SurgeryError(f"{key} has shape {shape} in the checkpoint, the model expects {tuple(p.shape)}")
            dtype = self.dtype if stored.is_floating_point else stored
            spare = self.spare.get((shape, dtype))
            todo.append((p, uses, key, spare.pop(0) if spare else None, shape, dtype))
        self.spare.clear()
        for p, uses, key, out, shape, dtype in todo:
            out = self.shards.read_into(key, torch.empty(shape, dtype=dtype) if out is None else out)
            self._replace(p, nn.Parameter(out, requires_grad=False), uses)

    def release(self) -> None:
        """Give the tensors kept for reuse back to the system (no part follows)."""
        self.spare.clear()
        _trim()

    def free(self, scope: tuple[str, ...]) -> None:
        """Put ``scope``'s parameters back on the meta device. A tensor nothing else holds (no
        view of it is alive) is kept for the next :meth:`load`."""
        for p, uses in self._uses(scope):
            if p.device.type != "meta" and _owned(p):
                self.spare.setdefault((tuple(p.shape), p.dtype), []).append(p.detach())
            self._replace(p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False), uses)
        _trim()


def _owned(p: torch.Tensor) -> bool:
    """True when ``p`` alone holds its storage, all of it: no view of it is alive anywhere (the
    storage's use count is ``p``'s and the one taken to ask)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and precision.spans_storage(p) and count(p.untyped_storage()._cdata) == 2


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def _trim() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _map_large_blocks() -> None:
    """Ask glibc to serve every allocation of 1 MiB or more by its own mapping (process-wide),
    so a freed part goes back to the system at once: by default the threshold rises with each
    large block freed, later tensors come from the heap, and the heap only grows."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


@contextmanager
def part_by_part(model, parts: list[Part], enter: Callable[[Part], None], leave: Callable[[Part], None]):
    """Hooks that, during a forward pass, ``enter`` each part before its first stage runs and
    ``leave`` it after its last."""
    lay = layout(model)
    blocks = model.get_submodule(lay.layers_path)
    n = len(blocks)
    starts = {min(p.stages): p for p in parts}
    ends = {max(p.stages): p for p in parts}

    def start(stage):
        if stage in starts:
            enter(starts[stage])

    def end(stage):
        if stage in ends:
            leave(ends[stage])

    def before_block(i):
        def hook(module, args):
            if i == 0:
                end(-1)
            start(i)
        return hook

    def after_block(i):
        def hook(module, args, output):
            end(i)
            if i == n - 1:
                start(n)
        return hook

    # the base model's forward starts with the embeddings, also when it runs without the head
    handles = [model.base_model.register_forward_pre_hook(lambda m, a: start(-1)),
               model.register_forward_hook(lambda m, a, o: end(n))]
    for i, b in enumerate(blocks):
        handles += [b.register_forward_pre_hook(before_block(i)), b.register_forward_hook(after_block(i))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def logits(model, parts: list[Part], ids: torch.Tensor, enter, leave) -> torch.Tensor:
    """The model's logits on ``ids`` with its parts entered and left as the forward goes."""
    kwargs = {"use_cache": False} if layout(model).objective == "causal-lm" else {}
    with part_by_part(model, parts, enter, leave):
        out = model(input_ids=ids, **kwargs).logits
    _trim()  # the forward's activations, freed after the last part: back to the system
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


def read_logits(path: Path, dtype: torch.dtype, ids: torch.Tensor, model=None, jitter: bool = False) -> torch.Tensor:
    """Logits of the checkpoint at ``path`` in ``dtype`` (``model``: its meta model, when built
    already), one part in memory at a time; ``jitter``: under ``verify.jittered``."""
    model = meta_model(path, dtype) if model is None else model
    if dtype == torch.float64:
        faithful_norms(model)
    shards = Shards(path)
    loader = Loader(model, shards, dtype)
    try:
        with jittered(model) if jitter else nullcontext():
            return logits(model, plan(model, layout(model), alone=True), ids, lambda p: loader.load(p.scope),
                          lambda p: loader.free(p.scope))
    finally:
        shards.close()


# ---------------------------------------------------------------------------------------------
# when to stream


def available_memory() -> int:
    """Bytes this process may still take: MemAvailable, or less under a cgroup limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail or 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 1 << 62


def too_big(paths: list[Path], dtype: torch.dtype, copies: float) -> str | None:
    """Why the checkpoints must be streamed (None when ``copies`` of their parameters in ``dtype``
    fit in the available memory, with a margin of 1 GiB). Pickle checkpoints are never streamed:
    they can only be loaded whole."""
    if any(f.suffix != ".safetensors" for p in paths for f in checkpoint.weight_files(p)):
        return None
    params = sum(Shards(p).numel for p in paths)
    need = params * torch.finfo(dtype).bits // 8 * copies + 2**30
    avail = available_memory()
    if need <= avail:
        return None
    return (f"in memory this needs about {need / 2**30:.1f} GiB ({params / 1e9:.2f}B parameters in "
            f"{str(dtype).removeprefix('torch.')}), {avail / 2**30:.1f} GiB are available")


# ---------------------------------------------------------------------------------------------
# convert and verify


def check_blockwise(passes: list[tuple[str, dict]], reason: str) -> list[tuple[registry.Pass, dict]]:
    """The passes with their options, when every one is blockwise; else why streaming cannot."""
    out = []
    for name, options in passes:
        p = registry.get(name)
        if not p.blockwise:
            raise SurgeryError(f"pass {name} cannot run one block at a time (it needs facts about the whole "
                               f"model, such as which channels any writer writes), and streaming was chosen: "
                               f"{reason}; --in-memory loads the whole model")
        out.append((p, registry.check_options(p, options)))
    return out


def convert(src, path: Path, out, passes: list[tuple[str, dict]], *, storage: torch.dtype, dtype: torch.dtype,
            force: bool = False, verify: bool = True, text: str | None = None, tolerance: float | None = None,
            max_shard_size: str | int = "5GB", progress: Progress = no_progress, reason: str = "",
            on_overflow: str = "refuse"):
    """``convert.convert`` one part at a time (called by it: ``path`` resolved, ``out`` checked).
    Each tensor is checked as it is cast back (``precision.for_storage``)."""
    from transformers.utils.hub import convert_file_size_to_int

    from .convert import Result, _length, check_applicable

    todo = check_blockwise(passes, reason)
    shards = Shards(path)
    model = meta_model(path, dtype)
    restore = faithful_norms(model) if dtype == torch.float64 else None
    parts = plan(model, layout(model))
    loader = Loader(model, shards, dtype)
    tokenizer = checkpoint.load_tokenizer(path)
    context = PassContext(tokenizer=tokenizer, text=text)
    reports = defaultdict(list)
    names = list(model.state_dict())
    result = Result([], str(dtype).removeprefix("torch."), str(storage).removeprefix("torch."), source=str(src))
    result.streaming = reason
    done = [0]
    lost = []  # tensors that do not fit the storage dtype, written in float32

    def rewrite(part: Part) -> None:
        progress("rewrite", done[0], len(parts))
        loader.load(part.scope)
        for p, opts in todo:
            lay = layout(model, part.scope)
            check_applicable(model, p.name, lay)
            context.options = opts
            reports[p.name].append(p.apply(model, lay, context))

    def write(part: Part) -> None:
        saved = tensors(model, part.scope)
        users = Counter(t.untyped_storage().data_ptr() for t in saved.values())
        for name, t in saved.items():  # a storage two names write is cast, not spent
            spend = users[t.untyped_storage().data_ptr()] == 1
            writer.add(name, precision.for_storage(name, t, storage, lost, spend) if t.is_floating_point() else t)
        saved = t = None  # no view left: the loader reuses the part's tensors
        loader.free(part.scope)
        done[0] += 1
        progress("rewrite", done[0], len(parts))

    try:
        with checkpoint.writing(out, force=force, source=path) as stage:
            tmp = stage.path
            writer = ShardWriter(tmp, convert_file_size_to_int(max_shard_size), header_room(names))
            if verify:
                ids = probe_ids(model, tokenizer, text, 4, _length(model))
                progress("reference", 0, 1)
                reference = read_logits(path, dtype, ids)
                progress("reference", 1, 1)
                after = logits(model, parts, ids, rewrite, write)
            else:
                for part in parts:
                    rewrite(part)
                    write(part)
            loader.release()
            if verify:
                result.parity = compare_logits(reference, after)
                result.parity.tolerance = TOLERANCE[dtype] if tolerance is None else tolerance
                if needs_rounding_tolerance([result.parity], dtype, tolerance):  # one more read of the input
                    result.parity.tolerance, result.parity.reason = rounding_tolerance(
                        reference, read_logits(path, dtype, ids, jitter=True), dtype)
            files = writer.close()
            precision.check_policy(lost, storage, on_overflow)
            if lost:
                result.kept_float32 = [x.name for x in lost]
                result.warnings = [precision.warning(lost, storage)]
            result.steps = [_step(p.name, p.kind, opts, reports[p.name], len(parts)) for p, opts in todo]
            if len(result.steps) == 1 and result.parity is not None:
                result.steps[0].parity = result.parity
            if verify and not result.ok and not force:
                raise SurgeryError(f"the passes broke parity: relative error {result.parity.relative:.2e} > "
                                   f"{result.parity.tolerance:.0e}; nothing was saved (--force saves anyway)")
            if restore:
                restore()
            record = {"version": __version__, "source": str(src), "streaming": True, "passes": [
                {"name": s.name, "options": s.options, "notes": s.notes,
                 "relative_error": s.parity.relative if s.parity else None} for s in result.steps],
                **({"kept_float32": result.kept_float32} if lost else {})}
            records = _finish(model, tmp, torch.float32 if lost else storage, record, path)
        result.saved = {**checkpoint.written(out, stage, checkpoint.claims(records)), "shards": len(files)}
    finally:
        shards.close()
    return result


def _finish(model, tmp: Path, storage: torch.dtype, record: dict, source: Path) -> list[dict]:
    """What ``save_pretrained`` writes beside the weights, from the meta model; the runtime and
    the side files (``checkpoint.finish``). Returns the module records."""
    records = checkpoint.stamp(model, record)
    write_config(model, tmp, storage)
    checkpoint.finish(tmp, records, source)
    return records


def _step(name: str, kind: str, options: dict, reports: list, parts: int):
    """One step from the reports of every part: distinct notes, integer metrics summed."""
    from .convert import Step

    notes = list(dict.fromkeys(n for r in reports for n in r.notes))
    metrics = {}
    for r in reports:
        for k, v in r.metrics.items():
            metrics[k] = metrics.get(k, 0) + v if isinstance(v, int) and not isinstance(v, bool) else v
    return Step(name, kind, options, [f"rewritten in {parts} parts, one at a time (notes per part)"] + notes, metrics)


def verify(a: Path, b: Path, *, text: str | None = None, dtype: torch.dtype = torch.float32,
           tolerance: float | None = None, n: int = 4, length: int = 64) -> Comparison:
    """``verify.verify`` on checkpoints one part at a time (no greedy generation, no per-layer)."""
    ma = meta_model(a, dtype)
    c = ma.config
    length = min(length, getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", length))
    ids = probe_ids(ma, checkpoint.load_tokenizer(a), text, n, length)
    if dtype not in TOLERANCE:
        raise SurgeryError("streaming verify computes in float32 or float64")
    reference = read_logits(a, dtype, ids, ma)
    result = compare_logits(reference, read_logits(b, dtype, ids))
    # weights stored coarser than the arithmetic allow the reference's own rounding in that
    # dtype (one more streamed forward)
    storage = coarsest(checkpoint.storage_dtype(a), checkpoint.storage_dtype(b))
    result.tolerance, result.reason, _ = storage_tolerance(
        dtype, storage, lambda d: compare_logits(reference, read_logits(a, d, ids)))
    if needs_rounding_tolerance([result], dtype, tolerance) and result.tolerance == TOLERANCE[dtype]:
        result.tolerance, result.reason = rounding_tolerance(reference, read_logits(a, dtype, ids, jitter=True), dtype)
    if tolerance is not None:
        result.tolerance, result.reason = tolerance, "given"
    return result


# ---------------------------------------------------------------------------------------------
# prune


def score(path: Path, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
          progress: Progress = no_progress):
    """``prune.score_layers`` over the checkpoint read one part at a time (all windows in one
    forward pass, so the checkpoint is read once), in its stored dtype."""
    from .prune import score_layers

    storage = checkpoint.storage_dtype(path)
    model = meta_model(path, storage)
    shards = Shards(path)
    loader = Loader(model, shards, storage)
    parts = plan(model, layout(model), alone=True)  # the base model's final norm runs too
    try:
        with part_by_part(model, parts, lambda p: loader.load(p.scope), lambda p: loader.free(p.scope)):
            return score_layers(model, ids, attention_mask, batch_size=len(ids), progress=progress)
    finally:
        shards.close()


def prune(src, out, layers, *, force: bool = False, record: dict | None = None,
          max_shard_size: str | int = "5GB", progress: Progress = no_progress) -> dict:
    """Remove the blocks ``layers`` (``prune.prune_model`` on the meta model: the same checks,
    renumbering and config), then copy the kept tensors under their new names, part by part,
    in the stored dtype: nothing is computed, memory stays about one part. ``record`` goes
    into ``config.normsurgery`` with prune_model's record added under "prune". Returns
    prune_model's record with ``saved``."""
    from transformers.utils.hub import convert_file_size_to_int

    from .prune import prune_model

    path = checkpoint.resolve(src)
    storage = checkpoint.storage_dtype(path)
    model = meta_model(path, storage)
    shards = Shards(path)
    loader = Loader(model, shards, storage)  # keys found by the names before renumbering
    names = list(model.state_dict())
    info = prune_model(model, layers)
    parts = plan(model, layout(model), alone=True)
    try:
        with checkpoint.writing(out, force=force, source=path) as stage:
            tmp = stage.path
            writer = ShardWriter(tmp, convert_file_size_to_int(max_shard_size),
                                 header_room(names))
            for i, part in enumerate(parts):
                progress("copy", i, len(parts))
                loader.load(part.scope)
                for name, t in tensors(model, part.scope).items():
                    writer.add(name, t)
                loader.free(part.scope)
            progress("copy", len(parts), len(parts))
            writer.close()
            record = {**(record or {}), "streaming": True}
            record["prune"] = {**record.get("prune", {}), **info}
            records = _finish(model, tmp, storage, record, path)
    finally:
        shards.close()
    return {**info, "saved": checkpoint.written(out, stage, checkpoint.claims(records))}
