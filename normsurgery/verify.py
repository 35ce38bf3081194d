"""Do two models compute the same function? Output, distribution, top-1 and generation checks.

A model is compared on what its class outputs: logits for a head (LM or classifier), the last
hidden state for a base model. For token batches X, with reference outputs A and candidate B:
- max |A - B|, mean |A - B| and the relative error max |A - B| / max |A|;
- logits: KL(softmax A || softmax B) averaged over positions; top-1 agreement of argmax;
- hidden states: the cosine of the mean-pooled embeddings (mean over tokens), worst sequence;
- causal LMs: greedy generation from a few prompts: fraction of generated tokens that agree.

Tolerance, by precision. Arithmetic on weights held exactly: float64 checks the algebra (1e-10),
float32 its rounding (1e-5). Weights stored coarser than the compute dtype (or a half-precision
compute dtype) cannot do better than that precision allows: the tolerance is then
``ROUNDING_FACTOR`` times the reference's own rounding, measured by running the reference in
that dtype (at least the arithmetic's tolerance). Deep float32 models round more than 1e-5 on
their own (a 26-block Llama: 2.5e-5 from its float64 value): where a float32 comparison exceeds
1e-5, the tolerance becomes ``ROUNDING_FACTOR`` times the model's own float32 rounding, measured by
one more forward with every linear output jittered by one ulp (:func:`jittered`; it tracks the
distance to float64 within 0.7-1.7x on six families of 2 to 26 blocks). Every comparison says
which tolerance applied and why.

HF's RMSNorm classes compute in float32 whatever the input dtype; ``norms.faithful_norms`` swaps
them for runtime.RMSNorm (same maths, input dtype kept) so float64 checks are float64 throughout.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import calibration, checkpoint
from .algebra import TOLERANCE
from .errors import SurgeryError
from .families import architecture, layout, stock_class_of
from .norms import faithful_norms

#: a model stored in a coarser dtype may differ by this many times the reference's own rounding in it
ROUNDING_FACTOR = 4
#: norm kinds whose output depends on the stream only through x - mean(x)
CENTRING = ("layernorm", "compensated-layernorm", "crmsnorm")


@dataclass
class Comparison:
    max_abs: float
    mean_abs: float
    relative: float
    kl: float | None  # logits only
    top1: float | None  # logits only
    cosine: float | None = None  # hidden states only: mean-pooled embeddings, worst sequence
    output: str = "logits"  # "logits" | "last hidden state"
    generation: float | None = None
    tolerance: float | None = None
    reason: str | None = None  # why this tolerance
    layers: list[dict] = field(default_factory=list)
    streaming: str | None = None  # why the models were read one block at a time (None: in memory)

    @property
    def ok(self) -> bool:
        return self.tolerance is None or self.relative <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def output_kind(model) -> str:
    return "logits" if layout(model).head is not None else "last hidden state"


def probe_ids(model, tokenizer, text: str | None, n: int = 4, length: int = 64, seed: int = 0) -> torch.Tensor:
    """n evenly spaced windows of ``length`` tokens of ``text`` (default: the bundled held-out
    sample); random ids when the checkpoint has no tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, model.config.vocab_size, (n, length), generator=g)
    ids = calibration.tokenize(tokenizer, text if text is not None else calibration.bundled_text())
    return calibration.windows(ids, length, n)


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """What the model's class outputs (logits for a head, the last hidden state for a base
    model) in its dtype, at least float32 (compare_logits works in float64 by rows).

    A sequence classifier without a pad token cannot find each row's last token in a batch:
    it runs one row at a time."""
    if len(ids) > 1 and layout(model).objective == "sequence-classification" and model.config.pad_token_id is None:
        return torch.cat([logits(model, row[None]) for row in ids])
    out = model(input_ids=ids.to(model.device))
    out = out.logits if output_kind(model) == "logits" else out.last_hidden_state
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


