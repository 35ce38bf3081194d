"""A written folder checked in a runtime that serves it, MLX-LM or vLLM (``CHECKS``), against
the torch model, as the ONNX export is compared (``export``):

- logits on the probe windows (``parity.compare``: relative error, per-position KL, top-1),
  judged by :class:`check.Tolerances` in float32: the runtime computes in float32 here (the
  parameters cast up from what the folder stores, exactly as torch's float32 model holds them),
  so what may differ is float32 arithmetic's rounding, on both sides: 1e-5, or beyond it
  ``ROUNDING_FACTOR`` x the larger of torch's own rounding (jittered) and the runtime's own,
  measured where the runtime computes in float64 (``FLOAT64``: its float32 logits against its
  float64 logits of the same folder, ``parity.runtime_tolerance``). MLX-LM rounds more than torch
  on some models, in its float32 matrix products (SmolLM2-135M masked and minimized: 1.5e-4 from
  its float64 logits, torch 3.8e-5);
- a greedy continuation of each window's first tokens through the runtime's key/value cache,
  which must equal transformers' ``generate``.

The runtime runs in a process of its own (``runtime_worker``: it imports neither torch nor
normsurgery), killed with everything it started when the caller is interrupted, so Ctrl-C acts
at once and leaves nothing; vLLM runs in this python where it has vLLM, else in the one
``NORMSURGERY_SERVE_PYTHON`` names (a serving environment of its own). ``check=None``: the first
runtime installed (:func:`choose`).

MLX-LM reads config.json itself (its ``models/<model_type>.py``, no remote code), in the keys
transformers wrote before version 5: a folder without a top-level ``rope_theta`` runs with RoPE
base 10000 whatever ``rope_parameters`` says (``checkpoint.legacy_keys`` writes it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.errors import SurgeryError
from ..core.options import CHECKS
from ..core.parity import TOLERANCE, Comparison, compare, outputs, probe_ids, runtime_tolerance
from ..engine.check import Tolerances, model_reader
from ..io.loader import load
from ..io.source import Source

#: each runtime's name in words and how to install it
NAMES = {"mlx": "MLX-LM", "vllm": "vLLM"}
INSTALL = {"mlx": "pip install 'normsurgery[mlx]'", "vllm": "pip install vllm"}
MODULES = {"mlx": ("mlx", "mlx_lm"), "vllm": ("vllm",)}
#: runtimes that compute in float64 too (on the CPU): their own rounding is measured against it
FLOAT64 = ("mlx",)
SERVE_PYTHON = "NORMSURGERY_SERVE_PYTHON"
WORKER = Path(__file__).with_name("runtime_worker.py")
#: greedy tokens generated after each prompt
NEW_TOKENS = 16
#: tokens of each probe window a greedy continuation starts from
PROMPT = 8


def python_of(runtime: str) -> str | None:
    """The python that runs ``runtime``: this one where it has the runtime's modules (found, not
    imported), else for vLLM the one ``NORMSURGERY_SERVE_PYTHON`` names; None: not installed."""
    if all(importlib.util.find_spec(m) is not None for m in MODULES[runtime]):
        return sys.executable
    other = os.environ.get(SERVE_PYTHON) if runtime == "vllm" else None
    return other if other and Path(other).is_file() else None


def choose(check: str | None = None) -> str:
    """The runtime of the check: ``check`` (one of ``CHECKS``) when installed; None: the first of
    ``CHECKS`` installed. Refused with one line saying what to install when there is none."""
    if check is not None:
        if check not in CHECKS:
            raise SurgeryError(f"--check {check!r}: choose one of {', '.join(CHECKS)}")
        if python_of(check) is None:
            raise SurgeryError(f"the {NAMES[check]} check needs {' and '.join(MODULES[check])}, not installed: "
                               f"{INSTALL[check]}")
        return check
    for runtime in CHECKS:
        if python_of(runtime) is not None:
            return runtime
    raise SurgeryError("the check runs the folder in MLX-LM or vLLM, and neither is installed: "
                       f"{INSTALL['mlx']}, or {INSTALL['vllm']}")


def run(runtime: str, folder: Path, ids: torch.Tensor, vocab: int, new_tokens: int = NEW_TOKENS,
        dtype: str = "float32"):
    """``runtime``'s logits of ``ids`` [windows, tokens, vocab] in ``dtype`` (float64: ``FLOAT64``
    only) and greedy tokens after each window's first :data:`PROMPT` (``runtime_worker``, a
    process group of its own: ended, all of it, before this returns or raises). A SurgeryError
    when the runtime refuses the folder."""
    with tempfile.TemporaryDirectory(prefix="normsurgery-check-") as tmp:
        out, log = Path(tmp) / "run.npz", Path(tmp) / "stderr"
        request = {"runtime": runtime, "folder": str(folder), "ids": ids.tolist(), "prompt": PROMPT,
                   "new_tokens": new_tokens, "vocab": vocab, "out": str(out), "dtype": dtype}
        with open(log, "w") as stderr:  # a file, not a pipe: vLLM's engine processes would hold a pipe open
            proc = subprocess.Popen([python_of(runtime), "-I", str(WORKER)], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)
            try:
                proc.communicate(json.dumps(request))
            finally:  # ended or interrupted: the worker and every process it started (its group) go
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        err = log.read_text()
        why = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:300]
        if proc.returncode == 3:
            raise SurgeryError(f"{NAMES[runtime]} cannot load {folder}: {why}")
        if proc.returncode != 0 or not out.is_file():
            raise SurgeryError(f"{NAMES[runtime]} failed on {folder}: {why}")
        with np.load(out) as data:
            return torch.from_numpy(data["logits"]), torch.from_numpy(data["tokens"])


@dataclass
class Checked:
    runtime: str  # mlx or vllm
    parity: Comparison  # the runtime's logits against the torch model's; ``generation``: greedy tokens agreeing
    greedy: dict  # prompts, new tokens, first prompt's tokens both ways

    @property
    def ok(self) -> bool:
        return self.parity.ok and self.parity.generation == 1

    def failure(self) -> str | None:
        """What differs, in one line (None: nothing)."""
        p, name = self.parity, NAMES[self.runtime]
        if not p.ok:
            return f"{name}'s logits differ from the torch model's: {p.failed} ({p.reason})"
        if p.generation != 1:
            return f"{name}'s greedy tokens differ from transformers': {p.generation:.1%} of them agree"
        return None

    def as_dict(self) -> dict:
        return {"runtime": NAMES[self.runtime], "parity": self.parity.as_dict(), "greedy": self.greedy, "ok": self.ok}


def compare_runtime(runtime: str, folder: Path, model, tol: Tolerances, new_tokens: int = NEW_TOKENS) -> Checked:
    """``folder`` in ``runtime`` against ``model`` (torch, float32, a causal LM) on ``tol``'s probe
    (its ids and reference logits): logits judged by ``tol``, and greedy continuations of each
    window's first :data:`PROMPT` tokens."""
    ids, reference = tol.ids, tol.reference
    got, tokens = run(runtime, folder, ids, reference.shape[-1], new_tokens)
    if got.shape != reference.shape:
        raise SurgeryError(f"{NAMES[runtime]}'s logits have shape {tuple(got.shape)}, the torch model's "
                           f"{tuple(reference.shape)}")
    c = tol.judge(compare(reference, got.to(reference.device), "logits"))
    if runtime in FLOAT64 and tol.given is None and c.relative > TOLERANCE[torch.float32]:  # beyond 1e-5: its rounding
        exact, _ = run(runtime, folder, ids, reference.shape[-1], 0, "float64")
        c.judged(*runtime_tolerance(c, compare(exact, got).relative, NAMES[runtime]))
    prompts = ids[:, :PROMPT].to(reference.device)
    with torch.no_grad():  # the mask given: else generate masks the prompt's tokens that equal the pad id
        expected = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)[:, PROMPT:].cpu()
    c.generation = (tokens == expected).double().mean().item()
    return Checked(runtime, c, {"prompts": int(prompts.shape[0]), "new_tokens": new_tokens, "agree": c.generation,
                                runtime: tokens[0].tolist(), "transformers": expected[0].tolist()})


