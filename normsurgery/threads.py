"""How many threads torch computes with.

torch's threads spin while they wait for each other: when other work holds the cores, a step
waits for a thread that is not running. Measured on 2 cores with the load average at 3.2 (other
processes busy): a training step of the demo Llama ran at 96-118 tokens/s with 2 threads and at
1,818-2,547 with 1. So the default is the CPUs this process may use less the load already on
them, at least one; ``OMP_NUM_THREADS`` (or the CLI's ``--threads``) overrides it.
"""

from __future__ import annotations

import os


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set; else the usable CPUs less the 1-minute load average (rounded),
    at least 1."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus - round(os.getloadavg()[0]))


def use(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads`` (default: :func:`default_threads`); returns it."""
    import torch

    n = threads or default_threads()
    torch.set_num_threads(n)
    return n
