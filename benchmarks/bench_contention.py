#!/usr/bin/env python
"""A small streamed convert on a quiet machine and with one core held by another process, in the
same run: what torch's waiting threads cost when other work holds a core, and what the CLI's
defaults (``normsurgery.core.threads``: OpenMP's threads sleep while they wait; threads = the CPUs not
busy) keep of it.

Checkpoint (built once into bench-out/contention): a synthetic Llama in bfloat16 (d 1024, 12
layers, MLP 2816, vocab 32000, untied head: 0.44 GB) in 100 MB shards; pass flashnorm, streamed,
``--no-verify`` (the rewrite and the writing only).

Settings, each timed in a fresh process (the operation only, after the imports), quiet and with
one busy-loop process (pinned to CPU 0 with ``--pin``, else where the scheduler puts it), rounds
alternating the settings and the two conditions so drift in the machine's load hits them alike:
  spin@N     OMP_WAIT_POLICY=ACTIVE, N threads (what a library caller gets by default)
  passive@N  OMP_WAIT_POLICY=PASSIVE (the CLI's default), N threads
  cli        the whole CLI process (``normsurgery convert``: imports included), its defaults
             (wait policy and threads)
N: 1 and every CPU. The table gives each setting's median seconds, the busy/quiet ratio, and
the load average when each condition was measured (other processes add to both).

Measured on a shared 2-CPU AMD EPYC whose other users kept the load average at 3.7-6.4 (so "quiet"
was not quiet), 2 rounds, medians (seconds, quiet / busy):
  spin@1 1.73 / 2.73, passive@1 1.38 / 1.72, spin@2 6.85 / 14.54, passive@2 0.87 / 2.19,
  cli 9.20 / 23.53 (the imports of torch and transformers are most of it).
With every CPU, threads that spin were 7.9x slower than threads that sleep with no busy-loop of
ours and 6.6x with one; at one thread the policy changes nothing beyond the noise.

Usage: python benchmarks/bench_contention.py [--rounds N] [--pin] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import env, folder_bytes, machine, quiet_imports, result, spawn  # noqa: E402

WORK = ROOT / "bench-out" / "contention"
CONFIG = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
              intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
SHARD = "100MB"
PASSES = [("flashnorm", {})]


def op_build(args) -> dict:
    torch, T = quiet_imports()
    from normsurgery.core.synthetic import make_realistic

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = T.LlamaForCausalLM(T.LlamaConfig(**CONFIG, dtype="bfloat16"))
    make_realistic(model.eval())
    model.save_pretrained(args.out, max_shard_size=SHARD)
    return {"bytes": folder_bytes(args.out)}


def op_convert(args) -> dict:
    """The streamed convert without checks, timed after the imports (the family's modules too)."""
    torch, T = quiet_imports()
    conv = importlib.import_module("normsurgery.commands.convert")
    src, out = Path(args.src), Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    getattr(T, T.AutoConfig.from_pretrained(src).architectures[0])
    t = time.perf_counter()
    conv.convert(src, out, PASSES, streaming=True, verify=False)
    return {"seconds": time.perf_counter() - t, "threads": torch.get_num_threads(),
            "wait_policy": os.environ.get("OMP_WAIT_POLICY")}


WORKERS = {"build": op_build, "convert": op_convert}


def cli_seconds(src: Path, out: Path) -> float:
    """The whole ``normsurgery convert`` process (imports included), with the CLI's defaults:
    neither OMP_NUM_THREADS nor OMP_WAIT_POLICY set."""
    variables = env(1)
    for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        variables.pop(k, None)
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "normsurgery", "convert", str(src), str(out), "--pass", "flashnorm",
                    "--streaming", "--no-verify"], check=True, capture_output=True, env=variables, cwd=ROOT)
    return time.perf_counter() - t


