"""The model card (README.md, Hugging Face convention) of every folder normsurgery writes.

Made from what the folder's config records under "normsurgery" (the record: passes and their
options, notes and parity; prune and heal summaries; held-out losses) and from the reload check
(how the folder loads, and what it computes against the reference): a YAML header, then what was
done, the parity measured, the losses of trained steps and how to load the folder. An input's own
README.md, copied with its side files, is kept as README.source.md.

The header keeps what the input's card says of the model's lineage and use (:data:`KEPT`: license,
language, datasets, pipeline tag, library and tags; not model-index, whose scores were measured on
the input) and adds ours: the tag ``normsurgery`` (which ``--force`` recognises), the family and
the steps. ``base_model`` is a hub id or nothing, never a local path: the source when it is a hub
id, else the config's ``_name_or_path``, else the input card's own ``base_model``. An unmerged
LoRA adapter gets a card of its own (:func:`write_adapter`).
"""

from __future__ import annotations

import re
import shlex
import sys
from contextvars import ContextVar
from pathlib import Path

from ..core.options import CACHE_TOKENS
from ..core.version import __version__

CARD = "README.md"
SOURCE_CARD = "README.source.md"
#: how a causal LM's class name ends (TransformerLens, ``normsurgery.lens``, takes no other)
CAUSAL_CLASSES = ("ForCausalLM", "LMHeadModel")
#: what a card keeps of its input card's YAML header
KEPT = ("language", "license", "license_name", "license_link", "library_name", "pipeline_tag", "datasets", "tags",
        "base_model")
#: the command line of the CLI run writing the folder (set by the CLI for the command's duration,
#: then reset; None: the Python API)
COMMAND: ContextVar[list[str] | None] = ContextVar("normsurgery_command", default=None)


def write_card(kind: str, folder: Path, facts: dict) -> None:
    """The card of what was written into ``folder``, as ``kind`` says (a writer asks for it in its
    stage, ``output.Staged.card``; ``output.staged`` writes it once the writing succeeded): a
    model folder (:func:`write`), an unmerged adapter (:func:`write_adapter`), an ONNX export
    (:func:`write_export`), a GGUF file (:func:`gguf_card`, beside it as ``NAME.md``), or a card its
    exporter composed (``text``, as README.md)."""
    if kind == "gguf":
        (Path(folder) / f"{facts['name']}.md").write_text(gguf_card(**facts))
    elif kind == "text":
        (Path(folder) / CARD).write_text(facts["text"])
    else:
        {"model": write, "adapter": write_adapter, "onnx": write_export}[kind](folder, **facts)


def write(folder: Path, record: dict, reload: dict | None, config, name: str) -> None:
    """``folder/README.md`` (of the model ``name``) from ``record`` and ``reload`` (see the module
    docstring)."""
    folder = Path(folder)
    if (folder / CARD).exists():
        (folder / CARD).rename(folder / SOURCE_CARD)
    (folder / CARD).write_text(render(record, reload, config, name, (folder / SOURCE_CARD).exists(),
                                      source_header(folder / SOURCE_CARD)))


def source_header(card: Path) -> dict:
    """The YAML header of the card ``card`` (a README.md): {} when there is none, or it does not parse."""
    import yaml

    try:
        text = Path(card).read_text(errors="replace")
    except OSError:
        return {}
    m = re.match(r"---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.S)
    try:
        data = yaml.safe_load(m.group(1)) if m else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def header(record: dict, config, kept: dict, library: str, tags: list[str], own_library: bool = False) -> list[str]:
    """The card's YAML header, between its ``---`` lines: what ``kept`` (the input card's header,
    :func:`source_header`) says under :data:`KEPT`, our ``tags`` before its own, ``library`` where it
    names none (or always, ``own_library``: an exported file loads with its own runtime), and
    ``base_model`` (:func:`base_model`)."""
    import yaml

    meta = {k: kept[k] for k in KEPT if k in kept and k not in ("base_model", "tags")}
    base = base_model(record, config, kept)
    if base:
        meta = {"base_model": base, **meta}
    if own_library or not isinstance(meta.get("library_name"), str):
        meta["library_name"] = library
    theirs = kept.get("tags")
    theirs = [theirs] if isinstance(theirs, str) else [t for t in theirs or [] if isinstance(t, str)]
    meta["tags"] = list(dict.fromkeys([*tags, *theirs]))
    return ["---", *yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=10_000).splitlines(), "---"]


