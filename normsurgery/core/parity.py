"""Do two models compute the same function? What a model outputs, the comparison, the tolerance.

A model is compared on what its class outputs (:func:`outputs`): logits for a head (LM or
classifier), the last hidden state for a base model. For token batches X, with reference outputs
A and candidate B (:func:`compare`, in float64, a slice of the last axis at a time):
- max |A - B|, mean |A - B| and the relative error max |A - B| / max |A|;
- logits: KL(softmax A || softmax B) averaged over positions; top-1 agreement of argmax;
- hidden states: the cosine of the mean-pooled embeddings (mean over tokens), worst sequence;
- causal LMs: greedy generation from a few prompts, the fraction of tokens that agree.

Tolerance (every comparison says which applied and why):
- arithmetic on weights held exactly: float64 checks the algebra (1e-10), float32 its rounding
  (1e-5). Deep float32 models round more than 1e-5 on their own (a 26-block Llama: 2.5e-5 from
  its float64 value): where a float32 comparison exceeds 1e-5, the tolerance becomes
  ``ROUNDING_FACTOR`` times the model's own float32 rounding, measured by one more forward with
  every linear output jittered by one ulp (:func:`jittered`; it tracks the distance to float64
  within 0.7-1.7x on six families of 2 to 26 blocks);
- weights stored coarser than the arithmetic (float16 or bfloat16 computed in float32, float32 in
  float64): a null distribution, what rounding alone does to the outputs. ``DRAWS`` seeded draws
  of the reference with the tensors in question (those of the reference the other model does not
  hold as they are) perturbed as storing them rounds (``precision.perturb``: uniform
  within half a spacing of the storage dtype), each compared with the reference in the same
  arithmetic (:func:`storage_tolerance`). The other model is the same function when its relative
  error is within ``ROUNDING_FACTOR`` x the draws' largest and, for logits, its KL within
  ``KL_FACTOR`` x theirs (KL grows with the square of a change). On Gemma-3-270M (bf16) the draws
  give relative 1.2e-2 and KL 1.2e-4 around a flashnorm rewrite (7.9e-3, 7.9e-5: same function)
  while the final gain x1.02 gives 2.1e-2 and 1.3e-3 against a null of 2.4e-3 and 4.4e-5;
- half-precision arithmetic (``verify --dtype bfloat16``): ``ROUNDING_FACTOR`` times the
  reference's own rounding in that arithmetic against float32.

HF's RMSNorm classes compute in float32 whatever the input dtype; ``norms.faithful_norms`` swaps
them for runtime.RMSNorm (same maths, input dtype kept) so float64 checks are float64 throughout.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from . import algebra, calibration, devices
from .algebra import TOLERANCE
from .analysis import evaluating, residual_states
from .errors import SurgeryError
from .families import layout, objective

#: a model may differ by this many times the reference's own rounding (or storage cost)
ROUNDING_FACTOR = 4
#: ... and its KL by this many times the null's: KL grows with the square of the outputs' change
KL_FACTOR = ROUNDING_FACTOR ** 2
#: seeded draws of the null distribution of what storing in a half-precision dtype costs
DRAWS = 3
#: norm kinds whose output depends on the stream only through x - mean(x)
CENTRING = ("layernorm", "compensated-layernorm", "crmsnorm")
#: entries of the last axis compared at a time (float64 temporaries of a few MB per row)
SLICE = 1 << 15


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
    kl_tolerance: float | None = None  # logits judged against a null distribution: the KL allowed
    null: dict | None = None  # that null distribution, each statistic at its worst over the draws
    layers: list[dict] = field(default_factory=list)
    streaming: str | None = None  # why the models were read one part at a time (None: in memory)
    device: dict | None = None  # where the outputs were computed (devices.describe), when a command chose it
    no_adapter: str | None = None  # a family without an adapter: only its stock class's outputs compared (verify)

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def failed(self) -> str | None:
        """The statistic beyond its tolerance, as "relative error 2.07e-02 > 9.6e-03" (None: within)."""
        if self.tolerance is not None and not self.relative <= self.tolerance:  # NaN fails
            return f"relative error {self.relative:.2e} > {self.tolerance:.2e}"
        if self.kl_tolerance is not None and self.kl is not None and not self.kl <= self.kl_tolerance:
            return f"KL {self.kl:.2e} > {self.kl_tolerance:.2e}"
        return None

    def judged(self, tolerance: float | None, reason: str | None, kl_tolerance: float | None = None) -> Comparison:
        self.tolerance, self.reason, self.kl_tolerance = tolerance, reason, kl_tolerance
        return self

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "failed": self.failed}


def beyond(c: Comparison) -> str:
    """What failed, as "relative error 2.07e-02 > 9.6e-03 (why the tolerance)"."""
    return (c.failed or f"relative error {c.relative:.2e}") + (f" ({c.reason})" if c.reason else "")


def output_kind(model) -> str:
    """"logits" for a head, "last hidden state" for a base model (``families.objective``: no layout needed)."""
    return "logits" if objective(model) != "none" else "last hidden state"


def probe_ids(tokenizer, vocab_size: int, text: str | None, n: int = 4, length: int = 64,
              seed: int = 0) -> torch.Tensor:
    """n evenly spaced windows of ``length`` tokens of ``text`` (default: the bundled held-out
    sample), each after the tokens the tokenizer puts before any text (Gemma's <bos>: without it
    Gemma-3 is in a degenerate regime where re-rounding its weights costs 3x the relative error and
    7x the KL); random ids when the checkpoint has no tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (n, length), generator=g)
    first = leading_special(tokenizer)[: length - 1]
    ids = calibration.tokenize(tokenizer, text if text is not None else calibration.bundled_text())
    windows = calibration.windows(ids, length - len(first), n)
    return torch.cat([torch.tensor(first, dtype=windows.dtype).expand(windows.shape[0], -1), windows], 1)


