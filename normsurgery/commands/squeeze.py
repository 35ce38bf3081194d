"""squeeze: mask -> minimize -> release -> retrain to a target size. One cycle by default
(``cycles=1``, one-shot: measured better than three at the same size and tokens, README's squeeze
section); with ``cycles`` N, Squeeze-Release: N cycles, each on the model the previous one left.

- mask: cycle c of N aims at P_c = P_0 * t^(c/N) parameters (t: ``target``, or ``target_bytes``
  over the original's bytes). The structures chosen (``structure``: MLP units, KV-head groups,
  residual channels; ``masks``) lose one fraction f of what the model holds then, ranked by
  ``by`` (activation: units and heads by the energy they write on calibration windows of the
  training text; channels by the energy written into them): the smallest f (bisection) whose
  minimized model has at most P_c parameters, counted on trial copies, not estimated (KV-head
  groups go in coarse steps, so they keep the last fraction that missed P_c while the other
  structures are bisected above it: :func:`plan_fraction`). ``sparsity`` adds unstructured
  magnitude zeros in what stays.
- minimize: the exact pass; its output is compared with the masked model on probe windows and
  the cycle stops with an error if it differs beyond its tolerance.
- release: every exact zero left inside a kept tensor of the blocks (its row and its column
  still live) becomes N(0, (release_scale * s)^2), s the RMS of that tensor's surviving entries,
  drawn from a generator seeded by (seed, cycle); whole zero rows and columns (pruned structure
  that minimize could not remove) stay zero. ``masks.release``. Only ``train="full"`` trains
  the released entries, so with norms or lora nothing is released (the count says 0).
- retrain: heal's loop (``train``: full | norms | lora, merged) for ``steps_per_cycle`` steps
  (default: ``options.SQUEEZE_STEPS``, 900, in all, split evenly over the cycles: ``SqueezeOptions.steps``),
  minimising ``objective`` (default kd, as heal's where a teacher is known: the KL to the cycle's input
  model per token, ``engine.teacher``), the teacher a frozen copy of that input, or with ``train="lora"``
  and a cut of whole units and heads, the student's own tensors plus the removed rows and columns
  (:func:`cycle_teacher`; each cycle records which, and why).

``cycles=1`` is one-shot: mask to the target, minimize, release, retrain with all the steps.
With ``control`` (the default) and more than one cycle, one-shot also runs from the input after
the cycles, at the same target with as many training steps as the cycles took together (the
papers' comparison at equal size and tokens: :func:`one_shot`), and is reported beside.
After each cycle the model and the records are kept in ``.OUT.squeeze-state`` beside OUT (the
training state too, every ``save_every`` steps), so ``resume`` continues an interrupted run to
the same result as an uninterrupted one.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..core import devices, masks
from ..core.calibration import windows
from .convert import apply_passes
from ..core.errors import SurgeryError
from ..core.families import layout
from .heal import Kept, heal_model, require_lm
from .heal_distill import width_teaching
from .heal_teacher import Teaching
from ..core.options import STRUCTURES, SqueezeOptions, Writing, options_and_io, options_of  # noqa: F401  (re-exported: the API's names)
from ..core.parity import probe_ids
from ..engine.plan import check_applies
from ..passes.mask import CALIBRATION
from ..core.progress import Progress, no_progress
from ..core.registry import PassContext
from ..engine.runner import Job, job_scope
from ..engine.teacher import Frozen
from ..io.stash import Stash
from ..io.texts import text_of
from ..engine.processes import is_main_process
from ..engine.train_state import STATE_FILE, save_state, state_dir
from ..engine.training import heldout_ce

STATE = "squeeze.pt"
TRAIN_STATE = "train"  # the folder of a cycle's training state, inside the squeeze state
#: the largest fraction of its structure one cycle may mask
MOST = 0.95


@dataclass
class Cycle:
    """One cycle: the size reached, the minimize check, the release, the held-out CE before and
    after retraining."""

    cycle: int
    fraction: float  # of each structure masked in this cycle (units, channels)
    heads_fraction: float  # of the KV-head groups
    params: int
    bytes: int  # in the storage dtype
    minimize_relative: float  # minimize's output vs the masked model's (probe windows)
    minimize_tolerance: float | None
    released: int  # zeros given back to training
    ce_masked: float  # held-out CE of the minimized model (= the masked model's)
    ce_released: float
    ce_after: float  # after retraining
    tokens: int
    seconds: float
    steps: int = 0  # retraining steps run
    objective: str = "ce"  # what the retraining minimised (options.OBJECTIVES)
    teacher: str | None = None  # how the teacher (the cycle's input model) was held, and why
    kl_released: float | None = None  # held-out KL(the cycle's input || model), before and after retraining
    kl_after: float | None = None


@dataclass
class SqueezeResult:
    original: dict  # params, bytes, ce
    cycles: list[Cycle]
    options: dict
    seconds: float
    saved: dict | None = None
    resumed_at: int | None = None  # the cycle a resumed run started in
    device: dict | None = None  # where it computed (devices.describe)
    control: Cycle | None = None  # one-shot from the input at the same target and steps (:func:`one_shot`)

    def as_dict(self) -> dict:
        return {"original": self.original, "cycles": [asdict(c) for c in self.cycles], "options": self.options,
                "seconds": self.seconds, "saved": self.saved, "resumed_at": self.resumed_at, "device": self.device,
                "control": self.control and asdict(self.control)}


def mask_options(model, fraction: float, opts: SqueezeOptions, heads: float | None = None) -> dict:
    """minimize's mask options masking ``fraction`` of each chosen structure (``heads`` of the
    KV-head groups, when given) and the sparsity."""
    out = {"by": opts.by, **({"sparsity": opts.sparsity} if opts.sparsity else {})}
    if "units" in opts.structure:
        out["prune_units"] = fraction
    if "heads" in opts.structure:
        out["prune_heads"] = fraction if heads is None else heads
    if "channels" in opts.structure:
        out["prune_channels"] = round(fraction * layout(model).stream_width)
    return out


def minimized_params(model, options: dict, context: PassContext) -> int:
    """Parameters of ``model`` masked with ``options`` and minimized (on a copy)."""
    steps = apply_passes(copy.deepcopy(model), [("minimize", options)], context=context)
    return steps[-1].metrics["params"][1]


def parameters(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def plan_fraction(model, goal: int, opts: SqueezeOptions, context: PassContext,
                  iterations: int = 12) -> tuple[float, float]:
    """(f, f_heads): the smallest fraction f found (bisection over [0, MOST]) whose minimized
    model has at most ``goal`` parameters. KV-head groups go in coarse steps (one group in every
    layer at once), so with other structures the heads keep the fraction of the last f that
    missed the goal and the others alone are bisected above it: the size lands nearer the goal."""
    def count(f: float, heads: float | None = None) -> int:
        return minimized_params(model, mask_options(model, f, opts, heads), context)

    def bisect(lo: float, heads: float | None = None) -> tuple[float, float]:
        """(the last fraction above the goal, the first within it)."""
        hi = MOST
        for _ in range(iterations):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if count(mid, heads) <= goal else (mid, hi)
        return lo, hi

    if parameters(model) <= goal:
        return 0.0, 0.0
    most = count(MOST)
    if most > goal:
        raise SurgeryError(f"masking {MOST:.0%} of the {', '.join(opts.structure)} leaves {most:,} parameters, more "
                           f"than this cycle's goal of {goal:,}: give more cycles, a larger target or more structures")
    missed, f = bisect(0.0)
    if "heads" in opts.structure and len(opts.structure) > 1 and count(MOST, missed) <= goal:
        return bisect(missed, missed)[1], missed
    return f, f


@torch.no_grad()
def release(model, scale: float, seed: int, cycle: int) -> int:
    """``masks.release`` on every linear weight of the blocks, in name order, one generator
    seeded by (seed, cycle)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + cycle)
    weights = masks.block_weights(model, layout(model))
    return sum(masks.release(weights[name].data, scale, gen) for name in sorted(weights))


