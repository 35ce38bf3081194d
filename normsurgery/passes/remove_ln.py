"""remove-ln: remove every normalization by staged fine-tuning (Heimersheim 2024; Baroni et al. 2025).

While a norm is live it is computed exactly and its divisor d(x) = sqrt(var(x) + eps) (LayerNorm)
or sqrt(mean(x^2) + eps) (RMSNorm), averaged over the tokens of each training batch, is tracked
as an exponential moving average s (momentum 0.9; evaluation batches do not move it; several
processes average their batches' divisors first). Removing a norm freezes s: LayerNorm becomes
the affine map (x - mean(x)) / s * g + b, RMSNorm x / s * g.

Each norm's readers form paths with their own constant: "mlp", "qk" and "v" where a block has
separate q/k/v projections ("attn" for a fused qkv), "final". The whole model fine-tunes on its
language-modelling loss (training.train) while the paths freeze on a schedule
(removal_schedule): the MLP path of each block in turn, then the q/k (or fused) paths, then the v
paths, then the final norm, a gap of steps between removals, or (``wait=M``) each removal once the
held-out CE is back within M of its level before the previous one. Position 0 carries a much
larger residual norm (attention sink): a frozen path keeps a separate constant for it until the
last removal drops that special case.

Then the frozen model is folded exactly: every writer is centred (so mean(x) = 0 on the stream;
only where a LayerNorm was), the readers take W diag(g / s) and c + W b, and each norm becomes
runtime.NoNorm, the identity: the saved model computes no statistic of the stream. The fold is
checked against the frozen-norm model in float64 and float32 before anything is saved.

``export=stock`` instead keeps the stock norm classes with eps = 1e12 and gains g * 1e6 / s (the
published checkpoints' trick): (x - mean) / sqrt(var + 1e12) * g 1e6 / s = (x - mean) g / s
up to a relative var / 2e12. Its error against the norm-free model is measured and reported;
it is refused in fp16/bf16, where gains near 1e6 overflow or lose their precision.

``keep=final`` (not the default) removes the block norms only: the final norm is never installed
as a RemovableNorm, so it stays the model's stock norm, computing its statistic and trained with
the rest; the schedule has no final event (position 0's special case is still dropped last), and
the notes and metrics (``kept``) say so. It is refused with ``export=stock`` (the stock classes
read one epsilon from the config, and the kept norm needs its own).

The final norm's removal (issue 37): by default (``final_aux=3``) the training loss carries an
auxiliary loss on the final norm's input (below; its measurements against the control are in
README). ``final_divisor=remeasure`` sets the final norm's frozen divisor, just before it is frozen, from a
measurement on the model as it is then (eval mode, the same 8 training windows the divisors start
from), position 0 left out of the average (and its own constant re-measured at position 0),
instead of the moving average's last value. ``final_aux=W`` (default 3; 0: off) adds W times an auxiliary loss on the
final norm's input to the training loss, from the first removal of the last block stage (the v
paths, or the q/k ones) to the end: the mean squared relative deviation of each token's divisor
(rms, or std for LayerNorm) from their mean over positions >= 1 (``aux_loss``; position 0 left
out), pulling every token toward one scale so a constant divides them all alike (Heimersheim
2024 and Baroni et al. 2025 use the absolute form on GPT-2, weight 0.1 to 0.01).
``final_blend=S`` turns the final norm's divisor from each token's own into the constant over S
steps, (1 - a) d(x) + a s with a rising from 1/S to 1, instead of at once (the fixed schedule; S at
most the final stage's length). ``untie=true``
gives a tied head its own copy of the embedding before training (vocabulary x width parameters
more), so the unembedding can absorb the scale the final norm's divisor gave; the default export
unties it anyway when the final norm folds into the head. ``block_aux=W`` adds the same auxiliary
loss on each block norm's input, W times, from that norm's first removal on: a token whose scale
runs away from the batch's is pulled back. A gated MLP, down(act(gate x) * up x), is quadratic in
the scale of x once its norm divides by a constant, so one such token can grow without bound
(measured: a GQA Llama's stream reached 10^10 times the rest and the run diverged); a plain MLP is
not. The default (-1) is therefore ``GATED_BLOCK_AUX`` where the layout's MLPs are gated
(``Layout.gated_mlp``) and 0 elsewhere (on a GPT-2 it cost +0.010; README, issue 37).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core import algebra, devices
from ..core.analysis import evaluating
from ..core.calibration import fit_seq_len, split_heldout, tokenize, windows
from ..core.errors import SurgeryError
from ..core.families import positions
from ..core.parity import TOLERANCE, compare, jittered, outputs, rounding_tolerance
from ..core.layout import Layout
from ..core.registry import PassContext, PassReport
from ..core.runtime import NoNorm
from . import REMOVE_LN_OPTIONS
from . import removal_schedule as schedule
from .norms import Control, adaptive, aux_loss, control_report, refuse_experts, refuse_norms, refuse_output_norms, refuse_post_ln, token_divisors, untie_if_touched

MOMENTUM = 0.9
STOCK_EPS = 1e12  # export=stock: sqrt(eps) = 1e6 dominates any variance
PATH_ORDER = ("mlp", "qk", "attn", "v", "final")
#: divisor=: what a batch's per-token divisors give the moving average (median: a few tokens with a
#: massive rms do not move the constant that divides all the others)
DIVISOR_STATISTICS = {"mean": torch.mean, "median": torch.median}
KEEP = ("", "none", "final")  # keep=final: the final norm stays the model's own, computing


def keep_final(options: dict) -> bool:
    """Whether ``keep=final``; any other value than KEEP's is refused in one line."""
    keep = options.get("keep", "")
    if keep not in KEEP:
        raise SurgeryError(f"remove-ln: keep={keep!r}; choose none (the default: every norm removed) or final")
    return keep == "final"


