"""The package version (one place; the package, the records and --version read it)."""

__version__ = "0.1.0"
