"""The norms remove-ln removes, while it removes them: each norm replaced by a
:class:`RemovableNorm` whose readers apply it through forward pre-hooks, one path each (``mlp``,
``qk``, ``v`` or ``attn``, ``final``), its divisor tracked as a moving average while a path is live
and frozen when the schedule (``removal_schedule``) removes the path; then the frozen norms folded
exactly into the weights (:func:`fold`, checked: :func:`fold_checked`), or put back as stock norms
with a large epsilon (:func:`export_stock`). The maths: ``remove_ln``'s docstring.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core import algebra, devices
from ..core.errors import SurgeryError
from ..core.layout import Layout
from ..core.parity import TOLERANCE, compare, jittered, outputs, rounding_tolerance
from ..core.runtime import NoNorm
from . import removal_schedule as schedule
from .norms import aux_loss, token_divisors, untie_if_touched

MOMENTUM = 0.9
STOCK_EPS = 1e12  # export=stock: sqrt(eps) = 1e6 dominates any variance
PATH_ORDER = ("mlp", "qk", "attn", "v", "final")
#: divisor=: what a batch's per-token divisors give the moving average (median: a few tokens with a
#: massive rms do not move the constant that divides all the others)
DIVISOR_STATISTICS = {"mean": torch.mean, "median": torch.median}


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
