"""The Typer application and what every command shares: one-line errors, progress, output."""

from __future__ import annotations

import functools
import json
import os
import sys
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import SurgeryError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Model surgery on transformer checkpoints, with the logits re-verified.")
console = Console()
err = Console(stderr=True)


def quiet_transformers() -> None:
    """Our progress bars replace transformers' own; its warnings go too unless asked for."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        transformers.utils.logging.set_verbosity_error()


def command(fn):
    """Register ``fn`` as a command; SurgeryError and interrupts become one line and exit 1/130.

    Any other exception is one line too (exit 2); NORMSURGERY_DEBUG=1 shows its traceback.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        quiet_transformers()
        try:
            return fn(*args, **kwargs)
        except SurgeryError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]: nothing was written")
            raise typer.Exit(130)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:  # a bug of ours: still one line, unless debugging
            if os.environ.get("NORMSURGERY_DEBUG"):
                raise
            err.print(f"[red]error:[/red] internal error, {type(e).__name__}: {e} "
                      "(NORMSURGERY_DEBUG=1 shows the traceback)", highlight=False, soft_wrap=True)
            raise typer.Exit(2)

    return app.command()(run)


@contextmanager
def progress_bar(enabled: bool = True):
    """Yields a (stage, done, total) callback drawing one bar per stage (on stderr)."""
    if not enabled or not sys.stderr.isatty() and not os.environ.get("NORMSURGERY_PROGRESS"):
        yield lambda stage, done, total: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=False) as bar:
        tasks = {}

        def update(stage, done, total):
            key = stage.split(" ")[0] if stage.startswith("pass") else stage
            if key not in tasks:
                tasks[key] = bar.add_task(stage, total=total)
            bar.update(tasks[key], completed=done, total=total, description=stage)

        yield update


def emit_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}e}" if (x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4)) else f"{x:.4g}"
    return str(x)
