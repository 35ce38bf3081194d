"""heal: repair a pruned model with LoRA on its remaining linear layers, then merge.

``train`` chooses what trains: ``lora`` (below, the default), ``norms`` (only the gains and
biases of the Layout's norms, stream and per-head: thousands of parameters; the seed paper finds
LayerNorm moves most in fine-tuning) or ``full`` (every parameter). The last two train the
model's own tensors, so there is nothing to merge.

Every targeted linear W (inside the blocks, never the embeddings or the LM head) becomes
W + (alpha / r) B A with A: r x in, B: out x r, B = 0 at the start, so training starts from the
pruned model's exact function. Only A and B train, on the language-modelling loss:
- causal models: CE(logits_t, x_{t+1}) averaged over positions;
- BERT: masked LM, 15% of positions predicted (of those 80% [MASK], 10% a random token,
  10% unchanged), CE averaged over the predicted positions.
Held-out CE is the same loss on fixed windows (fixed masks for BERT), before and after, of the end
of the text, never trained on, and of a second text when one is given (--eval-text): healing beyond
the original on the first alone is adaptation to the text, not recovery (:func:`recovery`). The same
loss on as many fixed windows of the training text tells why held-out CE rose
(:attr:`HealReport.cause`: over-fitting, or a learning rate too high for what trains).
``heal`` also measures the original before pruning (the input record's prune source) where it
opens here.
Merging writes W + (alpha / r) B A back into W: a plain checkpoint of the same architecture.

Training is :func:`normsurgery.engine.training.train` (accelerate, several processes, gradient
accumulation, bf16 autocast where the device has it); only the adapters train.

:func:`heal` is the whole command (``normsurgery heal``; ``prune --heal`` runs it on the pruned
model): through the one runner (``runner.Job``), the text split into training and held-out
windows, the checkpoint read whole on the chosen device, LoRA trained and merged, and the result
saved and checked through ``writer.save`` (or the adapter saved unmerged).
"""

from __future__ import annotations

import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..core import algebra, devices
from ..core.calibration import windows
from ..core.errors import SurgeryError
from ..io.source import Source
from ..core.families import layout
from ..io.output import Staged, written
from ..core.progress import no_progress
from ..engine.sweep import CheckpointWork
from ..engine.writer import earlier_records
from ..engine.runner import Job, job_scope
from ..io.texts import heldout_text, text_of
from ..core.devices import PRECISIONS  # noqa: F401  (re-exported)
# the options, their defaults and checks live in options.py (no torch: the CLI reads them); re-exported here
from ..core.options import (SEQ_LEN, TRAIN_MODES, HealOptions, Writing, options_and_io, options_of,  # noqa: F401
                            check_values)
from ..engine.teacher import Cut
from ..engine.training import TrainConfig, heldout, heldout_ce, make_accelerator, objective_of, train
from .heal_distill import check_distilling, prepared, width_teaching
from .heal_teacher import Teaching, check_teacher, find_original, kl_closed, objective as choose_objective, taught

__all__ = ["HealOptions", "HealReport", "HealResult", "heal", "heal_model", "heldout_ce", "linear_targets",
           "make_accelerator", "require_lm", "target_pattern"]

