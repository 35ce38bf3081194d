"""``heal``: LoRA on the remaining linears, merge (or keep the adapter), save (``normsurgery.heal``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import ALLOW_PICKLE, DEVICE, FORCE, JSON, PRECISION, claimed, command, emit_json, merge, open_unit, \
    positive, progress_bar, read_text, say, say_device, show, split_names, stderr

#: heal's options and defaults (``heal.HealOptions``), named here so --help needs no torch
HEAL_DEFAULTS = {"steps": 200, "rank": 8, "alpha": None, "lr": 2e-3, "target_modules": None,
                 "batch_size": 8, "seq_len": None, "grad_accum": 1, "precision": "auto",
                 "eval_fraction": 0.1, "eval_samples": 64, "seed": 0, "train": "lora"}


def print_heal_steps(report, seconds: float) -> None:
    """The steps line and, when the text was read many times over, the overfitting note."""
    from .report import heal_line, overfit_note

    say(heal_line(report, seconds))
    if overfit_note(report):
        stderr().print(overfit_note(report), markup=False, highlight=False)


@command
def heal(
    src: str = typer.Argument(..., metavar="IN", help="input checkpoint (a pruned one, typically)"),
    out: Path = typer.Argument(..., metavar="OUT", help="output folder, written atomically (never inside IN)"),
    text: Path = typer.Option(..., metavar="FILE", help="training text; its last --eval-fraction is held out"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="held-out text instead of the end of --text"),
    steps: Optional[int] = typer.Option(None, min=1, metavar="N", help="optimizer steps (default 200)"),
    rank: Optional[int] = typer.Option(None, min=1, metavar="R", help="LoRA rank (default 8)"),
    alpha: Optional[float] = typer.Option(None, callback=positive, metavar="X", help="LoRA alpha (default 2 x rank)"),
    lr: Optional[float] = typer.Option(None, callback=positive, metavar="X", help="learning rate (default 2e-3)"),
    target_modules: Optional[list[str]] = typer.Option(None, metavar="NAMES", help="linears to adapt, by name, e.g. "
                                                       "q_proj,v_proj (default: every linear in the blocks)"),
    batch_size: Optional[int] = typer.Option(None, min=1, metavar="B",
                                             help="windows per micro-batch and process (default 8)"),
    seq_len: Optional[int] = typer.Option(None, min=2, metavar="L", help="tokens per window (default: 128, or the "
                                                                          "model's positions when fewer)"),
    grad_accum: Optional[int] = typer.Option(None, min=1, metavar="K", help="gradient-accumulation steps (default 1)"),
    precision: Optional[str] = PRECISION,
    device: str = DEVICE,
    eval_fraction: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                                  help="share of --text held out (default 0.1)"),
    eval_samples: Optional[int] = typer.Option(None, min=1, metavar="K", help="held-out windows at most, evaluated "
                                               "before and after (default 64; fewer is faster)"),
    seed: Optional[int] = typer.Option(None, min=0, metavar="N", help="random seed (default 0)"),
    train: Optional[str] = typer.Option(None, metavar="WHAT", help="what trains: lora (adapters, merged) | norms "
                                        "(only the norms' gains and biases) | full (every parameter) (default lora)"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="save the peft adapter (base: IN), unmerged"),
    force: bool = FORCE,
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """LoRA on the remaining linears (LM loss; MLM for BERT), merge, save a plain checkpoint."""
    from ..heal import HealOptions, heal as heal_checkpoint

    opts = HealOptions(**merge(HEAL_DEFAULTS, None, {
        "steps": steps, "rank": rank, "alpha": alpha, "lr": lr, "target_modules": split_names(target_modules),
        "batch_size": batch_size, "seq_len": seq_len, "grad_accum": grad_accum, "precision": precision,
        "eval_fraction": eval_fraction, "eval_samples": eval_samples, "seed": seed, "train": train}))
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

    report = result.report
    show(ce_table("held-out cross-entropy", [("before", report.ce_before), ("after", report.ce_after)], None))
    print_heal_steps(report, result.seconds)
    say_device(result.record.get("device"))
    what = f"adapter (peft; base {source.path})" if save_adapter_ else f"merged; {loads_with(result.saved)}"
    say(f"saved {result.saved['path']}: {what}")
