"""``heal``: LoRA on the remaining linears, merge (or keep the adapter), save. Also what ``prune
--heal`` shares with it: defaults, option checks, the data split, the step bar, adapter saving."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from .. import __version__
from ..errors import SurgeryError
from .app import ALLOW_PICKLE, FORCE, JSON, allow_pickle_option, claimed, command, emit_json, open_unit, positive, \
    progress_bar, read_text, say, show, stderr

PRECISIONS = {"auto": "auto", "fp32": "no", "no": "no", "bf16": "bf16", "fp16": "fp16"}
SEQ_LEN = 128  # default tokens per window, or the model's positions when fewer
HEAL_DEFAULTS = {"steps": 200, "rank": 8, "alpha": None, "lr": 2e-3, "target_modules": None,
                 "batch_size": 8, "seq_len": None, "grad_accum": 1, "precision": "auto",
                 "eval_fraction": 0.1, "eval_samples": 64, "seed": 0}
AT_LEAST = {"samples": 1, "batch_size": 1, "eval_samples": 1, "steps": 1, "rank": 1, "grad_accum": 1,
            "layers": 1, "seq_len": 2, "seed": 0}
BETWEEN_0_1 = ("fraction", "eval_fraction")
POSITIVE = ("lr", "alpha")


def merge(defaults: dict, recipe: dict | None, given: dict) -> dict:
    """Options given on the command line win over the recipe, which wins over the defaults."""
    return {k: given[k] if given.get(k) is not None else (recipe or {}).get(k, v) for k, v in defaults.items()}


def check_values(opts: dict) -> None:
    """The ranges the command line enforces, for values that came from a recipe too."""
    for k, v in opts.items():
        flag = f"--{k.replace('_', '-')}"
        if v is None:
            continue
        if k in AT_LEAST and (not isinstance(v, int) or isinstance(v, bool) or v < AT_LEAST[k]):
            raise SurgeryError(f"{flag} must be a whole number of at least {AT_LEAST[k]}, got {v!r}")
        if k in BETWEEN_0_1 and (not isinstance(v, (int, float)) or not 0 < v < 1):
            raise SurgeryError(f"{flag} must be between 0 and 1 (exclusive), got {v!r}")
        if k in POSITIVE and (not isinstance(v, (int, float)) or v <= 0):
            raise SurgeryError(f"{flag} must be positive, got {v!r}")
    if opts.get("precision") is not None and opts["precision"] not in PRECISIONS:
        raise SurgeryError(f"--precision {opts['precision']!r}: choose one of auto, fp32, bf16, fp16")


def split_names(names: Optional[list[str]]) -> list[str] | None:
    out = [n.strip() for item in names or [] for n in item.split(",") if n.strip()]
    return out or None


def fit_seq_len(config, opts: dict, given: int | None) -> None:
    """The default window fits the model (min(128, positions)); a longer explicit one is refused."""
    from ..calibration import max_length

    limit = max_length(config)
    if opts["seq_len"] is None:
        opts["seq_len"] = min(SEQ_LEN, limit or SEQ_LEN)
    elif limit is not None and opts["seq_len"] > limit:
        where = "--seq-len" if given is not None else "the recipe's seq_len"
        raise SurgeryError(f"{where} {opts['seq_len']} is longer than the model's {limit} positions")


def heal_data(tokenizer, text: str, eval_text: str | None, opts: dict):
    """(training ids, held-out windows): the end of ``text`` held out unless ``eval_text``."""
    from ..calibration import split_heldout, tokenize, windows

    ids = tokenize(tokenizer, text)
    if eval_text is None:
        train, held = split_heldout(ids, opts["eval_fraction"], opts["seq_len"])
    else:
        train, held = ids, tokenize(tokenizer, eval_text)
    windows(train, opts["seq_len"], 1, "the training text")
    n_eval = min(opts["eval_samples"], max(1, len(held) // opts["seq_len"]))
    return train, windows(held, opts["seq_len"], n_eval, "the held-out text")


def run_heal(acc, model, tokenizer, train, held, opts, keep_adapter: bool, show_bar: bool):
    """heal_model with a bar that says when it evaluates (before the first step, after the
    last); returns (model, report, wall seconds)."""
    from ..heal import heal_model

    steps = opts["steps"]
    with progress_bar(show_bar) as update:
        update("heal", 0, steps, "evaluating held-out CE")

        def step(done, total, loss):
            update("heal", done, total, f"loss {loss:.4f}" + ("; evaluating held-out CE" if done == total else ""))

        t0 = time.perf_counter()
        model, report = heal_model(model, train, held, steps=steps, seq_len=opts["seq_len"],
                                   batch_size=opts["batch_size"], rank=opts["rank"], alpha=opts["alpha"],
                                   lr=opts["lr"], target_modules=opts["target_modules"],
                                   mask_token_id=getattr(tokenizer, "mask_token_id", None),
                                   merge=not keep_adapter, seed=opts["seed"], grad_accum=opts["grad_accum"],
                                   accelerator=acc, progress=step)
    return model, report, time.perf_counter() - t0


def make_accelerator(opts: dict):
    from ..heal import make_accelerator as make

    return make(PRECISIONS[opts["precision"]])


def save_adapter(peft_model, folder: Path, base, *, source=None) -> None:
    """Write the peft adapter into ``folder`` (a checkpoint.writing stage, or a folder inside
    one); ``base`` is what adapter_config.json names; ``source``'s tokenizer files are copied."""
    import shutil

    from .. import checkpoint

    peft_model.peft_config["default"].base_model_name_or_path = str(base)
    peft_model.save_pretrained(folder, save_embedding_layers=False)  # LoRA never touches embeddings
    if source is not None:
        for f in checkpoint.resolve(source).glob("*token*"):
            shutil.copy2(f, Path(folder) / f.name)


