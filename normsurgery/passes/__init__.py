"""Built-in passes; importing a module registers its passes."""

from . import flashnorm, pre_rmsnorm  # noqa: F401
