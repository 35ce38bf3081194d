"""Forward-time measurement shared by the benchmarks."""

from __future__ import annotations

import statistics
import time

import torch


def forward_ms(models: dict, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median forward time in ms of each model on ``ids``, runs interleaved (after one warm-up
    each) so drift in the machine's load hits every model alike."""
    times = {name: [] for name in models}
    with torch.no_grad():
        for m in models.values():
            m(input_ids=ids)  # warm-up
        for _ in range(repeats):
            for name, m in models.items():
                t = time.perf_counter()
                m(input_ids=ids)
                times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