def heal_summary(report) -> dict:
    return {k: v for k, v in report.as_dict().items() if k != "losses"}


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
    batch_size: Optional[int] = typer.Option(None, min=1, metavar="B", help="windows per micro-batch and process (default 8)"),
    seq_len: Optional[int] = typer.Option(None, min=2, metavar="L", help="tokens per window (default: 128, or the "
                                                                          "model's positions when fewer)"),
    grad_accum: Optional[int] = typer.Option(None, min=1, metavar="K", help="gradient-accumulation steps (default 1)"),
    precision: Optional[str] = typer.Option(None, metavar="P", help="auto (bf16 on a GPU that has it) | fp32 | bf16 | fp16"),
    eval_fraction: Optional[float] = typer.Option(None, callback=open_unit, metavar="F",
                                                  help="share of --text held out (default 0.1)"),
    eval_samples: Optional[int] = typer.Option(None, min=1, metavar="K", help="held-out windows at most, evaluated "
                                               "before and after (default 64; fewer is faster)"),
    seed: Optional[int] = typer.Option(None, min=0, metavar="N", help="random seed (default 0)"),
    save_adapter_: bool = typer.Option(False, "--save-adapter", help="save the peft adapter (base: IN), unmerged"),
    force: bool = FORCE,
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """LoRA on the remaining linears (LM loss; MLM for BERT), merge, save a plain checkpoint."""
    from .. import checkpoint
    from ..heal import require_lm
    from ..verify import reload_check

    allow_pickle_option(allow_pickle)
    h = merge(HEAL_DEFAULTS, None, {"steps": steps, "rank": rank, "alpha": alpha, "lr": lr,
                                    "target_modules": split_names(target_modules), "batch_size": batch_size,
                                    "seq_len": seq_len, "grad_accum": grad_accum, "precision": precision,
                                    "eval_fraction": eval_fraction, "eval_samples": eval_samples, "seed": seed})
    check_values(h)
    body = read_text(text)
    held_text = read_text(eval_text)
    with claimed(src, out, force) as path:
        cfg = checkpoint.load_config(path)
        fit_seq_len(cfg, h, seq_len)
        tokenizer = checkpoint.load_tokenizer(path)
        if tokenizer is None:
            raise SurgeryError(f"{src} has no tokenizer to read the text with")
        train, held = heal_data(tokenizer, body, held_text, h)
        acc = make_accelerator(h)
        model = checkpoint.load(path)
        require_lm(model)
        model, report, seconds = run_heal(acc, model, tokenizer, train, held, h, save_adapter_,
                                          not json and acc.is_main_process)
        if not acc.is_main_process:
            acc.wait_for_everyone()
            return
        meta = {"version": __version__, "source": str(src), "heal": heal_summary(report)}
        if save_adapter_:
            with checkpoint.writing(out, force=force, source=path) as stage:
                save_adapter(model, stage.path, path.resolve(), source=path)
            saved = checkpoint.written(out, stage, {})
        else:
            saved = checkpoint.save(model, out, source=path, force=force, record=meta,
                                    check=reload_check(model, held[:4]))
        acc.wait_for_everyone()
    if json:
        emit_json({**meta, "saved": saved, "losses": report.losses, "seconds": seconds})
        return
    from .report import ce_table, heal_line, loads_with, overfit_note

    show(ce_table("held-out cross-entropy", [("before", report.ce_before), ("after", report.ce_after)], None))
    say(heal_line(report, seconds))
    if overfit_note(report):
        stderr().print(overfit_note(report), markup=False, highlight=False)
    what = f"adapter (peft; base {path})" if save_adapter_ else f"merged; {loads_with(saved)}"
    say(f"saved {saved['path']}: {what}")
