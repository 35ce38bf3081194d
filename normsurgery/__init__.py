"""normsurgery: model surgery on transformer checkpoints, with the logits re-verified.

Python API (the CLI is a thin layer over it)::

    import normsurgery as ns
    result = ns.convert("in/", "out/", [("pre-rmsnorm", {"fold": True})])
    model = ns.load("out/")
    ns.verify("in/", "out/").relative
    ns.prune("in/", "pruned/", {"layers": 2}, heal={"steps": 100}, text=Path("train.txt"))
    ns.heal("pruned/", "healed/", {"steps": 100}, text=open("train.txt").read())  # a str: the text; a Path: a file
    ns.squeeze("in/", "small/", {"target": 0.5, "cycles": 3}, text=Path("train.txt"))
    ns.export("out/", "onnx/", to="onnx").parity.relative  # ONNX Runtime vs torch
    ns.lens("out/").run_with_cache(ids)  # a TransformerLens model, the surgery visible
    [p.name for p in ns.passes()]
"""

from .core.version import __version__  # noqa: E402, F401

import importlib  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

# The API is imported on first use (PEP 562), so ``import normsurgery.cli`` and
# ``normsurgery --help`` do not pay for torch and transformers.
_API = {"layout": "core.families", "Layout": "core.layout", "NormSite": "core.layout", "load": "commands.load",
        "Source": "io.source", "save": "engine.runner", "convert": "commands.convert", "apply_passes": "commands.convert",
        "load_recipe": "core.registry", "parse_pass": "core.registry", "SurgeryError": "core.errors", "passes": "passes",
        "register": "core.registry", "verify": "commands.verify", "outliers": "commands.verify", "prune": "commands.prune", "heal": "commands.heal",
        "PruneOptions": "core.options", "HealOptions": "core.options", "squeeze": "commands.squeeze", "SqueezeOptions": "core.options",
        "ConvertOptions": "core.options", "VerifyOptions": "core.options", "InspectOptions": "core.options",
        "ExportOptions": "core.options", "Writing": "core.options", "Reading": "core.options",
        "LoadOptions": "core.options", "SaveOptions": "core.options",
        "export": "exporters.export", "lens": "commands.lens"}


class _Package(types.ModuleType):
    """Loads the API on first use; ``import normsurgery.commands.convert`` (a submodule) does not
    replace the function ``normsurgery.convert`` of the same name."""

    def __getattr__(self, name: str):
        if name not in _API:
            raise AttributeError(f"module 'normsurgery' has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        if not (name in _API and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["ConvertOptions", "ExportOptions", "HealOptions", "InspectOptions", "LoadOptions", "Reading",
           "SaveOptions", "VerifyOptions", "Layout", "NormSite", "PruneOptions", "Source", "SurgeryError", "apply_passes", "convert",
           "export", "heal", "layout", "lens", "load", "load_recipe", "outliers", "parse_pass", "passes", "prune",
           "register", "save", "squeeze", "SqueezeOptions", "verify", "Writing"]
