"""Built-in passes: what each one is (name, kind, description, options), declared here without
importing torch; its ``applies``, ``apply`` (and ``reference``) live in the module named and are
imported on first use (``registry.declare``)."""

from ..core.devices import PRECISIONS
from ..core.registry import Declared, Limit, all_passes, between, declare, one_of

#: options of mask and of the passes that can mask first (minimize, compensated-ln)
#: (prune_units / prune_heads: the fraction of each MLP's units / each attention's KV heads to zero; by:
#: magnitude, or activation (units and heads scored on calibration text; sparsity and channels by magnitude))
MASK_OPTIONS = {"mask": "", "sparsity": 0.0, "by": "magnitude", "prune_channels": 0, "prune_units": 0.0,
                "prune_heads": 0.0}


def scored_on_text(options: dict) -> str | None:
    """Why mask options read text: units and heads ranked by activation are scored on it."""
    if options.get("by") == "activation" and (options.get("prune_units") or options.get("prune_heads")):
        return "with by=activation scores units and heads on calibration text"
    return None


#: both trained norm passes: control (the vanilla fine-tune at the same budget, reported beside),
#: patience (stop once held-out CE went that many evaluations, every eval_every steps, without improving)
TRAINED_OPTIONS = {"control": True, "patience": 0, "eval_every": 25}
PREPBN_OPTIONS = {"steps": 300, "warmup": -1, "decay": -1, "lr": 3e-4, "batch_size": 16, "seq_len": 0,
                  "eval_fraction": 0.1, "eval_samples": 32, "calib_samples": 64, "momentum": 0.1, "seed": 0,
                  "fold": True, "save_every": 0, "resume": False, "precision": "auto", "final_aux": 0.0,
                  **TRAINED_OPTIONS}
#: remove-ln: up to 900 steps, stopping once held-out CE has gone 4 evaluations (100 steps) without improving
#: after the last removal (measured on the demo models against the control: README, remove-ln); final_aux 3:
#: the auxiliary loss on the final norm's input (measured on 4 Llamas and 4 GPT-2s against their controls);
#: block_aux -1: 1 where the MLPs are gated (measured on 7 Llamas, GQA ones included), else 0 (``remove_ln.block_aux``)
REMOVE_LN_OPTIONS = {"steps": 900, "batch_size": 16, "seq_len": 0, "lr": 1e-4, "min_lr": -1.0, "warmup": -1,
                     "weight_decay": 0.0, "grad_accum": 1, "precision": "auto", "seed": 0, "start": -1, "gap": 0,
                     "final_gap": 0, "heldout": 0.1, "eval_samples": 32, "save_every": 50, "resume": False,
                     "export": "self", "keep": "", "final_divisor": "ema", "final_aux": 3.0, "final_blend": 0,
                     "wait": 0.0, "untie": False, "divisor": "mean", "block_aux": -1.0,
                     **TRAINED_OPTIONS, "patience": 4}
PRE_LN = "Pre-LN and parallel models of every supported family"
#: the values options take, checked before anything is loaded (options not listed: any of their type);
#: seq_len 0: min(128, the model's positions)
LIMITS = {"sparsity": between(0, 1), "prune_units": between(0, 1), "prune_heads": between(0, 1),
          "by": one_of("magnitude", "activation"), "prune_channels": between(0),
          "steps": between(1), "batch_size": between(1), "seq_len": between(0), "lr": between(0, open_low=True),
          "min_lr": between(-1), "weight_decay": between(0), "grad_accum": between(1), "save_every": between(0),
          "eval_fraction": between(0, 1, open_low=True), "heldout": between(0, 1, open_low=True),
          "eval_samples": between(1), "calib_samples": between(1), "momentum": between(0, 1, open_low=True,
                                                                                         open_high=False),
          "warmup": between(-1), "decay": between(-1), "start": between(-1), "gap": between(0),
          "final_gap": between(0), "precision": one_of(*PRECISIONS),
          "export": one_of("self", "stock"), "keep": Limit("one of none (the default), final", lambda x: x in ("", "none", "final")), "final_divisor": one_of("ema", "remeasure"), "final_aux": between(0), "final_blend": between(0), "wait": between(0),
          "divisor": one_of("mean", "median"), "block_aux": Limit("-1 (1 where the MLPs are gated, else 0) or >= 0", lambda x: x == -1 or x >= 0),
          "patience": between(0), "eval_every": between(1),
          "kind": one_of("hadamard", "random"), "seed": between(0)}