def removed_layout(layout: Layout, options: dict) -> Layout:
    """The layout of the norms the pass removes: every norm, or (keep=final) all but the final one,
    which then stays the model's stock norm, trained with the rest, and no schedule event."""
    if not keep_final(options):
        return layout
    return dataclasses.replace(layout, norms=[s for s in layout.norms if s.role != "final"])


class RemovableNorm(nn.Module):
    """A norm whose readers apply it (:meth:`normalise`, through forward pre-hooks), one path
    each; its own forward only tracks the divisor while some path is live and returns x.

    Buffers (so a training state holds them): ``scale`` [P] and ``scale_first`` [P], the EMA of
    the divisor over positions >= 1 and at position 0; ``frozen`` [P]; ``special`` (position 0
    keeps its own constant); ``removed_at`` [P], ``level`` [P] and ``released_at``, the schedule
    as it ran; ``blend`` [P] (final_blend). Gain and bias are the original norm's parameters.
    """

    def __init__(self, norm: nn.Module, layernorm: bool, eps: float, offset: float, paths: list[str],
                 over_tokens=torch.mean):
        super().__init__()
        self.layernorm, self.eps, self.offset, self.paths = layernorm, eps, offset, list(paths)
        self.original = [norm]  # a list: not a submodule
        self.weight = norm.weight
        self.bias = getattr(norm, "bias", None)
        p, dev = len(paths), norm.weight.device
        self.register_buffer("scale", torch.zeros(p, device=dev))
        self.register_buffer("scale_first", torch.zeros(p, device=dev))
        self.register_buffer("frozen", torch.zeros(p, dtype=torch.bool, device=dev))
        self.register_buffer("special", torch.ones((), dtype=torch.bool, device=dev))
        # when each path was frozen (-1: live) and the held-out CE just before (waiting; NaN: not measured);
        # when position 0's special case went (-1: not yet): the schedule as it ran, in the training state
        self.register_buffer("removed_at", torch.full((p,), -1, dtype=torch.long, device=dev))
        self.register_buffer("level", torch.full((p,), math.nan, device=dev))
        self.register_buffer("released_at", torch.full((), -1, dtype=torch.long, device=dev))
        # a frozen path divides by (1 - blend) d(x) + blend s (final_blend: from 0 to 1 over its steps)
        self.register_buffer("blend", torch.ones(p, device=dev))
        self.calibrating = False
        self.over_tokens = over_tokens  # a batch's divisors -> the value the moving average takes (divisor=)
        self.measured: list[torch.Tensor] | None = None  # remeasure: per-token divisors seen, [B, T] each
        self.aux_weight = 0.0  # final_aux / block_aux: weight of aux_loss while training (0: none)
        self.aux: torch.Tensor | None = None  # the weighted aux_loss of the last training forward
        self.hooks = []
        self.readers: dict[str, int] = {}  # reader path -> index of its path
        self._cache: dict = {}  # path -> (input, output) of the current forward

    def stats(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token divisor sqrt(var + eps) (or rms), shape [..., T], at least float32."""
        return token_divisors(x, self.layernorm, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._cache = {}
        self.aux = None
        if self.measured is not None:
            with torch.no_grad():
                self.measured.append(self.stats(x.detach()).reshape(-1, x.shape[-2]))
        if self.training and self.aux_weight > 0:
            self.aux = self.aux_weight * aux_loss(self.stats(x))
        if (self.training or self.calibrating) and not bool(self.frozen.all()):
            with torch.no_grad():
                d = self.stats(x.detach()).reshape(-1, x.shape[-2])
                rest, first = (self.over_tokens(t).to(self.scale.dtype) for t in (d[:, 1:] if d.shape[1] > 1 else d,
                                                                                   d[:, 0]))
                if self.training:  # several processes: the mean over all their batches, as one process of them all
                    rest, first = devices.mean_over_processes(torch.stack([rest, first]))
                live = ~self.frozen
                unseen = live & (self.scale == 0)
                for buf, v in ((self.scale, rest), (self.scale_first, first)):
                    buf.copy_(torch.where(unseen, v, torch.where(live, MOMENTUM * buf + (1 - MOMENTUM) * v, buf)))
        return x

    def normalise(self, x: torch.Tensor, p: int) -> torch.Tensor:
        """Path ``p``'s output: the exact norm while live, else (x - mean) / s * g + b."""
        hit = self._cache.get(p)
        if hit is not None and hit[0] is x:  # another reader of the same path, same input
            return hit[1]
        gain = self.weight + self.offset
        if not bool(self.frozen[p]):
            s = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            if self.layernorm:
                y = F.layer_norm(s, s.shape[-1:], eps=self.eps)
            else:
                y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.eps)
            y = y.to(x.dtype) * gain
        else:
            c = x - x.mean(-1, keepdim=True) if self.layernorm else x
            if bool(self.special):
                d = self.scale[p].expand(x.shape[-2]).clone()
                d[0] = self.scale_first[p]
                d = d.to(x.dtype)[:, None]
            else:
                d = self.scale[p].to(x.dtype)
            a = float(self.blend[p])
            if a < 1:  # final_blend: the token's own divisor, turning into the constant
                d = (1 - a) * self.stats(x).to(x.dtype)[..., None] + a * d
            y = c * (gain / d)
        y = y if self.bias is None else y + self.bias
        self._cache[p] = (x, y)
        return y


