"""What casting rewritten weights back to a half-precision storage dtype loses, tensor by tensor.

Folding a gain g into a reader (W diag(g)) moves weights in magnitude, possibly out of the
storage dtype's range:

- overflow: an entry the dtype cannot hold becomes ±inf (float16: |v| >= 65520, just above its
  largest finite value 65504; bfloat16 has float32's range);
- underflow: an entry below the smallest normal value (6.1e-5 in float16) is stored as a
  subnormal with fewer significant bits, or as 0.

In the normal range round-to-nearest errs by at most u = eps / 2 relative per entry (2^-11 in
float16, 2^-8 in bfloat16), so a cast within range has ||cast(w) - w|| <= u ||w||. A tensor whose
cast errs more has lost its small values to underflow; half-precision weights cast back
unchanged lose nothing. Each tensor so hit is either kept in float32 (the safetensors file holds
mixed dtypes) or the conversion is refused (``--on-overflow``).

:func:`perturb` makes the error storing in a dtype costs, for the checks' null distribution (``parity``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SurgeryError
from .options import ON_OVERFLOW

POLICIES = ON_OVERFLOW  # options.py holds the choices
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CastLoss:
    name: str
    overflow: int  # finite entries that become ±inf
    relative: float  # ||cast(w) - w|| / ||w|| over the entries that stay finite
    bound: float  # u: the most a cast within range can err

    def __str__(self) -> str:
        if self.overflow:
            return f"{self.name} ({self.overflow} {'value overflows' if self.overflow == 1 else 'values overflow'})"
        return f"{self.name} (underflow: relative error {self.relative:.1e} > {self.bound:.1e})"


#: entries checked at a time: temporaries of half a MB, which the allocator reuses (larger ones
#: are mapped afresh, and first touching their pages costs more than the arithmetic)
CHUNK = 1 << 17
#: the fast check's sums are float32: valid while u^2 ||w||^2 stays far above float32's smallest
#: values (squares of tiny errors flush to zero); below it the exact float64 check runs
SMALLEST_SUM = 1e-20
#: per working dtype: the integer dtype of its bits and the mask of its exponent field
EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def cast_loss(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> CastLoss | None:
    """What casting ``tensor`` to ``dtype`` loses (None: nothing beyond rounding within range):
    the relative error ||cast(w) - w|| / ||w|| against u.

    One pass in chunks: d = cast(w) - w is exact in ``w``'s dtype (a value minus its rounding),
    ||d||^2 and ||w||^2 are summed in float32. An overflow makes the sum infinite; then, and for
    tensors too small for float32 sums, :func:`_exact_loss` counts in float64. float32 to bfloat16
    needs only ||w||^2 (:func:`_same_range_loss`)."""
    if not tensor.is_floating_point() or torch.finfo(dtype).bits >= torch.finfo(tensor.dtype).bits:
        return None
    w = tensor.detach().reshape(-1)
    bound = torch.finfo(dtype).eps / 2
    if w.dtype == torch.float32 and dtype == torch.bfloat16:
        return _same_range_loss(name, w, bound)
    err2 = norm2 = 0.0
    for i in range(0, w.numel(), CHUNK):
        a = w[i:i + CHUNK]
        d = a.to(dtype).to(a.dtype).sub_(a)
        err2 += float(torch.dot(d, d))
        norm2 += float(torch.dot(a, a))
    if not (math.isfinite(err2) and math.isfinite(norm2)) or norm2 * bound ** 2 < SMALLEST_SUM:
        return _exact_loss(name, w, w.to(dtype), dtype)
    relative = math.sqrt(err2 / norm2)
    return CastLoss(name, 0, relative, bound) if relative > bound else None


def _same_range_loss(name: str, w: torch.Tensor, bound: float) -> CastLoss | None:
    """:func:`cast_loss` from float32 to bfloat16, which share their exponent range: a finite entry
    rounds to ±inf only above 3.39e38 (its square overflows float32), and one below bfloat16's
    smallest normal value is a float32 subnormal too, erring by at most 2^-134 (which matters only
    to a tensor whose norm is itself tiny). So a tensor whose ||w||^2, summed in float32, is finite
    and not tiny (:data:`SMALLEST_SUM`) loses nothing beyond rounding within range: one reduction,
    no temporaries; any other is counted by :func:`_exact_loss`."""
    norm2 = float(torch.dot(w, w))
    if math.isfinite(norm2) and norm2 * bound ** 2 >= SMALLEST_SUM:
        return None
    return _exact_loss(name, w, w.to(torch.bfloat16), torch.bfloat16)


def _exact_loss(name: str, w: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> CastLoss | None:
    """:func:`cast_loss` counting overflows, the error over the entries that stay finite summed
    in float64."""
    chunks = [(w[i:i + CHUNK], c[i:i + CHUNK]) for i in range(0, w.numel(), CHUNK)]
    overflow = sum(int((torch.isinf(b) & torch.isfinite(a)).sum()) for a, b in chunks)
    norm2 = err2 = 0.0
    for a, b in chunks:
        keep = torch.isfinite(b)
        if not bool(keep.all()):
            a, b = a[keep], b[keep]
        norm2 += float(torch.linalg.vector_norm(a.double())) ** 2
        err2 += float(torch.linalg.vector_norm(b.double() - a.double())) ** 2
    relative, bound = ((err2 / norm2) ** 0.5 if norm2 > 0 else 0.0), torch.finfo(dtype).eps / 2
    return CastLoss(name, overflow, relative, bound) if overflow or relative > bound else None


def for_storage(name: str, tensor: torch.Tensor, dtype: torch.dtype, lost: list[CastLoss],
                spend: bool = True) -> torch.Tensor:
    """``tensor`` as stored in ``dtype``; ``spend``: cast in its own storage
    (:func:`narrow_in_place`), its values are gone. One that does not fit stays float32 and is
    added to ``lost``, for :func:`check_policy` once all are seen."""
    loss = cast_loss(name, tensor, dtype) if dtype in HALF else None
    if loss:
        lost.append(loss)
        return tensor.float()
    return narrow_in_place(tensor, dtype) if spend else tensor.to(dtype)


def narrow_in_place(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` cast to the narrower ``dtype`` inside its own storage, chunk by chunk: no new
    memory (a fresh tensor's pages cost more to first touch than the cast). Chunk i of n entries,
    read from bytes [i n b, (i+1) n b) (b bytes per entry), is stored at [i n b', (i+1) n b'),
    with b' <= b / 2 at or before what is still to be read; the first chunk overlaps its own
    input and goes through a temporary. ``tensor``'s values are spent; the result is a view of
    its storage. A tensor that does not own its storage alone is cast to new memory."""
    t = tensor.detach()
    if not t.is_floating_point() or t.element_size() * 8 < 2 * torch.finfo(dtype).bits or not spans_storage(t):
        return t.to(dtype)
    flat = t.reshape(-1)
    out = torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage(), 0, (t.numel(),))
    with torch.no_grad():
        for i in range(0, t.numel(), CHUNK):
            chunk = flat[i:i + CHUNK]
            out[i:i + CHUNK].copy_(chunk.to(dtype) if i == 0 else chunk)
    return out.view(t.shape)


