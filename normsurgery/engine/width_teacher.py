"""The width-cut teacher: the model before ``mask``/``minimize`` removed MLP units and attention
heads, assembled from the student's own modules plus only what the cut removed.

An MLP is a sum over its units, down(act(gate x) * up x) + c = sum_j W_down[:, j] h_j(x) + c, and
an attention a sum over its query heads through o_proj, o(x) = sum_h W_o[:, h] a_h(x) + c (a head
reads only its own q rows and its kv head's k and v rows). So where the student's kept units and
heads are the original's unchanged (the same rows of gate, up, q, k, v and columns of down, o),

    teacher_site(x) = student_site(x) + removed_site(x),

``removed_site`` the original module restricted to the removed units (heads: the kv groups they
read, the student's kept heads' o columns zeroed there) with bias c_original - c_student (minimize
folds the constants dead units and heads still output into the student's bias). Each changed
MLP and attention gets a forward hook adding ``removed_site`` while the teacher runs
(:meth:`WidthTeacher.active`, adapters off); every other tensor is the student's, shared, not
copied. The teacher holds in addition only the removed rows and columns.

:func:`width_cut` shows the conditions from the two models (the original, e.g. read from the
input of prune, and the student before adapters are added): the same parameters everywhere but in
the changed sites, kept units and heads found among the original's in order, exactly equal.
Where they fail (weights trained or released, residual channels removed, magnitude sparsity,
per-head norms) it says why, and the caller falls back to a frozen copy of the original.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from ..core import algebra, analysis
from ..core.analysis import evaluating
from ..core.errors import SurgeryError
from ..core.families import layout
from ..core.layout import AttentionSite, MlpSite
from ..passes import _shrink


class NotExact(SurgeryError):
    """The student is not the original less whole units and heads: the teacher cannot share it."""


class WidthTeacher:
    """The original model, as the student ``model`` plus ``removed`` (path of an MLP or attention
    module -> the module computing what the cut took from it). :meth:`targets` is the teacher
    protocol (``engine.teacher.Teacher``): the original's logits on ``inputs``."""

    def __init__(self, model, removed: dict[str, nn.Module]):
        self.model, self.removed = model, removed

    def over(self, model, trained=()) -> "WidthTeacher":
        """This teacher over the student as the loop trains it (``model``: with its adapters), whose
        own parameters ``trained`` train: refused (they would drift the teacher with the student)."""
        trained = list(trained)
        if trained:
            raise NotExact(f"{len(trained)} of the student's own weights train (--train norms or full), and the "
                           "width-cut teacher shares them: train adapters only (--train lora) or distil from a "
                           "frozen copy of the original")
        self.model = model
        return self

    def extra_bytes(self) -> int:
        """What the teacher holds beyond the student: the removed rows and columns."""
        return sum(p.numel() * p.element_size() for m in self.removed.values() for p in m.parameters())

    def to(self, device) -> "WidthTeacher":
        for m in self.removed.values():
            m.to(device)
        return self

    @contextmanager
    def active(self):
        """While active, ``model``'s forward is the original's: adapters off (a peft model), the
        removed parts added by hooks, every module in eval mode."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        with ExitStack() as stack:
            if hasattr(self.model, "disable_adapter"):
                stack.enter_context(self.model.disable_adapter())
            stack.enter_context(evaluating(self.model))
            for path, extra in self.removed.items():
                stack.callback(base.get_submodule(path).register_forward_hook(_adding(extra), with_kwargs=True).remove)
            yield

    @torch.no_grad()
    def targets(self, inputs: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        with self.active():
            return self.model(input_ids=inputs, use_cache=False).logits


def _adding(extra: nn.Module):
    def hook(module, args, kwargs, output):
        more = extra(*args, **kwargs)
        if isinstance(output, tuple):
            return (output[0] + more[0], *output[1:])
        return output + more
    return hook


def width_cut(original, student) -> WidthTeacher:
    """The :class:`WidthTeacher` of ``original`` over ``student`` (both whole, in memory, the
    student without adapters yet), or :class:`NotExact` naming why it cannot be shown exact."""
    lo, ls = layout(original), layout(student)
    if (lo.family, len(lo.mlps), len(lo.attention), lo.stream_width) != (
            ls.family, len(ls.mlps), len(ls.attention), ls.stream_width):
        raise NotExact("the student is not the original less MLP units and heads (its blocks or residual width "
                       "differ)")
    removed, handled = {}, set()
    for so, ss in zip(lo.mlps, ls.mlps):
        handled |= _mlp(original, student, so, ss, removed)
    for so, ss in zip(lo.attention, ls.attention):
        handled |= _attention(original, student, so, ss, removed)
    theirs = dict(student.named_parameters())
    for name, p in original.named_parameters():
        if name not in handled and (name not in theirs or not torch.equal(p, theirs[name].to(p.device))):
            raise NotExact(f"{name} is not the original's (trained, released or reshaped): the teacher cannot "
                           "share the student's weights")
    return WidthTeacher(student, removed)


def _sites_params(site, names: tuple[str, ...]) -> set[str]:
    return {f"{getattr(site, n)}.{w}" for n in names if getattr(site, n, None) for w in ("weight", "bias")}


def _match(original: torch.Tensor, kept: torch.Tensor, what: str) -> list[int]:
    """Indices into ``original`` [n, ...] of the rows of ``kept`` [m, ...], found in order (a cut
    keeps order); :class:`NotExact` where some kept row is not one of the original's."""
    found, j = [], 0
    for i in range(len(original)):
        if j < len(kept) and torch.equal(original[i], kept[j]):
            found.append(i)
            j += 1
    if j < len(kept):
        raise NotExact(f"{what}: a kept unit or head is not the original's (changed by the cut or trained)")
    return found


