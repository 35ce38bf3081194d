"""A command's flags built from its options dataclasses (``core.options``: each field's default,
choices, range and help, once), mergekit's pattern: a parameter of a command function annotated
with an options dataclass becomes one Typer flag per field (:func:`expand`), and the command
receives what was given on the command line (:class:`Given`), from which it builds the dataclass
(with a recipe's values between the flags and the defaults, where the command reads one).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Optional

import typer

from ..core.options import Flag, Writing, default_of, flagged

#: the options every command that reads (or writes) a checkpoint shares: listed after a command's own
SHARED = frozenset(f.name for f in dataclasses.fields(Writing))


@dataclasses.dataclass(frozen=True)
class Given:
    """The flags of options dataclass ``cls`` given on the command line (those left out: absent)."""

    cls: type
    values: dict[str, Any]

    def build(self, recipe: dict | None = None, **extra):
        """``cls`` from the flags given, then ``recipe``'s values, then the defaults (``extra``: values
        that are not flags, or shared with another group)."""
        merged = {f.name: default_of(f) for f in dataclasses.fields(self.cls) if f.init}
        merged.update({k: v for k, v in (recipe or {}).items() if k in merged})
        merged.update(self.values)
        merged.update(extra)
        return self.cls(**merged)


@dataclasses.dataclass(frozen=True)
class Flags:
    """How a command takes options dataclass ``cls``: ``only`` these fields (default all flagged),
    each help prefixed with ``prefix`` (``prune --heal``'s "heal: ")."""

    cls: type
    only: tuple[str, ...] | None = None
    prefix: str = ""

    def fields(self) -> list:
        """The fields taken, in ``only``'s order, else the command's own first, then those every
        reading or writing command shares (``Writing``'s)."""
        chosen = [f for f in flagged(self.cls) if self.only is None or f.name in self.only]
        if self.only:
            return sorted(chosen, key=lambda f: self.only.index(f.name))
        return sorted(chosen, key=lambda f: f.name in SHARED)


def _split_parts(value: str | None) -> tuple[str, ...] | None:
    """``a,b`` -> (a, b)."""
    return None if value is None else tuple(s.strip() for s in value.split(",") if s.strip())


def split_names(names: list[str] | None) -> list[str] | None:
    """``--target-modules q_proj,v_proj --target-modules o_proj`` -> [q_proj, v_proj, o_proj]."""
    out = [n.strip() for item in names or [] for n in item.split(",") if n.strip()]
    return out or None


#: how a flag's value becomes the field's (:attr:`Flag.parse`): the type the flag takes, and the conversion
PARSERS: dict[str, tuple[Any, Callable]] = {"names": (Optional[list[str]], split_names),
                                            "parts": (Optional[str], _split_parts)}


def checking(limit, parse: Callable | None = None) -> Callable:
    """The Typer callback that refuses a value outside ``limit`` (``parse``: the value as the field takes
    it, first) with the words the API's check uses (``Limit.refusal``): a usage error, exit 2."""
    def callback(value):
        why = limit.refusal(parse(value) if parse else value)
        if why:
            raise typer.BadParameter(why)
        return value

    return callback


def _annotation(cls: type, f, flag: Flag):
    """The type Typer parses the flag as: the field's (Optional where the flag defaults to None)."""
    if flag.parse:
        return PARSERS[flag.parse][0]
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args and type(None) in typing.get_args(hint) else hint
    return Optional[base] if flag.given and not flag.required or default_of(f) is None else base


def flag_default(f) -> Any:
    """What field ``f``'s flag defaults to: ``...`` (required), None (not given: the dataclass's default
    applies, or a recipe's), or the field's default (negated for a ``--no-`` flag)."""
    flag: Flag = f.metadata["flag"]
    if flag.required:
        return ...
    if flag.given:
        return None
    return not default_of(f) if flag.negate else default_of(f)


def parameter(flags: Flags, f) -> inspect.Parameter:
    """The Typer flag of field ``f``."""
    flag: Flag = f.metadata["flag"]
    name = flag.name(f.name)
    names = flag.names or (f"--{name.replace('_', '-')}",)
    kw = {"metavar": flag.metavar, "help": flags.prefix + flag.text(default_of(f))}
    if flag.limit is not None:
        kw["callback"] = checking(flag.limit, PARSERS[flag.parse][1] if flag.parse else None)
    if flag.envvar:
        kw["envvar"] = flag.envvar
    if isinstance(default_of(f), bool) and not flag.names:
        kw.pop("metavar")
    option = typer.Option(flag_default(f), *names, **kw)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=_annotation(flags.cls, f, flag))


def _group(annotation) -> Flags | None:
    """The flags a command parameter stands for: an options dataclass, or :class:`Flags` of one."""
    if isinstance(annotation, Flags):
        return annotation
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return Flags(annotation)
    return None


def _given(flags: Flags, kwargs: dict, plain: bool) -> Any:
    """The fields of ``flags`` taken out of ``kwargs``: a :class:`Given` (``plain``: the dataclass built)."""
    values = {}
    for f in flags.fields():
        flag: Flag = f.metadata["flag"]
        v = kwargs.pop(flag.name(f.name))
        v = PARSERS[flag.parse][1](v) if flag.parse else not v if flag.negate else v
        if v is not None:
            values[f.name] = v
    given = Given(flags.cls, values)
    return given.build() if plain else given


def expand(fn: Callable) -> Callable:
    """``fn`` with each parameter annotated by an options dataclass (or :class:`Flags` of one)
    replaced by that dataclass's flags; called with the dataclass built from them (annotated
    ``Given[...]``-style by :class:`Flags`: the :class:`Given` itself, for a recipe to merge)."""
    sig = inspect.signature(fn, eval_str=True)
    params, groups = [], {}
    for p in sig.parameters.values():
        flags = _group(p.annotation)
        if flags is None:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.default is not p.empty else p)
            continue
        groups[p.name] = (flags, not isinstance(p.annotation, Flags))
        params += [parameter(flags, f) for f in flags.fields()]
    names = [p.name for p in params]
    if len(names) != len(set(names)):
        raise TypeError(f"{fn.__name__}: a flag is declared twice: {sorted({n for n in names if names.count(n) > 1})}")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for name, (flags, plain) in groups.items():
            kwargs[name] = _given(flags, kwargs, plain)
        return fn(*args, **kwargs)

    call.__signature__ = sig.replace(parameters=params)
    call.flags = {f.metadata["flag"].name(f.name): (flags, f)  # for tests and docs
                  for flags, _ in groups.values() for f in flags.fields()}
    call.__annotations__ = {p.name: p.annotation for p in params}
    return call


#: the arguments of the commands that read a checkpoint and write one
IN = typer.Argument(..., metavar="IN", help="input checkpoint: a folder or a cached hub id")
OUT = typer.Argument(..., metavar="OUT", help="output folder, written atomically (never inside IN)")
