"""``prune``: remove the layers that change the residual stream least; optionally heal; save."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.errors import SurgeryError
from ..core.options import EVAL_FRACTION, HealOptions, PruneOptions, Writing, did_you_mean, flagged, option
from .app import JSON, claimed, command, emit_json, progress_bar, read_text, say, say_device, show
from .flags import IN, OUT, Flags, Given
from .heal import print_heal_steps, say_heldout

#: the heal flags prune takes, each help prefixed "heal: "; seq_len, batch_size and eval_samples are prune's
#: own flags, which feed heal's options too (:data:`SHARED`)
HEAL_FLAGS = ("steps", "rank", "lr", "target_modules", "grad_accum", "precision", "train", "objective", "temperature",
              "ce_weight", "teacher")
SHARED = ("seq_len", "batch_size", "eval_samples")
HEALING = Flags(HealOptions, only=HEAL_FLAGS, prefix="heal: ")


@dataclass
class PruneAsked:
    """What prune's command line takes besides prune's and heal's options: texts, files, switches."""

    text: Path | None = option(None, f"calibration (and healing) text, its last {EVAL_FRACTION:.0%} held out for CE; "
                               "default: bundled Shakespeare", metavar="FILE")
    eval_text: Path | None = option(None, "a second text for CE (original, pruned, healed), beside the held-out last "
                                    f"{EVAL_FRACTION:.0%} of --text", metavar="FILE")
    plot: Path | None = option(None, "also draw the scores into this PNG", metavar="PNG")
    recipe: Path | None = option(None, "a TOML recipe with [prune] (and [heal]) tables", metavar="FILE")
    streaming: bool = option(PruneOptions.streaming, "score and copy one block at a time (default {default}; models "
                             "larger than memory; no cross-entropy figures, no --heal)", given=False)
    heal: bool = option(False, "heal with LoRA after pruning (see `heal --help`)", given=False)
    save_adapter_: bool = option(False, "heal: keep the adapter in OUT/adapter, unmerged", names=("--save-adapter",),
                                 given=False)


def load_prune_recipe(path: Path) -> tuple[dict, dict | None]:
    """A recipe: a ``[prune]`` table and, to heal as well, a ``[heal]`` table of the options."""
    from ..core.registry import read_recipe

    data = read_recipe(path)
    if not isinstance(data.get("prune"), dict):
        raise SurgeryError(f"recipe {path} needs a [prune] table")
    for table, cls in (("prune", PruneOptions), ("heal", HealOptions)):
        known = [f.name for f in flagged(cls)]
        for key in set(data.get(table) or {}) - set(known):
            raise SurgeryError(f"recipe {path}: [{table}] has no option {key}{did_you_mean(key, known)}; "
                               f"options: {', '.join(known)}")
    return data["prune"], data.get("heal")


def built(options: Given, healing: Given, asked: PruneAsked) -> tuple[PruneOptions, HealOptions | None]:
    """prune's options and, to heal, heal's (None: no healing): the flags given, then the recipe's
    ``[prune]`` and ``[heal]`` tables, then the defaults; a shared flag given feeds both, checked."""
    prune_recipe, heal_recipe = load_prune_recipe(asked.recipe) if asked.recipe else ({}, None)
    opts = options.build(prune_recipe, streaming=asked.streaming)
    opts.check()
    if not asked.heal and heal_recipe is None:
        return opts, None
    shared = {k: v for k, v in options.values.items() if k in SHARED}
    heal = healing.build(heal_recipe, save_adapter=asked.save_adapter_, **shared)
    heal.check()
    return opts, heal


@command(preload=False)
def prune(
    src: str = IN,
    out: Path = OUT,
    options: Flags(PruneOptions) = None,
    asked: PruneAsked = None,
    healing: HEALING = None,
    run: Writing = None,
    json: bool = JSON,
):
    """Remove the layers that change the residual stream least; optionally heal; save."""
    opts, heal = built(options, healing, asked)
    body, held_text = read_text(asked.text), read_text(asked.eval_text)
    with claimed(src, out, run.force, run.allow_pickle) as source, progress_bar(not json) as progress:
        from ..commands.prune import prune as prune_checkpoint
        from .report import plot_scores, plotting

        with plotting(asked.plot, run.force, out) as draw:
            r = prune_checkpoint(source, out, opts, text=body, eval_text=held_text, heal=heal, io=run,
                                 progress=progress)
            if r.saved is None:  # a secondary process of a distributed heal
                return
            if draw is not None and r.scores is not None:
                draw(plot_scores(r.selection, r.scores))
    say_pruned(r, asked.plot if r.scores is not None else None, json)


def say_pruned(r, plot: Path | None, json: bool) -> None:
    """What prune did (``commands.prune.PruneResult`` ``r``): JSON, or the scores, the layers removed,
    the cross-entropy table, the heal's steps, where it was saved and the ``plot`` drawn."""
    from .report import ce_table, loads_with, score_table

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
        show(ce_table("held-out cross-entropy" + (" and KL to the teacher" if "heldout_kl" in r.record else ""),
                      r.ce, r.record.get("recovered"), r.eval_text_ce, r.record))
        say_heldout(r.ce_on, r.record)
    elif r.no_lm_head:
        say(f"no cross-entropy: {r.no_lm_head} has no language-modelling head")
    if r.heal:
        print_heal_steps(r.heal, r.heal_seconds)
    a = r.saved.get("adapter")
    tail = f" (the adapter unmerged in adapter/: {a['tensors']} LoRA tensors, read back and checked)" if a else ""
    say_device(r.record.get("device"))
    say(f"saved {r.saved['path']}{tail}; {loads_with(r.saved)}")
    if plot is not None:
        say(f"plot: {plot}")
