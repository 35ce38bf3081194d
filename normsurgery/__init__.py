"""normsurgery: model surgery on transformer checkpoints, with the logits re-verified.

Python API (the CLI is a thin layer over it)::

    import normsurgery as ns
    result = ns.convert("in/", "out/", [("pre-rmsnorm", {"fold": True})])
    model = ns.load("out/")
    ns.verify("in/", "out/").relative
"""

__version__ = "0.1.0"

from .families import layout  # noqa: E402
from .layout import Layout, NormSite  # noqa: E402
from .checkpoint import load, load_tokenizer, save  # noqa: E402
from .convert import apply_passes, convert, load_recipe, parse_pass  # noqa: E402
from .errors import SurgeryError  # noqa: E402
from .registry import all_passes, register  # noqa: E402
from .verify import verify  # noqa: E402

__all__ = ["Layout", "NormSite", "SurgeryError", "all_passes", "apply_passes", "convert", "layout",
           "load", "load_recipe", "load_tokenizer", "parse_pass", "register", "save", "verify"]
