"""The one registry of passes.

A pass is a name, a one-line description, its kind and two functions over (model, layout):
``applies`` returns None when the pass can run, else the reason it cannot; ``apply`` rewrites
the model in place and returns a :class:`PassReport`.

- ``exact`` passes must preserve the function: the caller checks logits before and after.
- ``reference`` passes change it on purpose without training (a mask): what they output is the
  reference the following exact passes are checked against.
- ``trained`` passes change it on purpose: they get calibration text and a step budget through
  :class:`PassContext`, and report the quality they keep in ``metrics``.

A ``blockwise`` pass rewrites each part of a model (the embeddings, one block, the final norm
and head) from that part's tensors alone, so it may run one block at a time on a checkpoint
larger than memory (``streaming``): ``applies`` and ``apply`` then get a Layout restricted to
the part (``Layout.restrict``). A pass that needs whole-model facts (which channels any writer
writes, the least head count every block must keep) declares ``stages``: each a rewrite of one
part (:class:`Stage`) preceded by scans (:class:`Scan`) that read every part once, at the level
the stage starts from, and gather what they saw into ``PassContext.facts``; the rewrite then
runs part by part as any blockwise pass's. A pass that trains (or scores on a forward over the
whole model: ``whole``) needs the whole model in memory.

An exact pass may declare its own reference step (``reference``: minimize with a mask option
masks first): the caller runs it first and checks the pass against the model it leaves.

The built-in passes are registered by :func:`declare` in ``passes/__init__.py`` (imported by
whoever runs passes: the orchestration and the CLI; the registry never imports them): their
metadata (name, kind, description, options) is known without importing torch, and their
functions are imported from their module on first call, so ``normsurgery passes`` and the CLI's
argument checks answer at once. :func:`register` is the decorator for passes defined in one's
own code.
"""

from __future__ import annotations

import importlib
import tomllib
import typing
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import SurgeryError, UsageError
from .limits import Limit, did_you_mean
from .options import Checked, check_values, default_of, option


@dataclass(frozen=True)
class Later:
    """A value given as the function that makes it (``make()``), made when first read: a
    :class:`PassContext`'s tokenizer, which costs a command that reads no text up to 3 s of CPU
    (SmolLM2's: 3.2 s in a fresh process, the tokenizer modules' imports included; 0.44 s after)."""

    make: Callable[[], Any]


