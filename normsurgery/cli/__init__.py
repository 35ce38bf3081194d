"""Command-line interface: ``normsurgery convert | verify | passes | inspect | prune | heal | squeeze | export``.

One module per command group (convert, verify, inspect, prune, heal, squeeze, export), ``report`` for what they
print, ``app`` for what they share. Importing this package loads neither torch nor
transformers: each command imports what it needs when it runs.
"""

from . import convert, verify, inspect, prune, squeeze, export  # noqa: F401, I001  (importing registers the commands, in this order)
from .app import app, main

__all__ = ["app", "main"]