def compare_logits(ref: torch.Tensor, out: torch.Tensor, output: str = "logits") -> Comparison:
    """The metrics, computed in float64 one sequence at a time (a batch of vocab-sized float64
    copies would cost more memory than the model)."""
    if ref.shape != out.shape:
        raise SurgeryError(f"the models' {output} differ in shape: {tuple(ref.shape)} vs {tuple(out.shape)}")
    hidden = output != "logits"
    max_abs = abs_sum = kl = agree = 0.0
    ref_max, cosine = 0.0, 1.0
    for r, o in zip(ref.reshape(-1, *ref.shape[-2:]), out.reshape(-1, *out.shape[-2:])):
        r, o = r.double(), o.double()
        d = (r - o).abs()
        max_abs, abs_sum = max(max_abs, d.max().item()), abs_sum + d.sum().item()
        ref_max = max(ref_max, r.abs().max().item())
        if hidden:
            cosine = min(cosine, torch.cosine_similarity(r.mean(0), o.mean(0), dim=0).item())
        else:
            logp, logq = r.log_softmax(-1), o.log_softmax(-1)
            kl += (logp.exp() * (logp - logq)).sum().item()
            agree += (r.argmax(-1) == o.argmax(-1)).sum().item()
    positions = ref[..., 0].numel()
    relative = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else 1.0)
    if hidden:
        return Comparison(max_abs, abs_sum / ref.numel(), relative, None, None, cosine, output)
    return Comparison(max_abs, abs_sum / ref.numel(), relative, max(kl / positions, 0.0), agree / positions)


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def in_dtype(model, dtype: torch.dtype, ids, reference: torch.Tensor) -> Comparison:
    """``model`` run in ``dtype`` against its ``reference`` outputs in its own dtype. Casting
    back restores weights exactly when they were read from ``dtype`` (or the cast went up);
    buffers (rotary frequencies) were computed in the model's dtype: they are kept."""
    work = next(model.parameters()).dtype
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to(dtype)
    try:
        return compare_logits(reference, logits(model, ids), output_kind(model))
    finally:
        model.to(work)
        for name, b in buffers.items():
            model.get_buffer(name).copy_(b)


def tolerance_for(model, ids, storage: torch.dtype, reference: torch.Tensor) -> tuple[float, str, Comparison | None]:
    """(tolerance, why, the reference's own rounding or None) for comparing a model whose weights
    are stored in ``storage`` against ``model`` (the reference, outputs ``reference``)."""
    compute = next(model.parameters()).dtype
    if compute not in TOLERANCE:  # half-precision arithmetic: measured against float32
        own = in_dtype(model, torch.float32, ids, reference)
        tol = max(TOLERANCE[torch.float32], ROUNDING_FACTOR * own.relative)
        return tol, (f"computed in {_name(compute)}: {ROUNDING_FACTOR} x the reference's own {_name(compute)} "
                     f"rounding against float32 ({own.relative:.1e})"), own
    return storage_tolerance(compute, storage, lambda dtype: in_dtype(model, dtype, ids, reference))


def storage_tolerance(compute: torch.dtype, storage: torch.dtype,
                      own_rounding: Callable[[torch.dtype], Comparison]) -> tuple[float, str, Comparison | None]:
    """(tolerance, why, the reference's own rounding or None) for ``compute`` arithmetic on
    weights stored in ``storage``; ``own_rounding(dtype)``: the reference run in ``dtype`` against
    its own outputs, measured only when ``storage`` is the coarser (in memory or streamed)."""
    if torch.finfo(storage).eps <= torch.finfo(compute).eps:
        why = "checks the algebra" if compute == torch.float64 else "its rounding"
        return TOLERANCE[compute], f"{_name(compute)} arithmetic on weights it holds exactly: {why}", None
    own = own_rounding(storage)
    tol = max(TOLERANCE[compute], ROUNDING_FACTOR * own.relative)
    return tol, (f"weights stored in {_name(storage)}: {ROUNDING_FACTOR} x the reference's own rounding in "
                 f"{_name(storage)} ({own.relative:.1e}), at least {TOLERANCE[compute]:.0e} for "
                 f"{_name(compute)} arithmetic"), own


@contextmanager
def jittered(model, seed: int = 0):
    """While active, every linear's output y becomes y (1 ± eps) (random signs, eps of y's dtype):
    one rounding error per output, so the model's outputs move by about its own rounding."""
    g = torch.Generator().manual_seed(seed)

    def hook(module, args, y):  # in place, one temporary: factors 1 - eps or 1 + eps
        eps = torch.finfo(y.dtype).eps
        factor = torch.randint(0, 2, y.shape, generator=g, dtype=y.dtype).to(y.device)
        return y.mul_(factor.mul_(2 * eps).add_(1 - eps))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Linear, Conv1D))]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def rounding_tolerance(reference: torch.Tensor, jitter: torch.Tensor, dtype: torch.dtype,
                       output: str = "logits") -> tuple[float, str]:
    """(tolerance, why) from ``jitter``, the reference model's outputs under :func:`jittered`:
    ``ROUNDING_FACTOR`` times that rounding, at least the dtype's fixed tolerance."""
    noise = compare_logits(reference, jitter, output).relative
    name = _name(dtype)
    return (max(TOLERANCE[dtype], ROUNDING_FACTOR * noise),
            f"{name} arithmetic: {ROUNDING_FACTOR} x the model's own {name} rounding ({noise:.1e}, every linear "
            f"output jittered by one ulp), at least {TOLERANCE[dtype]:.0e}")