def leading_special(tokenizer) -> list[int]:
    """The ids the tokenizer adds before a text of its own accord (a BOS, BERT's [CLS]; none for
    GPT-2 or Qwen)."""
    bare = tokenizer("a b", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b")["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return list(full[:i])
    return []


@torch.no_grad()
def outputs(model, ids: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """What the model's class outputs on ``ids`` (logits for a head, the last hidden state for a
    base model) in its dtype, at least float32; one forward pass on ``device`` (default: where the
    model is, ``devices.of``).

    A sequence classifier reads each row's last token that is not padding; without a pad token
    transformers refuses batches. The probe has no padding, so a pad id no row holds (-1) makes
    it read every row's last token, as each row alone would."""
    kind = objective(model)
    kwargs = {"use_cache": False} if kind == "causal-lm" else {}
    with unpadded(model), evaluating(model):
        out = model(input_ids=ids.to(device or devices.of(model)), **kwargs)
    out = out.logits if kind != "none" else out.last_hidden_state
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


@contextmanager
def unpadded(model):
    """A sequence classifier without a pad token: while active, its pad id is one no row holds
    (-1), so it reads every row's last token (nothing else changes)."""
    text = model.config.get_text_config()
    if objective(model) != "sequence-classification" or text.pad_token_id is not None:
        yield
        return
    text.pad_token_id = -1
    try:
        yield
    finally:
        text.pad_token_id = None




def compare(ref: torch.Tensor, out: torch.Tensor, output: str = "logits") -> Comparison:
    """The metrics, in float64, one sequence and one slice of the last axis at a time (a batch of
    vocabulary-sized float64 copies would cost more memory than the model).

    KL per position: sum_v p_v (a_v - b_v) + lse(b) - lse(a), p = softmax(a)."""
    if isinstance(ref, HeadInput) or isinstance(out, HeadInput):
        return compare_slabs(ref, out)
    if ref.shape != out.shape:
        raise SurgeryError(f"the models' {output} differ in shape: {tuple(ref.shape)} vs {tuple(out.shape)}")
    hidden = output != "logits"
    width = ref.shape[-1]
    max_abs = abs_sum = kl = agree = ref_max = 0.0
    cosine = 1.0
    for r, o in zip(ref.reshape(-1, *ref.shape[-2:]), out.reshape(-1, *out.shape[-2:])):
        if hidden:
            cosine = min(cosine, torch.cosine_similarity(r.double().mean(0), o.double().mean(0), dim=0).item())
        else:
            lse_r, lse_o = _logsumexp(r), _logsumexp(o)
            cross = torch.zeros(r.shape[0], dtype=torch.float64)
            agree += (r.argmax(-1) == o.argmax(-1)).sum().item()
        for i in range(0, width, SLICE):
            a, b = r[:, i:i + SLICE].double(), o[:, i:i + SLICE].double()
            d = (a - b).abs()
            max_abs, abs_sum = max(max_abs, d.max().item()), abs_sum + d.sum().item()
            ref_max = max(ref_max, a.abs().max().item())
            if not hidden:
                cross += ((a - lse_r[:, None]).exp() * (a - b)).sum(-1)
        if not hidden:
            kl += (cross + lse_o - lse_r).sum().item()
    relative = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else 1.0)
    if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(out).all())):  # max() skips NaN
        max_abs = relative = float("nan")
    if hidden:
        return Comparison(max_abs, abs_sum / ref.numel(), relative, None, None, cosine, output)
    positions = ref[..., 0].numel()
    return Comparison(max_abs, abs_sum / ref.numel(), relative, max(kl / positions, 0.0), agree / positions)


