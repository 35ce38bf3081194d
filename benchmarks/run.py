#!/usr/bin/env python
"""``make bench``: run every benchmarks/bench_*.py in turn, each in its own process.

Each benchmark prints its own tables; their output streams through as it comes. All of them
run even when one fails; the exit status is non-zero when any failed (or none was found).

Usage: python benchmarks/run.py [NAME ...] [--list]
  NAME: run only the benchmarks whose file name contains NAME (e.g. ``convert``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def benchmarks(names: list[str]) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    return [p for p in found if not names or any(n in p.name for n in names)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run every benchmarks/bench_*.py in turn.")
    p.add_argument("names", nargs="*", help="only benchmarks whose file name contains one of these")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = p.parse_args(argv)
    todo = benchmarks(args.names)
    if args.list:
        print("\n".join(b.name for b in todo))
        return 0
    if not todo:
        print(f"run.py: no benchmarks/bench_*.py matches {args.names or '(any)'}", file=sys.stderr)
        return 1
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = []
    for bench in todo:
        print(f"\n===== {bench.name} =====", flush=True)
        t = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, str(bench)], cwd=ROOT, env=env).returncode
        except KeyboardInterrupt:
            print(f"\nrun.py: interrupted during {bench.name}", file=sys.stderr)
            return 130
        results.append((bench.name, rc, time.perf_counter() - t))
    print("\n===== summary =====")
    width = max(len(n) for n, _, _ in results)
    for name, rc, secs in results:
        print(f"{name:<{width}}  {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {secs:7.1f} s")
    failed = [n for n, rc, _ in results if rc != 0]
    if failed:
        print(f"run.py: {len(failed)} of {len(results)} benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
