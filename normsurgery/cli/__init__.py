"""Command-line interface: ``normsurgery convert | verify | passes | inspect | ...``."""

from . import core, prune  # noqa: F401  (importing registers the commands)
from .app import app

__all__ = ["app"]


def main() -> None:
    app()
