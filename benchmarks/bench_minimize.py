#!/usr/bin/env python
"""Size and forward time of crmsnorm and minimized models against the original (CPU).

On the demo checkpoints (normsurgery/demo/gpt2-tiny, llama-tiny; float32), in memory:
- crmsnorm (GPT-2 only: it needs a LayerNorm model): the stream in d-1 dimensions;
- 50% unstructured magnitude sparsity, then minimize: how many units, heads and channels
  actually go (whole rows or columns must be zero, which unstructured masks rarely make);
- a structured prune of K residual channels (the least-written ones), then minimize;
- both together.
For each: parameters, bytes in memory and on disk (safetensors, saved to a temporary folder),
the forward median (no_grad, batch x seq tokens, interleaved runs after warm-up) and the relative
logit error against its reference (the original for crmsnorm, the masked model otherwise).

Usage: python benchmarks/bench_minimize.py [--json FILE|-] [--repeats N] [--threads N] [--channels K]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import write_json  # noqa: E402

import torch  # noqa: E402
from timing import forward_ms  # noqa: E402

import normsurgery as ns  # noqa: E402
from normsurgery.core.parity import compare, outputs  # noqa: E402

DEMOS = {"gpt2-tiny": ROOT / "normsurgery/demo/gpt2-tiny", "llama-tiny": ROOT / "normsurgery/demo/llama-tiny"}


def variants(family: str, k: int) -> list[tuple[str, dict | None, list]]:
    """(name, mask options or None, passes): the mask makes the reference, the passes shrink it."""
    out = [("original", None, [])]
    if family == "gpt2":
        out.append(("crmsnorm", None, [("crmsnorm", {})]))
    out += [("50% magnitude + minimize", {"sparsity": 0.5}, [("minimize", {})]),
            (f"{k} channels + minimize", {"prune_channels": k}, [("minimize", {})]),
            (f"50% + {k} channels + minimize", {"sparsity": 0.5, "prune_channels": k}, [("minimize", {})])]
    return out


def disk_bytes(model) -> int:
    with tempfile.TemporaryDirectory() as d:
        ns.save(model, Path(d) / "out")
        return sum(f.stat().st_size for f in (Path(d) / "out").glob("*.safetensors"))


def run(demo: str, path: Path, k: int, repeats: int, batch: int, seq: int) -> list[dict]:
    original = ns.load(path, dtype=torch.float32)
    ids = torch.randint(0, original.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    models, rows = {}, []
    for name, mask, passes in variants(original.config.model_type, k):
        reference = copy.deepcopy(original)
        if mask:
            ns.apply_passes(reference, [("mask", mask)])
        model = copy.deepcopy(reference)
        steps = ns.apply_passes(model, passes) if passes else []
        n, b = sum(p.numel() for p in model.parameters()), sum(p.numel() * p.element_size() for p in model.parameters())
        row = {"model": demo, "variant": name, "params": n, "bytes": b, "disk": disk_bytes(model),
               "relative": compare(outputs(reference, ids[:2]), outputs(model, ids[:2])).relative}
        m = steps[-1].metrics if steps else {}
        if "layers" in m:
            row["units"] = sum(w["mlp_units"][0] - w["mlp_units"][1] for w in m["layers"])
            row["heads"] = sum(w["heads"][0] - w["heads"][1] for w in m["layers"])
        if "stream_width" in m:
            row["stream"] = m["stream_width"]
        models[name] = model
        rows.append(row)
    for row, (name, ms) in zip(rows, forward_ms(models, ids, repeats).items()):
        row["forward_ms"] = ms
    base = rows[0]
    for row in rows:
        row["size_ratio"] = row["params"] / base["params"]
        row["time_ratio"] = row["forward_ms"] / base["forward_ms"]
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'model':<11} {'variant':<28} {'params':>10} {'disk MB':>8} {'x size':>7} {'fwd ms':>8} "
            f"{'x time':>7} {'stream':>9} {'units-':>7} {'heads-':>7} {'rel err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        stream = "{}->{}".format(*r["stream"]) if "stream" in r else ""
        lines.append(f"{r['model']:<11} {r['variant']:<28} {r['params']:>10,} {r['disk'] / 1e6:>8.3f} "
                     f"{r['size_ratio']:>7.3f} {r['forward_ms']:>8.2f} {r['time_ratio']:>7.3f} {stream:>9} "
                     f"{r.get('units', ''):>7} {r.get('heads', ''):>7} {r['relative']:>9.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows as JSON to FILE (- for stdout)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--channels", type=int, default=16, help="residual channels to prune (of 128)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for demo, path in DEMOS.items():
        if not (path / "config.json").is_file():
            print(f"skipping {demo}: no checkpoint at {path}")
            continue
        rows += run(demo, path, args.channels, args.repeats, args.batch, args.seq)
    print(f"forward: batch {args.batch} x {args.seq} tokens, {args.threads} threads, median of {args.repeats}; "
          "rel err: max |dlogits| / max |logits| against the reference (original, or the masked model)")
    print(table(rows))
    bad = [r for r in rows if r["relative"] > 1e-5]
    if bad:
        print(f"FAILED: {', '.join(r['variant'] for r in bad)} out of float32 tolerance 1e-5")
    if args.json:
        write_json(args.json, rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