def render(record: dict, reload: dict | None, config, name: str, source_card: bool = False,
           kept: dict | None = None) -> str:
    passes = [p["name"] for p in record.get("passes") or []] + [k for k in ("prune", "heal", "squeeze")
                                                                  if k in record]
    tags = ["normsurgery", config.model_type, *dict.fromkeys(passes)]
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    lines = [*header(record, config, kept or {}, "normsurgery", tags), "", f"# {name}", "",
             f"`{arch}` ({config.model_type}) written by normsurgery {record.get('version', __version__)} from "
             f"`{record.get('source', '?')}`" + (" (its own card: README.source.md)" if source_card else "") + ".", ""]
    lines += _what_was_done(record)
    lines += ["", "## Parity", ""] + _parity(record, reload)
    lines += _losses(record)
    auto = next(iter(getattr(config, "auto_map", None) or {}), "AutoModel")
    lines += ["", "## How to load", ""] + _loading(reload, arch, auto)
    return "\n".join(lines) + "\n"


def write_adapter(folder: Path, record: dict, adapter: dict, source, name: str) -> None:
    """The card of an unmerged LoRA adapter (``heal.write_adapter``) named ``name``: what it holds
    (``adapter``: its tensors, parameters, rank, alpha and the base its config names), what was
    done (``record``), the held-out losses, and how to load it onto its base. The header's
    ``base_model`` is the source's hub id; from a local folder, the source card's own
    ``base_model`` (when it names one), the folder itself named in the text."""
    folder = Path(folder)
    config = source.config
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    base = adapter["base"]
    where = f"`{source.name}` on the hub" if hub_id(source.name) else f"the local folder `{Path(source.name).name}`"
    if "prune" in record:
        where = f"the pruned model in the folder holding this one (`..`), pruned from {where}"
    lines = [*header(record, config, source_header(source.path / CARD), "peft",
                     ["normsurgery", "lora", "peft", config.model_type, *(k for k in ("prune", "heal") if k in record)],
                     own_library=True), "", f"# {name}", "",
             f"A LoRA adapter (peft) written by normsurgery {record.get('version', __version__)}, unmerged: rank "
             f"{adapter['rank']}, alpha {adapter['alpha']:g}, {adapter['tensors']} tensors, {adapter['parameters']:,} "
             f"parameters, checked after writing (every LoRA tensor trained is in `adapter_model.safetensors`). "
             f"Its base is {where}; its config names `{base}`.", ""]
    lines += _what_was_done(record)
    lines += _losses(record)
    lines += ["", "## How to load", "", "```python", "import peft, transformers",
              f"base = transformers.{arch}.from_pretrained(\"BASE\")  # {base}",
              "model = peft.PeftModel.from_pretrained(base, \"PATH\")",
              "merged = model.merge_and_unload()  # a plain model, as heal without --save-adapter saves it", "```"]
    (folder / CARD).write_text("\n".join(lines) + "\n")


def _what_was_done(record: dict) -> list[str]:
    import torch
    import transformers

    command = COMMAND.get()
    lines = ["## What was done", "",
             "- command line: " + (f"`normsurgery {shlex.join(command)}`" if command is not None else
                                   "the Python API (" + (sys.argv[0] or "python") + ")"),
             f"- versions: normsurgery {__version__}, torch {torch.__version__}, "
             f"transformers {transformers.__version__}",
             *_device(record.get("device")),
             ""]
    lines += _done(record)
    if record.get("history"):
        lines += ["", "## Earlier steps (the input's own record, earliest first)", ""]
        for i, h in enumerate(record["history"], 1):
            lines.append(f"{i}. from `{h.get('source', '?')}` (normsurgery {h.get('version', '?')})")
            lines += [f"   {row}" for row in _done(h)]
    return lines


