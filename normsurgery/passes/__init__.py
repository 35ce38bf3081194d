"""Built-in passes: what each one is (name, kind, description, options), declared here without
importing torch; its ``applies``, ``apply`` (and ``reference``) live in the module named and are
imported on first use (``registry.declare``)."""

from dataclasses import dataclass

from ..core.options import (COUNT, COUNT0, CRITERIA, EVAL_FRACTION, FRACTION, OBJECTIVES, POSITIVE, PRECISION_FLAG,
                            SEQ_LEN_HELP, WINDOW, Checked, option)
from ..core.limits import between
from ..core.registry import Declared, all_passes, declare

@dataclass
class MaskOptions(Checked):
    """mask's options, and those of the passes that can mask first (minimize, compensated-ln)."""

    mask: str | None = option(None, "a mask file (safetensors of 0/1 tensors by parameter name)")
    sparsity: float = option(0.0, "unstructured magnitude sparsity in every linear inside the blocks",
                             check=between(0, 1))
    by: str = option("magnitude", "how units and heads are ranked: by their weights, or by the energy they write on "
                     "calibration text", choices=CRITERIA)
    prune_channels: int = option(0, "residual channels to remove, the least written", check=COUNT0)
    prune_units: float = option(0.0, "the fraction of each MLP's units to zero", check=between(0, 1))
    prune_heads: float = option(0.0, "the fraction of each attention's KV heads to zero", check=between(0, 1))


def scored_on_text(options: dict) -> str | None:
    """Why mask options read text: units and heads ranked by activation are scored on it."""
    if options.get("by") == "activation" and (options.get("prune_units") or options.get("prune_heads")):
        return "with by=activation scores units and heads on calibration text"
    return None


@dataclass
class Trained(Checked):
    """What both trained norm passes take: the control (the vanilla fine-tune at the same budget, reported
    beside), the held-out share and how long to go on without improving."""

    steps: int = option(300, "optimizer steps", check=COUNT)
    batch_size: int = option(16, "windows per micro-batch and process", check=COUNT)
    seq_len: int | None = option(None, SEQ_LEN_HELP, check=WINDOW)
    lr: float = option(3e-4, "peak learning rate", check=POSITIVE)
    warmup: int | None = option(None, "warm-up steps (default: steps / 10)", check=COUNT0)
    eval_fraction: float = option(EVAL_FRACTION, "share of the text held out, never trained on", check=FRACTION)
    eval_samples: int = option(32, "held-out windows at most", check=COUNT)
    seed: int = option(0, "random seed", check=COUNT0)
    save_every: int = option(0, "keep the training state every N steps (0: none), for --resume", check=COUNT0)
    resume: bool = option(False, "continue an interrupted run")
    precision: str = option("auto", **PRECISION_FLAG)
    final_aux: float = option(0.0, "weight of the auxiliary loss on the final norm's input", check=between(0))
    control: bool = option(True, "also the vanilla fine-tune at the same budget, reported beside")
    patience: int = option(0, "stop once held-out CE went N evaluations without improving (0: every step)",
                           check=COUNT0)
    eval_every: int = option(25, "with patience: steps between evaluations", check=COUNT)
    objective: str = option("ce", "what training minimises: ce, cross-entropy on the text; kd, the KL to the pass's "
                            "input model (a frozen copy) per token; kd+ce, KL + ce_weight x CE", choices=OBJECTIVES)
    temperature: float = option(1.0, "kd's temperature T, the loss scaled by T^2", check=POSITIVE)
    ce_weight: float = option(1.0, "kd+ce: the weight of CE", check=between(0))


@dataclass
class PrepbnOptions(Trained):
    decay: int | None = option(None, "steps over which lambda decays to 0 (default: 4/5 of steps)", check=COUNT0)
    calib_samples: int = option(64, "calibration windows of the frozen statistics", check=COUNT)
    momentum: float = option(0.1, "the BatchNorms' running-statistics momentum",
                             check=between(0, 1, open_low=True, open_high=False))
    fold: bool = option(True, "fold the RepBNs into their readers at the end (bn-fold)")


