"""Built-in passes; importing a module registers its passes."""

from . import bn_fold, crmsnorm, flashnorm, minimize, pre_rmsnorm, prepbn  # noqa: F401
