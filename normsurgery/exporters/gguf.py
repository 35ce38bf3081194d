"""export --to gguf: a checkpoint as one GGUF file for llama.cpp (what is written: ``gguf_write``),
checked in llama.cpp itself before the file appears.

The check runs llama.cpp through xllamacpp (llama.cpp's server as a Python module, CPU) in a
process of its own (``llamacpp_worker``: its server, threads and loopback socket end with that
process, before the check goes on), then the checkpoint in transformers (float32; our runtime
for rewritten ones), read one part at a time (``check.read_outputs``, the streamed forward every
check uses), on ``--device``:

- ``PROMPTS`` windows of ``PROMPT_TOKENS`` tokens of the probe text; llama.cpp continues each by
  ``NEW_TOKENS`` greedy tokens (F32 key/value cache: only its arithmetic and the weights'
  storage type differ from torch) and gives, at each of their positions, the log-probability of
  every token of the vocabulary;
- transformers reads each prompt followed by llama.cpp's continuation (one forward) and gives
  its distributions at the same positions. Its greedy continuation equals llama.cpp's exactly
  when its most likely token is llama.cpp's at every position (each position sees the tokens
  both chose before it);
- compared as llama.cpp's KL-divergence tool (``llama-perplexity --kl-divergence``) names it:
  mean, median, 99.9th percentile and largest KLD (transformers' distribution || llama.cpp's)
  and "same top p" (positions where both put the same token first), over every generated
  position; and the relative error of the log-probabilities, max |a - b| / max |a| over the
  entries above ``LOG_FLOOR`` (llama.cpp's float32 softmax rounds smaller probabilities to
  subnormals and zero), which is what the file is judged by;
- the probe text tokenized by llama.cpp (its server's ``/tokenize``) and by transformers, alike.

Tolerance: llama.cpp's float32 kernels sum and exponentiate in other orders than torch:
``FLOOR`` = 1e-3 relative. Below F32 the weights are rounded as stored (F16, BF16, Q8_0) and
llama.cpp rounds the activations to the weights' type before each product: ``ROUNDING_FACTOR``
x what that rounding costs the reference in transformers (a second streamed forward, each
part's weights rounded as written when it is read and each product's input as llama.cpp's CPU
kernels round it: :func:`storing`), at least ``FLOOR``. (Rounding the weights alone is no
baseline for a checkpoint already stored in that type: a bf16 Llama written as BF16 costs
nothing to store, while llama.cpp's bf16 products differ from torch's float32 ones by 3e-2.)

Memory: the writer holds a tensor, transformers a part (``plan``: a block; the embeddings with
the first, the head with the last), llama.cpp's process maps the file (page cache; its own
high-water mark is reported apart: ``Exported.llama_cpp``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..core import algebra, calibration, devices, memory
from ..io import modelcard
from ..io.ours import GGUF
from ..engine.check import source_reader
from ..io.source import Source
from ..core.errors import SurgeryError
from .gguf_write import Plan, gguf_plan, qtype, rounded, vocab, write
from ..core.options import GGUF_DTYPES, ExportOptions
from ..engine.runner import Job, job_scope
from ..core.parity import Comparison, HeadInput, probe_ids
from ..io.shards import inside
from ..io.texts import text_of

INSTALL = "pip install 'normsurgery[gguf]'"
#: relative error llama.cpp's float32 arithmetic may differ by from torch's
FLOOR = 1e-3
#: a lower dtype may differ by this many times what storing the weights in it costs
ROUNDING_FACTOR = 4
#: prompts continued, their length, greedy tokens after each (each position's whole distribution compared)
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 2, 32, 32
#: log-probabilities under this (in transformers) are left out of the relative error: llama.cpp's
#: softmax is float32, so probabilities under about e^-87 are subnormals or zero there
LOG_FLOOR = -80.0
#: llama.cpp gives float32's lowest for a probability that is zero: clamped to the log of its least subnormal
LEAST = math.log(2.0 ** -149)
WORKER = Path(__file__).with_name("llamacpp_worker.py")


def require_gguf() -> None:
    """gguf and xllamacpp are an optional extra: refused with the install line when missing."""
    missing = [m for m in ("gguf", "xllamacpp") if importlib.util.find_spec(m) is None]
    if missing:
        raise SurgeryError(f"export to GGUF needs {' and '.join(missing)}, not installed: {INSTALL}")


# ----------------------------------------------------------------------------- llama.cpp


@dataclass
class Run:
    """What llama.cpp computed (``llamacpp_worker``)."""

    tokens: torch.Tensor  # [prompts, new tokens]: greedy
    logprobs: torch.Tensor  # [prompts, new tokens, vocab] float32: log-softmax of its logits at each
    text_tokens: list[int]
    info: dict  # the server's loopback address, threads, system info, xllamacpp's version, peak RSS


def run_llama(path: Path, prompts: torch.Tensor, new_tokens: int, text: str, vocab_size: int) -> Run:
    """``path`` loaded in llama.cpp in a process of its own (``llamacpp_worker``), ended before
    this returns; a SurgeryError (one line) when it cannot load the file or fails."""
    with tempfile.TemporaryDirectory(prefix="normsurgery-llama-") as tmp:
        out = Path(tmp) / "run.npz"
        request = {"model": str(path), "n_ctx": prompts.shape[1] + new_tokens + 8, "threads": torch.get_num_threads(),
                   "prompts": prompts.tolist(), "new_tokens": new_tokens, "vocab": vocab_size, "text": text,
                   "out": str(out)}
        proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(json.dumps(request))
        finally:  # interrupted: the worker goes too
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode == 3:
            raise SurgeryError(f"llama.cpp cannot load the GGUF written ({_why(err)}); nothing was written")
        if proc.returncode != 0 or not out.is_file():
            why = _why(err) or (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                                else f"exit status {proc.returncode}")
            raise SurgeryError(f"llama.cpp (xllamacpp) failed on the GGUF written ({why}); nothing was written")
        with np.load(out) as data:
            run = Run(torch.from_numpy(data["tokens"]), torch.from_numpy(data["logprobs"]),
                      data["text_tokens"].tolist(), json.loads(Path(f"{out}.json").read_text()))
    return run


def _why(stderr: str) -> str:
    """The line of llama.cpp's log (errors only) or of the worker that says why, without its prefix."""
    lines = [re.sub(r"^[\d.]+ [EWID] +", "", line).strip() for line in stderr.splitlines() if line.strip()]
    for mark in ("error loading model: ", "error: "):
        for line in lines:
            if mark in line:
                return line.split(mark, 1)[1][:300]
    return lines[-1][:300] if lines else ""