@torch.no_grad()
def remeasure(norm: RemovableNorm, p: int, run) -> None:
    """final_divisor=remeasure: path ``p``'s divisor measured anew on the forwards ``run()`` makes
    (the model as it is now, in eval mode: batches that do not move the moving average): the
    mean per-token divisor over positions >= 1 into ``scale``, over position 0 into
    ``scale_first``. The moving average's value is replaced."""
    norm.measured = []
    try:
        run()
        d = torch.cat(norm.measured)
    finally:
        norm.measured = None
    rest = d[:, 1:] if d.shape[1] > 1 else d
    norm.scale[p] = rest.mean().to(norm.scale.dtype)
    norm.scale_first[p] = d[:, 0].mean().to(norm.scale.dtype)


def _path_of(reader: str, layout: Layout, role: str, split: bool = True) -> str:
    if role in ("final", "mlp") or not split:
        return "mlp" if role == "mlp" else "final" if role == "final" else "attn"
    for att in layout.attention:
        if reader in (att.q, att.k):
            return "qk"
        if reader == att.v:
            return "v"
        if reader == att.qkv:
            return "attn"
    for mlp in layout.mlps:
        if reader in (mlp.up, mlp.gate):
            return "mlp"
    return "mlp" if role == "mlp" else "attn"


def install(model, layout: Layout, split: bool = True, divisor: str = "mean") -> list[RemovableNorm]:
    """Replace each norm by a RemovableNorm and hook its readers; returns them in layout order.
    ``split``: separate paths (q/k, v, MLP) where a norm has several kinds of reader; else one."""
    norms = []
    for site in layout.norms:
        mod = model.get_submodule(site.path)
        paths = {r: _path_of(r, layout, site.role, split) for r in site.readers}
        order = sorted(set(paths.values()), key=PATH_ORDER.index)
        rn = RemovableNorm(mod, site.kind == "layernorm", site.eps, site.offset, order, DIVISOR_STATISTICS[divisor])
        _set(model, site.path, rn)
        rn.readers = {reader: order.index(path) for reader, path in paths.items()}
        for reader, p in rn.readers.items():
            rn.hooks.append(model.get_submodule(reader).register_forward_pre_hook(_hook(rn, p)))
        norms.append(rn)
    return norms


def _hook(norm: RemovableNorm, p: int):
    def pre(module, args):
        if not args:
            raise SurgeryError(f"remove-ln: {type(module).__name__} was called without a positional input")
        return (norm.normalise(args[0], p),) + tuple(args[1:])

    return pre


def _set(model, path: str, mod: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, mod)


# ----------------------------------------------------------------------------- schedule

def make(norms: list[RemovableNorm], event, step: int, level: float = math.nan, before=None) -> None:
    """Make ``event`` (removal_schedule's) at ``step``: freeze its paths, noting the step and the
    held-out CE just before (``level``), or drop position 0's special case; ``before(stage)``
    runs first."""
    _, stage, removal = event
    if before:
        before(stage)
    if not removal:
        for rn in norms:
            rn.special.fill_(False)
            rn.released_at.fill_(step)
    for i, p in removal:
        norms[i].frozen[p] = True
        norms[i].removed_at[p] = step
        norms[i].level[p] = level


