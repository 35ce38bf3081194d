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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SurgeryError

POLICIES = ("refuse", "keep-float32")
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


#: entries checked at a time: the temporaries stay a few MB whatever the tensor's size
CHUNK = 1 << 22


def cast_loss(name: str, tensor: torch.Tensor, dtype: torch.dtype, cast: torch.Tensor | None = None) -> CastLoss | None:
    """What casting ``tensor`` to ``dtype`` (``cast``, when done already) loses (None: nothing
    beyond rounding within range). Only entries below ``dtype``'s smallest normal value can err
    by more than u, so the error's norm is computed only when the tensor holds some; chunked."""
    if not tensor.is_floating_point() or torch.finfo(dtype).bits >= torch.finfo(tensor.dtype).bits:
        return None
    info = torch.finfo(dtype)
    w = tensor.detach().reshape(-1)
    c = (w.to(dtype) if cast is None else cast).reshape(-1)
    chunks = [(w[i:i + CHUNK], c[i:i + CHUNK]) for i in range(0, w.numel(), CHUNK)]
    overflow = sum(int((torch.isinf(b) & torch.isfinite(a)).sum()) for a, b in chunks if bool(torch.isinf(b).any()))
    relative, bound = 0.0, info.eps / 2
    if any(bool(((a.abs() < info.tiny) & (a != 0)).any()) for a, _ in chunks):
        norm2 = err2 = 0.0
        for a, b in chunks:
            keep = torch.isfinite(b)
            if not bool(keep.all()):
                a, b = a[keep], b[keep]
            norm2 += float(torch.linalg.vector_norm(a.double())) ** 2
            err2 += float(torch.linalg.vector_norm(b.double() - a.double())) ** 2
        relative = (err2 / norm2) ** 0.5 if norm2 > 0 else 0.0
    return CastLoss(name, overflow, relative, bound) if overflow or relative > bound else None


def cast_losses(model, dtype: torch.dtype) -> list[CastLoss]:
    """Every parameter of ``model`` that casting to ``dtype`` would damage."""
    if dtype not in HALF:
        return []
    return [loss for name, p in model.named_parameters() if (loss := cast_loss(name, p, dtype))]


def cast_back(model, dtype: torch.dtype, policy: str = "refuse") -> list[CastLoss]:
    """Round ``model``'s weights to the storage ``dtype``, in place. When a tensor would overflow
    or underflow: ``refuse`` raises :class:`SurgeryError` naming them; ``keep-float32`` keeps
    them exactly (float32), rounds every other tensor through ``dtype`` and leaves the model in
    float32, which is what the saved checkpoint loads as (see :func:`store`). Returns the
    tensors kept."""
    lost = cast_losses(model, dtype)
    check_policy(lost, dtype, policy)
    if not lost:
        model.to(dtype)
        return []
    kept = {loss.name for loss in lost}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.float() if name in kept else p.data.to(dtype).float()
    model.to(torch.float32)  # buffers
    return lost


def for_storage(name: str, tensor: torch.Tensor, dtype: torch.dtype, lost: list[CastLoss]) -> torch.Tensor:
    """``tensor`` as stored in ``dtype`` (one tensor at a time, ``streaming``); one that does not
    fit stays float32 and is added to ``lost``, for :func:`check_policy` once all are seen."""
    cast = tensor.to(dtype)
    loss = cast_loss(name, tensor, dtype, cast) if dtype in HALF else None
    if loss:
        lost.append(loss)
        return tensor.float()
    return cast


def check_policy(lost: list[CastLoss], dtype: torch.dtype, policy: str) -> None:
    """Raise :class:`SurgeryError` naming the ``lost`` tensors when ``policy`` is refuse."""
    if policy not in POLICIES:
        raise SurgeryError(f"--on-overflow {policy}: choose one of {', '.join(POLICIES)}")
    if lost and policy == "refuse":
        raise SurgeryError(f"{len(lost)} rewritten tensors do not fit {_dtype_name(dtype)}: {_names(lost)}; nothing "
                           "was saved (--on-overflow keep-float32 keeps them in float32)")


def store(model, dtype: torch.dtype, kept: list[CastLoss]) -> None:
    """After :func:`cast_back` kept tensors: every other parameter back to ``dtype`` (exact, it
    was rounded there), so that the safetensors file holds them in ``dtype``."""
    names = {loss.name for loss in kept}
    for name, p in model.named_parameters():
        if name not in names:
            p.data = p.data.to(dtype)


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
