"""The API's one convention: every entry point takes what it reads (and writes), then ``options``, its
options dataclass or a dict of its fields (or the fields as keywords), built and checked in one place
(``options.options_of``) before anything is read."""

from __future__ import annotations

import inspect

import pytest

import normsurgery as ns
from normsurgery.core import options
from normsurgery.core.errors import UsageError
from normsurgery.io.source import Source

LLAMA = "normsurgery/demo/llama-tiny"

#: each entry point: the arguments before its options, what it takes them as, an out-of-range field and
#: the words that refuse it (``Limit.refusal``'s, named by the option's flag)
ENTRIES = {
    "load": ((), options.LoadOptions, {"dtype": "float8"}, "--dtype 'float8': choose one of"),
    "lens": ((), options.Reading, {"device": "tpu"}, "--device 'tpu': choose auto, cpu"),
    "save": (("OUT",), options.SaveOptions, {"max_shard_size": "lots"}, "--max-shard-size 'lots' is not a size"),
    "prune": (("OUT",), options.PruneOptions, {"layers": 0}, "--layers must be a whole number >= 1, got 0"),
    "heal": (("OUT",), options.HealOptions, {"lr": 0.0}, "--lr must be > 0, got 0.0"),
    "squeeze": (("OUT",), options.SqueezeOptions, {"cycles": 0}, "--cycles must be a whole number >= 1, got 0"),
    "convert": (("OUT", [("flashnorm", {})]), options.ConvertOptions, {"tolerance": -1.0}, "--tol must be > 0"),
    "verify": ((LLAMA,), options.VerifyOptions, {"samples": 0}, "--samples must be a whole number >= 1, got 0"),
    "outliers": ((None,), options.InspectOptions, {"samples": 0}, "--samples must be a whole number >= 1, got 0"),
    "export": (("OUT",), options.ExportOptions, {"to": "tflite"}, "--to 'tflite': choose one of onnx, gguf"),
}
TEXT = {"heal": "some text\n", "squeeze": "some text\n"}  # their text is a keyword


def test_every_entry_point_takes_its_options_after_what_it_reads():
    """``(src, options)`` for load and lens, ``(a, b, options)`` for verify and outliers, ``(src, out,
    options)`` for the rest (``(src, out, passes, options)`` for convert): the options dataclass or a dict
    of its fields, and its fields as keywords besides."""
    for name, (before, cls, _, _) in ENTRIES.items():
        params = list(inspect.signature(getattr(ns, name)).parameters.values())
        assert params[1 + len(before)].name == "options", (name, [p.name for p in params])
        assert cls.__name__ in str(params[1 + len(before)].annotation), name
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD, name


@pytest.mark.parametrize("name", list(ENTRIES))
def test_an_out_of_range_option_is_refused_before_anything_is_read_however_it_is_given(tmp_path, monkeypatch, name):
    """The options object, a dict of its fields and the fields as keywords are one call: the same
    refusal, in the same words, before a checkpoint is opened or an output claimed."""
    def opened(*args, **kwargs):
        raise AssertionError(f"{name} opened a checkpoint before checking its options")

    monkeypatch.setattr(Source, "open", opened)
    before, cls, bad, said = ENTRIES[name]
    args = [None if name == "save" else LLAMA, *[tmp_path / "out" if a == "OUT" else a for a in before]]
    extra = {"text": TEXT[name]} if name in TEXT else {}
    for how in ({"options": bad}, {"options": cls(**bad)}, bad):
        given = how if how is bad else {}
        with pytest.raises(UsageError) as e:
            getattr(ns, name)(*args, *([how["options"]] if how is not bad else []), **extra, **given)
        assert str(e.value).startswith(said), (name, how, str(e.value))
    assert not list(tmp_path.iterdir())


def test_keywords_go_to_the_options_or_to_how_it_reads_and_writes(tmp_path, monkeypatch):
    """heal's, prune's and squeeze's keywords are fields of their options or of ``io`` (``Writing``,
    also given whole as ``io=``), each checked where it belongs."""
    monkeypatch.setattr(Source, "open", lambda *a, **k: (_ for _ in ()).throw(AssertionError("opened")))
    opts, io = options.options_and_io(options.HealOptions, {"steps": 3}, {"force": True, "lr": 0.5})
    assert (opts.steps, opts.lr, io.force) == (3, 0.5, True)
    opts, io = options.options_and_io(options.HealOptions, None, {"io": {"device": "cpu"}, "steps": 4})
    assert (opts.steps, io.device) == (4, "cpu")
    with pytest.raises(UsageError, match="--device 'tpu': choose auto"):
        ns.heal(LLAMA, tmp_path / "out", text="x\n", device="tpu", steps=3)
    with pytest.raises(TypeError):
        ns.prune(LLAMA, tmp_path / "out", nonesuch=1)
