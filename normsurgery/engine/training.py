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
``fully_shard`` for the steps (:class:`Shards`), each process holding 1/N of the weights,
gradients and AdamW moments, and every process is given the whole model back after them. Only
the main process writes the state (a sharded run: each process its shard) and reports progress.
The model trains on the accelerator's device (the one ``devices.choose`` made current) and is
given back where it was found. Precision
(``devices.PRECISIONS``): ``auto`` is bf16 autocast on a GPU that supports it, float32 elsewhere.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from ..core import devices
from ..core.analysis import evaluating
from ..core.devices import make_accelerator, mixed_precision  # noqa: F401  (the API's names)
from ..core.errors import SurgeryError
from ..core.families import layout, stock_class_of
from ..core.layout import LM_OBJECTIVES

MLM_FRACTION = 0.15
STATE_FILE = "train-state.pt"

#: (step done, total steps, running training loss), called on the main process only
StepProgress = Callable[[int, int, float], None]
#: (step about to run, unwrapped model) -> metrics to log (or None); runs before the step's forwards
OnStep = Callable[[int, Any], "dict[str, Any] | None"]


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8  # windows per micro-batch and process
    seq_len: int = 128
    lr: float = 1e-4
    min_lr: float | None = None  # end of the cosine; default lr / 10
    warmup: int | None = None  # warm-up steps; default steps // 10 (at least 1)
    weight_decay: float = 0.0
    grad_accum: int = 1
    clip: float = 1.0  # gradient-norm clipping (0: none)
    precision: str = "auto"  # devices.PRECISIONS
    seed: int = 0
    eval_every: int = 0  # held-out CE every this many steps (0: before and after only)
    eval_steps: tuple[int, ...] = ()  # and after these steps
    eval_batch_size: int = 8
    save_every: int = 0  # training state every this many steps (0: never)
    state_dir: Path | None = None
    resume: bool = False
    patience: int = 0  # stop once held-out CE went this many evaluations without improving (0: run every step)
    min_delta: float = 1e-3  # what counts as improving, in nats
    settle: int = 0  # evaluations before this step do not count (a schedule still changing the model)

    def check(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise SurgeryError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise SurgeryError(f"a sequence needs at least 2 tokens, got seq_len {self.seq_len}")
        if not self.lr > 0:
            raise SurgeryError(f"--lr must be positive, got {self.lr:g}")
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


# ----------------------------------------------------------------------------- processes

def is_main_process() -> bool:
    """False in every process but the first of a distributed group."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0


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


def loss_sum(model, inputs: torch.Tensor, labels: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token CEs in float32, number of predicted tokens). ``model`` may be wrapped."""
    logits = model(input_ids=inputs, **({"use_cache": False} if causal else {})).logits
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


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
               mask_token_id: int | None = None, autocast=None) -> float:
    """Mean CE (nats/token) on ``windows`` [n, T] in eval mode: next-token, or masked-token with
    masks fixed by seed (every model sees the same ones). ``objective`` defaults to the model's."""
    objective = objective or objective_of(model)
    mlm = _mlm_spec(objective, model, mask_token_id)
    inputs, labels = mask_tokens(windows, *mlm, torch.Generator().manual_seed(0)) if mlm else (windows, windows)
    total, count = 0.0, 0
    device = next(model.parameters()).device  # where it is now (tests stand devices.of in for home)
    with evaluating(model):
        for s in range(0, len(windows), batch_size):
            with autocast() if autocast else nullcontext():
                loss, n = loss_sum(model, inputs[s:s + batch_size].to(device), labels[s:s + batch_size].to(device),
                                   mlm is None)
            total, count = total + loss.item(), count + n.item()
    return total / count


# ----------------------------------------------------------------------------- state

def _fingerprint(config: TrainConfig, ids: torch.Tensor, objective: str, processes: int) -> str:
    keys = ("steps", "batch_size", "seq_len", "lr", "min_lr", "warmup", "weight_decay", "grad_accum", "clip",
            "precision", "seed")
    text = repr(([getattr(config, k) for k in keys], objective, processes, len(ids)))
    return hashlib.sha256(text.encode() + ids.cpu().numpy().tobytes()).hexdigest()[:16]


