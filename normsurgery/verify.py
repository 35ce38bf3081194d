"""verify: do two checkpoints (or two models in memory) compute the same function?

Both are run on probe text in one arithmetic and compared on what their class outputs, with the
tolerance the arithmetic and the stored precision allow (``parity``). In memory both models are
loaded whole, and greedy generation (causal LMs) and per-layer differences can be compared too;
one part at a time (``streaming``; checkpoints larger than memory) only the outputs are.
"""

from __future__ import annotations

import torch

from . import analysis, devices, memory
from .checkpoint import Source, load
from .errors import SurgeryError
from .families import architecture, layout, positions, stock_class_of
from .parity import (Comparison, coarsest, compare, greedy_agreement, layer_differences, output_kind, outputs,
                     probe_ids)
from .pipeline import Tolerances, Work, model_reader, source_reader
from .shards import differing

#: tokens per probe window when none is asked for (fewer when the model has fewer positions)
LENGTH = 64


def check_comparable(a: Source, b: Source) -> None:
    """Refuse, before loading, checkpoints whose outputs cannot be compared: of different
    architectures (family and class, from the family table) or vocabularies."""
    (fa, na), (fb, nb) = architecture(a.config), architecture(b.config)
    if (fa, na) != (fb, nb):
        raise SurgeryError(f"{a.name} is a {fa} model and {b.name} a {fb} one ({na} and {nb}): verify compares a "
                           "checkpoint with its rewrite, of the same architecture")
    if a.config.vocab_size != b.config.vocab_size:
        raise SurgeryError(f"{a.name} has a vocabulary of {a.config.vocab_size} tokens and {b.name} of "
                           f"{b.config.vocab_size}: their outputs cannot be compared")


def probe_length(positions: int | None, length: int | None) -> int:
    """``length`` tokens per window (default: 64, or the model's positions when fewer); an
    explicit length longer than the model's positions is refused."""
    if length is None:
        return min(LENGTH, positions or LENGTH)
    if positions is not None and length > positions:
        raise SurgeryError(f"--seq-len {length} is longer than the model's {positions} positions")
    return length


def verify(a, b, *, text: str | None = None, dtype: torch.dtype = torch.float32, tolerance: float | None = None,
           n: int = 4, length: int | None = None, generate: int = 16, per_layer: bool = False,
           streaming: bool | None = None, allow_pickle: bool = False, device: str = "auto") -> Comparison:
    """Run ``b`` against the reference ``a`` in ``dtype`` and compare: checkpoints (paths, hub ids
    or Sources), read onto ``device`` (``devices``), or models in memory (compared where they are).

    ``streaming`` (checkpoints only): True reads one part at a time (no generation, no per-layer
    figures), None does so when the two would not fit in memory together; the comparison's
    ``streaming`` says why."""
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        return compare_models(a, b, text=text, dtype=dtype, tolerance=tolerance, n=n, length=length,
                              generate=generate, per_layer=per_layer)
    sa, sb = Source.open(a, allow_pickle), Source.open(b, allow_pickle)
    check_comparable(sa, sb)
    where = devices.choose(device)
    why = _streaming(sa, sb, dtype, streaming, where)
    ids = probe_ids(sa.tokenizer, sa.config.vocab_size, text, n, probe_length(sa.positions, length))
    read = source_reader(sa, ids, dtype, why is not None, where)
    if why is not None:
        reference = read()
        result = compare(reference, source_reader(sb, ids, dtype, True, where)(), sa.head_output)
    else:
        wa, wb = Work(sa, dtype, device=where), Work(sb, dtype, device=where)
        result, reference = _compare_loaded(wa.load_all(), wb.load_all(), ids, generate, per_layer)
        wa.close()
        wb.close()
    Tolerances(read, ids, dtype, reference, tolerance, sa.head_output, why is not None, where,
               differ=lambda: differing(sa.index, sb.index)).judge(result, coarsest(sa.storage, sb.storage))
    result.streaming, result.device = why, devices.describe(where)
    return result