def _losses(record: dict) -> list[str]:
    trained = _trained(record)
    if not trained:
        return []
    return ["", "## Held-out loss (trained steps)", "", "| step | cross-entropy before | after | tokens |",
            "|---|---|---|---|", *trained, *_heldout(record)]


def write_export(folder: Path, name: str, source: str, config, parity: dict, with_past: bool,
                 external: bool) -> None:
    """The card of an ONNX export (named ``name``): what the graph takes and returns, and what ONNX Runtime
    computed against the torch model (``parity``: ``Comparison.as_dict``)."""
    import onnxruntime
    import torch

    folder = Path(folder)
    if (folder / CARD).exists():
        (folder / CARD).rename(folder / SOURCE_CARD)
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    p = parity
    lines = [*header({"source": source}, config, source_header(folder / SOURCE_CARD), "onnx",
                     ["normsurgery", "onnx", config.model_type], own_library=True), "", f"# {name}", "",
             f"`{arch}` ({config.model_type}) from `{source}`, exported to ONNX by normsurgery {__version__} "
             f"(torch {torch.__version__}, TorchScript exporter), checked in onnxruntime {onnxruntime.__version__}.",
             "", "## Graph", "", "- inputs: `input_ids`, `attention_mask` (int64; dynamic batch and sequence)"
             + (", `past_key_values.L.key` / `.value` (batch, heads, past tokens, head dim)" if with_past else ""),
             f"- outputs: `{'logits' if p.get('top1') is not None else 'last_hidden_state'}`"
             + (", `present.L.key` / `.value`" if with_past else ""),
             "- weights: " + ("`model.onnx_data` (external data)" if external else "inside `model.onnx`"),
             "", "## Parity", "",
             f"ONNX Runtime (CPU) against the torch model, float32, probe text: relative error {p['relative']:.2e}"
             + (f", top-1 agreement {p['top1']:.4f}" if p.get("top1") is not None else "")
             + f"; tolerance {_num(p.get('tolerance'))}: {p.get('reason') or 'none'}."
             + (f" With the cache: {p['generation']:.0%} of {CACHE_TOKENS} greedy tokens equal `generate`'s."
                if with_past else ""),
             "", "## How to run", "", "```python", "import onnxruntime, numpy as np",
             "session = onnxruntime.InferenceSession(\"PATH/model.onnx\")",
             "out = session.run(None, {\"input_ids\": ids, \"attention_mask\": np.ones_like(ids)"
             + (", **past" if with_past else "") + "})[0]", "```"]
    (folder / CARD).write_text("\n".join(lines) + "\n")


def gguf_card(name: str, source: str, config, result: dict, kept: dict | None = None) -> str:
    """The card beside a GGUF file (``NAME.md``): what was written, what llama.cpp computed against
    transformers (``result``: ``gguf.Exported.as_dict``) and how to run it; ``kept``: the source
    card's header (:func:`source_header`)."""
    p, g, k = result["parity"], result["greedy"], result["distributions"]
    trick = (" Every norm was removed (remove-ln): written with eps = 1e12 and gains 1e6, which llama.cpp's norm "
             "turns into the identity." if result["eps_trick"] else "")
    lines = [*header({"source": source}, config, kept or {}, "gguf", ["normsurgery", "gguf", config.model_type],
                     own_library=True), "", f"# {name}", "",
             f"`{source}` ({config.model_type}) as GGUF by normsurgery {__version__}: llama.cpp architecture "
             f"`{result['arch']}`, matrices in {result['dtype'].upper()} (1-D tensors F32), pre-tokenizer "
             f"`{result['pre_tokenizer']}`.{trick}", "", "## Checked in llama.cpp", "",
             f"llama.cpp (xllamacpp, CPU) against the checkpoint in transformers on the probe text, the whole "
             f"distribution at {k['positions']} generated positions: mean KLD {k['mean_kld']:.2e}, 99.9% KLD "
             f"{k['kld_99_9']:.2e}, same top p {k['same_top_p']:.1f}%; log-probabilities' relative error "
             f"{p['relative']:.2e}, tolerance {_num(p.get('tolerance'))}: {p.get('reason')}. Greedy: "
             f"{g['new_tokens']} tokens after each of {g['prompts']} prompts "
             + ("equal transformers'." if g["equal"] else f"agree with transformers' to {g['agree']:.0%}.")
             + " The text tokenizes alike in both.",
             "", "## How to run", "", "```", f"llama-cli -m {name}", "```", "",
             f"Ollama: a `Modelfile` holding `FROM ./{name}`, then `ollama create NAME -f Modelfile`."]
    return "\n".join(lines) + "\n"


