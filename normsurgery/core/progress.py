"""The progress callback the orchestration modules report through: (stage, done, total), and
optionally a note shown after the counts (e.g. the running loss)."""

from __future__ import annotations

from typing import Callable

Progress = Callable[..., None]  # (stage: str, done: int, total: int, note: str = "") -> None


def no_progress(stage: str, done: int, total: int, note: str = "") -> None:
    return None
