"""export: a checkpoint as an ONNX graph, run in ONNX Runtime and compared with the torch model.

The model (stock or rewritten: ``checkpoint.load``, float32) is traced by the exporter torch
ships (``torch.onnx.export``, the TorchScript exporter, opset 17) with inputs ``input_ids`` and
``attention_mask`` (int64, dynamic batch and sequence axes) and one output: ``logits`` for a
head, ``last_hidden_state`` for a base model. Weights above ``EXTERNAL_BYTES`` are stored as
external data (``model.onnx_data``: protobuf caps a file at 2 GB). The graph written is then run
in ONNX Runtime (CPU) on the probe text, at another batch size and length than it was traced
with, and compared with the torch model as ``convert`` compares (``parity``): a float32
comparison, 1e-5 or ``ROUNDING_FACTOR`` x the model's own float32 rounding where the kernels
round differently. Out of tolerance, nothing is written. The folder also holds the checkpoint's
config and side files (tokenizer).
"""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import Source, finish, load
from .errors import SurgeryError
from .output import check_output, writing, written
from .parity import Comparison, compare, outputs, probe_ids, unpadded
from .pipeline import Tolerances, model_reader

FORMATS = ("onnx",)
OPSET = 17
GRAPH = "model.onnx"
EXTERNAL = "model.onnx_data"
#: weights above this many bytes go to external data (protobuf caps a file at 2 GB)
EXTERNAL_BYTES = 1 << 30
INSTALL = "pip install 'normsurgery[onnx]'"


@dataclass
class Exported:
    saved: dict  # the folder and its files
    output: str  # the graph's output name
    opset: int
    external_data: bool
    parity: Comparison  # ONNX Runtime against the torch model on the probe

    def as_dict(self) -> dict:
        return {"saved": self.saved, "output": self.output, "opset": self.opset,
                "external_data": self.external_data, "parity": self.parity.as_dict(), "ok": self.parity.ok}


def require_onnx() -> None:
    """onnx and onnxruntime are an optional extra: refused with the install line when missing."""
    missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise SurgeryError(f"export to ONNX needs {' and '.join(missing)}, not installed: {INSTALL}")


class Graph(torch.nn.Module):
    """What is traced: (input_ids, attention_mask) -> the class's output, no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.kwargs = {"use_cache": False} if hasattr(model, "generate") and model.can_generate() else {}
        self.head = output_name(model) == "logits"

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **self.kwargs)
        return out.logits if self.head else out.last_hidden_state


def output_name(model) -> str:
    from .families import layout

    return "logits" if layout(model).head is not None else "last_hidden_state"


def export(src, dest, *, to: str = "onnx", text: str | None = None, tolerance: float | None = None,
           force: bool = False, external_data: bool | None = None, allow_pickle: bool = False) -> Exported:
    """Export ``src`` to ``dest`` (see the module docstring); ``external_data``: None decides by
    size. Raises SurgeryError, writing nothing, when ONNX Runtime's outputs are out of tolerance."""
    if to not in FORMATS:
        raise SurgeryError(f"cannot export to {to!r}; formats: {', '.join(FORMATS)}")
    require_onnx()
    source = Source.open(src, allow_pickle)
    check_output(Path(dest), force, source.path)
    model = load(source, torch.float32)
    ids = probe_ids(source.tokenizer, source.config.vocab_size, text, 4, min(64, source.positions or 64))
    name = output_name(model)
    with unpadded(model):
        reference = outputs(model, ids)
        tol = Tolerances(model_reader(model, ids), ids, torch.float32, reference, tolerance, source.head_output)
        external = external_data if external_data is not None else \
            sum(p.numel() * 4 for p in model.parameters()) > EXTERNAL_BYTES
        with writing(dest, force=force, source=source.path) as stage:
            write_graph(model, stage.path, external)
            got = run_graph(stage.path / GRAPH, ids)
            c = tol.judge(compare(reference, got, source.head_output))
            if not c.ok:
                raise SurgeryError(f"ONNX Runtime's {source.head_output} differ from the torch model's: relative "
                                   f"error {c.relative:.2e} > {c.tolerance:.1e} ({c.reason}); nothing was written")
            shutil.copyfile(source.path / "config.json", stage.path / "config.json")
            finish(stage.path, [], source)
    return Exported(written(dest, stage, {}), name, OPSET, external, c)


def write_graph(model, folder: Path, external: bool) -> None:
    """``model`` traced to ``folder/model.onnx`` (dynamic batch and sequence axes); weights as
    external data ``model.onnx_data`` when ``external``."""
    import onnx

    path = folder / GRAPH
    ids = torch.zeros(2, 8, dtype=torch.long)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            output_name(model): {0: "batch", 1: "sequence"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python branches it froze
        torch.onnx.export(Graph(model), (ids, torch.ones_like(ids)), str(path), input_names=["input_ids",
                          "attention_mask"], output_names=[output_name(model)], dynamic_axes=axes,
                          opset_version=OPSET, dynamo=False, do_constant_folding=True)
    graph = onnx.load(str(path))
    for f in folder.iterdir():  # what the exporter wrote beside it for a large graph
        if f.name != GRAPH:
            f.unlink()
    onnx.save_model(graph, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=EXTERNAL, size_threshold=0)


def run_graph(path: Path, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The graph's output on ``ids`` in ONNX Runtime (CPU)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    mask = torch.ones_like(ids) if mask is None else mask
    out = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    return torch.from_numpy(out).float()