def hub_id(name) -> bool:
    """``name`` looks like a hub id (owner/name) and is no local path."""
    return (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None
            and not Path(name).exists())


def base_model(record: dict, config, kept: dict | None = None):
    """The header's ``base_model``: a hub id only (the source, else the config's ``_name_or_path``,
    else what the input card names when every entry is one); None: a local folder is no model on
    the hub, so the line is left out."""
    for name in (record.get("source"), getattr(config, "_name_or_path", None)):
        if hub_id(name):
            return name
    theirs = (kept or {}).get("base_model")
    names = [theirs] if isinstance(theirs, str) else theirs if isinstance(theirs, list) else []
    return theirs if names and all(hub_id(n) for n in names) else None


def _device(device: dict | None) -> list[str]:
    """Where the command computed (``devices.describe``)."""
    if not device:
        return []
    return [f"- computed on: {device['device']}" + (f" ({device['name']})" if device["name"] != "CPU" else "")]


def _done(record: dict) -> list[str]:
    rows = []
    for p in record.get("passes") or []:
        opts = ", ".join(f"{k}={'auto' if v is None else v}"  # None: not given, chosen from the model and options
                         for k, v in (p.get("options") or {}).items() if not (k == "mask" and v is None)) or "defaults"
        rows.append(f"- pass **{p['name']}** ({opts})")
        rows += [f"  - {n}" for n in p.get("notes") or []]
    if "prune" in record:
        pr = record["prune"]
        rows.append(f"- **prune**: removed layers {pr.get('layers')} (method {pr.get('method')}, "
                    f"scored on {pr.get('text_tokens', 0)} tokens)")
    if "heal" in record:
        h = record["heal"]
        lora = f"LoRA rank {h.get('rank')}" + {True: ", merged", False: ", kept unmerged as an adapter"}.get(
            h.get("merged"), "")
        what = {"norms": "the norms' gains and biases", "full": "every parameter"}.get(h.get("train"), lora)
        precision = {"no": "fp32"}.get(h.get("mixed_precision"), h.get("mixed_precision"))
        rows.append(f"- **heal**: {what}, {h.get('steps')} steps, {h.get('tokens')} tokens, precision {precision}, "
                    f"objective {_objective(h)}")
    if "squeeze" in record:
        sq = record["squeeze"]
        o, opts, cycles = sq["original"], sq["options"], sq["cycles"]
        rows.append(f"- **squeeze**: {len(cycles)} cycle{'s' if len(cycles) != 1 else ''} of mask -> minimize -> "
                    f"release -> retrain ({opts.get('train')}, {opts.get('steps_per_cycle')} steps"
                    f"{' each' if len(cycles) != 1 else ''}; masks of "
                    f"{', '.join(opts.get('structure') or ())} by {opts.get('by')}): {o['params']:,} -> "
                    f"{cycles[-1]['params']:,} parameters ({cycles[-1]['params'] / o['params']:.1%})")
        rows += [f"  - cycle {c['cycle']}: masked {c['fraction']:.3f} of each structure ({c['heads_fraction']:.3f} "
                 f"of the KV-head groups), {c['params']:,} parameters; minimize's relative error "
                 f"{c['minimize_relative']:.2e}; {c['released']:,} zeros released" for c in cycles]
        if sq.get("control"):
            c = sq["control"]
            rows.append(f"  - control: one-shot from the input (one cycle, {c['steps']} steps), {c['params']:,} "
                        f"parameters, held-out CE {c['ce_after']:.4f} (squeeze {cycles[-1]['ce_after']:.4f})")
    if record.get("streaming"):
        rows.append("- rewritten one block at a time (streaming)")
    if record.get("kept_float32"):
        rows.append(f"- {len(record['kept_float32'])} tensors kept in float32 (they overflow the storage dtype)")
    return rows or ["- saved as it was (no pass)"]