# ----------------------------------------------------------------------------- transformers


def reference_rows(source: Source, ids: torch.Tensor, start: int, device, on_load: Callable | None = None):
    """transformers' logits at positions ``start``.. of ``ids`` ([prompts, positions, vocab],
    float32, on the CPU): the checkpoint read one part at a time (``check.read_outputs``);
    ``on_load``: a change to each part read (:func:`storing`)."""
    out = source_reader(source, ids, torch.float32, True, device)(on_load=on_load)
    if isinstance(out, HeadInput):
        head = HeadInput(out.hidden[:, start:], out.rows, out.bias, out.vocab)
        step = max(1, (1 << 24) // head.hidden.shape[-1])  # head rows read at a time: 64 MB in float32
        out = torch.cat([head.slab(i, min(i + step, head.vocab)).float().cpu() for i in range(0, head.vocab, step)],
                        -1)
    else:
        out = out[:, start:].float().cpu().clone()
    memory.trim()  # the parts freed go back to the system before the next forward or llama.cpp's run
    return out


def storing(p: Plan, dtype: str) -> Callable:
    """An ``on_load``: what llama.cpp's CPU kernels round, done to each part read. Its parameters
    rounded as ``gguf_write.write`` stores them in ``dtype`` (GPT-2's Conv1D weights in the
    orientation written), and the input of each product with such a weight rounded to the type
    the kernel computes that product in (ggml's ``vec_dot_type``: the weight's own, F16, BF16 or
    Q8_0 blocks), so a checkpoint already stored in that type still meets the rounding llama.cpp
    adds."""
    items = {it.param: it for it in p.items if it.param and qtype(dtype, it.shape) != qtype("f32", it.shape)}
    hooked: set[int] = set()

    def rounding(q):
        def hook(module, args):
            x = args[0]
            return (rounded(x.reshape(-1, x.shape[-1]), q).reshape(x.shape).to(x.device, x.dtype), *args[1:])
        return hook

    def load(model, part, keys_of) -> None:
        with torch.no_grad():
            for name, it in items.items():
                w = model.get_parameter(name)
                if w.device.type == "meta" or (part.scope and not inside(name, part.scope)):
                    continue
                view = w.T if it.flip else w
                rounded(view, qtype(dtype, it.shape), out=view)  # in place
        memory.trim()
        stored = {id(model.get_parameter(name)): qtype(dtype, it.shape) for name, it in items.items()}
        for mod in model.modules():
            q = stored.get(id(getattr(mod, "weight", None)))
            if q is not None and algebra.is_linear(mod) and id(mod) not in hooked:
                mod.register_forward_pre_hook(rounding(q))
                hooked.add(id(mod))
    return load


# ----------------------------------------------------------------------------- the comparison


def distributions(reference: torch.Tensor, got: torch.Tensor) -> tuple[Comparison, dict]:
    """transformers' logits ``reference`` against llama.cpp's log-probabilities ``got`` ([positions,
    vocab]), a position at a time in float64: the relative error of the log-probabilities (entries
    above ``LOG_FLOOR``), mean KL and top-1 as a ``parity.Comparison``, and the statistics of
    llama.cpp's KL-divergence tool (module docstring)."""
    kls, tops = [], []
    max_abs = abs_sum = ref_max = 0.0
    kept = 0
    finite = bool(torch.isfinite(reference).all()) and not bool(torch.isnan(got).any())
    for r, g in zip(reference, got):
        a = torch.log_softmax(r.double(), -1)
        b = g.double().clamp_min(LEAST)
        keep = a > LOG_FLOOR
        d = (a - b).abs()[keep]
        kept += int(keep.sum())
        max_abs, abs_sum = max(max_abs, d.max().item()), abs_sum + d.sum().item()
        ref_max = max(ref_max, a[keep].abs().max().item())
        kls.append(max(0.0, (a.exp() * (a - b)).sum().item()))
        tops.append(bool(a.argmax() == b.argmax()))
    relative = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else 1.0)
    if not finite:
        max_abs = relative = float("nan")
    kl = torch.tensor(kls, dtype=torch.float64)
    c = Comparison(max_abs, abs_sum / max(kept, 1), relative, kl.mean().item(), sum(tops) / len(tops),
                   output="log-probabilities")
    stats = {"positions": len(kls), "mean_kld": kl.mean().item(), "median_kld": kl.median().item(),
             "kld_99_9": torch.quantile(kl, 0.999).item(), "max_kld": kl.max().item(),
             "same_top_p": 100.0 * sum(tops) / len(tops), "entries_compared": kept,
             "entries_below_floor": reference.numel() - kept}
    return c, stats