def _fingerprint(opts: SqueezeOptions, train_ids: torch.Tensor, held: torch.Tensor) -> str:
    text = repr(sorted({k: v for k, v in asdict(opts).items() if k not in ("save_every", "control")}.items()))
    data = train_ids.cpu().numpy().tobytes() + held.cpu().numpy().tobytes()
    return hashlib.sha256(text.encode() + data).hexdigest()[:16]


@dataclass(frozen=True)
class Setup:
    """What the cycles take of the job: the output's bytes per parameter (its storage dtype's), the
    tokenizer's mask token (masked LMs), the training processes' accelerator."""

    storage_bytes: int
    mask_token_id: int | None = None
    accelerator: object = None


def squeeze_model(model, train_ids: torch.Tensor, held: torch.Tensor, opts: SqueezeOptions, setup: Setup, *,
                  state: Path | None = None, resume: bool = False,
                  progress: Progress = no_progress) -> tuple[object, SqueezeResult]:
    """The cycles on ``model`` (in place; returned, since a resumed run continues from the kept
    model): training windows from ``train_ids``, held-out CE on ``held``; ``setup.storage_bytes`` per
    parameter in the output. ``state``: the folder of the kept state (None: nothing kept)."""
    opts.check()
    try:
        check_applies(model, "minimize")  # every cycle minimizes: refuse now, with the pass's reason
    except SurgeryError as e:
        raise SurgeryError(f"squeeze: {e}") from None
    t0 = time.perf_counter()
    heal = opts.heal_options()
    heal.seq_len = held.shape[1]
    unsharded = _unsharded(heal)
    fingerprint = _fingerprint(opts, train_ids, held)
    p0, mask_id = parameters(model), setup.mask_token_id
    original = {"params": p0, "bytes": p0 * setup.storage_bytes, "ce": heldout_ce(model, held, mask_token_id=mask_id)}
    t = opts.target_bytes / original["bytes"] if opts.target_bytes is not None else opts.target
    if not 0 < t < 1:
        raise SurgeryError(f"--target-bytes {opts.target_bytes:,} is not below the model's {original['bytes']:,} bytes")
    train_state = None if state is None else state / TRAIN_STATE
    mid_cycle = train_state is not None and (train_state / STATE_FILE).is_file()  # a cycle's training was cut
    model, cycles, original, resumed = (_resumed(model, original, state, fingerprint, mid_cycle) if resume else
                                        (model, [], original, None))
    first = len(cycles) + 1
    ids = probe_ids(None, model.config.vocab_size, None, 2, held.shape[1])
    context = PassContext(calibration=windows(train_ids, held.shape[1], CALIBRATION, "the training text"))
    for c in range(first, opts.cycles + 1):
        goal = int(original["params"] * t ** (c / opts.cycles))
        progress("squeeze", c - 1, opts.cycles, f"cycle {c}: finding the mask for {goal:,} parameters")
        fraction, heads = plan_fraction(model, goal, opts, context)
        teaching = Teaching(Frozen(copy.deepcopy(model)), f"cycle {c}'s input") if heal.objective != "ce" else None
        steps = apply_passes(model, [("minimize", mask_options(model, fraction, opts, heads))], ids=ids,
                             context=context)
        check = steps[-1].parity
        if not check.ok:
            raise SurgeryError(f"cycle {c}: minimize changed the masked model's outputs by {check.relative:.2e} "
                               f"(tolerance {check.tolerance:.1e}); nothing was written")
        ce_masked = heldout_ce(model, held, mask_token_id=mask_id)
        released = release(model, opts.release_scale, opts.seed, c) if opts.train == "full" else 0
        teaching, held_as = cycle_teacher(teaching, model, heal)

        def step(done, total, loss, c=c):
            progress("squeeze", c - 1, opts.cycles, f"cycle {c}: retraining, step {done}/{total}, loss {loss:.4f}")

        kept = None if state is None else Kept(train_state, opts.save_every, resume and c == first and mid_cycle)
        model, report = heal_model(model, train_ids, held, replace(heal, seed=opts.seed + c), mask_token_id=mask_id,
                                   accelerator=setup.accelerator, progress=step, kept=kept, teacher=teaching)
        teaching = None  # the copy freed before the next cycle's
        params = parameters(model)
        cycles.append(Cycle(c, fraction, heads, params, params * setup.storage_bytes, check.relative,
                            check.tolerance, released, ce_masked, report.ce_before, report.ce_after, report.tokens,
                            report.seconds, report.steps, report.objective, held_as or unsharded, report.kl_before,
                            report.kl_after))
        if state is not None and is_main_process():
            _keep(state, {"fingerprint": fingerprint, "model": model, "original": original,
                          "cycles": [asdict(x) for x in cycles]})
    progress("squeeze", opts.cycles, opts.cycles, "done")
    return model, SqueezeResult(original, cycles, asdict(opts), time.perf_counter() - t0, resumed_at=resumed)


