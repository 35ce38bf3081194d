"""prune: remove the transformer blocks that change the residual stream least.

Residual states: h_l is the input of block l (l = 0..L-1) and h_L the last block's output, which
is the final norm's input (never ``output_hidden_states[-1]``: that one is already normalised).
Per token t, cos_ij(t) = <h_i(t), h_j(t)> / (|h_i(t)| |h_j(t)|), computed in float64 token by
token (a (L+1) x (L+1) Gram matrix per token, never token x token).

- angular (Gromov et al. 2024): the block of n layers starting at l scores
  d(l, n) = mean_t arccos(cos_{l,l+n}(t)) / pi, in [0, 1]; the block with the smallest d goes.
- block-influence (ShortGPT, Men et al. 2024): layer l scores BI_l = 1 - mean_t cos_{l,l+1}(t);
  the n layers with the smallest BI go (not necessarily contiguous).
- last: the n layers just before the final one (L-1-n .. L-2), a baseline that needs no text.

Means run over every real token of every calibration window (padding masked out). Removing
blocks renumbers each remaining module's ``layer_idx`` (the KV cache is indexed by it) and
shortens ``num_hidden_layers`` and every per-layer config list, so the result is a plain
checkpoint of the same architecture.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from ..core.analysis import blocks_of, forward_base, residual_capture
from ..core.calibration import bundled_text, fit_seq_len, windows
from ..core.errors import SurgeryError
from ..core.families import family, layout
from .heal import (HealOptions, HealReport, eval_text_record, heldout_record, kl_record, kl_recovery, recovery,
                   summary, take_adapter, write_adapter)
from .heal import run as heal_run
from .heal_teacher import cut_teacher
from ..engine.teacher import cut_of, renumber
from ..core.layout import LM_OBJECTIVES
from ..core.options import PruneOptions, Writing, options_and_io, options_of  # noqa: F401  (re-exported: the API's names)
from ..core.parity import output_kind, probe_ids
from ..engine.check import CheckPlan, Tolerances
from ..engine.sweep import CheckpointWork, Work
from ..engine.writer import Record, Storage, save_work
from ..core.progress import Progress, no_progress
from ..engine.runner import Job, job_scope
from ..io.output import Staged
from ..io.texts import heldout_text, text_of
from ..engine.training import heldout_ce



@dataclass
class LayerScores:
    """Similarity of the residual states h_0..h_L over the calibration tokens."""

    angular: torch.Tensor  # [L+1, L+1]: mean_t arccos(cos_ij(t)) / pi, symmetric, zero diagonal
    influence: torch.Tensor  # [L]: BI_l = 1 - mean_t cos_{l,l+1}(t)
    tokens: int
    seconds: float

    @property
    def num_layers(self) -> int:
        return len(self.influence)

    def block_distance(self, n: int) -> torch.Tensor:
        """d(l, n) for l = 0..L-n: the angular distance across the block of n layers at l."""
        return torch.stack([self.angular[l, l + n] for l in range(self.num_layers - n + 1)])

    def as_dict(self) -> dict:
        return {"angular": self.angular.tolist(), "block_influence": self.influence.tolist(),
                "tokens": self.tokens, "seconds": self.seconds}


@dataclass
class Selection:
    """Which layers go, and the candidate scores behind the choice (for the table and plot)."""

    method: str
    n: int
    layers: tuple[int, ...]  # removed, ascending
    candidates: list[str]  # "3-4" (a block) or "3" (one layer)
    scores: list[float] | None  # one per candidate; None when no scores were computed
    chosen: list[int]  # indices into candidates

    def as_dict(self) -> dict:
        return {"method": self.method, "n": self.n, "layers": list(self.layers),
                "candidates": self.candidates, "scores": self.scores,
                "chosen": [self.candidates[i] for i in self.chosen]}


def _accumulate(states: list[torch.Tensor], weight: torch.Tensor, ang: torch.Tensor, cos_adj: torch.Tensor) -> None:
    """Add sum_t w_t arccos(cos_ij(t))/pi to ``ang`` and sum_t w_t cos_{l,l+1}(t) to ``cos_adj``."""
    n_states, d = len(states), states[0].shape[-1]
    flat = [s.reshape(-1, d) for s in states]
    w = weight.reshape(-1).to(torch.float64)
    keep = w > 0
    chunk = max(1, (1 << 26) // (n_states * d))  # float64 unit vectors held per chunk: ~512 MB at most
    idx = keep.nonzero().squeeze(1)
    for start in range(0, len(idx), chunk):
        rows = idx[start:start + chunk].to(flat[0].device)
        u = torch.stack([f[rows].to(torch.float64) for f in flat], 1)  # [t, L+1, d]
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        cos = torch.einsum("tid,tjd->tij", u, u).clamp(-1.0, 1.0)  # per-token Gram matrix
        wt = w[rows.cpu()].to(cos.device)
        ang += torch.einsum("t,tij->ij", wt, torch.arccos(cos) / math.pi).cpu()
        cos_adj += torch.einsum("t,ti->i", wt, torch.diagonal(cos, 1, 1, 2)).cpu()


@torch.no_grad()
def score_layers(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 batch_size: int = 8, forward_size: int | None = None,
                 progress: Progress = no_progress) -> LayerScores:
    """Angular distances between all residual states and every layer's block influence.

    ``input_ids`` is [windows, tokens]; ``attention_mask`` (1 = real token) masks padding.
    ``forward_size`` windows per forward pass (default ``batch_size``; streamed: all, so each part
    is read once), their states compared ``batch_size`` windows at a time (what the float64 unit
    vectors hold is the same in either plan).
    """
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise SurgeryError("calibration needs a non-empty [windows, tokens] batch of token ids")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    n_layers = len(blocks_of(model))
    ang = torch.zeros(n_layers + 1, n_layers + 1, dtype=torch.float64)
    cos_adj = torch.zeros(n_layers, dtype=torch.float64)
    tokens = int(mask.sum())
    if tokens == 0:
        raise SurgeryError("the calibration batch has no unmasked tokens")
    t0 = time.perf_counter()
    total = len(input_ids)
    forward_size = forward_size or batch_size
    with residual_capture(model) as states:
        for start in range(0, total, forward_size):
            ids, m = input_ids[start:start + forward_size], mask[start:start + forward_size]
            progress("score", start, total)
            forward_base(model, ids, m)
            for i in range(0, len(ids), batch_size):
                _accumulate([s[i:i + batch_size] for s in states], m[i:i + batch_size], ang, cos_adj)
    progress("score", total, total)
    ang /= tokens
    return LayerScores(ang, 1.0 - cos_adj / tokens, tokens, time.perf_counter() - t0)


def count_layers(num_layers: int, layers: int | None = None, fraction: float | None = None) -> int:
    """How many layers to remove, from ``layers`` or ``fraction`` (rounded); at least 1, at most L-1."""
    if (layers is None) == (fraction is None):
        raise SurgeryError("give exactly one of --layers N or --fraction F")
    if fraction is not None:
        PruneOptions(fraction=fraction).check()  # the one check of its range
        layers = round(fraction * num_layers)
        if layers == 0:
            raise SurgeryError(f"--fraction {fraction:g} of {num_layers} layers rounds to 0 layers")
    if layers < 1:
        raise SurgeryError(f"cannot remove {layers} layers: give at least 1")
    if layers >= num_layers:
        raise SurgeryError(f"cannot remove {layers} layers: the model has {num_layers} "
                           f"(at most {num_layers - 1} can go)")
    return layers


def select_layers(method: str, n: int, scores: LayerScores | None = None,
                  num_layers: int | None = None) -> Selection:
    """The layers ``method`` (one of METHODS: ``PruneOptions.check`` refuses any other) removes.
    angular and block-influence need ``scores``; last does not."""
    PruneOptions(method=method).check()  # called alone (the API), an unknown method is not read as "last"
    L = scores.num_layers if scores is not None else num_layers
    if L is None:
        raise SurgeryError("select_layers needs scores or num_layers")
    count_layers(L, layers=n)
    if method == "block-influence":
        if scores is None:
            raise SurgeryError("block-influence needs calibration scores")
        bi = scores.influence.tolist()
        chosen = sorted(sorted(range(L), key=lambda i: (bi[i], i))[:n])
        return Selection(method, n, tuple(chosen), [str(i) for i in range(L)], bi, chosen)
    candidates = [f"{l}" if n == 1 else f"{l}-{l + n - 1}" for l in range(L - n + 1)]
    d = scores.block_distance(n).tolist() if scores is not None else None
    if method == "angular":
        if d is None:
            raise SurgeryError("angular needs calibration scores")
        start = min(range(len(d)), key=lambda l: (d[l], l))
    else:
        start = L - 1 - n
        if scores is None:
            candidates = candidates[start:start + 1]
            return Selection(method, n, tuple(range(start, start + n)), candidates, None, [0])
    return Selection(method, n, tuple(range(start, start + n)), candidates, d, [start])


def prune_model(model, layers: Iterable[int]) -> dict:
    """Remove the blocks ``layers`` in place; returns what changed (for the checkpoint's record).

    Remaining blocks keep their order; block j of the result gets ``layer_idx = j`` in every
    module that has one; ``num_hidden_layers`` and per-layer config lists (``layer_types``) shrink.
    """
    lay = layout(model)
    blocks = model.get_submodule(lay.layers_path)
    L = len(blocks)
    remove = sorted(set(int(i) for i in layers))
    if not remove:
        raise SurgeryError("no layers to remove")
    bad = [i for i in remove if not 0 <= i < L]
    if bad:
        raise SurgeryError(f"layer {bad[0]} does not exist: the model has layers 0..{L - 1}")
    keep = [i for i in range(L) if i not in remove]
    if not keep:
        raise SurgeryError(f"cannot remove all {L} layers")
    cfg = model.config
    rules = family(cfg.model_type).pruning
    for flag in rules.index_flags:
        if getattr(cfg, flag, False) and any(k != j for j, k in enumerate(keep)):
            raise SurgeryError(f"this model's layers compute with their own index ({flag}): renumbering "
                               "them would change what they compute")
    for key in rules.strides:
        if getattr(cfg, key, 1) != 1 and any(k != j for j, k in enumerate(keep)):
            raise SurgeryError(f"this model's config makes every {getattr(cfg, key)}-th layer of a kind ({key}): "
                               "renumbering the kept layers would change which kind each one is built as")
    per_layer = [k for k in rules.lists if isinstance(getattr(cfg, k, None), (list, tuple))]
    for k in per_layer:
        if len(getattr(cfg, k)) != L:
            raise SurgeryError(f"config {k} has {len(getattr(cfg, k))} entries for {L} layers")
    new = nn.ModuleList([blocks[i] for i in keep])
    renumber(new)
    model.set_submodule(lay.layers_path, new)
    cfg.num_hidden_layers = len(keep)
    for k in per_layer:
        old = getattr(cfg, k)
        setattr(cfg, k, type(old)(old[i] for i in keep))
    for k in rules.indices:  # layers listed by index: the kept ones, by their new index
        if isinstance(getattr(cfg, k, None), (list, tuple)):
            setattr(cfg, k, [j for j, i in enumerate(keep) if i in getattr(cfg, k)])
    for k in rules.counted:  # the first n layers are of a kind (Qwen2: layers >= n may slide)
        n = getattr(cfg, k, None)
        if isinstance(n, int) and n < L:
            setattr(cfg, k, sum(1 for i in keep if i < n))
    return {"removed": remove, "kept": keep, "layers_before": L, "layers_after": len(keep),
            "config_lists": per_layer}


# ---------------------------------------------------------------------------------------------
# the command: score, remove, (heal), save


@dataclass
class PruneResult:
    selection: Selection
    scores: LayerScores | None
    removed: dict  # prune_model's record
    ce: dict[str, float]  # cross-entropy of the original, pruned (and healed) model on the held-out windows
    ce_on: str | None  # what the CE was measured on (``texts.heldout_text``), None: not measured
    no_lm_head: str | None  # the class, when it has no language-modelling head (no CE)
    heal: HealReport | None
    heal_seconds: float | None
    record: dict  # what the saved config records under "normsurgery"
    saved: dict | None  # None on a secondary process of a distributed heal
    streaming: str | None
    eval_text_ce: dict[str, float] | None = None  # the same CEs on --eval-text, when given


@job_scope
def prune(src, out, options: PruneOptions | dict | None = None, *, text: str | Path | None = None,
          eval_text: str | Path | None = None, heal: HealOptions | dict | None = None,
          progress: Progress = no_progress, **keywords) -> PruneResult:
    """Score the layers of ``src`` on ``text`` (default: the bundled sample) before its held-out
    end (where cross-entropy is measured, and on ``eval_text`` beside), remove the chosen
    ones, optionally heal (``heal``: LoRA options), and save to ``out``, checked. ``options.streaming``:
    scored and copied one part at a time (no cross-entropy, no healing). ``io=`` (``Writing``): whether ``out`` may be
    replaced, pickle read, and the device computed on (``devices``). ``text`` and ``eval_text``: a
    ``str`` is the text itself, a ``pathlib.Path`` a file to read. ``keywords``: fields of the options
    or of ``io`` (``options_and_io``)."""
    text, eval_text = text_of(text), text_of(eval_text, "eval_text")
    opts, io = options_and_io(PruneOptions, options, keywords)  # checked
    hopts = None if heal is None else options_of(HealOptions, heal)
    streaming = opts.streaming
    if hopts is not None:
        if streaming:
            raise SurgeryError("--heal trains the whole model in memory: prune with --streaming, then heal the result")
    force, allow_pickle, device = io.force, io.allow_pickle, io.device
    job = Job.open(src, out, force=force, allow_pickle=allow_pickle, device=device)
    source = job.source
    layers = source.config.num_hidden_layers
    n = count_layers(layers, opts.layers, opts.fraction)
    lm = source.head.objective in LM_OBJECTIVES
    if (hopts is not None or eval_text is not None) and not lm:
        raise SurgeryError(f"{source.class_name} has no language-modelling head: cross-entropy and healing need "
                           "a causal or masked LM")
    cal, data = _windows(job, opts, hopts, text, eval_text)
    work = CheckpointWork(source, source.storage, streamed=streaming, alone=True, device=job.device)
    acc = job.make_accelerator(hopts.precision) if hopts is not None else None
    scores = _scores(source, work, cal, opts, progress)
    selection = select_layers(opts.method, n, scores, layers)
    ce = Measured(data if lm and not streaming else None, getattr(source.tokenizer, "mask_token_id", None))
    ce.measure("original", work.load_all() if ce.data is not None else None)
    cut = cut_of(work.model, selection.layers) if hopts is not None else None  # the heal's teacher's blocks
    removed = prune_model(work.model, selection.layers)
    work.replan()
    ce.measure("pruned", work.model)
    on = heldout_text((hopts or HealOptions()).eval_fraction) if ce.data is not None else None
    record = job.record(**({"streaming": True} if streaming else {}),
                        prune={**selection.as_dict(), **removed, "text_tokens": scores.tokens if scores else 0},
                        heldout_ce=ce.held,  # filled in as it is measured (healed: after healing)
                        **({"heldout": heldout_record(on, data.heldout)} if ce.data is not None else {}),
                        **eval_text_record(ce.other, data and data.other_record))
    probe = cal[:4] if cal is not None else probe_ids(None, source.config.vocab_size, None, 4, opts.seq_len)
    report = seconds = model = None
    if hopts is not None:
        teaching, hopts, why = cut_teacher(job, hopts, cut)
        model, report, seconds = heal_run(work.load_all(), source.tokenizer, data, hopts, accelerator=acc,
                                          teacher=teaching, progress=progress if acc.is_main_process else no_progress)
        report.why = why
        ce.healed(report, record)
    saved = _save_pruned(job, work, model, record, probe, hopts is not None and hopts.save_adapter, progress)
    return PruneResult(selection, scores, removed, ce.held, on, None if lm else source.class_name, report, seconds,
                       record, saved, "asked for (--streaming)" if streaming else None, ce.other)


@dataclass
class Measured:
    """Held-out CE of the original, pruned (and healed) model: on the held-out end of the text
    (``held``) and on --eval-text's windows (``other``, None without them); nothing measured
    without ``data`` (streamed, or no language-modelling head)."""

    data: object  # runner.Texts, or None
    mask_token_id: int | None
    held: dict = field(default_factory=dict)
    other: dict | None = None

    def __post_init__(self):
        if self.data is not None and self.data.other is not None:
            self.other = {}

    def measure(self, name: str, model) -> None:
        if self.data is None:
            return
        self.held[name] = heldout_ce(model, self.data.held, mask_token_id=self.mask_token_id)
        if self.other is not None:
            self.other[name] = heldout_ce(model, self.data.other, mask_token_id=self.mask_token_id)

    def healed(self, report: HealReport, record: dict) -> None:
        """The healed model's CE (measured by the healing) and what it recovered, into ``record``."""
        self.held["healed"] = report.ce_after
        if self.other is not None:
            self.other["healed"] = report.eval_text_ce_after
        record["heal"] = summary(report)
        record.update(kl_record(report, "pruned", report.teacher == record.get("source")))
        record["recovered"] = {**recovery(self.held, self.other, "pruned"), **kl_recovery(report)}


def _scores(source, work: Work, cal: torch.Tensor | None, opts: PruneOptions,
            progress: Progress) -> LayerScores | None:
    """The layer scores on the calibration windows ``cal`` (None without them). In memory: batch_size
    windows per forward; streamed: every window through each part at once (each part read once), unless
    their residual states would outweigh the whole model the in-memory plan holds: then as many as do not."""
    if cal is None:
        return None
    forward = None
    if opts.streaming:
        layers = source.config.num_hidden_layers
        states = (layers + 1) * cal.shape[1] * source.config.get_text_config().hidden_size * source.storage.itemsize
        forward = max(opts.batch_size, min(len(cal), source.index.numel * source.storage.itemsize // states))
    with work.running():
        return score_layers(work.model, cal, batch_size=opts.batch_size, forward_size=forward, progress=progress)


def _windows(job: Job, opts: PruneOptions, hopts: HealOptions | None, text: str | None, eval_text: str | None):
    """(calibration windows of the text before its held-out end; the text split as healing splits it,
    ``runner.Texts``), both None for ``--method last`` without a tokenizer. Layer scores never read
    the held-out end, on which the original's and the pruned model's CE are measured."""
    source = job.source
    opts.seq_len = fit_seq_len(source.positions, opts.seq_len)
    if source.tokenizer is None:
        if opts.method != "last" or hopts is not None:
            raise SurgeryError(f"{source.name} has no tokenizer: --method {opts.method}"
                               f"{' and --heal' if hopts else ''} need one to read text (--method last alone does "
                               "not)")
        return None, None
    if hopts is not None:
        hopts.seq_len = hopts.seq_len or opts.seq_len
        hopts.batch_size = opts.batch_size
    data = job.training_data(bundled_text() if text is None else text, eval_text,
                             hopts or HealOptions(seq_len=opts.seq_len, eval_samples=opts.eval_samples))
    return windows(data.train_ids, opts.seq_len, opts.samples, "the calibration text"), data


def _save_pruned(job: Job, work: Work, healed, record: dict, probe: torch.Tensor, keep_adapter: bool,
                 progress: Progress) -> dict | None:
    """The pruned model written and checked, or the ``healed`` one (through the runner: written once,
    by the main process); with ``keep_adapter`` that is the pruned base (adapter unloaded) plus the
    adapter in ``adapter/``."""
    if healed is None:  # the pruned model read from the source, part by part or whole
        reference = work.outputs(probe) if work.resident else None  # streamed: read once the parts are written
        t = Tolerances(None, probe, work.dtype, None, output=output_kind(work.model))
        return save_work(work, job.out, storage=Storage(work.dtype), record=Record(record),
                         check=CheckPlan(t, reference), force=job.force, progress=progress).info
    if not keep_adapter:
        return job.save(healed, record, probe, progress=progress)
    adapter = take_adapter(healed)  # before unload() takes the adapters out of the model
    held = {}

    def extra(stage: Staged) -> None:
        held.update(write_adapter(adapter, stage, job.out.expanduser().resolve(), source=job.source,
                                  record=record, name=f"{job.out.name}/adapter", into="adapter"))

    saved = job.save(healed.unload(), record, probe, extra=extra, progress=progress)
    return saved and {**saved, "adapter": held}
