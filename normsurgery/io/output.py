"""The output of every command that writes (a folder, or a file and its card): claimed once,
written atomically, locked, never losing data.

A command's output is claimed once, before any work (:func:`claim`, by ``runner.Job``): locked
against a second run writing it (:func:`output_lock`), an output that would lose data refused
(:func:`check_output`; a file: :func:`check_file`), what killed runs left beside it cleared
(:func:`remove_stale`). A run then fills a temporary sibling folder ``.OUT.tmp-PID``
(:func:`staged`) that replaces ``OUT`` in one rename (a file output: its files, each in one
rename) once everything is written and checked; on any error, Ctrl-C or SIGTERM it is removed
and ``OUT`` is as it was. ``--force`` replaces only what normsurgery wrote (``ours``). Each output
moved into place is told to the :func:`recording` blocks open (the CLI's: an interrupt after that is
never reported as having written nothing); nothing of it stays in the process after a call.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import SurgeryError, SurgeryNote
from .ours import FileKind, our_card

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".onnx", ".onnx_data")
#: folders a checkpoint may hold that ``--force`` may replace with it (ours: an unmerged adapter)
CHECKPOINT_FOLDERS = {"adapter", ".cache"}
#: files besides the weights (WEIGHT_SUFFIXES) that ``--force`` may replace: what normsurgery writes
#: (config, generation config, model card and the input's card kept beside it, the runtime module)
#: and a tokenizer's files; a file the input also holds is one a run copies (``checkpoint.finish``)
CHECKPOINT_FILES = {"config.json", "generation_config.json", "README.md", "README.source.md",
                    "modeling_normsurgery.py", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json"}
#: the model card a run writes (``modelcard.py``): ``--force`` replaces it only when it is ours
CARD = "README.md"
#: the lists of the :func:`recording` blocks open, innermost last
_RECORDING: list[list[Path]] = []


@dataclass
class Claim:
    """An output this process claimed (:func:`claim`): locked, checked once, written by :func:`staged`."""

    path: Path
    force: bool
    file: FileKind | None = None  # a file output (``ours.GGUF``, ``ours.PLOT``), else a folder
    stale: list[str] = field(default_factory=list)  # leftovers of killed runs, removed
    source: Path | None = None  # the input folder it was checked against
    ahead: bool = False  # claimed by the CLI before torch loaded (:func:`claim`)


@dataclass
class Staged:
    path: Path  # the temporary folder to fill
    claim: Claim
    cards: list[tuple[str, Path, dict]] = field(default_factory=list)  # (what was written, where, its facts)

    @property
    def stale(self) -> list[str]:
        return self.claim.stale

    def card(self, kind: str, folder: Path, **facts) -> None:
        """The card of what was written into ``folder`` (``kind``: ``modelcard.write_card``), written
        once the writing succeeded, before the stage is moved into place."""
        self.cards.append((kind, Path(folder), facts))


#: the outputs this process claims now (:func:`claim`), by resolved path
_CLAIMS: dict[str, Claim] = {}


@contextmanager
def claim(out, force: bool = False, source: Path | None = None, *, file: FileKind | None = None,
          source_name: str | None = None, ahead: bool = False):
    """Yields the :class:`Claim` of ``out`` for the block: locked against a second run
    (:func:`output_lock`) and checked once, before any work (:func:`check_output`; ``file``: a file
    output, :func:`check_file`); what killed runs left is removed and said (a ``SurgeryNote``).
    ``ahead``: the CLI's claim, made before torch loads (``cli.app.claimed``: the checks answer at
    once); the command's own claim of ``out`` within it is that claim, not checked again (only
    its relation to the input, where the CLI could not resolve the input: a hub id)."""
    out = Path(out).expanduser()
    with output_lock(out):
        key = _key(out)
        held = _CLAIMS.get(key)
        if held is not None:
            if not held.ahead or (held.force, held.file) != (force, file):
                raise SurgeryError(f"internal: {out} is claimed twice by one process")
            if source is not None and held.source is None:
                _refuse_input(out, Path(source), source_name or str(source), file)
            yield held
            return
        stale = (check_file(out, force, source, source_name or str(source), file) if file
                 else check_output(out, force, source))
        for line in stale:
            warnings.warn(f"{line} (left by a run that was killed)", SurgeryNote, stacklevel=3)
        _CLAIMS[key] = Claim(out, force, file, stale, source, ahead)
        try:
            yield _CLAIMS[key]
        finally:
            del _CLAIMS[key]


@contextmanager
def staged(out):
    """Yields a :class:`Staged`: a temporary sibling folder ``.OUT.tmp-PID`` to fill, for the output
    ``out`` this process claims (:func:`claim`). When the block ends without an exception its
    content replaces ``out`` (a folder: the folder; a file: the files in it, each beside ``out``:
    :func:`_replace`); on any exception, Ctrl-C or SIGTERM (the CLI turns it into an exception) it
    is removed, and ``out`` is as it was, the folders made above it too (:func:`_folders`)."""
    out = Path(out).expanduser()
    held = _CLAIMS.get(_key(out))
    if held is None:
        raise SurgeryError(f"internal: {out} is written without being claimed (runner.Job)")
    try:
        with _folders(out):
            stage = Staged(out.parent / f".{out.name}.tmp-{os.getpid()}", held)
            shutil.rmtree(stage.path, ignore_errors=True)
            stage.path.mkdir()
            try:
                yield stage
                _write_cards(stage)
                _replace(stage.path, out, held.file is not None)
            finally:
                shutil.rmtree(stage.path, ignore_errors=True)
    except OSError as e:
        raise SurgeryError(f"cannot write {out}: {e.strerror or e}"
                           + (f" ({e.filename})" if e.filename else "")) from None


@contextmanager
def _folders(out: Path):
    """The folders ``out`` lacks made for the time of the writing, and removed again (those still
    empty) when it fails: a refused output leaves no folder."""
    missing = [d for d in (out.parent, *out.parent.parents) if not d.exists()]
    for d in reversed(missing):
        d.mkdir()
    try:
        yield
    except BaseException:
        for d in missing:  # the deepest first
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _write_cards(stage: Staged) -> None:
    """The one place cards are written: each the stage's writers asked for (``modelcard.write_card``)."""
    from .modelcard import write_card

    for kind, folder, facts in stage.cards:
        write_card(kind, folder, facts)