def needs_rounding_tolerance(comparisons, dtype: torch.dtype, given: float | None) -> bool:
    """True when a float32 check with the fixed tolerance failed and none was given: the model
    may round more than that on its own (deep models), so measure it."""
    return given is None and dtype == torch.float32 and any(
        c is not None and c.tolerance is not None and not c.ok for c in comparisons)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def greedy_agreement(a, b, prompts: torch.Tensor, new_tokens: int = 16) -> float:
    """Fraction of greedily generated tokens (after the prompts) on which the models agree."""
    kw = dict(max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
              pad_token_id=0, eos_token_id=None)
    ga = a.generate(prompts.to(a.device), **kw)[:, prompts.shape[1]:]
    gb = b.generate(prompts.to(b.device), **kw)[:, prompts.shape[1]:]
    return (ga.cpu() == gb.cpu()).double().mean().item()


@torch.no_grad()
def layer_differences(a, b, ids: torch.Tensor) -> list[dict]:
    """max |h_a - h_b| / max |h_a| for each residual state h_0..h_L: the input of every block,
    then the last block's output, which is the final norm's input (the final norm's output is
    not compared: flashnorm moves its gain into the head, so it differs by design; the head's
    logits, or a base model's last hidden state, are compared above).

    Compared in a common basis: where the reference's norms all remove the mean (LayerNorm), the
    function sees only x - mean(x), so both streams are centred (pre-rmsnorm centres the stream
    and differs from the input only by its mean); a CRMSNorm stream stores d-1 coordinates of
    a zero-mean d-vector, whose last coordinate -sum(x~) is restored. Streams whose widths differ
    otherwise (channels removed) have no common basis: no figure, and the row says why."""
    from .prune import residual_states

    la, lb = layout(a), layout(b)
    centre = la.placement != "post" and bool(la.norms) and all(s.kind in CENTRING for s in la.norms)
    ha, hb = residual_states(a, ids), residual_states(b, ids)
    rows = []
    for i, (x, y) in enumerate(zip(ha, hb)):
        what = f"input of block {i}" if i < len(ha) - 1 else "last block's output (the final norm's input)"
        row = {"state": i, "what": what, "relative": None, "basis": "centred" if centre else "as stored", "note": None}
        x, y = x.double(), y.double()
        if y.shape[-1] == x.shape[-1] - 1 and "crmsnorm" in lb.norm_kinds:
            y = torch.cat([y, -y.sum(-1, keepdim=True)], -1)
            row["note"] = "CRMSNorm stream: its d-th coordinate -sum(x~) restored"
        if x.shape != y.shape:
            row["note"] = (f"stream widths differ ({x.shape[-1]} vs {y.shape[-1]}): channels were removed, "
                           "so there is no common basis to compare in")
            rows.append(row)
            continue
        if centre:
            x, y = x - x.mean(-1, keepdim=True), y - y.mean(-1, keepdim=True)
        row["relative"] = ((x - y).abs().max() / x.abs().max().clamp_min(1e-300)).item()
        rows.append(row)
    return rows


def compare_models(a, b, ids: torch.Tensor, *, tolerance: float | None = None, generate: int = 16,
                   per_layer: bool = False, storage: torch.dtype | None = None) -> Comparison:
    """Compare model ``b`` against reference ``a`` on ``ids``; without ``tolerance``, the one
    the precision allows (``storage``: the coarser dtype the two store their weights in)."""
    if stock_class_of(a) is not stock_class_of(b):
        raise SurgeryError(f"the models are of different classes ({stock_class_of(a).__name__} and "
                           f"{stock_class_of(b).__name__}): they do not output the same thing")
    ref = logits(a, ids)
    result = compare_logits(ref, logits(b, ids), output_kind(a))
    if tolerance is None:
        result.tolerance, result.reason, _ = tolerance_for(a, ids, storage or next(a.parameters()).dtype, ref)
        compute = next(a.parameters()).dtype
        if needs_rounding_tolerance([result], compute, tolerance) and result.tolerance == TOLERANCE[compute]:
            with jittered(a):
                jitter = logits(a, ids)
            result.tolerance, result.reason = rounding_tolerance(ref, jitter, compute, result.output)
    else:
        result.tolerance, result.reason = tolerance, "given"
    if generate and layout(a).objective == "causal-lm":
        result.generation = greedy_agreement(a, b, ids[:, : min(8, ids.shape[1])], generate)
    if per_layer:
        result.layers = layer_differences(a, b, ids)
    return result


