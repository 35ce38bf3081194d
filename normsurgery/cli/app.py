"""The Typer application and what every command shares: exit codes, one-line errors, progress,
option parsing, output.

Nothing here imports torch or transformers: ``--help``, ``--version`` and usage errors answer
before any of it loads; each command imports what it needs when it runs.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, Optional

import typer

from .. import __version__
from ..core import threads
from ..engine import launch
from ..io import output
from ..io.ours import FileKind
from ..core.options import COUNT
from .flags import checking, expand
from ..core.errors import BUG, FAILED, INTERRUPTED, REPORT_BUGS, USAGE, SurgeryError, SurgeryNote, SurgeryWarning, UsageError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Model surgery on transformer checkpoints, with the logits re-verified. "
                       "Exit codes: 0 ok, 1 bad input or parity failure, 2 usage error, "
                       "3 a bug of ours, 130 interrupted.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"normsurgery {__version__}")
        raise typer.Exit()


THREADS: list[int | None] = [None]  # --threads, before the command


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit"),
          threads: Optional[int] = typer.Option(None, "--threads", callback=checking(COUNT), metavar="N",
                                                help="torch threads (default: OMP_NUM_THREADS, else the CPUs "
                                                     "not already busy: spinning threads collapse under load)")):
    """Model surgery on transformer checkpoints, with the logits re-verified."""
    THREADS[0] = threads


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every ``finally`` (temporary folders) runs."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main() -> None:
    """The entry point: OpenMP's threads sleep while they wait unless the user says otherwise
    (``threads.passive_wait``: spinning threads collapse when other work holds the cores);
    SIGTERM unwinds like Ctrl-C; an interrupt anywhere is one line, and once the command has
    ended, none (:func:`_ignore_interrupts`)."""
    threads.passive_wait()  # before torch is imported: OpenMP reads it once, as it loads
    from ..io import modelcard

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        launch.relaunch_cpu_processes()  # accelerate launch --cpu's one process becomes N, before any loading
    except SurgeryError as e:
        say_error(str(e))
        sys.exit(FAILED)
    command = modelcard.COMMAND.set(sys.argv[1:])  # for the cards of the folders written, this command's only
    with output.recording() as saved:
        try:
            app()
        except KeyboardInterrupt as e:
            say_error(interrupted(e, saved))
            _exit_now(INTERRUPTED)
        except SystemExit as e:
            if e.code == INTERRUPTED:
                _exit_now(INTERRUPTED)
            raise
        finally:
            modelcard.COMMAND.reset(command)
            _ignore_interrupts()


def _exit_now(code: int) -> NoReturn:
    """End an interrupted command at once: its stage, lock and worker processes went as the stack
    unwound and it has said so; Python's teardown (a model's tensors freed, torch's and MLX's
    destructors: seconds on a busy machine) would only hold the exit Ctrl-C asked for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _ignore_interrupts() -> None:
    """Ignore Ctrl-C and SIGTERM from here on: the command has ended and said how. Python puts
    back the default handlers while it shuts down (torch's teardown takes a while), and a signal
    then would kill the process silently with 130, which says nothing was written."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def interrupted(e: KeyboardInterrupt, saved=()) -> str:
    """What an interrupt leaves: no output, or the outputs ``saved`` (moved into place before it:
    complete, only the report cut short); a training state kept (``e.kept``) is named."""
    kept = getattr(e, "kept", None)
    what = "terminated" if isinstance(e, Terminated) else "interrupted"
    left = (f"{what} after {', '.join(map(str, saved))} was written in full (only the report was cut short)"
            if saved else f"{what}: nothing was written")
    return left + (f"; {kept}" if kept else "")


def failed(message: str, code: int, as_json: bool = False) -> NoReturn:
    """End a command that failed with exit ``code``: one ``error:`` line on stderr and, for
    ``--json``, ``{"ok": false, "error": message, "exit_code": code}`` on stdout."""
    say_error(message)
    if as_json:
        emit_json({"ok": False, "error": message, "exit_code": code})
    raise typer.Exit(code)


def say_error(message: str) -> None:
    """One line on stderr: ``error: message`` (no markup: ``[[pass]]`` stays literal)."""
    typer.echo(typer.style("error:", fg="red") + " " + message, err=True)


def say_warning(message: str) -> None:
    """One line on stderr: ``warning: message`` (never wrapped: scripts grep it)."""
    typer.echo(typer.style("warning:", fg="yellow") + " " + message, err=True)


def _show_warning(shown, message, category, *args, **kwargs) -> None:
    """Our warnings as one ``warning:`` line, our notes as one ``note:`` line; any other as Python shows it."""
    if issubclass(category, SurgeryWarning):
        say_warning(str(message))
    elif issubclass(category, SurgeryNote):
        typer.echo(f"note: {message}", err=True)
    else:
        shown(message, category, *args, **kwargs)


def load_transformers() -> None:
    """Import torch and transformers with Ctrl-C and SIGTERM held until both are loaded (a signal
    inside torch's C++ start-up aborts the process instead of raising KeyboardInterrupt); then
    quiet them: our progress bars replace transformers' own, its warnings go unless asked for."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        import torch  # noqa: F401
        import transformers
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a held signal is raised here

    threads.use(THREADS[0])
    transformers.utils.logging.disable_progress_bar()
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        transformers.utils.logging.set_verbosity_error()


def command(fn=None, *, preload: bool = True):
    """Register ``fn`` as a command. SurgeryError and OSError (a bad or unwritable path) are one
    line and exit 1; an interrupt exits 130; anything else is a bug of ours: one line saying
    where to report it, exit 3 (NORMSURGERY_DEBUG=1 shows the traceback); with ``--json``, each
    also a JSON error object on stdout (:func:`failed`). ``preload=False``:
    the command calls :func:`load_transformers` itself, after the checks that need neither
    (``passes`` never does), so those answer at once."""
    if fn is None:
        return functools.partial(command, preload=preload)
    fn = expand(fn)  # its options dataclasses' flags (``flags``)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        fail = functools.partial(failed, as_json=kwargs.get("json", False))
        saved: list = []
        try:
            with warnings.catch_warnings(), output.recording() as saved:
                warnings.simplefilter("default", SurgeryWarning)  # a warning repeated (two loads) is shown once
                warnings.simplefilter("default", SurgeryNote)
                shown = warnings.showwarning
                warnings.showwarning = functools.partial(_show_warning, shown)
                if preload:
                    load_transformers()
                return fn(*args, **kwargs)
        except SurgeryError as e:
            fail(str(e), USAGE if isinstance(e, UsageError) else FAILED)
        except KeyboardInterrupt as e:
            fail(interrupted(e, saved), INTERRUPTED)
        except (typer.Exit, typer.Abort):
            raise
        except OSError as e:
            if os.environ.get("NORMSURGERY_DEBUG"):
                raise
            fail(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}", FAILED)
        except Exception as e:
            if os.environ.get("NORMSURGERY_DEBUG"):
                raise
            fail(f"internal error, {type(e).__name__}: {e}; {REPORT_BUGS}", BUG)

    return app.command()(run)


def say_device(device: dict | None) -> None:
    """The line naming where a command computed (``devices.describe``)."""
    if device:
        say(f"computed on {device['device']}" + (f" ({device['name']})" if device["name"] != "CPU" else ""))


JSON = typer.Option(False, "--json", help="print the result as JSON (for scripts)")


def read_text(path) -> str | None:
    """The text of a --text style option (None: not given): missing, empty or binary files refused."""
    if path is None:
        return None
    from ..io.texts import read_text as read

    return read(path)


@contextmanager
def claimed(src: str, out, force: bool, allow_pickle: bool = False, file: FileKind | None = None):
    """For the whole command: ``out`` claimed (``output.claim``: locked and checked; ``file``: a
    file output, what it is) before torch loads or anything is read, so a refused output or a
    second run answers at once; the API's job claims it within this claim (``runner.claim_output``:
    the same claim, not checked again). Yields ``src`` read (``source.Source``)."""
    local = Path(src).expanduser()
    with output.claim(out, force, local if local.is_dir() else None, file=file, source_name=str(src), ahead=True):
        load_transformers()
        from ..io.source import Source

        yield Source.open(src, allow_pickle)


def merge(defaults: dict, recipe: dict | None, given: dict) -> dict:
    """Options given on the command line win over the recipe, which wins over the defaults."""
    return {k: given[k] if given.get(k) is not None else (recipe or {}).get(k, v) for k, v in defaults.items()}


def torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


# ---- progress (stderr, terminals only) ----

@contextmanager
def progress_bar(enabled: bool = True):
    """Yields ``update(stage, done, total, note="")``: one bar per stage on stderr, drawn on a
    terminal (or with NORMSURGERY_PROGRESS=1). Stages ``pass NAME`` share one bar, so a
    convert shows which pass of how many runs; ``note`` is shown after the counts."""
    if not enabled or not sys.stderr.isatty() and not os.environ.get("NORMSURGERY_PROGRESS"):
        yield lambda stage, done, total, note="": None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=stderr(),
                  transient=False) as bar:
        tasks = {}

        def update(stage, done, total, note=""):
            key = "pass" if stage.startswith("pass") else stage  # "pass NAME" i of n, then "passes" n of n
            if key not in tasks:
                tasks[key] = bar.add_task(stage, total=total, note=note)
            bar.update(tasks[key], completed=done, total=total, description=stage, note=note)

        yield update


# ---- output ----

@functools.cache
def stdout():
    from rich.console import Console

    return Console()


@functools.cache
def stderr():
    from rich.console import Console

    return Console(stderr=True)


def say(text: str) -> None:
    """A line for people on stdout, printed literally (no markup, no highlighting)."""
    stdout().print(text, markup=False, highlight=False)


def show(renderable) -> None:
    """A table (see report) on stdout."""
    stdout().print(renderable)


def emit_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))
