"""``convert``: apply passes (or a recipe), check parity, save."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import UsageError
from ..core.options import AT_LEAST, MAX_SHARD_SIZE, ON_OVERFLOW
from .app import ALLOW_PICKLE, DEVICE, FORCE, JSON, PRECISION, STREAMING, claimed, command, did_you_mean, dtype_option, emit_json, positive, progress_bar, read_text, say, say_device, say_warning, show, size_option, torch_dtype


def overflow_option(value: str) -> str:
    if value not in ON_OVERFLOW:
        raise typer.BadParameter(f"{value!r}: choose one of {', '.join(ON_OVERFLOW)}{did_you_mean(value, ON_OVERFLOW)}")
    return value


def check_passes(specs) -> None:
    """Every pass named exists and every option it is given is one it has (with suggestions)."""
    from .. import passes as _passes
    from ..core import registry  # noqa: F401  (the built-in passes)

    names = [p.name for p in registry.all_passes()]
    for name, options in specs:
        if name not in names:
            raise UsageError(f"unknown pass {name!r}{did_you_mean(name, names)}; registered: {', '.join(names)} "
                               "(`normsurgery passes` describes them)")
        p = registry.get(name)
        for key in options:
            if key not in p.options:
                raise UsageError(f"pass {name!r} has no option {key!r}{did_you_mean(key, p.options)}; "
                                   f"options: {', '.join(p.options) or 'none'}")
        registry.check_options(p, options)


@command(preload=False)
def convert(
    src: str = typer.Argument(..., metavar="IN", help="input checkpoint: a folder or a cached hub id"),
    out: Path = typer.Argument(..., metavar="OUT", help="output folder, written atomically (never inside IN)"),
    passes: list[str] = typer.Option([], "--pass", "-p", metavar="NAME[:KEY=VALUE,...]",
                                     help="a pass and its options (repeatable, applied in order)"),
    recipe: Optional[Path] = typer.Option(None, metavar="FILE", help="a TOML recipe of [[pass]] tables"),
    fold: bool = typer.Option(False, "--fold", help="set fold=true on every pass that has the option"),
    force: bool = FORCE,
    no_verify: bool = typer.Option(False, "--no-verify", help="skip the logit checks"),
    work_dtype: Optional[str] = typer.Option(None, metavar="DTYPE", callback=dtype_option,
                                             help="float32 (default) or float64 for the rewrite (not half)"),
    text: Optional[Path] = typer.Option(None, metavar="FILE",
                                        help="text for the checks (default: bundled Shakespeare)"),
    tol: Optional[float] = typer.Option(None, callback=positive, metavar="X",
                                        help="relative logit tolerance for exact passes (default by dtype)"),
    max_shard_size: str = typer.Option(MAX_SHARD_SIZE, metavar="SIZE", callback=size_option,
                                       help="largest safetensors shard, e.g. 500MB"),
    steps: Optional[int] = typer.Option(None, min=AT_LEAST["steps"], metavar="N",
                                        help="trained passes: optimizer steps"),
    batch_size: Optional[int] = typer.Option(None, min=AT_LEAST["batch_size"], metavar="B",
                                             help="trained passes: windows per micro-batch and process"),
    seq_len: Optional[int] = typer.Option(None, min=AT_LEAST["seq_len"], metavar="L",
                                          help="trained passes: tokens per window"),
    lr: Optional[float] = typer.Option(None, callback=positive, metavar="X", help="trained passes: peak learning rate"),
    resume: bool = typer.Option(False, "--resume", help="trained passes: continue an interrupted run"),
    precision: Optional[str] = PRECISION,
    device: str = DEVICE,
    streaming: Optional[bool] = STREAMING,
    on_overflow: str = typer.Option(ON_OVERFLOW[0], metavar="|".join(ON_OVERFLOW), callback=overflow_option,
                                    help="a rewritten tensor that does not fit a float16/bfloat16 checkpoint "
                                         "(overflow, or small values lost): refuse and write nothing, or keep "
                                         "that tensor in float32 with a warning"),
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """Apply passes (or a recipe) to a checkpoint, check parity, save safetensors."""
    from .. import passes as _passes
    from ..core import registry  # noqa: F401  (the built-in passes)

    specs = (registry.load_recipe(recipe) if recipe is not None else []) + [registry.parse_pass(s) for s in passes]
    if not specs:
        raise UsageError("no passes given: use --pass NAME or --recipe FILE (`normsurgery passes` lists them)")
    check_passes(specs)
    if fold:
        specs = [(n, {**o, "fold": True}) if "fold" in registry.get(n).options else (n, o) for n, o in specs]
    given = {k: v for k, v in {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                                "resume": resume or None, "precision": precision}.items() if v is not None}
    specs = [(n, {**o, **{k: v for k, v in given.items() if k in registry.get(n).options}}) for n, o in specs]
    registry.check_text(specs, text is not None)  # before anything is loaded
    body = read_text(text)
    try:
        with claimed(src, out, force, allow_pickle) as source:  # OUT locked before torch is loaded
            from ..commands.convert import convert as convert_checkpoint
            from ..engine.processes import is_main_process

            with progress_bar(not json and is_main_process()) as progress:
                result = convert_checkpoint(source, out, specs, force=force, verify=not no_verify,
                                             work_dtype=torch_dtype(work_dtype), text=body, tolerance=tol,
                                             max_shard_size=max_shard_size, progress=progress,
                                             streaming=streaming, on_overflow=on_overflow, device=device)
    except KeyboardInterrupt as e:
        from ..engine.train_state import STATE_FILE, state_dir

        kept = state_dir(out)
        if (kept / STATE_FILE).is_file():
            e.kept = f"the training state is kept in {kept}: the same command with --resume continues from it"
        raise
    if result.saved is None:  # not the main process
        return
    for line in result.warnings or ():
        say_warning(line)
    if json:
        emit_json(result.as_dict())
        return
    from .report import convert_tables, fmt, loads_with

    for t in convert_tables(result, src, out):
        show(t)
    for s in result.steps:
        for note in s.notes:
            say(f"  {s.name}: {note}")
    if result.parity:
        p = result.parity
        say(f"saved folder vs {result.against} ({p.output}): relative error {fmt(p.relative)}"
            + (f", KL {fmt(p.kl)}" if p.kl_tolerance is not None else "")
            + (f", top-1 agreement {p.top1:.4f}" if p.top1 is not None else "")
            + (f"; tolerance {fmt(p.tolerance)}" if p.tolerance is not None else "")
            + (f", KL {fmt(p.kl_tolerance)}" if p.kl_tolerance is not None else "")
            + (f": {p.reason}" if p.tolerance is not None else ""))
        if result.from_input is not None:
            d = result.from_input
            say(f"that model vs the input ({d.output}, measured, not judged): relative error {fmt(d.relative)}"
                + (f", top-1 agreement {d.top1:.4f}" if d.top1 is not None else ""))
    if result.streaming:
        say(f"rewritten one block at a time: {result.streaming}")
    say_device(result.device)
    say(f"saved {result.saved['path']} ({len(result.saved['files'])} files); {loads_with(result.saved)}")