class Deferred:
    """A dataclass field that may be given as :class:`Later` (made on first read, then kept)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the field's default
        value = obj.__dict__.get(self.slot)
        if isinstance(value, Later):
            value = obj.__dict__[self.slot] = value.make()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class PassContext:
    """What a pass may need beyond the model: options, tokenizer (or :class:`Later`: loaded when a
    pass first reads it), text, progress; for trained passes the fine-tuning loop
    (``training.train``, given by the orchestration), a (step, total, loss) progress callback and
    a folder for resumable training state."""

    options: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = Deferred()
    text: str | None = None
    progress: Callable[[str], None] = lambda message: None
    train: Callable[..., Any] | None = None
    heldout_ce: Callable[..., float] | None = None  # ``training.heldout_ce``, given with ``train``
    # ``teacher.frozen_distillation``, given with ``train``: (the model now, objective, temperature, ce_weight)
    # -> what ``train``'s ``distillation=`` takes (a frozen copy of the model as the teacher), or None for ce
    distillation: Callable[..., Any] | None = None
    train_progress: Callable[[int, int, float], None] | None = None
    workdir: Path | None = None
    calibration: Any = None  # token windows [n, T] to calibrate on, instead of tokenizing ``text``
    storage_bytes: int | None = None  # bytes per floating-point value as the checkpoint stores it (sizes
    # reported in bytes count that, not the working dtype's; None: as held)
    facts: dict[str, Any] = field(default_factory=dict)  # what the running stage's scans gathered (``Scan``)


@dataclass
class PassReport:
    name: str
    notes: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    counted: dict[str, tuple[str, dict]] = field(default_factory=dict)  # note -> (template, values): see count
    sums: tuple[str, ...] = ()  # metrics summed over parts (lists element by element, dicts key by key)
    joined: tuple[str, ...] = ()  # metrics that are lists of the part's blocks, joined over parts in order
    same: tuple[str, ...] = ()  # whole-model integers every part reports alike (not summed)

    def count(self, template: str, **values) -> None:
        """A note, ``template`` formatted with ``values``. Where the model is rewritten in parts
        (``sweep``), the parts' notes of one template become one, its integer values summed
        (others: the first part's), so every plan says the same of the whole model."""
        note = template.format(**values)
        self.notes.append(note)
        self.counted[note] = (template, values)


@dataclass(frozen=True)
class Scan:
    """Whole-model facts a stage needs before it rewrites any part: ``collect(model, layout, ctx)``
    on every part in turn (read-only; the Layout restricted to the part, ``ctx.facts``: the
    earlier stages' facts), then ``gather(collected, layout, ctx) -> dict`` (``layout``: the whole
    model's), added to ``ctx.facts``. In memory the one part is the whole model: the same code."""

    collect: Callable[..., Any]
    gather: Callable[..., dict]


@dataclass(frozen=True)
class Stage:
    """One stage of a pass on a part: its ``scans`` first (once for the whole model), then
    ``run(model, layout, ctx, report)``, adding to the part's ``report``."""

    run: Callable[..., None]
    scans: tuple[Scan, ...] = ()


@dataclass(frozen=True)
class Pass:
    name: str
    description: str
    kind: str  # one of KINDS
    families: str  # human-readable: where it applies
    applies: Callable[..., str | None]
    apply: Callable[..., PassReport] | None  # None: the pass is its ``stages``
    options: dict[str, Any] = field(default_factory=dict)  # option name -> default (``model``'s)
    reference: Callable[..., PassReport | None] | None = None  # changes the function first, on purpose
    blockwise: bool = False  # may run one part of the model at a time (see the module docstring)
    limits: dict[str, Limit] = field(default_factory=dict)  # option name -> the values it takes (``model``'s)
    # (model, layout, options) -> why not, before any weight is read (the model may be on the meta device)
    check: Callable[..., str | None] | None = None
    # (options, layout) -> [Stage]: a blockwise pass that needs whole-model facts, in place of ``apply``
    # (the executor runs them, in memory as part by part); ``reference_stages``: its reference step's
    stages: Callable[..., list[Stage]] | None = None
    reference_stages: Callable[..., list[Stage]] | None = None
    # (options) -> why these options need the whole model in memory (None: they stream)
    whole: Callable[[dict], str | None] | None = None
    # every write it makes is seen by torch's version counter, or is a new tensor (a built-in pass:
    # tests/test_pipeline.py checks each); False (``register``): every parameter of a part it ran on
    # counts as changed, none is copied as stored
    tracked: bool = False
    # (layout, options) -> the module paths whose parameters it reads or writes on the part the
    # layout holds; the executor's write sweep leaves the rest unread (their bytes copied as stored,
    # never decoded: ``sweep.Work.enter``). None: it may read any parameter
    reads: Callable[..., set[str]] | None = None
    # (options) -> why these options read text (a usage fact: without text the command stops before
    # anything is loaded, :func:`check_text`); None: it reads none
    text: Callable[[dict], str | None] | None = None
    # the options dataclass (``options.option`` fields: defaults, limits, help; ``Declared.options``);
    # None: one made from ``options`` (:func:`options_model`)
    model: type | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", options_model(self.options))


def trains_on_text(options: dict) -> str:
    """A trained pass's text: what it trains on."""
    return "trains on text"


KINDS = ("exact", "reference", "trained")
PASSES: dict[str, Pass] = {}


@dataclass(frozen=True)
class Declared:
    """What a pass declares about itself beside its name and functions: a one-line ``description``,
    its ``kind`` (one of :data:`KINDS`), where it applies (``families``, in words), its options (an
    options dataclass of ``options.option`` fields: default, limit and help each, as the commands'; or,
    for a pass of one's own, a dict of defaults, a given value coerced to its default's type), and
    whether it may run one part of the model at a time (``blockwise``: see the module docstring)."""

    description: str
    kind: str
    families: str
    options: type | dict[str, Any] = field(default_factory=dict)
    blockwise: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(self.kind)

    def model(self) -> type:
        """The options dataclass: ``options``, or one made from its dict of defaults."""
        return self.options if isinstance(self.options, type) else options_model(self.options)


def options_model(defaults: dict[str, Any]) -> type:
    """An options dataclass of ``defaults``' options (a pass of one's own: each value coerced to its
    default's type, no limit)."""
    return make_dataclass("Options", [(k, Any if v is None else type(v), option(v)) for k, v in defaults.items()],
                          bases=(Checked,))


def _described(name: str, d: Declared, **functions) -> Pass:
    """The pass ``name`` as ``d`` declares it, with ``functions`` (``applies``, ``apply``, ...; one that is
    its ``stages`` runs part by part, as a blockwise pass)."""
    model = d.model()
    named = [f for f in fields(model) if f.init]
    return Pass(name, d.description, d.kind, d.families, options={f.name: default_of(f) for f in named},
                blockwise=d.blockwise or functions.get("stages") is not None, limits={f.name: f.metadata["flag"].limit for f in named
                                               if "flag" in f.metadata and f.metadata["flag"].limit is not None},
                model=model, **functions)


def register(name: str, declared: Declared, applies, reference=None, tracked: bool = False):
    """Decorator registering ``apply(model, layout, ctx) -> PassReport`` under ``name``, as
    ``declared``; ``tracked``: it writes parameters in place or replaces them, never through
    ``.data`` (``Pass.tracked``)."""

    def wrap(apply):
        PASSES[name] = _described(name, declared, applies=applies, apply=apply, reference=reference, tracked=tracked)
        return apply

    return wrap


@dataclass(frozen=True)
class Lazy:
    """``module.attr``, imported when first called (the built-in passes' functions)."""

    module: str
    attr: str

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module(self.module), self.attr)(*args, **kwargs)


