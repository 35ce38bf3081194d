#!/usr/bin/env python
"""What ``rotate`` buys for 4-bit weights: held-out cross-entropy after round-to-nearest 4-bit
quantization, with and without the rotation, and the stream's outliers before and after.

Per model, four versions of the same function (float32, in memory):
- original: as stored (norm gains in the norms);
- folded: the gains folded into the readers (flashnorm on RMSNorm models, pre-rmsnorm with
  fold=true on LayerNorm ones), the step ``rotate`` needs first;
- rotated (seed k): folded, then ``rotate`` (kind=hadamard, seed=k, k < ``--seeds``): the spread
  over seeds is the noise of the figures; rotated (random): kind=random.
Each is evaluated in float32 on held-out windows (``normsurgery/data/heldout.txt``) and again
after RTN W4: every linear in the blocks quantized per output channel, symmetric,
w -> s * clamp(round(w / s), -8, 7), s = max|w_row| / 7 (embeddings and head kept, as QuaRot and
SpinQuant do). Gap = CE(W4) - CE(float32); ratio = gap / the original's gap (aim: <= 0.5).
A4: weights in float32, and the input of every linear that reads a stream norm (q/k/v, gate/up,
fc1, ...; the head excluded) quantized per token, symmetric 4-bit, x -> s * clamp(round(x / s),
-8, 7), s = max|x_token| / 7: what the stream's outliers cost activation quantization.
Stream: max|h| / RMS(h) per token, averaged over tokens and residual states h_0..h_L
(``analysis.outliers``), on the same windows; kurtosis likewise.

Models: the bundled demos, and SmolLM2-135M when ``--real DIR`` is given or its default fetch
folder (~/.cache/normsurgery-real/smollm2-135m-instruct, ``../shared/real-models/fetch``) exists.

Usage: python benchmarks/bench_rotate.py [--real DIR] [--samples N] [--seq-len L] [--json FILE|-]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import write_json  # noqa: E402

import torch  # noqa: E402

import normsurgery as ns  # noqa: E402
from normsurgery.io.source import Source  # noqa: E402
from normsurgery.core import algebra
from normsurgery.core import analysis
from normsurgery.core import calibration
from normsurgery.engine.training import heldout_ce  # noqa: E402

DEMOS = {"llama-tiny": ROOT / "normsurgery/demo/llama-tiny", "gpt2-tiny": ROOT / "normsurgery/demo/gpt2-tiny"}
REAL = Path.home() / ".cache/normsurgery-real/smollm2-135m-instruct"


def rtn_w4(model) -> None:
    """Every linear in the blocks, in place: per output channel symmetric 4-bit round-to-nearest."""
    blocks = model.get_submodule(ns.layout(model).layers_path)
    for mod in blocks.modules():
        if algebra.is_linear(mod):
            algebra.set_weight(mod, quantized(algebra.weight(mod), 1))


def quantized(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Symmetric 4-bit round-to-nearest along ``dim`` (one scale per slice): s * clamp(round(x / s), -8, 7)."""
    s = (x.abs().amax(dim, keepdim=True) / 7).clamp_min(1e-12)
    return (x / s).round().clamp(-8, 7) * s