def made(norms: list[RemovableNorm], events) -> list:
    """The events made so far, in order, each at the step it was made (from the norms' buffers)."""
    out = []
    for _, stage, removal in events:
        at = ([int(norms[i].removed_at[p]) for i, p in removal] if removal
              else [int(rn.released_at) for rn in norms[:1]])
        if not at or min(at) < 0:
            break
        out.append((at[0], stage, removal))
    return out


def freeze_until(norms: list[RemovableNorm], events, step: int, before=None) -> dict:
    """Fixed gaps: make every event scheduled at or before ``step`` not made yet (a resumed run
    finds the earlier ones made). Returns the curve's labels: removals made, stage now."""
    done = made(norms, events)
    for event in events[len(done):]:
        if event[0] <= step:
            make(norms, event, event[0], before=before)
    return labels(norms, events)


def labels(norms: list[RemovableNorm], events) -> dict:
    done = made(norms, events)
    return {"removed": sum(len(r) for _, _, r in done), "stage": done[-1][1] if done else "live"}


def wait_for_recovery(norms: list[RemovableNorm], events, step: int, gap: int, until: int, margin: float, ce,
                      before=None) -> dict:
    """Waiting (``wait`` = ``margin`` > 0): make the next event at ``step`` when
    removal_schedule.due says so, the held-out CE measured now (``ce()``, at most once) its level.
    Returns the curve's labels."""
    done = made(norms, events)
    if len(done) < len(events):
        seen: list[float] = []

        def now() -> float:
            if not seen:
                seen.append(ce())
            return seen[0]

        previous = None
        if done:  # position 0's event is the last: the one before removed a path
            at, _, removal = done[-1]
            i, p = removal[0]
            previous = (at, float(norms[i].level[p]))
        if schedule.due(step, events[0][0], previous, len(events) - len(done), gap, until, margin, now):
            make(norms, events[len(done)], step, now(), before)
    return labels(norms, events)


def removal_paths(layout: Layout, split: bool = True) -> list[list[str]]:
    """Each norm's paths (``install``'s), from the Layout alone: no weight needed."""
    return [sorted({_path_of(r, layout, site.role, split) for r in site.readers}, key=PATH_ORDER.index)
            for site in layout.norms]


def check(model, layout: Layout, options: dict) -> str | None:
    """Before any weight is read (``model`` may be on the meta device): options that contradict
    each other, and a step budget the schedule cannot fit in."""
    if keep_final(options) and options["export"] == "stock":
        return ("remove-ln: keep=final cannot export=stock: the stock classes read one epsilon from the "
                "config, and the kept final norm needs its own; use the default export")
    try:
        paths = removal_paths(removed_layout(layout, options), split=options["export"] != "stock")
        final_variants(options, schedule.plan(paths, options)[3])
    except SurgeryError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------- fold and export

def fold(model, layout: Layout, norms: list[RemovableNorm]) -> int:
    """Frozen norms into the weights: centre the writers (when a LayerNorm removes the mean),
    readers W diag(g / s) and c + W b, each norm replaced by NoNorm. Returns readers folded."""
    if any(not bool(rn.frozen.all()) or bool(rn.special) or bool((rn.blend < 1).any()) for rn in norms):
        raise SurgeryError("remove-ln: some norm is still live; nothing can be folded")
    touched = set(layout.embeddings) if any(rn.layernorm for rn in norms) else set()
    touched |= {r for s in layout.norms for r in s.readers}
    untie_if_touched(model, layout, touched)
    if any(rn.layernorm for rn in norms):
        for path in layout.embeddings + layout.writers:
            algebra.centre_outputs(model.get_submodule(path))
    count = 0
    for site, rn in zip(layout.norms, norms):
        for h in rn.hooks:
            h.remove()
        gain = rn.weight.detach().to(algebra.WORK) + rn.offset
        shift = None if rn.bias is None else rn.bias.detach().to(algebra.WORK)
        for reader, p in rn.readers.items():
            s = rn.scale[p].to(algebra.WORK)
            algebra.fold_affine_into_reader(model.get_submodule(reader), gain / s, shift)
            count += 1
        nonorm = NoNorm(gain.shape[0])
        _set(model, site.path, nonorm)
    return count


def export_stock(model, layout: Layout, norms: list[RemovableNorm]) -> str:
    """Put the stock norms back with eps = STOCK_EPS and gains (g + offset) sqrt(eps) / s - offset.
    Every path of a norm must share one constant: the stock norm computes one output."""
    keys = _eps_keys(model, layout, norms)
    for site, rn in zip(layout.norms, norms):
        for h in rn.hooks:
            h.remove()
        if len(rn.paths) != 1:
            raise SurgeryError(f"export=stock: {site.path} has one constant per path ({', '.join(rn.paths)}), "
                               "and a stock norm has one output")
        norm = rn.original[0]
        with torch.no_grad():
            g = rn.weight.detach().to(algebra.WORK) + rn.offset
            gain = g * math.sqrt(STOCK_EPS) / rn.scale[0].to(algebra.WORK) - rn.offset
            norm.weight.copy_(gain.to(norm.weight.dtype))
            if rn.bias is not None:
                norm.bias.copy_(rn.bias.detach())
        for name in ("eps", "variance_epsilon"):
            if hasattr(norm, name):
                setattr(norm, name, STOCK_EPS)
        _set(model, site.path, norm)
    for key in keys:
        setattr(model.config, key, STOCK_EPS)
    return ", ".join(keys)


