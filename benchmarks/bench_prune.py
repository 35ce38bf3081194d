#!/usr/bin/env python
"""prune scoring cost per calibration token and heal throughput, with peak memory (CPU or GPU).

Each measurement runs in a fresh subprocess (so peak RSS, ``ru_maxrss``, is its own; shown whole
and above the RSS after imports and loading; on a GPU also torch's peak allocated memory):

1. score: ``prune.score_layers`` on W windows of T tokens, against a plain no-grad forward of
   the same batch (the hooks keep L+1 residual states; the cosines are a per-token
   (L+1) x (L+1) Gram matrix in float64). Reported per calibration token.
2. heal: ``heal.heal_model`` for S optimizer steps of B x T tokens (LoRA rank 8 on every linear
   in the blocks), trained tokens per second (evaluation excluded).

Models: the demo checkpoints (8 layers, d=128) and a random Llama of GPT-2-small size
(12 layers, d=768) for the scoring cost at a realistic width.

Usage: python benchmarks/bench_prune.py [--json FILE|-] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import peak_rss_mb, result, spawn as spawn_worker  # noqa: E402

DEMOS = {"gpt2-tiny": "normsurgery/demo/gpt2-tiny", "llama-tiny": "normsurgery/demo/llama-tiny"}
WIDE = "llama-768x12 (random)"


def build(name: str, device: str):
    import torch
    import transformers as T

    from normsurgery.io.loader import load

    if name == WIDE:
        torch.manual_seed(0)
        cfg = T.LlamaConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                            intermediate_size=2048, vocab_size=8192, max_position_embeddings=512)
        model = T.AutoModelForCausalLM.from_config(cfg).eval()
    else:
        model = load(ROOT / DEMOS[name])
    return model.to(device)


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import accelerate  # noqa: F401  (imported before the baseline RSS, like everything heal uses)
    import peft  # noqa: F401

    from normsurgery.commands.heal import HealOptions, heal_model, make_accelerator
    from normsurgery.commands.prune import score_layers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args.model, device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    base = peak_rss_mb()  # the peak once loaded
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = {"model": args.model, "device": device, "layers": model.config.num_hidden_layers,
           "hidden": model.config.hidden_size, "rss_loaded_mb": base}
    if args.worker == "score":
        ids = torch.randint(0, vocab, (args.windows, args.seq), generator=g)
        with torch.no_grad():
            model(input_ids=ids[: args.batch].to(device), use_cache=False)  # warm-up
            t = time.perf_counter()
            for s in range(0, len(ids), args.batch):
                model(input_ids=ids[s:s + args.batch].to(device), use_cache=False)
            if device == "cuda":
                torch.cuda.synchronize()
            forward = time.perf_counter() - t
        scores = score_layers(model, ids, batch_size=args.batch)
        out.update(tokens=scores.tokens, seconds=scores.seconds, forward_seconds=forward,
                   us_per_token=1e6 * scores.seconds / scores.tokens,
                   forward_us_per_token=1e6 * forward / scores.tokens)
    else:
        train = torch.randint(0, vocab, (50_000,), generator=g)
        held = torch.randint(0, vocab, (2, args.seq), generator=g)
        acc = make_accelerator("auto", device)  # where the model is
        opts = HealOptions(steps=args.steps, seq_len=args.seq, batch_size=args.batch)
        _, report = heal_model(model, train, held, opts, accelerator=acc)
        out.update(tokens=report.tokens, seconds=report.seconds, tokens_per_second=report.tokens_per_second,
                   steps=report.steps, precision=report.mixed_precision,
                   trainable_parameters=report.trainable_parameters)
    out["peak_rss_mb"] = peak_rss_mb()
    if device == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def spawn(kind: str, model: str, args, **sizes) -> dict:
    return spawn_worker(__file__, kind, args.threads, model=model, **sizes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the results as JSON to FILE (- for stdout)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument("--worker", choices=["score", "heal"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    for k, v in (("windows", 32), ("seq", 128), ("batch", 8), ("steps", 20)):
        p.add_argument(f"--{k}", type=int, default=v, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result(worker(args))
        return 0
    q = args.quick
    score = [spawn("score", m, args, windows=8 if q else 32, seq=128, batch=8) for m in DEMOS]
    score.append(spawn("score", WIDE, args, windows=2 if q else 8, seq=256, batch=4))
    heal = [spawn("heal", m, args, steps=3 if q else 20, seq=128, batch=8) for m in DEMOS]
    print(f"prune scoring (score_layers), {args.threads} threads, device {score[0]['device']}")
    print(f"{'model':<24}{'layers x d':>11}{'tokens':>8}{'score s':>9}{'us/token':>10}{'forward us/token':>18}"
          f"{'ratio':>7}{'peak RSS MB':>13}{'above loaded':>14}")
    for r in score:
        print(f"{r['model']:<24}{r['layers']:>5} x {r['hidden']:<4}{r['tokens']:>8}{r['seconds']:>9.2f}"
              f"{r['us_per_token']:>10.1f}{r['forward_us_per_token']:>18.1f}"
              f"{r['us_per_token'] / r['forward_us_per_token']:>7.2f}{r['peak_rss_mb']:>13.0f}"
              f"{r['peak_rss_mb'] - r['rss_loaded_mb']:>14.0f}" + (f"  cuda peak {r['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in r else ""))
    print(f"\nheal (heal_model, LoRA r=8 on every block linear), {args.threads} threads")
    print(f"{'model':<24}{'steps':>6}{'tokens':>8}{'train s':>9}{'tokens/s':>10}{'precision':>10}"
          f"{'peak RSS MB':>13}{'above loaded':>14}")
    for r in heal:
        print(f"{r['model']:<24}{r['steps']:>6}{r['tokens']:>8}{r['seconds']:>9.2f}{r['tokens_per_second']:>10.0f}"
              f"{r['precision']:>10}{r['peak_rss_mb']:>13.0f}{r['peak_rss_mb'] - r['rss_loaded_mb']:>14.0f}"
              + (f"  cuda peak {r['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in r else ""))
    if args.json:
        text = json.dumps({"score": score, "heal": heal}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
