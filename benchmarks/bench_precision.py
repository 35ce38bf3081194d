"""Calibration of the half-precision checks on real checkpoints: exact conversions and re-rounded
copies must pass ``verify``; perturbations of known size must fail it.

For each model (Gemma-3-270M and Qwen2.5-Coder-0.5B as stored, bf16; SmolLM2-135M cast to bf16),
from ``../shared/real-models/fetch`` (``--real DIR`` holds them):

- ``flashnorm``: ``convert IN OUT --pass flashnorm`` (its own checks: the rewrite before the cast
  and the cast), then ``verify IN OUT``;
- ``re-rounded``: every weight nudged by a uniform fraction of +-1 ulp and rounded to nearest
  (about half the entries move by one ulp; zeros stay): a copy that differs by rounding alone;
- known changes: one norm's gain x1.02 (block 3's pre-MLP norm; Gemma's post-attention output
  norm), 1% per-channel noise on every pre-MLP norm, the final norm's gain x1.02, x1.05, x1.10,
  5% per-channel noise on every pre-MLP norm, and block 3's MLP weights shifted by one ulp toward
  +inf (every nonzero entry);
- the smallest final-gain change detected, from x1.002 up.

Gemma's gains are stored as w in (1 + w): a gain x f is stored as (1 + w) f - 1. Prints a
markdown table (``--json`` for the rows); run with the machine otherwise idle and give the load
average with the figures.

    python benchmarks/bench_precision.py --real DIR [--models gemma3,qwen2.5,smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import normsurgery as ns  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"gemma3": "gemma3-270m", "qwen2.5": "qwen2.5-coder-0.5b-instruct", "smollm2": "smollm2-135m-instruct"}
PRE_MLP = {"gemma3": "pre_feedforward_layernorm", "qwen2.5": "post_attention_layernorm",
           "smollm2": "post_attention_layernorm"}
ONE_NORM = {"gemma3": "layers.3.post_attention_layernorm.weight", "qwen2.5": "layers.3.post_attention_layernorm.weight",
            "smollm2": "layers.3.post_attention_layernorm.weight"}
FINAL_STEPS = (1.002, 1.005, 1.01, 1.02, 1.05)


def bf16_input(name: str, real: Path, work: Path) -> Path:
    """The checkpoint as users hold it in bf16 (SmolLM2 is stored in float32: cast, tokenizer kept)."""
    src = real / MODELS[name]
    if name != "smollm2":
        return src
    out = work / "smollm2-bf16"
    if not out.exists():
        shutil.copytree(src, out)
        for f in out.glob("*.safetensors"):
            sd = load_file(f)
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}, f,
                      metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def variant(src: Path, out: Path, change) -> Path:
    """A copy of ``src`` with ``change(state dict, generator)`` applied to its weights."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        sd = load_file(f)
        change(sd, g)
        save_file(sd, f, metadata={"format": "pt"})
    return out


def gain(offset: float, keys, factor):
    """Multiply the gains of ``keys`` (a suffix match) by ``factor`` (a number, or a function of the
    shape giving per-channel factors), stored as w with an ``offset`` (Gemma: 1)."""
    def change(sd, g):
        for k in [k for k in sd if any(k.endswith(x) for x in keys)]:
            w = sd[k].float()
            f = factor(w.shape, g) if callable(factor) else factor
            sd[k] = ((offset + w) * f - offset).to(sd[k].dtype)
    return change


def noise(scale):
    return lambda shape, g: 1 + scale * torch.randn(shape, generator=g)


def ulp_up(block: int):
    """Every nonzero entry of block ``block``'s MLP weights moved one ulp toward +inf."""
    def change(sd, g):
        for k in [k for k in sd if f"layers.{block}.mlp." in k and sd[k].is_floating_point()]:
            sd[k] = torch.where(sd[k] == 0, sd[k], _next(sd[k]))
    return change


def _next(t: torch.Tensor) -> torch.Tensor:
    """The next value of ``t``'s (16-bit) dtype above each entry: bit pattern + 1 for positives,
    - 1 for negatives."""
    bits = t.view(torch.int16)
    return torch.where(t > 0, bits + 1, bits - 1).view(t.dtype)


