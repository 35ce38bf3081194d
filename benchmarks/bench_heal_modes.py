#!/usr/bin/env python
"""heal --train lora | norms | full after ``prune --layers 2`` on the demo Llama, same steps.

For each mode: held-out CE of the original, pruned and healed models (the bundled sample text,
its end held out; the bundled held-out text for evaluation), the fraction of the pruning gap
recovered, (pruned - healed) / (pruned - original), and the trainable parameter count. lora is
the baseline the others are compared with; ``uptime`` load is recorded with the figures.

Usage: python benchmarks/bench_heal_modes.py [--steps S] [--lr X] [--lr-norms X] [--lr-full X] [--json FILE|-]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import write_json  # noqa: E402
from normsurgery.core.options import LEARNING_RATES  # noqa: E402  (no torch: --help stays light)

LLAMA = ROOT / "normsurgery/demo/llama-tiny"
TEXT, HELD = ROOT / "normsurgery/data/sample.txt", ROOT / "normsurgery/data/heldout.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=LEARNING_RATES["lora"], help="learning rate of lora (heal's default)")
    ap.add_argument("--lr-norms", type=float, default=LEARNING_RATES["norms"],
                    help="learning rate of norms (heal's default: few parameters, larger)")
    ap.add_argument("--lr-full", type=float, default=LEARNING_RATES["full"],
                    help="learning rate of full (heal's default: every parameter, smaller)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to FILE (- for stdout)")
    args = ap.parse_args()
    import torch

    import normsurgery as ns
    from normsurgery.commands.heal import HealOptions

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("lora", "norms", "full"):
            lr = {"lora": args.lr, "norms": args.lr_norms, "full": args.lr_full}[mode]
            opts = HealOptions(steps=args.steps, lr=lr, train=mode, batch_size=8, seq_len=64, eval_samples=16)
            r = ns.prune(LLAMA, Path(tmp) / mode, {"layers": 2}, text=TEXT.read_text(), eval_text=HELD.read_text(),
                         heal=opts)
            ce = r.ce
            gap = ce["pruned"] - ce["original"]
            rows.append({"train": mode, "steps": args.steps, "lr": opts.lr, "ce_original": ce["original"],
                         "ce_pruned": ce["pruned"], "ce_healed": ce["healed"],
                         "recovered": (ce["pruned"] - ce["healed"]) / gap if gap else float("nan"),
                         "trainable_parameters": r.heal.trainable_parameters, "seconds": r.heal.seconds})
    load = os.getloadavg()
    base = rows[0]
    print(f"prune --layers 2 on {LLAMA.name}, heal {args.steps} steps of 8 x 64 tokens; uptime load "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'train':<7}{'lr':>8}{'CE orig':>9}{'pruned':>8}{'healed':>8}{'recovered':>10}{'trainable':>11}"
          f"{'x lora':>8}{'seconds':>9}")
    for r in rows:
        print(f"{r['train']:<7}{r['lr']:>8.0e}{r['ce_original']:>9.3f}{r['ce_pruned']:>8.3f}{r['ce_healed']:>8.3f}"
              f"{100 * r['recovered']:>9.0f}%{r['trainable_parameters']:>11}"
              f"{r['trainable_parameters'] / base['trainable_parameters']:>8.3f}{r['seconds']:>9.1f}")
    if args.json:
        write_json(args.json, {"load": load, "rows": rows})


if __name__ == "__main__":
    main()
