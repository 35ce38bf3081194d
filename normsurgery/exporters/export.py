"""export: a checkpoint as an ONNX graph, run in ONNX Runtime and compared with the torch model
(``to="gguf"``: one GGUF file for llama.cpp, checked in llama.cpp: ``normsurgery.exporters.gguf``).

The model (stock or rewritten: ``loader.load``, float32) is traced by the exporter torch
ships (``torch.onnx.export``, the TorchScript exporter, opset 17) with inputs ``input_ids`` and
``attention_mask`` (int64, dynamic batch and sequence axes) and one output: ``logits`` for a
head, ``last_hidden_state`` for a base model. Weights above ``EXTERNAL_BYTES`` are stored as
external data (``model.onnx_data``: protobuf caps a file at 2 GB). The graph written is then run
in ONNX Runtime (CPU) on the probe text, at another batch size and length than it was traced
with, and compared with the torch model as ``convert`` compares (``parity``): a float32
comparison, 1e-5 or ``ROUNDING_FACTOR`` x the model's own float32 rounding where the kernels
round differently. Out of tolerance, nothing is written. The folder also holds the checkpoint's
config and side files (tokenizer).

``with_past`` (decoders): the graph also takes the key/value cache (``past_key_values.L.key`` /
``.value``: batch, heads, past tokens, head dim; empty for a prompt) with an attention mask over
past and new tokens, and returns the cache extended (``present.L.key`` / ``.value``). Besides the
logits on the probe (empty cache), ``CACHE_TOKENS`` tokens are generated greedily in ONNX Runtime (the prompt,
then one token at a time through the cache) and must equal ``generate``'s in torch.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core import devices
from . import gguf
from ..io.checkpoint import finish, legacy_keys
from ..io.loader import load
from ..core.errors import SurgeryError
from ..core.options import CACHE_TOKENS, EXTERNAL_BYTES, FORMATS, ExportOptions, options_of  # noqa: F401  (API)
from ..io.output import written
from ..core.parity import Comparison, compare, greedy_agreement, outputs, probe_ids, unpadded
from ..engine.check import Tolerances, model_reader
from ..engine.runner import Job, job_scope
from ..io.texts import text_of

OPSET = 17
GRAPH = "model.onnx"
EXTERNAL = "model.onnx_data"
INSTALL = "pip install 'normsurgery[onnx]'"


@dataclass
class Exported:
    saved: dict  # the folder and its files
    output: str  # the graph's output name
    opset: int
    external_data: bool
    parity: Comparison  # ONNX Runtime against the torch model on the probe (generation: with the cache)
    with_past: bool = False

    def as_dict(self) -> dict:
        return {"saved": self.saved, "output": self.output, "opset": self.opset, "with_past": self.with_past,
                "external_data": self.external_data, "parity": self.parity.as_dict(), "ok": self.parity.ok}


def require_onnx() -> None:
    """onnx and onnxruntime are an optional extra: refused with the install line when missing."""
    missing = [m for m in ("onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise SurgeryError(f"export to ONNX needs {' and '.join(missing)}, not installed: {INSTALL}")


class Graph(torch.nn.Module):
    """What is traced: (input_ids, attention_mask) -> the class's output, no cache; with
    ``past`` (the cache's tensors, per layer a key and a value: (batch, heads, past, head_dim))
    (input_ids, attention_mask over past and new tokens, *past) -> (logits, *present)."""

    def __init__(self, model, past: list[tuple] | None = None):
        super().__init__()
        self.model, self.layers = model, len(past or ())
        self.kwargs = {"use_cache": False} if model.can_generate() and not self.layers else {}
        self.head = output_name(model) == "logits"

    def forward(self, input_ids, attention_mask, *past):
        if self.layers:
            from transformers import DynamicCache

            cache = DynamicCache(ddp_cache_data=list(zip(past[::2], past[1::2])), config=self.model.config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                             use_cache=True, return_dict=True)
            return (out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)))
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **self.kwargs)
        return out.logits if self.head else out.last_hidden_state


def cache_shapes(model) -> list[tuple]:
    """Per layer, the shape of the key and of the value cache for one token of one sequence, as
    the model builds them (read from a forward pass, not from the config)."""
    with torch.no_grad():
        cache = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=devices.of(model)),
                      use_cache=True).past_key_values
    return [tuple(t.shape) for layer in cache.layers for t in (layer.keys, layer.values)]


def past_names(n: int) -> tuple[list[str], list[str]]:
    """The graph's cache inputs and outputs, ``n`` tensors (a key and a value per layer)."""
    return ([f"past_key_values.{i // 2}.{'key' if i % 2 == 0 else 'value'}" for i in range(n)],
            [f"present.{i // 2}.{'key' if i % 2 == 0 else 'value'}" for i in range(n)])


def output_name(model) -> str:
    from ..core.families import layout

    return "logits" if layout(model).head is not None else "last_hidden_state"


def export(src, dest, options: ExportOptions | None = None, *, text: str | Path | None = None, **keywords):
    """Export ``src`` to ``dest`` (see the module docstring) with ``options`` (``ExportOptions``;
    ``keywords``: its fields, e.g. ``to="gguf"``); ``external_data``: None decides by size;
    ``with_past``: the graph takes and returns the key/value cache (decoders), checked by greedy
    generation as well. The torch side (reference outputs, ``generate``) computes on ``device``; the
    graph is traced on the CPU, where ONNX Runtime runs it. Raises SurgeryError, writing nothing,
    when ONNX Runtime's outputs are out of tolerance or its greedy tokens differ from ``generate``'s.
    ``text``: the check's text (default: the bundled sample), a ``str`` the text, a ``Path`` a file.
    ``to="gguf"``: ``dest`` is a file, ``dtype`` its matrices' type (``gguf.export``: llama.cpp
    runs on the CPU, transformers' side on ``device``; the ONNX options do not apply).
    ``to="nemotron-nas"``: a DeciLM folder checked in MLX-LM or vLLM (``check``) and in transformers
    (``nemotron.export``). Each writes
    through the one runner (``runner.Job``: the output claimed once, written into its stage)."""
    options = options_of(ExportOptions, options, keywords)
    text = text_of(text)
    options.check()  # its values and the options of its format, before anything is read
    if options.to == "gguf":
        return gguf.export(src, dest, options, text=text)
    if options.to == "nemotron-nas":
        from . import nemotron

        return nemotron.export(src, dest, options, text=text)
    require_onnx()
    return onnx_export(src, dest, options, text)


@job_scope
def onnx_export(src, dest, options: ExportOptions, text: str | None) -> Exported:
    """``export`` to ONNX: the graph written into the job's stage, run in ONNX Runtime and compared
    with the torch model (:func:`check_graph`), then its folder's config, side files and card."""
    job = Job.open(src, dest, force=options.force, allow_pickle=options.allow_pickle, device=options.device)
    source, where, with_past, external_data = job.source, job.device, options.with_past, options.external_data
    model = load(source, torch.float32, device=where)
    if with_past and not model.can_generate():
        raise SurgeryError(f"--with-past: {source.name} is a {source.class_name}, which does not generate (no "
                           "key/value cache to export)")
    past = cache_shapes(model) if with_past else None
    ids = probe_ids(source.tokenizer, source.config.vocab_size, text, 4, min(64, source.positions or 64))
    with unpadded(model):
        reference = outputs(model, ids)
        tol = Tolerances(model_reader(model, ids), ids, torch.float32, reference, options.tolerance,
                          source.head_output)
        external = external_data if external_data is not None else \
            sum(p.numel() * 4 for p in model.parameters()) > EXTERNAL_BYTES
        with job.staged() as stage:
            write_graph(model, stage.path, external, past)
            c = check_graph(model, stage.path / GRAPH, ids, past, reference, tol, source.head_output)
            config = legacy_keys(json.loads((source.path / "config.json").read_text()))
            (stage.path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            finish(stage.path, [], source)
            stage.card("onnx", stage.path, name=Path(dest).name, source=source.name, config=source.config,
                       parity=c.as_dict(), with_past=bool(past), external=external)
    c.device = devices.describe(where)
    return Exported(written(dest, stage, {}), output_name(model), OPSET, external, c, bool(past))


def check_graph(model, path: Path, ids: torch.Tensor, past: list[tuple] | None, reference: torch.Tensor,
                tol: Tolerances, head_output: str) -> Comparison:
    """The graph at ``path`` run in ONNX Runtime on ``ids`` against the torch ``model``'s
    ``reference`` outputs, judged by ``tol``; with ``past``, its greedy tokens through the cache
    against ``generate``'s too. Out of tolerance, or a token differing: a SurgeryError."""
    got = run_graph(path, ids, past)[0].to(reference.device)
    c = tol.judge(compare(reference, got, head_output))
    if not c.ok:
        raise SurgeryError(f"ONNX Runtime's {head_output} differ from the torch model's: relative "
                           f"error {c.relative:.2e} > {c.tolerance:.1e} ({c.reason}); nothing was written")
    if past:
        c.generation = greedy_agreement(model, Greedy(path, past), ids[:, :8], CACHE_TOKENS)
        if c.generation < 1:
            raise SurgeryError(f"ONNX Runtime's greedy tokens (with the cache) differ from generate's: "
                               f"{c.generation:.1%} agree; nothing was written")
    return c


def write_graph(model, folder: Path, external: bool, past: list[tuple] | None = None) -> None:
    """``model`` traced to ``folder/model.onnx`` (dynamic batch and sequence axes; with ``past``,
    the cache shapes of :func:`cache_shapes`, its inputs and outputs too); weights as external
    data ``model.onnx_data`` when ``external``."""
    import onnx

    path = folder / GRAPH
    home = devices.of(model)
    model.to("cpu")  # traced where ONNX Runtime runs it: no device baked into the graph
    try:
        _trace(model, path, past)
    finally:
        model.to(home)
    graph = onnx.load(str(path))
    for f in folder.iterdir():  # what the exporter wrote beside it for a large graph
        if f.name != GRAPH:
            f.unlink()
    onnx.save_model(graph, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=EXTERNAL, size_threshold=0)
    if (folder / EXTERNAL).is_file():  # onnx writes it 0600: readable as the graph beside it is
        (folder / EXTERNAL).chmod(path.stat().st_mode & 0o777)


def _trace(model, path: Path, past: list[tuple] | None) -> None:
    ids = torch.zeros(2, 8, dtype=torch.long)
    out = output_name(model)
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            out: {0: "batch", 1: "sequence"}}
    cache, inputs, outputs_ = [], [], []
    if past:
        cache = [torch.zeros(2, s[1], 3, *s[3:]) for s in past]  # 3 tokens of past when traced
        inputs, outputs_ = past_names(len(past))
        axes["attention_mask"] = {0: "batch", 1: "past+sequence"}
        axes.update({n: {0: "batch", 2: "past"} for n in inputs})
        axes.update({n: {0: "batch", 2: "past+sequence"} for n in outputs_})
    mask = torch.ones(2, 8 + (3 if past else 0), dtype=torch.long)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python branches it froze
        torch.onnx.export(Graph(model, past), (ids, mask, *cache), str(path),
                          input_names=["input_ids", "attention_mask", *inputs], output_names=[out, *outputs_],
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False, do_constant_folding=True)


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_graph(path: Path, ids: torch.Tensor, past: list[tuple] | None = None, *, cache=None, total: int = 0,
              graph=None) -> list[torch.Tensor]:
    """The graph's outputs on ``ids`` in ONNX Runtime (CPU), the first its logits (or last hidden
    state). A graph with the cache (``past``: its shapes) is given ``cache`` (the previous call's
    present tensors; none: empty) of ``total`` tokens so far; ``graph``: a session to reuse."""
    import numpy as np

    graph = graph or session(path)
    feed = {"input_ids": ids.cpu().numpy(), "attention_mask": np.ones((ids.shape[0], total + ids.shape[1]), np.int64)}
    if past:
        empty = [np.zeros((ids.shape[0], s[1], 0, *s[3:]), np.float32) for s in past]
        feed.update(zip(past_names(len(past))[0], cache if cache is not None else empty))
    return [torch.from_numpy(x).float() for x in graph.run(None, feed)]


class Greedy:
    """The graph at ``path`` (with the cache: ``past``, its shapes) as ``parity.greedy_agreement``
    reads a model: ``generate`` greedily in ONNX Runtime (the prompt once, then one token at a
    time through the cache), on the host (no tensors of its own: ``devices.of`` says the host)."""

    def parameters(self):
        return iter(())

    buffers = parameters

    def __init__(self, path: Path, past: list[tuple]):
        self.path, self.past = path, past

    def generate(self, prompts: torch.Tensor, *, max_new_tokens: int, **_) -> torch.Tensor:
        graph, cache, total, cur, got = session(self.path), None, 0, prompts, []
        for _ in range(max_new_tokens):
            out = run_graph(self.path, cur, self.past, cache=cache, total=total, graph=graph)
            total += cur.shape[1]
            cur = out[0][:, -1].argmax(-1, keepdim=True)
            cache = [t.numpy() for t in out[1:]]  # host: ONNX Runtime outputs
            got.append(cur)
        return torch.cat([prompts, *got], 1)