def _eps_keys(model, layout: Layout, norms: list[RemovableNorm]) -> list[str]:
    """The config keys the stock classes read the norms' eps from (``Layout.eps_keys``), when every
    norm has the one eps they hold."""
    eps = {rn.eps for rn in norms}
    keys = [k for k in layout.eps_keys if getattr(model.config, k, None) in eps]
    if len(eps) != 1 or not keys:
        raise SurgeryError(f"export=stock: no config key sets the norms' epsilon in {layout.family}, "
                           "so a stock checkpoint cannot carry the large-eps trick; use the default export")
    return keys


def fold_checked(model, layout: Layout, norms: list[RemovableNorm], ids: torch.Tensor) -> dict:
    """Fold in float64 and check it against the frozen-norm model computed in float64: the fold in
    float64 at the algebra's tolerance, and the fold cast to float32 at float32's (``parity``: 1e-5,
    or 4 x the folded model's own float32 rounding where it rounds more on its own, as a deep model
    does; against the frozen model's float32 outputs the error would hold that model's rounding too,
    which nothing measures: 6.5e-6 of a tiny Llama's 7.6e-6 fold error); the model ends in its
    working dtype. Raises (nothing to save) when a check fails."""

    work = next(model.parameters()).dtype
    model.to(torch.float64)  # widening is exact
    frozen = outputs(model, ids)
    readers = fold(model, layout, norms)
    folded64 = outputs(model, ids)
    folded = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.float32)
    folded32 = outputs(model, ids)
    err = {"float64": compare(frozen, folded64).relative, "float32": compare(frozen, folded32).relative}
    tolerance = {"float64": (TOLERANCE[torch.float64], "the algebra"),
                 "float32": (TOLERANCE[torch.float32], "float32 rounding")}
    if err["float32"] > TOLERANCE[torch.float32]:  # the folded model's own rounding, measured
        with jittered(model):
            tolerance["float32"] = rounding_tolerance(folded32, outputs(model, ids), torch.float32)
    model.to(work)
    model.load_state_dict(folded)
    for name, (tol, why) in tolerance.items():
        if not err[name] <= tol:
            raise SurgeryError(f"remove-ln: the folded model differs from the frozen-norm model in {name} "
                               f"(relative error {err[name]:.2e} > {tol:.1e}: {why}); nothing was saved")
    return {"readers_folded": readers, "fold_error_float64": err["float64"], "fold_error_float32": err["float32"]}


# ----------------------------------------------------------------------------- the pass

def applies(model, layout: Layout) -> str | None:
    reason = refuse_post_ln(layout) or refuse_output_norms(layout) or refuse_experts(layout)
    if reason:
        return reason
    if layout.qk_norms:
        return (f"it has {len(layout.qk_norms)} QK-norms (per-head norms inside attention): their divisor "
                "is not a property of the residual stream, and rotary embeddings follow them")
    if layout.objective != "causal-lm":
        return f"it has no causal language-modelling head to train with (objective {layout.objective})"
    for site in layout.norms:
        if site.role not in ("attn", "mlp", "attn+mlp", "final"):
            return f"{site.path} is a {site.role} norm"
        if site.eps is None:
            return f"the epsilon of {site.path} is unknown"
    return refuse_norms(layout, ("layernorm", "rmsnorm"))