def _key(out: Path) -> str:
    return str(Path(out).expanduser().resolve())


def written(out, stage: Staged, info: dict) -> dict:
    """What a save returns once ``stage`` replaced ``out``: the folder, its files, ``info`` (see
    ``checkpoint.claims``) and the leftovers of killed runs that were removed."""
    out = Path(out).expanduser()
    return {"path": str(out), "files": sorted(p.name for p in out.iterdir()), **info,
            **({"stale_removed": stage.stale} if stage.stale else {})}


def check_output(out: Path, force: bool, source: Path | None = None) -> list[str]:
    """Refuse, before any work, an output that would lose data or cannot be written: the input
    folder ``source`` itself, a folder inside it or holding it, the current folder (or one holding it), an existing
    folder without ``force``, and with ``force`` anything but a checkpoint (config.json and
    weights; no folders or files of the user's: :func:`_not_a_checkpoint`); an unwritable
    location. First clears what killed runs left beside ``out`` (:func:`remove_stale`) and
    returns what that did."""
    out = Path(out).expanduser()
    target = out.resolve()
    stale = remove_stale(out)
    if source is not None:
        _refuse_input(out, Path(source), str(source))
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise SurgeryError(f"output {out} is the current folder or holds it; run from elsewhere or name "
                           "another folder")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise SurgeryError(f"output {out} exists and is not a folder")
        if not force:
            raise SurgeryError(f"output {out} already exists; pass --force to replace it")
        why = _not_a_checkpoint(out, source)
        if why:
            raise SurgeryError(f"--force replaces only a checkpoint folder, and {out} {why}; move what you "
                               "keep there or choose another output")
    _check_writable(out, target.parent)
    return stale


def check_file(out: Path, force: bool, source: Path | None, source_name: str, kind: FileKind) -> list[str]:
    """:func:`check_output` for a file output of ``kind``: never a folder (``kind.what`` said) or
    inside the input folder ``source`` (``source_name``, as the user gave it); the files it replaces
    (``out``, its card) only when normsurgery wrote each (``kind.not_ours``), even with ``force``,
    and only with ``force``; in a location that takes the stage's folder. First clears what killed
    runs left beside it (:func:`remove_stale`) and returns what that did."""
    out = Path(out).expanduser()
    stale = remove_stale(out)
    if out.is_dir():
        raise SurgeryError(f"output {out} is a folder; {kind.what}")
    if source is not None:
        _refuse_input(out, Path(source), source_name, kind)
    foreign = kind.not_ours(out)
    if foreign is not None:
        raise SurgeryError(f"{foreign[0]} exists and {foreign[1]}; normsurgery replaces only what it wrote, "
                           "even with --force: move it or choose another output")
    if not force and any(p.exists() or p.is_symlink() for p in kind.paths(out)):
        raise SurgeryError(f"output {out} already exists; pass --force to replace it")
    _check_writable(out, out.resolve().parent)
    return stale


