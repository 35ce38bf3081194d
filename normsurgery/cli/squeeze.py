"""``squeeze``: the Squeeze-Release cycle to a target size (``normsurgery.squeeze``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import UsageError
from ..core.options import AT_LEAST, CRITERIA, SQUEEZE_STEPS, STRUCTURES, TRAIN_MODES, SqueezeOptions
from .app import ALLOW_PICKLE, DEVICE, FORCE, JSON, PRECISION, SEQ_LEN_HELP, claimed, command, emit_json, one_of, open_unit, positive, progress_bar, read_text, say, say_device, show

S = SqueezeOptions  # its fields' defaults, for the help (options.py loads no torch, so --help needs none)


@command(preload=False)
def squeeze(
    src: str = typer.Argument(..., metavar="IN", help="input checkpoint: a folder or a cached hub id"),
    out: Path = typer.Argument(..., metavar="OUT", help="output folder, written atomically (never inside IN)"),
    text: Path = typer.Option(..., metavar="FILE", help="training text; its last --eval-fraction is held out"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="held-out text instead of the end of --text"),
    target: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                           help=f"fraction of the parameters to keep (default {S.target:g})"),
    target_bytes: Optional[int] = typer.Option(None, min=AT_LEAST["target_bytes"], metavar="N",
                                               help="or: the output's size in bytes (storage dtype)"),
    cycles: Optional[int] = typer.Option(None, min=AT_LEAST["cycles"], metavar="N",
                                         help="mask -> minimize -> release -> retrain "
                                              f"cycles (default {S.cycles}: one-shot, measured better than 3 at the "
                                              "same size and tokens; N > 1: Squeeze-Release, with its one-shot "
                                              "control)"),
    steps_per_cycle: Optional[int] = typer.Option(None, min=AT_LEAST["steps_per_cycle"], metavar="S",
                                                  help="retraining steps per cycle "
                                                       f"(default: {SQUEEZE_STEPS} in all, split evenly over the "
                                                       f"cycles; {SQUEEZE_STEPS} with one, "
                                                       f"{SQUEEZE_STEPS // 3} each with 3)"),
    structure: Optional[str] = typer.Option(None, metavar="LIST", help="what the masks remove: some of "
                                            f"{', '.join(STRUCTURES)} (default {','.join(S.structure)})"),
    by: Optional[str] = typer.Option(None, metavar="HOW", help="how units and heads are ranked (activation: by the "
                                     "energy they write on calibration windows of --text; magnitude: by their weights; "
                                     f"channels by the energy written into them): {one_of(CRITERIA, S.by)}"),
    sparsity: Optional[float] = typer.Option(None, min=0.0, max=0.999, metavar="X", help="unstructured magnitude "
                                             "sparsity added to each cycle's mask, released after minimize "
                                             f"(default {S.sparsity:g})"),
    release_scale: Optional[float] = typer.Option(None, min=0.0, metavar="X", help="released noise's std, in units "
                                                  "of the RMS of the tensor's surviving weights "
                                                  f"(default {S.release_scale:g})"),
    train: Optional[str] = typer.Option(None, metavar="WHAT", help="what retrains (lora: merged): "
                                      f"{one_of(TRAIN_MODES, S.train)}"),
    lr: Optional[float] = typer.Option(None, callback=positive, metavar="X", help=f"learning rate (default {S.lr:g})"),
    batch_size: Optional[int] = typer.Option(None, min=AT_LEAST["batch_size"], metavar="B",
                                             help=f"windows per step (default {S.batch_size})"),
    seq_len: Optional[int] = typer.Option(None, min=AT_LEAST["seq_len"], metavar="L", help=SEQ_LEN_HELP),
    eval_fraction: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                                  help=f"share of --text held out (default {S.eval_fraction:g})"),
    eval_samples: Optional[int] = typer.Option(None, min=AT_LEAST["eval_samples"], metavar="K",
                                               help=f"held-out windows at most (default {S.eval_samples})"),
    precision: Optional[str] = PRECISION,
    device: str = DEVICE,
    seed: Optional[int] = typer.Option(None, min=AT_LEAST["seed"], metavar="N",
                                       help="seed of the release noise and the training "
                                     f"batches (default {S.seed})"),
    save_every: Optional[int] = typer.Option(None, min=AT_LEAST["save_every"], metavar="N",
                                             help="keep the training state every N steps "
                                          f"within a cycle (default {S.save_every}: none; the state after each "
                                          "cycle is always kept)"),
    patience: Optional[int] = typer.Option(None, min=AT_LEAST["patience"], metavar="N",
                                           help="a cycle's retraining stops once held-out "
                                           f"CE went N evaluations without improving (default {S.patience}: every "
                                           "step)"),
    eval_every: Optional[int] = typer.Option(None, min=AT_LEAST["eval_every"], metavar="S",
                                             help="with --patience: steps between "
                                             f"evaluations (default {S.eval_every})"),
    control: Optional[bool] = typer.Option(None, "--control/--no-control", help="also one-shot from the input at "
                                           "the same target and training steps, reported beside (default "
                                           f"{'on' if S.control else 'off'}; only with --cycles above 1: one cycle "
                                           "is its own)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run from its kept state"),
    plot: Optional[Path] = typer.Option(None, metavar="PNG", help="also draw size vs held-out CE per cycle"),
    force: bool = FORCE,
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """mask -> minimize (exact) -> release -> retrain to a target size: one cycle by default (one-shot),
    Squeeze-Release's several with --cycles N."""
    if target is not None and target_bytes is not None:
        raise UsageError("give --target or --target-bytes, not both")
    parts = None if structure is None else tuple(s.strip() for s in structure.split(",") if s.strip())
    given = {"target": target, "target_bytes": target_bytes, "cycles": cycles, "steps_per_cycle": steps_per_cycle,
             "structure": parts, "by": by, "sparsity": sparsity, "release_scale": release_scale, "train": train,
             "lr": lr, "batch_size": batch_size, "seq_len": seq_len, "eval_fraction": eval_fraction,
             "eval_samples": eval_samples, "precision": precision, "seed": seed, "save_every": save_every,
             "patience": patience, "eval_every": eval_every, "control": control}
    options = {k: v for k, v in given.items() if v is not None}
    if target_bytes is not None:
        options["target"] = None
    options = SqueezeOptions(**options)
    options.check()  # every choice and range, before torch loads (the API checks the same)
    body, held_text = read_text(text), read_text(eval_text)
    try:
        with claimed(src, out, force, allow_pickle) as source, progress_bar(not json) as progress:
            from ..commands.squeeze import squeeze as squeeze_checkpoint

            result = squeeze_checkpoint(source, out, body, eval_text=held_text, options=options,
                                        resume=resume, force=force, progress=progress, device=device)
    except KeyboardInterrupt as e:
        from ..engine.train_state import state_dir

        if state_dir(out, "squeeze").is_dir():
            e.kept = f"the squeeze state is kept in {state_dir(out, 'squeeze')}: the same command with --resume continues from it"
        raise
    if result.saved is None:  # a secondary process of a distributed run
        return
    if plot is not None:
        from .report import plot_squeeze

        plot_squeeze(plot, result)
    if json:
        emit_json(result.as_dict())
        return
    from .report import loads_with, squeeze_table

    show(squeeze_table(result))
    last, o = result.cycles[-1], result.original
    resumed = f" (resumed in cycle {result.resumed_at})" if result.resumed_at else ""
    say(f"squeezed{resumed}: {last.params:,} of {o['params']:,} parameters ({last.params / o['params']:.1%}), "
        f"held-out CE {o['ce']:.4f} -> {last.ce_after:.4f} ({last.ce_after - o['ce']:+.4f}) in {result.seconds:.0f} s, "
        f"{sum(c.tokens for c in result.cycles):,} training tokens")
    if result.control:
        c = result.control
        say(f"one-shot at the same target and tokens (the control): {c.params:,} parameters, held-out CE "
            f"{c.ce_after:.4f}; squeeze is {last.ce_after - c.ce_after:+.4f} from it")
    say_device(result.device)
    say(f"saved {result.saved['path']}: {loads_with(result.saved)}" + (f"; plot {plot}" if plot else ""))