class Busy:
    """One busy-loop process while active (pinned to CPU 0 when ``pin``)."""

    def __init__(self, pin: bool):
        self.pin, self.proc = pin, None

    def __enter__(self):
        code = ("import os, sys\n"
                "if sys.argv[1] == '1' and hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {0})\n"
                "while True: pass\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, "1" if self.pin else "0"])
        time.sleep(1.0)  # running before the measured process starts
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def measure(setting: str, src: Path, out: Path) -> float:
    if setting == "cli":
        return cli_seconds(src, out)
    policy, threads = setting.split("@")
    wait = {"spin": "ACTIVE", "passive": "PASSIVE"}[policy]
    return spawn(__file__, "convert", int(threads), environ={"OMP_WAIT_POLICY": wait}, src=src, out=out)["seconds"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="measurements of each setting in each condition")
    p.add_argument("--pin", action="store_true", help="pin the busy process to CPU 0")
    p.add_argument("--settings", default=None, help="comma-separated (default: spin@1,passive@1,spin@N,passive@N,cli)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep bench-out/contention")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    for k in ("src", "out"):
        p.add_argument(f"--{k}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result(WORKERS[args.worker](args))
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = (args.settings or f"spin@1,passive@1,spin@{cpus},passive@{cpus},cli").split(",")
    WORK.mkdir(parents=True, exist_ok=True)
    src, out = WORK / "llama-0.4b", WORK / "out"
    if not (src / "config.json").is_file():
        print(f"building {src} ...", file=sys.stderr, flush=True)
        spawn(__file__, "build", cpus, out=src)
    res = {"machine": machine(cpus), "pin": args.pin, "rounds": args.rounds, "settings": settings, "runs": [],
           "command": "python benchmarks/bench_contention.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    t = time.perf_counter()
    try:
        for r in range(args.rounds):
            for busy in ((False, True) if r % 2 == 0 else (True, False)):  # the order alternates too
                for setting in (settings if r % 2 == 0 else settings[::-1]):
                    load = os.getloadavg()[0]
                    if busy:
                        with Busy(args.pin):
                            seconds = measure(setting, src, out)
                    else:
                        seconds = measure(setting, src, out)
                    res["runs"].append({"setting": setting, "busy": busy, "seconds": seconds, "loadavg": load})
                    print(f"  round {r + 1} {setting:<12} {'busy' if busy else 'quiet':<6} {seconds:6.2f} s "
                          f"(load average {load:.2f})", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(WORK, ignore_errors=True)
    res["table"] = summarise(res["runs"], settings)
    res["total_s"] = time.perf_counter() - t
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def summarise(runs: list[dict], settings: list[str]) -> list[dict]:
    rows = []
    for s in settings:
        got = {b: [r for r in runs if r["setting"] == s and r["busy"] == b] for b in (False, True)}
        med = {b: statistics.median(r["seconds"] for r in got[b]) for b in got}
        rows.append({"setting": s, "quiet_s": med[False], "busy_s": med[True], "ratio": med[True] / med[False],
                     "load_quiet": statistics.mean(r["loadavg"] for r in got[False]),
                     "load_busy": statistics.mean(r["loadavg"] for r in got[True])})
    return rows


def print_table(res: dict) -> None:
    m = res["machine"]
    print(f"\nstreamed flashnorm --no-verify, 0.44 GB bf16 Llama; {m['cpus']} CPUs ({m['cpu']}); busy: one busy-loop "
          f"process{' pinned to CPU 0' if res['pin'] else ''}; medians of {res['rounds']} runs each")
    print(f"  {'setting':<12}{'quiet s':>9}{'busy s':>9}{'busy/quiet':>12}{'load q':>8}{'load b':>8}")
    for r in res["table"]:
        print(f"  {r['setting']:<12}{r['quiet_s']:>9.2f}{r['busy_s']:>9.2f}{r['ratio']:>12.2f}"
              f"{r['load_quiet']:>8.2f}{r['load_busy']:>8.2f}")
    print(f"bench_contention: {res['total_s']:.0f} s in all (the load average counts other processes too)")


if __name__ == "__main__":
    sys.exit(main())
