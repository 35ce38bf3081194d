"""The API's text= / eval_text=: a str is the text itself, a pathlib.Path a file (read as the CLI
reads --text); a short text's error names no CLI flag."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import normsurgery as ns
from normsurgery.core.calibration import windows
from normsurgery.core.errors import SurgeryError, SurgeryWarning
from normsurgery.io.texts import text_of

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE, HELD = "normsurgery/data/sample.txt", "normsurgery/data/heldout.txt"


def test_text_of_reads_a_path_and_keeps_a_str(tmp_path):
    assert text_of(Path(SAMPLE)) == Path(SAMPLE).read_text()
    assert text_of("To be, or not to be") == "To be, or not to be"
    assert text_of(None) is None
    with pytest.raises(SurgeryError, match="no text file"):
        text_of(tmp_path / "missing.txt")
    with pytest.raises(SurgeryError, match=r"a str\) or a file \(a pathlib.Path\), got bytes"):
        text_of(b"bytes")
    with pytest.warns(SurgeryWarning, match=r"pass pathlib.Path\('normsurgery/data/sample.txt'\) to read the file"):
        assert text_of(SAMPLE) == SAMPLE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text_of("a line of text that names no file")


def test_a_short_text_names_no_cli_flag():
    with pytest.raises(SurgeryError, match="fewer than one sequence of 32") as e:
        windows(torch.arange(5), 32)
    assert "--" not in str(e.value) and "seq_len" in str(e.value)


def test_prune_and_heal_read_a_path_as_the_text_it_holds(tmp_path):
    opts = {"layers": 1, "samples": 2, "seq_len": 32}
    by_path = ns.prune(LLAMA, tmp_path / "a", opts, text=Path(SAMPLE), eval_text=Path(HELD))
    by_text = ns.prune(LLAMA, tmp_path / "b", opts, text=Path(SAMPLE).read_text(), eval_text=Path(HELD).read_text())
    scores = [{k: v for k, v in r.scores.as_dict().items() if k != "seconds"} for r in (by_path, by_text)]
    assert scores[0] == scores[1] and by_path.ce == by_text.ce
    healed = ns.heal(tmp_path / "a", tmp_path / "c", text=Path(SAMPLE), eval_text=Path(HELD),
                     options={"steps": 1, "batch_size": 2, "seq_len": 32})  # prune's held-out windows (64 at most)
    assert healed.saved is not None and healed.report.ce_before == pytest.approx(by_path.ce["pruned"], abs=1e-4)
    assert healed.eval_text_ce["input"] == pytest.approx(by_path.eval_text_ce["pruned"], abs=1e-4)


def test_a_long_one_line_text_is_the_text_not_an_error():
    """A one-line text too long to be a file name (Path.is_file raised ENAMETOOLONG) is the text."""
    text = "word " * 600
    assert text_of(text) == text
