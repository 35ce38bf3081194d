"""``heal``: LoRA on the remaining linears, merge (or keep the adapter), save (``normsurgery.heal``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.options import HealOptions, Writing
from .app import JSON, claimed, command, emit_json, progress_bar, read_text, say, say_device, show, stderr
from .flags import OUT


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


@command(preload=False)
def heal(
    src: str = typer.Argument(..., metavar="IN", help="input checkpoint (a pruned one, typically)"),
    out: Path = OUT,
    text: Path = typer.Option(..., metavar="FILE", help="training text; its last --eval-fraction is held out"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="a second text the healing never reads: the "
                                             "original's, the input's and the healed model's CE on it too, beside "
                                             "the held-out end of --text"),
    options: HealOptions = None,
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="save the peft adapter (base: IN), unmerged"),
    run: Writing = None,
    json: bool = JSON,
):
    """LoRA on the remaining linears (LM loss; MLM for BERT), merge, save a plain checkpoint."""
    options.save_adapter = save_adapter_
    options.check()
    body, held_text = read_text(text), read_text(eval_text)
    with claimed(src, out, run.force, run.allow_pickle) as source, progress_bar(not json) as progress:
        from ..commands.heal import heal as heal_checkpoint

        result = heal_checkpoint(source, out, text=body, eval_text=held_text, options=options, io=run,
                                 progress=progress)
    if result.saved is None:  # a secondary process of a distributed run
        return
    if json:
        emit_json({**result.record, "saved": result.saved, "losses": result.report.losses, "seconds": result.seconds})
        return
    from .report import ce_table, loads_with

    report, rec = result.report, result.record["recovered"]
    show(ce_table("held-out cross-entropy" + (" and KL to the teacher" if "heldout_kl" in result.record else ""),
                  result.ce, rec, result.eval_text_ce, result.record))
    say_heldout(result.heldout, result.record)
    if result.original is not None:
        say(f"original before pruning: {result.original}")
    print_heal_steps(report, result.seconds)
    say_device(result.record.get("device"))
    a = result.saved.get("adapter")
    what = (f"the adapter (peft, unmerged: {a['tensors']} LoRA tensors, read back and checked; base {a['base']})"
            if a else f"{'LoRA merged; ' if report.merged else ''}{loads_with(result.saved)}")
    say(f"saved {result.saved['path']}: {what}")
