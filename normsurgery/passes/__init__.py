"""Built-in passes; importing a module registers its passes."""

from . import (bn_fold, compensated_ln, crmsnorm, flashnorm, mask, minimize, pre_rmsnorm, prepbn,  # noqa: F401
               remove_ln)
