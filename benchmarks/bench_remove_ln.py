#!/usr/bin/env python
"""remove-ln: forward time of the norm-free model against the original, training tokens/s;
with ``--quality``, held-out CE before/after on the demo models against a plain fine-tune.

Speed (default, ``make bench``): for each demo model, ``--steps`` steps of remove-ln on the
bundled text (too few to keep quality: this times the loop), then the forward time of B x T
tokens through the original and the norm-free model (median of 5, one process, 2 threads).

Quality (``--quality TEXT``): the pass with its defaults (or --steps/--lr/--batch) on TEXT, its
last 10% held out, and its control (the pass's own ``control=true``: the same fine-tune with the
norms untouched). Prints the per-stage curve and the gap to the control against the bound (+0.05
nats), per family its mean and worst; ``--held DIR`` adds the held-back models
(``scripts/make_demo.py --held-back DIR``), ``--summarize JSON...`` prints the table of earlier
runs' ``--json`` files together (a model takes 7-15 minutes on one thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import DEMOS, print_spread, quality_models, saved_rows, trained_pass, write_json  # noqa: E402

BOUND = 0.05  # remove-ln's held-out CE over its vanilla control (README; Heimersheim 2024)


def forward_seconds(model, ids, repeats: int = 5) -> float:
    import torch

    times = []
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        for _ in range(repeats):
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quality", metavar="TEXT", help="measure held-out CE on TEXT (minutes per model)")
    p.add_argument("--models", default=",".join(DEMOS), help="demo models or folders, comma-separated")
    p.add_argument("--held", metavar="DIR", help="also every held-back model under DIR (with --quality)")
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="print the quality table of earlier --json files")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--batch", type=int)
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--options", default="", metavar="K=V,...",
                   help="more options of the pass, as after remove-ln: (e.g. keep=final, final_aux=0.1)")
    p.add_argument("--patience", type=int, help="stop once held-out CE stops improving (--steps: the cap)")
    p.add_argument("--eval-samples", type=int, default=64, help="held-out windows (the pass's default: 32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results as JSON to FILE")
    args = p.parse_args(argv)
    if args.summarize:
        print_spread("remove-ln: held-out CE minus the control's", saved_rows(args.summarize), "gap_to_control", BOUND)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    from normsurgery.io.loader import load
    from normsurgery.core.registry import parse_pass

    results = []
    for name, family, path in quality_models(args.models, args.held if args.quality else None):
        if args.quality:
            text = Path(args.quality).read_text()
            opts = {k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("batch_size", args.batch),
                                      ("eval_samples", args.eval_samples), ("control", not args.no_control),
                                      ("patience", args.patience)) if v is not None}
            opts.update(parse_pass("remove-ln:" + args.options)[1])
            model, m, wall = trained_pass(path, "remove-ln", text, opts)
            row = {"model": name, "family": family, "options": opts, "wall_seconds": wall, **{k: m[k] for k in (
                "ce_before", "ce_after", "ce_delta", "steps", "tokens", "seconds", "schedule", "curve",
                "fold_error_float64", "fold_error_float32", "stages", "kept")},
                   "loadavg": os.getloadavg(), **{k: m[k] for k in ("final_positions",) if k in m}}
            if "ce_control" in m:
                row["control"] = {"ce_after": m["ce_control"], "seconds": m["control_seconds"]}
                row["gap_to_control"] = m["gap_to_control"]
            print(f"\n{name}: held-out CE {m['ce_before']:.4f} -> {m['ce_after']:.4f} ({m['ce_delta']:+.4f}) "
                  f"in {m['steps']} steps, {m['tokens']} tokens, {m['seconds']:.0f} s training "
                  f"({wall:.0f} s in all); schedule {m['schedule']}")
            if "control" in row:
                c = row["control"]["ce_after"]
                print(f"  control (same fine-tune, norms kept): {c:.4f} ({c - m['ce_before']:+.4f}); "
                      f"remove-ln vs control {m['ce_after'] - c:+.4f}")
            print(f"  {'step':>5} {'tokens':>8} {'stage':<11}{'removed':>8} {'loss':>7} {'held-out CE':>12}")
            for r in m["curve"]:
                loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
                print(f"  {r['step']:>5} {r['tokens']:>8} {r.get('stage', '-'):<11}{r.get('removed', '-'):>8} "
                      f"{loss:>7} {r['heldout_ce']:>12.4f}"
                      + (f"  aux {r['final_aux_loss']:.5f}" if "final_aux_loss" in r else ""))
            print("  stages: " + "; ".join(f"{st['stage']} {st['from']}-{st['to']}" + (
                "" if st["heldout_ce"] is None else f": {st['heldout_ce']:.4f}") for st in m["stages"]))
            for when, ces in m.get("final_positions", {}).items():
                print(f"  held-out CE by predicting position, {when} the final stage: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in ces.items()))
            print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        else:
            text = (ROOT / "normsurgery/data/sample.txt").read_text()
            steps = args.steps or 40  # llama-tiny has 26 removals to schedule
            original = load(path)
            model, m, wall = trained_pass(path, "remove-ln", text, {"steps": steps, "batch_size": args.batch or 8,
                                                   "eval_samples": 2, "save_every": 0, "control": False})
            ids = torch.randint(0, original.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))
            t0, t1 = forward_seconds(original, ids), forward_seconds(model.eval(), ids)
            row = {"model": name, "forward_original_s": t0, "forward_norm_free_s": t1, "ratio": t1 / t0,
                   "train_tokens_per_second": m["tokens"] / m["seconds"], "steps": steps}
        results.append(row)
    if args.quality and not args.no_control:
        print_spread("remove-ln: held-out CE minus the control's", results, "gap_to_control", BOUND)
    if not args.quality:
        print(f"remove-ln speed, {args.threads} threads: forward of 8 x 128 tokens (median of 5), training loop")
        print(f"{'model':<12}{'original ms':>12}{'norm-free ms':>13}{'ratio':>7}{'train tokens/s':>16}")
        for r in results:
            print(f"{r['model']:<12}{1e3 * r['forward_original_s']:>12.1f}{1e3 * r['forward_norm_free_s']:>13.1f}"
                  f"{r['ratio']:>7.2f}{r['train_tokens_per_second']:>16.0f}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
