"""``export``: a checkpoint as an ONNX graph, checked in ONNX Runtime against the torch model, or as
a GGUF file, checked in llama.cpp against the checkpoint in transformers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import typer

from ..core.options import CACHE_TOKENS, GGUF_DTYPES, ExportOptions
from ..io.ours import GGUF
from .app import JSON, claimed, command, emit_json, read_text, say, say_device


@command(preload=False)
def export(
    src: str = typer.Argument(..., metavar="IN", help="checkpoint: a folder or a cached hub id (stock or rewritten)"),
    dest: Path = typer.Argument(..., metavar="DEST", help="output folder (ONNX) or file (GGUF), written atomically"),
    options: ExportOptions = None,
    text: Optional[Path] = typer.Option(None, metavar="FILE", help="text for the check (default: bundled Shakespeare)"),
    json: bool = JSON,
):
    """Export a checkpoint to ONNX (inputs input_ids and attention_mask, dynamic batch and sequence),
    run it in ONNX Runtime on probe text and compare with the torch model; or to one GGUF file
    (--to gguf) run in llama.cpp and compared with the checkpoint in transformers. Exit 1, writing
    nothing, when they differ beyond the tolerance. Or to a nemotron-nas (DeciLM) folder (--to
    nemotron-nas: per-layer widths as vLLM, SGLang, TensorRT-LLM and MLX-LM read them), checked in
    MLX-LM or vLLM (--check) and in transformers. Needs pip install 'normsurgery[onnx]' (or [gguf],
    [mlx] or vLLM)."""
    options.check()
    asked = Asked(src, dest, text, options, json)
    if options.to == "gguf":
        return _gguf(asked)
    if options.to == "nemotron-nas":
        return _nemotron(asked)
    _onnx(asked)


def _onnx(a: Asked) -> None:
    """``export --to onnx``: the graph written and checked in ONNX Runtime (``export.export``)."""
    body = read_text(a.text)
    with claimed(a.src, a.dest, a.options.force, a.options.allow_pickle) as source:
        from ..exporters.export import export as export_api  # each format's runtime required there

        r = export_api(source, a.dest, a.options, text=body)
    if a.json:
        emit_json(r.as_dict())
        return
    from .report import fmt

    p = r.parity
    say(f"ONNX Runtime vs torch ({p.output}): relative error {fmt(p.relative)}"
        + (f", top-1 agreement {p.top1:.4f}" if p.top1 is not None else "")
        + f"; tolerance {fmt(p.tolerance)}: {p.reason}")
    if r.with_past:
        say(f"with the key/value cache: {CACHE_TOKENS} greedy tokens in ONNX Runtime equal generate's "
            f"({p.generation:.0%} agree)")
    say_device(p.device)
    say(f"saved {r.saved['path']}: opset {r.opset}, inputs input_ids and attention_mask, output {r.output}"
        + (", past_key_values.L.key/value in, present.L.key/value out" if r.with_past else "")
        + (", weights in model.onnx_data" if r.external_data else ""))


@dataclass(frozen=True)
class Asked:
    """What every export format takes from the command line."""
    src: str
    dest: Path
    text: Path | None
    options: ExportOptions
    json: bool


def _gguf(a: Asked) -> None:
    """``export --to gguf``: the file written and checked in llama.cpp (``gguf.export``)."""
    dtype = a.options.dtype or GGUF_DTYPES[0]
    body = read_text(a.text)
    with claimed(a.src, a.dest, a.options.force, a.options.allow_pickle, file=GGUF) as source:
        from ..exporters.export import export as export_api  # each format's runtime required there

        r = export_api(source, a.dest, replace(a.options, dtype=dtype), text=body)
    if a.json:
        emit_json(r.as_dict())
        return
    from .report import fmt

    p, g, k = r.parity, r.greedy, r.distributions
    say(f"llama.cpp vs transformers, the whole distribution at {k['positions']} generated positions: mean KLD "
        f"{fmt(k['mean_kld'])}, 99.9% KLD {fmt(k['kld_99_9'])}, same top p {k['same_top_p']:.1f}%; log-probabilities' "
        f"relative error {fmt(p.relative)}, tolerance {fmt(p.tolerance)}: {p.reason}")
    say(f"greedy: {g['new_tokens']} tokens after each of {g['prompts']} prompts "
        + ("equal transformers'" if g["equal"] else f"equal transformers' up to the first difference: {g['agree']:.0%}")
        + f"; the text's {r.tokenizer['tokens']} tokens equal transformers'")
    say_device(p.device)
    say(f"saved {r.saved['path']} ({r.saved['bytes']:,} bytes): llama.cpp architecture {r.arch}, matrices in "
        f"{r.dtype.upper()}" + (" (--dtype auto: the checkpoint's type)" if dtype == "auto" else "")
        + (", norms removed (eps trick: eps 1e12, gains 1e6)" if r.eps_trick else "")
        + f"; card {r.saved['card']}")


def _nemotron(a: Asked) -> None:
    """``export --to nemotron-nas``: the DeciLM folder written and checked in MLX-LM or vLLM and in
    transformers (``nemotron.export``)."""
    body = read_text(a.text)
    with claimed(a.src, a.dest, a.options.force, a.options.allow_pickle) as source:
        from ..exporters.export import export as export_api  # each format's runtime required there

        r = export_api(source, a.dest, a.options, text=body)
    if a.json:
        emit_json(r.as_dict())
        return
    from .report import fmt

    p, g, plan, t, b = r.parity, r.greedy, r.plan, r.transformers, r.weight_bytes
    say(f"{r.runtime} vs transformers (logits): relative error {fmt(p.relative)}, KL {fmt(p.kl)}, top-1 agreement "
        f"{p.top1:.4f}; tolerance {fmt(p.tolerance)}: {p.reason}")
    say(f"greedy: {g['agree']:.0%} of {g['new_tokens']} tokens after each of {g['prompts']} prompts equal transformers'")
    say(f"the folder in transformers (AutoModelForCausalLM, its auto_map) vs the checkpoint: relative error "
        f"{fmt(t.relative)}; tolerance {fmt(t.tolerance)}")
    from ..exporters.nemotron import runs

    written = plan.as_dict()["units_written"]
    say(f"saved {r.saved['path']}: nemotron-nas ({r.dtype}), MLP widths {runs(plan.widths)}, key/value heads "
        f"{runs(plan.kv_heads)}; checked in {r.runtime}")
    say(f"padding: {plan.kept:,} MLP units kept, written as {written:,} ({plan.padding_bytes:,} bytes of zero units); "
        f"weights {b['out'] / 1e6:.1f} MB for {b['in'] / 1e6:.1f} MB in"
        + (": not smaller, the padding ate the saving" if written > plan.kept and b["out"] >= b["in"] else ""))
