"""convert, verify, passes, inspect."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.table import Table

from .. import calibration, checkpoint, registry
from ..convert import convert as convert_checkpoint, load_recipe, parse_pass
from ..families import layout
from ..errors import SurgeryError
from ..analysis import dead_units
from ..training import is_main_process
from ..verify import verify as verify_api
from .app import command, console, emit_json, fmt, progress_bar

STREAMING_HELP = ("read and rewrite one block at a time (default: only when the model does not fit "
                  "in memory); --in-memory loads it whole")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def read_text(path: Optional[Path]) -> Optional[str]:
    return None if path is None else calibration.read_text(path)


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise SurgeryError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@command
def convert(
    src: str = typer.Argument(..., help="input checkpoint: a folder or a cached hub id"),
    out: Path = typer.Argument(..., help="output folder (written atomically)"),
    passes: list[str] = typer.Option([], "--pass", "-p", help="NAME or NAME:key=value,... (repeatable, in order)"),
    recipe: Optional[Path] = typer.Option(None, help="a TOML recipe of [[pass]] tables"),
    fold: bool = typer.Option(False, "--fold", help="set fold=true on every pass that has the option"),
    force: bool = typer.Option(False, help="replace an existing output; save even if parity breaks"),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip the logit checks"),
    work_dtype: Optional[str] = typer.Option(None, help="float32 (default) or float64 for the rewrite (not half)"),
    text: Optional[Path] = typer.Option(None, help="text for the checks (default: bundled Shakespeare)"),
    tol: Optional[float] = typer.Option(None, help="relative logit tolerance for exact passes"),
    max_shard_size: str = typer.Option("5GB", help="largest safetensors shard"),
    streaming: Optional[bool] = typer.Option(None, "--streaming/--in-memory", help=STREAMING_HELP),
    steps: Optional[int] = typer.Option(None, help="trained passes: optimizer steps"),
    batch_size: Optional[int] = typer.Option(None, help="trained passes: windows per micro-batch and process"),
    seq_len: Optional[int] = typer.Option(None, help="trained passes: tokens per window"),
    lr: Optional[float] = typer.Option(None, help="trained passes: peak learning rate"),
    resume: bool = typer.Option(False, "--resume", help="trained passes: continue an interrupted run"),
    json: bool = typer.Option(False, "--json", help="print the result as JSON"),
):
    """Apply passes (or a recipe) to a checkpoint, check parity, save safetensors."""
    specs = [parse_pass(s) for s in passes]
    if recipe is not None:
        specs = load_recipe(recipe) + specs
    if fold:
        specs = [(n, {**o, "fold": True}) if "fold" in registry.get(n).options else (n, o) for n, o in specs]
    given = {k: v for k, v in {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                                "resume": resume or None}.items() if v is not None}
    specs = [(n, {**o, **{k: v for k, v in given.items() if k in registry.get(n).options}}) for n, o in specs]
    with progress_bar(not json and is_main_process()) as progress:
        result = convert_checkpoint(src, out, specs, force=force, verify=not no_verify,
                                     work_dtype=parse_dtype(work_dtype), text=read_text(text), tolerance=tol,
                                     max_shard_size=max_shard_size, progress=progress, streaming=streaming)
    if result.saved is None:  # not the main process
        return
    if json:
        emit_json(result.as_dict())
        return
    table = Table(title=f"convert {src} -> {out}  (rewritten in {result.work_dtype}, stored in {result.storage_dtype})")
    for col in ("pass", "kind", "rel. error", "max |Δlogit|", "KL", "top-1", "ok"):
        table.add_column(col)
    for s in result.steps:
        p = s.parity
        ok = "-" if p is None else ("yes" if p.ok else "[red]NO[/red]") if s.kind == "exact" else f"n/a ({s.kind})"
        table.add_row(s.name, s.kind, fmt(p and p.relative), fmt(p and p.max_abs), fmt(p and p.kl),
                      fmt(p and p.top1), ok)
    console.print(table)
    for s in result.steps:
        if s.metrics.get("curve"):
            console.print(curve_table(s.name, s.metrics["curve"]))
    for s in result.steps:
        for note in s.notes:
            console.print(f"  [bold]{s.name}[/bold]: {note}", highlight=False)
    if result.parity:
        p = result.parity
        console.print(f"overall vs the reference ({p.output}): relative error {fmt(p.relative)}"
                      + (f", top-1 agreement {p.top1:.4f}" if p.top1 is not None else "")
                      + (f"; tolerance {fmt(p.tolerance)}: {p.reason}" if p.tolerance is not None else ""),
                      highlight=False)
    if result.streaming:
        console.print(f"rewritten one block at a time: {result.streaming}", highlight=False)
    if result.cast:
        console.print(f"cast to {result.storage_dtype}: relative error {fmt(result.cast.relative)}; tolerance "
                      f"{fmt(result.cast.tolerance)}: {result.cast.reason}", highlight=False)
    console.print(f"saved {result.saved['path']} ({len(result.saved['files'])} files); {loads_with(result.saved)}",
                  highlight=False)


def loads_with(saved: dict) -> str:
    """What was checked about loading the saved folder (``checkpoint.save``)."""
    reload = saved.get("reload")
    if reload is None:
        return "not loaded back: how it loads was not checked"
    c = reload["comparison"]
    return (f"loads with {reload['loader']} (checked: loaded back, relative error {fmt(c['relative'])})"
            + ("; plain transformers loads it with different outputs" if reload.get("plain_transformers") else ""))


def curve_table(name: str, curve: list[dict]) -> Table:
    """A trained pass's evaluations: step, stage, what was removed, training loss, held-out CE."""
    table = Table(title=f"{name}: training curve (held-out CE never trained on)")
    keys = ["step", "tokens"] + [k for k in ("stage", "removed") if any(k in r for r in curve)] + ["loss", "heldout_ce"]
    for k in keys:
        table.add_column(k.replace("_", " "), justify="left" if k == "stage" else "right")
    for row in curve:
        table.add_row(*[(f"{row[k]:.4f}" if isinstance(row.get(k), float) else str(row.get(k, "-")))
                        if row.get(k) is not None else "-" for k in keys])
    return table