def perturb(t: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    """In place: each nonzero entry x of ``t`` (kept in a wider dtype) moved by u h(x), u uniform
    in (-1, 1) (``seed``: :func:`uniform`) and h(x) half the spacing of ``dtype`` at x: the error
    rounding x into ``dtype`` makes, distributed as rounding's (uniform over the interval, not always
    the largest). The spacing in [2^(e-1), 2^e) is eps 2^(e-1), and eps tiny below the smallest
    normal value tiny; 2^(e-1) is x with its sign and mantissa bits cleared. Exact zeros stay (a zero
    is stored exactly), and so do infinities and NaN."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(seed)
    flat = t.detach().view(-1)
    bits, exponent = EXPONENT_BITS[flat.dtype]
    with torch.no_grad():
        for i in range(0, flat.numel(), CHUNK):
            x = flat[i:i + CHUNK]
            binade = (x.view(bits) & exponent).view(x.dtype)  # 2^(e-1); infinite where x is not finite
            half = binade.clamp_(min=info.tiny, max=torch.finfo(x.dtype).max).mul_(info.eps / 2)
            half.mul_(uniform(x.numel(), g).to(x.device, x.dtype))
            x.add_(half.masked_fill_(x == 0, 0))


def uniform(n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` draws uniform in (-1, 1) on the CPU, float32, of 16 bits each: (k + 1/2) 2^-15 for k a
    random int16, four from each 64-bit draw of ``g`` (a draw of the generator costs several times
    the arithmetic around it)."""
    k = torch.randint(-2**63, 2**63 - 1, ((n + 3) // 4,), generator=g, dtype=torch.int64).view(torch.int16)[:n]
    return k.float().add_(0.5).mul_(2**-15)


def spans_storage(t: torch.Tensor) -> bool:
    """True when ``t`` is its storage, contiguous, from its first byte to its last."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def check_policy(lost: list[CastLoss], dtype: torch.dtype, policy: str) -> None:
    """Raise :class:`SurgeryError` naming the ``lost`` tensors when ``policy`` is refuse."""
    if policy not in POLICIES:
        raise SurgeryError(f"--on-overflow {policy}: choose one of {', '.join(POLICIES)}")
    if lost and policy == "refuse":
        raise SurgeryError(f"{len(lost)} rewritten tensors do not fit {_dtype_name(dtype)}: {_names(lost)}; nothing "
                           "was saved (--on-overflow keep-float32 keeps them in float32)")


def warning(kept: list[CastLoss], dtype: torch.dtype) -> str:
    """The one line saying which tensors stay in float32, and how the checkpoint then loads."""
    return (f"kept {len(kept)} tensors in float32, they do not fit {_dtype_name(dtype)}: {_names(kept)}; "
            "the checkpoint's config dtype is float32, so from_pretrained loads it in float32 "
            f"(with dtype=torch.{_dtype_name(dtype)} they would be cast back)")


def _names(losses: list[CastLoss], most: int = 3) -> str:
    more = f" and {len(losses) - most} more" if len(losses) > most else ""
    return ", ".join(str(x) for x in losses[:most]) + more


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
