"""``prune``: remove the layers that change the residual stream least; optionally heal; save."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import SurgeryError
from ..core.options import AT_LEAST, METHODS, TRAIN_MODES, HealOptions, PruneOptions, defaults
from .app import ALLOW_PICKLE, DEVICE, FORCE, JSON, PRECISION, SEQ_LEN_HELP, claimed, command, did_you_mean, emit_json, merge, one_of, open_unit, positive, progress_bar, read_text, say, say_device, show, split_names
from .heal import HEAL_DEFAULTS, LR_HELP, print_heal_steps, say_heldout

#: prune's options and defaults: ``PruneOptions``' own (options.py loads no torch, so --help needs none)
PRUNE_DEFAULTS = defaults(PruneOptions)
P, H = PruneOptions, HealOptions  # their fields' defaults, for the help


def load_prune_recipe(path: Path) -> tuple[dict, dict | None]:
    """A recipe: a ``[prune]`` table and, to heal as well, a ``[heal]`` table of the options."""
    from ..core.registry import read_recipe

    data = read_recipe(path)
    if not isinstance(data.get("prune"), dict):
        raise SurgeryError(f"recipe {path} needs a [prune] table")
    for table, known in (("prune", PRUNE_DEFAULTS), ("heal", HEAL_DEFAULTS)):
        for key in set(data.get(table) or {}) - set(known):
            raise SurgeryError(f"recipe {path}: [{table}] has no option {key}{did_you_mean(key, known)}; "
                               f"options: {', '.join(known)}")
    return data["prune"], data.get("heal")


@command
def prune(
    src: str = typer.Argument(..., metavar="IN", help="input checkpoint: a folder or a cached hub id"),
    out: Path = typer.Argument(..., metavar="OUT", help="output folder, written atomically (never inside IN)"),
    layers: Optional[int] = typer.Option(None, "--layers", "-n", min=AT_LEAST["layers"], metavar="N",
                                         help="how many layers to remove"),
    fraction: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                             help="or: the fraction of layers to remove (rounded)"),
    method: Optional[str] = typer.Option(None, metavar="METHOD", help=one_of(METHODS, P.method)),
    text: Optional[Path] = typer.Option(None, metavar="FILE", help="calibration (and healing) text, its last "
                                             f"{H.eval_fraction:.0%} held out for CE; default: bundled Shakespeare"),
    samples: Optional[int] = typer.Option(None, min=AT_LEAST["samples"], metavar="K",
                                          help=f"calibration windows (default {P.samples})"),
    seq_len: Optional[int] = typer.Option(None, min=AT_LEAST["seq_len"], metavar="L", help=SEQ_LEN_HELP),
    batch_size: Optional[int] = typer.Option(None, min=AT_LEAST["batch_size"], metavar="B",
                                             help="windows per forward pass and per heal "
                                                                            f"micro-batch (default {P.batch_size})"),
    plot: Optional[Path] = typer.Option(None, metavar="PNG", help="also draw the scores into this PNG"),
    heal: bool = typer.Option(False, "--heal", help="heal with LoRA after pruning (see `heal --help`)"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="a second text for CE (original, pruned, "
                                             f"healed), beside the held-out last {H.eval_fraction:.0%} of --text"),
    eval_samples: Optional[int] = typer.Option(None, min=AT_LEAST["eval_samples"], metavar="K",
                                               help=f"held-out windows at most (default {P.eval_samples})"),
    steps: Optional[int] = typer.Option(None, min=AT_LEAST["steps"], metavar="N",
                                        help=f"heal: optimizer steps (default {H.steps})"),
    rank: Optional[int] = typer.Option(None, min=AT_LEAST["rank"], metavar="R",
                                       help=f"heal: LoRA rank (default {H.rank})"),
    lr: Optional[float] = typer.Option(None, callback=positive, metavar="X",
                                      help=f"heal: learning rate (default by --train: {LR_HELP})"),
    target_modules: Optional[list[str]] = typer.Option(None, metavar="NAMES", help="heal: linears to adapt, by name "
                                                       "(default: all in the blocks)"),
    grad_accum: Optional[int] = typer.Option(None, min=AT_LEAST["grad_accum"], metavar="K",
                                             help=f"heal: gradient-accumulation steps (default {H.grad_accum})"),
    precision: Optional[str] = PRECISION,
    device: str = DEVICE,
    train: Optional[str] = typer.Option(None, metavar="WHAT",
                                        help=f"heal: what trains: {one_of(TRAIN_MODES, H.train)}; "
                                        "see `heal --help`"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="heal: keep the adapter in OUT/adapter, unmerged"),
    recipe: Optional[Path] = typer.Option(None, metavar="FILE", help="a TOML recipe with [prune] (and [heal]) tables"),
    force: bool = FORCE,
    streaming: bool = typer.Option(False, "--streaming", help="score and copy one block at a time (models larger "
                                   "than memory; no cross-entropy figures, no --heal)"),
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """Remove the layers that change the residual stream least; optionally heal; save."""
    from ..commands.prune import prune as prune_checkpoint

    prune_recipe, heal_recipe = load_prune_recipe(recipe) if recipe else ({}, None)
    p = merge(PRUNE_DEFAULTS, prune_recipe, {"layers": layers, "fraction": fraction, "method": method,
                                             "samples": samples, "seq_len": seq_len, "batch_size": batch_size,
                                             "eval_samples": eval_samples})
    if p["method"] not in METHODS:
        raise SurgeryError(f"unknown method {p['method']!r}{did_you_mean(p['method'], METHODS)}; "
                           f"choose one of {', '.join(METHODS)}")
    opts = PruneOptions(**p)
    opts.check()
    h = None
    if heal or heal_recipe is not None:
        h = HealOptions(**merge(HEAL_DEFAULTS, heal_recipe, {
            "steps": steps, "rank": rank, "lr": lr, "grad_accum": grad_accum,
            "target_modules": split_names(target_modules), "precision": precision, "seq_len": seq_len,
            "batch_size": batch_size, "eval_samples": eval_samples, "train": train}))
        h.check(save_adapter_)
    if plot is not None and plot.is_dir():
        raise SurgeryError(f"--plot {plot} is a folder; give a .png file name")
    body, held_text = read_text(text), read_text(eval_text)
    with claimed(src, out, force, allow_pickle) as source, progress_bar(not json) as progress:
        r = prune_checkpoint(source, out, opts, text=body, eval_text=held_text, heal=h, save_adapter=save_adapter_,
                             streaming=streaming, force=force, progress=progress, device=device)
    if r.saved is None:  # a secondary process of a distributed heal
        return
    from .report import ce_table, loads_with, plot_scores, score_table

    if plot is not None and r.scores is not None:
        plot_scores(plot, r.selection, r.scores)
    if json:
        emit_json({**r.record, "ce": r.ce, "scores": r.scores.as_dict() if r.scores else None,
                   "saved": r.saved, "plot": str(plot) if plot else None})
        return
    if r.scores is not None:
        show(score_table(r.selection, r.scores))
    how = ", one block at a time" if r.streaming else ""
    say(f"removed {len(r.selection.layers)} of {r.removed['layers_before']} layers "
        f"({', '.join(map(str, r.selection.layers))}) by {r.selection.method}{how}; {r.removed['layers_after']} "
        "remain, renumbered")
    if r.ce:
        show(ce_table("held-out cross-entropy", r.ce, r.record.get("recovered"), r.eval_text_ce))
        say_heldout(r.ce_on, r.record)
    elif r.no_lm_head:
        say(f"no cross-entropy: {r.no_lm_head} has no language-modelling head")
    if r.heal:
        print_heal_steps(r.heal, r.heal_seconds)
    a = r.saved.get("adapter")
    tail = f" (the adapter unmerged in adapter/: {a['tensors']} LoRA tensors, read back and checked)" if a else ""
    say_device(r.record.get("device"))
    say(f"saved {r.saved['path']}{tail}; {loads_with(r.saved)}")
    if plot is not None and r.scores is not None:
        say(f"plot: {plot}")