@dataclass
class HeadInput:
    """Logits kept compact: the head's input and its rows, read a slab at a time when compared
    (:func:`compare`), instead of positions x vocabulary values (152k columns: 155 MB per 256
    positions in float32, held several times by a check).

    ``hidden``: the head's input [..., T, d]; ``rows(start, stop)``: rows start..stop of the head's
    weight [n, d] (read from the checkpoint, in ``hidden``'s dtype); ``bias``: the head's bias or None."""

    hidden: torch.Tensor
    rows: Callable[[int, int], torch.Tensor]
    bias: torch.Tensor | None
    vocab: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.hidden.shape[:-1], self.vocab)

    def slab(self, start: int, stop: int) -> torch.Tensor:
        """The logits of columns start..stop, [..., T, stop - start]."""
        w = self.rows(start, stop).to(self.hidden.device, self.hidden.dtype)
        b = None if self.bias is None else self.bias[start:stop]
        return torch.nn.functional.linear(self.hidden, w, b)


def _columns(x, start: int, stop: int) -> torch.Tensor:
    """Columns start..stop of full outputs or of :class:`HeadInput`, as [positions, n] float64 on the CPU."""
    c = x.slab(start, stop) if isinstance(x, HeadInput) else x[..., start:stop]
    return c.reshape(-1, stop - start).to(devices.HOST, torch.float64)