@dataclass
class HealReport:
    ce_before: float
    ce_after: float
    steps: int
    tokens: int  # tokens trained on, all processes together
    epochs: float  # tokens / training-text tokens: how many times over the text was read
    seconds: float
    rank: int | None  # LoRA's (None: no LoRA trained, --train norms or full)
    alpha: float | None
    lr: float
    trainable_parameters: int
    target_modules: int
    mixed_precision: str
    processes: int
    losses: list[float] = field(default_factory=list)  # mean training loss of each step
    train: str = "lora"  # what trained (TRAIN_MODES)
    train_ce_before: float | None = None  # CE on fixed windows of the training text (:func:`run` measures it)
    train_ce_after: float | None = None
    merged: bool = False  # LoRA merged into the weights (False: kept as an adapter, or no adapter trained)
    eval_text_ce_before: float | None = None  # CE on --eval-text's windows (:func:`run` measures it when given)
    eval_text_ce_after: float | None = None
    objective: str = "ce"  # what training minimised (options.OBJECTIVES)
    why: str | None = None  # why that objective (the command's choice: asked, or by whether a teacher is known)
    teacher: str | None = None  # the teacher's name, where one is known
    temperature: float | None = None  # kd's T and kd+ce's CE weight, where they apply
    ce_weight: float | None = None
    kl_before: float | None = None  # held-out KL(teacher || model), nats per predicted token, where a teacher is known
    kl_after: float | None = None
    eval_text_kl_before: float | None = None  # the same on --eval-text's windows
    eval_text_kl_after: float | None = None
    sharded: bool = False  # the training state sharded over the processes (FSDP2), not data-parallel
    local: list | None = None  # --local-steps: per changed block its nMSE to the teacher's block, before and after

    @property
    def rose(self) -> tuple[str, float, float] | None:
        """The held-out CE healing raised, (what, before, after): the held-out end of the text's, else
        --eval-text's; None when neither rose."""
        for what, before, after in (("held-out CE", self.ce_before, self.ce_after),
                                    ("held-out CE on --eval-text", self.eval_text_ce_before, self.eval_text_ce_after)):
            if None not in (before, after) and after > before:
                return what, before, after
        return None

    @property
    def cause(self) -> str | None:
        """Why held-out CE rose (:attr:`rose`), as measured (None: it did not rise, or the training
        text was not measured): "overfit" when CE on the training text fell after the text was read
        at least once over (healing fit its text, not the language); "lr" when it rose as well, or
        fell after less than one reading, too little to over-fit (the steps are too large for what
        trains)."""
        if None in (self.train_ce_before, self.train_ce_after) or self.rose is None:
            return None
        return "overfit" if self.train_ce_after < self.train_ce_before and self.epochs >= 1 else "lr"

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def as_dict(self) -> dict:
        """The facts of the report (what ``--json`` and the record carry, as the table says them): no
        LoRA rank or alpha where no LoRA trained, no count of what trained where every parameter did."""
        unused = {"lora": (), "norms": ("rank", "alpha"), "full": ("rank", "alpha", "target_modules")}[self.train]
        facts = {k: v for k, v in asdict(self).items() if k not in unused}
        return {**facts, "tokens_per_second": self.tokens_per_second, "cause": self.cause}


def linear_targets(model) -> list[str]:
    """Names of every linear layer (nn.Linear or GPT-2's Conv1D) inside the blocks."""
    prefix = layout(model).layers_path + "."
    return [n for n, m in model.named_modules() if n.startswith(prefix) and algebra.is_linear(m)]


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


def norm_parameters(model) -> list[torch.nn.Parameter]:
    """The gains and biases of every norm the Layout knows: the stream's norm sites and the
    per-head norms inside attention."""
    lay = layout(model)
    paths = [s.path for s in lay.norms] + list(lay.qk_norms)
    return list(dict.fromkeys(p for path in paths for p in model.get_submodule(path).parameters()))


def require_lm(model) -> None:
    """Cross-entropy and healing need a language-modelling head (a causal or masked LM)."""
    objective_of(model)


@dataclass(frozen=True)
class Kept:
    """Where a training keeps its state and whether it continues from it (squeeze's cycles): the
    ``state_dir``, ``save_every`` and ``resume`` of :class:`training.TrainConfig`."""

    state_dir: Path
    save_every: int = 0
    resume: bool = False