def _unsharded(heal) -> str | None:
    """Where training is sharded over processes (FSDP), ``heal``'s objective made ``ce`` and why; else None."""
    if heal.objective == "ce" or not devices.sharding():
        return None
    heal.objective = "ce"
    return "none: training sharded over processes (FSDP) distils from no teacher"


def cycle_teacher(teaching: Teaching | None, model, heal) -> tuple[Teaching | None, str | None]:
    """(the teacher a cycle's retraining distils from, how it is held): ``teaching``, the cycle's
    input copied before its mask, kept a frozen copy where the retraining trains the weights it
    would share (``--train full`` or ``norms``) or the student is not the input less whole units and
    heads (released noise, sparsity, channels); otherwise the student's own tensors plus the
    removed rows and columns (``engine.width_teacher``), the copy freed. None with ``ce``."""
    if teaching is None:
        return None, None
    shared, why = width_teaching(teaching, model, heal)
    return shared, ("shared with the student, plus the removed rows and columns" if why is None else
                    f"a frozen copy: {why}")


def _resumed(model, original: dict, state: Path | None, fingerprint: str,
             mid_cycle: bool) -> tuple[object, list, dict, int]:
    """(model, cycles done, original, the cycle resumed in) from the squeeze state in ``state``: the
    model and records kept after the last completed cycle (``model`` and ``original`` as they are
    when the first cycle's training was cut: ``mid_cycle``)."""
    kept = None if state is None else state / STATE
    if kept is None or not (kept.is_file() or mid_cycle):
        raise SurgeryError(f"nothing to resume: no squeeze state in {state}")
    if not kept.is_file():
        return model, [], original, 1
    saved = torch.load(kept, map_location="cpu", weights_only=False)
    if saved["fingerprint"] != fingerprint:
        raise SurgeryError(f"the squeeze state in {state} is from another run (other text or options); "
                           "resume with the same ones or start afresh without --resume")
    cycles = [Cycle(**c) for c in saved["cycles"]]
    return saved["model"].to(devices.of(model)), cycles, saved["original"], len(cycles) + 1