@command
def verify(
    a: str = typer.Argument(..., help="reference checkpoint"),
    b: str = typer.Argument(..., help="checkpoint to compare"),
    text: Optional[Path] = typer.Option(None, help="text to tokenize (default: bundled Shakespeare)"),
    dtype: str = typer.Option("float32", help="compute dtype: float64 checks the algebra"),
    tol: Optional[float] = typer.Option(None, help="relative tolerance (default: from the compute and storage dtypes)"),
    samples: int = typer.Option(4, help="number of token windows"),
    seq_len: int = typer.Option(64, help="tokens per window"),
    generate: int = typer.Option(16, help="greedy tokens to compare (0: skip)"),
    layers: bool = typer.Option(False, "--layers", help="also compare every hidden state"),
    streaming: Optional[bool] = typer.Option(None, "--streaming/--in-memory", help=STREAMING_HELP),
    json: bool = typer.Option(False, "--json"),
):
    """Compare two checkpoints' outputs (logits, or a base model's last hidden state); exit 1 when
    they differ beyond the tolerance (by default the one the stored precision allows)."""
    r = verify_api(a, b, text=read_text(text), dtype=parse_dtype(dtype), tolerance=tol, n=samples,
                   length=seq_len, generate=generate, per_layer=layers, streaming=streaming)
    if json:
        emit_json({"a": a, "b": b, "dtype": dtype, **r.as_dict()})
    else:
        table = Table(title=f"verify {a} vs {b} in {dtype}")
        table.add_column("metric")
        table.add_column("value")
        d = "Δlogit" if r.output == "logits" else "Δh"
        rows = [("compared", r.output), (f"max |{d}|", r.max_abs), (f"mean |{d}|", r.mean_abs),
                ("relative error", r.relative), ("tolerance", r.tolerance), ("why this tolerance", r.reason)]
        rows += ([("KL(a||b)", r.kl), ("top-1 agreement", r.top1)] if r.output == "logits"
                 else [("mean-pooled cosine (worst)", r.cosine)])
        rows += [("greedy agreement", r.generation)] if r.generation is not None else []
        for row in r.layers:
            rows.append((f"h_{row['state']}: {row['what']}", fmt(row["relative"]) + f" ({row['basis']})"
                         + (f"; {row['note']}" if row["note"] else "")))
        for k, v in rows:
            table.add_row(k, fmt(v))
        console.print(table)
        if r.streaming:
            console.print(f"read one block at a time (no generation, no per-layer figures): {r.streaming}",
                          highlight=False)
        if r.layers:
            console.print("h_l: the residual stream entering block l (the last row: leaving the last block). The "
                          "final norm's output is not compared per layer (flashnorm moves its gain into the head); "
                          f"the {r.output} compared above is what the model outputs", highlight=False, soft_wrap=True)
        console.print("[green]same function[/green]" if r.ok else "[red]DIFFERENT[/red]: relative error above tolerance")
    if not r.ok:
        raise typer.Exit(1)


