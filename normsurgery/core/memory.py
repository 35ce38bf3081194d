"""Memory the process may take, and giving freed memory back to the system (glibc)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from . import devices
from .precision import spans_storage


def available() -> int:
    """Bytes this process may still take: MemAvailable, or less under a cgroup limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail or 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 1 << 62


def room(device) -> tuple[int, str]:
    """(bytes a whole model may take when it computes on ``device``, words saying where): host
    memory, and on a GPU the least of it and the GPU's free memory."""
    gpu = devices.free_bytes(device)
    host = available()
    return (host, "") if gpu is None else (min(host, gpu), f" on {device} and its host")


def owned(t: torch.Tensor) -> bool:
    """True when ``t`` alone holds its storage, all of it: no view of it is alive anywhere (the
    storage's use count is ``t``'s and the one taken to ask). Rests on a private torch API;
    without it, False (nothing is reused: slower, still correct)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and spans_storage(t) and count(t.untyped_storage()._cdata) == 2


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def trim() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


#: mallopt's M_MMAP_THRESHOLD
MMAP_THRESHOLD = -3
#: glibc's threshold when nothing set one (DEFAULT_MMAP_THRESHOLD_MIN), which then rises with each
#: large block freed
GLIBC_THRESHOLD = 128 * 1024
#: inside a job (:func:`allocator_kept`): whether :func:`map_large_blocks` set the threshold
_KEPT: ContextVar[list[bool] | None] = ContextVar("normsurgery_allocator", default=None)


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """Ask glibc to serve every allocation of ``threshold`` bytes or more by its own mapping, so a
    freed tensor goes back to the system at once (by default the threshold rises with each large
    block freed, later tensors come from the heap, and the heap only grows): called by the
    operations that bound their memory (streamed plans), for the rest of their job
    (:func:`allocator_kept`); outside a job, nothing (the caller's allocator is the caller's)."""
    kept = _KEPT.get()
    libc = _libc()
    if kept is None or libc is None:
        return
    libc.mallopt(MMAP_THRESHOLD, threshold)
    kept[0] = True


@contextmanager
def allocator_kept():
    """For the block (a job: ``runner``): the mmap threshold :func:`map_large_blocks` sets is put
    back when it ends, to the process's start-up value (:func:`start_threshold`). What cannot be
    put back: glibc tells no one the threshold in force (a caller's own ``mallopt`` is not known),
    and once set it no longer rises by itself (glibc has no call that turns that back on)."""
    outer = _KEPT.get()
    kept = [False] if outer is None else outer  # (a job inside a job: the outer one puts it back)
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)
        if outer is None and kept[0]:
            _libc().mallopt(MMAP_THRESHOLD, start_threshold())


def start_threshold() -> int:
    """glibc's mmap threshold as the process started: ``GLIBC_TUNABLES``' ``glibc.malloc.mmap_threshold``
    or ``MALLOC_MMAP_THRESHOLD_`` where set, else glibc's default."""
    tuned = re.search(r"(?:^|:)glibc\.malloc\.mmap_threshold=(\w+)", os.environ.get("GLIBC_TUNABLES", ""))
    for value in (tuned and tuned[1], os.environ.get("MALLOC_MMAP_THRESHOLD_")):
        try:
            return int(value, 0)
        except (TypeError, ValueError):
            continue
    return GLIBC_THRESHOLD
