"""The one exception type the CLI turns into a one-line message, and the exit codes.

Exit codes: 0 success; 1 bad input, a refusal or a parity failure (:class:`SurgeryError`,
``verify`` finding different functions); 2 a usage error (unknown option, bad value: reported
by the argument parser before any work); 3 a bug of ours (any other exception); 130 interrupted.
"""

OK = 0
FAILED = 1
USAGE = 2
BUG = 3
INTERRUPTED = 130

#: where the CLI asks users to report exit code 3
REPORT_BUGS = ("this is a bug in normsurgery: please report it with the command line and the "
               "traceback NORMSURGERY_DEBUG=1 prints (docs/errors.md: Reporting bugs)")


class SurgeryError(Exception):
    """A user-facing failure: bad input, a pass that does not apply, parity lost."""


class UsageError(SurgeryError):
    """A command used wrongly (an unknown pass or option, a value out of range), found before any
    work: exit code 2."""


class SurgeryWarning(UserWarning):
    """Something the user should know that does not stop the work (an unexpected weight left
    unread, as transformers leaves it): the CLI prints it as one ``warning:`` line."""


class SurgeryNote(UserWarning):
    """Something done differently from what the input says, as the tool it comes from does it (a
    sentence-transformers checkpoint loaded as its base model): the CLI prints it as one ``note:`` line."""
