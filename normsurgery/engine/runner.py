"""The one runner of every command that writes: ``convert``, ``prune`` (with and without
``--heal``), ``heal`` (with and without ``--save-adapter``), ``squeeze``, and each ``export``
format (an exporter is a writer into the job's stage plus a check in its runtime).

A command runs in a job's scope (:func:`job_scope`): the process set for the work
(:func:`process_state`: TF32 off, glibc's allocator kept), the current CUDA device and what its
:class:`Job` claims are put back and released when the command returns or raises. A :class:`Job` is opened once per
command, before any work: the checkpoint resolved (``source.Source``), the output claimed
(:func:`claim_output`, the one place: locked and checked once, ``output.claim``) and the device
chosen (:func:`choose_device`: current for the job alone). Then:

- :meth:`Job.training_data`: the text split into training ids and held-out windows (and
  ``--eval-text``'s windows);
- :meth:`Job.make_accelerator`: the training processes' accelerator on that device, with the
  precision asked for;
- :meth:`Job.load`: the checkpoint whole, on the device (the one-part plan of ``sweep``; under
  sharded training, on the main process only);
- :meth:`Job.record`: what the saved config records (version, source, device, the steps');
- the output written atomically into the claim's stage (``output.staged``) and read back: a
  model by :meth:`Job.save` (``writer.save_model``, on the main process; the other processes of a
  distributed run wait for it) or ``writer.save_work``, anything else by its writer in
  :meth:`Job.staged`.

Training itself is ``training.train``, the one loop, which moves the model to the accelerator's
device and gives it back where it found it. :func:`save` (``ns.save``) writes a model held in
memory through the same claim.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core import devices, memory
from ..core.calibration import fit_seq_len, split_heldout, tokenize, windows
from ..core.errors import SurgeryError
from ..core.options import SaveOptions, options_of
from ..core.progress import Progress, no_progress
from ..core.version import __version__
from ..io import output
from ..io.source import Source
from .sweep import CheckpointWork
from .writer import save_model

#: the scope of the command running in this context (:func:`job_scope`): what its job holds
_SCOPE: ContextVar[ExitStack | None] = ContextVar("normsurgery_job_scope", default=None)


def job_scope(command):
    """``command`` (an API function that computes: one that writes opens a :class:`Job` or calls
    :func:`save`; verify, outliers and lens write nothing) run in a scope of its own: the process
    settings of :func:`process_state` hold, and the output it claims stays locked, until it returns
    or raises; then the lock is released and the settings put back."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        with ExitStack() as scope:
            scope.enter_context(process_state())
            token = _SCOPE.set(scope)
            try:
                return command(*args, **kwargs)
            finally:
                _SCOPE.reset(token)

    return run


@contextmanager
def process_state():
    """The process as a job computes in it, put back when the job ends: TF32 off
    (``devices.exact_arithmetic``: a float32 check on a GPU), torch's global generator (what a
    training seeds, what a model's initialisation draws: ``devices.rng_kept``; a GPU's is kept by
    :func:`choose_device`) and glibc's mmap threshold, which a streamed plan lowers
    (``memory.map_large_blocks``: freed parts go back to the system at once) for the rest of its
    job (``memory.allocator_kept``)."""
    with devices.exact_arithmetic(), devices.rng_kept(devices.HOST), memory.allocator_kept():
        yield


def _scope(what: str) -> ExitStack:
    """The running command's scope (:func:`job_scope`), to hold ``what`` (in words) until it ends."""
    scope = _SCOPE.get()
    if scope is None:
        raise SurgeryError(f"internal: {what} outside a command's job scope (runner.job_scope)")
    return scope


