"""Text files the commands read (--text, --eval-text), checked without importing torch, so a
command reads them before it takes its output lock and loads torch."""

from __future__ import annotations

from pathlib import Path

from .errors import SurgeryError


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