def _refuse_input(out: Path, source: Path, name: str, file: FileKind | None = None) -> None:
    """Refuse an output that would overwrite the input folder ``source`` (``name``, as the user gave
    it): a folder (``file`` None) that is it, lies inside it or holds it; a file inside it."""
    target, src = out.resolve(), source.resolve()
    if file is not None:
        if src in target.parents:
            raise SurgeryError(f"output {out} is inside the input checkpoint {name}; choose a file outside it")
        return
    if target == src:
        raise SurgeryError(f"output {out} is the input checkpoint; choose another folder")
    if src in target.parents:
        raise SurgeryError(f"output {out} is inside the input checkpoint {name}; choose a folder outside it")
    if target in src.parents:
        raise SurgeryError(f"output {out} holds the input checkpoint {name}: replacing it would delete "
                           "the input; choose another folder")


def _not_a_checkpoint(folder: Path, source: Path | None = None) -> str | None:
    """Why ``--force`` may not replace ``folder`` (None: an empty folder, or a checkpoint holding
    only what a run writes: CHECKPOINT_FOLDERS and the input ``source``'s folders a run copies
    (:func:`copied_folders`), CHECKPOINT_FILES, weights, files ``source`` also holds, and a
    README.md that is a card of ours (``ours.our_card``))."""
    entries = list(folder.iterdir())
    if not entries:
        return None
    if not (folder / "config.json").is_file():
        return "has no config.json (it is not a checkpoint)"
    if not any(f.is_file() and f.name.endswith(WEIGHT_SUFFIXES) for f in entries):
        return "holds no weights (it is not a checkpoint)"
    source = Path(source) if source is not None else None
    folders = {f.name for f in copied_folders(source)} if source is not None else set()
    other = sorted(f.name for f in entries if f.is_dir() and f.name not in CHECKPOINT_FOLDERS | folders)
    if other:
        return f"holds folders a checkpoint does not have ({', '.join(other[:3])})"
    if (folder / CARD).exists() and not our_card(folder / CARD):
        return f"holds a {CARD} normsurgery did not write, which it would delete"
    files = {f.name for f in source.iterdir() if f.is_file()} - {CARD} if source is not None else set()
    other = sorted(f.name for f in entries if not f.is_dir() and f.name not in CHECKPOINT_FILES | files
                   and not f.name.endswith(WEIGHT_SUFFIXES))
    if other:
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        return f"holds files normsurgery did not write, which it would delete ({', '.join(other[:5])}{more})"
    return None


def copied_folders(source: Path) -> list[Path]:
    """The input ``source``'s subfolders a run copies beside its weights (``checkpoint.finish``):
    those holding no weights (a sentence-transformers ``1_Pooling/``), and those its
    ``modules.json`` names (a module with its own weights, ``2_Dense/``, which a rewrite of the
    transformer leaves as they are); never hidden ones, nor other copies of the input's weights
    (``onnx/``, ``original/``, ``checkpoint-N/``), which the rewrite would leave stale."""
    modules = _module_folders(source)
    return [f for f in sorted(source.iterdir()) if f.is_dir() and not f.name.startswith(".")
            and (f.name in modules or not any(w.name.endswith(WEIGHT_SUFFIXES) for w in f.rglob("*")))]


