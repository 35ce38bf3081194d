#!/usr/bin/env python
"""Forward time of prepbn-folded models against the original (and remove-ln's, when registered).

On the demo checkpoints (normsurgery/demo/gpt2-tiny, llama-tiny; float32, CPU), in memory. The
timing depends only on the structure, not on how well the model was trained, so each trained
pass runs a budget that only fixes its structure, on the bundled sample text: prepbn leaves
every norm a NoNorm (y = x), its statistics folded into the readers (which gain biases).
Forward median (no_grad, batch x seq tokens, interleaved runs after a warm-up); ratio = time /
original's time.

Quality (``--quality TEXT``): prepbn at its defaults on TEXT (its last 10% held out) with its
control (``control=true``: the same fine-tune with the norms kept), on the demo models and with
``--held DIR`` the held-back ones (``scripts/make_demo.py --held-back DIR``); prints each model's gap
to the control against the bound (+0.10 nats), per family its mean and worst. ``--summarize
JSON...`` prints the table of earlier runs' ``--json`` files together (6-8 minutes a model on one
thread).

Usage: python benchmarks/bench_prepbn.py [--json FILE|-] [--repeats N] [--threads N]
       python benchmarks/bench_prepbn.py --quality TEXT [--models A,B] [--held DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import DEMOS, print_spread, quality_models, saved_rows, trained_pass, write_json  # noqa: E402

import torch  # noqa: E402
from timing import forward_ms  # noqa: E402

import normsurgery as ns  # noqa: E402
from normsurgery.core import registry  # noqa: E402
from normsurgery.io.source import Source
from normsurgery.core.registry import PassContext  # noqa: E402

BOUND = 0.10  # prepbn's held-out CE over its vanilla control (README)
SAMPLE = ROOT / "normsurgery/data/sample.txt"
#: a budget that only fixes each trained pass's structure (remove-ln needs a step per removal)
SHORT = {"prepbn": {"steps": 2, "batch_size": 2, "seq_len": 32, "eval_samples": 2, "calib_samples": 2,
                    "control": False},
         "remove-ln": {"steps": 40, "batch_size": 1, "seq_len": 32, "eval_samples": 2, "control": False}}


def trained(original, path: Path, name: str):
    """``original`` after the trained pass ``name`` on a token budget that only fixes its structure."""
    p = registry.get(name)
    if p.applies(original, ns.layout(original)):
        return None
    model = copy.deepcopy(original)
    options = {k: v for k, v in SHORT[name].items() if k in p.options}
    ctx = PassContext(tokenizer=Source.open(path).tokenizer, text=SAMPLE.read_text())
    ns.apply_passes(model, [(name, options)], context=ctx)
    return model.eval()


def run(demo: str, path: Path, repeats: int, batch: int, seq: int) -> list[dict]:
    original = ns.load(path, dtype=torch.float32)
    models = {"original": original}
    for name in ("prepbn", "remove-ln"):
        if name in {p.name for p in registry.all_passes()}:
            model = trained(original, path, name)
            if model is not None:
                models[name] = model
    ids = torch.randint(0, original.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ms = forward_ms(models, ids, repeats)
    return [{"model": demo, "variant": name, "forward_ms": ms[name], "ratio": ms[name] / ms["original"],
             "params": sum(p.numel() for p in m.parameters())} for name, m in models.items()]


def quality(path: Path, name: str, family: str, text: str, options: dict) -> dict:
    """prepbn with ``options`` (else its defaults) and its control on ``text``: the row of the quality table."""
    _, m, wall = trained_pass(path, "prepbn", text, {**options, "control": True})
    row = {"model": name, "family": family, "options": options, "wall_seconds": wall, **{k: m[k] for k in (
        "ce_before", "ce_after", "ce_control", "gap_to_control", "steps", "tokens", "seconds", "control_seconds")}}
    print(f"{name}: held-out CE {m['ce_before']:.4f} -> {m['ce_after']:.4f}, control {m['ce_control']:.4f}: "
          f"gap {m['gap_to_control']:+.4f} ({m['steps']} steps, {m['tokens']} tokens, {wall:.0f} s)", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows as JSON to FILE (- for stdout)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--quality", metavar="TEXT", help="held-out CE against the control on TEXT (minutes per model)")
    ap.add_argument("--models", default=",".join(DEMOS), help="demo models or folders, comma-separated")
    ap.add_argument("--held", metavar="DIR", help="also every held-back model under DIR (with --quality)")
    ap.add_argument("--steps", type=int, help="with --quality: the step budget (default: the pass's)")
    ap.add_argument("--lr", type=float, help="with --quality: the learning rate (default: the pass's)")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the quality table of earlier --json files")
    ap.add_argument("--options", default="", metavar="K=V,...",
                    help="more options of the pass, as after prepbn: (e.g. final_aux=3.0)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    title = "prepbn: held-out CE minus the control's"
    if args.summarize:
        print_spread(title, saved_rows(args.summarize), "gap_to_control", BOUND)
        return 0
    if args.quality:
        text = Path(args.quality).read_text()
        options = {k: v for k, v in (("steps", args.steps), ("lr", args.lr)) if v is not None}
        options.update(registry.parse_pass("prepbn:" + args.options)[1])
        rows = [quality(path, name, family, text, options)
                for name, family, path in quality_models(args.models, args.held)]
        print_spread(title, rows, "gap_to_control", BOUND)
        if args.json:
            write_json(args.json, rows)
        return 0
    rows = [r for demo, path in DEMOS.items() for r in run(demo, path, args.repeats, args.batch, args.seq)]
    print(f"forward time, batch {args.batch} x {args.seq} tokens, {args.threads} threads, median of {args.repeats}")
    print(f"{'model':<12} {'variant':<10} {'params':>10} {'forward ms':>11} {'ratio':>7}")
    for r in rows:
        print(f"{r['model']:<12} {r['variant']:<10} {r['params']:>10,} {r['forward_ms']:>11.2f} {r['ratio']:>7.3f}")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
