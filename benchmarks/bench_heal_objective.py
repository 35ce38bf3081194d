#!/usr/bin/env python
"""heal --objective ce | kd | kd+ce (and local + global) on the real SmolLM2-135M, judged off the healing text.

Two cuts of SmolLM2-135M-Instruct (``../shared/real-models/fetch smollm2``): (a) ``prune --layers 6``
(6 of 30 blocks, scored on the healing text), (b) ``minimize`` with ``prune_units=0.3,by=activation``
(the mask then the exact shrink: 30% of every MLP's units, the least energy on the healing text; by
weight magnitude instead, the cut leaves SmolLM2 at CE 13.4, above ln V). Each is healed on
``../shared/data/tinyshakespeare.txt`` at heal's defaults (LoRA r 8 on every linear, lr 2e-3, windows
of 128 tokens, 8 a step), S steps (S 100) under each objective; for (b) also S_L local steps
(``local_steps``, blockwise nMSE) then S - S_L global kd steps: the same number of steps of the
same windows as global kd alone (equal token budget); for (a) also kd from ``--teacher-cache``
(top-64 targets on disk, the teacher not loaded), and kd on text the original model wrote instead
of tinyshakespeare (``--samples`` samples of 160 tokens from its BOS at temperature 1: self-data
distillation). Every heal runs in a fresh process: its wall time and peak RSS are its own.

Judged on the three texts of ``../shared/data/other/`` (a licence, Python source, Python's
documentation), none like the healing text: KL(original || model) per predicted token and the
share of the pruned model's KL closed, (KL_pruned - KL_healed) / KL_pruned, and CE, on W windows
of 128 tokens of each (W 16). Written as a markdown table into docs/results/heal-objective.md
(``--out``), with the command, the machine and ``uptime``'s load.

Usage: python benchmarks/bench_heal_objective.py [--real DIR] [--steps S] [--local-steps S_L]
       [--windows W] [--batch-size B] [--samples N] [--cuts a,b] [--only ce,kd,...] [--quick]
       [--json FILE|-] [--out FILE]
       python benchmarks/bench_heal_objective.py --table FILE ... [--out FILE]
  --table: the page from rows saved by earlier runs' --json (runs of one cut each, or of some labels)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, peak_rss_mb, quiet_imports, result, spawn, write_json  # noqa: E402

NAME = "smollm2-135m-instruct"
TEXT = "data/tinyshakespeare.txt"
OTHER = {"licence": "data/other/gpl-3.txt", "source": "data/other/python-argparse.txt",
         "docs": "data/other/python-docs.txt"}
SEQ = 128
COMMON = {"seq_len": SEQ}  # heal's defaults beside: LoRA r 8 on every linear, lr 2e-3, 8 windows a step
#: (cut, label, heal options beyond COMMON and steps); "local" rows take local_steps from the steps
RUNS = [("a", "ce", {"objective": "ce"}), ("a", "kd", {"objective": "kd"}), ("a", "kd+ce", {"objective": "kd+ce"}),
        ("a", "kd from a teacher cache", {"objective": "kd", "teacher_cache": "CACHE", "teacher_k": 64}),
        ("a", "kd on the original's samples", {"objective": "kd", "text": "SAMPLES"}),
        ("b", "ce", {"objective": "ce"}), ("b", "kd", {"objective": "kd"}), ("b", "kd+ce", {"objective": "kd+ce"}),
        ("b", "local + kd", {"objective": "kd", "local_steps": "LOCAL"})]
CUTS = {"a": "prune --layers 6", "b": "minimize prune_units=0.3,by=activation"}
HEADER = """# Healing objective: cross-entropy or distillation from the model before the cut

