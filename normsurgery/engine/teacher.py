"""The teacher a heal distils from, and the distillation's share of the training loss.

The loss of a micro-batch, over its predicted positions P (causal: positions 0..T-2 predicting
1..T-1; masked LM: the masked positions, labels != -100), |P| their number:

    ce:     sum_P CE_t / |P|
    kd:     sum_P T^2 KL(p_teacher,t || q_student,t) / |P|          (``core.distillation``)
    kd+ce:  (sum_P T^2 KL_t + ce_weight * sum_P CE_t) / |P|

A :class:`Teacher` gives, per micro-batch, the teacher's full logits (a live teacher) or a
``TopK`` (a cache): :func:`objective_sum` dispatches on which. One training loop
(``training.train``) takes the objective as data: a :class:`Distillation`, or None for ``ce``.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..core.analysis import evaluating
from ..core.distillation import OBJECTIVES, TopK, kd_loss_sum, kd_top_k_loss_sum
from ..core.errors import SurgeryError
from ..core.families import family, layout

#: the ``step`` a teacher is asked at for held-out windows (evaluation, not a training micro-batch)
EVAL = -1


class Teacher(Protocol):
    """What the training loop distils from."""

    def targets(self, inputs: torch.Tensor, step: int, micro: int) -> "torch.Tensor | TopK | None":
        """The teacher's view of the micro-batch ``inputs`` [B, T] (step ``step``, micro-batch
        ``micro``, this process's windows): full logits [B, T, V] (a live teacher) or a TopK
        (a cache). Called under no_grad. At ``step`` :data:`EVAL` (held-out windows, ``micro`` the
        batch's index) a teacher that cannot answer (a cache) returns None: no KL is measured."""


@dataclass
class Distillation:
    """The training objective (``core.distillation.OBJECTIVES``) and, for ``kd`` and ``kd+ce``, the
    teacher, the temperature T and the weight of CE. A teacher with objective ``ce`` trains on CE
    alone and is only measured against (KL to it, held out)."""

    teacher: Teacher | None
    objective: str = "kd"
    temperature: float = 1.0
    ce_weight: float = 1.0

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise SurgeryError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if self.objective != "ce" and self.teacher is None:
            raise SurgeryError(f"objective {self.objective} distils from a teacher, and none was given")
        if not self.temperature > 0 or self.ce_weight < 0:
            raise SurgeryError(f"temperature must be positive and ce_weight at least 0, got {self.temperature:g} "
                               f"and {self.ce_weight:g}")

    @property
    def distils(self) -> bool:
        return self.objective != "ce"


def predicted(logits: torch.Tensor, labels: torch.Tensor, causal: bool):
    """(logits, labels, mask) at the predicted positions: causal, logits 0..T-2 against labels
    1..T-1; every position whose label is not -100 counts."""
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return logits, labels, labels != -100


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """sum of the token CEs in float32 (labels -100 ignored); ``logits`` already at the predicted positions."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def kd_sum(logits: torch.Tensor, targets, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """sum over ``mask`` of T^2 KL(teacher || student): full teacher logits, or a TopK (its own T)."""
    if isinstance(targets, TopK):
        return kd_top_k_loss_sum(logits, targets, mask)[0]
    return kd_loss_sum(logits, targets, temperature, mask)[0]


def shifted(targets, causal: bool):
    """The teacher's targets at the predicted positions (causal: 0..T-2), logits or TopK alike."""
    return targets[:, :-1] if causal else targets


def objective_sum(logits: torch.Tensor, labels: torch.Tensor, causal: bool, distillation: Distillation | None,
                  targets=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the objective summed over the predicted positions, their number) for a micro-batch's
    student ``logits`` [B, T, V]; ``targets``: the teacher's (``Teacher.targets``) where it distils."""
    logits, labels, mask = predicted(logits, labels, causal)
    if distillation is None or not distillation.distils:
        return ce_sum(logits, labels), mask.sum()
    total = kd_sum(logits, shifted(targets, causal), mask, distillation.temperature)
    if distillation.objective == "kd+ce":
        total = total + distillation.ce_weight * ce_sum(logits, labels)
    return total, mask.sum()


# ----------------------------------------------------------------------------- live teachers

def renumber(blocks: nn.ModuleList) -> None:
    """Block j of ``blocks`` gets ``layer_idx = j`` in every module that has one (the KV cache and
    per-layer config lists are indexed by it)."""
    for j, block in enumerate(blocks):
        for mod in block.modules():
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = j


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _logits(model, inputs: torch.Tensor) -> torch.Tensor:
    causal = layout(_base(model)).objective == "causal-lm"
    return model(input_ids=inputs, **({"use_cache": False} if causal else {})).logits


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Cut:
    """What a layer cut removed from a model of ``layers`` blocks: the blocks, by their index in
    it, and the config values the cut changed (``num_hidden_layers`` and the per-layer entries
    ``Pruning`` names), as they were."""

    blocks: dict[int, nn.Module]
    config: dict[str, Any]

    @property
    def layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def nbytes(self) -> int:
        return _nbytes(t for b in self.blocks.values() for t in [*b.parameters(), *b.buffers()])


def cut_of(model, layers: Iterable[int]) -> Cut:
    """The :class:`Cut` removing ``layers`` from ``model`` would make (taken before it is made:
    the blocks themselves, not copies)."""
    blocks, cfg = model.get_submodule(layout(model).layers_path), model.config
    rules = family(cfg.model_type).pruning
    keys = ["num_hidden_layers", *rules.lists, *rules.indices, *rules.counted]
    return Cut({int(i): blocks[int(i)] for i in layers},
               {k: copy.copy(getattr(cfg, k)) for k in keys if getattr(cfg, k, None) is not None})


class LayerCut:
    """A live :class:`Teacher`: the model before a layer cut, assembled from the student's own
    modules (its tensors shared, never copied: with its adapters off, peft's ``disable_adapter``)
    and the :class:`Cut`'s blocks put back in their places, the config as it was, for each forward
    (in eval mode). ``trained``: the student's own parameters that train (``--train norms`` or
    ``full``), whose starting values it holds (copies) and puts in for its forwards."""

    def __init__(self, model, cut: Cut, trained: Iterable[nn.Parameter] = ()):
        self.model, self.cut = model, cut
        self.frozen = [(p, p.detach().clone()) for p in trained]

    @property
    def nbytes(self) -> int:
        """What it holds beyond the student: the removed blocks and the frozen copies."""
        return self.cut.nbytes + _nbytes(t for _, t in self.frozen)

    @torch.no_grad()
    def targets(self, inputs: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        with self.assembled():
            return _logits(self.model, inputs)

    @contextmanager
    def assembled(self):
        """While active, ``model`` computes the model before the cut."""
        base = _base(self.model)
        path = layout(base).layers_path
        kept = base.get_submodule(path)
        ref = next(kept.parameters())
        rest = iter(kept)
        whole = nn.ModuleList([self.cut.blocks[i].to(device=ref.device, dtype=ref.dtype) if i in self.cut.blocks
                               else next(rest) for i in range(self.cut.layers)])
        if len(whole) != len(kept) + len(self.cut.blocks):
            raise SurgeryError(f"the teacher's cut removed {len(self.cut.blocks)} of {self.cut.layers} blocks and "
                               f"the student has {len(kept)}")
        now = {k: getattr(base.config, k, None) for k in self.cut.config}
        off = self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else nullcontext()
        try:
            base.set_submodule(path, whole)
            renumber(whole)
            _set(base.config, self.cut.config)
            self._swap()
            with off, evaluating(self.model):
                yield
        finally:
            self._swap()
            _set(base.config, now)
            base.set_submodule(path, kept)
            renumber(kept)

    def _swap(self) -> None:
        """The trained parameters' values and the frozen copies exchanged (twice: as they were)."""
        for i, (p, held) in enumerate(self.frozen):
            held = held.to(p.device)
            self.frozen[i] = (p, p.data)
            p.data = held


def _set(config, values: dict) -> None:
    for k, v in values.items():
        setattr(config, k, v)


def frozen_distillation(model, objective: str, temperature: float = 1.0,
                        ce_weight: float = 1.0) -> Distillation | None:
    """A trained pass's objective: None for ``ce`` (no teacher held), else a :class:`Distillation`
    from a frozen copy of ``model`` as it is now (the pass's input: taken before the pass changes it)."""
    if objective == "ce":
        return None
    return Distillation(Frozen(copy.deepcopy(model)), objective, temperature, ce_weight)


class Frozen:
    """A live :class:`Teacher` that is a model of its own (``--teacher`` not sharing the student's
    blocks): frozen, in eval mode, moved where the inputs are on first use."""

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)

    @property
    def nbytes(self) -> int:
        return _nbytes([*self.model.parameters(), *self.model.buffers()])

    @torch.no_grad()
    def targets(self, inputs: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        return _logits(self.model.to(inputs.device), inputs)
