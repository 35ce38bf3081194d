"""heal: repair a pruned model with LoRA on its remaining linear layers, then merge.

Every targeted linear W (inside the blocks, never the embeddings or the LM head) becomes
W + (alpha / r) B A with A: r x in, B: out x r, B = 0 at the start, so training starts from the
pruned model's exact function. Only A and B train, on the language-modelling loss:
- causal models: CE(logits_t, x_{t+1}) averaged over positions;
- BERT: masked LM, 15% of positions predicted (of those 80% [MASK], 10% a random token,
  10% unchanged), CE averaged over the predicted positions.
Held-out CE is the same loss on fixed windows (fixed masks for BERT), before and after.
Merging writes W + (alpha / r) B A back into W: a plain checkpoint of the same architecture.

Runs under accelerate: one CPU, one GPU or several processes (``accelerate launch``), with
gradient accumulation and bf16 autocast where the device supports it.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .families import layout, stock_class_of
from .layout import LM_OBJECTIVES
from .errors import SurgeryError

MLM_FRACTION = 0.15
StepProgress = Callable[[int, int, float], None]


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


def is_masked_lm(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps it
    return layout(base).objective == "masked-lm"


def make_accelerator(mixed_precision: str = "auto", grad_accum: int = 1):
    """An Accelerator; ``auto`` means bf16 on a GPU that supports it, else full precision.
    Without a GPU it asks for the CPU, so ``torchrun``/``accelerate launch`` processes join one
    multi-CPU group."""
    from accelerate import Accelerator

    if mixed_precision == "auto":
        mixed_precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    if mixed_precision not in ("no", "bf16", "fp16"):
        raise SurgeryError(f"unknown precision {mixed_precision!r}; choose auto, no, bf16 or fp16")
    if grad_accum < 1:
        raise SurgeryError(f"gradient accumulation needs at least 1 step, got {grad_accum}")
    try:
        return Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=grad_accum,
                           cpu=not torch.cuda.is_available())
    except ValueError as e:  # accelerate's state is per process: its precision is fixed once set
        raise SurgeryError(str(e)) from None


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


def _mask(ids: torch.Tensor, mask_id: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of ``ids`` [..., T]: (inputs, labels with -100 where nothing is predicted)."""
    pick = torch.rand(ids.shape, generator=gen) < MLM_FRACTION
    pick[..., 0] |= ~pick.any(-1)  # predict at least one position per window
    r = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[pick & (r < 0.8)] = mask_id
    rand = pick & (r >= 0.8) & (r < 0.9)
    inputs[rand] = torch.randint(0, vocab, ids.shape, generator=gen)[rand]
    return inputs, torch.where(pick, ids, torch.full_like(ids, -100))


class _Windows(torch.utils.data.Dataset):
    """``count`` random windows of ``length`` tokens of ``ids``; item i depends only on (seed, i)."""

    def __init__(self, ids: torch.Tensor, length: int, count: int, seed: int, mlm: tuple[int, int] | None):
        self.ids, self.length, self.count, self.seed, self.mlm = ids, length, count, seed, mlm

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, len(self.ids) - self.length + 1, (1,), generator=gen))
        w = self.ids[start:start + self.length]
        if self.mlm:
            return _mask(w, *self.mlm, gen)
        return w, w


def _loss_sum(model, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token CEs in float32, number of predicted tokens)."""
    causal = not is_masked_lm(model)
    kw = {"use_cache": False} if causal else {}
    logits = model(input_ids=inputs, **kw).logits
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def require_lm(model) -> None:
    """Cross-entropy and healing need a language-modelling head (a causal or masked LM)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    objective = layout(base).objective
    if objective not in LM_OBJECTIVES:
        raise SurgeryError(f"{stock_class_of(base).__name__} has no language-modelling head (objective: "
                           f"{objective}): cross-entropy and heal need a causal or masked LM")


def _mlm_spec(model, mask_token_id: int | None) -> tuple[int, int] | None:
    require_lm(model)
    if not is_masked_lm(model):
        return None
    if mask_token_id is None:
        raise SurgeryError("a masked language model needs its tokenizer's mask token to heal")
    return mask_token_id, model.config.vocab_size