The command and its options: [heal](../commands/prune-heal.md). `benchmarks/bench_heal_objective.py` (part
of `make bench`) heals two cuts of SmolLM2-135M-Instruct on tinyshakespeare under each objective and
judges each healed model on three texts the heal never saw (a licence, Python source, Python's
documentation: `shared/data/other/` beside the checkout): KL(original || model) per predicted token, with
the share of the unhealed model's KL closed in bold, and CE. Local + kd: blockwise local steps
(`--local-steps`) then global kd steps, as many steps of the same windows in all as kd alone."""


def shared() -> Path:
    """The shared folder beside the checkout (``../shared``), or beside the main checkout of a worktree."""
    for up in (ROOT.parent, ROOT.parent.parent):
        if (up / "shared" / "real-models" / "fetch").is_file():
            return up / "shared"
    raise SystemExit("bench_heal_objective: ../shared/real-models/fetch not found")


def real_model(dest: Path) -> Path:
    """SmolLM2-135M in ``dest``, fetched there by ``../shared/real-models/fetch`` when missing."""
    out = subprocess.run([str(shared() / "real-models" / "fetch"), str(dest), "smollm2"], capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"bench_heal_objective: fetching SmolLM2-135M failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- workers (fresh processes)

def work_cut(args) -> None:
    quiet_imports()
    import normsurgery as ns

    if args.cut == "a":
        ns.prune(args.real, args.dest, {"layers": 6}, text=Path(shared() / TEXT))
    else:
        ns.convert(args.real, args.dest, [("minimize", {"prune_units": 0.3, "by": "activation"})],
                   text=Path(shared() / TEXT))
    result({"cut": args.cut})


def _judge(model_dir: str, original: str, windows: int) -> dict:
    """KL(original || model) and CE of the model (and the original's CE) on ``windows`` windows of each other text."""
    import torch

    import normsurgery as ns
    from normsurgery.core.calibration import tokenize
    from normsurgery.core.calibration import windows as cut_windows
    from normsurgery.core.distillation import mean_kl
    from normsurgery.engine.training import heldout_ce
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(original)
    model, teacher = ns.load(model_dir).eval(), ns.load(original).eval()
    out = {}
    for name, path in OTHER.items():
        ids = cut_windows(tokenize(tok, (shared() / path).read_text()), SEQ, windows, name)
        kl = 0.0
        with torch.no_grad():
            for w in ids.split(4):
                kl += mean_kl(model(input_ids=w).logits[:, :-1], teacher(input_ids=w).logits[:, :-1]) * len(w)
        out[name] = {"kl": kl / len(ids), "ce": heldout_ce(model, ids, 4), "ce_original": heldout_ce(teacher, ids, 4)}
    return out


def work_sample(args) -> None:
    """``--samples`` samples of 160 tokens from the original, each from its BOS token at temperature 1 (seed 0),
    as one text."""
    quiet_imports()
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(args.real), AutoModelForCausalLM.from_pretrained(args.real).eval()
    start, texts, t = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id, [], time.perf_counter()
    torch.manual_seed(0)
    with torch.no_grad():
        for i in range(0, args.samples, 50):
            ids = torch.full((min(50, args.samples - i), 1), start)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=160, min_new_tokens=160, pad_token_id=tok.eos_token_id)
            texts += tok.batch_decode(out[:, 1:], skip_special_tokens=True)
    Path(args.dest).write_text("\n\n".join(texts))
    result({"seconds": time.perf_counter() - t})


def work_judge(args) -> None:
    quiet_imports()
    result(_judge(args.dest, args.real, args.windows))


def work_heal(args) -> None:
    quiet_imports()
    import time

    import normsurgery as ns

    options = json.loads(args.options)
    text = Path(options.pop("text", shared() / TEXT))  # the healing text: tinyshakespeare, or the samples
    t = time.perf_counter()
    report = ns.heal(args.src, args.dest, options, text=text).report
    seconds, peak = time.perf_counter() - t, peak_rss_mb()
    result({"seconds": seconds, "peak_rss_mb": peak, "step_s": report.seconds / report.steps,
            "tokens": report.tokens, "judged": _judge(args.dest, args.real, args.windows)})


# ----------------------------------------------------------------------------- the table

def closed(before: float, after: float) -> str:
    return f"{100 * (before - after) / before:+.1f}%" if before else "n/a"


def _each(judged: dict, key: str) -> str:
    return " / ".join(f"{judged[n][key]:.3f}" for n in OTHER)


def table(rows: list[dict], pruned: dict) -> list[str]:
    names = " / ".join(OTHER)
    lines = [f"| cut | heal | steps x tokens | KL to the original, closed ({names}) | CE ({names}) | s a step | wall s "
             "| peak RSS MB |", "|---|---|---|---|---|---|---|---|"]
    for cut in pruned:
        p = pruned[cut]
        lines.append(f"| ({cut}) {CUTS[cut]} | (not healed) | | KL {_each(p, 'kl')} | {_each(p, 'ce')} (original "
                     f"{_each(p, 'ce_original')}) | | | |")
        for r in (r for r in rows if r["cut"] == cut):
            j, o = r["judged"], r["options"]
            kl = " / ".join(f"{j[n]['kl']:.3f} (**{closed(p[n]['kl'], j[n]['kl'])}**)" for n in OTHER)
            size = f"{o.get('batch_size', 8) * o['seq_len']}"
            when = f"{o['local_steps']} local + {o['steps']} global" if o.get("local_steps") else str(o["steps"])
            lines.append(f"| ({cut}) | {r['label']} | {when} x {size} | {kl} | {_each(j, 'ce')} | {r['step_s']:.2f} "
                         f"| {r['seconds']:.0f} | {r['peak_rss_mb']:.0f} |")
    return lines


