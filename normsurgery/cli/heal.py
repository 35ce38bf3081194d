"""``heal``: LoRA on the remaining linears, merge (or keep the adapter), save (``normsurgery.heal``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.options import AT_LEAST, LEARNING_RATES, TRAIN_MODES, HealOptions, defaults
from .app import ALLOW_PICKLE, DEVICE, FORCE, JSON, PRECISION, SEQ_LEN_HELP, claimed, command, emit_json, merge, one_of, open_unit, positive, progress_bar, read_text, say, say_device, show, split_names, stderr

#: heal's options and defaults: ``HealOptions``' own (options.py loads no torch, so --help needs none)
HEAL_DEFAULTS = defaults(HealOptions)
H = HealOptions  # its fields' defaults, for the help
LR_HELP = ", ".join(f"{mode} {lr:g}" for mode, lr in LEARNING_RATES.items())


def print_heal_steps(report, seconds: float) -> None:
    """The steps line, the warning when healing raised held-out CE (naming the cause measured) and,
    when the text was read many times over, the overfitting note."""
    from .report import heal_line, heal_warning, overfit_note

    say(heal_line(report, seconds))
    for line in (heal_warning(report), overfit_note(report)):
        if line:
            stderr().print(line, markup=False, highlight=False)


def say_heldout(on: str, record: dict) -> None:
    """What the held-out CE was measured on, why on fewer windows than asked, and the note that
    healing adapted to its text rather than recovered (``heal.recovery``), one line each."""
    for what, r in (("held out", record.get("heldout")), ("--eval-text", record.get("eval_text"))):
        if r:
            say(f"{what}: " + (f"{on}; " if what == "held out" else "") + (r.get("fewer") or
                                                                           f"{r['windows']} windows of {r['seq_len']}"))
    note = (record.get("recovered") or {}).get("note")
    if note:
        stderr().print(f"note: {note}", markup=False, highlight=False)


@command
def heal(
    src: str = typer.Argument(..., metavar="IN", help="input checkpoint (a pruned one, typically)"),
    out: Path = typer.Argument(..., metavar="OUT", help="output folder, written atomically (never inside IN)"),
    text: Path = typer.Option(..., metavar="FILE", help="training text; its last --eval-fraction is held out"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="a second text the healing never reads: the "
                                             "original's, the input's and the healed model's CE on it too, beside "
                                             "the held-out end of --text"),
    steps: Optional[int] = typer.Option(None, min=AT_LEAST["steps"], metavar="N",
                                        help=f"optimizer steps (default {H.steps})"),
    rank: Optional[int] = typer.Option(None, min=AT_LEAST["rank"], metavar="R", help=f"LoRA rank (default {H.rank})"),
    alpha: Optional[float] = typer.Option(None, callback=positive, metavar="X", help="LoRA alpha (default 2 x rank)"),
    lr: Optional[float] = typer.Option(None, callback=positive, metavar="X",
                                      help=f"learning rate (default by --train: {LR_HELP})"),
    target_modules: Optional[list[str]] = typer.Option(None, metavar="NAMES", help="linears to adapt, by name, e.g. "
                                                       "q_proj,v_proj (default: every linear in the blocks)"),
    batch_size: Optional[int] = typer.Option(None, min=AT_LEAST["batch_size"], metavar="B",
                                             help=f"windows per micro-batch and process (default {H.batch_size})"),
    seq_len: Optional[int] = typer.Option(None, min=AT_LEAST["seq_len"], metavar="L", help=SEQ_LEN_HELP),
    grad_accum: Optional[int] = typer.Option(None, min=AT_LEAST["grad_accum"], metavar="K",
                                             help=f"gradient-accumulation steps (default {H.grad_accum})"),
    precision: Optional[str] = PRECISION,
    device: str = DEVICE,
    eval_fraction: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                                  help=f"share of --text held out (default {H.eval_fraction:g})"),
    eval_samples: Optional[int] = typer.Option(None, min=AT_LEAST["eval_samples"], metavar="K",
                                               help="held-out windows at most, evaluated "
                                               f"before and after (default {H.eval_samples}; fewer is faster)"),
    seed: Optional[int] = typer.Option(None, min=AT_LEAST["seed"], metavar="N", help=f"random seed (default {H.seed})"),
    train: Optional[str] = typer.Option(None, metavar="WHAT", help="what trains (lora: adapters, merged; norms: "
                                        "only the norms' gains and biases; full: every parameter): "
                                        f"{one_of(TRAIN_MODES, H.train)}"),
    patience: Optional[int] = typer.Option(None, min=AT_LEAST["patience"], metavar="N",
                                           help="stop once held-out CE went N evaluations "
                                           f"without improving, --steps the cap (default {H.patience}: every step)"),
    eval_every: Optional[int] = typer.Option(None, min=AT_LEAST["eval_every"], metavar="S",
                                             help="with --patience: steps between "
                                             f"evaluations (default {H.eval_every})"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="save the peft adapter (base: IN), unmerged"),
    force: bool = FORCE,
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """LoRA on the remaining linears (LM loss; MLM for BERT), merge, save a plain checkpoint."""
    from ..commands.heal import heal as heal_checkpoint

    opts = HealOptions(**merge(HEAL_DEFAULTS, None, {
        "steps": steps, "rank": rank, "alpha": alpha, "lr": lr, "target_modules": split_names(target_modules),
        "batch_size": batch_size, "seq_len": seq_len, "grad_accum": grad_accum, "precision": precision,
        "eval_fraction": eval_fraction, "eval_samples": eval_samples, "seed": seed, "train": train,
        "patience": patience, "eval_every": eval_every}))
    opts.check(save_adapter_)
    body, held_text = read_text(text), read_text(eval_text)
    with claimed(src, out, force, allow_pickle) as source, progress_bar(not json) as progress:
        result = heal_checkpoint(source, out, body, eval_text=held_text, options=opts, save_adapter=save_adapter_,
                                 force=force, progress=progress, device=device)
    if result.saved is None:  # a secondary process of a distributed run
        return
    if json:
        emit_json({**result.record, "saved": result.saved, "losses": result.report.losses, "seconds": result.seconds})
        return
    from .report import ce_table, loads_with

    report, rec = result.report, result.record["recovered"]
    show(ce_table("held-out cross-entropy", result.ce, rec, result.eval_text_ce))
    say_heldout(result.heldout, result.record)
    if result.original is not None:
        say(f"original before pruning: {result.original}")
    print_heal_steps(report, result.seconds)
    say_device(result.record.get("device"))
    a = result.saved.get("adapter")
    what = (f"the adapter (peft, unmerged: {a['tensors']} LoRA tensors, read back and checked; base {a['base']})"
            if a else f"{'LoRA merged; ' if report.merged else ''}{loads_with(result.saved)}")
    say(f"saved {result.saved['path']}: {what}")
