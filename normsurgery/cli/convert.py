"""``convert``: apply passes (or a recipe), check parity, save."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import UsageError
from ..core.options import ConvertOptions, PassFlags, did_you_mean
from .app import JSON, claimed, command, emit_json, progress_bar, read_text, say, say_device, say_warning, show
from .flags import IN, OUT


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


def pass_specs(passes: list[str], recipe: Path | None, given: PassFlags, text: bool) -> list:
    """The recipe's passes, then ``--pass``'s, checked, each given the options of ``given`` it has
    (``text``: a text was given, which some passes need)."""
    from .. import passes as _passes
    from ..core import registry  # noqa: F401  (the built-in passes)

    specs = (registry.load_recipe(recipe) if recipe is not None else []) + [registry.parse_pass(s) for s in passes]
    if not specs:
        raise UsageError("no passes given: use --pass NAME or --recipe FILE (`normsurgery passes` lists them)")
    check_passes(specs)
    values = given.given()
    specs = [(n, {**o, **{k: v for k, v in values.items() if k in registry.get(n).options}}) for n, o in specs]
    registry.check_text(specs, text)  # before anything is loaded
    return specs


@command(preload=False)
def convert(
    src: str = IN,
    out: Path = OUT,
    passes: list[str] = typer.Option([], "--pass", "-p", metavar="NAME[:KEY=VALUE,...]",
                                     help="a pass and its options (repeatable, applied in order)"),
    recipe: Optional[Path] = typer.Option(None, metavar="FILE", help="a TOML recipe of [[pass]] tables"),
    given: PassFlags = None,
    options: ConvertOptions = None,
    text: Optional[Path] = typer.Option(None, metavar="FILE",
                                        help="text for the checks (default: bundled Shakespeare)"),
    json: bool = JSON,
):
    """Apply passes (or a recipe) to a checkpoint, check parity, save safetensors."""
    specs = pass_specs(passes, recipe, given, text is not None)
    body = read_text(text)
    try:
        with claimed(src, out, options.force, options.allow_pickle) as source:  # OUT locked before torch is loaded
            from ..commands.convert import convert as convert_checkpoint
            from ..engine.processes import is_main_process

            with progress_bar(not json and is_main_process()) as progress:
                result = convert_checkpoint(source, out, specs, options, text=body, progress=progress)
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
    print_convert(result, src, out)


def print_convert(result, src: str, out: Path) -> None:
    """convert's tables and lines for people."""
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