def _rows(model, path: str | None, rows: torch.Tensor) -> list[torch.Tensor]:
    """Rows ``rows`` of ``path``'s W [out, in] and c (as columns: one entry per row)."""
    if path is None:
        return []
    mod = model.get_submodule(path)
    w = algebra.weight(mod, None)[rows.to(mod.weight.device)]
    c = getattr(mod, "bias", None)
    return [w] + ([] if c is None else [c.detach()[rows.to(c.device)][:, None]])


def _unit_signatures(model, site: MlpSite) -> torch.Tensor:
    """Per unit j: its rows of up (and gate) with their bias entries, and its column of down."""
    n = algebra.in_width(model.get_submodule(site.down))
    units = torch.arange(n)
    parts = (_rows(model, site.up, units) + _rows(model, site.up, units + n) if site.stacked
             else _rows(model, site.up, units) + _rows(model, site.gate, units))
    return torch.cat(parts + [algebra.weight(model.get_submodule(site.down), None).T], dim=1)


def _bias_delta(original, student, path: str) -> torch.Tensor | None:
    """c_original - c_student of ``path`` (a missing bias: zeros), None where neither has one."""
    co, cs = algebra.bias(original.get_submodule(path)), algebra.bias(student.get_submodule(path))
    if co is None and cs is None:
        return None
    return (torch.zeros_like(cs) if co is None else co) - (torch.zeros_like(co) if cs is None else cs.to(co.device))


def _set_bias(mod: nn.Module, delta: torch.Tensor | None) -> None:
    if delta is None:
        if algebra.has_bias(mod):
            mod.bias = None
        return
    algebra.set_bias(mod, delta)


def _parent(*paths: str) -> str:
    parents = {p.rpartition(".")[0] for p in paths if p}
    if len(parents) != 1:
        raise NotExact(f"the projections {', '.join(p for p in paths if p)} are not children of one module")
    return parents.pop()


def _holder(path: str, module: nn.Module) -> nn.Module:
    """A module holding ``module`` at ``path`` (so site paths name its children)."""
    root = cur = nn.Module()
    *above, last = path.split(".")
    for name in above:
        cur.add_module(name, nn.Module())
        cur = getattr(cur, name)
    cur.add_module(last, module)
    return root


