"""Do two models compute the same function? Logit, distribution, top-1 and generation checks.

For token batches X, with reference logits A and candidate logits B:
- max |A - B|, mean |A - B| and the relative error max |A - B| / max |A|;
- KL(softmax A || softmax B) averaged over positions; top-1 agreement of argmax;
- greedy generation from a few prompts: fraction of generated tokens that agree.

HF's RMSNorm classes compute in float32 whatever the input dtype; ``norms.faithful_norms`` swaps
them for runtime.RMSNorm (same maths, input dtype kept) so float64 checks are float64 throughout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from . import calibration, checkpoint
from .errors import SurgeryError
from .families import layout
from .norms import faithful_norms

#: relative-error tolerance by compute dtype: float64 checks the algebra, float32 its rounding
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass
class Comparison:
    max_abs: float
    mean_abs: float
    relative: float
    kl: float
    top1: float
    generation: float | None = None
    tolerance: float | None = None
    layers: list[float] = field(default_factory=list)
    streaming: str | None = None  # why the models were read one block at a time (None: in memory)

    @property
    def ok(self) -> bool:
        return self.tolerance is None or self.relative <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


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
    """Logits in the model's dtype, at least float32 (compare_logits works in float64 by rows)."""
    out = model(input_ids=ids.to(model.device)).logits
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


def compare_logits(ref: torch.Tensor, out: torch.Tensor) -> Comparison:
    """The metrics, computed in float64 one sequence at a time (a batch of vocab-sized float64
    copies would cost more memory than the model). With D = A - B and p = softmax A,
    KL = sum p D - (logsumexp A - logsumexp B): no log-softmax of either is materialised."""
    if ref.shape != out.shape:
        raise SurgeryError(f"the models' logits differ in shape: {tuple(ref.shape)} vs {tuple(out.shape)}")
    max_abs = abs_sum = kl = agree = 0.0
    ref_max = 0.0
    for r, o in zip(ref.reshape(-1, *ref.shape[-2:]), out.reshape(-1, *out.shape[-2:])):
        agree += (r.argmax(-1) == o.argmax(-1)).sum().item()
        ref_max = max(ref_max, r.abs().max().item())
        r, o = r.to(torch.float64, copy=True), o.to(torch.float64, copy=True)
        lse_r, lse_o = r.logsumexp(-1), o.logsumexp(-1)
        p = (r - lse_r[:, None]).exp_()  # softmax A
        d = r.sub_(o)  # A - B, in r's copy
        kl += (p.mul_(d).sum(-1) - (lse_r - lse_o)).sum().item()
        d.abs_()
        max_abs, abs_sum = max(max_abs, d.max().item()), abs_sum + d.sum().item()
    positions = ref[..., 0].numel()
    return Comparison(max_abs, abs_sum / ref.numel(), max_abs / ref_max, max(kl / positions, 0.0),
                      agree / positions)


@torch.no_grad()
def greedy_agreement(a, b, prompts: torch.Tensor, new_tokens: int = 16) -> float:
    """Fraction of greedily generated tokens (after the prompts) on which the models agree."""
    kw = dict(max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
              pad_token_id=0, eos_token_id=None)
    ga = a.generate(prompts.to(a.device), **kw)[:, prompts.shape[1]:]
    gb = b.generate(prompts.to(b.device), **kw)[:, prompts.shape[1]:]
    return (ga.cpu() == gb.cpu()).double().mean().item()


@torch.no_grad()
def layer_differences(a, b, ids: torch.Tensor) -> list[float]:
    """max |h_a - h_b| / max |h_a| per hidden state (NaN where the widths differ)."""
    ha = a(input_ids=ids, output_hidden_states=True).hidden_states
    hb = b(input_ids=ids, output_hidden_states=True).hidden_states
    return [((x - y).abs().max() / x.abs().max()).item() if x.shape == y.shape else float("nan")
            for x, y in zip(ha, hb)]


def compare_models(a, b, ids: torch.Tensor, *, tolerance: float | None = None, generate: int = 16,
                   per_layer: bool = False) -> Comparison:
    """Compare model ``b`` against reference ``a`` on ``ids``."""
    result = compare_logits(logits(a, ids), logits(b, ids))
    result.tolerance = tolerance
    if generate and layout(a).objective == "causal-lm":
        result.generation = greedy_agreement(a, b, ids[:, : min(8, ids.shape[1])], generate)
    if per_layer:
        result.layers = layer_differences(a, b, ids)
    return result


def verify(a, b, *, text: str | None = None, dtype: torch.dtype = torch.float32,
           tolerance: float | None = None, n: int = 4, length: int = 64, generate: int = 16,
           per_layer: bool = False, streaming: bool | None = None) -> Comparison:
    """Load checkpoints (paths) or take models, run both in ``dtype`` and compare.

    ``streaming`` (checkpoints only): True reads one block at a time (``streaming.verify``: no
    generation, no per-layer figures), None does so when both models would not fit in memory;
    the comparison's ``streaming`` says why."""
    if not isinstance(a, torch.nn.Module) and not isinstance(b, torch.nn.Module) and streaming is not False:
        from . import streaming as stream

        pa, pb = checkpoint.resolve(a), checkpoint.resolve(b)
        why = "asked for (--streaming)" if streaming else stream.too_big([pa, pb], dtype, 1.1)
        if why:
            result = stream.verify(pa, pb, text=text, dtype=dtype, tolerance=tolerance, n=n, length=length)
            result.streaming = why
            return result
    ma = checkpoint.load(a, dtype) if not isinstance(a, torch.nn.Module) else a
    mb = checkpoint.load(b, dtype) if not isinstance(b, torch.nn.Module) else b
    if dtype == torch.float64:
        faithful_norms(ma)
        faithful_norms(mb)
    tok = checkpoint.load_tokenizer(a) if not isinstance(a, torch.nn.Module) else None
    length = min(length, getattr(ma.config, "max_position_embeddings", None) or getattr(ma.config, "n_positions", length))
    ids = probe_ids(ma, tok, text, n, length)
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    return compare_models(ma, mb, ids, tolerance=tol, generate=generate, per_layer=per_layer)
