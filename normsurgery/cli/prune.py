"""``prune``: remove the layers that change the residual stream least; optionally heal; save."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import typer

from .. import __version__
from ..errors import SurgeryError
from .app import ALLOW_PICKLE, FORCE, JSON, allow_pickle_option, claimed, command, did_you_mean, emit_json, open_unit, \
    positive, progress_bar, read_text, say, show, stderr
from .heal import HEAL_DEFAULTS, check_values, fit_seq_len, heal_data, heal_summary, make_accelerator, merge, \
    run_heal, save_adapter, split_names

METHODS = ("angular", "block-influence", "last")  # prune.METHODS, named here so --help needs no torch
PRUNE_DEFAULTS = {"layers": None, "fraction": None, "method": "angular", "samples": 32, "seq_len": None,
                  "batch_size": 8}


def load_prune_recipe(path: Path) -> tuple[dict, dict | None]:
    """A recipe: a ``[prune]`` table and, to heal as well, a ``[heal]`` table of the options."""
    from ..registry import read_recipe

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
    layers: Optional[int] = typer.Option(None, "--layers", "-n", min=1, metavar="N", help="how many layers to remove"),
    fraction: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                             help="or: the fraction of layers to remove (rounded)"),
    method: Optional[str] = typer.Option(None, metavar="METHOD", help=f"{' | '.join(METHODS)} (default angular)"),
    text: Optional[Path] = typer.Option(None, metavar="FILE", help="calibration (and healing) text; default: "
                                                                   "bundled Shakespeare"),
    samples: Optional[int] = typer.Option(None, min=1, metavar="K", help="calibration windows (default 32)"),
    seq_len: Optional[int] = typer.Option(None, min=2, metavar="L", help="tokens per window (default: 128, or the "
                                                                          "model's positions when fewer)"),
    batch_size: Optional[int] = typer.Option(None, min=1, metavar="B", help="windows per forward pass and per heal "
                                                                            "micro-batch (default 8)"),
    plot: Optional[Path] = typer.Option(None, metavar="PNG", help="also draw the scores into this PNG"),
    heal: bool = typer.Option(False, "--heal", help="heal with LoRA after pruning (see `heal --help`)"),
    eval_text: Optional[Path] = typer.Option(None, metavar="FILE", help="held-out text for CE (default: the end "
                                                                        "of --text)"),
    eval_samples: Optional[int] = typer.Option(None, min=1, metavar="K", help="held-out windows at most (default 64)"),
    steps: Optional[int] = typer.Option(None, min=1, metavar="N", help="heal: optimizer steps (default 200)"),
    rank: Optional[int] = typer.Option(None, min=1, metavar="R", help="heal: LoRA rank (default 8)"),
    lr: Optional[float] = typer.Option(None, callback=positive, metavar="X", help="heal: learning rate (default 2e-3)"),
    target_modules: Optional[list[str]] = typer.Option(None, metavar="NAMES", help="heal: linears to adapt, by name "
                                                       "(default: all in the blocks)"),
    grad_accum: Optional[int] = typer.Option(None, min=1, metavar="K", help="heal: gradient-accumulation steps (default 1)"),
    precision: Optional[str] = typer.Option(None, metavar="P", help="heal: auto (bf16 on a GPU that has it) | fp32 | "
                                                                   "bf16 | fp16"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="heal: keep the adapter in OUT/adapter, unmerged"),
    recipe: Optional[Path] = typer.Option(None, metavar="FILE", help="a TOML recipe with [prune] (and [heal]) tables"),
    force: bool = FORCE,
    streaming: bool = typer.Option(False, "--streaming", help="score and copy one block at a time (models larger "
                                   "than memory; no cross-entropy figures, no --heal)"),
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """Remove the layers that change the residual stream least; optionally heal; save."""
    from .. import checkpoint

    allow_pickle_option(allow_pickle)
    prune_recipe, heal_recipe = load_prune_recipe(recipe) if recipe else ({}, None)
    p = merge(PRUNE_DEFAULTS, prune_recipe, {"layers": layers, "fraction": fraction, "method": method,
                                             "samples": samples, "seq_len": seq_len, "batch_size": batch_size})
    do_heal = heal or heal_recipe is not None
    h = merge(HEAL_DEFAULTS, heal_recipe, {"steps": steps, "rank": rank, "lr": lr, "grad_accum": grad_accum,
                                           "target_modules": split_names(target_modules), "precision": precision,
                                           "seq_len": seq_len, "batch_size": batch_size, "eval_samples": eval_samples})
    if p["method"] not in METHODS:
        raise SurgeryError(f"unknown method {p['method']!r}{did_you_mean(p['method'], METHODS)}; "
                           f"choose one of {', '.join(METHODS)}")
    check_values(p)
    check_values(h)
    if plot is not None and plot.is_dir():
        raise SurgeryError(f"--plot {plot} is a folder; give a .png file name")
    body = read_text(text)
    held_text = read_text(eval_text)
    with claimed(src, out, force) as path:
        cfg = checkpoint.load_config(path)
        if streaming:
            return _prune_streaming(path, src, out, cfg, p, do_heal, body, force, plot, json, seq_len)
        result = _prune(path, src, out, cfg, p, h, do_heal, body, held_text, save_adapter_, force, json,
                        seq_len)
    if result is None:
        return
    meta, ce, scores, selection, record, report, seconds, saved, headless = result
    if plot is not None and scores is not None:
        from .report import plot_scores

        plot_scores(plot, selection, scores)
    from .report import ce_table, heal_line, loads_with, overfit_note, recovered_fraction, score_table

    rec = recovered_fraction(ce["original"], ce["pruned"], ce["healed"]) if "healed" in ce else None
    if json:
        emit_json({**meta, "ce": ce, "recovered": rec, "scores": scores.as_dict() if scores else None,
                   "saved": saved, "plot": str(plot) if plot else None})
        return
    if scores is not None:
        show(score_table(selection, scores))
    say(f"removed {len(selection.layers)} of {record['layers_before']} layers "
        f"({', '.join(map(str, selection.layers))}) by {selection.method}; {record['layers_after']} remain, renumbered")
    if ce:
        where = "held-out text" if held_text or do_heal else "the calibration windows"
        show(ce_table(f"cross-entropy on {where}", list(ce.items()), rec))
    elif headless:
        say(f"no cross-entropy: {headless} has no language-modelling head")
    if report:
        say(heal_line(report, seconds))
        if overfit_note(report):
            stderr().print(overfit_note(report), markup=False, highlight=False)
    tail = " (adapter unmerged in adapter/)" if report and save_adapter_ else ""
    say(f"saved {saved['path']}{tail}; {loads_with(saved)}")
    if plot is not None and scores is not None:
        say(f"plot: {plot}")


def _prune(path, src, out, cfg, p, h, do_heal, body, held_text, keep_adapter, force, json, given_seq_len):
    """Score, remove, (heal), save. None on a secondary process of a distributed heal."""
    from .. import checkpoint
    from ..calibration import tokenize, windows
    from ..families import layout
    from ..heal import heldout_ce, require_lm
    from ..layout import LM_OBJECTIVES
    from ..prune import prune_model, score_layers, select_layers
    from ..verify import probe_ids, reload_check

    n, tokenizer, body, cal = _calibration(path, src, cfg, p, do_heal, body, given_seq_len)
    fit_seq_len(cfg, h, given_seq_len)
    if do_heal:
        train, held = heal_data(tokenizer, body, held_text, h)
    else:
        held = windows(tokenize(tokenizer, held_text), p["seq_len"], h["eval_samples"]) if held_text else cal

    acc = make_accelerator(h)  # one process of several, or the only one
    model = checkpoint.load(path).to(acc.device)
    lm = layout(model).objective in LM_OBJECTIVES
    if do_heal or held_text:
        require_lm(model)  # --heal and --eval-text need a language-modelling head
    with progress_bar(not json and acc.is_main_process) as progress:
        scores = score_layers(model, cal, batch_size=p["batch_size"], progress=progress) if cal is not None else None
        selection = select_layers(p["method"], n, scores, cfg.num_hidden_layers)
        mask_id = getattr(tokenizer, "mask_token_id", None)
        ce = {}
        if held is not None and lm:
            progress("held-out CE", 0, 2)
            ce["original"] = heldout_ce(model, held, mask_token_id=mask_id)
        record = prune_model(model, selection.layers)
        if held is not None and lm:
            ce["pruned"] = heldout_ce(model, held, mask_token_id=mask_id)
            progress("held-out CE", 2, 2)
    report = seconds = None
    if do_heal:
        model, report, seconds = run_heal(acc, model, tokenizer, train, held, h, keep_adapter,
                                          not json and acc.is_main_process)
        ce["healed"] = report.ce_after
    if not acc.is_main_process:
        acc.wait_for_everyone()
        return None
    meta = {"version": __version__, "source": str(src),
            "prune": {**selection.as_dict(), **record, "text_tokens": scores.tokens if scores else 0},
            **({"heal": heal_summary(report)} if report else {})}
    if report and keep_adapter:
        with checkpoint.writing(out, force=force, source=path) as stage:
            adapter = stage.path / ".adapter"
            save_adapter(model, adapter, Path(out).expanduser().resolve())
            base = model.unload()
            info = checkpoint.save_into(base, stage.path, source=path, record=meta, check=reload_check(base, held[:4]))
            shutil.move(adapter, stage.path / "adapter")
        saved = {"path": str(out), "files": sorted(f.name for f in Path(out).iterdir()), **info}
    else:
        probe = cal[:4] if cal is not None else probe_ids(model, None, None, 4, p["seq_len"])
        saved = checkpoint.save(model, out, source=path, force=force, record=meta, check=reload_check(model, probe))
    acc.wait_for_everyone()
    return meta, ce, scores, selection, record, report, seconds, saved, None if lm else type(model).__name__


def _calibration(path, src, cfg, p, do_heal, body, given_seq_len):
    """How many layers go, the tokenizer, the text (bundled when none is given) and the scoring
    windows (None for ``--method last`` without a tokenizer)."""
    from .. import checkpoint
    from ..calibration import bundled_text, tokenize, windows
    from ..prune import count_layers

    n = count_layers(cfg.num_hidden_layers, p["layers"], p["fraction"])
    fit_seq_len(cfg, p, given_seq_len)
    tokenizer = checkpoint.load_tokenizer(path)
    if tokenizer is None and (p["method"] != "last" or do_heal):
        raise SurgeryError(f"{src} has no tokenizer: --method {p['method']}{' and --heal' if do_heal else ''} "
                           "need one to read text (--method last alone does not)")
    if body is None and tokenizer is not None:
        body = bundled_text()
    cal = windows(tokenize(tokenizer, body), p["seq_len"], p["samples"]) if tokenizer is not None else None
    return n, tokenizer, body, cal


def _prune_streaming(path, src, out, cfg, p, do_heal, body, force, plot, json, given_seq_len) -> None:
    """prune --streaming: scores from one streamed pass over the checkpoint, tensors copied part by part."""
    from .. import streaming
    from ..prune import select_layers
    from .report import plot_scores, score_table

    if do_heal:
        raise SurgeryError("--heal trains the whole model in memory: prune with --streaming, then heal the result")
    n, _, _, cal = _calibration(path, src, cfg, p, do_heal, body, given_seq_len)
    scores = streaming.score(path, cal) if cal is not None else None
    selection = select_layers(p["method"], n, scores, cfg.num_hidden_layers)
    meta = {"version": __version__, "source": str(src),
            "prune": {**selection.as_dict(), "text_tokens": scores.tokens if scores else 0}}
    record = streaming.prune(path, out, selection.layers, force=force, record=meta)
    saved = record.pop("saved")
    meta["prune"].update(record)
    if plot is not None and scores is not None:
        plot_scores(plot, selection, scores)
    if json:
        emit_json({**meta, "streaming": True, "scores": scores.as_dict() if scores else None, "saved": saved})
        return
    if scores is not None:
        show(score_table(selection, scores))
    say(f"removed {len(selection.layers)} of {record['layers_before']} layers "
        f"({', '.join(map(str, selection.layers))}) by {selection.method}, one block at a time; "
        f"{record['layers_after']} remain, renumbered")
    say(f"saved {saved['path']}")
