"""Built-in passes; importing a module registers its passes."""

from . import compensated_ln, crmsnorm, flashnorm, mask, minimize, pre_rmsnorm, remove_ln  # noqa: F401
