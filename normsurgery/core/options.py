"""Each command's options, their defaults and their choices, once (ARCHITECTURE: "Options from one
source"). The API's option dataclasses live here, with the checks of their values; the CLI builds
its flags' defaults, help and choices from them, and ``heal``, ``prune``, ``squeeze``,
``precision``, ``masks`` and ``export`` re-export what they use.

Nothing here imports torch: ``--help`` and usage errors are answered from this module alone.
A value out of range is named by its flag (``option_spec.flag``, the one place an option's name
becomes ``--its-name``), since the same check guards the CLI, recipes and the API. How a field is
declared (``option``, ``Flag``) and the commands' constants live in ``option_spec``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass, replace

from .devices import HELP as DEVICE_HELP
from .errors import UsageError
from .option_spec import (  # noqa: F401  (declared there, read here and by the CLI)
    SEQ_LEN, METHODS, TRAIN_MODES, OBJECTIVES, LEARNING_RATES, STRUCTURES, SQUEEZE_STEPS, CRITERIA, ON_OVERFLOW,
    MAX_SHARD_SIZE, PROBE_SAMPLES, PROBE_LENGTH, PROBE_GENERATE, OUTLIER_SAMPLES, FORMATS, GGUF_DTYPES, CHECKS,
    EXTERNAL_BYTES, CACHE_TOKENS, Flag, option, flagged, default_of, shown, one_of, EVAL_FRACTION, SEQ_LEN_HELP,
    HELP_VALUES, flag, PRECISION_FLAG)
from .limits import (COUNT, COUNT0, DEVICE, DTYPE, FRACTION, POSITIVE, PRECISION, SIZE_LIMIT, WINDOW, Limit,  # noqa: F401
                     between, did_you_mean, one_of as one_of_values, parse_size, some_of)

__all__ = ["CHECKS", "CRITERIA", "FORMATS", "GGUF_DTYPES", "HealOptions", "LEARNING_RATES", "MAX_SHARD_SIZE", "METHODS",
           "OBJECTIVES", "ON_OVERFLOW", "OUTLIER_SAMPLES", "PROBE_GENERATE", "PROBE_LENGTH", "PROBE_SAMPLES", "PruneOptions",
           "STRUCTURES", "SEQ_LEN", "SQUEEZE_STEPS", "SqueezeOptions", "TRAIN_MODES", "check_values", "Checked", "flag"]


def check_values(opts, named=None) -> None:
    """Each value of options dataclass ``opts`` (or of a dict of option names: ``LIMITS``'s) within its
    option's limit (:attr:`Flag.limit`), the one check the CLI's flags run too (``cli.flags``); refused
    as a :class:`UsageError` naming the option as ``named(name)`` says (default: its flag as the
    command line spells it, :meth:`Flag.spelled`)."""
    if is_dataclass(opts):
        items = [(f.name, getattr(opts, f.name), f.metadata["flag"]) for f in flagged(type(opts))]
    else:
        items = [(k, v, Flag("", check=LIMITS.get(k))) for k, v in opts.items()]
    for name, value, spec in items:
        why = spec.limit.refusal(value) if spec.limit is not None else None
        if why:
            raise UsageError(f"{named(name) if named else spec.spelled(name)} {why}")


class Checked:
    """An options dataclass whose values are checked, for the API and recipes as for the CLI."""

    def check(self) -> None:
        """Every value within its option's limit (:func:`check_values`)."""
        check_values(self)


@dataclass
class HealOptions(Checked):
    steps: int = option(200, "optimizer steps (default {default})", metavar="N", check=COUNT)
    rank: int = option(8, "LoRA rank (default {default})", metavar="R", check=COUNT)
    alpha: float | None = option(None, "LoRA alpha (default 2 x rank)", metavar="X", check=POSITIVE)
    lr: float | None = option(None, "learning rate (default by --train: {LR_BY_TRAIN})", metavar="X",
                              check=POSITIVE)  # None: LEARNING_RATES[train] (:meth:`learning_rate`)
    target_modules: list[str] | None = option(None, "linears to adapt, by name, e.g. q_proj,v_proj (default: every "
                                              "linear in the blocks)", metavar="NAMES", parse="names")
    batch_size: int = option(8, "windows per micro-batch and process (default {default})", metavar="B", check=COUNT)
    seq_len: int | None = option(None, SEQ_LEN_HELP, metavar="L", check=WINDOW)  # None: SEQ_LEN, or the model's positions when fewer
    grad_accum: int = option(1, "gradient-accumulation steps (default {default})", metavar="K", check=COUNT)
    precision: str = option("auto", **PRECISION_FLAG)  # devices.PRECISIONS
    eval_fraction: float = option(EVAL_FRACTION, "share of --text held out (default {default})", metavar="F",
                                  check=FRACTION)
    eval_samples: int = option(64, "held-out windows at most, evaluated before and after (default {default}; fewer "
                               "is faster)", metavar="K", check=COUNT)
    seed: int = option(0, "random seed (default {default})", metavar="N", check=COUNT0)
    train: str = option("lora", "what trains (lora: adapters, merged; norms: only the norms' gains and biases; full: "
                        "every parameter): {choices}", metavar="WHAT", choices=TRAIN_MODES)
    patience: int = option(0, "stop once held-out CE went N evaluations without improving, --steps the cap (default "
                           "{default}: every step)", metavar="N", check=COUNT0)
    eval_every: int = option(25, "with --patience: steps between evaluations (default {default})", metavar="S", check=COUNT)
    objective: str | None = option(None, "what healing minimises (kd: the KL to the teacher, the model before the cut, "
                                   "per token; ce: cross-entropy on --text; kd+ce: KL + --ce-weight x CE): "
                                   "{choices} (default kd where a teacher is known, else ce)", metavar="WHAT",
                                   choices=OBJECTIVES)  # None: chosen by whether a teacher is known
    temperature: float = option(1.0, "kd's temperature T, the loss scaled by T^2 (default {default})", metavar="T",
                                check=POSITIVE)
    ce_weight: float = option(1.0, "kd+ce: the weight of CE (default {default})", metavar="W", check=between(0))
    teacher: str | None = option(None, "the model to distil from, a folder or hub id (default: the model the input "
                                 "was pruned from, as its record says)", metavar="PATH")
    teacher_cache: str | None = option(None, "distil from the teacher's top --teacher-k tokens of each training window, kept in DIR (built once)", metavar="DIR")
    teacher_k: int = option(64, "tokens a position --teacher-cache keeps, the rest one bucket: K x 8 + 4 bytes a token (default {default})", metavar="K", check=COUNT)
    local_steps: int = option(0, "blockwise local distillation steps for each block a width cut changed, before the global steps (default {default})", metavar="N", check=COUNT0)
    save_adapter: bool = False  # keep the adapter unmerged (--save-adapter: a flag of each command's own wording)

    @property
    def learning_rate(self) -> float:
        """``lr``, or when none was given the default of what trains (:data:`LEARNING_RATES`)."""
        return self.lr if self.lr is not None else LEARNING_RATES[self.train]

    def check(self) -> None:
        """Every value within its option's limit (:func:`check_values`), and an adapter only with LoRA."""
        super().check()
        if self.save_adapter and self.train != "lora":
            raise UsageError(f"--save-adapter needs {flag('train')} lora ({flag('train')} {self.train} trains "
                             "no adapter)")


@dataclass
class PruneOptions(Checked):
    layers: int | None = option(None, "how many layers to remove", metavar="N", names=("--layers", "-n"), check=COUNT)
    fraction: float | None = option(None, "or: the fraction of layers to remove (rounded)", metavar="F",
                                    check=FRACTION)
    method: str = option("angular", "{choices}", metavar="METHOD", choices=METHODS)
    samples: int = option(32, "calibration windows (default {default})", metavar="K", check=COUNT)
    seq_len: int | None = option(None, SEQ_LEN_HELP, metavar="L", check=WINDOW)  # None: SEQ_LEN, or the model's positions when fewer
    batch_size: int = option(8, "windows per forward pass and per heal micro-batch (default {default})", metavar="B", check=COUNT)
    eval_samples: int = option(64, "held-out windows at most (default {default})", metavar="K", check=COUNT)
    streaming: bool = False  # scored and copied one part at a time (no cross-entropy, no healing): a flag of its own


@dataclass
class SqueezeOptions(Checked):
    target: float | None = option(0.5, "fraction of the parameters to keep (default {default})", metavar="F",
                                  check=FRACTION)  # unless target_bytes
    target_bytes: int | None = option(None, "or: the output's size in bytes (storage dtype)", metavar="N", check=COUNT)
    cycles: int = option(1, "mask -> minimize -> release -> retrain cycles (default {default}: one-shot, measured "
                         "better than 3 at the same size and tokens; N > 1: Squeeze-Release, with its one-shot "
                         "control)", metavar="N", check=COUNT)
    steps_per_cycle: int | None = option(None, "retraining steps per cycle (default: {SQUEEZE_STEPS} in all, split "
                                         "evenly over the cycles; {SQUEEZE_STEPS} with one, {SQUEEZE_THIRD} each "
                                         "with 3)", metavar="S", check=COUNT)  # None: SQUEEZE_STEPS split (:meth:`steps`)
    structure: tuple[str, ...] = option(STRUCTURES, f"what the masks remove: some of {', '.join(STRUCTURES)} "
                                        "(default {default})", metavar="LIST", parse="parts",
                                        check=some_of(*STRUCTURES))
    by: str = option("activation", "how units and heads are ranked (activation: by the energy they write on "
                     "calibration windows of --text; magnitude: by their weights; channels by the energy written "
                     "into them): {choices}", metavar="HOW", choices=CRITERIA)
    sparsity: float = option(0.0, "unstructured magnitude sparsity added to each cycle's mask, released after "
                             "minimize (default {default})", metavar="X", check=between(0, 1))
    release_scale: float = option(0.1, "released noise's std, in units of the RMS of the tensor's surviving weights "
                                  "(default {default})", metavar="X", check=between(0))
    train: str = option("full", "what retrains (lora: merged): {choices}", metavar="WHAT", choices=TRAIN_MODES)
    lr: float = option(1e-3, "learning rate (default {default})", metavar="X", check=POSITIVE)
    batch_size: int = option(8, "windows per step (default {default})", metavar="B", check=COUNT)
    seq_len: int | None = option(None, SEQ_LEN_HELP, metavar="L", check=WINDOW)
    eval_fraction: float = option(EVAL_FRACTION, "share of --text held out (default {default})", metavar="F",
                                  check=FRACTION)
    eval_samples: int = option(64, "held-out windows at most (default {default})", metavar="K", check=COUNT)
    precision: str = option("auto", **PRECISION_FLAG)
    seed: int = option(0, "seed of the release noise and the training batches (default {default})", metavar="N", check=COUNT0)
    save_every: int = option(0, "keep the training state every N steps within a cycle (default {default}: none; "
                             "the state after each cycle is always kept)", metavar="N", check=COUNT0)
    patience: int = option(0, "a cycle's retraining stops once held-out CE went N evaluations without improving "
                           "(default {default}: every step)", metavar="N", check=COUNT0)
    eval_every: int = option(25, "with --patience: steps between evaluations (default {default})", metavar="S", check=COUNT)
    objective: str = option("kd", "what each cycle's retraining minimises (kd: the KL to the cycle's input model, per "
                            "token; ce: cross-entropy on --text; kd+ce: KL + --ce-weight x CE): {choices} (default "
                            "{default})", metavar="WHAT", choices=OBJECTIVES)
    temperature: float = option(1.0, "kd's temperature T, the loss scaled by T^2 (default {default})", metavar="T",
                                check=POSITIVE)
    ce_weight: float = option(1.0, "kd+ce: the weight of CE (default {default})", metavar="W", check=between(0))
    control: bool = option(True, "also one-shot from the input at the same target and training steps, reported "
                           "beside (default {default}; only with --cycles above 1: one cycle is its own)",
                           names=("--control/--no-control",))

    def check(self) -> None:
        """Every value within its option's limit, a target (a fraction, or bytes) and the retraining's."""
        super().check()
        if self.target is None and self.target_bytes is None:
            raise UsageError(f"give {flag('target')} or {flag('target_bytes')}")
        self.heal_options().check()

    def steps(self) -> int:
        """Retraining steps per cycle: ``steps_per_cycle``, or SQUEEZE_STEPS split evenly over the
        cycles (rounded down, at least 1)."""
        return self.steps_per_cycle if self.steps_per_cycle is not None else max(1, SQUEEZE_STEPS // self.cycles)

    def heal_options(self) -> HealOptions:
        """The retraining's options (heal's, so they are checked and read the same way)."""
        return HealOptions(steps=self.steps(), lr=self.lr, batch_size=self.batch_size, seq_len=self.seq_len,
                           precision=self.precision, eval_fraction=self.eval_fraction,
                           eval_samples=self.eval_samples, seed=self.seed, train=self.train, patience=self.patience,
                           eval_every=self.eval_every, objective=self.objective, temperature=self.temperature,
                           ce_weight=self.ce_weight)


@dataclass
class Reading(Checked):
    """What every command that reads a checkpoint takes: pickle allowed, where to compute."""

    allow_pickle: bool = option(False, "read pickle (.bin) weights, with torch.load(weights_only=True); refused "
                                "otherwise", given=False, envvar="NORMSURGERY_ALLOW_PICKLE")
    device: str = option("auto", DEVICE_HELP, metavar="auto|cpu|cuda|cuda:N", check=DEVICE, given=False)


@dataclass
class Writing(Reading):
    """What every command that writes a checkpoint takes besides: whether OUT may be replaced."""

    force: bool = option(False, "replace OUT if it is a checkpoint (never a folder of other files), and --plot's "
                         "file if normsurgery drew it; a checkpoint written (not an ONNX export) is kept even if its "
                         "reload check fails", given=False)


#: convert --streaming/--in-memory (``convert.choose_plan``)
STREAMING_HELP = ("read and rewrite one block at a time (default: convert streams when every pass is blockwise, else "
                  "(a scan or training first) loads the model whole when it fits; verify streams only when the models "
                  "do not fit); --in-memory loads it whole")


@dataclass
class Sharded(Checked):
    """What a command or function that writes safetensors shards takes: the largest shard."""

    max_shard_size: str = option(MAX_SHARD_SIZE, "largest safetensors shard, e.g. 500MB", metavar="SIZE",
                                 check=SIZE_LIMIT, given=False)  # or a whole number of bytes

    @property
    def shard_bytes(self) -> int:
        """``max_shard_size`` in bytes (``limits.parse_size``: the one parse of it, checked by ``check``)."""
        return parse_size(self.max_shard_size)


@dataclass
class SaveOptions(Sharded):
    """save's options (``runner.save``: a model held in memory written as a checkpoint)."""

    force: bool = False  # replace ``out`` if it is a checkpoint (never a folder of other files)


@dataclass
class ConvertOptions(Writing, Sharded):
    """convert's options (``commands.convert.convert``); the passes, the checks' text and the
    progress are its arguments."""

    verify: bool = option(True, "skip the logit checks", negate=True, given=False)
    work_dtype: str | None = option(None, "float32 (default) or float64 for the rewrite (not half)", metavar="DTYPE",
                             check=DTYPE)  # or a torch.dtype; None: float32 (float64 for float64 weights)
    tolerance: float | None = option(None, "relative logit tolerance for exact passes (default by dtype)",
                                     metavar="X", check=POSITIVE, param="tol")
    streaming: bool | None = option(None, STREAMING_HELP, names=("--streaming/--in-memory",))
    on_overflow: str = option(ON_OVERFLOW[0], "a rewritten tensor that does not fit a float16/bfloat16 checkpoint "
                              "(overflow, or small values lost): refuse and write nothing, or keep that tensor in "
                              "float32 with a warning", metavar="|".join(ON_OVERFLOW), choices=ON_OVERFLOW, given=False)


@dataclass
class PassFlags(Checked):
    """What convert gives every pass of its recipe that has the option (``registry``: each pass's
    own options and limits); those not given are left to the recipe and the pass."""

    fold: bool = option(False, "set fold=true on every pass that has the option", given=False)
    steps: int | None = option(None, "trained passes: optimizer steps", metavar="N", check=COUNT)
    batch_size: int | None = option(None, "trained passes: windows per micro-batch and process", metavar="B", check=COUNT)
    seq_len: int | None = option(None, "trained passes: tokens per window", metavar="L", check=WINDOW)
    lr: float | None = option(None, "trained passes: peak learning rate", metavar="X", check=POSITIVE)
    resume: bool = option(False, "trained passes: continue an interrupted run", given=False)
    precision: str | None = option(None, **PRECISION_FLAG)

    def given(self) -> dict:
        """``{option: value}`` of those given (a switch: only when on)."""
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


@dataclass
class VerifyOptions(Reading):
    """verify's options (``commands.verify.verify``); the probe text is its argument."""

    dtype: str = option("float32", "compute dtype: float64 checks the algebra; float32, float16, bfloat16",
                        metavar="DTYPE", check=DTYPE, given=False)  # or a torch.dtype
    tolerance: float | None = option(None, "relative tolerance (default: from the compute and storage dtypes)",
                                     metavar="X", check=POSITIVE, param="tol")
    samples: int = option(PROBE_SAMPLES, "number of token windows", metavar="K", given=False, check=COUNT)
    seq_len: int | None = option(None, "tokens per window (default: {PROBE_LENGTH}, or the model's positions when "
                                 "fewer)", metavar="L", check=WINDOW)
    generate: int = option(PROBE_GENERATE, "greedy tokens to compare (0: skip)", metavar="N", given=False, check=COUNT0)
    per_layer: bool = option(False, "also compare every hidden state", names=("--layers",), param="layers",
                             given=False)
    streaming: bool | None = option(None, "read the checkpoints one block at a time, comparing only their outputs "
                                    "(default: only when the two do not fit in memory together); --in-memory loads "
                                    "each whole", names=("--streaming/--in-memory",))


@dataclass
class InspectOptions(Reading):
    """inspect --outliers' options (``commands.verify.outliers``)."""

    samples: int = option(OUTLIER_SAMPLES, "--outliers: token windows", metavar="K", given=False, check=COUNT)
    seq_len: int | None = option(None, "--outliers: tokens per window (default: {PROBE_LENGTH}, or the model's "
                                 "positions when fewer)", metavar="L", check=WINDOW)


@dataclass
class ExportOptions(Reading):
    """export's options (``exporters.export.export``, and ``gguf``'s and ``nemotron``'s); the check's text is
    its argument."""

    force: bool = option(False, "replace DEST if normsurgery wrote it: a GGUF file with its card beside it, or a "
                         "folder holding only what an export or a convert writes (never a file or folder of other "
                         "files)", given=False)
    to: str = option(FORMATS[0], "{choices}", names=("--to", "--format"), metavar="FORMAT", choices=FORMATS,
                     required=True)
    dtype: str | None = option(None, "GGUF: the matrices' type, {choices} (default {GGUF_DTYPE}: the checkpoint's, bf16 as BF16, "
                               "f16 as F16, f32 as F32)", metavar="TYPE",
                               choices=GGUF_DTYPES)  # None: GGUF_DTYPES[0] (a GGUF option only)
    external_data: bool | None = option(None, "weights beside the graph in model.onnx_data (default: when they "
                                        "exceed {EXTERNAL_SIZE})", names=("--external-data/--no-external-data",))
    with_past: bool = option(False, "decoders: key/value cache inputs and outputs, checked by {CACHE_TOKENS} greedy "
                             "tokens against generate", given=False)
    tolerance: float | None = option(None, "relative tolerance (default: float32 rounding)", metavar="X",
                                     check=POSITIVE, param="tol")
    runtime: str | None = option(None, "nemotron-nas: the runtime the folder is checked in, {choices} (default: the "
                                 "first installed)", metavar="RUNTIME", choices=CHECKS, param="check")

    def check(self) -> None:
        """Every value within its option's limit, and only the options of the format chosen."""
        super().check()
        if self.to != "nemotron-nas" and self.runtime is not None:
            raise UsageError("--check is a nemotron-nas option (--to nemotron-nas): the runtime its folder is "
                             "checked in")
        if self.to == "gguf" and (self.with_past or self.external_data is not None):
            raise UsageError("--with-past and --external-data are ONNX options; a GGUF file has neither")
        if self.to == "nemotron-nas" and (self.with_past or self.external_data is not None or self.dtype is not None):
            raise UsageError("--with-past, --external-data and --dtype are ONNX and GGUF options; a nemotron-nas "
                             "folder is stored in the checkpoint's dtype")
        if self.to == "onnx" and self.dtype is not None:
            raise UsageError("--dtype is a GGUF option (--to gguf); an ONNX graph is float32")


def options_of(cls, options=None, keywords: dict | None = None):
    """The API's options as options dataclass ``cls``, checked (``check``: every value within its
    option's limit, refused before any work): ``options`` itself, built from a dict of its fields, or
    (None) the defaults, with ``keywords`` set, so that ``convert(src, out, passes, force=True)`` and
    ``convert(src, out, passes, ConvertOptions(force=True))`` are one call."""
    base = options if isinstance(options, cls) else cls(**(options or {}))
    built = replace(base, **keywords) if keywords else base
    built.check()
    return built


def options_and_io(cls, options=None, keywords: dict | None = None):
    """The API's options as ``cls`` and how it reads and writes as :class:`Writing` (``keywords``' ``io``:
    the object or a dict of its fields), each checked (:func:`options_of`): the other ``keywords`` are
    fields of either (``force=True`` goes to ``io``, ``steps=3`` to the options), so ``heal(src, out,
    steps=3, force=True)`` is ``heal(src, out, {"steps": 3}, io={"force": True})``."""
    keywords, writing = dict(keywords or {}), {f.name for f in fields(Writing)}
    io = keywords.pop("io", None)
    return (options_of(cls, options, {k: v for k, v in keywords.items() if k not in writing}),
            options_of(Writing, io, {k: v for k, v in keywords.items() if k in writing}))


@dataclass
class LoadOptions(Reading):
    """load's options (``commands.load.load``): a checkpoint read whole into memory."""

    dtype: str | None = option(None, "float64, float32, float16 or bfloat16 (default: the checkpoint's storage dtype)",
                               check=DTYPE)  # or a torch.dtype
    stock: bool = option(False, "with the plain stock class, as from_pretrained without normsurgery would")
    device: str = option("cpu", DEVICE_HELP, check=DEVICE)  # host memory, as from_pretrained loads


__all__ += ["CACHE_TOKENS", "ConvertOptions", "EXTERNAL_BYTES", "ExportOptions", "InspectOptions", "LoadOptions",
            "PassFlags", "SaveOptions", "Sharded", "VerifyOptions", "options_and_io", "options_of"]

#: each command's options dataclass (prune's --heal flags are HealOptions' too)
COMMANDS = {"heal": HealOptions, "prune": PruneOptions, "squeeze": SqueezeOptions, "convert": ConvertOptions,
            "verify": VerifyOptions, "inspect": InspectOptions, "export": ExportOptions}

#: the limits of options given as a dict by name (``check_values``: the training loop's, ``training.TrainConfig``): heal's
LIMITS = {f.name: f.metadata["flag"].limit for f in flagged(HealOptions)}