@dataclass
class RemoveLnOptions(Trained):
    """remove-ln: up to 900 steps, stopping once held-out CE has gone 4 evaluations (100 steps) without improving
    after the last removal (measured on the demo models against the control: README, remove-ln); final_aux 3:
    the auxiliary loss on the final norm's input (measured on 4 Llamas and 4 GPT-2s against their controls);
    block_aux None: 1 where the MLPs are gated (measured on 7 Llamas, GQA ones included), else 0
    (``remove_ln.block_aux``)."""

    steps: int = option(900, "optimizer steps", check=COUNT)
    lr: float = option(1e-4, "peak learning rate", check=POSITIVE)
    min_lr: float | None = option(None, "the cosine's end (default: lr / 10)", check=between(0))
    weight_decay: float = option(0.0, "AdamW weight decay", check=between(0))
    grad_accum: int = option(1, "gradient-accumulation steps", check=COUNT)
    start: int | None = option(None, "the first removal's step (default: steps / 10)", check=COUNT0)
    gap: int | None = option(None, "steps between removals (default: spread over the first half)", check=COUNT)
    final_gap: int | None = option(None, "steps around the final norm's removal (default: twice the gap)", check=COUNT)
    save_every: int = option(50, "keep the training state every N steps (0: none), for --resume", check=COUNT0)
    export: str = option("self", "frozen norms folded into the weights (self) or kept as stock norms",
                         choices=("self", "stock"))
    keep: str = option("none", "final: the final norm stays the model's own, computing; none: every norm removed",
                       choices=("none", "final"))
    final_divisor: str = option("ema", "the final norm's frozen divisor: the moving average, or measured again",
                                choices=("ema", "remeasure"))
    final_aux: float = option(3.0, "weight of the auxiliary loss on the final norm's input", check=between(0))
    final_blend: int = option(0, "steps over which the final norm's divisor is blended in", check=COUNT0)
    wait: float = option(0.0, "each removal once held-out CE recovered to within this many nats (0: fixed gaps)",
                         check=between(0))
    untie: bool = option(False, "untie the head from the embeddings")
    divisor: str = option("mean", "how each frozen divisor averages the tokens", choices=("mean", "median"))
    block_aux: float | None = option(None, "weight of the auxiliary loss on each block norm's input (default: 1 "
                                     "where the MLPs are gated, else 0)", check=between(0))
    patience: int = option(4, "stop once held-out CE went N evaluations without improving after the last "
                           "removal (0: every step)", check=COUNT0)


@dataclass
class PreRmsnormOptions(Checked):
    fold: bool = option(False, "fold the gains and biases into the readers")


@dataclass
class FlashnormOptions(Checked):
    keep_tied: bool = option(False, "keep the embedding and head tied (the final norm's gain stays)")


@dataclass
class RotateOptions(Checked):
    kind: str = option("hadamard", "the orthogonal Q: a randomised Hadamard, or random", choices=("hadamard", "random"))
    seed: int = option(0, "random seed of Q", check=COUNT0)


PRE_LN = "Pre-LN and parallel models of every supported family"

for name, module, declared, extra in [
    ("pre-rmsnorm", "pre_rmsnorm", Declared(
        "Pre-LN to Pre-RMSNorm: centre the writers, swap LayerNorm for RMSNorm", "exact",
        "Pre-LN and parallel LayerNorm models (GPT-2, GPT-NeoX, OPT, Phi)", PreRmsnormOptions, blockwise=True), {}),
    ("flashnorm", "flashnorm", Declared(
        "FlashNorm: fold every norm's gain (and bias) into the linears that read it", "exact",
        "every Pre-LN or parallel model (LayerNorm or RMSNorm, Gemma's 1 + w)", FlashnormOptions,
        blockwise=True), {"has": ("reads",)}),
    ("crmsnorm", "crmsnorm", Declared(
        "Pre-CRMSNorm: after pre-rmsnorm, store the zero-mean stream in d-1 dimensions", "exact",
        "Pre-LN and parallel LayerNorm models (GPT-2, GPT-NeoX, OPT, Phi), or their pre-rmsnorm output",
        blockwise=True), {}),
    ("mask", "mask", Declared(
        "Zero weights by a mask file or criterion (changes the function; minimize then shrinks)", "reference",
        PRE_LN, MaskOptions), {"has": ("stages",), "text": scored_on_text}),
    ("minimize", "minimize", Declared(
        "Remove dead MLP units, attention heads and residual channels (exact; optional mask first)", "exact",
        PRE_LN, MaskOptions), {"has": ("reference", "stages"), "text": scored_on_text}),
    ("compensated-ln", "compensated_ln", Declared(
        "Remove dead residual channels, norms keeping the full width's statistics (exact)", "exact", PRE_LN,
        MaskOptions), {"has": ("reference", "stages"), "text": scored_on_text}),
    ("remove-ln", "remove_ln", Declared(
        "remove every norm by staged fine-tuning, then fold the frozen divisors: no normalization left", "trained",
        "Pre-LN and parallel models with LayerNorm or RMSNorm (GPT-2, GPT-NeoX, OPT, Phi, Llama-like)",
        RemoveLnOptions), {"has": ("check",)}),
    ("bn-fold", "bn_fold", Declared(
        "fold inference-time BatchNorm / RepBN / per-channel affine norms into their readers", "exact",
        "any model whose stream norms are RepBN, BatchNorm or ChannelAffine (after prepbn); Post-LN norms stay as "
        "a per-channel affine map"), {}),
    ("prepbn", "prepbn", Declared(
        "PRepBN: LayerNorm/RMSNorm to re-parameterised BatchNorm by progressive fine-tuning, then folded "
        "(bn-fold): no normalisation statistics at run time", "trained",
        "Pre-LN and parallel decoders with LayerNorm or RMSNorm", PrepbnOptions), {"has": ("check",)}),
    ("rotate", "rotate", Declared(
        "rotate the residual stream by an orthogonal Q (randomised Hadamard or random), folded into the writers "
        "and readers", "exact", "models whose stream norms are gain-free RMSNorms: Pre-LN and parallel models "
        "after pre-rmsnorm with fold=true, RMSNorm models after flashnorm", RotateOptions,
        blockwise=True), {}),
]:
    declare(name, f"{__name__}.{module}", declared, **extra)


def passes():
    """The registered passes (the built-in ones and any registered since), by name."""
    return all_passes()
