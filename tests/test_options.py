"""Options from one source (ARCHITECTURE.md): each command's defaults and choices live once, in
``normsurgery/core/options.py`` (no torch), and the CLI's flags are the API's: the same defaults when no
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

from normsurgery.core import devices
from normsurgery.core import options
from normsurgery.cli import app
from normsurgery.cli.flags import Flags, expand
from normsurgery.core.errors import SurgeryError
from normsurgery.core.options import (ConvertOptions, ExportOptions, HealOptions, InspectOptions, PruneOptions,
                                     SqueezeOptions, VerifyOptions, Writing)

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
    code = ("import sys\nimport normsurgery.core.options, normsurgery.cli.heal, normsurgery.cli.prune, "
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
    for module, name in (("commands.heal", "heal"), ("commands.prune", "prune"), ("commands.squeeze", "squeeze"),
                         ("commands.convert", "convert"), ("exporters.export", "export"), ("commands.verify", "verify"),
                         ("commands.verify", "outliers")):
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
    args, _ = called(stubbed, "convert", run("convert", LLAMA, out, "--pass", "flashnorm"))
    assert args[1] == ConvertOptions() and args[1].on_overflow == options.ON_OVERFLOW[0]


WRITING = ["--force", "--allow-pickle", "--device", "cpu"]


@pytest.mark.parametrize("command, before", [("heal", ["--text", SAMPLE]), ("prune", ["--layers", 1]),
                                             ("squeeze", ["--text", SAMPLE])])
def test_the_api_takes_the_clis_writing_flags_as_one_object(tmp_path, stubbed, command, before):
    """--force, --allow-pickle and --device reach the API as the one ``Writing`` its ``io`` takes."""
    _, kw = called(stubbed, command, run(command, LLAMA, tmp_path / "out", *before, *WRITING))
    assert kw["io"] == Writing(force=True, allow_pickle=True, device="cpu")
    _, kw = called(stubbed, command, run(command, LLAMA, tmp_path / "out", *before))
    assert kw["io"] == Writing()


def test_a_flag_prune_shares_with_heal_feeds_both(tmp_path, stubbed):
    """--seq-len, --batch-size and --eval-samples are prune's flags; given, heal's options take them too."""
    args, kw = called(stubbed, "prune", run("prune", LLAMA, tmp_path / "out", "--layers", 1, "--heal", "--seq-len", 16,
                                            "--batch-size", 2, "--eval-samples", 3, "--save-adapter"))
    shared = {"seq_len": 16, "batch_size": 2, "eval_samples": 3}
    assert args[0] == PruneOptions(layers=1, **shared) and kw["heal"] == HealOptions(save_adapter=True, **shared)


#: an out-of-range value of each kind of limit: command, what comes before the flag, the option, its value on the
#: command line and in the API, the options model the API takes it in
REFUSED = [
    ("prune", ["--layers", 1], "method", "angulr", "angulr", PruneOptions),
    ("prune", ["--layers", 1, "--heal"], "rank", "0", 0, HealOptions),
    ("heal", ["--text", SAMPLE], "eval_fraction", "1", 1.0, HealOptions),
    ("heal", ["--text", SAMPLE], "lr", "0", 0.0, HealOptions),
    ("heal", ["--text", SAMPLE], "seq_len", "1", 1, HealOptions),
    ("heal", ["--text", SAMPLE], "precision", "fp8", "fp8", HealOptions),
    ("heal", ["--text", SAMPLE], "device", "tpu", "tpu", Writing),
    ("squeeze", ["--text", SAMPLE], "target", "1.5", 1.5, SqueezeOptions),
    ("squeeze", ["--text", SAMPLE], "structure", "units,layers", ("units", "layers"), SqueezeOptions),
    ("squeeze", ["--text", SAMPLE], "sparsity", "1", 1.0, SqueezeOptions),
    ("squeeze", ["--text", SAMPLE], "release_scale", "-1", -1.0, SqueezeOptions),
    ("squeeze", ["--text", SAMPLE], "cycles", "0", 0, SqueezeOptions),
    ("convert", ["--pass", "flashnorm"], "max_shard_size", "lots", "lots", ConvertOptions),
    ("convert", ["--pass", "flashnorm"], "work_dtype", "float8", "float8", ConvertOptions),
    ("verify", [], "samples", "0", 0, VerifyOptions),
    ("export", ["--to", "gguf"], "dtype", "q4", "q4", ExportOptions),
]
MARK = "refused by Limit.refusal:"


@pytest.mark.parametrize("command, before, name, typed, given, cls", REFUSED,
                         ids=[f"{c}-{n}" for c, _, n, _, _, _ in REFUSED])
def test_a_value_out_of_range_is_refused_by_one_check_in_the_same_words(tmp_path, stubbed, monkeypatch, command,
                                                                        before, name, typed, given, cls):
    """The option's declared limit (``option(check=...)`` or its choices) is checked by one function,
    ``Limit.refusal``, for the API (``options_of``, which every entry point builds its options with)
    and for the command line (the flag's callback: exit 2, before the API is called): the same words
    from the same place. A second check (Typer's own ``min=``, a hand-written range) would answer
    first, in other words; without the one check nothing would refuse the value."""
    from normsurgery.core.limits import Limit

    real = Limit.refusal
    monkeypatch.setattr(Limit, "refusal", lambda self, v: None if real(self, v) is None else f"{MARK} {real(self, v)}")
    with pytest.raises(options.UsageError) as e:
        options.options_of(cls, {name: given, **({"to": "gguf"} if command == "export" else {})})
    said = str(e.value)
    assert said.startswith(f"{options.flag(name)} {MARK} "), said
    words = said.split(MARK, 1)[1].split()
    out = tmp_path / "out"
    r = run(*([command, LLAMA, out] if command != "verify" else [command, LLAMA, LLAMA]), *before,
            options.flag(name), typed)
    shown = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and STOP not in r.output and not stubbed, r.output
    assert MARK in shown and " ".join(words) in shown, (shown, words)


def test_no_flag_has_a_range_or_choice_of_its_own():
    """The CLI's flags check no range themselves (Typer's ``min=``/``max=``): each
    flag with a limit takes the options model's one check as its callback, which says the same as the API."""
    from normsurgery.cli.flags import checking

    checked = 0
    for name, command in typer.main.get_command(app).commands.items():
        for p in command.params:
            assert getattr(p, "min", None) is None and getattr(p, "max", None) is None, (name, p.name)
            flags, f = getattr(command.callback, "flags", {}).get(p.name, (None, None))
            if f is not None and f.metadata["flag"].limit is not None:
                assert p.callback is not None and p.callback.__qualname__ == checking(None).__qualname__, (name, p.name)
                checked += 1
    assert checked >= 40, checked


def value(got, name, key):
    args, kw = got.pop(name)
    if name == "prune":
        return getattr(args[0], key) if key == "method" else getattr(kw["heal"], key)
    if name in ("convert", "export"):  # convert(src, out, passes, options), export(src, dest, options)
        return getattr(args[1 if name == "convert" else 0], key)
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


#: convert's, verify's, inspect's and export's defaults: the flag's option name -> (options.py's value, the options
#: dataclass the API takes, its field); the flag's default, or where it has none (None reaches the API, whose
#: default applies) the default its help states, is options.py's
API_DEFAULTS = {
    "convert": {"max_shard_size": (options.MAX_SHARD_SIZE, ConvertOptions, "max_shard_size"),
                "on_overflow": (options.ON_OVERFLOW[0], ConvertOptions, "on_overflow")},
    "verify": {"samples": (options.PROBE_SAMPLES, VerifyOptions, "samples"),
               "generate": (options.PROBE_GENERATE, VerifyOptions, "generate")},
    "inspect": {"samples": (options.OUTLIER_SAMPLES, InspectOptions, "samples")},
    "export": {"dtype": (options.GGUF_DTYPES[0], ExportOptions, "dtype")},
}
#: the API functions that take each command's options dataclass (module:function)
API = {"convert": ("commands.convert:convert",), "verify": ("commands.verify:verify",),
       "inspect": ("commands.verify:outliers",),
       "export": ("exporters.export:export", "exporters.gguf:export", "exporters.nemotron:export")}


def api_function(where: str):
    import importlib

    module, name = where.split(":")  # not stubbed here (the stubs are this module's fixture's)
    return getattr(importlib.import_module(f"normsurgery.{module}"), name)


@pytest.mark.parametrize("command", list(API_DEFAULTS))
def test_convert_verify_inspect_and_export_take_their_defaults_from_options(command):
    """The flag's default (or, where it has none, the default its help states) and the API's are
    options.py's: changing the value there changes both."""
    flags = params(command)
    for name, (value, cls, field) in API_DEFAULTS[command].items():
        p = flags[name]
        if p.default is None:
            stated = re.search(r"\(default:? ([^;:)]*)", p.help or "")
            assert stated and stated.group(1).strip() == str(value), (command, name, p.help)
        else:
            assert p.default == value and p.show_default is not False, (command, name, p.default, value)
        default = getattr(cls(), field)
        assert default == value or default is None and name == "dtype", (command, name, default)  # None: f32
    for where in API[command]:  # the API takes the options dataclass, and no option beside it
        taken = inspect.signature(api_function(where)).parameters
        assert "options" in taken and cls.__name__ in str(taken["options"].annotation), where
        assert not {f.name for f in dataclasses.fields(cls)} & set(taken), where


def test_the_probe_length_is_options_and_stated_in_the_helps():
    import importlib

    verify = importlib.import_module("normsurgery.commands.verify")  # the module (normsurgery.verify is also its function)
    assert verify.LENGTH == options.PROBE_LENGTH == verify.probe_length(None, None)
    for command in ("verify", "inspect"):
        assert f"(default: {options.PROBE_LENGTH}," in params(command)["seq_len"].help, command


def test_no_flag_gives_the_apis_defaults_for_verify_inspect_and_export(tmp_path, stubbed):
    (o,), _ = called(stubbed, "verify", run("verify", LLAMA, LLAMA))
    assert o == VerifyOptions()
    assert (o.samples, o.generate, o.seq_len) == (options.PROBE_SAMPLES, options.PROBE_GENERATE, None)
    (o,), _ = called(stubbed, "outliers", run("inspect", LLAMA, "--outliers"))
    assert o == InspectOptions() and (o.samples, o.seq_len) == (options.OUTLIER_SAMPLES, None)
    (_, o), _ = called(stubbed, "convert", run("convert", LLAMA, tmp_path / "o", "--pass", "flashnorm"))
    assert o.max_shard_size == options.MAX_SHARD_SIZE
    (o,), _ = called(stubbed, "export", run("export", LLAMA, tmp_path / "o.gguf", "--to", "gguf"))
    assert o.dtype == options.GGUF_DTYPES[0] and o.to == "gguf"


@pytest.mark.parametrize("args", [["verify", LLAMA, LLAMA, "--samples", "0"],
                                  ["verify", LLAMA, LLAMA, "--generate", "-1"],
                                  ["verify", LLAMA, LLAMA, "--seq-len", "1"],
                                  ["inspect", LLAMA, "--outliers", "--samples", "0"],
                                  ["convert", LLAMA, "OUT", "--pass", "flashnorm", "--max-shard-size", "lots"]])
def test_out_of_range_values_are_usage_errors_before_the_api(tmp_path, stubbed, args):
    r = run(*[str(tmp_path / a) if a == "OUT" else a for a in args])
    assert r.exit_code == 2 and STOP not in r.output and not stubbed, r.output


def model_mismatches(name: str, command) -> list[str]:
    """What in ``command``'s flags (a click command of the app) differs from its options models: a flag
    named as a model's field yet typed by hand (not built from the model: ``cli.flags.expand``), or
    whose default is neither None (not given) nor the field's, whose help is not the field's
    (``Flag.text``, with its group's prefix), or whose listed choices are not the field's."""
    built = getattr(command.callback, "flags", {})  # {flag name: (Flags, field)}
    models = {flags.cls for flags, _ in built.values()} | ({options.COMMANDS[name]} if name in options.COMMANDS
                                                             else set())
    by_name = {f.metadata["flag"].name(f.name): f for cls in models for f in options.flagged(cls)}
    wrong = []
    for p in command.params:
        if p.name not in by_name:
            continue
        if p.name not in built:
            wrong.append(f"{name} --{p.name}: typed by hand, not built from its options model")
        group, f = built.get(p.name, (Flags(type(None)), by_name[p.name]))
        flag, default = f.metadata["flag"], options.default_of(f)
        expected = [None, (not default) if flag.negate else default]
        if flag.required:
            expected = [None] if p.required else []
        if p.default not in expected:
            wrong.append(f"{name} --{p.name}: default {p.default!r}, the model's {default!r}")
        if p.help != group.prefix + flag.text(default):
            wrong.append(f"{name} --{p.name}: help {p.help!r}, the model's {group.prefix + flag.text(default)!r}")
        if flag.choices:
            shown = f"{p.help} {p.metavar or ''}"
            listed = [set(re.split(r"\s*\|\s*", m)) for m in re.findall(r"[\w+-]+(?:\s*\|\s*[\w+-]+)+", shown)]
            if not listed or any(c != set(flag.choices) for c in listed):
                wrong.append(f"{name} --{p.name}: lists {listed}, the model's choices {flag.choices}")
    return wrong


def test_every_commands_flags_are_its_options_models():
    """For every command of the app, each flag named as a field of its options models is built from
    that field: its default None (not given) or the field's, its help the field's, its choices the
    field's; the commands with an options model have all its flags."""
    commands = typer.main.get_command(app).commands
    checked = 0
    for name, command in commands.items():
        assert not model_mismatches(name, command), model_mismatches(name, command)
        built = getattr(command.callback, "flags", {})
        checked += len(built)
        if name in options.COMMANDS:
            names = {p.name for p in command.params}
            fields = [f.metadata["flag"].name(f.name) for f in options.flagged(options.COMMANDS[name])]
            assert set(fields) <= names, (name, set(fields) - names)
    assert {"convert", "verify", "inspect", "export", "heal"} <= {n for n, c in commands.items()
                                                                  if getattr(c.callback, "flags", None)}
    assert checked >= 40, checked


#: the flags of options models a command takes only some of (the others typed by hand, below)
SOME_OF_VERIFY = Flags(VerifyOptions, only=("dtype", "tolerance"))
SOME_OF_EXPORT = Flags(ExportOptions, only=("tolerance",))


def test_a_flag_typed_by_hand_unlike_its_model_is_found():
    """The check above, on a command whose flags were typed by hand: a default, a help and the choices
    that are not the model's are each named, and so is a flag that repeats the model's by hand."""
    def broken(options: SOME_OF_VERIFY = None,
               samples: int = typer.Option(options.PROBE_SAMPLES + 1, help="number of token windows"),
               generate: int = typer.Option(options.PROBE_GENERATE, help="greedy tokens to compare (0: skip)")):
        pass

    def unlike(to: str = typer.Option(..., "--to", help="onnx | gguf"),
               options: SOME_OF_EXPORT = None):
        pass

    fake = typer.Typer()
    fake.command("verify")(expand(broken))
    fake.command("export")(expand(unlike))
    got = typer.main.get_command(fake).commands
    assert not [w for w in model_mismatches("verify", got["verify"]) if "--dtype" in w or "--tol" in w]
    said = model_mismatches("verify", got["verify"]) + model_mismatches("export", got["export"])
    assert {w.split(":")[0] for w in said} == {"verify --samples", "verify --generate", "export --to"}, said
    kinds = {(w.split(":")[0], w.split(":")[1].split()[0]) for w in said}
    assert {("verify --samples", "default"), ("export --to", "help"), ("export --to", "lists")} <= kinds, said
    assert ("verify --generate", "default") not in kinds and ("verify --generate", "help") not in kinds, said
    expanded = typer.main.get_command(app).commands["verify"]
    samples = next(p for p in expanded.params if p.name == "samples")
    samples_default, samples_help = samples.default, samples.help
    try:  # the built command itself, its default and its help changed by hand
        samples.default, samples.help = options.PROBE_SAMPLES + 1, "windows"
        said = model_mismatches("verify", expanded)
    finally:
        samples.default, samples.help = samples_default, samples_help
    assert [w.split(":")[1].split()[0] for w in said] == ["default", "help"], said


@pytest.mark.parametrize("size", ["lots", "500M", "0", "1.5XB"])
def test_the_apis_shard_size_is_refused_before_anything_is_read(tmp_path, monkeypatch, size):
    """A shard size that is not one is refused by the options' check (the one parse of it: ``limits.parse_size``)
    before a checkpoint is opened or an output claimed: convert's and save's, as the CLI's flag refuses it."""
    import normsurgery as ns
    from normsurgery.io.source import Source

    def opened(*args, **kwargs):
        raise AssertionError("the checkpoint was opened before the shard size was checked")

    monkeypatch.setattr(Source, "open", opened)
    with pytest.raises(options.UsageError, match=f"--max-shard-size '{size}' is not a size"):
        ns.convert(LLAMA, tmp_path / "out", [("flashnorm", {})], max_shard_size=size)
    with pytest.raises(options.UsageError, match="is not a size"):
        ns.save(None, tmp_path / "saved", {"max_shard_size": size}, source=LLAMA)
    assert not list(tmp_path.iterdir())


def test_a_shard_size_is_parsed_once_as_transformers_reads_it():
    """``parse_size`` gives transformers' bytes for the sizes both read, and takes a decimal one
    (``1.5GB``), which transformers' parse refused only once the work was done."""
    from transformers.utils.hub import convert_file_size_to_int

    from normsurgery.core.limits import parse_size

    for size in ("5GB", "5GiB", "500MB", "20KB", "3KiB", "2MiB", "8Gb", "500mb", 1234):
        assert parse_size(size) == convert_file_size_to_int(size), size
    assert parse_size("1.5GB") == 1_500_000_000 and ConvertOptions(max_shard_size="1.5GB").shard_bytes == 1_500_000_000
    with pytest.raises(ValueError):
        convert_file_size_to_int("1.5GB")