def heal_model(model, train_ids: torch.Tensor, eval_windows: torch.Tensor, opts: HealOptions, *,
               mask_token_id: int | None = None, kept: Kept | None = None, teacher: Teaching | None = None,
               **training):
    """Train LoRA adapters (rank ``opts.rank``, scale ``alpha / rank``, alpha defaulting to 2 rank)
    on random ``opts.seq_len`` windows of ``train_ids`` (default :data:`options.SEQ_LEN`) for
    ``opts.steps`` optimizer steps of ``batch_size`` windows x ``grad_accum`` x processes. AdamW,
    linear warm-up over the first 10% of steps, then cosine decay to lr / 10.

    ``opts.train`` "norms" or "full" trains the model's own norm parameters or every parameter
    instead (rank, alpha, target_modules and save_adapter then play no part).

    ``kept``: the training state, kept and continued as :func:`training.train` does. ``teacher``:
    what ``opts.objective`` distils from (default ``kd`` with one, ``ce`` without), measured
    against (held-out KL) in either case. ``training``: :class:`training.Training`'s ``accelerator``
    and ``progress``.
    ``opts.patience``: stop once held-out CE went that many evaluations (every ``eval_every``
    steps) without improving; ``steps`` is then the cap.

    Returns (model, HealReport): the merged plain model, or the peft model with ``opts.save_adapter``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    opts.check()
    config = TrainConfig(steps=opts.steps, batch_size=opts.batch_size, seq_len=opts.seq_len or SEQ_LEN,
                         lr=opts.learning_rate, grad_accum=opts.grad_accum, seed=opts.seed,
                         eval_batch_size=opts.batch_size, patience=opts.patience,
                         eval_every=opts.eval_every if opts.patience else 0, **(asdict(kept) if kept else {}))
    config.check()
    objective = objective_of(model)
    alpha, merge = float(2 * opts.rank if opts.alpha is None else opts.alpha), not opts.save_adapter
    targets, params = 0, None
    if opts.train != "lora":
        # "full": a generator, so that no list here holds the weights a sharded run replaces (no teacher then)
        params = norm_parameters(model) if opts.train == "norms" else model.parameters()
        params = list(params) if teacher is not None else params
        targets = len(layout(model).norms) + len(layout(model).qk_norms) if opts.train == "norms" else 0
        merge = False
    else:
        pattern = target_pattern(model, opts.target_modules)
        conv1d = any(isinstance(m, Conv1D) for n, m in model.named_modules() if re.fullmatch(pattern, n))
        # LoRA's A is drawn from the global generator: seeded, then the caller's put back
        with devices.rng_kept(devices.of(model)), warnings.catch_warnings():
            torch.manual_seed(opts.seed)
            # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, LoraConfig(r=opts.rank, lora_alpha=alpha, lora_dropout=0.0,
                                                     target_modules=pattern, fan_in_fan_out=conv1d))
        targets = sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))
    distillation, goal, local = prepared(teacher, model, params or (), (train_ids, eval_windows), config, opts,
                                         (objective, mask_token_id))
    result = train(model, train_ids, eval_windows, config, objective=objective, mask_token_id=mask_token_id,
                   params=params, distillation=distillation, **training)
    lora = opts.train == "lora"
    report = HealReport(result.ce_before, result.ce_after, result.steps, result.tokens,
                        result.tokens / len(train_ids), result.seconds, opts.rank if lora else None,
                        alpha if lora else None, config.lr, result.trainable_parameters, targets, result.precision,
                        result.processes, result.losses, opts.train, merged=merge, sharded=result.sharded,
                        **taught(goal, teacher, opts, result), local=local)
    return (model.merge_and_unload() if merge else model), report


@dataclass
class HealResult:
    report: HealReport
    seconds: float  # the whole heal's wall time, held-out evaluation included
    saved: dict | None  # None on a secondary process of a distributed run
    record: dict  # what the saved config records under "normsurgery" (its "device": where it computed)
    ce: dict[str, float]  # held-out CE of the original before pruning (when measured), the input, the healed model
    heldout: str  # what the held-out CE was measured on (``texts.heldout_text``)
    original: str | None  # the original's name, or why it was not measured; None: the input was not pruned
    eval_text_ce: dict[str, float] | None = None  # the same three on --eval-text, when given


def run(model, tokenizer, data, opts: HealOptions, *, accelerator=None, progress=no_progress,
        teacher: Teaching | None = None):
    """:func:`heal_model` with ``opts`` (merged unless ``opts.save_adapter``) on ``data``
    (``runner.Texts``: the training tokens, the held-out windows and --eval-text's), reporting its
    steps to ``progress`` (stage "heal", the running loss and when it evaluates as the note), and CE
    on as many fixed windows of the training text as are held out, before and after (what
    :attr:`HealReport.cause` compares), and on --eval-text's windows when given, with the KL to
    ``teacher`` there where one is known (measured before merging: a teacher sharing the
    student's tensors is the base with the adapters off); returns (model, report, wall seconds)."""
    progress("heal", 0, opts.steps, "evaluating held-out CE")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    fit = windows(data.train_ids, opts.seq_len, len(data.held), "the training text")
    measure = lambda m, w, t=None: heldout(m, w, opts.batch_size, mask_token_id=mask_id, teacher=t)  # noqa: E731

    def step(done, total, loss):
        progress("heal", done, total, f"loss {loss:.4f}" + ("; evaluating held-out CE" if done == total else ""))

    t0 = time.perf_counter()
    # a sharded run's other processes hold the model on the meta device until training shards it:
    # only the main process (which reports) measures it before
    meta = any(p.is_meta for p in model.parameters())
    before = None if meta else measure(model, fit)["ce"]
    other = data.other
    other_before = None if meta or other is None else measure(model, other, teacher and teacher.over(model))
    defer = teacher is not None and opts.train == "lora" and not opts.save_adapter  # merged after measuring
    model, report = heal_model(model, data.train_ids, data.held, replace(opts, save_adapter=True) if defer else opts,
                               mask_token_id=mask_id, accelerator=accelerator, progress=step, teacher=teacher)
    report.train_ce_before, report.train_ce_after = before, measure(model, fit)["ce"]
    if other is not None:
        after = measure(model, other, teacher and teacher.live)
        report.eval_text_ce_before, report.eval_text_ce_after = other_before and other_before["ce"], after["ce"]
        report.eval_text_kl_before, report.eval_text_kl_after = (other_before or {}).get("kl"), after.get("kl")
    if defer:
        model, report.merged = model.merge_and_unload(), True
    return model, report, time.perf_counter() - t0


def heldout_record(text: str, windows: dict, original: str | None = None) -> dict:
    """What the record says of the held-out windows: the text (``texts.heldout_text``), their size
    (``windows``: ``runner.Texts.heldout``, with why fewer than asked) and (heal alone) the original
    before pruning, or why it was not measured."""
    return {"text": text, **windows, **({"original": original} if original is not None else {})}


def gap_closed(ce: dict, before: str) -> float | None:
    """(CE_before - CE_healed) / (CE_before - CE_original): the share of the gap pruning opened
    (``before``: the pruned model's CE) that healing closed; None where not measured or no gap."""
    if not {"original", before, "healed"} <= ce.keys():
        return None
    gap = ce[before] - ce["original"]
    return (ce[before] - ce["healed"]) / gap if gap > 0 else None


def recovery(ce: dict, other: dict | None, before: str) -> dict:
    """What healing recovered: the share of the gap closed on the held-out end of the text
    (``ce``) and on --eval-text (``other``); and, where that is what they show, a note that it is
    domain adaptation rather than recovery: beyond the original (over 100%) on text of the
    training text's own kind, or closing the gap there while opening it on --eval-text."""
    share, theirs = gap_closed(ce, before), gap_closed(other or {}, before)
    out = {**({"heldout": share} if share is not None else {}), **({"eval_text": theirs} if theirs is not None else {})}
    if share is not None and (share > 1 or (theirs is not None and theirs < 0 < share)):
        out["domain_adaptation"] = True
        out["note"] = ((f"healed beats the original on the held-out end of its own text ({share:.1%} of the gap): "
                        if share > 1 else f"healing closed {share:.1%} of the gap on the held-out end of its own "
                        f"text but widened it on --eval-text ({theirs:.1%}): ")
                       + "that is adaptation to the training text, not recovery of what pruning removed"
                       + (f"; on --eval-text it closed {theirs:.1%}" if theirs is not None and share > 1 else "")
                       + ("" if theirs is not None else "; --eval-text FILE (text unlike it) measures recovery"))
    return out


def kl_record(report: HealReport, before: str, original: bool) -> dict:
    """The record's KL(teacher || model) entries, where a teacher was measured against, on the
    held-out end and on --eval-text: the model before healing's (named ``before``), the healed
    model's, and (``original``: the teacher is the model before the cut) the original's, 0."""
    kl = {"heldout_kl": (report.kl_before, report.kl_after),
          "eval_text_kl": (report.eval_text_kl_before, report.eval_text_kl_after)}
    return {k: {**({"original": 0.0} if original else {}), before: a, "healed": b} for k, (a, b) in kl.items()
            if a is not None}


def kl_recovery(report: HealReport) -> dict:
    """The share of the KL to the teacher healing closed, on the held-out end and on --eval-text."""
    shares = {"kl_heldout": kl_closed(report.kl_before, report.kl_after),
              "kl_eval_text": kl_closed(report.eval_text_kl_before, report.eval_text_kl_after)}
    return {k: v for k, v in shares.items() if v is not None}


def eval_text_record(ce: dict | None, windows: dict | None) -> dict:
    """The record's entries for --eval-text (none without it): the CEs measured on it and its windows."""
    return {} if ce is None else {"eval_text_ce": ce, "eval_text": windows}


def summary(report: HealReport) -> dict:
    return {k: v for k, v in report.as_dict().items() if k != "losses"}


ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class Adapter:
    """A LoRA adapter taken out of its peft model (before it is merged or unloaded, which would take
    the adapters out of it): the tensors as peft names them in its files, and its config."""

    tensors: dict[str, torch.Tensor]
    config: object  # peft's LoraConfig
    expected: dict[str, tuple[int, ...]]  # every LoRA parameter of the model, as named in the files, and its shape


def take_adapter(peft_model) -> Adapter:
    """The adapter of ``peft_model``, copied to the CPU (peft's state dict of it, embeddings aside:
    LoRA never touches them), with every LoRA parameter the model holds, by name, to check a save
    against (:func:`write_adapter`)."""
    import copy

    from peft import get_peft_model_state_dict

    name = peft_model.active_adapter
    state = get_peft_model_state_dict(peft_model, adapter_name=name, save_embedding_layers=False)
    expected = {n.replace(f".{name}.", "."): tuple(p.shape) for n, p in peft_model.named_parameters()
                if re.search(r"\.lora_[AB]\.", n)}
    return Adapter({k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()},
                   copy.deepcopy(peft_model.peft_config[name]), expected)


def write_adapter(adapter: Adapter, stage: Staged, base: str, *, source: Source, record: dict, name: str,
                  into: str = "") -> dict:
    """The one way an adapter is saved (``heal --save-adapter``, ``prune --heal --save-adapter``):
    ``adapter``'s config (naming ``base``, the folder or hub id peft loads it onto) and tensors written
    into the folder ``into`` of the job's ``stage``, ``source``'s tokenizer files copied, then the file
    read back: it must hold every LoRA parameter of the model (by name and shape) with the values
    trained, or nothing is kept (a SurgeryError). Its card (``modelcard.write_adapter``, asked of the
    stage) gives ``record``. Returns what the file holds."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = stage.path / into
    folder.mkdir(parents=True, exist_ok=True)
    config = adapter.config
    config.base_model_name_or_path = str(base)
    config.save_pretrained(folder)
    save_file(adapter.tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    with safe_open(folder / ADAPTER_WEIGHTS, "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    missing = [k for k in adapter.expected if k not in saved or tuple(saved[k].shape) != adapter.expected[k]]
    changed = [k for k in adapter.expected if k not in missing and not torch.equal(saved[k], adapter.tensors[k])]
    if missing or changed or not adapter.expected:
        what = (f"{len(missing)} of its {len(adapter.expected)} LoRA tensors missing or misshapen (first "
                f"{missing[0]})" if missing else f"{len(changed)} LoRA tensors differ from those trained (first "
                f"{changed[0]})" if changed else "no LoRA tensor at all")
        raise SurgeryError(f"the adapter written to {folder} holds {what}; nothing was saved")
    for f in source.path.glob("*token*"):
        shutil.copy2(f, folder / f.name)
    info = {"tensors": len(saved), "parameters": sum(t.numel() for t in saved.values()), "rank": config.r,
            "alpha": config.lora_alpha, "base": str(base)}
    stage.card("adapter", folder, record=record, adapter=info, source=source, name=name)
    return info


def adapter_base(source: Source) -> str:
    """What an adapter's config names as its base: the hub id ``source`` was opened by, else its folder."""
    from ..io.modelcard import hub_id

    return source.name if hub_id(source.name) else str(source.path.resolve())


@job_scope
def heal(src, out, options: HealOptions | dict | None = None, *, text: str | Path, eval_text: str | Path | None = None,
         progress=no_progress, **keywords) -> HealResult:
    """LoRA on the remaining linears of ``src`` (LM loss; MLM for BERT) on ``text`` (its end held
    out; ``eval_text``, a second text, measured beside), merged and saved to ``out`` as a plain checkpoint (or, with
    ``options.save_adapter``, the adapter alone, base ``src``); ``io=`` (``Writing``): whether ``out`` may be
    replaced, pickle read, and the device computed on (``devices``). ``text`` and ``eval_text``: a ``str`` is the
    text itself, a ``pathlib.Path`` a file to read. ``keywords``: fields of the options or of ``io``
    (``options_and_io``)."""
    text, eval_text = text_of(text), text_of(eval_text, "eval_text")
    opts, io = options_and_io(HealOptions, options, keywords)
    opts.check()
    check_distilling(opts)
    force, allow_pickle, device = io.force, io.allow_pickle, io.device
    job = Job.open(src, out, force=force, allow_pickle=allow_pickle, device=device)
    data = job.training_data(text, eval_text, opts)
    held = data.held
    acc = job.make_accelerator(opts.precision)
    tok = job.source.tokenizer
    # then freed but for the blocks the cut removed (the teacher's): one model at a time
    found = find_original(job, [held, data.other], getattr(tok, "mask_token_id", None), opts)
    ce_original, original = found.ce, found.name
    model = job.load(trains=True)
    require_lm(model)
    check_teacher(found, model, opts)
    found.teaching, copied = width_teaching(found.teaching, model, opts)
    goal, why = choose_objective(opts, found.teaching, found.why)
    model, report, seconds = run(model, tok, data, replace(opts, objective=goal), accelerator=acc,
                                 progress=progress if job.main else no_progress, teacher=found.teaching)
    report.why = why + (f"; the teacher is a frozen copy: {copied}" if copied and goal != "ce" else "")
    ce = {**({"original": ce_original[0]} if ce_original else {}), "input": report.ce_before,
          "healed": report.ce_after}
    other = None if data.other is None else {**({"original": ce_original[1]} if ce_original else {}),
                                             "input": report.eval_text_ce_before, "healed": report.eval_text_ce_after}
    on = heldout_text(opts.eval_fraction)
    cut = found.teaching is not None and isinstance(found.teaching.given, Cut)  # the teacher is the original
    record = job.record(heal=summary(report), heldout_ce=ce, heldout=heldout_record(on, data.heldout, original),
                        **eval_text_record(other, data.other_record), **kl_record(report, "input", cut),
                        recovered={**recovery(ce, other, "input"), **kl_recovery(report)})
    if opts.save_adapter:
        saved = None
        if job.main:
            adapter = take_adapter(model)
            with job.staged() as stage:
                held_info = write_adapter(adapter, stage, adapter_base(job.source), source=job.source,
                                          record=record, name=Path(out).name)
            saved = written(out, stage, {"adapter": held_info})
        job.wait()
    else:
        saved = job.save(model, record, held[:4])
    return HealResult(report, seconds, saved, record, ce, on, original, other)