@torch.no_grad()
def heldout_ce(model, windows: torch.Tensor, *, mask_token_id: int | None = None, batch_size: int = 8,
               autocast=None) -> float:
    """Mean CE (nats/token) on ``windows`` [n, T]: next-token, or masked-token for BERT
    (with masks fixed by seed, so every model sees the same ones)."""
    mlm = _mlm_spec(model, mask_token_id)
    if mlm:
        inputs, labels = _mask(windows, *mlm, torch.Generator().manual_seed(0))
    else:
        inputs, labels = windows, windows
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    try:
        for s in range(0, len(windows), batch_size):
            with autocast() if autocast else nullcontext():
                loss, n = _loss_sum(model, inputs[s:s + batch_size].to(device), labels[s:s + batch_size].to(device))
            total, count = total + loss.item(), count + n.item()
    finally:
        model.train(was_training)
    return total / count


def heal_model(model, train_ids: torch.Tensor, eval_windows: torch.Tensor, *, steps: int = 200,
               seq_len: int = 128, batch_size: int = 8, rank: int = 8, alpha: float | None = None,
               lr: float = 2e-3, target_modules: list[str] | None = None, mask_token_id: int | None = None,
               merge: bool = True, seed: int = 0, accelerator=None,
               progress: StepProgress = lambda step, total, loss: None):
    """Train LoRA adapters (rank ``rank``, scale ``alpha / rank``, alpha defaulting to 2 rank) on
    random ``seq_len`` windows of ``train_ids`` for ``steps`` optimizer steps of ``batch_size``
    windows x gradient-accumulation steps x processes. AdamW, linear warm-up over the first
    10% of steps, then cosine decay to lr / 10.

    Returns (model, HealReport): the merged plain model, or the peft model when ``merge=False``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    if steps < 1:
        raise SurgeryError(f"--steps must be at least 1, got {steps}")
    if rank < 1:
        raise SurgeryError(f"--rank must be at least 1, got {rank}")
    if len(train_ids) < seq_len:
        raise SurgeryError(f"the training text has {len(train_ids)} tokens, fewer than one sequence of {seq_len}")
    acc = accelerator or make_accelerator()
    mlm = _mlm_spec(model, mask_token_id)
    alpha = float(2 * rank if alpha is None else alpha)
    pattern = target_pattern(model, target_modules)
    conv1d = any(isinstance(m, Conv1D) for n, m in model.named_modules() if re.fullmatch(pattern, n))
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                      target_modules=pattern, fan_in_fan_out=conv1d))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    targets = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    accum = acc.gradient_accumulation_steps
    data = _Windows(train_ids, seq_len, steps * accum * batch_size * acc.num_processes, seed, mlm)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    peft_model, optimizer, loader = acc.prepare(peft_model, optimizer, loader)
    inner = acc.unwrap_model(peft_model)
    ce_before = heldout_ce(inner, eval_windows, mask_token_id=mask_token_id, batch_size=batch_size,
                           autocast=acc.autocast)
    peft_model.train()
    losses, step, running, window_loss = [], 0, None, []
    t0 = time.perf_counter()
    for inputs, labels in loader:
        with acc.accumulate(peft_model), acc.autocast():
            loss_sum, n = _loss_sum(peft_model, inputs, labels)
            loss = loss_sum / n.clamp_min(1)
            acc.backward(loss)
            window_loss.append(loss.item())
            if acc.sync_gradients:
                acc.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            scheduler.step()
            losses.append(sum(window_loss) / len(window_loss))
            window_loss = []
            running = losses[-1] if running is None else 0.9 * running + 0.1 * losses[-1]
            step += 1
            progress(step, steps, running)
    seconds = time.perf_counter() - t0
    ce_after = heldout_ce(inner, eval_windows, mask_token_id=mask_token_id, batch_size=batch_size,
                          autocast=acc.autocast)
    tokens = step * accum * batch_size * acc.num_processes * seq_len
    report = HealReport(ce_before, ce_after, step, tokens, tokens / len(train_ids), seconds, rank, alpha, lr, sum(p.numel() for p in params), targets,
                        acc.mixed_precision, acc.num_processes, losses)
    inner.eval()
    return (inner.merge_and_unload() if merge else inner), report
