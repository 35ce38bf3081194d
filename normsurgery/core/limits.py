"""The values an option takes, declared once beside the option (``options.option(check=...)``, the
passes' options in ``passes/__init__.py``) and refused by one function, :meth:`Limit.refusal`, for
the command line, recipes and the API alike. No torch here: usage errors answer before it loads.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable

from .devices import PRECISION_CHOICES, PRECISIONS, SPEC

__all__ = ["Limit", "between", "did_you_mean", "matching", "one_of", "parse_size", "some_of", "whole"]


@dataclass(frozen=True)
class Limit:
    """The values an option takes: ``ok(value)``, said by ``text`` ("in [0, 1)"); ``said(value)``:
    the refusal where it is not ``must be TEXT, got VALUE`` (a choice lists the choices)."""

    text: str
    ok: Callable[[Any], bool]
    said: Callable[[Any], str] | None = None

    def refusal(self, value: Any) -> str | None:
        """Why ``value`` is refused (None: taken; None, an option not given, always is)."""
        if value is None or self.ok(value):
            return None
        return self.said(value) if self.said else f"must be {self.text}, got {value!r}"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def between(low: float, high: float | None = None, *, open_low: bool = False, open_high: bool = True) -> Limit:
    """A number with low <= x < high (by default; ``open_low``: low < x, ``open_high=False``: x <= high);
    ``high`` None: no upper bound."""
    text = (f"{'>' if open_low else '>='} {low:g}" if high is None else
            f"in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}")
    return Limit(text, lambda x: _number(x) and (x > low if open_low else x >= low)
                 and (high is None or (x < high if open_high else x <= high)))


def whole(least: int) -> Limit:
    """A whole number of at least ``least``."""
    return Limit(f"a whole number >= {least}", lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= least)


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` (case, - and _ ignored), or ''."""
    choices = list(choices)
    key = str(name).lower().replace("_", "-")
    close = [c for c in choices if c.lower().replace("_", "-") == key]
    close = close or difflib.get_close_matches(key, choices, 1, 0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_of(*values: str, accepted=None) -> Limit:
    """One of ``values`` (``accepted``: the values taken, where more than those listed: aliases)."""
    taken = tuple(accepted or values)
    return Limit(f"one of {', '.join(values)}", lambda x: x in taken,
                 lambda x: f"{x!r}: choose one of {', '.join(values)}{did_you_mean(x, values)}")


def some_of(*values: str) -> Limit:
    """One or more of ``values`` (a tuple)."""
    return Limit(f"some of {', '.join(values)}", lambda x: bool(x) and all(v in values for v in x),
                 lambda x: f"{','.join(x)!r}: choose among {', '.join(values)}")


def matching(pattern: str, text: str, said: str, also: Callable[[Any], bool] = lambda x: False) -> Limit:
    """A string matching ``pattern`` whole (or any value ``also`` takes: a ``torch.device``), said by
    ``text``; refused with ``said`` (``{value!r}`` filled in)."""
    compiled = re.compile(pattern)
    return Limit(text, lambda x: also(x) or isinstance(x, str) and bool(compiled.fullmatch(x)),
                 lambda x: said.format(value=x))


#: the units of a shard size, as transformers' ``convert_file_size_to_int`` reads them (KB: 10^3, KiB: 2^10;
#: a lower-case final b, as in Gb: bits)
UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
SIZE = r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*"


def parse_size(size: str | int) -> int:
    """A size in bytes from ``500MB``, ``2GiB``, ``1.5GB`` or a whole number of bytes, units as transformers
    reads them (``UNITS``) (ValueError: not a size, or not a positive one)."""
    if isinstance(size, int) and not isinstance(size, bool):
        bytes_ = size
    else:
        found = re.fullmatch(SIZE, size, re.IGNORECASE) if isinstance(size, str) else None
        if not found:
            raise ValueError(size)
        unit = found.group(2) or ""
        bits = unit.endswith("b") and not unit.upper().endswith("IB")
        bytes_ = int(float(found.group(1)) * UNITS[unit.upper()]) // (8 if bits else 1)
    if bytes_ < 1:
        raise ValueError(size)
    return bytes_


def _is_size(x) -> bool:
    try:
        parse_size(x)
    except ValueError:
        return False
    return True


#: a shard size (``parse_size``)
SIZE_LIMIT = Limit("a size (bytes, or e.g. 500MB, 2GB)", _is_size, lambda x: f"{x!r} is not a size; give bytes or "
                   "e.g. 500MB, 2GB")


#: the limits options share (each declared on its options with ``check=``; one name, one limit)
COUNT, COUNT0, WINDOW = whole(1), whole(0), whole(2)  # at least 1; at least 0; a window's tokens
POSITIVE, FRACTION = between(0, open_low=True), between(0, 1, open_low=True)  # > 0; in (0, 1)
#: --precision's values (an alias, ``no``, taken)
PRECISION = one_of(*PRECISION_CHOICES, accepted=PRECISIONS)
#: a compute dtype (or a ``torch.dtype``, from the API)
DTYPES = ("float64", "float32", "float16", "bfloat16")
_NAMED = one_of(*DTYPES, accepted=DTYPES + tuple(f"torch.{d}" for d in DTYPES))
DTYPE = Limit(_NAMED.text, lambda x: _NAMED.ok(str(x)), _NAMED.said)
#: where to compute (or a ``torch.device``, from the API)
DEVICE = matching(SPEC.pattern, "a device", "{value!r}: choose auto, cpu, cuda or cuda:N",
                  also=lambda x: type(x).__name__ == "device")
