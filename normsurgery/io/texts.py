"""Text files the commands read (--text, --eval-text), checked without importing torch, so a
command reads them before it takes its output lock and loads torch; and the API's ``text=`` /
``eval_text=`` arguments (:func:`text_of`): a ``str`` is the text itself, a ``pathlib.Path`` a
file read here."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ..core.errors import SurgeryError, SurgeryWarning


def read_text(path) -> str:
    """The text of ``path``: a missing, empty or binary file (a NUL byte, or over 1% of it not
    UTF-8) is a SurgeryError."""
    path = Path(path)
    if not path.is_file():
        raise SurgeryError(f"no text file at {path}")
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    if b"\0" in data or text.count("\ufffd") > 0.01 * len(text):
        raise SurgeryError(f"{path} is not a text file (binary or not UTF-8): give plain text")
    if not text.strip():
        raise SurgeryError(f"text file {path} is empty")
    return text


def text_of(text, what: str = "text") -> str | None:
    """An API's ``text=`` / ``eval_text=`` (named ``what``): a ``str`` is the text itself; a path
    (``pathlib.Path``, any ``os.PathLike``) is a file, read with :func:`read_text`; None stays None.
    A one-line ``str`` that names an existing file is still taken as the text, with a warning that
    says how to read the file instead."""
    if text is None:
        return None
    if isinstance(text, os.PathLike):
        return read_text(text)
    if not isinstance(text, str):
        raise SurgeryError(f"{what}= takes the text (a str) or a file (a pathlib.Path), got {type(text).__name__}")
    if "\n" not in text and len(text) < 4096 and _names_a_file(text):
        warnings.warn(f"{what}={text!r} is taken as the text itself (a str), not as the file it names: pass "
                      f"pathlib.Path({text!r}) to read the file", SurgeryWarning, stacklevel=3)
    return text


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is the path of an existing file (a name too long to be one is not)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def heldout_text(fraction: float) -> str:
    """What held-out cross-entropy is measured on, in words: the end of the text (``fraction`` of
    its tokens) that neither training nor prune's layer scores read (--eval-text, when given, is
    measured beside it)."""
    return f"the last {fraction:.0%} of the text (never trained on)"
