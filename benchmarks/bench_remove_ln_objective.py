#!/usr/bin/env python
"""remove-ln's objective: cross-entropy on the text or distillation from the input model.

The demo llama-tiny (a Llama: RMSNorm, gated MLP, GQA), remove-ln at equal steps under each
objective (``objective=ce|kd|kd+ce``: kd the KL to a frozen copy of the pass's input, per token),
trained on the first 300,000 characters of ``../shared/data/tinyshakespeare.txt`` (inside the demo's
training slice), 8 x 128 tokens a step, patience 0 (every step), no control. Judged against the
input on text the pass never trained on: 32 windows of 128 tokens of ``normsurgery/data/heldout.txt``
(held-out Shakespeare) and of the first 60,000 characters of each of ``../shared/data/other/`` (a
licence, Python source, Python's documentation): the CE gap to the input (nats per token) and
KL(input || output) per predicted token.

Usage: python benchmarks/bench_remove_ln_objective.py [--steps S] [--only ce,kd,kd+ce] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_heal_objective import OTHER, SEQ, TEXT, shared  # noqa: E402
from benchmarks.common import machine, quiet_imports  # noqa: E402

SRC = ROOT / "normsurgery/demo/llama-tiny"
TRAIN_CHARS, WINDOWS = 300_000, 32


def logits(model, w):
    import torch
    model.eval()
    with torch.no_grad():
        return torch.cat([model(input_ids=w[i:i + 8], use_cache=False).logits.float() for i in range(0, len(w), 8)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", default="ce,kd,kd+ce")
    p.add_argument("--json")
    args = p.parse_args(argv)
    quiet_imports()
    import torch
    import normsurgery as ns
    from normsurgery.commands.convert import apply_passes
    from normsurgery.core.calibration import tokenize, windows
    from normsurgery.core.distillation import mean_kl
    from normsurgery.core.registry import PassContext
    from normsurgery.engine.training import heldout_ce
    from normsurgery.io.source import Source
    torch.set_num_threads(1)
    tok = Source.open(str(SRC)).tokenizer
    texts = {"shakespeare": (ROOT / "normsurgery/data/heldout.txt").read_text(),
             **{n: (shared() / f).read_text()[:60_000] for n, f in OTHER.items()}}
    evals = {n: windows(tokenize(tok, t), SEQ, WINDOWS, n) for n, t in texts.items()}
    base = ns.load(SRC)
    ref = {n: logits(base, w) for n, w in evals.items()}
    ce0 = {n: heldout_ce(base, w) for n, w in evals.items()}
    rows = []
    for objective in args.only.split(","):
        model, t = copy.deepcopy(base), time.perf_counter()
        opts = {"steps": args.steps, "batch_size": 8, "seq_len": SEQ, "eval_samples": 16, "patience": 0,
                "control": False, "save_every": 0, "objective": objective}
        text = (shared() / TEXT).read_text()[:TRAIN_CHARS]
        m = apply_passes(model, [("remove-ln", opts)], context=PassContext(tokenizer=tok, text=text))[-1].metrics
        row = {"objective": objective, "steps": m["steps"], "seconds": time.perf_counter() - t,
               "pass_ce_delta": m["ce_delta"], **{n: {"ce_gap": heldout_ce(model, w) - ce0[n],
                                                      "kl": mean_kl(logits(model, w)[:, :-1], ref[n][:, :-1])}
                                                  for n, w in evals.items()}}
        rows.append(row)
        print(f"{objective:6} {m['steps']} steps {row['seconds']:.0f} s: " + "; ".join(
            f"{n} CE {row[n]['ce_gap']:+.4f} KL {row[n]['kl']:.4f}" for n in evals), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"input_ce": ce0, "rows": rows, "machine": machine(1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
