"""The commands (convert, verify, prune, heal, squeeze, lens): thin uses of the engine, below the
API (``normsurgery/__init__.py``) and the CLI.

A floor imports only the floors below it (tests/test_architecture.py)."""