def _streaming(a: Source, b: Source, dtype: torch.dtype, streaming: bool | None, device: torch.device) -> str | None:
    if streaming is not None:
        return "asked for (--streaming)" if streaming else None
    params = a.index.numel + b.index.numel
    need = params * torch.finfo(dtype).bits // 8 * 1.1 + 2**30
    free, where = memory.room(device)
    if need <= free:
        return None
    return (f"in memory this needs about {need / 2**30:.1f} GiB ({params / 1e9:.2f}B parameters in "
            f"{str(dtype).removeprefix('torch.')}), {free / 2**30:.1f} GiB are available{where}")


def _compare_loaded(a, b, ids: torch.Tensor, generate: int, per_layer: bool) -> tuple[Comparison, torch.Tensor]:
    """(the comparison, ``a``'s outputs) of two models in memory."""
    reference = outputs(a, ids)
    result = compare(reference, outputs(b, ids), output_kind(a))
    if generate and layout(a).objective == "causal-lm":
        result.generation = greedy_agreement(a, b, ids[:, : min(8, ids.shape[1])], generate)
    if per_layer:
        result.layers = layer_differences(a, b, ids)
    return result, reference


def compare_models(a, b, *, text: str | None = None, dtype: torch.dtype | None = None,
                   tolerance: float | None = None, n: int = 4, length: int | None = None, generate: int = 16,
                   per_layer: bool = False, tokenizer=None) -> Comparison:
    """``verify`` of two models in memory (``dtype``: that of ``a`` unless given)."""
    if stock_class_of(a) is not stock_class_of(b):
        raise SurgeryError(f"the models are of different classes ({stock_class_of(a).__name__} and "
                           f"{stock_class_of(b).__name__}): they do not output the same thing")
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    dtype = next(a.parameters()).dtype
    ids = probe_ids(tokenizer, a.config.vocab_size, text, n, probe_length(positions(a.config), length))
    result, reference = _compare_loaded(a, b, ids, generate, per_layer)
    return Tolerances(model_reader(a, ids), ids, dtype, reference, tolerance, output_kind(a),
                      differ=lambda: differing_parameters(a, b)).judge(result)


def differing_parameters(a, b) -> frozenset[str] | None:
    """The parameters of ``a`` whose values differ from ``b``'s (None: their names or shapes differ)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys() or any(pa[k].shape != pb[k].shape for k in pa):
        return None
    return frozenset(k for k in pa if not torch.equal(pa[k].detach().cpu(), pb[k].detach().to("cpu", pa[k].dtype)))


def outliers(a, b=None, *, text: str | None = None, n: int = 8, length: int | None = None,
             allow_pickle: bool = False, device: str = "auto") -> dict:
    """``analysis.outliers`` of checkpoint ``a`` and, when given, ``b`` (its rewrite: same blocks and
    vocabulary), on the same ``n`` windows of ``text`` (default: the bundled sample), in float32:
    {"a": ..., "b": ... or None}."""
    sa = Source.open(a, allow_pickle)
    sb = None if b is None else Source.open(b, allow_pickle)
    if sb is not None and sa.config.vocab_size != sb.config.vocab_size:
        raise SurgeryError(f"{sa.name} and {sb.name} have different vocabularies: no common text to compare on")
    ids = probe_ids(sa.tokenizer, sa.config.vocab_size, text, n, probe_length(sa.positions, length))
    where = devices.choose(device)
    stats = [None if s is None else analysis.outliers(load(s, torch.float32, device=where), ids) for s in (sa, sb)]
    if stats[1] is not None and len(stats[0]["stream"]) != len(stats[1]["stream"]):
        raise SurgeryError(f"{sa.name} and {sb.name} have different numbers of blocks: their states do not pair up")
    return {"a": stats[0], "b": stats[1], "device": devices.describe(where)}