def rounding_tolerance(source: Source, p: Plan, dtype: str, ids: torch.Tensor, start: int, reference: torch.Tensor,
              device) -> tuple[float, str]:
    """(tolerance, why) of ``dtype`` (module docstring). Below F32 the baseline is measured: the
    reference read again rounded as llama.cpp rounds (:func:`storing`), compared as llama.cpp is."""
    if dtype == "f32":
        return FLOOR, f"F32 weights: llama.cpp's float32 arithmetic against torch's, {FLOOR:.0e}"
    stored = reference_rows(source, ids, start, device, on_load=storing(p, dtype))
    vocab_size = reference.shape[-1]
    own = distributions(reference.reshape(-1, vocab_size),
                        torch.log_softmax(stored.reshape(-1, vocab_size).double(), -1).float())[0].relative
    return (max(FLOOR, ROUNDING_FACTOR * own),
            f"{dtype.upper()} weights: {ROUNDING_FACTOR} x what storing them so, and each product's input "
            f"in {dtype.upper()}, costs the model in torch ({own:.1e}), at least {FLOOR:.0e}")


@dataclass
class LlamaCheck:
    parity: Comparison  # llama.cpp's log-probabilities against transformers' at the generated positions
    distributions: dict  # KLD statistics (llama.cpp's KL-divergence tool's)
    greedy: dict  # prompts, new tokens, tokens agreeing before the first difference, the first prompt's
    tokenizer: dict  # llama.cpp's tokens of the text equal transformers'
    llama_cpp: dict = field(default_factory=dict)  # the run: threads, address, system info, peak RSS