def apply(model, layout: Layout, ctx: PassContext) -> PassReport:
    o = _options(model, layout, ctx)
    kept = ["final"] if keep_final(o) else []
    full, layout = layout, removed_layout(layout, o)
    ids = tokenize(ctx.tokenizer, ctx.text)
    train_ids, held_ids = split_heldout(ids, o["heldout"], o["seq_len"])
    held = windows(held_ids, o["seq_len"], o["eval_samples"], "the held-out part of the text")
    workdir = ctx.workdir / "remove-ln" if ctx.workdir else None
    config = {"steps": o["steps"], "batch_size": o["batch_size"], "seq_len": o["seq_len"], "lr": o["lr"],
              "min_lr": None if o["min_lr"] < 0 else o["min_lr"], "warmup": None if o["warmup"] < 0 else o["warmup"],
              "weight_decay": o["weight_decay"], "grad_accum": o["grad_accum"], "precision": o["precision"],
              "seed": o["seed"], "eval_batch_size": o["batch_size"], "resume": o["resume"],
              "save_every": o["save_every"] if workdir else 0, "state_dir": workdir}
    control = Control(model, ctx.workdir) if o["control"] else None
    untied = o["untie"] and algebra.untie(model, layout)
    if untied:  # the head trains on its own: it can absorb the scale the final norm's divisor gave
        layout = dataclasses.replace(layout, tied=False)
    norms = install(model, layout, o["export"] != "stock", o["divisor"])  # a stock norm has one output
    start, gap, final_gap, events = schedule.plan([rn.paths for rn in norms], o)
    calib = windows(train_ids, o["seq_len"], 8)
    _calibrate(model, norms, calib)
    run = Run(model, norms, events, final_variants(o, events), o, gap, held, calib, ctx.heldout_ce)
    config = adaptive({**config, **run.evaluations()}, o, settle=run.until)
    result = ctx.train(model, train_ids, held, config, objective="causal-lm", on_step=run.on_step,
                       progress=ctx.train_progress, **run.extra())
    run.stop_pulling()
    report = PassReport("remove-ln")
    report.metrics.update({"ce_before": result.ce_before, "ce_after": result.ce_after,
                           "ce_delta": result.ce_after - result.ce_before, "steps": result.steps,
                           "tokens": result.tokens, "seconds": result.seconds, "processes": result.processes,
                           "precision": result.precision, "resumed_from": result.resumed_from,
                           "schedule": run.schedule_metrics(start, final_gap), "curve": result.curve, "kept": kept,
                           **{k: run.variants[k] for k in ("final_divisor", "final_aux", "final_blend")}})
    report.notes += run.variant_notes()
    report.metrics["block_aux"] = o["block_aux"]
    if o["block_aux"] > 0:
        report.notes.append(f"block norms: auxiliary loss on each one's input, weight {o['block_aux']:g}, from its "
                            "first removal" + (" (the default for gated MLPs)" if ctx.options["block_aux"] == -1
                                               else ""))
    _fold_or_export(model, layout, norms, held[: min(4, len(held))], o["export"], report,
                    kept and next((("LayerNorm" if s.kind == "layernorm" else "RMSNorm") for s in full.norms
                                   if s.role == "final"), "norm"))
    report.notes.append(f"{result.done()}: held-out CE "
                        f"{result.ce_before:.4f} -> {result.ce_after:.4f} ({result.ce_after - result.ce_before:+.4f})")
    report.metrics["stages"] = schedule.stages_run(made(norms, events), result.curve, result.steps)
    report.notes.append("stages as run (steps: held-out CE at the stage's last evaluation): " + "; ".join(
        f"{s['stage']} {s['from']}-{s['to']}" + ("" if s["heldout_ce"] is None else f": {s['heldout_ce']:.4f}")
        for s in report.metrics["stages"])
        + (" (position 0: the first position's own frozen divisors dropped, so that every position divides by "
           "one constant)" if any(s["stage"] == "position 0" for s in report.metrics["stages"]) else ""))
    if untied:
        head = model.get_submodule(layout.head).weight
        report.metrics["untied_parameters"] = head.numel()
        report.notes.append(f"untie: {layout.head} untied from {layout.token_embedding} before training "
                            f"({head.numel():,} parameters of its own)")
    run.position_report(report)
    if control is not None:
        control_report(report, control.run(ctx, model, train_ids, held, config, "causal-lm"))
    return report


def _options(model, layout: Layout, ctx: PassContext) -> dict:
    """The pass's options, refused in one line where they cannot run here; seq_len fitted to the
    model's positions."""
    o = ctx.options
    if o["export"] not in ("self", "stock"):
        raise SurgeryError(f"remove-ln: export={o['export']!r}; choose self or stock")
    dtype = next(model.parameters()).dtype
    if o["export"] == "stock" and dtype in (torch.float16, torch.bfloat16):
        raise SurgeryError(f"remove-ln: export=stock stores gains near {math.sqrt(STOCK_EPS):.0e}, which {dtype} "
                           "cannot hold accurately; use the default export or a float32 working dtype")
    if not ctx.text:
        raise SurgeryError("remove-ln trains the model: give it text (--text FILE)")
    refused = check(model, layout, o)
    if refused:
        raise SurgeryError(refused)
    if ctx.train is None or (o["wait"] > 0 and ctx.heldout_ce is None):
        raise SurgeryError("remove-ln needs the training loop: run it through convert or apply_passes")
    return {**o, "seq_len": fit_seq_len(positions(model.config), o["seq_len"], "remove-ln: seq_len"),
            "block_aux": block_aux(o["block_aux"], layout)}


#: block_aux's value where the MLPs are gated (measured on five Llamas against their controls: README)
GATED_BLOCK_AUX = 1.0


def block_aux(value: float, layout: Layout) -> float:
    """The block norms' auxiliary weight: ``value``, or where it is -1 (the default)
    GATED_BLOCK_AUX for gated MLPs and 0 for plain ones."""
    if value != -1:
        return float(value)
    return GATED_BLOCK_AUX if layout.gated_mlp else 0.0


