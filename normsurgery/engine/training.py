"""The one fine-tuning loop (heal, remove-ln, prepbn): accelerate, held-out CE, checkpoints.

Objective: the language-modelling loss in nats per predicted token,
- ``causal-lm``: CE(logits_t, x_{t+1}) averaged over positions;
- ``masked-lm``: 15% of positions predicted (of those 80% [MASK], 10% a random token, 10%
  unchanged), CE averaged over the predicted positions.

One optimizer step reads ``batch_size`` windows x ``grad_accum`` micro-batches x processes.
AdamW (weight decay on matrices only), linear warm-up to ``lr`` over ``warmup`` steps, then
cosine decay to ``min_lr``; gradients clipped to norm ``clip``. The ``batch_size`` x processes
windows of micro-batch ``m`` of step ``s`` are drawn from a generator seeded by (seed, s, m),
process ``r`` taking the ``r``-th ``batch_size`` of them: a run is a function of its
configuration alone, N processes of ``batch_size`` B read the windows one process of N B reads,
and ``resume`` from a state saved at step ``k`` (model, optimizer, scheduler, RNG) continues
exactly as the uninterrupted run would.

Processes: one CPU, one GPU, or several under ``torchrun`` / ``accelerate launch`` (gloo on
CPU, NCCL on GPUs; each process its own batches, gradients averaged). Data parallel, each
process holding the whole training state, unless accelerate's FSDP configuration asks to shard
it (``devices.sharding``): then each block, and the whole model, are wrapped with FSDP2's
``fully_shard`` for the steps (``processes.Shards``), each process holding 1/N of the weights,
gradients and AdamW moments, and every process is given the whole model back after them. Only
the main process writes the state (a sharded run: each process its shard) and reports progress.
The model trains on the accelerator's device (the one ``runner.choose_device`` made current) and is
given back where it was found. Precision
(``devices.PRECISIONS``): ``auto`` is bf16 autocast on a GPU that supports it, float32 elsewhere.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..core import devices
from ..core.analysis import evaluating
from ..core.devices import make_accelerator, mixed_precision  # noqa: F401  (the API's names)
from ..core.errors import SurgeryError
from ..core.families import layout, stock_class_of
from ..core.layout import LM_OBJECTIVES
from ..core.options import SEQ_LEN, HealOptions, check_values
from . import train_state
from .processes import Shards
from .teacher import EVAL, Distillation, Teacher, ce_sum, kd_sum, objective_sum, predicted, shifted

MLM_FRACTION = 0.15

#: (step done, total steps, running training loss), called on the main process only
StepProgress = Callable[[int, int, float], None]
#: (step about to run, unwrapped model) -> metrics to log (or None); runs before the step's forwards
OnStep = Callable[[int, Any], "dict[str, Any] | None"]


@dataclass
class TrainConfig:
    steps: int = HealOptions.steps
    batch_size: int = HealOptions.batch_size  # windows per micro-batch and process
    seq_len: int = SEQ_LEN
    lr: float = 1e-4
    min_lr: float | None = None  # end of the cosine; default lr / 10
    warmup: int | None = None  # warm-up steps; default steps // 10 (at least 1)
    weight_decay: float = 0.0
    grad_accum: int = HealOptions.grad_accum
    clip: float = 1.0  # gradient-norm clipping (0: none)
    precision: str = HealOptions.precision  # devices.PRECISIONS
    seed: int = HealOptions.seed
    eval_every: int = 0  # held-out CE every this many steps (0: before and after only)
    eval_steps: tuple[int, ...] = ()  # and after these steps
    eval_batch_size: int = HealOptions.batch_size
    save_every: int = 0  # training state every this many steps (0: never)
    state_dir: Path | None = None
    resume: bool = False
    patience: int = 0  # stop once held-out CE went this many evaluations without improving (0: run every step)
    min_delta: float = 1e-3  # what counts as improving, in nats
    settle: int = 0  # evaluations before this step do not count (a schedule still changing the model)

    def check(self) -> None:
        """The ranges ``core.options`` checks for every command (``check_values``), and what the
        other fields ask of each other."""
        check_values({k: getattr(self, k) for k in ("steps", "batch_size", "grad_accum", "seq_len", "lr")})
        if self.eval_batch_size < 1:  # no command's option: not in check_values
            raise SurgeryError(f"eval_batch_size must be at least 1, got {self.eval_batch_size}")
        if (self.save_every or self.resume) and self.state_dir is None:
            raise SurgeryError("saving or resuming training state needs a state directory")
        if self.patience and not (self.eval_every or self.eval_steps):
            raise SurgeryError("stopping when held-out CE stops improving needs evaluations during training "
                               "(eval_every)")

    @property
    def warmup_steps(self) -> int:
        return max(1, self.steps // 10) if self.warmup is None else self.warmup

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        w = self.warmup_steps
        if step < w:
            return self.lr * (step + 1) / w
        t = (step - w) / max(1, self.steps - w)
        return self.final_lr + (self.lr - self.final_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


@dataclass
class TrainResult:
    steps: int
    tokens: int  # tokens trained on, all processes together
    seconds: float  # wall time of the steps run in this call (a resumed run: since the resume)
    processes: int
    precision: str
    ce_before: float
    ce_after: float
    trainable_parameters: int
    resumed_from: int | None = None
    losses: list[float] = field(default_factory=list)  # mean training loss of each step
    curve: list[dict] = field(default_factory=list)  # one row per evaluation
    cap: int | None = None  # the steps allowed, when training stopped before them (held-out CE stopped improving)
    sharded: bool = False  # the training state sharded over the processes (FSDP2), not data-parallel
    kl_before: float | None = None  # held-out KL(teacher || model), where a teacher is given
    kl_after: float | None = None

    @property
    def tokens_per_second(self) -> float:
        done = self.steps - (self.resumed_from or 0)
        return self.tokens * done / self.steps / self.seconds if self.seconds and self.steps else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    def done(self) -> str:
        """What was trained, in words: "trained 120 steps (resumed at step 50: 70 in this run,
        ...)"."""
        resumed = (f"resumed at step {self.resumed_from}: {self.steps - self.resumed_from} in this run, "
                   if self.resumed_from else "")
        precision = "fp32" if self.precision == "no" else self.precision
        stopped = f" of at most {self.cap}, held-out CE having stopped improving" if self.cap else ""
        return (f"trained {self.steps} steps ({resumed}{self.tokens:,} tokens, {self.seconds:.0f} s, {precision}"
                f"{stopped})")