def _objective(h: dict) -> str:
    """heal's objective in words: ``kd`` (T 1, from `teacher`; why) or ``ce`` (why)."""
    o = h.get("objective", "ce")
    how = [f"T {h['temperature']:g}" if h.get("temperature") is not None else "",
           f"CE weight {h['ce_weight']:g}" if h.get("ce_weight") is not None else "",
           f"from `{h['teacher']}`" if o != "ce" and h.get("teacher") else "", h.get("why") or ""]
    return f"{o}" + (f" ({'; '.join(x for x in how if x)})" if any(how) else "")


def _parity(record: dict, reload: dict | None) -> list[str]:
    dtypes = (f"rewritten in {record['work_dtype']}, stored in {record['storage_dtype']}"
              if "work_dtype" in record else None)
    rows = [f"Dtypes: {dtypes}.", ""] if dtypes else []
    rows += [line for w in record.get("warnings") or () for line in (f"**Warning:** {w}", "")]
    steps = [p for p in record.get("passes") or [] if p.get("relative_error") is not None]
    if steps:
        rows += ["| pass | relative logit error | tolerance | why |", "|---|---|---|---|"]
        rows += [f"| {p['name']} | {p['relative_error']:.2e} | {_num(p.get('tolerance'))} | {p.get('reason') or ''} |"
                 for p in steps]
        rows.append("")
    if reload is None:
        return rows + ["Not loaded back: how this folder loads and what it computes were not checked."]
    c = reload["comparison"]
    what = c.get("output", "logits")
    rows.append(f"Overall (reload check): this folder, loaded back with {reload['loader']}, against the reference "
                f"({what}, probe text): relative error {c['relative']:.2e}"
                + (f", KL {c['kl']:.2e}" if c.get("kl_tolerance") is not None else "")
                + (f", top-1 agreement {c['top1']:.4f}" if c.get("top1") is not None else "")
                + f"; tolerance {_num(c.get('tolerance'))}"
                + (f", KL {_num(c.get('kl_tolerance'))}" if c.get("kl_tolerance") is not None else "")
                + f": {c.get('reason') or 'none'}.")
    if c.get("ok") is False:
        rows += ["", f"**The check failed** ({c.get('failed')}): this folder was saved with `--force` and does not "
                 "compute the reference's function within tolerance."]
    return rows


def _trained(record: dict) -> list[str]:
    rows = []
    for p in record.get("passes") or []:
        h = p.get("heldout")
        if h:
            rows.append(f"| {p['name']} | {h['ce_before']:.4f} | {h['ce_after']:.4f} | {h['tokens']} |")
            if "ce_control" in h:
                rows.append(f"| {p['name']}: the vanilla fine-tune at the same budget (control; the pass is "
                            f"{h['gap_to_control']:+.4f} from it) | {h['ce_before']:.4f} | {h['ce_control']:.4f} | "
                            f"{h['control_tokens']} |")
    h = record.get("heal")
    for ce, on in ((record.get("heldout_ce") or {}, ""), (record.get("eval_text_ce") or {}, " (--eval-text)")):
        if "original" in ce and "pruned" in ce:
            rows.append(f"| prune{on} | {ce['original']:.4f} | {ce['pruned']:.4f} | 0 |")
        before = ce.get("pruned", ce.get("input"))
        if h and before is not None and ce.get("healed") is not None:
            rows.append(f"| heal{on} | {before:.4f} | {ce['healed']:.4f} | {h['tokens']} |")
    sq = record.get("squeeze") or {}
    for c in sq.get("cycles") or []:
        rows.append(f"| squeeze cycle {c['cycle']} | {c['ce_released']:.4f} | {c['ce_after']:.4f} | {c['tokens']} |")
    if sq.get("control"):
        c, gap = sq["control"], sq["cycles"][-1]["ce_after"] - sq["control"]["ce_after"]
        rows.append(f"| squeeze: one-shot from the input at the same target and tokens (control; squeeze is "
                    f"{gap:+.4f} from it) | {c['ce_released']:.4f} | {c['ce_after']:.4f} | {c['tokens']} |")
    return rows