#: the functions a built-in pass's module may have beyond ``applies`` and ``apply`` (``declare``'s ``has``)
FUNCTIONS = ("reference", "check", "stages", "reads")


def declare(name: str, module: str, declared: Declared, has: tuple[str, ...] = (),
            text: Callable[[dict], str | None] | None = None) -> None:
    """Register the pass ``name``, as ``declared``, whose ``applies`` and ``apply`` (and those of
    :data:`FUNCTIONS` it ``has``: ``reference``, ``check``, ``reads``; ``stages``: ``stages``,
    ``whole`` and with a reference ``reference_stages``, in place of ``apply``) are functions of
    ``module``, imported on first use. ``text``: why its options read text (``Pass.text``; a trained
    pass: it trains on it)."""
    unknown = set(has) - set(FUNCTIONS)
    if unknown:
        raise ValueError(f"{name}: no such functions {sorted(unknown)}; a pass may have {', '.join(FUNCTIONS)}")
    stages, reference = "stages" in has, "reference" in has
    PASSES[name] = _described(
        name, declared, applies=Lazy(module, "applies"), apply=None if stages else Lazy(module, "apply"),
        reference=Lazy(module, "reference") if reference and not stages else None,
        check=Lazy(module, "check") if "check" in has else None, stages=Lazy(module, "stages") if stages else None,
        reference_stages=Lazy(module, "reference_stages") if stages and reference else None,
        whole=Lazy(module, "whole") if stages else None, tracked=True,
        reads=Lazy(module, "reads") if "reads" in has else None,
        text=text or (trains_on_text if declared.kind == "trained" else None))