def page(measured: list[dict], out: Path) -> None:
    """The results page from the runs' saved data (``--json``'s: machine, load, command, pruned, rows; ``how``
    where the rows were run by hand, a worker at a time)."""
    said = []
    for m in measured:
        load = " ".join(f"{x:.2f}" for x in m["load"])
        how = f" ({m['how']})" if m.get("how") else ""  # runs made by hand, a worker at a time: how
        said.append(f"`{m['command']}`{how} on {m['machine']['cpu']} ({m['machine']['threads']} threads), load at "
                    f"the start {m['machine']['loadavg_start']:.2f}, at the end {load}")
    pruned = {k: v for m in measured for k, v in m["pruned"].items()}
    rows = [r for m in measured for r in m["rows"]]
    out.write_text(f"{HEADER}\n\nMeasured: " + "; ".join(said) + ". SmolLM2-135M-Instruct healed on tinyshakespeare "
                   "at heal's defaults (LoRA r 8 on every linear, lr 2e-3, kd at T 1) but for the steps and tokens "
                   f"a row names; judged on {rows[0]['options']['eval_samples'] if rows else '?'} windows of {SEQ} "
                   "tokens of each of the three other texts. The teacher cache keeps k x (4 + 4) + 4 = 516 bytes per "
                   "token (k 64); its row's s a step reads the stored targets, its wall time includes building "
                   "them.\n\n" + "\n".join(table(rows, pruned)) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("cut", "heal", "judge", "sample"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--real", type=Path, default=Path(os.environ.get("REAL_MODELS",
                                                                     Path.home() / ".cache/normsurgery-real")),
                    help="folder of the fetched real models (default: $REAL_MODELS or ~/.cache/normsurgery-real)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=None, help="local steps of (b)'s local + kd (default steps / 4)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows a step (default heal's, 8)")
    ap.add_argument("--windows", type=int, default=16, help="windows of 128 tokens judged per other text")
    ap.add_argument("--samples", type=int, default=800, help="samples of 160 tokens the original writes (default 800)")
    ap.add_argument("--only", default=None, help="only the runs with these labels (comma-separated)")
    ap.add_argument("--cuts", default="a,b", help="only these cuts (comma-separated: a, b)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, 2 windows, nothing written to docs")
    ap.add_argument("--json", default=None, help="write the rows as JSON to FILE (- for stdout)")
    ap.add_argument("--table", nargs="+", type=Path, help="write the page from these --json files, measuring nothing")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/heal-objective.md")
    ap.add_argument("--cut"), ap.add_argument("--dest"), ap.add_argument("--src"), ap.add_argument("--options")
    args = ap.parse_args()
    if args.worker:
        {"cut": work_cut, "heal": work_heal, "judge": work_judge, "sample": work_sample}[args.worker](args)
        return
    if args.table:
        page([json.loads(f.read_text()) for f in args.table], args.out)
        return
    if args.quick:
        args.steps, args.windows, args.samples = 4, 2, 8
    local = args.local_steps if args.local_steps is not None else max(1, args.steps // 4)
    real = real_model(args.real)
    only = set(args.only.split(",")) if args.only else None
    cuts = [c for c in args.cuts.split(",") if c in CUTS]
    rows, pruned, start = [], {}, machine(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for cut in (c for c in cuts if any(c == r[0] and (only is None or r[1] in only) for r in RUNS)):
            src = Path(tmp) / f"cut-{cut}"
            spawn(__file__, "cut", args.threads, cut=cut, real=real, dest=src)
            pruned[cut] = spawn(__file__, "judge", args.threads, real=real, dest=src, windows=args.windows)
            for label, options in ((lb, o) for c, lb, o in RUNS if c == cut and (only is None or lb in only)):
                options = {**COMMON, "batch_size": args.batch_size, "steps": args.steps,
                           "eval_samples": args.windows, "teacher": str(real), **options}
                if options.get("local_steps") == "LOCAL":
                    options.update(local_steps=local, steps=args.steps - local)
                if options.get("teacher_cache") == "CACHE":
                    options["teacher_cache"] = str(Path(tmp) / f"cache-{cut}")
                if options.get("text") == "SAMPLES":
                    options["text"] = str(Path(tmp) / "samples.txt")
                    sampled = spawn(__file__, "sample", args.threads, real=real, dest=options["text"],
                                    samples=args.samples)
                    print(f"the original's samples: {sampled['seconds']:.0f} s", flush=True)
                dest = Path(tmp) / f"healed-{cut}-{len(rows)}"  # one folder per heal: none replaces another's
                out = spawn(__file__, "heal", args.threads, real=real, src=src, dest=dest, windows=args.windows,
                            options=json.dumps(options))
                rows.append({"cut": cut, "label": label, "options": options, **out})
                print(f"({cut}) {label}: {out['seconds']:.0f} s, peak {out['peak_rss_mb']:.0f} MB", flush=True)
    measured = {"machine": start, "load": os.getloadavg(), "pruned": pruned, "rows": rows,
                "command": "python benchmarks/bench_heal_objective.py " + " ".join(sys.argv[1:])}
    print("\n".join(table(rows, pruned)))
    if args.json:
        write_json(args.json, measured)
    if not args.quick:
        page([measured], args.out)


if __name__ == "__main__":
    main()
