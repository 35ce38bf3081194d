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

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ..core.distillation import OBJECTIVES, TopK, kd_loss_sum, kd_top_k_loss_sum
from ..core.errors import SurgeryError

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
