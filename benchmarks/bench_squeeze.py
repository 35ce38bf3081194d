#!/usr/bin/env python
"""squeeze (N cycles of mask -> minimize -> release -> retrain) against one-shot (one cycle:
mask to the target, minimize, release, retrain) at the same size and the same training tokens.

For each demo model and target (a fraction of the parameters): held-out CE of the original and of
each result, the parameters reached and the wall time. Training text: the training slice (first
90%) of ../shared/data/tinyshakespeare.txt, the text the demo models were trained on (else the
bundled sample); held-out CE on the bundled held-out text, from the last 10%, never trained on.
One-shot is squeeze with ``--cycles 1`` and all the steps in its one retraining, so the two differ
only in the cycling. ``uptime`` load is recorded. ``--held DIR`` adds the held-back models
(``scripts/make_demo.py --held-back DIR``); the summary gives, per family, the mean and worst of
each result's CE over the original at the 50% target (bound +0.15) and of squeeze over one-shot.
``--summarize JSON...`` prints it for earlier runs' ``--json`` files together.

Usage: python benchmarks/bench_squeeze.py [--models llama-tiny,gpt2-tiny] [--held DIR] [--targets 0.5,0.25]
       [--cycles N] [--steps S] [--lr X] [--sparsity X] [--train full] [--structure LIST] [--how WHICH]
       [--text FILE] [--json FILE|-]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import print_spread, quality_models, saved_rows, write_json  # noqa: E402

SAMPLE, HELD = ROOT / "normsurgery/data/sample.txt", ROOT / "normsurgery/data/heldout.txt"
SHAKESPEARE = ROOT.parent / "shared/data/tinyshakespeare.txt"
BOUND = 0.15  # squeeze at 50% of the parameters: held-out CE over the original's (README)


def summarize(rows: list[dict]) -> None:
    """Each result's CE over the original at the 50% target against the bound, and squeeze's CE
    over one-shot's at every target (negative: the cycles won), per family mean and worst."""
    for how in ("one-shot", "squeeze"):
        at = [{**r, "vs_original": r["ce"] - r["ce_original"]} for r in rows if r["how"] == how and r["target"] == 0.5]
        if at:
            print_spread(f"{how} at 50%: held-out CE minus the original's", at, "vs_original", BOUND)
    pairs = {(r["model"], r["target"], r["how"]): r for r in rows}
    for target in sorted({r["target"] for r in rows}, reverse=True):
        won = [{"model": m, "family": pairs[m, t, "squeeze"].get("family", Path(m).name),
                "squeeze_minus_one_shot": pairs[m, t, "squeeze"]["ce"] - pairs[m, t, "one-shot"]["ce"]}
               for m, t, how in pairs if how == "one-shot" and t == target and (m, t, "squeeze") in pairs]
        if won:
            print_spread(f"squeeze minus one-shot at {target:.0%} (same size and tokens; negative: squeeze wins)",
                         won, "squeeze_minus_one_shot", 0.0)


def training_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): FILE, else the training slice of tiny Shakespeare, else the sample."""
    if path:
        return Path(path).read_text(), path
    if SHAKESPEARE.is_file():
        text = SHAKESPEARE.read_text()
        return text[:len(text) - round(0.1 * len(text))], f"{SHAKESPEARE.name}, first 90%"
    return SAMPLE.read_text(), SAMPLE.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-tiny,gpt2-tiny", help="demo models or folders, comma-separated")
    ap.add_argument("--held", metavar="DIR", help="also every held-back model under DIR")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the summary of earlier --json files")
    ap.add_argument("--targets", default="0.5,0.25")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="retraining steps per cycle (one-shot: cycles x steps)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--sparsity", type=float, default=None)
    ap.add_argument("--release-scale", type=float, default=None)
    ap.add_argument("--train", default=None)
    ap.add_argument("--structure", default=None, help="e.g. units,heads (default: squeeze's)")
    ap.add_argument("--how", default="one-shot,squeeze", help="which of one-shot, squeeze to run")
    ap.add_argument("--text", default=None, help="training text (default: see above)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to FILE (- for stdout)")
    args = ap.parse_args()
    if args.summarize:
        summarize(saved_rows(args.summarize))
        return
    import torch

    import normsurgery as ns

    torch.set_num_threads(1)
    common = {k: v for k, v in {"lr": args.lr, "sparsity": args.sparsity, "release_scale": args.release_scale,
                                "train": args.train,
                                "structure": args.structure and tuple(args.structure.split(","))}.items()
              if v is not None}
    common.update(batch_size=8, seq_len=64, eval_samples=16, control=False)  # one-shot runs as its own row
    text, text_name = training_text(args.text)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, family, path in quality_models(args.models, args.held):
            for target in map(float, args.targets.split(",")):
                for how, cycles in (("one-shot", 1), ("squeeze", args.cycles)):
                    if how not in args.how.split(","):
                        continue
                    opts = {**common, "target": target, "cycles": cycles,
                            "steps_per_cycle": args.steps * args.cycles // cycles}
                    r = ns.squeeze(path, Path(tmp) / f"{model.replace('/', '-')}-{target}-{how}",
                                   text=text, eval_text=HELD.read_text(), options=opts)
                    last = r.cycles[-1]
                    rows.append({"model": model, "family": family, "target": target, "how": how, "cycles": cycles,
                                 "params": last.params, "params_original": r.original["params"],
                                 "ce_original": r.original["ce"], "ce": last.ce_after,
                                 "tokens": sum(c.tokens for c in r.cycles), "seconds": r.seconds,
                                 "per_cycle": [[c.params, c.ce_masked, c.ce_after, c.minimize_relative]
                                               for c in r.cycles]})
                    print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()
    print(f"\nsqueeze vs one-shot, {args.cycles} cycles x {args.steps} steps "
          f"(one-shot: 1 x {args.cycles * args.steps}) "
          f"of 8 x 64 tokens, trained on {text_name}, options {common}; "
          f"uptime load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'model':<20}{'target':>7}{'how':>10}{'params':>10}{'CE orig':>9}{'CE':>8}{'vs orig':>9}{'tokens':>9}"
          f"{'seconds':>9}")
    for r in rows:
        print(f"{r['model']:<20}{r['target']:>7.2f}{r['how']:>10}{r['params']:>10,}{r['ce_original']:>9.3f}"
              f"{r['ce']:>8.3f}{r['ce'] - r['ce_original']:>+9.3f}{r['tokens']:>9,}{r['seconds']:>9.1f}")
    summarize(rows)
    if args.json:
        write_json(args.json, {"load": load, "text": text_name, "options": common, "rows": rows})


if __name__ == "__main__":
    main()
