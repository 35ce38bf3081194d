#!/usr/bin/env python
"""Peak host memory per process of ``heal --train full`` at 1 process and at 2 processes sharded
with FSDP2 (gloo, CPU), on a Llama whose weights dominate the imports.

The model: a random Llama (d 1024, 16 blocks, MLP 2816, the demo's 1024-token vocabulary and
tokenizer; about 0.2 B parameters, 0.8 GB in float32) written once. Each run is a fresh process
tree (``torchrun``); its peak RSS is the largest high-water mark of its processes (the main one
under FSDP: it reads the weights and gathers them back). A full fine-tune of one process holds
the weights, their gradients and AdamW's two moments (4 x the weights); two sharded processes
hold half of each. Target (issue 38): 2 processes below 0.7 x the 1-process peak.

Usage: python benchmarks/bench_fsdp.py [--quick] [--json FILE] [--keep]
(``--quick``: a d 256 model, to check the script itself.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "normsurgery/demo/llama-tiny"
SAMPLE = ROOT / "normsurgery/data/sample.txt"
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
# runs a command and prints the largest peak RSS (MiB) of the processes it waited for
PEAK = "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); " \
       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024); sys.exit(rc)"


def make_model(folder: Path, hidden: int, layers: int, mlp: int) -> int:
    """A random Llama with the demo's tokenizer in ``folder``; its parameter count."""
    import torch
    import transformers as T

    cfg = T.LlamaConfig.from_pretrained(DEMO)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size = hidden, layers, mlp
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = hidden // 64, hidden // 128, 64
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    for f in DEMO.glob("*token*"):
        shutil.copy2(f, folder / f.name)
    return sum(p.numel() for p in model.parameters())


def run(model: Path, out: Path, procs: int) -> dict:
    """``heal --train full`` under torchrun with ``procs`` processes (sharded when 2): peak RSS,
    wall time, held-out CE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    batch = 4 // procs
    cmd = [sys.executable, "-c", PEAK, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
           str(procs), "--master_port", port, "-m", "normsurgery", "heal", str(model), str(out), "--text",
           str(SAMPLE), "--train", "full", "--steps", "2", "--seq-len", "32", "--batch-size", str(batch),
           "--eval-samples", "2", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           **(FSDP if procs > 1 else {})}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    report_text, peak = r.stdout.rsplit("\n", 2)[0], float(r.stdout.split()[-1])
    heal = json.loads(report_text)["heal"]
    return {"processes": procs, "sharded": procs > 1, "peak_rss_mib": round(peak), "seconds":
            round(time.perf_counter() - t0, 1), "ce_before": heal["ce_before"], "ce_after": heal["ce_after"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-fsdp-"))
    try:
        shape = (256, 2, 704) if args.quick else (1024, 16, 2816)
        n = make_model(work / "model", *shape)
        rows = [run(work / "model", work / f"out{p}", p) for p in (1, 2)]
        result = {"model": {"hidden": shape[0], "layers": shape[1], "mlp": shape[2], "parameters": n,
                            "weights_mib": round(4 * n / 2**20)},
                  "runs": rows, "ratio": round(rows[1]["peak_rss_mib"] / rows[0]["peak_rss_mib"], 3),
                  "load_average": os.getloadavg()}
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
