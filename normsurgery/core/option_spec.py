"""How an option is declared, once, for the CLI, the API and recipes: the commands' constants
(defaults, choices, the numbers a help may name), a field's :class:`Flag` (help, choices, range
check, spelling) and :func:`option`. ``options.py`` declares each command's options with them.

No torch here: ``--help`` and usage errors are answered without it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any

from .devices import PRECISION_HELP
from .limits import PRECISION, Limit, one_of as one_of_values

#: tokens per window when none is given (or the model's positions when fewer: ``calibration.fit_seq_len``)
SEQ_LEN = 128
#: prune --method: how the layers to remove are chosen (``prune``)
METHODS = ("angular", "block-influence", "last")
#: heal / squeeze --train, prune --heal --train: what trains
TRAIN_MODES = ("lora", "norms", "full")
#: heal --objective: ``kd`` the KL to the teacher alone; ``ce`` next-token (or masked-token) cross-entropy;
#: ``kd+ce`` their weighted sum (``core.distillation``)
OBJECTIVES = ("kd", "ce", "kd+ce")
#: heal's --lr when none is given, by --train (``HealOptions.learning_rate``): the rates measured best of those
#: tried on the demo llama-tiny pruned by 2 layers (benchmarks/bench_heal_modes.py, README "heal"); every
#: parameter (full) takes a tenth of LoRA's rate (at LoRA's, held-out CE rose after a quarter epoch on
#: SmolLM2-135M), the few gains of the norms five times it
LEARNING_RATES = {"lora": 2e-3, "norms": 1e-2, "full": 2e-4}
#: squeeze --structure: what the masks remove (``squeeze``)
STRUCTURES = ("units", "heads", "channels")
#: squeeze's retraining steps in all when --steps-per-cycle is not given, split evenly over the cycles
#: (one cycle, the default: all of them; 3 cycles: 300 each, the measured Squeeze-Release regime)
SQUEEZE_STEPS = 900
#: squeeze --by, the mask pass's ``by``: how units and heads are ranked (``masks``)
CRITERIA = ("magnitude", "activation")
#: convert --on-overflow: a rewritten tensor that does not fit a half-precision checkpoint (``precision``)
ON_OVERFLOW = ("refuse", "keep-float32")
#: convert --max-shard-size: the largest safetensors shard written (``writer.save_work``), as transformers'
#: ``save_pretrained`` spells its default
MAX_SHARD_SIZE = "5GB"
#: verify --samples: probe windows compared (``verify.verify``)
PROBE_SAMPLES = 4
#: verify and inspect --outliers --seq-len: tokens per probe window when none is given (fewer when the model
#: has fewer positions: ``verify.probe_length``)
PROBE_LENGTH = 64
#: verify --generate: greedy tokens compared (0: none)
PROBE_GENERATE = 16
#: inspect --outliers --samples: calibration windows (``verify.outliers``)
OUTLIER_SAMPLES = 8
#: export --to (``export``)
FORMATS = ("onnx", "gguf", "nemotron-nas")
#: export --to gguf --dtype: the matrices' storage type in the GGUF file (1-D tensors stay F32); auto: the
#: checkpoint's own (bf16 stays BF16, f16 F16, f32 F32), as llama.cpp's converter keeps the input's precision
GGUF_DTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
#: export --to nemotron-nas --check: the runtimes the folder is checked in (the default: the first installed)
CHECKS = ("mlx", "vllm")
#: export (ONNX): weights above this many bytes go to external data, model.onnx_data (protobuf caps a file at 2 GB)
EXTERNAL_BYTES = 1 << 30
#: export --with-past: greedy tokens generated through the key/value cache, compared with ``generate``'s
CACHE_TOKENS = 16


@dataclass(frozen=True)
class Flag:
    """How an option of a command's options dataclass is spelled on the command line (the CLI
    builds its Typer flags from these: ``cli.flags``). ``help`` may name ``{default}`` (the
    field's default as --help shows it: :func:`shown`), ``{choices}`` (:func:`one_of`) and the
    constants of :data:`HELP_VALUES`, so no number is written into a help text.

    ``names``: spellings other than ``--field-name`` (``("--layers", "-n")``, ``("--streaming/--in-memory",)``);
    ``given``: the flag defaults to None (not given: the dataclass's default applies, or a
    recipe's), else to the field's default, shown by --help; ``check``: the values it takes (a
    :class:`~.limits.Limit`; ``choices`` alone: one of them), refused by :func:`check_values` for the
    API and recipes and by the CLI's flag (``cli.flags``) with the same words; ``parse``: how the CLI's
    value becomes the field's (``cli.flags.PARSERS``). ``param``: the command-line parameter's name
    where it is not the field's (``tolerance`` is ``--tol``); ``negate``: the flag is ``--no-FIELD``,
    its value the field's negation (``verify`` is ``--no-verify``); ``required``: the command line
    must give it (the API has the field's default)."""

    help: str
    metavar: str | None = None
    names: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    check: Limit | None = None
    parse: str | None = None
    given: bool = True
    envvar: str | None = None
    param: str | None = None
    negate: bool = False
    required: bool = False

    def text(self, default: Any) -> str:
        """The help, its ``{default}``, ``{choices}`` and constants filled in."""
        listed = one_of(self.choices, None if self.required else default)
        return self.help.format(default=shown(default), choices=listed, **HELP_VALUES)

    @cached_property
    def limit(self) -> Limit | None:
        """The values the option takes: ``check``, else one of ``choices``."""
        return self.check or (one_of_values(*self.choices) if self.choices else None)

    def spelled(self, field_name: str) -> str:
        """The flag as the command line spells it: ``--tol`` for ``tolerance``, ``--no-verify``."""
        return self.names[0].split("/")[0] if self.names else flag(self.name(field_name))

    def name(self, field_name: str) -> str:
        """The command-line parameter's name for field ``field_name``."""
        return self.param or (f"no_{field_name}" if self.negate else field_name)


def option(default: Any = None, help: str = "", **flag) -> Any:
    """A field of an options dataclass with its flag (:class:`Flag`); a list default is copied per instance."""
    meta = {"flag": Flag(help, **flag)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flagged(cls) -> list:
    """The fields of options dataclass ``cls`` that are flags, in order."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def default_of(f) -> Any:
    """A dataclass field's default (a fresh copy of a factory's)."""
    return f.default_factory() if f.default is MISSING else f.default


def shown(default: Any) -> str:
    """A default as --help states it: on/off, a comma list, a float in its shortest form."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, (tuple, list)):
        return ",".join(map(str, default))
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def one_of(choices, default=None) -> str:
    """``a | b | c (default a)``: a flag's choices and default as --help shows them."""
    return " | ".join(choices) + ("" if default is None else f" (default {default})")


#: the share of the text held out when no held-out text is given (heal, prune --heal, squeeze)
EVAL_FRACTION = 0.1
#: tokens per window, as --help says it
SEQ_LEN_HELP = f"tokens per window (default: {SEQ_LEN}, or the model's positions when fewer)"

#: the constants a help text may name (:meth:`Flag.text`): numbers stated where they are defined
HELP_VALUES = {"SEQ_LEN": SEQ_LEN, "SQUEEZE_STEPS": SQUEEZE_STEPS, "SQUEEZE_THIRD": SQUEEZE_STEPS // 3,
               "LR_BY_TRAIN": ", ".join(f"{mode} {lr:g}" for mode, lr in LEARNING_RATES.items()),
               "PROBE_LENGTH": PROBE_LENGTH, "PROBE_SAMPLES": PROBE_SAMPLES, "PROBE_GENERATE": PROBE_GENERATE,
               "OUTLIER_SAMPLES": OUTLIER_SAMPLES, "MAX_SHARD_SIZE": MAX_SHARD_SIZE, "GGUF_DTYPE": GGUF_DTYPES[0],
               "EXTERNAL_SIZE": f"{EXTERNAL_BYTES / 2**30:g} GiB", "CACHE_TOKENS": CACHE_TOKENS}


def flag(name: str) -> str:
    """The command-line spelling of option ``name``: ``seq_len`` -> ``--seq-len``."""
    return f"--{name.replace('_', '-')}"


#: --precision, as every training command spells it
PRECISION_FLAG = {"help": PRECISION_HELP, "metavar": "auto|fp32|bf16|fp16", "check": PRECISION}
