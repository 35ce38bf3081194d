"""verify: do two checkpoints (or two models in memory) compute the same function?

Both are run on probe text in one arithmetic and compared on what their class outputs, with the
tolerance the arithmetic and the stored precision allow (``parity``). In memory both models are
loaded whole, and greedy generation (causal LMs) and per-layer differences can be compared too;
one part at a time (``streaming``; checkpoints larger than memory) only the outputs are.

A family without an adapter (no layout: ``families.stock_class_name``) is compared on what its
stock class outputs, both models whole in memory (:func:`_verify_stock`): streaming and
per-layer figures follow the layout, so they are refused for it.
"""

from __future__ import annotations

import torch

from ..core import analysis, devices, memory
from ..io.loader import load
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.options import PROBE_LENGTH, InspectOptions, VerifyOptions, options_of
from ..core.families import FAMILIES, architecture, objective, positions, stock_class_of
from ..core.parity import Comparison, coarsest, compare, greedy_agreement, layer_differences, output_kind, outputs, probe_ids
from ..engine.check import Tolerances, model_reader, source_reader
from ..engine.sweep import CheckpointWork
from ..io.shards import differing
from ..engine.runner import choose_device, job_scope

#: tokens per probe window when none is asked for (fewer when the model has fewer positions)
LENGTH = PROBE_LENGTH


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
    """``length`` tokens per window (default: :data:`LENGTH`, or the model's positions when fewer); an
    explicit length longer than the model's positions is refused."""
    if length is None:
        return min(LENGTH, positions or LENGTH)
    if positions is not None and length > positions:
        raise SurgeryError(f"--seq-len {length} is longer than the model's {positions} positions")
    return length


def as_dtype(dtype) -> torch.dtype | None:
    """A dtype option (``VerifyOptions.dtype``, ``ConvertOptions.work_dtype``): a name or a torch.dtype."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


@job_scope  # TF32 off while it computes, the caller's settings put back
def verify(a, b, options: VerifyOptions | None = None, *, text: str | None = None, **keywords) -> Comparison:
    """Run ``b`` against the reference ``a`` in ``options.dtype`` and compare (``options``:
    ``VerifyOptions``; ``keywords``: its fields, e.g. ``generate=0``): checkpoints (paths, hub ids
    or Sources), read onto ``device`` (``devices``), or models in memory (compared where they are).

    ``streaming`` (checkpoints only): True reads one part at a time (no generation, no per-layer
    figures), None does so when the two would not fit in memory together; the comparison's
    ``streaming`` says why."""
    o = options_of(VerifyOptions, options, keywords)
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        return compare_models(a, b, o, text=text)
    sa, sb = Source.open(a, o.allow_pickle, any_family=True), Source.open(b, o.allow_pickle, any_family=True)
    check_comparable(sa, sb)
    where, dtype = choose_device(o.device), as_dtype(o.dtype)
    why = _streaming(sa, sb, dtype, o.streaming, where)
    if sa.family not in FAMILIES:
        return _verify_stock(sa, sb, why, o, text, where)
    ids = probe_ids(sa.tokenizer, sa.config.vocab_size, text, o.samples, probe_length(sa.positions, o.seq_len))
    read = source_reader(sa, ids, dtype, why is not None, where)
    if why is not None:
        reference = read()
        result = compare(reference, source_reader(sb, ids, dtype, True, where)(), sa.head_output)
    else:
        wa, wb = CheckpointWork(sa, dtype, device=where), CheckpointWork(sb, dtype, device=where)
        result, reference = _compare_loaded(wa.load_all(), wb.load_all(), ids, o.generate, o.per_layer)
        wa.close()
        wb.close()
    Tolerances(read, ids, dtype, reference, o.tolerance, sa.head_output,
               differ=lambda: differing(sa.index, sb.index)).judge(result, coarsest(sa.storage, sb.storage))
    result.streaming, result.device = why, devices.describe(where)
    return result


def _verify_stock(sa: Source, sb: Source, why: str | None, o: VerifyOptions, text: str | None,
                  device: torch.device) -> Comparison:
    """``verify`` of two checkpoints of a family without an adapter: each loaded whole with its
    stock class, both run on the same probe and compared on what the class outputs (logits, or the
    last hidden state), greedy generation too for a causal LM, judged by ``parity``'s rules. What a
    tolerance needs measured is measured on the reference loaded again whole. Reading one part at a
    time (``why``: asked for, or the two would not fit in memory) and per-layer figures need the
    family's layout: refused, saying so."""
    family, dtype = sa.family, as_dtype(o.dtype)
    if o.streaming:
        raise SurgeryError(f"--streaming reads one part at a time, which needs a family adapter (the parts follow "
                           f"its layout), and normsurgery has none for {family!r}: verify it in memory, without "
                           "--streaming")
    if why is not None:
        raise SurgeryError(f"normsurgery has no adapter for {family!r}, so verify compares such models whole in "
                           f"memory (reading one part at a time needs the family's layout), but {why}")
    if o.per_layer:
        raise _no_layers(family)
    ids = probe_ids(sa.tokenizer, sa.config.vocab_size, text, o.samples, probe_length(sa.positions, o.seq_len))
    ma, mb = load(sa, dtype, device=device), load(sb, dtype, device=device)
    result, reference = _compare_loaded(ma, mb, ids, o.generate, False)
    output = output_kind(ma)
    del ma, mb  # a measurement below loads the reference again

    def read(dtype: torch.dtype = dtype, jitter: bool = False, on_load=None) -> torch.Tensor:
        return model_reader(load(sa, dtype, device=device), ids)(jitter=jitter, on_load=on_load)

    Tolerances(read, ids, dtype, reference, o.tolerance, output).judge(
        result, coarsest(sa.storage, sb.storage))
    result.device = devices.describe(device)
    result.no_adapter = (f"no adapter for {family!r}: what the stock {sa.class_name} outputs was compared, both "
                         "models in memory (no per-layer figures, no streaming)")
    return result


