"""heal: repair a pruned model with LoRA on its remaining linear layers, then merge.

Every targeted linear W (inside the blocks, never the embeddings or the LM head) becomes
W + (alpha / r) B A with A: r x in, B: out x r, B = 0 at the start, so training starts from the
pruned model's exact function. Only A and B train, on the language-modelling loss:
- causal models: CE(logits_t, x_{t+1}) averaged over positions;
- BERT: masked LM, 15% of positions predicted (of those 80% [MASK], 10% a random token,
  10% unchanged), CE averaged over the predicted positions.
Held-out CE is the same loss on fixed windows (fixed masks for BERT), before and after.
Merging writes W + (alpha / r) B A back into W: a plain checkpoint of the same architecture.

Training is :func:`normsurgery.training.train` (accelerate, several processes, gradient
accumulation, bf16 autocast where the device has it); only the adapters train.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .errors import SurgeryError
from .families import layout
from .training import StepProgress, TrainConfig, heldout_ce, make_accelerator, objective_of, train

__all__ = ["HealReport", "heal_model", "heldout_ce", "linear_targets", "make_accelerator", "require_lm",
           "target_pattern"]


@dataclass
class HealReport:
    ce_before: float
    ce_after: float
    steps: int
    tokens: int  # tokens trained on, all processes together
    epochs: float  # tokens / training-text tokens: how many times over the text was read
    seconds: float
    rank: int
    alpha: float
    lr: float
    trainable_parameters: int
    target_modules: int
    mixed_precision: str
    processes: int
    losses: list[float] = field(default_factory=list)  # mean training loss of each step

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        return d


def linear_targets(model) -> list[str]:
    """Names of every linear layer (nn.Linear or GPT-2's Conv1D) inside the blocks."""
    from transformers.pytorch_utils import Conv1D

    prefix = layout(model).layers_path + "."
    return [n for n, m in model.named_modules()
            if n.startswith(prefix) and isinstance(m, (nn.Linear, Conv1D))]


def target_pattern(model, names: list[str] | None = None) -> str:
    """A peft regex (full match) for the linears of the blocks whose name ends with one of
    ``names`` (all of them when None)."""
    lin = linear_targets(model)
    prefix = layout(model).layers_path + "."
    rel = sorted({n[len(prefix):].split(".", 1)[1] for n in lin})
    if names:
        wanted = [r for r in rel if any(r == t or r.endswith("." + t) for t in names)]
        if not wanted:
            choices = sorted({r.rsplit(".", 1)[-1] for r in rel})
            raise SurgeryError(f"no linear layer in the blocks matches {', '.join(names)}; "
                               f"they are named {', '.join(choices)}")
        rel = wanted
    return rf"{re.escape(prefix)}\d+\.({'|'.join(re.escape(r) for r in rel)})"


def require_lm(model) -> None:
    """Cross-entropy and healing need a language-modelling head (a causal or masked LM)."""
    objective_of(model)


def heal_model(model, train_ids: torch.Tensor, eval_windows: torch.Tensor, *, steps: int = 200,
               seq_len: int = 128, batch_size: int = 8, rank: int = 8, alpha: float | None = None,
               lr: float = 2e-3, target_modules: list[str] | None = None, mask_token_id: int | None = None,
               merge: bool = True, seed: int = 0, grad_accum: int = 1, accelerator=None,
               progress: StepProgress = lambda step, total, loss: None):
    """Train LoRA adapters (rank ``rank``, scale ``alpha / rank``, alpha defaulting to 2 rank) on
    random ``seq_len`` windows of ``train_ids`` for ``steps`` optimizer steps of ``batch_size``
    windows x ``grad_accum`` x processes. AdamW, linear warm-up over the first 10% of steps,
    then cosine decay to lr / 10.

    Returns (model, HealReport): the merged plain model, or the peft model when ``merge=False``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    if rank < 1:
        raise SurgeryError(f"--rank must be at least 1, got {rank}")
    config = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, grad_accum=grad_accum,
                         seed=seed, eval_batch_size=batch_size)
    config.check()
    objective = objective_of(model)
    alpha = float(2 * rank if alpha is None else alpha)
    pattern = target_pattern(model, target_modules)
    conv1d = any(isinstance(m, Conv1D) for n, m in model.named_modules() if re.fullmatch(pattern, n))
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                      target_modules=pattern, fan_in_fan_out=conv1d))
    targets = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    result = train(peft_model, train_ids, eval_windows, config, objective=objective, mask_token_id=mask_token_id,
                   progress=progress, accelerator=accelerator)
    report = HealReport(result.ce_before, result.ce_after, result.steps, result.tokens,
                        result.tokens / len(train_ids), result.seconds, rank, alpha, lr,
                        result.trainable_parameters, targets, result.precision, result.processes, result.losses)
    return (peft_model.merge_and_unload() if merge else peft_model), report