def _module_folders(source: Path) -> set[str]:
    """The folders ``source/modules.json`` (sentence-transformers) names as modules."""
    try:
        modules = json.loads((source / "modules.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return set()
    paths = [m.get("path") for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    return {Path(p).parts[0] for p in paths if isinstance(p, str) and Path(p).parts}


def _check_writable(out: Path, folder: Path) -> None:
    """The nearest existing ancestor of ``folder`` (where ``out`` goes) must take a new folder:
    probed, then removed (a file system that takes none, such as /proc, answers "No such file or
    directory": said as what it means)."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise SurgeryError(f"cannot create {out}: {folder} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".normsurgery-probe-", dir=folder))
    except OSError as e:
        raise SurgeryError(f"cannot create {out}: {folder} does not take new folders ({e.strerror or e}); "
                           "choose an output elsewhere") from None


STALE = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)")


def remove_stale(out: Path) -> list[str]:
    """Remove the ``.OUT.tmp-PID`` / ``.OUT.old-PID`` folders of killed runs (PID no longer
    alive; a ``.tmp`` file too: a file output's of an earlier version); an ``.old`` one with no ``out`` beside it (killed between the two renames of
    :func:`_replace`) is the previous output: it is put back. Returns what was done."""
    done = []
    if not out.parent.is_dir():
        return done
    for f in out.parent.iterdir():
        m = STALE.fullmatch(f.name)
        if not m or m["name"] != out.name or _alive(int(m["pid"])) or not (f.is_dir() or m["kind"] == "tmp"):
            continue
        if m["kind"] == "old" and not out.exists():
            f.rename(out)
            done.append(f"restored {out} from {f.name}")
        else:
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)
            done.append(f"removed {f.name}")
    return done


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HELD: dict[str, int] = {}


@contextmanager
def output_lock(out):
    """An exclusive lock on the output path for this process (re-entrant), so two runs writing
    the same output at once cannot mix: the second fails at once, naming the first's PID.
    The lock file lives in the temporary directory, never beside the output."""
    key = str(Path(out).expanduser().resolve())
    if os.environ.get("RANK", "0") != "0":  # a secondary process of a distributed run: rank 0 writes
        yield
        return
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    folder = Path(tempfile.gettempdir()) / "normsurgery-locks"
    folder.mkdir(exist_ok=True)
    path = folder / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".lock")
    fd = _lock(path, out)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        os.unlink(path)  # still locked: a run waiting on this file sees it gone and takes a new one
        os.close(fd)


def _lock(path: Path, out) -> int:
    """The lock file ``path`` opened and locked (a file removed by its last holder between our
    open and our lock is opened again); a lock held by a live run is a SurgeryError naming it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SurgeryError(f"another normsurgery run (PID {owner}) is writing {out}; wait for it to finish "
                               "or choose another output") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _replace(tmp: Path, out: Path, file: bool = False) -> None:
    """Move ``tmp`` to ``out``; an old ``out`` is only removed once the new one is in place.
    Ctrl-C and SIGTERM wait for the swap (the two renames, ``out`` told to the :func:`recording`
    blocks, the old one removed: :func:`_held`); a SIGKILL between the renames leaves the previous
    output as ``.OUT.old-PID``, which the next run puts back (:func:`remove_stale`). ``file``:
    ``out`` is the file of that name in ``tmp``, moved beside it with the files named after it (its
    card), each replacing its own in one rename, ``out`` last: a file in place has its card of ours
    beside it (``ours.GGUF``) even when a SIGKILL lands between."""
    with _held(signal.SIGINT, signal.SIGTERM):
        if file:
            for f in sorted(tmp.iterdir(), key=lambda f: (f.name == out.name, f.name)):
                if not f.name.startswith(out.name):
                    raise SurgeryError(f"internal: {f.name} written beside the file {out}")
                os.replace(f, out.parent / f.name)
            _recorded(out)
            return
        old = out.parent / f".{out.name}.old-{os.getpid()}" if out.exists() or out.is_symlink() else None
        if old is not None:
            out.rename(old)
        tmp.rename(out)
        _recorded(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextmanager
def recording():
    """Yields the list of the outputs moved into place (:func:`_replace`) while the block runs, in
    order; once it ends nothing of it stays in the process (a library call leaves the caller's
    process as it found it)."""
    saved: list[Path] = []
    _RECORDING.append(saved)
    try:
        yield saved
    finally:
        _RECORDING[:] = [s for s in _RECORDING if s is not saved]


def _recorded(out: Path) -> None:
    for saved in _RECORDING:
        saved.append(out)


@contextmanager
def _held(*signals: int):
    """``signals`` arriving inside the block are acted on when it ends, as their handlers say.
    Their Python handlers are swapped, not the thread's signal mask: another thread (torch's)
    takes a signal the main thread blocks, and Python still runs its handler in the main thread.
    Only the main thread runs handlers: elsewhere nothing needs holding."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []
    handlers = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in signals
                if signal.getsignal(s) is not None}  # (None: a handler set outside Python, left alone)
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(arrived):
            signal.raise_signal(s)