def compare_slabs(ref, out) -> Comparison:
    """:func:`compare` of logits a slab of the vocabulary at a time, either side full outputs or a
    :class:`HeadInput`: what is kept per position is a running maximum and sum for each
    logsumexp, the KL's cross term (rescaled as the maximum moves) and each side's best column,
    so no positions x vocabulary tensor is held (temporaries of about 8 MB)."""
    if tuple(ref.shape) != tuple(out.shape):
        raise SurgeryError(f"the models' logits differ in shape: {tuple(ref.shape)} vs {tuple(out.shape)}")
    width = ref.shape[-1]
    n = math.prod(ref.shape[:-1])
    step = max(256, (1 << 20) // max(n, 1))
    neg = torch.full((n,), -math.inf, dtype=torch.float64)
    zero = torch.zeros(n, dtype=torch.float64)
    m_a, s_a, cross, m_b, s_b = neg.clone(), zero.clone(), zero.clone(), neg.clone(), zero.clone()
    best_a, best_b = neg.clone(), neg.clone()
    arg_a, arg_b = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    max_abs = abs_sum = ref_max = 0.0
    finite = True
    for i in range(0, width, step):
        j = min(width, i + step)
        a, b = _columns(ref, i, j), _columns(out, i, j)
        finite = finite and bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
        d = (a - b).abs()
        max_abs, abs_sum = max(max_abs, d.max().item()), abs_sum + d.sum().item()
        ref_max = max(ref_max, a.abs().max().item())
        for x, m, s, best, arg in ((a, m_a, s_a, best_a, arg_a), (b, m_b, s_b, best_b, arg_b)):
            top, where = x.max(-1)
            better = top > best  # strictly: the first of equal maxima, as argmax over the whole row
            best.copy_(torch.where(better, top, best))
            arg.copy_(torch.where(better, where + i, arg))
            new = torch.maximum(m, top)
            scale = (m - new).exp()
            e = (x - new[:, None]).exp()
            if x is a:
                cross.mul_(scale).add_((e * (a - b)).sum(-1))
            s.mul_(scale).add_(e.sum(-1))
            m.copy_(new)
    relative = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else 1.0)
    if not finite:
        max_abs = relative = float("nan")
    kl = (cross / s_a + (m_b + s_b.log()) - (m_a + s_a.log())).sum().item()
    top1 = (arg_a == arg_b).double().mean().item()
    return Comparison(max_abs, abs_sum / (n * width), relative, max(kl / n, 0.0), top1)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last axis in float64, a slice at a time."""
    m = x.max(-1).values.double()
    s = torch.zeros_like(m)
    for i in range(0, x.shape[-1], SLICE):
        s += (x[:, i:i + SLICE].double() - m[:, None]).exp().sum(-1)
    return m + s.log()


def coarser(storage: torch.dtype, compute: torch.dtype) -> bool:
    """True when weights stored in ``storage`` hold fewer digits than ``compute`` arithmetic: a
    rewrite computed in ``compute`` is rounded when it is stored."""
    return torch.finfo(storage).eps > torch.finfo(compute).eps


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tolerance(compute: torch.dtype, storage: torch.dtype, null: Callable[[], list[Comparison]] | None,
              what: str = "the reference with the tensors that differ") -> tuple[float, str, float | None]:
    """(relative tolerance, why, KL tolerance or None) for ``compute`` arithmetic on weights stored
    in ``storage``. ``null()``: the reference against itself with the tensors in question perturbed
    as storing in ``storage`` rounds them, ``DRAWS`` times (for half-precision arithmetic: once, run
    in float32); measured only when called."""
    if compute not in TOLERANCE:
        own = null()[0]
        if not math.isfinite(own.relative):
            return TOLERANCE[torch.float32], _unmeasured(f"the reference's own {dtype_name(compute)} rounding"), None
        return (max(TOLERANCE[torch.float32], ROUNDING_FACTOR * own.relative),
                f"computed in {dtype_name(compute)}: {ROUNDING_FACTOR} x the reference's own "
                f"{dtype_name(compute)} rounding against float32 ({own.relative:.1e})", None)
    if not coarser(storage, compute):
        why = "checks the algebra" if compute == torch.float64 else "its rounding"
        return TOLERANCE[compute], f"{dtype_name(compute)} arithmetic on weights it holds exactly: {why}", None
    return storage_tolerance(compute, storage, null(), what)


def storage_tolerance(compute: torch.dtype, storage: torch.dtype, draws: list[Comparison],
                      what: str = "the reference with the tensors that differ") -> tuple[float, str, float | None]:
    """(relative tolerance, why, KL tolerance) from the null ``draws``: ``ROUNDING_FACTOR`` x their
    largest relative error (at least the arithmetic's own) and ``KL_FACTOR`` x their largest KL
    (logits; None for hidden states)."""
    worst = null_summary(draws)
    if not math.isfinite(worst.relative):
        return TOLERANCE[compute], _unmeasured(f"what storing in {dtype_name(storage)} costs"), None
    kl = None if worst.kl is None else KL_FACTOR * worst.kl
    return (max(TOLERANCE[compute], ROUNDING_FACTOR * worst.relative),
            f"weights stored in {dtype_name(storage)}: within {ROUNDING_FACTOR} x the relative error"
            + ("" if kl is None else f" and {KL_FACTOR} x the KL")
            + f" that rounding alone gives ({what} perturbed as storing in "
            f"{dtype_name(storage)} rounds them, {len(draws)} seeded draws: at most {worst.relative:.1e}"
            + ("" if kl is None else f", KL {worst.kl:.1e}") + ")", kl)


def null_summary(draws: list[Comparison]) -> Comparison:
    """The null draws as one comparison: each statistic at its worst (largest errors, lowest agreement)."""
    def most(f, pick=max):
        v = [x for d in draws if (x := getattr(d, f)) is not None and not math.isnan(x)]
        return pick(v) if v else None
    worst = Comparison(most("max_abs"), most("mean_abs"), most("relative"), most("kl"), most("top1", min),
                       most("cosine", min), draws[0].output)
    if any(math.isnan(d.relative) for d in draws):
        worst.relative = float("nan")
    return worst


def _unmeasured(what: str) -> str:
    return (f"{what} could not be measured (the reference's outputs, or those of its perturbed copy, hold NaN "
            f"or Inf); only the arithmetic's own tolerance applies")


#: entries of a linear's output jittered at a time: one factor temporary of 4 MB in float32, not one
#: of the output's size (a 152k-token head's logits on the probe: 156 MB)
JITTER_CHUNK = 1 << 20


@contextmanager
def jittered(model, seed: int = 0):
    """While active, every linear's output y becomes y (1 ± eps) (random signs, eps of y's dtype):
    one rounding error per output, so the model's outputs move by about its own rounding."""
    g = torch.Generator().manual_seed(seed)

    def hook(module, args, y):  # in place, factors 1 - eps or 1 + eps drawn JITTER_CHUNK at a time
        eps = torch.finfo(y.dtype).eps
        flat = y.reshape(-1)  # y itself where contiguous; the draws are the whole tensor's, in order
        for i in range(0, flat.numel(), JITTER_CHUNK):
            part = flat[i:i + JITTER_CHUNK]
            factor = torch.randint(0, 2, part.shape, generator=g, dtype=y.dtype).to(y.device)
            part.mul_(factor.mul_(2 * eps).add_(1 - eps))
        return flat.view(y.shape)

    handles = [m.register_forward_hook(hook) for m in model.modules() if algebra.is_linear(m)]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def rounding_tolerance(reference: torch.Tensor, jitter: torch.Tensor, dtype: torch.dtype,
                       output: str = "logits") -> tuple[float, str]:
    """(tolerance, why) from ``jitter``, the reference model's outputs under :func:`jittered`:
    ``ROUNDING_FACTOR`` times that rounding, at least the dtype's fixed tolerance."""
    noise = compare(reference, jitter, output).relative
    return (max(TOLERANCE[dtype], ROUNDING_FACTOR * noise),
            f"{dtype_name(dtype)} arithmetic: {ROUNDING_FACTOR} x the model's own {dtype_name(dtype)} rounding "
            f"({noise:.1e}, "
            f"every linear output jittered by one ulp), at least {TOLERANCE[dtype]:.0e}")