def _heldout(record: dict) -> list[str]:
    """What the held-out cross-entropy was measured on (prune, heal) and, healing a pruned model,
    the original's on the same windows."""
    h, ce, other = record.get("heldout"), record.get("heldout_ce") or {}, record.get("eval_text")
    if not h:
        return []
    rows = ["", f"Cross-entropy in nats per token on {h['text']}: {h['windows']} windows of {h['seq_len']} tokens"
            + (f" ({h['fewer']})" if h.get("fewer") else "") + "."]
    if other:
        rows.append(f"(--eval-text): on a second text, never trained on: {other['windows']} windows of "
                    f"{other['seq_len']} tokens" + (f" ({other['fewer']})" if other.get("fewer") else "") + ".")
    if "original" in h:
        theirs = (record.get("eval_text_ce") or {}).get("original")
        rows.append(f"The original before pruning (`{h['original']}`): {ce['original']:.4f} on the same windows"
                    + (f", {theirs:.4f} on --eval-text" if theirs is not None else "") + "."
                    if "original" in ce else f"The original before pruning: {h['original']}.")
    rec = record.get("recovered") or {}
    shares = [f"{rec[k]:.1%} on {what}" for k, what in (("heldout", "the held-out end of the text"),
                                                       ("eval_text", "--eval-text")) if rec.get(k) is not None]
    if shares:
        rows.append(f"Share of the gap pruning opened that healing closed: {', '.join(shares)}.")
    rows += _kl(record)
    if rec.get("note"):
        rows.append(f"**Note**: {rec['note']}.")
    return rows


def _kl(record: dict) -> list[str]:
    """KL(teacher || model) before and after healing, and the share of it closed, where measured."""
    rec, rows = record.get("recovered") or {}, []
    for key, on, share in (("heldout_kl", "the held-out end of the text", "kl_heldout"),
                           ("eval_text_kl", "--eval-text", "kl_eval_text")):
        kl = record.get(key)
        if kl:
            closed = f" ({rec[share]:.1%} of it closed)" if rec.get(share) is not None else ""
            rows.append(f"KL(teacher || model) on {on}, nats per token: {kl.get('input', kl.get('pruned')):.4f} "
                        "before healing, "
                        f"{kl['healed']:.4f} after{closed}.")
    if rows:
        teacher = (record.get("heal") or {}).get("teacher")
        rows.insert(0, f"The teacher: `{teacher}`, the model before the cut." if teacher else
                    "The teacher: the model before the cut.")
    return rows


def _loading(reload: dict | None, arch: str, auto: str) -> list[str]:
    plain = reload is not None and reload["loader"] == "plain transformers"
    failed = reload is not None and reload["comparison"].get("ok") is False
    code = (f"import transformers\nmodel = transformers.{arch}.from_pretrained(\"PATH\")" if plain else
            f"import transformers\nmodel = transformers.{auto}.from_pretrained(\"PATH\", trust_remote_code=True)\n"
            "# or: import normsurgery; model = normsurgery.load(\"PATH\")")
    return (["It loads as below, but its outputs differ from the reference's beyond tolerance (see Parity).", ""]
            if failed else []) + ["```python", code, "```", "",
            "- " + ("plain transformers, no remote code" if plain else
                    "rewritten modules: the runtime beside the weights (modeling_normsurgery.py) loads as remote code"),
            "- ONNX Runtime: `normsurgery export PATH onnx/ --to onnx` (checked against this model in ONNX Runtime).",
            *(["- TransformerLens (GPT-2 and Llama families): `normsurgery.lens(\"PATH\")`."]
              if arch.endswith(CAUSAL_CLASSES) else [])]


def _num(x) -> str:
    return "-" if x is None else f"{x:.1e}"