def check_comparable(a, b) -> None:
    """Refuse, before loading, checkpoints whose outputs cannot be compared: of different
    architectures (family and class, from the family table) or vocabularies."""
    ca, cb = (checkpoint.load_config(checkpoint.resolve(x)) for x in (a, b))
    (fa, na), (fb, nb) = architecture(ca), architecture(cb)
    if (fa, na) != (fb, nb):
        raise SurgeryError(f"{a} is a {fa} model and {b} a {fb} one ({na} and {nb}): verify compares a checkpoint "
                           "with its rewrite, of the same architecture")
    if ca.vocab_size != cb.vocab_size:
        raise SurgeryError(f"{a} has a vocabulary of {ca.vocab_size} tokens and {b} of {cb.vocab_size}: "
                           "their logits cannot be compared")


def verify(a, b, *, text: str | None = None, dtype: torch.dtype = torch.float32,
           tolerance: float | None = None, n: int = 4, length: int = 64, generate: int = 16,
           per_layer: bool = False, streaming: bool | None = None) -> Comparison:
    """Load checkpoints (paths) or take models, run both in ``dtype`` and compare.

    ``streaming`` (checkpoints only): True reads one block at a time (``streaming.verify``: no
    generation, no per-layer figures), None does so when both models would not fit in memory;
    the comparison's ``streaming`` says why."""
    if not isinstance(a, torch.nn.Module) and not isinstance(b, torch.nn.Module):
        check_comparable(a, b)
        if streaming is not False:
            from . import streaming as stream

            pa, pb = checkpoint.resolve(a), checkpoint.resolve(b)
            why = "asked for (--streaming)" if streaming else stream.too_big([pa, pb], dtype, 1.1)
            if why:
                result = stream.verify(pa, pb, text=text, dtype=dtype, tolerance=tolerance, n=n, length=length)
                result.streaming = why
                return result
    ma, sa = _model(a, dtype)
    mb, sb = _model(b, dtype)
    if dtype == torch.float64:
        faithful_norms(ma)
        faithful_norms(mb)
    tok = checkpoint.load_tokenizer(a) if not isinstance(a, torch.nn.Module) else None
    length = min(length, getattr(ma.config, "max_position_embeddings", None) or getattr(ma.config, "n_positions", length))
    ids = probe_ids(ma, tok, text, n, length)
    return compare_models(ma, mb, ids, tolerance=tolerance, generate=generate, per_layer=per_layer,
                          storage=coarsest(sa, sb))


def _model(src, dtype: torch.dtype):
    """(model in ``dtype``, the dtype its weights are stored in)."""
    if isinstance(src, torch.nn.Module):
        return src, next(src.parameters()).dtype
    return checkpoint.load(src, dtype), checkpoint.storage_dtype(checkpoint.resolve(src))


def reload_check(model, ids: torch.Tensor, outputs: torch.Tensor | None = None):
    """A ``checkpoint.save`` check: a model loaded back from the written folder against
    ``model``'s outputs on ``ids`` (``outputs``: those, when computed already), within the
    tolerance of ``model``'s dtype."""
    ref = logits(model, ids) if outputs is None else outputs
    tol, why, _ = tolerance_for(model, ids, next(model.parameters()).dtype, ref)
    return outputs_check(ref, ids, output_kind(model), tol, why)


def outputs_check(reference: torch.Tensor, ids: torch.Tensor, output: str, tolerance: float,
                  reason: str) -> Callable[[torch.nn.Module], Comparison]:
    """A check of a model's outputs on ``ids`` against ``reference``, within ``tolerance``."""
    def check(model) -> Comparison:
        c = compare_logits(reference, logits(model, ids), output)
        c.tolerance, c.reason = tolerance, reason
        return c

    return check
