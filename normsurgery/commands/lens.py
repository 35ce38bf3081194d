"""lens: a checkpoint as a TransformerLens 4.x model (``TransformerBridge``), the surgery visible.

TransformerLens 4 wraps the transformers model itself: each norm site becomes a bridge component
that recomputes the norm from scratch with hooks (``hook_scale``, ``hook_normalized``). Here:

- a removed norm (remove-ln's default export: y = x) gets no component at all: no norm hooks,
  ``cfg.normalization_type`` None, the residual stream flows straight into the readers;
- a folded norm (flashnorm, pre-rmsnorm with fold: gain 1, no bias) keeps its component and
  ``normalization_type`` says so ("LNPre" / "RMSPre"): there is nothing left for ``fold_ln``;
- CRMSNorm and CompensatedLayerNorm are refused: TransformerLens has no component for them (a
  stream of d-1 coordinates; a LayerNorm with a rank-one correction).

The bridge's logits are then compared with the checkpoint's on probe ids in float32 (``parity``):
a bridge that does not compute the checkpoint's function is an error, never returned.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import torch

from ..core import devices
from ..io.loader import load
from ..io.source import Source
from ..core.errors import SurgeryError
from ..core.families import layout
from ..core.parity import compare, outputs, probe_ids
from ..engine.check import Tolerances, model_reader
from ..core.options import Reading, options_of
from ..core.runtime import NoNorm
from ..engine.runner import choose_device, job_scope

INSTALL = "pip install 'normsurgery[lens]'"
#: norm kinds TransformerLens has no component for, and why
INEXPRESSIBLE = {"crmsnorm": "CRMSNorm keeps d-1 coordinates of a zero-mean stream",
                 "compensated-layernorm": "CompensatedLayerNorm adds a rank-one correction to a LayerNorm"}


@job_scope  # TF32 off while it computes, the caller's settings put back
def lens(src, options: Reading | dict | None = None, *, text: str | None = None, **keywords):
    """A ``TransformerBridge`` of ``src`` (see the module docstring) on ``options.device`` (``devices``;
    ``options``: ``Reading``, a dict of its fields, or its fields as ``keywords``: ``allow_pickle``,
    ``device``), with ``parity`` (its logits against the checkpoint's, float32) set on it as
    ``normsurgery_parity``."""
    o = options_of(Reading, options, keywords)
    if importlib.util.find_spec("transformer_lens") is None:
        raise SurgeryError(f"normsurgery.commands.lens needs transformer-lens, not installed: {INSTALL}")
    from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_bridge.generalized_components import NormalizationBridge
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_config_from_hf
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config

    source = Source.open(src, o.allow_pickle)
    where = choose_device(o.device)
    model = load(source, torch.float32, device=where)
    if layout(model).objective != "causal-lm":
        raise SurgeryError(f"normsurgery.commands.lens: {source.name} is a {source.class_name}; TransformerLens models "
                           "are language models (a causal LM head)")
    if source.tokenizer is None:
        raise SurgeryError(f"normsurgery.commands.lens: {source.name} has no tokenizer, which TransformerLens needs")
    kind = norm_kind(model)
    ids = probe_ids(source.tokenizer, source.config.vocab_size, text, 2, min(32, source.positions or 32))
    reference = outputs(model, ids)  # the checkpoint as transformers runs it
    model.set_attn_implementation("eager")  # TransformerLens hooks the attention pattern
    try:
        arch = determine_architecture_from_hf_config(model.config)
        cfg = build_bridge_config_from_hf(copy.deepcopy(model.config), arch, str(source.path), torch.float32)
        adapter = ArchitectureAdapterFactory.select_architecture_adapter(cfg)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise SurgeryError(f"normsurgery.commands.lens: TransformerLens does not support {source.class_name}: {e}") from None
    adapter.cfg.device = str(where)
    adapter.cfg.normalization_type = kind
    if kind is None:
        _drop(adapter.component_mapping, NormalizationBridge)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aliases of the norm hooks removed ("hook_resid_mid" -> "ln2.hook_in")
        bridge = TransformerBridge(model, adapter, source.tokenizer)
    c = compare(reference, _logits(bridge, ids))

    def unbridged(**kw):  # the model's own rounding, measured on a copy the bridge does not wrap
        return model_reader(load(source, torch.float32, device=where), ids)(**kw)

    Tolerances(unbridged, ids, torch.float32, reference).judge(c)
    if not c.ok:
        raise SurgeryError(f"normsurgery.commands.lens: the TransformerLens model's logits differ from {source.name}'s: "
                           f"relative error {c.relative:.2e} > {c.tolerance:.1e} ({c.reason})")
    bridge.normsurgery_parity = c
    return bridge


def norm_kind(model) -> str | None:
    """TransformerLens' ``normalization_type`` for the model's norms: None (all removed),
    "LN"/"RMS" (with gains, some may be folded), "LNPre"/"RMSPre" (all folded: gain 1, no bias).
    Removed norms beside others, LayerNorm beside RMSNorm, and norms TransformerLens has no
    component for are refused."""
    kinds = set()
    for site in layout(model).norms:
        mod = model.get_submodule(site.path)
        if isinstance(mod, NoNorm):
            kinds.add(None)
            continue
        if site.kind in INEXPRESSIBLE:
            raise SurgeryError(f"normsurgery.commands.lens: {site.path} is a {site.kind}, which TransformerLens cannot "
                               f"express ({INEXPRESSIBLE[site.kind]}); lens the model before this pass")
        if site.kind not in ("layernorm", "rmsnorm") or site.offset is None:
            raise SurgeryError(f"normsurgery.commands.lens: {site.path} ({type(mod).__name__}) is no norm TransformerLens has")
        name = "LN" if site.kind == "layernorm" else "RMS"
        bias = getattr(mod, "bias", None)
        if name == "RMS" and bias is not None and bool(bias.any()):
            raise SurgeryError(f"normsurgery.commands.lens: {site.path} is an RMSNorm with a bias, which TransformerLens' "
                               "RMSNorm does not apply; lens the model before this pass")
        folded = bool(((mod.weight + site.offset) == 1).all()) and (bias is None or not bool(bias.any()))
        kinds.add(name + "Pre" if folded else name)
    families = {k if k is None else k.removesuffix("Pre") for k in kinds}
    if len(families) > 1:
        raise SurgeryError(f"normsurgery.commands.lens: the norms are of several kinds ({', '.join(map(str, kinds))}); "
                           "TransformerLens has one normalization_type per model")
    # some folded, some with gains: each bridge norm applies its own gain, 1 for the folded ones
    return min(kinds, key=lambda k: k is not None and k.endswith("Pre")) if kinds else None


def _drop(mapping: dict, component: type) -> None:
    """Remove every ``component`` from an adapter's component mapping, blocks' submodules included."""
    for name, c in list(mapping.items()):
        if isinstance(c, component):
            del mapping[name]
        elif getattr(c, "submodules", None):
            _drop(c.submodules, component)


@torch.no_grad()
def _logits(bridge, ids: torch.Tensor) -> torch.Tensor:
    return bridge(ids.to(devices.of(bridge)), return_type="logits").float()