@contextlib.contextmanager
def a4_readers(model):
    """While active: the input of every linear reading a stream norm (not the head) quantized per token."""
    lay = ns.layout(model)
    readers = {r for s in lay.norms for r in s.readers if r != lay.head}

    def hook(module, args):
        return (quantized(args[0], -1), *args[1:])

    handles = [model.get_submodule(r).register_forward_pre_hook(hook) for r in readers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def versions(model, seeds: int):
    """(name, model) for the original, folded, rotated (Hadamard, each seed) and rotated (random) versions."""
    fold = [("flashnorm", {})] if ns.layout(model).norm_kinds == {"rmsnorm"} else [("pre-rmsnorm", {"fold": True})]
    yield "original", model
    rotated = [(f"rotated (seed {k})", [("rotate", {"seed": k})]) for k in range(seeds)]
    for name, extra in (("folded", []), *rotated, ("rotated (random)", [("rotate", {"kind": "random"})])):
        new = copy.deepcopy(model)
        ns.apply_passes(new, fold + extra)
        yield name, new


def measure(name: str, path: Path, samples: int, seq_len: int, seeds: int) -> dict:
    source = Source.open(path)
    ids = calibration.tokenize(source.tokenizer, calibration.bundled_text("heldout.txt"))
    windows = calibration.windows(ids, seq_len, samples)
    model = ns.load(path, dtype=torch.float32)
    rows, t = [], time.perf_counter()
    for version, m in versions(model, seeds):
        stats = analysis.outliers(m, windows)
        ce = heldout_ce(m, windows)
        w4 = copy.deepcopy(m)
        rtn_w4(w4)
        ce4 = heldout_ce(w4, windows)
        with a4_readers(m):
            ce_a4 = heldout_ce(m, windows)
        stream = stats["stream"]
        rows.append({"version": version, "ce": ce, "ce_w4": ce4, "gap": ce4 - ce, "gap_a4": ce_a4 - ce,
                     "stream_max_over_rms": sum(s["max_over_rms"] for s in stream) / len(stream),
                     "stream_kurtosis": sum(s["kurtosis"] for s in stream) / len(stream),
                     "weight_max_over_rms": sum(w["max_over_rms"] for w in stats["weights"]) / len(stats["weights"])})
    base, base_a4 = rows[0]["gap"], rows[0]["gap_a4"]
    for r in rows:
        r["gap_ratio"] = r["gap"] / base if base > 0 else None
        r["gap_a4_ratio"] = r["gap_a4"] / base_a4 if base_a4 > 0 else None
    return {"model": name, "path": str(path), "width": ns.layout(model).stream_width, "tokens": windows.numel(),
            "seconds": time.perf_counter() - t, "load_average": os.getloadavg(), "rows": rows}


def show(result: dict) -> None:
    print(f"\n{result['model']} (d = {result['width']}, {result['tokens']} held-out tokens, "
          f"{result['seconds']:.1f} s, load average {' '.join(f'{x:.2f}' for x in result['load_average'])})")
    print(f"{'version':<18}{'CE fp32':>8}{'W4 gap':>8}{'/orig':>7}{'A4 gap':>8}{'/orig':>7}{'max/RMS':>8}"
          f"{'kurt.':>7}{'W max/RMS':>10}")

    def ratio(x):
        return "-" if x is None else f"{x:.2f}x"

    for r in result["rows"]:
        print(f"{r['version']:<18}{r['ce']:>8.4f}{r['gap']:>8.4f}{ratio(r['gap_ratio']):>7}{r['gap_a4']:>8.4f}"
              f"{ratio(r['gap_a4_ratio']):>7}{r['stream_max_over_rms']:>8.2f}{r['stream_kurtosis']:>7.2f}"
              f"{r['weight_max_over_rms']:>10.2f}")
    ratios = [r["gap_ratio"] for r in result["rows"] if r["version"].startswith("rotated (seed")]
    if None not in ratios:
        mean = sum(ratios) / len(ratios)
        print(f"aim: rotated W4 gap <= 0.5 x the original's: {mean:.2f}x (mean of {len(ratios)} Hadamard seeds), "
              f"{'met' if mean <= 0.5 else 'MISSED'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", type=Path, default=None, help="SmolLM2-135M folder (default: the fetch folder, if any)")
    p.add_argument("--samples", type=int, default=32, help="held-out windows (default 32)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--seeds", type=int, default=3, help="Hadamard seeds to rotate with (default 3)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--only", default=None, help="only the models whose name contains this")
    p.add_argument("--json", default=None, help="write the results as JSON to FILE (- for stdout)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = dict(DEMOS)
    real = args.real or (REAL if (REAL / "config.json").is_file() else None)
    if real is not None:
        models["SmolLM2-135M"] = real
    else:
        print("SmolLM2-135M: not fetched (../shared/real-models/fetch, or --real DIR): skipped")
    results = []
    for name, path in models.items():
        if args.only and args.only not in name:
            continue
        results.append(measure(name, path, args.samples, args.seq_len, args.seeds))
        show(results[-1])
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
