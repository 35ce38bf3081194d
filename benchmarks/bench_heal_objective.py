#!/usr/bin/env python
"""heal --objective ce | kd | kd+ce (and local + global) on the real SmolLM2-135M, judged off the healing text.

Two cuts of SmolLM2-135M-Instruct (``../shared/real-models/fetch smollm2``): (a) ``prune --layers 6``
(6 of 30 blocks, scored on the healing text), (b) ``minimize`` with ``prune_units=0.3`` (the mask
then the exact shrink: 30% of every MLP's units). Each is healed on
``../shared/data/tinyshakespeare.txt`` with LoRA r 16 on every linear, lr 1e-3, S steps of 4 x 128
tokens (S 100) under each objective; for (b) also S_L local steps (``local_steps``, blockwise nMSE)
then S - S_L global kd steps: the same number of steps of the same windows as global kd alone
(equal token budget); for (a) also kd from ``--teacher-cache`` (top-64 targets on disk, the teacher
not loaded). Every heal runs in a fresh process: its wall time and peak RSS are its own.

Judged on the three texts of ``../shared/data/other/`` (a licence, Python source, Python's
documentation), none like the healing text: KL(original || model) per predicted token and the
share of the pruned model's KL closed, (KL_pruned - KL_healed) / KL_pruned, and CE, on W windows
of 128 tokens of each (W 16). Written as a markdown table into docs/results/heal-objective.md
(``--out``), with the command, the machine and ``uptime``'s load.

Usage: python benchmarks/bench_heal_objective.py [--real DIR] [--steps S] [--local-steps S_L]
       [--windows W] [--only ce,kd,...] [--quick] [--json FILE|-] [--out FILE]
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
COMMON = {"rank": 16, "lr": 1e-3, "batch_size": 4, "seq_len": SEQ}
#: (cut, label, heal options beyond COMMON and steps); "local" rows take local_steps from the steps
RUNS = [("a", "ce", {"objective": "ce"}), ("a", "kd", {"objective": "kd"}), ("a", "kd+ce", {"objective": "kd+ce"}),
        ("a", "kd from a teacher cache", {"objective": "kd", "teacher_cache": "CACHE", "teacher_k": 64}),
        ("b", "ce", {"objective": "ce"}), ("b", "kd", {"objective": "kd"}), ("b", "kd+ce", {"objective": "kd+ce"}),
        ("b", "local + kd", {"objective": "kd", "local_steps": "LOCAL"})]
CUTS = {"a": "prune --layers 6", "b": "minimize prune_units=0.3"}
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
        ns.convert(args.real, args.dest, [("minimize", {"prune_units": 0.3})])
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


def work_judge(args) -> None:
    quiet_imports()
    result(_judge(args.dest, args.real, args.windows))


def work_heal(args) -> None:
    quiet_imports()
    import time

    import normsurgery as ns

    options = json.loads(args.options)
    t = time.perf_counter()
    ns.heal(args.src, args.dest, options, text=Path(shared() / TEXT))
    seconds, peak = time.perf_counter() - t, peak_rss_mb()
    result({"seconds": seconds, "peak_rss_mb": peak, "judged": _judge(args.dest, args.real, args.windows)})


# ----------------------------------------------------------------------------- the table

def closed(before: float, after: float) -> str:
    return f"{100 * (before - after) / before:+.1f}%" if before else "n/a"


def _each(judged: dict, key: str) -> str:
    return " / ".join(f"{judged[n][key]:.3f}" for n in OTHER)


def table(rows: list[dict], pruned: dict) -> list[str]:
    names = " / ".join(OTHER)
    lines = [f"| cut | heal | steps | KL to the original, closed ({names}) | CE ({names}) | wall s | peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for cut in pruned:
        p = pruned[cut]
        lines.append(f"| ({cut}) {CUTS[cut]} | (not healed) | | KL {_each(p, 'kl')} | {_each(p, 'ce')} (original "
                     f"{_each(p, 'ce_original')}) | | |")
        for r in (r for r in rows if r["cut"] == cut):
            j = r["judged"]
            kl = " / ".join(f"{j[n]['kl']:.3f} (**{closed(p[n]['kl'], j[n]['kl'])}**)" for n in OTHER)
            local = r["options"].get("local_steps")
            when = f"{local} local + {r['options']['steps']} global" if local else str(r["options"]["steps"])
            lines.append(f"| ({cut}) | {r['label']} | {when} | {kl} | {_each(j, 'ce')} | {r['seconds']:.0f} "
                         f"| {r['peak_rss_mb']:.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("cut", "heal", "judge"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--real", type=Path, default=Path(os.environ.get("REAL_MODELS",
                                                                     Path.home() / ".cache/normsurgery-real")),
                    help="folder of the fetched real models (default: $REAL_MODELS or ~/.cache/normsurgery-real)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--local-steps", type=int, default=None, help="local steps of (b)'s local + kd (default steps / 4)")
    ap.add_argument("--windows", type=int, default=16, help="windows of 128 tokens judged per other text")
    ap.add_argument("--only", default=None, help="only the runs with these labels (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, 2 windows, nothing written to docs")
    ap.add_argument("--json", default=None, help="write the rows as JSON to FILE (- for stdout)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/heal-objective.md")
    ap.add_argument("--cut"), ap.add_argument("--dest"), ap.add_argument("--src"), ap.add_argument("--options")
    args = ap.parse_args()
    if args.worker:
        {"cut": work_cut, "heal": work_heal, "judge": work_judge}[args.worker](args)
        return
    if args.quick:
        args.steps, args.windows = 4, 2
    local = args.local_steps if args.local_steps is not None else max(1, args.steps // 4)
    real = real_model(args.real)
    only = set(args.only.split(",")) if args.only else None
    rows, pruned, start = [], {}, machine(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for cut in (c for c in CUTS if any(c == r[0] and (only is None or r[1] in only) for r in RUNS)):
            src = Path(tmp) / f"cut-{cut}"
            spawn(__file__, "cut", args.threads, cut=cut, real=real, dest=src)
            pruned[cut] = spawn(__file__, "judge", args.threads, real=real, dest=src, windows=args.windows)
            for label, options in ((lb, o) for c, lb, o in RUNS if c == cut and (only is None or lb in only)):
                options = {**COMMON, "steps": args.steps, "eval_samples": args.windows, "teacher": str(real),
                           **options}
                if options.get("local_steps") == "LOCAL":
                    options.update(local_steps=local, steps=args.steps - local)
                if options.get("teacher_cache") == "CACHE":
                    options["teacher_cache"] = str(Path(tmp) / f"cache-{cut}")
                dest = Path(tmp) / f"healed-{cut}-{len(rows)}"  # one folder per heal: none replaces another's
                out = spawn(__file__, "heal", args.threads, real=real, src=src, dest=dest, windows=args.windows,
                            options=json.dumps(options))
                rows.append({"cut": cut, "label": label, "options": options, **out})
                print(f"({cut}) {label}: {out['seconds']:.0f} s, peak {out['peak_rss_mb']:.0f} MB", flush=True)
    load = os.getloadavg()
    lines = table(rows, pruned)
    print("\n".join(lines))
    if args.json:
        write_json(args.json, {"machine": start, "load": load, "pruned": pruned, "rows": rows})
    if not args.quick:
        command = "python benchmarks/bench_heal_objective.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            f"{HEADER}\n\nMeasured: `{command}` on {start['cpu']} ({start['threads']} threads), load "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. SmolLM2-135M-Instruct, healed on tinyshakespeare with "
            f"LoRA r 16 on every linear, lr 1e-3, {args.steps} steps of 4 x {SEQ} tokens; judged on {args.windows} windows of {SEQ} tokens of "
            "each of the three other texts. The teacher cache keeps k x (4 + 4) + 4 = 516 bytes per token "
            "(k 64).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
