"""``verify``: do two checkpoints compute the same function?"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core.errors import FAILED
from ..core.options import AT_LEAST, PROBE_GENERATE, PROBE_LENGTH, PROBE_SAMPLES
from .app import ALLOW_PICKLE, DEVICE, JSON, command, dtype_option, emit_json, positive, read_text, say, say_device, say_error, show, torch_dtype


@command
def verify(
    a: str = typer.Argument(..., metavar="A", help="reference checkpoint"),
    b: str = typer.Argument(..., metavar="B", help="checkpoint to compare"),
    text: Optional[Path] = typer.Option(None, metavar="FILE", help="text to tokenize (default: bundled Shakespeare)"),
    dtype: str = typer.Option("float32", metavar="DTYPE", callback=dtype_option,
                              help="compute dtype: float64 checks the algebra; float32, float16, bfloat16"),
    tol: Optional[float] = typer.Option(None, callback=positive, metavar="X",
                                        help="relative tolerance (default: from the compute and storage dtypes)"),
    samples: int = typer.Option(PROBE_SAMPLES, min=AT_LEAST["samples"], metavar="K", help="number of token windows"),
    seq_len: Optional[int] = typer.Option(None, min=AT_LEAST["seq_len"], metavar="L",
                                          help=f"tokens per window (default: {PROBE_LENGTH}, or the model's positions "
                                               "when fewer)"),
    generate: int = typer.Option(PROBE_GENERATE, min=AT_LEAST["generate"], metavar="N",
                                 help="greedy tokens to compare (0: skip)"),
    layers: bool = typer.Option(False, "--layers", help="also compare every hidden state"),
    streaming: Optional[bool] = typer.Option(None, "--streaming/--in-memory",
                                             help="read the checkpoints one block at a time, comparing only their "
                                                  "outputs (default: only when the two do not fit in memory "
                                                  "together); --in-memory loads each whole"),
    device: str = DEVICE,
    allow_pickle: bool = ALLOW_PICKLE,
    json: bool = JSON,
):
    """Compare two checkpoints' outputs (logits, or a base model's last hidden state); exit 1 when
    they differ beyond the tolerance (by default the one the stored precision allows)."""
    from ..commands.verify import verify as verify_api

    body = read_text(text)
    r = verify_api(a, b, text=body, dtype=torch_dtype(dtype), tolerance=tol, n=samples, length=seq_len,
                   generate=generate, per_layer=layers, streaming=streaming, allow_pickle=allow_pickle,
                   device=device)
    if json:
        emit_json({"a": a, "b": b, "dtype": dtype, **r.as_dict()})
    else:
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
    if not r.ok:  # the table (or JSON) above on stdout, and the one error line every failure gives on stderr
        from ..core.parity import beyond

        say_error(f"{b} does not compute the same function as {a}: {beyond(r)}")
        raise typer.Exit(FAILED)
