"""How many threads torch computes with, and how they wait.

torch's threads spin while they wait for each other: when other work holds the cores, a step
waits for a thread that is not running. Measured on 2 cores with the load average at 3.2 (other
processes busy): a training step of the demo Llama ran at 96-118 tokens/s with 2 threads and at
1,818-2,547 with 1. So the default is the CPUs this process may use less those other work holds
now, at least one; ``OMP_NUM_THREADS`` (or the CLI's ``--threads``) overrides it. What other work
holds is the larger of the 1-minute load average (rounded) and the tasks runnable at this moment
besides this one (``/proc/loadavg``): the average lags a process that started seconds ago by most
of a minute.

The CLI also has OpenMP's threads sleep while they wait (:func:`passive_wait`, before torch is
imported): a streamed flashnorm of a 1.5 GB bf16 Llama with 2 threads and one other process busy
on one of 2 cores took 4.39 s spinning, 1.76 s sleeping (1.26 s on the quiet machine). A library
import changes nothing in its caller's process: only the CLI's entry calls it.
"""

from __future__ import annotations

import os

#: OpenMP's wait policy the CLI sets unless the user did (read once, when torch loads OpenMP)
WAIT_POLICY = "PASSIVE"


def passive_wait() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless set: for a process that has not imported torch yet (the
    CLI's entry; a library must not change its caller's process)."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def runnable_elsewhere() -> int:
    """Tasks runnable on the machine at this moment besides the caller (``/proc/loadavg``'s
    running count less one; 0 where it cannot be read)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - 1)


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set; else the usable CPUs less what other work holds (the
    1-minute load average, rounded, or the tasks runnable now besides this one, whichever is
    more), at least 1."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus - max(round(os.getloadavg()[0]), runnable_elsewhere()))


def use(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads`` (default: :func:`default_threads`); returns it."""
    import torch

    n = threads or default_threads()
    torch.set_num_threads(n)
    return n