@command
def passes(json: bool = typer.Option(False, "--json")):
    """List the registered passes."""
    ps = registry.all_passes()
    if json:
        emit_json([{"name": p.name, "kind": p.kind, "description": p.description,
                    "applies_to": p.families, "options": p.options} for p in ps])
        return
    table = Table(title="passes")
    for col in ("name", "kind", "what it does", "applies to", "options"):
        table.add_column(col)
    for p in ps:
        table.add_row(p.name, p.kind, p.description, p.families,
                      ", ".join(f"{k}={v}" for k, v in p.options.items()) or "-")
    console.print(table)


@command
def inspect(src: str = typer.Argument(..., help="checkpoint folder or cached hub id"),
            json: bool = typer.Option(False, "--json")):
    """Architecture, norm layout, and which passes apply (and why not)."""
    model = checkpoint.load(src)
    lay = layout(model)
    info = {
        "architecture": type(model).__name__, "family": lay.family, "placement": lay.placement,
        "norm": ", ".join(sorted({s.kind + (f" (gain = {s.offset:g} + w)" if s.offset else "") for s in lay.norms})),
        "hidden_size": lay.hidden_size, "stream_width": lay.stream_width, "objective": lay.objective,
        "blocks": len(model.get_submodule(lay.layers_path)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "tied_embeddings": lay.tied, "stream_norms": len(lay.norms),
        "writers": len(lay.embeddings) + len(lay.writers),
        "readers": sum(len(s.readers) for s in lay.norms), "qk_norms": len(lay.qk_norms),
        "norm_sites": _norm_sites(lay),
        "passes": {p.name: (p.applies(model, lay) or "applies") for p in registry.all_passes()},
        "dead": asdict(dead_units(model, lay)) if lay.attention else None,
    }
    if json:
        emit_json(info)
        return
    table = Table(title=f"inspect {src}", show_header=False)
    table.add_column("")
    table.add_column("")
    for k, v in info.items():
        if k not in ("passes", "norm_sites", "dead"):
            table.add_row(k.replace("_", " "), str(v))
    for site in info["norm_sites"]:
        table.add_row(f"norm ({site['role']})", f"{site['path']} -> {', '.join(site['readers']) or '(the stream)'}")
    for name, why in info["passes"].items():
        table.add_row(f"pass {name}", "[green]applies[/green]" if why == "applies" else why)
    console.print(table)
    if info["dead"]:
        console.print(_dead_table(info["dead"]))


def _dead_table(dead: dict) -> Table:
    """Per layer: dead MLP units, dead and removable heads, channels its writers leave zero."""
    table = Table(title=f"dead units (stream: {dead['width']} channels, {len(dead['dead_channels'])} unwritten, "
                        f"{len(dead['removable_channels'])} removable)")
    for col in ("layer", "MLP units dead", "heads dead", "heads removable", "KV heads removable",
                "channels unwritten"):
        table.add_column(col)
    for d in dead["layers"]:
        table.add_row(str(d["layer"]), f"{len(d['dead_units'])}/{d['mlp_units']}",
                      f"{len(d['dead_heads'])}/{d['heads']}", str(len(d["removable_heads"])),
                      f"{len(d['removable_kv_heads'])}/{d['kv_heads']}", str(len(d["unwritten_channels"])))
    return table


def _norm_sites(lay) -> list[dict]:
    """The first block's norm sites and the final norm (every block has the same layout)."""
    first = f"{lay.layers_path}.0."
    sites = [s for s in lay.norms if s.path.startswith(first) or s.role in ("final", "embed")]
    return [{"path": s.path, "role": s.role, "readers": list(s.readers)} for s in sites]