def get(name: str) -> Pass:
    if name not in PASSES:
        raise SurgeryError(f"unknown pass {name!r}; registered: {', '.join(sorted(PASSES))}")
    return PASSES[name]


def all_passes() -> list[Pass]:
    return [PASSES[n] for n in sorted(PASSES)]


#: pass options renamed, by their old name: refused, the new one named
RENAMED = {"heldout": "eval_fraction"}


def check_options(p: Pass, options: dict[str, Any]) -> dict[str, Any]:
    """The pass's options (its ``model``, an options dataclass) from ``options``: each given value of
    its field's type (a string from the command line converted) and within its limit (``Limit.refusal``,
    the one check of the commands' options too); the rest their defaults. An unknown name is a
    :class:`UsageError` naming the closest (or the name it was renamed to: :data:`RENAMED`)."""
    for key in set(options) - set(p.options):
        known = ", ".join(p.options) or "none"
        hint = (f" (renamed {RENAMED[key]!r}, as the commands' --{RENAMED[key].replace('_', '-')})"
                if RENAMED.get(key) in p.options else did_you_mean(key, p.options))
        raise UsageError(f"pass {p.name!r} has no option {key}{hint}; options: {known}")
    hints = typing.get_type_hints(p.model)
    built = p.model(**{k: _coerce(p.name, k, v, hints[k]) for k, v in options.items()})
    check_values(built, lambda k: f"pass {p.name!r}: option {k}")
    return asdict(built)


def check_text(passes: list[tuple[str, dict[str, Any]]], given: bool) -> None:
    """Refuse (:class:`UsageError`, before anything is loaded) a pass whose options read text
    (``Pass.text``) when none is ``given``."""
    if given:
        return
    for name, options in passes:
        p = get(name)
        why = p.text(check_options(p, options)) if p.text is not None else None
        if why:
            raise UsageError(f"pass {name} {why}: give it text (--text FILE)")


def _coerce(name: str, key: str, value, hint):
    """An option's value of its field's type ``hint`` (``X | None``: X): from a string (the command line),
    or a TOML value (a whole number where a float is expected is one)."""
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    kind = kinds[0]
    if kind not in (bool, int, float):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if kind is bool:
            if text in ("true", "false", "1", "0", "yes", "no"):
                return text in ("true", "1", "yes")
        else:
            try:
                return kind(value)
            except ValueError:
                pass
    elif kind is bool and isinstance(value, bool) or kind is int and isinstance(value, int) and not isinstance(
            value, bool) or kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return kind(value)
    raise UsageError(f"pass {name!r}: option {key}={value!r} is not a {kind.__name__}")


def parse_pass(spec: str) -> tuple[str, dict[str, str]]:
    """``name`` or ``name:key=value,key=value`` -> (name, options)."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"pass option {item!r} in {spec!r} is not key=value")
        options[key.strip().replace("-", "_")] = value.strip()
    return name.strip(), options


def read_recipe(path) -> dict[str, Any]:
    """The tables of a TOML recipe file (``[[pass]]`` for convert, ``[prune]``/``[heal]`` for prune)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise SurgeryError(f"no recipe at {path}") from None
    except UnicodeDecodeError:
        raise SurgeryError(f"recipe {path} is not a text file") from None
    except tomllib.TOMLDecodeError as e:
        raise SurgeryError(f"recipe {path} is not valid TOML: {e}") from None


def load_recipe(path) -> list[tuple[str, dict[str, Any]]]:
    """A TOML recipe: ``[[pass]]`` tables, each with ``name`` and the pass's options."""
    data = read_recipe(path)
    steps = data.get("pass", [])
    if not steps or not all(isinstance(s, dict) and "name" in s for s in steps):
        raise SurgeryError(f"recipe {path} needs one or more [[pass]] tables with a name")
    return [(s["name"], {k: v for k, v in s.items() if k != "name"}) for s in steps]
