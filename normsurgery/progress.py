"""The progress callback the orchestration modules report through: (stage, done, total)."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]


def no_progress(stage: str, done: int, total: int) -> None:
    return None