def _fold_or_export(model, layout: Layout, norms: list[RemovableNorm], check_ids: torch.Tensor, export: str,
                    report: PassReport, kept_kind: str | None) -> None:
    """The frozen norms folded into the weights (checked), or exported as stock norms (its error
    measured); the notes and metrics in ``report``. ``kept_kind``: the final norm's kind where
    keep=final kept it."""
    if export == "stock":
        frozen = outputs(model, check_ids)
        keys = export_stock(model, layout, norms)
        err = compare(frozen, outputs(model, check_ids)).relative
        report.metrics["stock_error"] = err
        report.notes.append(f"export=stock: stock norms with {keys} = {STOCK_EPS:.0e} and gains scaled by "
                            f"1e6 / s; relative logit error against the norm-free model {err:.2e}")
        return
    report.metrics.update(fold_checked(model, layout, norms, check_ids))
    if kept_kind:
        report.notes.append(f"block norms removed; final {kept_kind} kept (it computes its statistic "
                            "as the stock norm, trained with the model)")
    took = "g / s (each norm's gain over its frozen divisor)" + (
        " and b (its bias)" if any(n.bias is not None for n in norms) else "")
    report.notes.append(f"removed {len(norms)} norms: {report.metrics['readers_folded']} readers took {took}; "
                        f"fold checked against the frozen model (relative error "
                        f"{report.metrics['fold_error_float64']:.1e} in float64, "
                        f"{report.metrics['fold_error_float32']:.1e} in float32)")


class Run:
    """The schedule as the training runs it: ``on_step`` makes the events (fixed gaps, or waiting
    for recovery), sets the final norm's blend and the weight of its auxiliary loss; just before
    the final removal and before position 0's, the held-out CE by predicting position is measured
    (and, remeasure, the final divisor). Everything it decides follows from the step and the
    norms' buffers, so a resumed run decides the same."""

    def __init__(self, model, norms: list[RemovableNorm], events, variants: dict, o: dict, gap: int,
                 held: torch.Tensor, calib: torch.Tensor, heldout_ce):
        self.model, self.norms, self.events, self.variants, self.o = model, norms, events, variants, o
        self.gap, self.held, self.calib, self.heldout_ce = gap, held, calib, heldout_ce
        self.waiting = o["wait"] > 0
        self.until = schedule.deadline(o["steps"]) if self.waiting else events[-1][0]
        self.final = next(((rn, rn.paths.index("final")) for rn in norms if "final" in rn.paths), None)
        self.by_position: dict[str, dict] = {}

    def evaluations(self) -> dict:
        """The training's evaluation steps: each stage's start (fixed), or every eval_every steps
        (waiting: the stages' steps are not known before)."""
        if self.waiting:
            return {"eval_every": self.o["eval_every"]}
        e = self.events
        return {"eval_steps": tuple(sorted({e[i][0] for i in range(len(e)) if i == 0 or e[i][1] != e[i - 1][1]}))}

    def before(self, stage: str) -> None:
        if self.final is not None and stage in ("final", "position 0"):
            when = "before" if stage == "final" else "after"
            self.by_position[when] = position_ce(self.model, self.held, self.o["batch_size"])
        if stage == "final" and self.variants["final_divisor"] == "remeasure":
            remeasure(self.final[0], self.final[1], lambda: _forward_eval(self.model, self.calib))

    def on_step(self, step: int, model) -> dict:
        if self.waiting:
            ce = lambda: self.heldout_ce(self.model, self.held, self.o["batch_size"], "causal-lm")  # noqa: E731
            row = wait_for_recovery(self.norms, self.events, step, self.gap, self.until, self.o["wait"], ce,
                                    self.before)
        else:
            row = freeze_until(self.norms, self.events, step, self.before)
        for rn in self.norms:  # block_aux: each block norm's input, from its first frozen path on
            if self.final is None or rn is not self.final[0]:
                rn.aux_weight = self.o["block_aux"] if bool(rn.frozen.any()) else 0.0
        if self.final is None:
            return row
        rn, p = self.final
        blend = self.variants["final_blend"]
        if blend > 0 and int(rn.removed_at[p]) >= 0:
            rn.blend[p] = row["final_blend"] = min(1.0, (step - int(rn.removed_at[p]) + 1) / blend)
        if self.variants["final_aux"] > 0:
            if rn.aux is not None:  # the previous step's term, unweighted: how far the scales spread
                row["final_aux_loss"] = float(rn.aux.detach()) / rn.aux_weight
            event = self.variants["aux_event"]
            rn.aux_weight = self.variants["final_aux"] if event is not None and len(
                made(self.norms, self.events)) > event else 0.0
        return row

    def extra(self) -> dict:
        """The training loop's extra loss: the auxiliary terms of the norms pulled (the final
        norm's, final_aux; the block norms', block_aux), None while none is."""
        if (self.final is None or self.variants["final_aux"] <= 0) and self.o["block_aux"] <= 0:
            return {}

        def terms():
            pulled = [rn.aux for rn in self.norms if rn.aux is not None]
            return sum(pulled) if pulled else None

        return {"extra_loss": terms}

    def stop_pulling(self) -> None:
        for rn in self.norms:
            rn.aux_weight, rn.aux = 0.0, None

    def schedule_metrics(self, start: int, final_gap: int) -> dict:
        ran = made(self.norms, self.events)
        return {"start": start, "gap": self.gap,
                **({"wait": self.o["wait"], "deadline": self.until} if self.waiting else {"final_gap": final_gap}),
                "last_removal": ran[-1][0] if ran else None, "removals": [at for at, _, _ in ran]}

    def variant_notes(self) -> list[str]:
        v = self.variants
        if self.final is None or (v["final_divisor"] == "ema" and v["final_aux"] <= 0 and v["final_blend"] <= 0):
            return []
        return ["final norm: divisor " + ("re-measured just before it was frozen (position 0 left out)"
                                          if v["final_divisor"] == "remeasure" else "the moving average")
                + (f", blended in from each token's own over {v['final_blend']} steps" if v["final_blend"] > 0 else "")
                + (f"; auxiliary loss on its input, weight {v['final_aux']:g}, from step "
                   f"{made(self.norms, self.events)[v['aux_event']][0]}" if v["final_aux"] > 0 else "")]

    def position_report(self, report: PassReport) -> None:
        if self.by_position:
            report.metrics["final_positions"] = self.by_position
            report.notes.append("held-out CE by predicting position, " + " and ".join(
                f"{when} the final stage ({', '.join(f'{k}: {v:.4f}' for k, v in ces.items())})"
                for when, ces in self.by_position.items()))