def check(source: Source, path: Path, p: Plan, dtype: str, text: str | None, tol: float | None,
          device) -> LlamaCheck:
    """Run ``path`` in llama.cpp and compare it with the checkpoint in transformers on ``device``
    (module docstring). The tolerance: ``tol``, else :func:`rounding_tolerance`."""
    positions = source.positions or 2048
    new = min(NEW_TOKENS, positions // 2)
    m = max(2, min(PROMPT_TOKENS, positions - new))
    vocab_size = int(source.config.vocab_size)
    prompts = probe_ids(source.tokenizer, vocab_size, text, PROMPTS, m)
    sample = (text if text is not None else calibration.bundled_text())[:2000]
    run = run_llama(path, prompts, new, sample, vocab_size)
    ids = torch.cat([prompts, run.tokens[:, :-1]], 1)  # each prompt and llama.cpp's continuation
    reference = reference_rows(source, ids, m - 1, device)  # [prompts, new, vocab]
    c, stats = distributions(reference.reshape(-1, vocab_size), run.logprobs.reshape(-1, vocab_size))
    c.judged(*((tol, "given") if tol is not None else
               rounding_tolerance(source, p, dtype, ids, m - 1, reference, device)))
    best = reference.argmax(-1)  # transformers' choice after the tokens both chose before
    before = [int((b == t).long().cumprod(0).sum()) for b, t in zip(best, run.tokens)]
    c.generation = sum(before) / (len(before) * new)
    k = before[0]
    greedy = {"prompts": len(before), "new_tokens": new, "agree": c.generation, "equal": min(before) == new,
              "prompt": prompts[0].tolist(), "llama.cpp": run.tokens[0].tolist(),
              "transformers": run.tokens[0, :k].tolist() + ([int(best[0, k])] if k < new else [])}
    theirs = source.tokenizer(sample)["input_ids"]
    ours = run.text_tokens
    same = ours == theirs
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return LlamaCheck(c, stats, greedy, {"equal": same, "tokens": len(theirs), "first_difference": None if same else first},
                 run.info)


# ----------------------------------------------------------------------------- export


@dataclass
class Exported:
    saved: dict  # path, card, bytes
    arch: str
    dtype: str
    eps_trick: bool
    widths: dict
    pre_tokenizer: str
    parity: Comparison
    distributions: dict
    greedy: dict
    tokenizer: dict
    llama_cpp: dict

    def as_dict(self) -> dict:
        return {"saved": self.saved, "format": "gguf", "arch": self.arch, "dtype": self.dtype,
                "eps_trick": self.eps_trick, "widths": self.widths, "pre_tokenizer": self.pre_tokenizer,
                "parity": self.parity.as_dict(), "distributions": self.distributions, "greedy": self.greedy,
                "tokenizer": self.tokenizer, "llama_cpp": self.llama_cpp, "ok": self.parity.ok}


#: --dtype auto: the type the checkpoint stores its weights in (float64, which no GGUF matrix type holds: F32)
STORED = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f32"}


def file_dtype(dtype: str, storage: torch.dtype) -> str:
    """The matrices' type of ``--dtype dtype`` for a checkpoint stored in ``storage``: ``auto`` its own."""
    return STORED[storage] if dtype == "auto" else dtype


@job_scope
def export(src, dest, options: ExportOptions | None = None, *, text: str | None = None,
           change: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Exported:
    """``src`` written to the file ``dest`` in GGUF and checked in llama.cpp (module docstring),
    with ``options`` (``ExportOptions``: ``dtype``, None: ``GGUF_DTYPES[0]``, auto: the checkpoint's
    storage type, :func:`file_dtype`), transformers' side
    computed on its ``device`` (llama.cpp's on the CPU); raises SurgeryError,
    leaving nothing (no file, no folder), when the check fails. The output is claimed as a file by
    the one runner (``runner.Job``) and written into its stage: the file appears only once checked,
    with its card ``dest.md`` beside it.
    ``change(name, values)``: a last change to each tensor written (tests: a wrong weight)."""
    options = options or ExportOptions(to="gguf")
    dtype, tolerance, force = options.dtype or GGUF_DTYPES[0], options.tolerance, options.force
    allow_pickle, device = options.allow_pickle, options.device
    require_gguf()
    text = text_of(text)
    options.check()
    job = Job.open(src, dest, force=force, allow_pickle=allow_pickle, device=device, file=GGUF)
    source, dest = job.source, job.out
    dtype = file_dtype(dtype, source.storage)
    p, model = gguf_plan(source)
    voc = vocab(source)
    with job.staged() as stage:
        size = write(source, model, p, voc, stage.path / dest.name, dtype, change)
        memory.trim()
        result = check(source, stage.path / dest.name, p, dtype, text, tolerance, job.device)
        c, k = result.parity, result.distributions
        if not c.ok:
            raise SurgeryError(f"llama.cpp's log-probabilities differ from transformers': relative error "
                               f"{c.relative:.2e} > {c.tolerance:.1e} ({c.reason}); mean KLD {k['mean_kld']:.2e}, "
                               f"same top p {k['same_top_p']:.1f}%; nothing was written")
        if not result.tokenizer["equal"]:
            raise SurgeryError(f"llama.cpp tokenizes the text differently from transformers (first at token "
                               f"{result.tokenizer['first_difference']}); nothing was written")
        c.device = devices.describe(job.device)
        out = Exported({"path": str(dest), "card": f"{dest}.md", "bytes": size}, p.arch, dtype, p.eps_trick,
                       p.widths, voc.pre, c, k, result.greedy, result.tokenizer, result.llama_cpp)
        stage.card("gguf", stage.path, name=dest.name, source=source.name, config=source.config, result=out.as_dict(),
                   kept=modelcard.source_header(source.path / modelcard.CARD))
    return out
