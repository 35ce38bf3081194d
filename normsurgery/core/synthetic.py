"""Random models with weights of realistic scale, for tests, benchmarks and fuzzing.

Random init (std 0.02) gives near-Gaussian activations of tiny norm; trained checkpoints have
outlier channels and gains far from 1. :func:`make_realistic` rescales the weights, gives norms
random gains and biases and a few residual channels large writes, so a wrong fold shows up.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def make_realistic(model, seed: int = 0) -> None:
    """In place: matrices ~ N(0, 4 / fan_in), vectors ~ N(0, 0.01), norm gains 1 + N(0, 0.09)
    (Gemma's zero-init gains N(0, 0.09)) and biases N(0, 0.09); three residual channels of the
    embeddings written 8x larger."""
    g = torch.Generator().manual_seed(seed + 1)
    outliers = torch.randperm(model.config.hidden_size, generator=g)[:3]
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if p.ndim == 1 and ("norm" in name.lower() or "ln" in name):
            # gains around 1 with spread (Gemma-style zero-init gains too), biases of size 0.3
            p.copy_((1.0 if name.endswith("weight") and p.abs().max() > 0.5 else 0.0) + 0.3 * r)
        elif p.ndim == 1:
            p.copy_(0.1 * r)
        else:
            p.copy_(r * (2.0 / p.shape[-1] ** 0.5))
            if "emb" in name or "wte" in name or "wpe" in name:
                p[..., outliers % p.shape[-1]] *= 8.0