for name, module, declared, extra in [
    ("pre-rmsnorm", "pre_rmsnorm", Declared(
        "Pre-LN to Pre-RMSNorm: centre the writers, swap LayerNorm for RMSNorm", "exact",
        "Pre-LN and parallel LayerNorm models (GPT-2, GPT-NeoX, OPT, Phi)", {"fold": False}, blockwise=True), {}),
    ("flashnorm", "flashnorm", Declared(
        "FlashNorm: fold every norm's gain (and bias) into the linears that read it", "exact",
        "every Pre-LN or parallel model (LayerNorm or RMSNorm, Gemma's 1 + w)", {"keep_tied": False},
        blockwise=True), {"has": ("reads",)}),
    ("crmsnorm", "crmsnorm", Declared(
        "Pre-CRMSNorm: after pre-rmsnorm, store the zero-mean stream in d-1 dimensions", "exact",
        "Pre-LN and parallel LayerNorm models (GPT-2, GPT-NeoX, OPT, Phi), or their pre-rmsnorm output",
        blockwise=True), {}),
    ("mask", "mask", Declared(
        "Zero weights by a mask file or criterion (changes the function; minimize then shrinks)", "reference",
        PRE_LN, MASK_OPTIONS), {"has": ("stages",), "text": scored_on_text}),
    ("minimize", "minimize", Declared(
        "Remove dead MLP units, attention heads and residual channels (exact; optional mask first)", "exact",
        PRE_LN, MASK_OPTIONS), {"has": ("reference", "stages"), "text": scored_on_text}),
    ("compensated-ln", "compensated_ln", Declared(
        "Remove dead residual channels, norms keeping the full width's statistics (exact)", "exact", PRE_LN,
        MASK_OPTIONS), {"has": ("reference", "stages"), "text": scored_on_text}),
    ("remove-ln", "remove_ln", Declared(
        "remove every norm by staged fine-tuning, then fold the frozen divisors: no normalization left", "trained",
        "Pre-LN and parallel models with LayerNorm or RMSNorm (GPT-2, GPT-NeoX, OPT, Phi, Llama-like)",
        REMOVE_LN_OPTIONS), {"has": ("check",)}),
    ("bn-fold", "bn_fold", Declared(
        "fold inference-time BatchNorm / RepBN / per-channel affine norms into their readers", "exact",
        "any model whose stream norms are RepBN, BatchNorm or ChannelAffine (after prepbn); Post-LN norms stay as "
        "a per-channel affine map"), {}),
    ("prepbn", "prepbn", Declared(
        "PRepBN: LayerNorm/RMSNorm to re-parameterised BatchNorm by progressive fine-tuning, then folded "
        "(bn-fold): no normalisation statistics at run time", "trained",
        "Pre-LN and parallel decoders with LayerNorm or RMSNorm", PREPBN_OPTIONS), {"has": ("check",)}),
    ("rotate", "rotate", Declared(
        "rotate the residual stream by an orthogonal Q (randomised Hadamard or random), folded into the writers "
        "and readers", "exact", "models whose stream norms are gain-free RMSNorms: Pre-LN and parallel models "
        "after pre-rmsnorm with fold=true, RMSNorm models after flashnorm", {"kind": "hadamard", "seed": 0},
        blockwise=True), {}),
]:
    declare(name, f"{__name__}.{module}", declared, LIMITS, **extra)


def passes():
    """The registered passes (the built-in ones and any registered since), by name."""
    return all_passes()
