"""Usage facts the registry states are usage errors: exit 2, one ``error:`` line, before anything
is loaded; a refusal read off the Layout says the same of the whole model in every plan."""

import importlib

import pytest
import torch
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.core import registry
from normsurgery.io.loader import Loader
from normsurgery.io.source import Source
from normsurgery.cli import app
from normsurgery.core.errors import SurgeryError, UsageError

from models import CONFIGS, tiny_model

convert_mod = importlib.import_module("normsurgery.commands.convert")  # the module, not ns.convert


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any read of a checkpoint fails the test."""
    def refused(*args, **kwargs):
        raise AssertionError("a checkpoint was opened")
    monkeypatch.setattr(Source, "open", refused)
    monkeypatch.setattr(Loader, "load", refused)


@pytest.mark.parametrize("spec", ["remove-ln", "prepbn:steps=2", "mask:by=activation,prune_units=0.1",
                                  "minimize:by=activation,prune_heads=0.5"])
def test_a_pass_that_reads_text_without_text_is_a_usage_error(tmp_path, nothing_loads, spec):
    """No --text: exit 2 with one error line naming --text, though IN does not even exist (it is
    never opened), and OUT is not made."""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "no-such-model"), str(out), "--pass", spec])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--text FILE" in lines[0], result.output
    assert spec.partition(":")[0] in lines[0] and not out.exists()
    with pytest.raises(UsageError, match="--text FILE"):
        convert_mod.convert(tmp_path / "no-such-model", out, [registry.parse_pass(spec)])


def test_a_pass_that_reads_no_text_goes_on_to_the_model(tmp_path):
    """The same passes with options that read no text are not refused for it: the missing IN is
    the error (exit 1)."""
    for spec in ("mask:by=activation", "mask:prune_units=0.1", "flashnorm"):
        result = CliRunner().invoke(app, ["convert", str(tmp_path / "no-such-model"), str(tmp_path / "out"),
                                          "--pass", spec])
        assert result.exit_code == 1 and "--text" not in result.output, result.output


def test_a_streamed_refusal_counts_every_norm_of_the_model(tmp_path, monkeypatch):
    """A pass refused for the model's output norms: the same words in either plan, counting every
    output norm of the model (two per block), and no weight read."""
    cfg = CONFIGS["gemma3_text"]()
    model = tiny_model("gemma3_text", torch.float32)
    model.save_pretrained(tmp_path / "in")
    norms = 2 * cfg.num_hidden_layers

    def refused(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(Loader, "load", refused)
    said = {}
    for streaming in (True, False):
        with pytest.raises(SurgeryError) as e:
            convert_mod.convert(tmp_path / "in", tmp_path / "out", [("mask", {"sparsity": 0.5})], streaming=streaming)
        said[streaming] = str(e.value)
    assert said[True] == said[False] and f"and {norms - 1} more norms" in said[True], said
