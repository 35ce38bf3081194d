"""The one load -> (mask / train) -> save runner of the commands that change a model on purpose:
``heal``, ``prune`` (with ``--heal``), ``squeeze`` (and ``convert``'s trained passes, whose
training runs inside the executor's one-part plan).

A :class:`Job` is opened once per command that writes (those, ``convert`` and ``export``), before
any work: the checkpoint resolved (``source.Source``), the output checked
(``output.check_output``: never the input, never a folder of the user's, writable) and the device
chosen (``devices.choose``). Then:

- :meth:`Job.training_data`: the text split into training ids and held-out windows (and
  ``--eval-text``'s windows);
- :meth:`Job.make_accelerator`: the training processes' accelerator on that device, with the
  precision asked for;
- :meth:`Job.load`: the checkpoint whole, on the device (the one-part plan of ``sweep``; under
  sharded training, on the main process only);
- :meth:`Job.record`: what the saved config records (version, source, device, the steps');
- :meth:`Job.save`: the model written and checked by ``writer.save`` on the main process (the
  other processes of a distributed run wait for it).

Training itself is ``training.train``, the one loop, which moves the model to the accelerator's
device and gives it back where it found it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core import devices
from ..core.calibration import fit_seq_len, split_heldout, tokenize, windows
from ..io.source import Source
from ..core.errors import SurgeryError
from ..io.output import check_output
from .sweep import CheckpointWork
from .writer import save
from ..core.version import __version__


@dataclass
class Texts:
    """A command's text, tokenized once and split (:func:`training_windows`)."""

    train_ids: torch.Tensor  # the text before its held-out end: all that training and prune's layer scores read
    held: torch.Tensor  # [n, T] windows of the held-out end of the text
    heldout: dict  # what the record says of them: windows, seq_len and, when fewer than asked, asked and why
    other: torch.Tensor | None = None  # [n, T] windows of --eval-text, a second text nothing trained on
    other_record: dict | None = None


def heldout_windows(ids: torch.Tensor, length: int, asked: int, what: str) -> tuple[torch.Tensor, dict]:
    """As many as ``asked`` non-overlapping ``length``-token windows of ``ids`` (``what``, in words),
    and the record of them: ``asked`` and ``fewer`` (why, in one line) when the text holds fewer."""
    n = min(asked, max(1, len(ids) // length))
    held = windows(ids, length, n, "the held-out text")
    fewer = {} if n == asked else {
        "asked": asked, "fewer": f"{n} window{'s' if n != 1 else ''}, not the {asked} asked (--eval-samples): {what} is "
                                 f"{len(ids)} tokens, {n} window{'s' if n != 1 else ''} of {length}"}
    return held, {"windows": n, "seq_len": length, **fewer}


def training_windows(tokenizer, text: str, eval_text: str | None, opts) -> Texts:
    """``text``'s training ids and held-out windows for ``opts`` (``eval_fraction``, ``seq_len``,
    ``eval_samples``): its last ``eval_fraction`` held out, and ``eval_text``'s windows beside."""
    train_ids, end = split_heldout(tokenize(tokenizer, text), opts.eval_fraction, opts.seq_len)
    windows(train_ids, opts.seq_len, 1, "the training text")
    held, record = heldout_windows(end, opts.seq_len, opts.eval_samples,
                                   f"the held-out {opts.eval_fraction:.0%} of the text")
    if eval_text is None:
        return Texts(train_ids, held, record)
    return Texts(train_ids, held, record, *heldout_windows(tokenize(tokenizer, eval_text), opts.seq_len,
                                                          opts.eval_samples, "--eval-text"))


@dataclass
class Job:
    source: Source
    out: Path
    force: bool
    device: torch.device
    accelerator: object = None

    @classmethod
    def open(cls, src, out, *, force: bool = False, allow_pickle: bool = False, device: str = "auto") -> Job:
        """``src`` resolved, ``out`` checked and ``device`` chosen, before any work."""
        source = Source.open(src, allow_pickle)
        check_output(Path(out), force, source.path)
        return cls(source, Path(out), force, devices.choose(device))

    def training_data(self, text: str, eval_text: str | None, opts) -> Texts:
        """:func:`training_windows` of ``text`` with the checkpoint's tokenizer (``opts.seq_len``
        fitted to the model's positions here)."""
        if self.source.tokenizer is None:
            raise SurgeryError(f"{self.source.name} has no tokenizer to read the text with")
        opts.seq_len = fit_seq_len(self.source.positions, opts.seq_len)
        return training_windows(self.source.tokenizer, text, eval_text, opts)

    def make_accelerator(self, precision: str):
        """The accelerator of the training processes, on the job's device."""
        self.accelerator = devices.make_accelerator(precision, self.device)
        return self.accelerator

    @property
    def main(self) -> bool:
        """Whether this process writes (the first of a distributed run, or the only one)."""
        return self.accelerator is None or self.accelerator.is_main_process

    def load(self, trains: bool = False):
        """The checkpoint whole, in its storage dtype, on the job's device. ``trains``: the model
        goes straight to training; where that is sharded over the processes (FSDP), only the
        main process reads the weights, the others' wait on the meta device until training
        gives them their shards (``processes.Shards``)."""
        if trains and devices.sharding() and not self.main:
            model = self.source.meta_model(self.source.storage)
            devices.place_buffers(model, self.device)
            return model
        return CheckpointWork(self.source, self.source.storage, device=self.device).load_all()

    def record(self, **steps) -> dict:
        """What the saved config records under "normsurgery": version, source, device, ``steps``."""
        return {"version": __version__, "source": self.source.name, "device": devices.describe(self.device), **steps}

    def save(self, model, record: dict, ids: torch.Tensor, *, extra: Callable[[Path], None] | None = None,
             progress=None) -> dict | None:
        """``model`` written to the job's output and checked (``writer.save``) by the main process;
        every process waits for it. Returns what was written (None on the other processes)."""
        saved = None
        if self.main:
            kw = {} if progress is None else {"progress": progress}
            saved = save(model, self.out, record=record, ids=ids, source=self.source, force=self.force, extra=extra,
                         **kw)
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        return saved
