"""Several processes: what the launcher started, before anything is loaded.

Launching N processes is the launcher's job (``torchrun --nproc_per_node N -m normsurgery ...``,
``accelerate launch --num_processes N -m normsurgery ...``): each process reads the checkpoint,
trains on its own batches (gradients averaged: gloo on CPUs, NCCL on GPUs) and only the first
writes. One quirk is mended here, at the entry point, before torch loads: ``accelerate launch
--cpu --num_processes N`` starts one process whatever N is (:func:`relaunch_cpu_processes`).
No torch at module level.
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..core.errors import SurgeryError


def _requested_cpu_processes() -> int | None:
    """``accelerate launch --cpu --num_processes N`` (N > 1) starts this script once, with
    MASTER_ADDR set and no WORLD_SIZE: the count is only on the launcher's command line."""
    if os.environ.get("WORLD_SIZE") or os.environ.get("ACCELERATE_USE_CPU", "").lower() != "true":
        return None
    if not os.environ.get("MASTER_ADDR"):
        return None
    try:
        import psutil

        argv = psutil.Process().parent().cmdline()
    except Exception:
        argv = []
    for i, a in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            if a == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    raise SurgeryError("accelerate launch --cpu starts one process whatever --num_processes says, and the count "
                       "could not be read; use torchrun --nproc_per_node N -m normsurgery ...")


def relaunch_cpu_processes() -> None:
    """Turn a single process started by ``accelerate launch --cpu --num_processes N`` into N
    processes of one gloo group: run the same command under torch.distributed.run, then exit
    with its status. Does nothing otherwise."""
    n = _requested_cpu_processes()
    if not n or n < 2:
        return
    argv = list(getattr(sys, "orig_argv", []))[1:]
    if not argv or (argv[0].startswith("-") and argv[0] != "-m"):
        raise SurgeryError("cannot restart this command under torchrun; run torchrun --nproc_per_node "
                           f"{n} -m normsurgery ... instead")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
           "--master_addr", os.environ["MASTER_ADDR"], "--master_port", os.environ.get("MASTER_PORT", "29500"),
           *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    raise SystemExit(subprocess.call(cmd, env=env))