def probe(model, ids: torch.Tensor, tolerance: float | None = None) -> Tolerances:
    """The float32 judge of ``model``'s logits on ``ids`` (``tolerance``: given instead of the
    arithmetic's rounding), its reference computed once."""
    return Tolerances(model_reader(model, ids), ids, torch.float32, outputs(model, ids), tolerance, "logits")


def probe_for(source: Source, text: str | None, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Four probe windows of ``text`` (default: the bundled sample), short enough for a greedy
    continuation of :data:`PROMPT` tokens plus ``new_tokens`` within the model's positions."""
    n = max(PROMPT + 1, min(64, (source.positions or 64) - new_tokens - PROMPT))
    return probe_ids(source.tokenizer, source.config.vocab_size, text, 4, n)


def check(folder, reference=None, *, text: str | None = None, tolerance: float | None = None,
          new_tokens: int = NEW_TOKENS, allow_pickle: bool = False, runtime: str | None = None) -> Checked:
    """``folder`` (a written checkpoint the runtime reads) in ``runtime`` (:func:`choose`) against
    the checkpoint ``reference`` (default: the folder itself) in torch, float32 (``loader.load``:
    our runtime for rewritten ones), on probe windows of ``text`` tokenized by its tokenizer."""
    runtime = choose(runtime)
    source = Source.open(reference if reference is not None else folder, allow_pickle)
    model = load(source, torch.float32)
    tol = probe(model, probe_for(source, text, new_tokens), tolerance)
    return compare_runtime(runtime, Path(folder), model, tol, new_tokens)