def _no_layers(family: str) -> SurgeryError:
    return SurgeryError(f"per-layer differences (--layers) need a family adapter to find the blocks, and "
                        f"normsurgery has none for {family!r}: verify it without --layers")


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
    if generate and objective(a) == "causal-lm":
        result.generation = greedy_agreement(a, b, ids[:, : min(8, ids.shape[1])], generate)
    if per_layer:
        result.layers = layer_differences(a, b, ids)
    return result, reference


def compare_models(a, b, options: VerifyOptions, *, text: str | None = None, tokenizer=None) -> Comparison:
    """``verify`` of two models in memory, cast to ``options.dtype`` (None: that of ``a``)."""
    o = options
    if stock_class_of(a) is not stock_class_of(b):
        raise SurgeryError(f"the models are of different classes ({stock_class_of(a).__name__} and "
                           f"{stock_class_of(b).__name__}): they do not output the same thing")
    if o.per_layer and a.config.model_type not in FAMILIES:
        raise _no_layers(a.config.model_type)
    if o.dtype is not None:
        a, b = a.to(as_dtype(o.dtype)), b.to(as_dtype(o.dtype))
    dtype = next(a.parameters()).dtype
    ids = probe_ids(tokenizer, a.config.vocab_size, text, o.samples, probe_length(positions(a.config), o.seq_len))
    result, reference = _compare_loaded(a, b, ids, o.generate, o.per_layer)
    return Tolerances(model_reader(a, ids), ids, dtype, reference, o.tolerance, output_kind(a),
                      differ=lambda: differing_parameters(a, b)).judge(result)


def differing_parameters(a, b) -> frozenset[str]:
    """The parameters of ``a`` that ``b`` does not hold as they are (absent, of another shape or values)."""
    pb = dict(b.named_parameters())
    return frozenset(k for k, p in a.named_parameters() if k not in pb or pb[k].shape != p.shape
                     or not torch.equal(p.detach().cpu(), pb[k].detach().to(devices.HOST, p.dtype)))


@job_scope  # TF32 off while it computes, the caller's settings put back
def outliers(a, b=None, options: InspectOptions | None = None, *, text: str | None = None, **keywords) -> dict:
    """``analysis.outliers`` of checkpoint ``a`` and, when given, ``b`` (its rewrite: same blocks and
    vocabulary), on the same ``options.samples`` windows of ``text`` (default: the bundled sample), in
    float32 (``options``: ``InspectOptions``; ``keywords``: its fields): {"a": ..., "b": ... or None}."""
    o = options_of(InspectOptions, options, keywords)
    n, length, allow_pickle, device = o.samples, o.seq_len, o.allow_pickle, o.device
    sa = Source.open(a, allow_pickle)
    sb = None if b is None else Source.open(b, allow_pickle)
    if sb is not None and sa.config.vocab_size != sb.config.vocab_size:
        raise SurgeryError(f"{sa.name} and {sb.name} have different vocabularies: no common text to compare on")
    ids = probe_ids(sa.tokenizer, sa.config.vocab_size, text, n, probe_length(sa.positions, length))
    where = choose_device(device)
    stats = [None if s is None else analysis.outliers(load(s, torch.float32, device=where), ids) for s in (sa, sb)]
    if stats[1] is not None and len(stats[0]["stream"]) != len(stats[1]["stream"]):
        raise SurgeryError(f"{sa.name} and {sb.name} have different numbers of blocks: their states do not pair up")
    return {"a": stats[0], "b": stats[1], "device": devices.describe(where)}
