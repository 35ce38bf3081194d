"""Text to token windows: calibration batches for prune, training and held-out slices for heal."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from .errors import SurgeryError
from .options import SEQ_LEN  # the default window length (options.py: the CLI's help reads it)


def bundled_path(name: str = "sample.txt") -> Path:
    """A text shipped with the package: held-out Shakespeare the demo models never trained on
    (``sample.txt``, 20 kB; ``heldout.txt``, the next 60 kB)."""
    return Path(str(resources.files("normsurgery").joinpath("data", name)))


def bundled_text(name: str = "sample.txt") -> str:
    return bundled_path(name).read_text()


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """The 1-D token ids of ``text`` (no special tokens added)."""
    if tokenizer is None:
        raise SurgeryError("the checkpoint has no tokenizer, so text cannot be turned into tokens")
    # verbose=False: the whole text is longer than the model's positions on purpose (it is cut
    # into windows), so transformers' "Token indices sequence length is longer..." is noise
    return tokenizer(text, return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"][0]


def fit_seq_len(positions: int | None, seq_len: int | None, what: str = "--seq-len") -> int:
    """The window length: none given (None or 0) fits the model, min(SEQ_LEN, positions); an
    explicit one longer than the model's positions is refused."""
    if not seq_len:
        return min(SEQ_LEN, positions or SEQ_LEN)
    if positions is not None and seq_len > positions:
        raise SurgeryError(f"{what} {seq_len} is longer than the model's {positions} positions")
    return seq_len


def check_length(ids: torch.Tensor, length: int, what: str = "the text") -> None:
    if length < 2:
        raise SurgeryError(f"a sequence needs at least 2 tokens, got a window of {length}")
    if len(ids) < length:
        raise SurgeryError(f"{what} has {len(ids)} tokens, fewer than one sequence of {length} "
                           "(give more text, or shorter windows: a smaller seq_len)")


def windows(ids: torch.Tensor, length: int, n: int | None = None, what: str = "the text") -> torch.Tensor:
    """[n, length] windows of ``ids``: n evenly spaced ones (overlapping only if the text is
    short), or with ``n=None`` every non-overlapping one."""
    check_length(ids, length, what)
    if n is None:
        n = len(ids) // length
        starts = torch.arange(n) * length
    else:
        starts = torch.linspace(0, len(ids) - length, max(1, n)).long()
    return torch.stack([ids[s:s + length] for s in starts])


def split_heldout(ids: torch.Tensor, fraction: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 1 - ``fraction`` of the tokens for training, the rest held out (each at least
    one sequence long)."""
    if not 0.0 < fraction < 1.0:
        raise SurgeryError(f"the held-out fraction must be between 0 and 1, got {fraction:g}")
    cut = len(ids) - max(length, int(len(ids) * fraction))
    train, heldout = ids[:cut], ids[cut:]
    check_length(train, length, "the training part of the text")
    return train, heldout
