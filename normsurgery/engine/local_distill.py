"""Blockwise local distillation (``heal --local-steps N``, Puzzle's BLD), before the global steps.

Block i of the student is trained, alone, to reproduce the teacher's block i on the teacher's
block inputs: with h_0 the embeddings of the training windows and h_{i+1} = f_T,i(h_i) (the
teacher's own stream, block after block),

    min over block i's trainable parameters of  block_nmse(f_S,i(h_i), f_T,i(h_i), h_i)
        = ||f_S,i(h_i) - f_T,i(h_i)||^2 / ||f_T,i(h_i) - h_i||^2

for ``steps`` AdamW steps (one micro-batch of windows each, cycling), only in the blocks the cut
changed; a block the cut left alone is not trained. The blocks are visited in order, each needing
only its own weights and the cache of h_i, so the model need not be held whole: with ``stash``
(a folder) every block waits on disk (``io.stash``) and is read back only for its turn. (sweep's
``Work`` reads parts from a checkpoint; the student here carries adapters its loader does not
know, so its blocks are set aside and brought back instead: the same one-block-at-a-time memory.)

The teacher is any object with ``model`` and ``active()`` (``width_teacher.WidthTeacher``: the
student's blocks with the removed units added and adapters off; a frozen copy: its own model, a
null context). Its block kwargs (position embeddings, masks) are those of block 0's call, which
every block of the families it supports receives alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.distillation import block_nmse
from ..core.errors import SurgeryError
from ..core.families import layout
from ..io.stash import Stash


@dataclass
class LocalConfig:
    steps: int = 100  # optimizer steps per changed block
    lr: float = 1e-3
    batch_size: int = 4  # windows per step


class _Stop(Exception):
    """Ends a forward once block 0's inputs are seen."""


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _blocks(model):
    base = _base(model)
    return base.get_submodule(layout(base).layers_path)


def changed_blocks(model, paths) -> set[int]:
    """The blocks holding any of the module ``paths`` (a width teacher's ``removed``)."""
    lp = layout(_base(model)).layers_path + "."
    return {int(p[len(lp):].split(".")[0]) for p in paths if p.startswith(lp)}


@torch.no_grad()
def block_inputs(teacher, windows: torch.Tensor, batch_size: int, first=None) -> list[tuple[tuple, dict]]:
    """Per micro-batch of ``windows``, the (args, kwargs) the teacher's block 0 (``first``, default
    found from its layout) is called with; the forward ends there (later blocks are not read)."""
    seen = []

    def hook(module, args, kwargs):
        seen.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
        raise _Stop

    handle = (_blocks(teacher.model)[0] if first is None else first).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with teacher.active():
            for s in range(0, len(windows), batch_size):
                try:
                    teacher.model(input_ids=windows[s:s + batch_size], use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return seen


def _out(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _nmse(block, cache, targets) -> float:
    with torch.no_grad():
        return sum(block_nmse(_out(block(*a, **k)), t, a[0]).item() for (a, k), t in zip(cache, targets)) / len(cache)


def _train_block(block, cache: list, targets: list, config: LocalConfig) -> None:
    params = [p for p in block.parameters() if p.requires_grad]
    if not params:
        raise SurgeryError("local distillation trains a changed block's adapters, and this block has none that "
                           "train (heal --train lora)")
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    for step in range(config.steps):
        (args, kwargs), target = cache[step % len(cache)], targets[step % len(cache)]
        loss = block_nmse(_out(block(*args, **kwargs)), target, args[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local_distill(teacher, student, windows: torch.Tensor, changed: set[int], config: LocalConfig,
                  stash: Path | None = None) -> list[dict]:
    """Train the ``changed`` blocks of ``student`` (its parameters that require grad: adapters)
    on ``windows`` [n, T] from ``teacher`` (see the module doc); ``stash``: a folder where blocks
    wait while not their turn. Returns per block its nMSE before and after (None: not trained)."""
    blocks, teacher_blocks = _blocks(student), _blocks(teacher.model)  # (the layout read while whole)
    waiting = {}
    if stash is not None:
        waiting = {i: Stash(b, Path(stash) / f"block-{i}") for i, b in enumerate(blocks)}
    rows = []
    try:
        cache = block_inputs(teacher, windows, config.batch_size, teacher_blocks[0])
        for i, block in enumerate(blocks):
            if i in waiting:
                waiting.pop(i).back()
            with torch.no_grad(), teacher.active():
                targets = [_out(teacher_blocks[i](*a, **k)).detach() for a, k in cache]
            row = {"block": i, "nmse_before": None, "nmse_after": None}
            if i in changed:
                with torch.enable_grad():
                    row["nmse_before"] = _nmse(block, cache, targets)
                    _train_block(block, cache, targets, config)
                    row["nmse_after"] = _nmse(block, cache, targets)
            rows.append(row)
            cache = [((t, *a[1:]), k) for (a, k), t in zip(cache, targets)]
            if stash is not None:
                waiting[i] = Stash(block, Path(stash) / f"block-{i}")
    finally:
        for s in waiting.values():
            s.back()
    return rows