# ----------------------------------------------------------------------------- data and loss

def mask_tokens(ids: torch.Tensor, mask_id: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of ``ids`` [..., T]: (inputs, labels with -100 where nothing is predicted)."""
    pick = torch.rand(ids.shape, generator=gen) < MLM_FRACTION
    pick[..., 0] |= ~pick.any(-1)  # predict at least one position per window
    r = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[pick & (r < 0.8)] = mask_id
    rand = pick & (r >= 0.8) & (r < 0.9)
    inputs[rand] = torch.randint(0, vocab, ids.shape, generator=gen)[rand]
    return inputs, torch.where(pick, ids, torch.full_like(ids, -100))


def objective_of(model) -> str:
    """The Layout's objective of ``model`` (or of the model a peft wrapper holds)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    objective = layout(base).objective
    if objective not in LM_OBJECTIVES:
        raise SurgeryError(f"{stock_class_of(base).__name__} has no language-modelling head (objective: "
                           f"{objective}): cross-entropy and training need a causal or masked LM")
    return objective


def _mlm_spec(objective: str, model, mask_token_id: int | None) -> tuple[int, int] | None:
    if objective not in LM_OBJECTIVES:
        raise SurgeryError(f"unknown objective {objective!r}; choose {' or '.join(LM_OBJECTIVES)}")
    if objective == "causal-lm":
        return None
    if mask_token_id is None:
        raise SurgeryError("a masked language model needs its tokenizer's mask token to train")
    return mask_token_id, model.config.vocab_size


def loss_sum(model, inputs: torch.Tensor, labels: torch.Tensor, causal: bool,
             distillation: Distillation | None = None,
             at: tuple[int, int] = (EVAL, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """(the objective summed over the predicted tokens in float32, their number): CE, or with a
    distilling ``distillation`` its objective (``teacher.objective_sum``), the teacher asked for
    micro-batch ``at`` = (step, micro). ``model`` may be wrapped."""
    targets = None
    if distillation is not None and distillation.distils:  # first: a teacher may swap the student's tensors
        with torch.no_grad():
            targets = distillation.teacher.targets(inputs, *at)
    logits = model(input_ids=inputs, **({"use_cache": False} if causal else {})).logits
    return objective_sum(logits, labels, causal, distillation, targets)


def _batch(ids: torch.Tensor, config: TrainConfig, step: int, micro: int, rank: int, procs: int,
           mlm: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Process ``rank``'s windows (inputs, labels) of the micro-batch all ``procs`` processes read."""
    gen = torch.Generator().manual_seed(((config.seed * 1_000_003 + step) * 1_009 + micro) * 1_013)
    starts = torch.randint(0, len(ids) - config.seq_len + 1, (config.batch_size * procs,), generator=gen)
    w = torch.stack([ids[s:s + config.seq_len] for s in starts.tolist()])
    inputs, labels = mask_tokens(w, *mlm, gen) if mlm else (w, w)
    mine = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
    return inputs[mine], labels[mine]


@torch.no_grad()
def heldout_ce(model, windows: torch.Tensor, batch_size: int = 8, objective: str | None = None, *,
               mask_token_id: int | None = None, autocast=None, device=None) -> float:
    """Mean CE (nats/token) on ``windows`` [n, T] in eval mode: next-token, or masked-token with
    masks fixed by seed (every model sees the same ones). ``objective`` defaults to the model's,
    ``device`` (where the model is now) to ``devices.of(model)``."""
    return heldout(model, windows, batch_size, objective, mask_token_id=mask_token_id, autocast=autocast,
                   device=device)["ce"]


@torch.no_grad()
def heldout(model, windows: torch.Tensor, batch_size: int = 8, objective: str | None = None, *,
            mask_token_id: int | None = None, autocast=None, device=None, teacher: Teacher | None = None) -> dict:
    """:func:`heldout_ce` as {"ce": ...}, and with a ``teacher`` "kl": the mean KL(teacher || model)
    at temperature 1 over the same predicted tokens (``core.distillation.mean_kl``), from the same
    forwards; absent where the teacher cannot answer held-out windows (a cache)."""
    objective = objective or objective_of(model)
    mlm = _mlm_spec(objective, model, mask_token_id)
    inputs, labels = mask_tokens(windows, *mlm, torch.Generator().manual_seed(0)) if mlm else (windows, windows)
    ce, kl, count = 0.0, 0.0 if teacher is not None else None, 0
    device = device or devices.of(model)
    with evaluating(model):
        for i, s in enumerate(range(0, len(windows), batch_size)):
            x, y = inputs[s:s + batch_size].to(device), labels[s:s + batch_size].to(device)
            with autocast() if autocast else nullcontext():
                logits = model(input_ids=x, **({} if mlm else {"use_cache": False})).logits
                targets = teacher.targets(x, EVAL, i) if kl is not None else None
            scored, y, mask = predicted(logits, y, mlm is None)
            ce, count = ce + ce_sum(scored, y).item(), count + mask.sum().item()
            kl = None if targets is None else kl + kd_sum(scored, shifted(targets, mlm is None), mask, 1.0).item()
    return {"ce": ce / count, **({"kl": kl / count} if kl is not None else {})}


# ----------------------------------------------------------------------------- the loop

@dataclass
class Training:
    """What :func:`train` trains with beyond its configuration (its keyword arguments).

    ``objective`` (``causal-lm`` or ``masked-lm``, with the tokenizer's ``mask_token_id``);
    ``params``: what trains (default every parameter that requires grad).

    ``on_step(step, model)`` runs at the start of each optimizer step, before its forwards; it
    must depend only on ``step`` and the model's state (a resumed run skips the earlier calls);
    the metrics it returns go into the next curve row. ``progress(step, steps, loss)``: on the
    main process only.

    ``extra_loss()``, called after each training forward, gives a term (or None) added to that
    micro-batch's loss before the backward (remove-ln's auxiliary loss on the final norm's input,
    computed in that forward); the training losses reported stay the LM loss alone.

    ``accelerator``: where training runs (default: an accelerator where the model is, with
    ``config.precision``).

    ``distillation`` (``teacher.Distillation``): the loss is its objective (KL to its teacher, or
    KL plus weighted CE) instead of CE, and every evaluation measures the KL to the teacher beside
    the held-out CE; None: CE alone."""

    objective: str = "causal-lm"
    mask_token_id: int | None = None
    on_step: OnStep | None = None
    params: Iterable[torch.nn.Parameter] | None = None
    progress: StepProgress | None = None
    accelerator: Any = None
    extra_loss: Callable[[], "torch.Tensor | None"] | None = None
    distillation: Distillation | None = None


def train(model, train_ids: torch.Tensor, heldout: torch.Tensor, config: TrainConfig | dict, **given) -> TrainResult:
    """Fine-tune ``model`` in place on random windows of the 1-D token stream ``train_ids``;
    held-out CE on the fixed windows ``heldout`` [n, T] before, after and on ``config``'s
    evaluation steps (``config`` may be a dict of TrainConfig's fields). ``given``: the fields of
    :class:`Training` (objective, mask_token_id, on_step, params, progress, accelerator, extra_loss).

    Training runs on the accelerator's device, sharded over its processes where FSDP is asked
    (``devices.sharding``); the model is given back whole, on the device it was found on, and
    torch's global generators, which the loop seeds (``config.seed``) or a resumed run restores,
    as they were found.
    """
    run = Training(**given)
    config = TrainConfig(**config) if isinstance(config, dict) else config
    config.check()
    train_ids = torch.as_tensor(train_ids).reshape(-1).to(devices.HOST)
    if len(train_ids) < config.seq_len:
        raise SurgeryError(f"the training text has {len(train_ids)} tokens, fewer than one sequence of "
                           f"{config.seq_len} (give more text, or shorter windows: a smaller seq_len)")
    home = devices.of(model)
    acc = run.accelerator or make_accelerator(config.precision, home)
    _mlm_spec(run.objective, model, run.mask_token_id)  # refused before anything moves
    sharded = devices.sharding() and acc.num_processes > 1
    policy = devices.shard_policy(acc.mixed_precision) if sharded else None
    chosen = {id(p) for p in ((p for p in model.parameters() if p.requires_grad) if run.params is None
                              else run.params)}
    teacher = run.distillation.teacher if run.distillation else None
    if sharded and teacher is not None:
        raise SurgeryError("distillation (or KL to a teacher) with training sharded over processes (FSDP) is not "
                           "supported: heal --objective ce without a teacher, or data-parallel processes")
    check_fits(model, [p for p in model.parameters() if id(p) in chosen], acc.device,
               acc.num_processes if sharded else 1, getattr(teacher, "nbytes", 0))
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    names = {n for n, p in model.named_parameters() if id(p) in chosen}
    run.params = chosen = None  # the parameters sharding replaces: none kept here
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    if not sharded:  # fully_shard places the shards
        model.to(acc.device)
    shards = Shards(model, policy) if sharded else None
    try:
        params = [p for n, p in model.named_parameters() if n in names]
        with devices.rng_kept(acc.device):  # the loop seeds them (dropout): the caller's put back
            return _Loop(model, acc, (train_ids, heldout), config, run, params, shards).run()
    finally:
        acc.free_memory()  # its references to this training's optimizer (and moments) and wrapped model
        if shards:
            shards.whole()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.to(home)


def training_bytes(model, params: list, device, teacher: int = 0) -> int:
    """Device memory training needs at least (activations aside): the model's weights where they
    are not on ``device`` yet, for every parameter that trains its gradient and AdamW's two
    moments (each the parameter's size), and ``teacher`` bytes a teacher holds beyond the model
    (the blocks a cut removed; a frozen copy)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if not devices.same(p.device, device))
    return weights + sum(3 * p.numel() * p.element_size() for p in params) + teacher


def check_fits(model, params: list, device, shards: int = 1, teacher: int = 0) -> None:
    """Refuse, before anything moves, training that cannot fit a GPU's free memory, naming the
    limit and what would fit. Data parallel, each process holds all of it; sharded over
    ``shards`` processes (FSDP), each holds 1/``shards`` of it. ``teacher``: bytes a teacher adds."""
    free = devices.free_bytes(device)
    if free is None:
        return
    need = training_bytes(model, params, device, teacher) // shards
    if need > free:
        n = sum(p.numel() for p in params)
        where = f"{device}, sharded over {shards} processes," if shards > 1 else device
        raise SurgeryError(f"training needs at least {need / 2**30:.1f} GiB on {where} (the weights, "
                           f"{'the teacher, ' if teacher else ''}and the gradients and AdamW moments of the "
                           f"{n / 1e9:.2f}B parameters that train), and "
                           f"{free / 2**30:.1f} GiB are free: train fewer parameters (heal --train lora or norms), "
                           "shard the training state over more GPUs (accelerate launch --use_fsdp --fsdp_version 2 "
                           "--num_processes N), or train on the CPU (--device cpu)")


class _Loop:
    """:func:`train`'s loop, with the model on ``acc``'s device (sharded where ``shards``) and
    ``params`` alone requiring grad; ``data``: (the training tokens, the held-out windows)."""

    def __init__(self, model, acc, data: tuple[torch.Tensor, torch.Tensor], config: TrainConfig, run: Training,
                 params: list, shards: Shards | None):
        self.model, self.acc, self.config, self.training, self.params = model, acc, config, run, params
        self.shards = shards
        self.train_ids, self.heldout = data
        self.mlm = _mlm_spec(run.objective, model, run.mask_token_id)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: config.lr_at(s) / config.lr)
        self.wrapped, self.optimizer = (model, optimizer) if shards else acc.prepare(model, optimizer)
        self.procs, self.rank, self.main = acc.num_processes, acc.process_index, acc.is_main_process
        self.fingerprint = train_state.fingerprint(config, self.train_ids, _objective_key(run), self.procs)
        self.tokens_per_step = config.batch_size * config.grad_accum * self.procs * config.seq_len
        self.eval_at = set(config.eval_steps) | (
            {s for s in range(config.eval_every, config.steps, config.eval_every)} if config.eval_every else set())
        self.losses, self.curve, self.resumed, self.kept = [], [], None, None

    def evaluate(self) -> dict:
        """{"heldout_ce": ..., and "heldout_kl" with a teacher}: a curve row's measures."""
        d = self.training.distillation
        m = heldout(self.model, self.heldout, self.config.eval_batch_size, self.training.objective,
                    mask_token_id=self.training.mask_token_id, autocast=self.acc.autocast, device=self.acc.device,
                    teacher=d.teacher if d else None)
        return {"heldout_" + k: v for k, v in m.items()}

    def begin(self) -> int:
        """The step to start at: a resumed run's, or 0 (the held-out CE before measured)."""
        if self.config.resume:
            state = train_state.restore(self.config, self.fingerprint, self.model, self.optimizer, self.shards,
                                        self.acc)
            self.scheduler.load_state_dict(state["scheduler"])
            self.resumed = self.kept = state["step"]
            self.losses, self.curve = state["losses"], state["curve"]
            return state["step"]
        torch.manual_seed(self.config.seed)
        self.curve.append({"step": 0, "tokens": 0, "loss": None, **self.evaluate(), "lr": self.config.lr_at(0)})
        return 0

    def step(self, step: int) -> None:
        """One optimizer step: its micro-batches' forwards and backwards, its mean loss kept."""
        config, acc = self.config, self.acc
        total = torch.zeros((), device=acc.device)
        for micro in range(config.grad_accum):
            inputs, labels = _batch(self.train_ids, config, step, micro, self.rank, self.procs, self.mlm)
            sync = micro == config.grad_accum - 1
            with (nullcontext() if sync else acc.no_sync(self.wrapped)), acc.autocast():
                s, n = loss_sum(self.wrapped, inputs.to(acc.device), labels.to(acc.device), self.mlm is None,
                                self.training.distillation, (step, micro))
                loss = s / n.clamp_min(1) / config.grad_accum
                extra = self.training.extra_loss() if self.training.extra_loss else None
                acc.backward(loss if extra is None else loss + extra / config.grad_accum)
            total += loss.detach().float()
        if config.clip:
            acc.clip_grad_norm_(self.params, config.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        losses = self.losses
        losses.append(acc.reduce(total, "mean").item() if self.procs > 1 else total.item())
        if not math.isfinite(losses[-1]):
            raise SurgeryError(f"training diverged at step {step + 1} of {config.steps}: the loss is {losses[-1]} "
                               f"(the last finite one {next((x for x in reversed(losses) if math.isfinite(x)), None)}"
                               "); nothing was saved: a lower --lr may hold")

    def evaluated(self, step: int, metrics: dict) -> bool:
        """After step ``step``, the held-out CE where it is due, with ``metrics``: whether it was."""
        done, config = step + 1, self.config
        if not (done in self.eval_at or done == config.steps):
            return False
        window = self.losses[self.curve[-1]["step"]:]
        self.curve.append({"step": done, "tokens": done * self.tokens_per_step,
                           "loss": sum(window) / len(window) if window else None, **self.evaluate(),
                           "lr": config.lr_at(step), **metrics})
        self.wrapped.train()
        return True

    def run(self) -> TrainResult:
        config, progress = self.config, self.training.progress
        start = self.begin()
        self.wrapped.train()
        metrics: dict[str, Any] = {}
        t0 = time.perf_counter()
        for step in range(start, config.steps):
            if self.training.on_step:
                metrics.update(self.training.on_step(step, self.model) or {})
            self.step(step)
            done, recent = step + 1, sum(self.losses[-10:]) / len(self.losses[-10:])
            if self.evaluated(step, metrics):
                metrics = {}
                if done < config.steps and config.patience and plateaued(self.curve, config.settle, config.patience,
                                                                         config.min_delta):
                    if self.main and progress:
                        progress(done, done, recent)
                    break
            if config.save_every and done % config.save_every == 0 and done < config.steps:
                common = {"fingerprint": self.fingerprint, "step": done, "scheduler": self.scheduler.state_dict(),
                          "losses": self.losses, "curve": self.curve}
                self.kept = train_state.keep(config, common, self.model, self.optimizer, self.shards, self.acc,
                                             self.kept)
            if self.main and progress:
                progress(done, config.steps, recent)
        seconds = time.perf_counter() - t0
        self.model.eval()
        ran, first, last = len(self.losses), self.curve[0], self.curve[-1]
        return TrainResult(ran, ran * self.tokens_per_step, seconds, self.procs, self.acc.mixed_precision,
                           first["heldout_ce"], last["heldout_ce"], sum(p.numel() for p in self.params),
                           self.resumed, self.losses, self.curve, config.steps if ran < config.steps else None,
                           self.shards is not None, first.get("heldout_kl"), last.get("heldout_kl"))


def _objective_key(run: Training) -> str:
    """What of the objective a resumed run must share: the LM objective, and what it distils with."""
    d = run.distillation
    if d is None or not d.distils:
        return run.objective
    return f"{run.objective}/{d.objective}/{d.temperature!r}/{d.ce_weight!r}"


def plateaued(curve: list[dict], settle: int, patience: int, min_delta: float) -> bool:
    """Whether the held-out CE of the evaluations at or after step ``settle`` has gone ``patience``
    evaluations without improving its best so far by more than ``min_delta`` (the first of them
    is the reference)."""
    ces = [row["heldout_ce"] for row in curve if row["step"] >= settle]
    best, since = None, 0
    for ce in ces:
        if best is None or ce < best - min_delta:
            best, since = ce, 0
        else:
            since += 1
    return best is not None and since >= patience

