"""``export``: a checkpoint as an ONNX graph, checked in ONNX Runtime against the torch model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from ..options import FORMATS
from .app import ALLOW_PICKLE, DEVICE, FORCE, JSON, claimed, command, did_you_mean, emit_json, one_of, positive, \
    read_text, say, say_device


@command(preload=False)
def export(
    src: str = typer.Argument(..., metavar="IN", help="checkpoint: a folder or a cached hub id (stock or rewritten)"),
    dest: Path = typer.Argument(..., metavar="DEST", help="output folder, written atomically"),
    to: str = typer.Option(..., "--to", metavar="FORMAT", help=one_of(FORMATS)),
    external_data: Optional[bool] = typer.Option(None, "--external-data/--no-external-data",
                                                 help="weights beside the graph in model.onnx_data (default: "
                                                      "when they exceed 1 GiB)"),
    with_past: bool = typer.Option(False, "--with-past", help="decoders: key/value cache inputs and outputs, "
                                                              "checked by 16 greedy tokens against generate"),
    text: Optional[Path] = typer.Option(None, metavar="FILE", help="text for the check (default: bundled Shakespeare)"),
    tol: Optional[float] = typer.Option(None, callback=positive, metavar="X",
                                        help="relative tolerance (default: float32 rounding)"),
    device: str = DEVICE,
    force: bool = FORCE,
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """Export a checkpoint to ONNX (inputs input_ids and attention_mask, dynamic batch and sequence),
    run it in ONNX Runtime on probe text and compare with the torch model; exit 1, writing
    nothing, when they differ beyond the tolerance. Needs pip install 'normsurgery[onnx]'."""
    if to not in FORMATS:
        raise UsageError(f"--to {to!r}: choose one of {', '.join(FORMATS)}{did_you_mean(to, FORMATS)}")
    from ..export import require_onnx

    require_onnx()
    from .app import load_transformers

    load_transformers()
    from ..export import export as export_api

    body = read_text(text)
    with claimed(src, dest, force, allow_pickle) as source:
        r = export_api(source, dest, to=to, text=body, tolerance=tol, force=force, external_data=external_data,
                       with_past=with_past, device=device)
    if json:
        emit_json(r.as_dict())
        return
    from .report import fmt

    p = r.parity
    say(f"ONNX Runtime vs torch ({p.output}): relative error {fmt(p.relative)}"
        + (f", top-1 agreement {p.top1:.4f}" if p.top1 is not None else "")
        + f"; tolerance {fmt(p.tolerance)}: {p.reason}")
    if r.with_past:
        say(f"with the key/value cache: 16 greedy tokens in ONNX Runtime equal generate's ({p.generation:.0%} agree)")
    say_device(p.device)
    say(f"saved {r.saved['path']}: opset {r.opset}, inputs input_ids and attention_mask, output {r.output}"
        + (", past_key_values.L.key/value in, present.L.key/value out" if r.with_past else "")
        + (", weights in model.onnx_data" if r.external_data else ""))