def final_variants(options: dict, events) -> dict:
    """The final norm's removal variants (``final_divisor``, ``final_aux``, ``final_blend``) and the
    index of the event the auxiliary loss starts at (the first removal of the last block stage).
    keep=final has no final removal: there they are off, and a value other than the default is
    refused in one line; a blend must end before position 0's removal, on the fixed schedule."""
    names = ("final_divisor", "final_aux", "final_blend")
    chosen = {k: options[k] for k in names}
    if keep_final(options):
        if chosen != {k: REMOVE_LN_OPTIONS[k] for k in names}:
            raise SurgeryError("remove-ln: final_divisor, final_aux and final_blend change the final norm's removal, "
                               "and keep=final keeps it")
        chosen = {"final_divisor": "ema", "final_aux": 0.0, "final_blend": 0}
    if chosen["final_blend"] > 0:
        at = {stage: step for step, stage, _ in events}
        if options["wait"] > 0:
            raise SurgeryError("remove-ln: final_blend needs the fixed schedule (the final stage's length is known "
                               "before it starts); drop wait")
        if "final" in at and chosen["final_blend"] > at["position 0"] - at["final"]:
            raise SurgeryError(f"remove-ln: final_blend={chosen['final_blend']} steps do not fit in the final stage "
                               f"({at['position 0'] - at['final']} steps: final_gap); give a larger final_gap or a "
                               "shorter blend")
    last = next((e[1] for e in reversed(events) if e[1] in schedule.STAGES), None)
    return {**chosen, "final_aux": float(chosen["final_aux"]),
            "aux_event": next((i for i, e in enumerate(events) if e[1] == last), None)}


POSITION_GROUPS = (("0", 0, 1), ("1-7", 1, 8), ("8+", 8, None))  # predicting position: name, from, to


@torch.no_grad()
def position_ce(model, windows: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Held-out CE (nats/token) of ``windows`` [n, T] by the position that predicts: position 0
    (the attention sink, predicting token 1), positions 1-7, 8 onwards (POSITION_GROUPS); eval
    mode (``parity.outputs``)."""
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for s in range(0, len(windows), batch_size):
        ids = windows[s:s + batch_size]
        logits = outputs(model, ids)[:, :-1].double().cpu()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        total += ce.view(ids.shape[0], -1).sum(0)
    total /= len(windows)
    return {name: float(total[a:b].mean()) for name, a, b in POSITION_GROUPS}


@torch.no_grad()
def _forward_eval(model, batch: torch.Tensor) -> None:
    """One forward of ``batch`` in eval mode (the training mode restored)."""
    with evaluating(model):
        model(input_ids=batch.to(devices.of(model)))


@torch.no_grad()
def _calibrate(model, norms: list[RemovableNorm], batch: torch.Tensor) -> None:
    """Start every divisor EMA at its value on a few training windows."""
    for rn in norms:
        rn.calibrating = True
    try:
        with evaluating(model):
            model(input_ids=batch.to(devices.of(model)))
    finally:
        for rn in norms:
            rn.calibrating = False