def rerounded(sd, g):
    for k, t in sd.items():
        if t.is_floating_point():
            x = t.float()
            info = torch.finfo(t.dtype)
            ulp = torch.ldexp(torch.full_like(x, info.eps), torch.frexp(x).exponent - 1)
            u = (torch.rand(x.shape, generator=g) * 2 - 1) * ulp
            sd[k] = torch.where(t == 0, t, (x + u).to(t.dtype))


def row(model: str, case: str, c, seconds: float) -> dict:
    return {"model": model, "case": case, "relative": c.relative, "kl": c.kl, "top1": c.top1,
            "tolerance": c.tolerance, "kl_tolerance": c.kl_tolerance, "null_relative": (c.null or {}).get("relative"),
            "null_kl": (c.null or {}).get("kl"), "same": c.ok, "failed": c.failed, "seconds": round(seconds, 1)}


def run(name: str, real: Path, work: Path) -> list[dict]:
    src = bf16_input(name, real, work)
    gemma = name == "gemma3"
    offset = 1.0 if gemma else 0.0
    final = ["model.norm.weight"]
    rows = []

    def check(case: str, other: Path):
        t0 = time.perf_counter()
        c = ns.verify(src, other, generate=0)
        rows.append(row(name, case, c, time.perf_counter() - t0))
        print(json.dumps(rows[-1]), flush=True)
        return c

    t0 = time.perf_counter()
    out = work / f"{name}-flashnorm"
    r = ns.convert(src, out, [("flashnorm", {})], force=True)
    step = r.steps[0].parity
    rows.append({**row(name, "convert --pass flashnorm: the rewrite before the cast (float32)", step, 0),
                 "seconds": None})
    rows.append(row(name, "convert --pass flashnorm: the written folder vs the rewrite before the cast", r.parity,
                    time.perf_counter() - t0))
    print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
    check("verify IN flashnorm-output", out)
    check("re-rounded copy (about half the entries one ulp away)", variant(src, work / f"{name}-rr", rerounded))
    cases = [("one norm's gain x1.02", gain(offset, [ONE_NORM[name]], 1.02)),
             ("1% per-channel noise on every pre-MLP norm", gain(offset, [f"{PRE_MLP[name]}.weight"], noise(0.01))),
             ("5% per-channel noise on every pre-MLP norm", gain(offset, [f"{PRE_MLP[name]}.weight"], noise(0.05))),
             ("final gain x1.10", gain(offset, final, 1.10)),
             ("block 3's MLP weights one ulp up", ulp_up(3))]
    for case, change in cases:
        check(case, variant(src, work / f"{name}-x", change))
    for f in FINAL_STEPS:
        c = check(f"final gain x{f}", variant(src, work / f"{name}-x", gain(offset, final, f)))
        if not c.ok:
            break
    return rows


def table(rows: list[dict]) -> str:
    def e(x):
        return "-" if x is None else f"{x:.1e}"
    lines = ["| model | case | relative (tolerance) | KL (tolerance) | top-1 | rounding alone: relative, KL "
             "| verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = "-" if r["top1"] is None else f"{r['top1']:.4f}"
        lines.append(f"| {r['model']} | {r['case']} | {e(r['relative'])} ({e(r['tolerance'])}) | {e(r['kl'])} "
                     f"({e(r['kl_tolerance'])}) | {top1} | "
                     f"{e(r['null_relative'])}, {e(r['null_kl'])} | "
                     f"{'same' if r['same'] else 'DIFFERENT: ' + r['failed']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", type=Path, default=Path(os.environ.get("REAL_MODELS", ROOT / ".real-models")),
                    help="folder holding the checkpoints (folders named as MODELS; default: $REAL_MODELS or "
                         ".real-models)")
    ap.add_argument("--models", default="gemma3,qwen2.5,smollm2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    missing = [MODELS[m] for m in args.models.split(",") if not (args.real / MODELS[m] / "config.json").is_file()]
    if missing:  # make bench runs every benchmark: say what this one needs instead of failing the rest
        print(f"SKIPPED: {', '.join(missing)} not found in {args.real} (give --real DIR holding them)")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += run(name, args.real, Path(tmp))
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
