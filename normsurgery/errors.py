"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class SurgeryError(Exception):
    """A user-facing failure: bad input, a pass that does not apply, parity lost."""
