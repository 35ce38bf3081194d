"""``passes`` and ``inspect``: what exists, what applies to a checkpoint and why not."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from ..core.errors import UsageError
from ..core.options import InspectOptions
from .app import JSON, command, emit_json, read_text, say_device, show


@command(preload=False)
def passes(json: bool = JSON):
    """List the registered passes."""
    from .. import passes as _passes
    from ..core import registry  # noqa: F401  (the built-in passes)

    ps = registry.all_passes()
    if json:
        emit_json([{"name": p.name, "kind": p.kind, "description": p.description,
                    "applies_to": p.families, "options": p.options} for p in ps])
        return
    from .report import passes_table

    show(passes_table(ps))


@command
def inspect(src: str = typer.Argument(..., metavar="IN", help="checkpoint folder or cached hub id"),
            other: Optional[str] = typer.Argument(None, metavar="[IN2]", help="with --outliers: a rewrite of IN "
                                                  "(e.g. rotated) to compare, before/after"),
            outliers: bool = typer.Option(False, "--outliers", help="per residual state and per linear: largest "
                                          "|entry| / RMS and kurtosis, on calibration text"),
            text: Optional[Path] = typer.Option(None, metavar="FILE", help="--outliers: calibration text (default: "
                                                "bundled Shakespeare)"),
            options: InspectOptions = None, json: bool = JSON):
    """Architecture, norm layout, dead units, and which passes apply (and why not); --outliers: the
    stream's and weights' outlier figures (two checkpoints: side by side)."""
    if other is not None and not outliers:
        raise UsageError("a second checkpoint is compared only with --outliers")
    if outliers:
        return print_outliers(src, other, read_text(text), options, json)
    info = describe(src, options.allow_pickle)
    if json:
        emit_json(info)
        return
    from .report import inspect_tables

    for t in inspect_tables(info, src):
        show(t)


def print_outliers(src: str, other: str | None, text: str | None, options: InspectOptions, json: bool) -> None:
    """``inspect --outliers``: the figures of ``src`` (and ``other``), as JSON or tables."""
    from ..commands.verify import outliers as outlier_stats

    r = outlier_stats(src, other, options, text=text)
    if json:
        emit_json(r)
        return
    from .report import outlier_tables

    for t in outlier_tables(r, src, other):
        show(t)
    say_device(r["device"])


def describe(src: str, allow_pickle: bool) -> dict:
    """What ``inspect`` says of checkpoint ``src``: architecture, layout, dead units, passes."""
    from ..io import loader
    from .. import passes as _passes
    from ..core import registry  # noqa: F401  (the built-in passes)
    from ..core.analysis import dead_units
    from ..core.families import layout

    model = loader.load(src, allow_pickle=allow_pickle)
    lay = layout(model)
    return {
        "architecture": type(model).__name__, "family": lay.family, "placement": lay.placement,
        "norm": ", ".join(sorted({s.kind + (f" (gain = {s.offset:g} + w)" if s.offset else "") for s in lay.norms})),
        "hidden_size": lay.hidden_size, "stream_width": lay.stream_width, "objective": lay.objective,
        "blocks": len(model.get_submodule(lay.layers_path)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "tied_embeddings": lay.tied, "stream_norms": len(lay.norms),
        "writers": len(lay.embeddings) + len(lay.writers),
        "readers": sum(len(s.readers) for s in lay.norms), "qk_norms": len(lay.qk_norms),
        "norm_sites": _norm_sites(lay),
        "passes": {p.name: (p.applies(model, lay) or "applies") for p in registry.all_passes()},
        "dead": asdict(dead_units(model, lay)) if lay.attention else None,
    }


def _norm_sites(lay) -> list[dict]:
    """The first block's norm sites and the final norm (every block has the same layout)."""
    first = f"{lay.layers_path}.0."
    sites = [s for s in lay.norms if s.path.startswith(first) or s.role in ("final", "embed")]
    return [{"path": s.path, "role": s.role, "readers": list(s.readers)} for s in sites]
