"""Distillation losses, pure functions over logits (Hinton et al. 2015; Minitron; Puzzle).

Per predicted position t, with p = softmax(z_teacher / T) and q = softmax(z_student / T):

    KD_t = T^2 * KL(p || q) = T^2 * sum_v p(v) (log p(v) - log q(v))

(forward KL, teacher first; T^2 keeps the gradients' scale across temperatures). Losses are
returned as (sum over the positions ``mask`` selects, number of those positions), like the
training loop's cross-entropy, so micro-batches and processes average the same way.

A teacher need not be held whole: :class:`TopK` keeps, per position, the k largest teacher
log-probabilities at temperature T and their token ids, and the log of the remaining mass as one
tail bucket; the student's distribution is folded to the same k + 1 outcomes. At k = vocabulary
the tail is empty and the loss is the full KL. Bytes per position: k x (4 + 4) + 4 in float32 and
int32.

Blockwise local distillation (Puzzle) trains block i of the student on the teacher's block
inputs h: the normalised MSE of the block's update,
``||f_S(h) - f_T(h)||^2 / ||f_T(h) - h||^2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import OBJECTIVES  # noqa: F401  (declared with heal's options: no torch there)

#: log of the tail mass below which the tail bucket counts as empty (k = vocabulary)
_EMPTY = -1e30


@dataclass
class TopK:
    """A teacher's distribution at temperature ``temperature`` reduced per position to its k most
    likely tokens (``logp`` [..., k] float32, ``ids`` [..., k] int64) and the log of the rest of its
    mass (``tail`` [...], -inf where nothing remains)."""

    logp: torch.Tensor
    ids: torch.Tensor
    tail: torch.Tensor
    temperature: float

    @property
    def k(self) -> int:
        return self.logp.shape[-1]

    def to(self, device) -> "TopK":
        return TopK(self.logp.to(device), self.ids.to(device), self.tail.to(device), self.temperature)

    def __getitem__(self, index) -> "TopK":
        return TopK(self.logp[index], self.ids[index], self.tail[index], self.temperature)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it (Maechler 2012); x is kept below
    -tiny, so the result stays finite (about -87 at most) and so do its gradients."""
    x = x.clamp(max=-torch.finfo(torch.float32).tiny)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def top_k(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopK:
    """The :class:`TopK` of ``teacher_logits`` [..., V] (k clipped to V)."""
    logp = _log_probs(teacher_logits, temperature)
    top, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    tail = _log1mexp(torch.logsumexp(top, dim=-1))
    if top.shape[-1] == logp.shape[-1]:
        tail = torch.full_like(tail, -torch.inf)
    return TopK(top, ids, tail, temperature)


def _selected(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if mask is None:
        return x.sum(), torch.tensor(x.numel(), device=x.device)
    return (x * mask).sum(), mask.sum()


def kd_loss_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over masked positions of T^2 KL(p_teacher || q_student), their number), in float32;
    ``student_logits`` and ``teacher_logits`` [..., V], ``mask`` [...] (bool; None: every position)."""
    logq = _log_probs(student_logits, temperature)
    logp = _log_probs(teacher_logits, temperature)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    total, count = _selected(kl, None if mask is None else mask.to(kl.dtype))
    return total * temperature ** 2, count


def kd_top_k_loss_sum(student_logits: torch.Tensor, teacher: TopK,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kd_loss_sum` against a :class:`TopK` teacher: the KL of the k + 1 outcomes (the k
    tokens, the rest), the student's distribution folded to them, at the teacher's temperature."""
    logq_all = _log_probs(student_logits, teacher.temperature)
    logq = logq_all.gather(-1, teacher.ids)
    has_tail = teacher.tail > _EMPTY
    # where no tail remains the student's is not computed (its log would be -inf, its gradient inf)
    logq_tail = _log1mexp(torch.where(has_tail, torch.logsumexp(logq, dim=-1), torch.full_like(teacher.tail, -1.0)))
    kl = (teacher.logp.exp() * (teacher.logp - logq)).sum(-1)
    tail_p = torch.where(has_tail, teacher.tail.exp(), torch.zeros_like(teacher.tail))
    tail_term = torch.where(has_tail, tail_p * (teacher.tail - logq_tail), torch.zeros_like(tail_p))
    total, count = _selected(kl + tail_term, None if mask is None else mask.to(kl.dtype))
    return total * teacher.temperature ** 2, count


def block_nmse(student_out: torch.Tensor, teacher_out: torch.Tensor, block_in: torch.Tensor) -> torch.Tensor:
    """||f_S(h) - f_T(h)||^2 / ||f_T(h) - h||^2 over the whole batch, in float32: the share of the
    teacher block's update the student misses (0: the same block; 1: as far as the identity)."""
    update = (teacher_out.float() - block_in.float()).pow(2).sum()
    return (student_out.float() - teacher_out.float()).pow(2).sum() / update.clamp_min(torch.finfo(torch.float32).tiny)


def mean_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            mask: torch.Tensor | None = None) -> float:
    """KL(teacher || student) at temperature 1 averaged over the masked positions, in nats: the
    distance to the original a heal reports."""
    total, count = kd_loss_sum(student_logits, teacher_logits, 1.0, mask)
    return (total / count.clamp_min(1)).item()
