"""heal's width-cut teacher, blockwise local steps and teacher cache, around the one training loop.

- :func:`width_teaching`: a teacher given whole (``--teacher``: a frozen copy) whose student is
  it less whole MLP units and heads (``mask``/``minimize``) becomes the student's own modules plus
  the removed rows and columns (``engine.width_teacher``), the copy freed; where that cannot be
  shown exact, the copy stays, and the reason is returned.
- :func:`prepared`: before the global steps, ``--local-steps`` (``engine.local_distill``: each
  changed block's adapters trained on the teacher's block outputs), then ``--teacher-cache``
  (``engine.teacher_cache``: top-k targets of every training window, built once from the live
  teacher, which the loop then never calls).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from ..core.errors import SurgeryError, UsageError
from ..core.options import HealOptions
from ..engine import teacher_cache
from ..engine.local_distill import LocalConfig, changed_blocks, local_distill
from ..engine.teacher import Distillation, Frozen
from ..engine.training import TrainConfig, _batch, _mlm_spec
from ..engine.width_teacher import NotExact, WidthTeacher, width_cut
from .heal_teacher import Teaching, distill_with


def check_distilling(opts: HealOptions) -> None:
    """Refuse, before anything is read, local steps without adapters and a cache or local steps
    without distillation."""
    if opts.local_steps and opts.train != "lora":
        raise UsageError(f"--local-steps trains each changed block's adapters: it needs --train lora, not {opts.train}")
    if opts.objective == "ce" and (opts.teacher_cache or opts.local_steps):
        raise UsageError(f"{'--teacher-cache' if opts.teacher_cache else '--local-steps'} distils from a teacher: not "
                         "with --objective ce")


def width_teaching(teaching: Teaching | None, student, opts: HealOptions) -> tuple[Teaching | None, str | None]:
    """(the teaching, why it stays a frozen copy: None where it now shares the student's tensors)."""
    if teaching is None or not isinstance(teaching.given, Frozen):
        return teaching, None
    if opts.train != "lora":
        return teaching, f"--train {opts.train} trains the weights a width-cut teacher would share"
    try:
        shared = width_cut(teaching.given.model, student)
    except NotExact as e:
        return teaching, str(e)
    return Teaching(shared, teaching.name), None


def prepared(teaching: Teaching | None, model, trained, data: tuple, config: TrainConfig, opts: HealOptions,
             lm: tuple[str, int | None]) -> tuple[Distillation | None, str, list | None]:
    """(the distillation the loop runs: ``heal_teacher.distill_with``'s for the student ``model``
    whose own parameters ``trained`` train, its teacher replaced by the cache of it where
    ``opts.teacher_cache`` asks; the objective; the local steps' rows: per changed block its nMSE
    before and after), the local steps run first; ``data``: the training tokens and held-out
    windows; ``lm``: the model's objective and mask token id."""
    distillation, goal = distill_with(teaching, model, trained, opts)
    local = None
    if opts.local_steps:
        local = _local(distillation, model, data[0], config, opts)
    if opts.teacher_cache and distillation is not None and distillation.distils:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SurgeryError("--teacher-cache is built by one process: heal with it on one process")
        spec = teacher_cache.Spec(opts.teacher_k, opts.temperature, teaching.name, 1, _mlm_spec(lm[0], model, lm[1]))
        device = next(model.parameters()).device
        cache = teacher_cache.build(Path(opts.teacher_cache), distillation.teacher, data, config, spec, device)
        distillation = replace(distillation, teacher=cache)
    return distillation, goal, local


def _local(distillation: Distillation | None, model, train_ids: torch.Tensor, config: TrainConfig,
           opts: HealOptions) -> list:
    teacher = None if distillation is None else distillation.teacher
    if not isinstance(teacher, WidthTeacher):
        raise SurgeryError("--local-steps trains the blocks a width cut changed (mask/minimize units and heads) from "
                           "a teacher sharing the student's tensors: give --teacher the model before the cut, "
                           "and --train lora")
    other = replace(config, seed=config.seed + 1)  # windows of their own, as many as the steps read
    windows = torch.cat([_batch(train_ids, other, s, 0, 0, 1, None)[0] for s in range(opts.local_steps)])
    rows = local_distill(teacher, model, windows.to(next(model.parameters()).device),
                         changed_blocks(model, teacher.removed),
                         LocalConfig(opts.local_steps, config.lr, opts.batch_size))
    return [r for r in rows if r["nmse_before"] is not None]