def _mlp(original, student, so: MlpSite, ss: MlpSite, removed: dict) -> set[str]:
    """The removed units of one MLP into ``removed`` (none removed: nothing); the parameter names handled."""
    path = _parent(so.up, so.gate, so.down)
    kept = _match(_unit_signatures(original, so), _unit_signatures(student, ss).to(original.device), path)
    units = algebra.in_width(original.get_submodule(so.down))
    if len(kept) == units:
        return set()
    gone = torch.tensor([j for j in range(units) if j not in set(kept)])
    holder = _holder(path, copy.deepcopy(original.get_submodule(path)))
    if so.stacked:
        _shrink.keep_outputs(holder.get_submodule(so.up), torch.cat([gone, units + gone]))
    for p in () if so.stacked else (so.up, so.gate):
        if p:
            _shrink.keep_outputs(holder.get_submodule(p), gone)
    _shrink.keep_inputs(holder.get_submodule(so.down), gone)
    _set_bias(holder.get_submodule(so.down), _bias_delta(original, student, so.down))
    removed[path] = holder.get_submodule(path).requires_grad_(False)
    return _sites_params(so, ("up", "gate", "down"))


def _head_signatures(model, site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor]:
    """(per query head: its q rows and biases and o columns; per kv head: its k and v rows and biases)."""
    wo = algebra.weight(model.get_submodule(site.o), None)
    hd = site.head_dim

    def part(name: str, heads: int) -> torch.Tensor:
        return torch.stack([torch.cat([x.flatten() for x in _rows(model, *analysis.qkv_rows(site, name, [h]))])
                            for h in range(heads)])

    o = torch.stack([wo[:, analysis.head_idx(h, hd).to(wo.device)].flatten() for h in range(site.num_heads)])
    return torch.cat([part("q", site.num_heads), o], 1), torch.cat([part("k", site.num_kv_heads),
                                                                     part("v", site.num_kv_heads)], 1)


def _attention(original, student, so: AttentionSite, ss: AttentionSite, removed: dict) -> set[str]:
    """The removed heads of one attention into ``removed``; the parameter names handled."""
    if (so.num_heads, so.num_kv_heads) == (ss.num_heads, ss.num_kv_heads):
        return set()
    if so.per_head:
        raise NotExact(f"{so.path} has per-head parameters ({', '.join(p for p, _ in so.per_head)}): not shown exact")
    qo, kvo = _head_signatures(original, so)
    qs, kvs = (t.to(original.device) for t in _head_signatures(student, ss))
    kept_kv, kept = _match(kvo, kvs, so.path), _match(qo, qs, so.path)
    g, gs = so.num_heads // so.num_kv_heads, ss.num_heads // ss.num_kv_heads
    if any(kept[j] // g != kept_kv[j // gs] for j in range(len(kept))):
        raise NotExact(f"{so.path}: a kept query head reads another kv head than in the original")
    gone = [h for h in range(so.num_heads) if h not in set(kept)]
    groups = sorted({h // g for h in gone})
    holder = _holder(so.path, copy.deepcopy(original.get_submodule(so.path)))
    o = holder.get_submodule(so.o)
    w = algebra.weight(o, None).clone()
    for h in set(kept) & {h for grp in groups for h in range(grp * g, (grp + 1) * g)}:
        w[:, analysis.head_idx(h, so.head_dim).to(w.device)] = 0  # a kept head: the student computes it
    _shrink.set_matrix(o, w)
    _shrink.attention(holder, so, ([h for grp in groups for h in range(grp * g, (grp + 1) * g)], groups))
    _set_bias(o, _bias_delta(original, student, so.o))
    removed[so.path] = holder.get_submodule(so.path).requires_grad_(False)
    return _sites_params(so, ("q", "k", "v", "qkv", "o"))
