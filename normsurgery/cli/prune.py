"""prune and heal: remove layers by similarity, repair with LoRA, save a plain checkpoint."""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import __version__, checkpoint
from .. import streaming as stream
from ..calibration import max_length, read_text, split_heldout, tokenize, windows
from ..errors import SurgeryError
from ..families import layout
from ..heal import heal_model, heldout_ce, make_accelerator, require_lm
from ..layout import LM_OBJECTIVES
from ..prune import METHODS, count_layers, prune_model, score_layers, select_layers
from ..verify import probe_ids, reload_check
from .app import command, console, emit_json, err
from .core import loads_with

PRUNE_DEFAULTS = {"layers": None, "fraction": None, "method": "angular", "samples": 32, "seq_len": 128,
                  "batch_size": 8}
HEAL_DEFAULTS = {"steps": 200, "rank": 8, "alpha": None, "lr": 2e-3, "target_modules": None,
                 "batch_size": 8, "seq_len": 128, "grad_accum": 1, "precision": "auto",
                 "eval_fraction": 0.1, "eval_samples": 64, "seed": 0}


def load_prune_recipe(path: Path) -> tuple[dict, dict | None]:
    """A recipe: a ``[prune]`` table and, to heal as well, a ``[heal]`` table of the options."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SurgeryError(f"no recipe at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise SurgeryError(f"recipe {path} is not valid TOML: {e}") from None
    if not isinstance(data.get("prune"), dict):
        raise SurgeryError(f"recipe {path} needs a [prune] table")
    for table, known in (("prune", PRUNE_DEFAULTS), ("heal", HEAL_DEFAULTS)):
        unknown = set(data.get(table) or {}) - set(known)
        if unknown:
            raise SurgeryError(f"recipe {path}: [{table}] has no option {', '.join(sorted(unknown))}; "
                               f"options: {', '.join(known)}")
    return data["prune"], data.get("heal")


def merge(defaults: dict, recipe: dict | None, given: dict) -> dict:
    """Options given on the command line win over the recipe, which wins over the defaults."""
    return {k: given[k] if given.get(k) is not None else (recipe or {}).get(k, v) for k, v in defaults.items()}


def split_names(names: Optional[list[str]]) -> list[str] | None:
    out = [n.strip() for item in names or [] for n in item.split(",") if n.strip()]
    return out or None


def check_seq_len(config, seq_len: int) -> None:
    limit = max_length(config)
    if limit is not None and seq_len > limit:
        raise SurgeryError(f"--seq-len {seq_len} is longer than the model's {limit} positions")


def check_counts(opts: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        if opts[k] < 1:
            raise SurgeryError(f"--{k.replace('_', '-')} must be at least 1, got {opts[k]}")


@contextmanager
def step_bar(enabled: bool, what: str):
    """A (step, total, running loss) callback drawing a bar on stderr (terminals only)."""
    if not enabled or not sys.stderr.isatty() and not os.environ.get("NORMSURGERY_PROGRESS"):
        yield lambda step, total, loss: None
        return
    with Progress(TextColumn(what), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=err) as bar:
        task = bar.add_task(what, total=None, loss="-")
        yield lambda step, total, loss: bar.update(task, completed=step, total=total, loss=f"{loss:.4f}")


def score_table(selection, scores) -> Table:
    """Candidates with their scores as bars; the removed ones marked."""
    what = ("block influence 1 - cos(x_in, x_out)" if selection.method == "block-influence"
            else "angular distance arccos(cos(x_l, x_l+n)) / pi")
    table = Table(title=f"{selection.method}: {what} over {scores.tokens} tokens (smaller = more removable)")
    table.add_column("layer" if selection.method == "block-influence" else "block")
    table.add_column("score", justify="right")
    table.add_column("")
    table.add_column("removed")
    top = max(selection.scores) or 1.0
    for i, (c, s) in enumerate(zip(selection.candidates, selection.scores)):
        mark = i in selection.chosen
        bar = "█" * max(1, round(30 * s / top)) if s > 0 else ""
        table.add_row(c, f"{s:.4f}", f"[red]{bar}[/red]" if mark else bar, "yes" if mark else "")
    return table


def plot_scores(path: Path, selection, scores) -> None:
    """Left: the chosen method's candidate scores (removed in red). Right: d(l, n) for every
    start l and block size n, the chosen block marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = scores.num_layers
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colours = ["tab:red" if i in selection.chosen else "tab:blue" for i in range(len(selection.candidates))]
    a.bar(range(len(selection.scores)), selection.scores, color=colours)
    a.set_xticks(range(len(selection.candidates)), selection.candidates, rotation=45 if L > 12 else 0)
    a.set_xlabel("layer" if selection.method == "block-influence" else f"block of {selection.n}")
    a.set_ylabel("1 - cos" if selection.method == "block-influence" else "angular distance / pi")
    a.set_title(f"{selection.method}: removed {', '.join(map(str, selection.layers))}")
    grid = [[float(scores.angular[l, l + n]) if l + n <= L else float("nan") for l in range(L)]
            for n in range(1, L)]
    im = b.imshow(grid, origin="lower", aspect="auto", cmap="viridis",
                  extent=(-0.5, L - 0.5, 0.5, L - 0.5))
    if selection.method != "block-influence":
        b.scatter([selection.layers[0]], [selection.n], marker="x", color="red", s=80)
    b.set_xlabel("first layer l")
    b.set_ylabel("block size n")
    b.set_title("angular distance d(l, n)")
    fig.colorbar(im, ax=b)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _heal_data(tokenizer, text: str, eval_text: str | None, opts: dict):
    ids = tokenize(tokenizer, text)
    if eval_text is None:
        train, held = split_heldout(ids, opts["eval_fraction"], opts["seq_len"])
    else:
        train, held = ids, tokenize(tokenizer, eval_text)
    windows(train, opts["seq_len"], 1, "the training text")
    n_eval = min(opts["eval_samples"], max(1, len(held) // opts["seq_len"]))
    return train, windows(held, opts["seq_len"], n_eval, "the held-out text")


def _run_heal(acc, model, tokenizer, train, held, opts, save_adapter: bool, progress):
    return heal_model(model, train, held, steps=opts["steps"], seq_len=opts["seq_len"],
                            batch_size=opts["batch_size"], rank=opts["rank"], alpha=opts["alpha"],
                            lr=opts["lr"], target_modules=opts["target_modules"],
                            mask_token_id=getattr(tokenizer, "mask_token_id", None), merge=not save_adapter,
                            seed=opts["seed"], grad_accum=opts["grad_accum"], accelerator=acc, progress=progress)


def save_adapter(peft_model, out: Path, base, *, source=None, force: bool = False) -> None:
    """Write a peft adapter folder atomically; ``base`` is what adapter_config.json names."""
    out = Path(out)
    checkpoint.check_output(out, force)
    peft_model.peft_config["default"].base_model_name_or_path = str(base)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        peft_model.save_pretrained(tmp, save_embedding_layers=False)  # LoRA never touches embeddings
        if source is not None:
            for f in checkpoint.resolve(source).glob("*token*"):
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


OVERFIT_EPOCHS = 4


def overfit_note(report) -> str | None:
    if report.epochs <= OVERFIT_EPOCHS:
        return None
    return (f"note: healing read the training text {report.epochs:.0f} times over "
            f"({report.tokens} tokens from {round(report.tokens / report.epochs)}): held-out CE may "
            "suffer from overfitting; give more text or fewer --steps")


def _heal_summary(report) -> dict:
    return {k: v for k, v in report.as_dict().items() if k != "losses"}


def _ce_table(title: str, rows: list[tuple[str, float]], recovered: float | None) -> Table:
    table = Table(title=title)
    table.add_column("model")
    table.add_column("CE (nats/token)", justify="right")
    for name, ce in rows:
        table.add_row(name, f"{ce:.4f}")
    if recovered is not None:
        table.add_row("gap recovered by healing", f"{100 * recovered:.1f}%")
    return table


def recovered_fraction(original: float, pruned: float, healed: float) -> float | None:
    """(CE_pruned - CE_healed) / (CE_pruned - CE_original): the share of the damage repaired."""
    gap = pruned - original
    return (pruned - healed) / gap if gap > 0 else None


@command
def prune(
    src: str = typer.Argument(..., help="input checkpoint: a folder or a cached hub id"),
    out: Path = typer.Argument(..., help="output folder (written atomically)"),
    layers: Optional[int] = typer.Option(None, "--layers", "-n", help="how many layers to remove"),
    fraction: Optional[float] = typer.Option(None, help="or: the fraction of layers to remove (rounded)"),
    method: Optional[str] = typer.Option(None, help=f"{' | '.join(METHODS)} (default angular)"),
    text: Optional[Path] = typer.Option(None, help="calibration (and healing) text; default: bundled Shakespeare"),
    samples: Optional[int] = typer.Option(None, help="calibration windows (default 32)"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per window (default 128)"),
    batch_size: Optional[int] = typer.Option(None, help="windows per forward pass and per heal micro-batch (default 8)"),
    plot: Optional[Path] = typer.Option(None, help="also draw the scores into this PNG"),
    heal: bool = typer.Option(False, "--heal", help="heal with LoRA after pruning (see `heal --help`)"),
    eval_text: Optional[Path] = typer.Option(None, help="held-out text for CE (default: the end of --text)"),
    eval_samples: Optional[int] = typer.Option(None, help="held-out windows at most (default 64)"),
    steps: Optional[int] = typer.Option(None, help="heal: optimizer steps (default 200)"),
    rank: Optional[int] = typer.Option(None, help="heal: LoRA rank (default 8)"),
    lr: Optional[float] = typer.Option(None, help="heal: learning rate (default 2e-3)"),
    target_modules: Optional[list[str]] = typer.Option(None, help="heal: linears to adapt, by name (default: all in the blocks)"),
    grad_accum: Optional[int] = typer.Option(None, help="heal: gradient-accumulation steps (default 1)"),
    precision: Optional[str] = typer.Option(None, help="heal: auto (bf16 on a GPU that has it) | no | bf16 | fp16"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="heal: keep the adapter in OUT/adapter, unmerged"),
    recipe: Optional[Path] = typer.Option(None, help="a TOML recipe with [prune] (and [heal]) tables"),
    force: bool = typer.Option(False, help="replace an existing output"),
    streaming: bool = typer.Option(False, "--streaming", help="score and copy one block at a time "
                                   "(models larger than memory; no cross-entropy figures, no --heal)"),
    json: bool = typer.Option(False, "--json", help="print the result as JSON"),
):
    """Remove the layers that change the residual stream least; optionally heal; save."""
    prune_recipe, heal_recipe = load_prune_recipe(recipe) if recipe else ({}, None)
    p = merge(PRUNE_DEFAULTS, prune_recipe, {"layers": layers, "fraction": fraction, "method": method,
                                             "samples": samples, "seq_len": seq_len, "batch_size": batch_size})
    do_heal = heal or heal_recipe is not None
    h = merge(HEAL_DEFAULTS, heal_recipe, {"steps": steps, "rank": rank, "lr": lr, "grad_accum": grad_accum,
                                           "target_modules": split_names(target_modules), "precision": precision,
                                           "seq_len": seq_len, "batch_size": batch_size, "eval_samples": eval_samples})
    if p["method"] not in METHODS:
        raise SurgeryError(f"unknown method {p['method']!r}; choose one of {', '.join(METHODS)}")
    path = checkpoint.resolve(src)
    cfg = checkpoint.load_config(path)
    n = count_layers(cfg.num_hidden_layers, p["layers"], p["fraction"])
    checkpoint.check_output(out, force, path)
    check_seq_len(cfg, p["seq_len"])
    check_counts({**h, **p}, ("samples", "batch_size", "eval_samples") + (("steps", "rank") if do_heal else ()))
    tokenizer = checkpoint.load_tokenizer(path)
    needs_text = p["method"] != "last" or do_heal
    if tokenizer is None and needs_text:
        raise SurgeryError(f"{src} has no tokenizer: --method {p['method']}{' and --heal' if do_heal else ''} "
                           "need one to read text (--method last alone does not)")
    body = read_text(text) if text is not None else (read_text(_bundled()) if tokenizer else None)
    held_text = read_text(eval_text) if eval_text is not None else None
    cal = windows(tokenize(tokenizer, body), p["seq_len"], p["samples"]) if tokenizer is not None else None
    if do_heal:
        check_seq_len(cfg, h["seq_len"])
        train, held = _heal_data(tokenizer, body, held_text, h)
    else:
        held = windows(tokenize(tokenizer, held_text), p["seq_len"], h["eval_samples"]) if held_text else cal

    if streaming:
        _prune_streaming(src, path, out, n, cal, p["method"], cfg, do_heal, force, plot, json)
        return
    acc = make_accelerator(h["precision"])  # one process of several, or the only one
    model = checkpoint.load(path).to(acc.device)
    lm = layout(model).objective in LM_OBJECTIVES
    if do_heal or held_text:
        require_lm(model)  # --heal and --eval-text need a language-modelling head
    scores = score_layers(model, cal, batch_size=p["batch_size"]) if cal is not None else None
    selection = select_layers(p["method"], n, scores, cfg.num_hidden_layers)
    mask_id = getattr(tokenizer, "mask_token_id", None)
    ce = {}
    if held is not None and lm:
        ce["original"] = heldout_ce(model, held, mask_token_id=mask_id)
    record = prune_model(model, selection.layers)
    if held is not None and lm:
        ce["pruned"] = heldout_ce(model, held, mask_token_id=mask_id)
    report = None
    if do_heal:
        with step_bar(not json and acc.is_main_process, "heal") as bar:
            model, report = _run_heal(acc, model, tokenizer, train, held, h, save_adapter_, bar)
        ce["healed"] = report.ce_after
    if not acc.is_main_process:
        acc.wait_for_everyone()
        return
    meta = {"version": __version__, "source": str(src),
            "prune": {**selection.as_dict(), **record, "text_tokens": scores.tokens if scores else 0},
            **({"heal": _heal_summary(report)} if report else {})}
    if report and save_adapter_:
        adapter_tmp = out.parent / f".{out.name}.adapter-{os.getpid()}"
        save_adapter(model, adapter_tmp, Path(out).resolve(), force=True)
        try:
            base = model.unload()
            saved = checkpoint.save(base, out, source=path, force=force, record=meta,
                                    check=reload_check(base, held[:4]))
            adapter_tmp.rename(Path(out) / "adapter")
        finally:
            shutil.rmtree(adapter_tmp, ignore_errors=True)
    else:
        probe = cal[:4] if cal is not None else probe_ids(model, None, None, 4, p["seq_len"])
        saved = checkpoint.save(model, out, source=path, force=force, record=meta, check=reload_check(model, probe))
    acc.wait_for_everyone()
    if plot is not None and scores is not None:
        plot_scores(plot, selection, scores)
    rec = recovered_fraction(ce["original"], ce["pruned"], ce["healed"]) if "healed" in ce else None
    if json:
        emit_json({**meta, "ce": ce, "recovered": rec, "scores": scores.as_dict() if scores else None,
                   "saved": saved, "plot": str(plot) if plot else None})
        return
    if scores is not None:
        console.print(score_table(selection, scores))
    console.print(f"removed {len(selection.layers)} of {record['layers_before']} layers "
                  f"({', '.join(map(str, selection.layers))}) by {selection.method}; "
                  f"{record['layers_after']} remain, renumbered", highlight=False)
    if ce:
        where = "held-out text" if held_text or do_heal else "the calibration windows"
        rows = [(k, v) for k, v in ce.items()]
        console.print(_ce_table(f"cross-entropy on {where}", rows, rec))
    elif not lm:
        console.print(f"no cross-entropy: {type(model).__name__} has no language-modelling head", highlight=False)
    if report:
        console.print(f"healed: {report.steps} steps, {report.tokens} tokens, "
                      f"{report.tokens_per_second:.0f} tokens/s, LoRA rank {report.rank} on "
                      f"{report.target_modules} linears", highlight=False)
        if overfit_note(report):
            err.print(overfit_note(report), highlight=False)
    tail = " (adapter unmerged in adapter/)" if report and save_adapter_ else ""
    console.print(f"saved {saved['path']}{tail}; {loads_with(saved)}", highlight=False)
    if plot is not None and scores is not None:
        console.print(f"plot: {plot}", highlight=False)


def _prune_streaming(src, path, out, n, cal, method, cfg, do_heal, force, plot, json) -> None:
    """prune --streaming: scores from one pass over the checkpoint, tensors copied part by part."""
    if do_heal:
        raise SurgeryError("--heal trains the whole model in memory: prune with --streaming, then heal the result")
    scores = stream.score(path, cal) if cal is not None else None
    selection = select_layers(method, n, scores, cfg.num_hidden_layers)
    meta = {"version": __version__, "source": str(src),
            "prune": {**selection.as_dict(), "text_tokens": scores.tokens if scores else 0}}
    record = stream.prune(path, out, selection.layers, force=force, record=meta)
    saved = record.pop("saved")
    meta["prune"].update(record)
    if plot is not None and scores is not None:
        plot_scores(plot, selection, scores)
    if json:
        emit_json({**meta, "streaming": True, "scores": scores.as_dict() if scores else None, "saved": saved})
        return
    if scores is not None:
        console.print(score_table(selection, scores))
    console.print(f"removed {len(selection.layers)} of {record['layers_before']} layers "
                  f"({', '.join(map(str, selection.layers))}) by {selection.method}, one block at a time; "
                  f"{record['layers_after']} remain, renumbered", highlight=False)
    console.print(f"saved {saved['path']}", highlight=False)


@command
def heal(
    src: str = typer.Argument(..., help="input checkpoint (a pruned one, typically)"),
    out: Path = typer.Argument(..., help="output folder (written atomically)"),
    text: Path = typer.Option(..., help="training text; its last --eval-fraction is held out"),
    eval_text: Optional[Path] = typer.Option(None, help="held-out text instead of the end of --text"),
    steps: Optional[int] = typer.Option(None, help="optimizer steps (default 200)"),
    rank: Optional[int] = typer.Option(None, help="LoRA rank (default 8)"),
    alpha: Optional[float] = typer.Option(None, help="LoRA alpha (default 2 x rank)"),
    lr: Optional[float] = typer.Option(None, help="learning rate (default 2e-3)"),
    target_modules: Optional[list[str]] = typer.Option(None, help="linears to adapt, by name, e.g. q_proj,v_proj "
                                                                  "(default: every linear in the blocks)"),
    batch_size: Optional[int] = typer.Option(None, help="windows per micro-batch and process (default 8)"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per window (default 128)"),
    grad_accum: Optional[int] = typer.Option(None, help="gradient-accumulation steps (default 1)"),
    precision: Optional[str] = typer.Option(None, help="auto (bf16 on a GPU that has it) | no | bf16 | fp16"),
    eval_fraction: Optional[float] = typer.Option(None, help="share of --text held out (default 0.1)"),
    eval_samples: Optional[int] = typer.Option(None, help="held-out windows at most (default 64)"),
    seed: Optional[int] = typer.Option(None, help="random seed (default 0)"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="save the peft adapter (base: SRC), unmerged"),
    force: bool = typer.Option(False, help="replace an existing output"),
    json: bool = typer.Option(False, "--json", help="print the result as JSON"),
):
    """LoRA on the remaining linears (LM loss; MLM for BERT), merge, save a plain checkpoint."""
    h = merge(HEAL_DEFAULTS, None, {"steps": steps, "rank": rank, "alpha": alpha, "lr": lr,
                                    "target_modules": split_names(target_modules), "batch_size": batch_size,
                                    "seq_len": seq_len, "grad_accum": grad_accum, "precision": precision,
                                    "eval_fraction": eval_fraction, "eval_samples": eval_samples, "seed": seed})
    path = checkpoint.resolve(src)
    cfg = checkpoint.load_config(path)
    checkpoint.check_output(out, force, path)
    check_seq_len(cfg, h["seq_len"])
    check_counts(h, ("steps", "rank", "batch_size", "eval_samples"))
    tokenizer = checkpoint.load_tokenizer(path)
    if tokenizer is None:
        raise SurgeryError(f"{src} has no tokenizer to read the text with")
    body = read_text(text)
    train, held = _heal_data(tokenizer, body, read_text(eval_text) if eval_text else None, h)
    acc = make_accelerator(h["precision"])
    model = checkpoint.load(path)
    with step_bar(not json and acc.is_main_process, "heal") as bar:
        model, report = _run_heal(acc, model, tokenizer, train, held, h, save_adapter_, bar)
    if not acc.is_main_process:
        acc.wait_for_everyone()
        return
    meta = {"version": __version__, "source": str(src), "heal": _heal_summary(report)}
    if save_adapter_:
        save_adapter(model, out, path.resolve(), source=path, force=force)
        saved = {"path": str(out), "files": sorted(f.name for f in Path(out).iterdir())}
    else:
        saved = checkpoint.save(model, out, source=path, force=force, record=meta, check=reload_check(model, held[:4]))
    acc.wait_for_everyone()
    if json:
        emit_json({**meta, "saved": saved, "losses": report.losses})
        return
    console.print(_ce_table("held-out cross-entropy", [("before", report.ce_before), ("after", report.ce_after)], None))
    console.print(f"{report.steps} steps, {report.tokens} tokens in {report.seconds:.1f} s "
                  f"({report.tokens_per_second:.0f} tokens/s, {report.processes} process(es), "
                  f"precision {report.mixed_precision}); LoRA rank {report.rank} on {report.target_modules} linears, "
                  f"{report.trainable_parameters} trainable parameters", highlight=False)
    if overfit_note(report):
        err.print(overfit_note(report), highlight=False)
    what = f"adapter (peft; base {path})" if save_adapter_ else f"merged; {loads_with(saved)}"
    console.print(f"saved {saved['path']}: {what}", highlight=False)


def _bundled() -> Path:
    from importlib import resources

    return Path(str(resources.files("normsurgery").joinpath("data/sample.txt")))
