"""Options from one source (ARCHITECTURE.md): each command's defaults and choices live once, in
``normsurgery/options.py`` (no torch), and the CLI's flags are the API's: the same defaults when no
flag is given, the same choices accepted, the same ones listed."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from normsurgery import devices, options
from normsurgery.cli import app
from normsurgery.errors import SurgeryError
from normsurgery.options import HealOptions, PruneOptions, SqueezeOptions

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
STOP = "stopped by the test"

#: what each command's flags are, by option name: its own dataclass first (prune --heal: heal's)
FLAGS = {"heal": (HealOptions,), "prune": (PruneOptions, HealOptions), "squeeze": (SqueezeOptions,)}
#: the choices of the flags that have some
CHOICES = {"method": options.METHODS, "train": options.TRAIN_MODES, "by": options.CRITERIA,
           "structure": options.STRUCTURES, "precision": devices.PRECISION_CHOICES,
           "on_overflow": options.ON_OVERFLOW, "to": options.FORMATS}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def params(command: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[command].params}


def field_defaults(classes) -> dict:
    out = {}
    for cls in reversed(classes):
        out.update({f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(cls)})
    return out


def test_options_and_the_cli_modules_load_no_torch():
    code = ("import sys\nimport normsurgery.options, normsurgery.cli.heal, normsurgery.cli.prune, "
            "normsurgery.cli.squeeze, normsurgery.cli.convert, normsurgery.cli.export\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.parametrize("command", list(FLAGS))
def test_the_help_states_the_apis_defaults_and_choices(command):
    """Every flag that is an option of the API: no default of its own (None: the dataclass's applies)
    or the dataclass's; the default its help states is the dataclass's; the choices it lists are
    the API's."""
    defaults = field_defaults(FLAGS[command])
    checked = 0
    for name, p in params(command).items():
        if name not in defaults:
            continue
        d, text = defaults[name], f"{p.help} {p.metavar or ''}"
        assert p.default in (None, d), (command, name, p.default, d)
        stated = re.search(r"\(default:? ([^;:)]*)", p.help or "")
        if d is not None and name != "precision":  # --precision: devices.PRECISION_HELP, checked below
            assert stated, (command, name, p.help)
            shown = stated.group(1).strip()
            if isinstance(d, bool):
                assert shown == ("on" if d else "off"), (command, name, shown, d)
            elif isinstance(d, tuple):
                assert tuple(shown.split(",")) == d, (command, name, shown, d)
            elif isinstance(d, (int, float)):
                assert float(shown) == d, (command, name, shown, d)
            else:
                assert shown == str(d), (command, name, shown, d)
            checked += 1
        if name in CHOICES:
            assert all(c in text for c in CHOICES[name]), (command, name, text)
            for listed in re.findall(r"[\w-]+(?:\s*\|\s*[\w-]+)+", re.sub(r"\([^)]*\)", "", text)):
                assert set(re.split(r"\s*\|\s*", listed)) == set(CHOICES[name]), (command, name, listed)
    assert checked >= 5


ORIGINAL = {}  # the API's functions the stubs replace


@pytest.fixture
def stubbed(monkeypatch):
    """The API's commands replaced by a stub that records what the CLI passed and stops."""
    import importlib

    got = {}
    for module, name in (("heal", "heal"), ("prune", "prune"), ("squeeze", "squeeze"), ("convert", "convert"),
                         ("export", "export")):
        mod = importlib.import_module(f"normsurgery.{module}")

        def stub(src, out, *args, _name=name, **kwargs):
            got[_name] = (args, kwargs)
            raise SurgeryError(STOP)

        ORIGINAL.setdefault(name, getattr(mod, name))
        monkeypatch.setattr(mod, name, stub)
    return got


def called(got, name, result):
    assert result.exit_code == 1 and STOP in result.output, result.output
    return got.pop(name)


def test_no_flag_gives_the_apis_defaults(tmp_path, stubbed):
    out = tmp_path / "out"
    _, kw = called(stubbed, "heal", run("heal", LLAMA, out, "--text", SAMPLE))
    assert kw["options"] == HealOptions()
    args, kw = called(stubbed, "prune", run("prune", LLAMA, out, "--layers", 1, "--heal"))
    assert args[0] == PruneOptions(layers=1) and kw["heal"] == HealOptions()
    _, kw = called(stubbed, "squeeze", run("squeeze", LLAMA, out, "--text", SAMPLE))
    assert kw["options"] == SqueezeOptions()
    _, kw = called(stubbed, "convert", run("convert", LLAMA, out, "--pass", "flashnorm"))
    assert kw["on_overflow"] == inspect.signature(ORIGINAL["convert"]).parameters["on_overflow"].default


def value(got, name, key):
    args, kw = got.pop(name)
    if name == "prune":
        return getattr(args[0], key) if key == "method" else getattr(kw["heal"], key)
    if name in ("convert", "export"):
        return kw[key]
    return getattr(kw["options"], key)


CASES = [  # command, the flag's option name, the arguments before it
    ("heal", "train", ["--text", SAMPLE]),
    ("heal", "precision", ["--text", SAMPLE]),
    ("prune", "method", ["--layers", 1]),
    ("prune", "train", ["--layers", 1, "--heal"]),
    ("squeeze", "train", ["--text", SAMPLE]),
    ("squeeze", "by", ["--text", SAMPLE]),
    ("squeeze", "structure", ["--text", SAMPLE]),
    ("convert", "on_overflow", ["--pass", "flashnorm"]),
    ("export", "to", []),
]


@pytest.mark.parametrize("command, name, before", CASES, ids=[f"{c}-{n}" for c, n, _ in CASES])
def test_the_cli_takes_the_apis_choices_and_lists_them(tmp_path, stubbed, command, name, before):
    """Each choice the API has reaches the API unchanged; any other value is refused, and the refusal
    lists the API's choices."""
    choices = CHOICES[name]
    flag = options.flag(name)
    for c in choices:
        r = run(command, LLAMA, tmp_path / "out", *before, flag, c)
        got = value(stubbed, command, name) if STOP in r.output else r.output
        assert got == ((c,) if name == "structure" else c), (command, name, c, got)
    r = run(command, LLAMA, tmp_path / "out", *before, flag, "nonesuch")
    assert r.exit_code in (1, 2) and STOP not in r.output and not stubbed, r.output
    said = " ".join(r.output.replace("│", " ").split())
    listed = re.search(r"choose (?:one of|among) ((?:[\w-]+, )*[\w-]+)", said)
    assert listed and set(listed.group(1).split(", ")) == set(choices), said
