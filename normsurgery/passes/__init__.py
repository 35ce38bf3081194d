"""Built-in passes; importing a module registers its passes."""

from . import crmsnorm, flashnorm, minimize, pre_rmsnorm, remove_ln  # noqa: F401