def _save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_state(config: TrainConfig, fingerprint: str, shards: int | None) -> dict:
    """The state kept in ``config.state_dir``, refused in one line when another run's, or kept
    sharded over another number of processes than ``shards`` (None: not sharded)."""
    path = Path(config.state_dir) / STATE_FILE
    if not path.is_file():
        raise SurgeryError(f"nothing to resume: no training state at {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    kept = state.get("shards")
    if kept != shards:
        how = f"sharded over {kept} processes (FSDP)" if kept else "not sharded"
        now = "is not" if not shards else f"over {shards}" if kept else f"is, over {shards} processes"
        raise SurgeryError(f"the training state at {path} is {how} and this run {now}: resume it "
                           f"{f'with {kept} processes under FSDP' if kept else 'without FSDP'}, or start afresh "
                           "without --resume")
    if state.get("fingerprint") != fingerprint:
        raise SurgeryError(f"the training state at {path} is from another run (other text, options or process "
                           "count); resume with the same ones or start afresh without --resume")
    return state


def _shard_file(state_dir, step: int, rank: int, procs: int) -> Path:
    """Process ``rank``'s shard of the state at ``step`` (a file per step: the one the state names
    survives an interrupted save)."""
    return Path(state_dir) / f"train-state.step{step}.rank{rank}-of-{procs}.pt"


# ----------------------------------------------------------------------------- sharding (FSDP2)

#: a module's hook tables (fully_shard adds to them; :meth:`Shards.whole` takes its entries out)
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def _local(obj):
    """``obj`` (a state dict, nested) with every DTensor replaced by this process's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj.to_local() if isinstance(obj, DTensor) else obj


def _like(t, template):
    """A shard ``t`` as a DTensor laid out as ``template`` (itself where ``template`` is not one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor) or t.ndim != template.ndim:
        return t
    return DTensor.from_local(t.to(template.device), template.device_mesh, template.placements,
                              shape=template.shape, stride=template.stride())


def _from_main(model, whole: dict) -> None:
    """Load the main process's ``whole`` state dict (empty elsewhere) into the sharded ``model``:
    each process receives its shards of each tensor in turn (ties kept: one parameter per tensor)."""
    from torch import nn
    from torch.distributed.tensor import DTensor, distribute_tensor

    state, made = {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in made:
            device = torch.device(t.device_mesh.device_type) if isinstance(t, DTensor) else t.device
            full = whole[key].to(device) if whole else torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, DTensor):
                made[id(t)] = nn.Parameter(distribute_tensor(full, t.device_mesh, t.placements),
                                           requires_grad=t.requires_grad)
            else:
                torch.distributed.broadcast(full, 0)
                made[id(t)] = full
        state[key] = made[id(t)]
    model.load_state_dict(state, assign=True)


class Shards:
    """``model`` sharded in place over the processes for training (FSDP2): each block, then the
    whole model (embeddings, final norm, head), wrapped with ``fully_shard`` under ``policy``
    (``devices.shard_policy``), each process's shards sent by the main process (the others may
    hold the model on the meta device: ``runner.Job.load``). :meth:`whole` gives every process the
    whole model back as it was: plain parameters, its classes and hooks."""

    def __init__(self, model, policy):
        from torch.distributed.fsdp import fully_shard

        self.model = model
        self.before = {m: (type(m), set(vars(m)), {h: set(getattr(m, h)) for h in _HOOKS}) for m in model.modules()}
        whole = model.state_dict() if is_main_process() else {}  # the others' may wait on the meta device
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for block in base.get_submodule(layout(base).layers_path).children():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        _from_main(model, whole)

    def whole(self) -> None:
        """Every parameter gathered whole in every process, and fully_shard's changes undone."""
        from torch import nn
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        gathered: dict[int, nn.Parameter] = {}
        for m in self.model.modules():  # the same order in every process: one all-gather at a time
            for name, p in m._parameters.items():
                if isinstance(p, DTensor):
                    if id(p) not in gathered:
                        gathered[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                    m._parameters[name] = gathered[id(p)]
        for m, (cls, attrs, hooks) in self.before.items():
            m.__class__ = cls
            for a in set(vars(m)) - attrs:
                if a.startswith(("__composable_api", "_is_fsdp", "_fsdp")):
                    delattr(m, a)
            for h, keys in hooks.items():
                table = getattr(m, h)
                for k in set(table) - keys:
                    del table[k]
            _module_state_mapping.pop(m, None)

    def local_state(self, optimizer) -> dict:
        """This process's shards of the model's and ``optimizer``'s states, plain tensors."""
        return {"model": _local(self.model.state_dict()), "optimizer": _local(optimizer.state_dict())}

    def load_local(self, state: dict, optimizer) -> None:
        """:meth:`local_state`'s shards put back into the sharded model and ``optimizer``."""
        template = self.model.state_dict()
        self.model.load_state_dict({k: _like(v, template[k]) for k, v in state["model"].items()})
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = state["optimizer"]
        optimizer.load_state_dict({**saved, "state": {i: {k: _like(v, params[i]) for k, v in s.items()}
                                                      for i, s in saved["state"].items()}})


# ----------------------------------------------------------------------------- the loop

def train(model, train_ids: torch.Tensor, heldout: torch.Tensor, config: TrainConfig | dict, *,
          objective: str = "causal-lm", mask_token_id: int | None = None, on_step: OnStep | None = None,
          params: Iterable[torch.nn.Parameter] | None = None, progress: StepProgress | None = None,
          accelerator=None, extra_loss: Callable[[], "torch.Tensor | None"] | None = None) -> TrainResult:
    """Fine-tune ``model`` in place on random windows of the 1-D token stream ``train_ids``;
    held-out CE on the fixed windows ``heldout`` [n, T] before, after and on ``config``'s
    evaluation steps (``config`` may be a dict of TrainConfig's fields). ``params``: what
    trains (default every parameter that requires grad).

    ``on_step(step, model)`` runs at the start of each optimizer step, before its forwards; it
    must depend only on ``step`` and the model's state (a resumed run skips the earlier calls);
    the metrics it returns go into the next curve row.

    ``extra_loss()``, called after each training forward, gives a term (or None) added to that
    micro-batch's loss before the backward (remove-ln's auxiliary loss on the final norm's input,
    computed in that forward); the training losses reported stay the LM loss alone.

    Training runs on ``accelerator``'s device (default: an accelerator where the model is, with
    ``config.precision``), sharded over its processes where FSDP is asked (``devices.sharding``);
    the model is given back whole, on the device it was found on.
    """
    config = TrainConfig(**config) if isinstance(config, dict) else config
    config.check()
    train_ids = torch.as_tensor(train_ids).reshape(-1).cpu()
    if len(train_ids) < config.seq_len:
        raise SurgeryError(f"the training text has {len(train_ids)} tokens, fewer than one sequence of "
                           f"{config.seq_len} (give more text, or shorter windows: a smaller seq_len)")
    home = devices.of(model)
    acc = accelerator or make_accelerator(config.precision, home)
    mlm = _mlm_spec(objective, model, mask_token_id)
    sharded = devices.sharding() and acc.num_processes > 1
    policy = devices.shard_policy(acc.mixed_precision) if sharded else None
    chosen = {id(p) for p in ((p for p in model.parameters() if p.requires_grad) if params is None else params)}
    check_fits(model, [p for p in model.parameters() if id(p) in chosen], acc.device,
               acc.num_processes if sharded else 1)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    names = {n for n, p in model.named_parameters() if id(p) in chosen}
    del params, chosen  # the parameters sharding replaces: none kept here
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    if not sharded:  # fully_shard places the shards
        model.to(acc.device)
    shards = Shards(model, policy) if sharded else None
    try:
        return _train(model, acc, train_ids, heldout, config, objective, mask_token_id, mlm, on_step,
                      [p for n, p in model.named_parameters() if n in names], progress, shards, extra_loss)
    finally:
        acc.free_memory()  # its references to this training's optimizer (and moments) and wrapped model
        if shards:
            shards.whole()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.to(home)


def training_bytes(model, params: list, device) -> int:
    """Device memory training needs at least (activations aside): the model's weights where they
    are not on ``device`` yet, and for every parameter that trains its gradient and AdamW's two
    moments (each the parameter's size)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if not devices.same(p.device, device))
    return weights + sum(3 * p.numel() * p.element_size() for p in params)


def check_fits(model, params: list, device, shards: int = 1) -> None:
    """Refuse, before anything moves, training that cannot fit a GPU's free memory, naming the
    limit and what would fit. Data parallel, each process holds all of it; sharded over
    ``shards`` processes (FSDP), each holds 1/``shards`` of it."""
    free = devices.free_bytes(device)
    if free is None:
        return
    need = training_bytes(model, params, device) // shards
    if need > free:
        n = sum(p.numel() for p in params)
        where = f"{device}, sharded over {shards} processes," if shards > 1 else device
        raise SurgeryError(f"training needs at least {need / 2**30:.1f} GiB on {where} (the weights, and the "
                           f"gradients and AdamW moments of the {n / 1e9:.2f}B parameters that train), and "
                           f"{free / 2**30:.1f} GiB are free: train fewer parameters (heal --train lora or norms), "
                           "shard the training state over more GPUs (accelerate launch --use_fsdp --fsdp_version 2 "
                           "--num_processes N), or train on the CPU (--device cpu)")


def _train(model, acc, train_ids, heldout, config: TrainConfig, objective: str, mask_token_id: int | None, mlm,
           on_step: OnStep | None, params, progress: StepProgress | None, shards: Shards | None,
           extra_loss=None) -> TrainResult:
    """:func:`train`'s loop, with the model on ``acc``'s device (sharded where ``shards``) and
    ``params`` alone requiring grad."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: config.lr_at(s) / config.lr)
    wrapped, optimizer = (model, optimizer) if shards else acc.prepare(model, optimizer)
    procs, rank, main = acc.num_processes, acc.process_index, acc.is_main_process
    evaluate = lambda: heldout_ce(model, heldout, config.eval_batch_size, objective,  # noqa: E731
                                  mask_token_id=mask_token_id, autocast=acc.autocast)
    fingerprint = _fingerprint(config, train_ids, objective, procs)
    state_path = Path(config.state_dir) / STATE_FILE if config.state_dir else None
    tokens_per_step = config.batch_size * config.grad_accum * procs * config.seq_len
    eval_at = set(config.eval_steps) | ({s for s in range(config.eval_every, config.steps, config.eval_every)}
                                       if config.eval_every else set())

    start, losses, curve, resumed = 0, [], [], None
    if config.resume:
        state = _load_state(config, fingerprint, procs if shards else None)
        if shards:
            local = torch.load(_shard_file(config.state_dir, state["step"], rank, procs), map_location="cpu",
                               weights_only=False)
            shards.load_local(local, optimizer)
            devices.restore_rng(local)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            devices.restore_rng(state)
        scheduler.load_state_dict(state["scheduler"])
        start = resumed = state["step"]
        losses, curve, ce_before = state["losses"], state["curve"], state["ce_before"]
    else:
        torch.manual_seed(config.seed)
        ce_before = evaluate()
        curve.append({"step": 0, "tokens": 0, "loss": None, "heldout_ce": ce_before, "lr": config.lr_at(0)})

    wrapped.train()
    metrics: dict[str, Any] = {}
    kept = resumed
    t0 = time.perf_counter()
    for step in range(start, config.steps):
        if on_step:
            metrics.update(on_step(step, model) or {})
        total = torch.zeros((), device=acc.device)
        for micro in range(config.grad_accum):
            inputs, labels = _batch(train_ids, config, step, micro, rank, procs, mlm)
            sync = micro == config.grad_accum - 1
            with (nullcontext() if sync else acc.no_sync(wrapped)), acc.autocast():
                s, n = loss_sum(wrapped, inputs.to(acc.device), labels.to(acc.device), mlm is None)
                loss = s / n.clamp_min(1) / config.grad_accum
                extra = extra_loss() if extra_loss else None
                acc.backward(loss if extra is None else loss + extra / config.grad_accum)
            total += loss.detach().float()
        if config.clip:
            acc.clip_grad_norm_(params, config.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(acc.reduce(total, "mean").item() if procs > 1 else total.item())
        done = step + 1
        if not math.isfinite(losses[-1]):
            raise SurgeryError(f"training diverged at step {done} of {config.steps}: the loss is {losses[-1]} (the "
                               f"last finite one {next((x for x in reversed(losses) if math.isfinite(x)), None)}); "
                               "nothing was saved: a lower --lr may hold")
        evaluated = done in eval_at or done == config.steps
        if evaluated:
            window = losses[curve[-1]["step"]:]
            curve.append({"step": done, "tokens": done * tokens_per_step,
                          "loss": sum(window) / len(window) if window else None, "heldout_ce": evaluate(),
                          "lr": config.lr_at(step), **metrics})
            metrics = {}
            wrapped.train()
        if evaluated and done < config.steps and config.patience and plateaued(
                curve, config.settle, config.patience, config.min_delta):
            if main and progress:
                progress(done, done, sum(losses[-10:]) / len(losses[-10:]))
            break
        if config.save_every and done % config.save_every == 0 and done < config.steps:
            common = {"fingerprint": fingerprint, "step": done, "scheduler": scheduler.state_dict(),
                      "losses": losses, "curve": curve, "ce_before": ce_before}
            if shards:
                _save_state(_shard_file(config.state_dir, done, rank, procs),
                            {**shards.local_state(optimizer), **devices.rng_state()})
                acc.wait_for_everyone()
                if main:
                    _save_state(state_path, {**common, "shards": procs})
                acc.wait_for_everyone()
                if kept is not None:  # the state now names this step's shards
                    _shard_file(config.state_dir, kept, rank, procs).unlink(missing_ok=True)
                kept = done
            elif main:
                _save_state(state_path, {**common, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                         **devices.rng_state()})
            acc.wait_for_everyone()
        if main and progress:
            progress(done, config.steps, sum(losses[-10:]) / len(losses[-10:]))
    seconds = time.perf_counter() - t0
    model.eval()
    ran = len(losses)
    return TrainResult(ran, ran * tokens_per_step, seconds, procs, acc.mixed_precision, ce_before,
                       curve[-1]["heldout_ce"], sum(p.numel() for p in params), resumed, losses, curve,
                       cap=config.steps if ran < config.steps else None)


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