def one_shot(model, cycles: list[Cycle], train_ids: torch.Tensor, held: torch.Tensor, opts: SqueezeOptions,
             setup: Setup, progress: Progress = no_progress) -> Cycle:
    """The control of a squeeze that ran ``cycles``: ``model`` (the input) masked to the same
    target at once, minimized, released and retrained for as many steps as the cycles took
    together (every step: no patience), same seed and options. Its one :class:`Cycle`."""
    steps = sum(c.steps for c in cycles) or opts.cycles * opts.steps()  # (a state from before steps were kept)
    once = replace(opts, cycles=1, steps_per_cycle=steps, patience=0, control=False)

    def step(task, done, total, message=""):
        progress("one-shot", done, total, f"the control, {message.removeprefix('cycle 1: ')}")

    _, result = squeeze_model(model, train_ids, held, once, setup, progress=step)
    return result.cycles[0]


def _keep(state: Path, data: dict) -> None:
    """The state after a completed cycle (atomically); the finished cycle's training state goes."""
    save_state(state / STATE, data)
    shutil.rmtree(state / TRAIN_STATE, ignore_errors=True)


@job_scope
def squeeze(src, out, options: SqueezeOptions | dict | None = None, *, text: str | Path,
            eval_text: str | Path | None = None, resume: bool = False, progress: Progress = no_progress,
            **keywords) -> SqueezeResult:
    """Squeeze ``src`` to ``options.target`` of its parameters (or ``target_bytes``) and save the
    last cycle's model to ``out`` (checked as every output is: read back and compared); training
    on ``text`` (its end held out unless ``eval_text``), through the one runner (``runner.Job``).
    ``io=`` (``Writing``): whether ``out`` may be replaced, pickle read, and the device computed on
    (``devices``). ``text`` and ``eval_text``: a ``str`` is the text itself, a ``pathlib.Path`` a file to read.
    ``keywords``: fields of the options or of ``io`` (``options_and_io``). See the module docstring."""
    text, eval_text = text_of(text), text_of(eval_text, "eval_text")
    opts, io = options_and_io(SqueezeOptions, options, keywords)
    opts.structure = tuple(opts.structure)
    opts.steps_per_cycle = opts.steps()  # the default's split, so the record and the card state it
    force, allow_pickle, device = io.force, io.allow_pickle, io.device
    job = Job.open(src, out, force=force, allow_pickle=allow_pickle, device=device)
    heal = opts.heal_options()
    data = job.training_data(text, eval_text, heal)
    train_ids, held = data.train_ids, data.held if data.other is None else data.other
    opts.seq_len = heal.seq_len
    acc = job.make_accelerator(opts.precision)
    model = job.load()
    require_lm(model)
    state = state_dir(out, "squeeze")
    setup = Setup(job.source.storage.itemsize, getattr(job.source.tokenizer, "mask_token_id", None), acc)
    model, result = squeeze_model(model, train_ids, held, opts, setup, state=state, resume=resume, progress=progress)
    if opts.control and opts.cycles > 1:  # the squeezed model waits on disk meanwhile
        aside = Stash(model, state / "squeezed")
        result.control = one_shot(job.load(), result.cycles, train_ids, held, opts, setup, progress)
        aside.back()
    result.device = devices.describe(job.device)
    record = job.record(squeeze={"options": result.options, "original": result.original,
                                 "cycles": [asdict(c) for c in result.cycles],
                                 "control": result.control and asdict(result.control)})
    result.saved = job.save(model, record, held[:4])
    if job.main:
        shutil.rmtree(state, ignore_errors=True)
    return result