def runtime_tolerance(c: Comparison, noise: float, runtime: str) -> tuple[float, str]:
    """(tolerance, why) of ``c``, a runtime's float32 outputs against torch's float32 ones
    already judged on torch's own rounding (``c.tolerance``), given the runtime's own rounding
    ``noise`` (its float32 outputs against its float64 ones, same weights): both sides round, so
    ``ROUNDING_FACTOR`` x the larger of the two (at least 2 x their sum)."""
    own = f"{runtime}'s own float32 rounding ({noise:.1e}: its float32 outputs against its float64 ones, same weights)"
    if not ROUNDING_FACTOR * noise > c.tolerance:  # NaN: the torch side's tolerance stands
        return c.tolerance, f"{c.reason}; {own} within it"
    return (ROUNDING_FACTOR * noise, f"float32 arithmetic in two runtimes: {ROUNDING_FACTOR} x the larger rounding, "
                                     f"{own}; torch's tolerance {c.tolerance:.1e}: {c.reason}")


def needs_rounding_tolerance(comparisons, dtype: torch.dtype, given: float | None) -> bool:
    """True when a float32 check with the fixed tolerance failed and none was given: the model
    may round more than that on its own (deep models), so measure it."""
    return given is None and dtype == torch.float32 and any(
        c is not None and c.tolerance == TOLERANCE[dtype] and not c.ok for c in comparisons)


@torch.no_grad()
def greedy_agreement(a, b, prompts: torch.Tensor, new_tokens: int = 16) -> float:
    """Fraction of greedily generated tokens (after the prompts) on which the models agree."""
    kw = dict(max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
              pad_token_id=0, eos_token_id=None)
    # the mask given: else generate masks the prompt's tokens that equal the pad id
    pa, pb = prompts.to(devices.of(a)), prompts.to(devices.of(b))
    ga = a.generate(pa, attention_mask=torch.ones_like(pa), **kw)[:, prompts.shape[1]:]
    gb = b.generate(pb, attention_mask=torch.ones_like(pb), **kw)[:, prompts.shape[1]:]
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
