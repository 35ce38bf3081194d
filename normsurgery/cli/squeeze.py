"""``squeeze``: the Squeeze-Release cycle to a target size (``normsurgery.squeeze``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ..core.errors import UsageError
from ..core.options import SqueezeOptions, Writing, option
from .app import JSON, claimed, command, emit_json, progress_bar, read_text, say, say_device, show
from .flags import IN, OUT, Flags, Given


@dataclass
class SqueezeAsked:
    """What squeeze's command line takes besides its options, texts and output: resume, plot."""

    resume: bool = option(False, "continue an interrupted run from its kept state", given=False)
    plot: Path | None = option(None, "also draw size vs held-out CE per cycle", metavar="PNG")


def built(options: Given) -> SqueezeOptions:
    """squeeze's options from the flags given (--target-bytes given: no --target), checked before torch
    loads (the API checks the same)."""
    if "target" in options.values and "target_bytes" in options.values:
        raise UsageError("give --target or --target-bytes, not both")
    opts = options.build(**({"target": None} if "target_bytes" in options.values else {}))
    opts.check()
    return opts


@command(preload=False)
def squeeze(
    src: str = IN,
    out: Path = OUT,
    text: Path = typer.Option(..., metavar="FILE", help="training text; its last --eval-fraction is held out"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="held-out text instead of the end of --text"),
    options: Flags(SqueezeOptions) = None,
    asked: SqueezeAsked = None,
    run: Writing = None,
    json: bool = JSON,
):
    """mask -> minimize (exact) -> release -> retrain to a target size: one cycle by default (one-shot),
    Squeeze-Release's several with --cycles N."""
    opts = built(options)
    body, held_text = read_text(text), read_text(eval_text)
    try:
        with claimed(src, out, run.force, run.allow_pickle) as source, progress_bar(not json) as progress:
            from ..commands.squeeze import squeeze as squeeze_checkpoint
            from .report import plot_squeeze, plotting

            with plotting(asked.plot, run.force, out) as draw:
                result = squeeze_checkpoint(source, out, text=body, eval_text=held_text, options=opts,
                                            resume=asked.resume, io=run, progress=progress)
                if draw is not None and result.saved is not None:
                    draw(plot_squeeze(result))
    except KeyboardInterrupt as e:
        from ..engine.train_state import state_dir

        if state_dir(out, "squeeze").is_dir():
            e.kept = f"the squeeze state is kept in {state_dir(out, 'squeeze')}: the same command with --resume continues from it"
        raise
    if result.saved is None:  # a secondary process of a distributed run
        return
    say_squeezed(result, asked.plot, json)


def say_squeezed(result, plot: Path | None, json: bool) -> None:
    """What squeeze did (``commands.squeeze.SqueezeResult``): JSON, or the cycles' table, the size
    and CE reached, the control beside, and where it was saved (and the ``plot`` drawn)."""
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
