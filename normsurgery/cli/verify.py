"""``verify``: do two checkpoints compute the same function?"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import FAILED
from ..core.options import VerifyOptions
from .app import JSON, command, emit_json, read_text, say, say_device, say_error, show


@command
def verify(
    a: str = typer.Argument(..., metavar="A", help="reference checkpoint"),
    b: str = typer.Argument(..., metavar="B", help="checkpoint to compare"),
    text: Optional[Path] = typer.Option(None, metavar="FILE", help="text to tokenize (default: bundled Shakespeare)"),
    options: VerifyOptions = None,
    json: bool = JSON,
):
    """Compare two checkpoints' outputs (logits, or a base model's last hidden state); exit 1 when
    they differ beyond the tolerance (by default the one the stored precision allows)."""
    from ..commands.verify import verify as verify_api

    r = verify_api(a, b, options, text=read_text(text))
    if json:
        emit_json({"a": a, "b": b, "dtype": options.dtype, **r.as_dict()})
    else:
        print_verify(r, a, b, options.dtype)
    if not r.ok:  # the table (or JSON) above on stdout, and the one error line every failure gives on stderr
        from ..core.parity import beyond

        say_error(f"{b} does not compute the same function as {a}: {beyond(r)}")
        raise typer.Exit(FAILED)


def print_verify(r, a: str, b: str, dtype: str) -> None:
    """verify's table and lines for people."""
    from .report import verify_table

    show(verify_table(r, a, b, dtype))
    if r.streaming:
        say(f"read one block at a time (no generation, no per-layer figures): {r.streaming}")
    if r.no_adapter:
        say(r.no_adapter)
    if r.layers:
        say("h_l: the residual stream entering block l (the last row: leaving the last block). The final "
            "norm's output is not compared per layer (flashnorm moves its gain into the head); the "
            f"{r.output} compared above is what the model outputs")
    say_device(r.device)
    say("same function" if r.ok else f"DIFFERENT: {r.failed}")