def choose_device(spec: str) -> torch.device:
    """``devices.choose(spec)``, a GPU made the current CUDA device (where accelerate and ``"cuda"``
    compute) until the command's :func:`job_scope` ends; then the caller's is current again
    (``torch.cuda.device``, which wakes no GPU to put it back)."""
    where = devices.choose(spec)
    if devices.is_gpu(where):
        scope = _scope(f"{where} made current")
        scope.enter_context(torch.cuda.device(where))
        scope.enter_context(devices.rng_kept(where))  # its generator too, as process_state keeps the CPU's
    return where


def claim_output(out, force: bool, source: Source | None, file: output.FileKind | None = None) -> output.Claim:
    """The one place a command claims its output ``out`` (``output.claim``: locked, checked once;
    ``file``: a file output of that kind), held until the command's :func:`job_scope` ends. Under
    the CLI, which claimed ``out`` before torch loaded (``cli.app.claimed``), it is that claim."""
    held = output.claim(out, force, None if source is None else source.path, file=file,
                        source_name=None if source is None else source.name)
    return _scope(f"{out} claimed").enter_context(held)


@contextmanager
def file_output(out, force: bool, kind: output.FileKind):
    """A file written beside a command, by its caller once the command returned (the CLI's
    ``--plot``): claimed as a command's output is (:func:`claim_output`), before the command's work,
    and held for the block; yields the claim, which ``output.staged`` writes."""
    with ExitStack() as scope:
        token = _SCOPE.set(scope)
        try:
            claim = claim_output(out, force, None, kind)
        finally:
            _SCOPE.reset(token)
        yield claim


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
    claim: output.Claim
    device: torch.device
    accelerator: object = None

    @classmethod
    def open(cls, src, out, *, force: bool = False, allow_pickle: bool = False, device: str = "auto",
             file: output.FileKind | None = None) -> Job:
        """``src`` resolved, ``out`` claimed (:func:`claim_output`; ``file``: a file output of that
        kind) and ``device`` chosen, before any work."""
        source = Source.open(src, allow_pickle)
        return cls(source, claim_output(out, force, source, file), choose_device(device))

    @property
    def out(self) -> Path:
        return self.claim.path

    @property
    def force(self) -> bool:
        return self.claim.force

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

    def save(self, model, record: dict, ids: torch.Tensor, *, extra: Callable[[output.Staged], None] | None = None,
             progress: Progress = no_progress) -> dict | None:
        """``model`` written to the job's output and checked (``writer.save_model``) by the main
        process; every process waits for it. Returns what was written (None on the other processes)."""
        saved = None
        if self.main:
            saved = save_model(model, self.claim, record=record, ids=ids, source=self.source, extra=extra,
                               progress=progress)
        self.wait()
        return saved

    @contextmanager
    def staged(self):
        """The job's output written by what the block puts in the stage it yields (``output.staged``:
        moved into place when the block ends, removed on any error), by the main process."""
        with output.staged(self.out) as stage:
            yield stage

    def wait(self) -> None:
        """The processes of a distributed run wait here for the main one (which writes)."""
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()


@job_scope
def save(model, out, options: SaveOptions | dict | None = None, *, record: dict | None = None,
         ids: torch.Tensor | None = None, source=None, progress: Progress = no_progress, **keywords) -> dict:
    """Save a model held in memory (rewritten, pruned, healed) to ``out`` with ``options``
    (``SaveOptions``, a dict of its fields, or its fields as ``keywords``: ``force``, ``max_shard_size``;
    checked before anything is claimed), claimed as a job's
    output is (:func:`claim_output`), with ``writer.save_model``: checked, the folder read back,
    on the model's device, against the model's outputs on ``ids`` (default: random tokens);
    ``source`` (a checkpoint): where it came from, whose side files are copied. The model is
    spent. Returns what was written (the folder, its files, how it loads)."""
    o = options_of(SaveOptions, options, keywords)
    source = None if source is None else Source.open(source)
    claim = claim_output(out, o.force, source)
    return save_model(model, claim, record=record, ids=ids, source=source, shard_bytes=o.shard_bytes,
                      progress=progress)
