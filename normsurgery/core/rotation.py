"""Orthogonal matrices that rotate the residual stream (QuaRot, SpinQuant, SliceGPT), in float64.

- :func:`hadamard` (n): entries +-1 with H Hᵀ = n I, built as the Kronecker product of a Paley
  matrix and a Sylvester power of two. Paley I gives order p + 1 for a prime p = 3 mod 4 (4, 8,
  12, 20, 24, 32, 44, ...), Paley II order 2 (p + 1) for a prime p = 1 mod 4 (12, 28, 36, 60,
  ...): so n = m 2^k with m one of those orders or 1: every power of two, 12 2^k, 20 2^k, 28 2^k,
  36 2^k (576 = 36 x 16), ...; 203 of the widths up to 1100. Not built: orders that need a prime
  power (52 = 2 (25 + 1)) or other constructions (92, 100, ...), and any n not divisible by 4.
- :func:`randomized_hadamard` (n, seed): Q = H diag(s) / sqrt(n) with random signs s. Orthogonal;
  each entry of Q x is a +-1/sqrt(n)-weighted sum of every channel of x, so a channel much
  larger than the others is spread over all n (max|Qx| / rms(Qx) near sqrt(2 ln n)).
- :func:`random_orthogonal` (n, seed): Q of the QR of an n x n Gaussian matrix, columns signed by
  diag(R) (Haar-distributed).
"""

from __future__ import annotations

import functools

import torch

WORK = torch.float64


def _is_prime(p: int) -> bool:
    return p > 1 and all(p % f for f in range(2, int(p ** 0.5) + 1))


def _jacobsthal(p: int) -> torch.Tensor:
    """Q_ij = chi(j - i), chi the quadratic character mod the prime p (chi(0) = 0)."""
    squares = {(x * x) % p for x in range(1, p)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, p)], dtype=WORK)
    idx = torch.arange(p)
    return chi[(idx[None, :] - idx[:, None]) % p]


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m from a prime p (Paley I: m = p + 1, p = 3 mod 4; Paley II:
    m = 2 (p + 1), p = 1 mod 4), or None when m is neither."""
    p = m - 1
    if _is_prime(p) and p % 4 == 3:
        s = torch.zeros(m, m, dtype=WORK)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(p)
        return torch.eye(m, dtype=WORK) + s  # I + S, S skew with S Sᵀ = p I
    p = m // 2 - 1
    if m % 2 == 0 and _is_prime(p) and p % 4 == 1:
        c = torch.zeros(p + 1, p + 1, dtype=WORK)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(p)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=WORK)
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=WORK)
        return torch.kron(c, one) + torch.kron(torch.eye(p + 1, dtype=WORK), zero)
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=WORK)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache
def hadamard_base(n: int) -> int | None:
    """The order m of the Paley matrix that :func:`hadamard` uses for n (1: n is a power of two),
    or None when it builds none of order n."""
    if _power_of_two(n):
        return 1
    for m in range(4, n + 1, 4):
        if n % m == 0 and _power_of_two(n // m) and _paley(m) is not None:
            return m
    return None


def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order n (float64, entries +-1, H Hᵀ = n I); ValueError when none is
    built here for n (see the module docstring)."""
    m = hadamard_base(n)
    if m is None:
        raise ValueError(f"no Hadamard matrix of order {n} is built here (orders m 2^k, m a prime "
                         "Paley order: 12, 20, 28, 36, 44, ...)")
    return _sylvester(n) if m == 1 else torch.kron(_paley(m), _sylvester(n // m))


def _signs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).to(WORK) * 2 - 1


def randomized_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """Q = H diag(s) / sqrt(n), s random signs from ``seed``: orthogonal."""
    return hadamard(n) * _signs(n, seed) / n ** 0.5


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A Haar-random orthogonal matrix from ``seed``: Q R = G (Gaussian), Q <- Q diag(sign(diag R))."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=WORK))
    return q * torch.sign(torch.diagonal(r))


KINDS = {"hadamard": randomized_hadamard, "random": random_orthogonal}


def rotation(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """The n x n orthogonal matrix of ``kind`` ("hadamard" or "random") and ``seed``."""
    return KINDS[kind](n, seed)
