"""The output's checks answer first, for every command that writes (issue 54, item 6): an existing
output without --force (or one inside the input) is refused before torch is even imported, so
before any model loads (``export IN EXISTING --to gguf`` answered after 5.4 s, the model loaded)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "normsurgery" / "demo" / "llama-tiny")
TEXT = str(ROOT / "normsurgery" / "data" / "sample.txt")

#: a CLI run in a fresh interpreter: its exit code, then whether torch or transformers were imported
CODE = """import runpy, sys
sys.argv = ["normsurgery", *sys.argv[1:]]
try:
    runpy.run_module("normsurgery", run_name="__main__")
except SystemExit as e:
    print("EXIT", e.code)
print("IMPORTED", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""

COMMANDS = {
    "convert": ["convert", LLAMA, "{out}", "--pass", "flashnorm"],
    "prune": ["prune", LLAMA, "{out}", "--layers", "1"],
    "heal": ["heal", LLAMA, "{out}", "--text", TEXT],
    "squeeze": ["squeeze", LLAMA, "{out}", "--text", TEXT],
    "export onnx": ["export", LLAMA, "{out}", "--to", "onnx"],
    "export gguf": ["export", LLAMA, "{out}.gguf", "--to", "gguf"],
    "export nemotron-nas": ["export", LLAMA, "{out}", "--to", "nemotron-nas"],
}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_existing_output_is_refused_before_torch_loads(tmp_path, command):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "notes.md").write_text("the user's")
    Path(f"{out}.gguf").write_text("the user's")
    r = cli(*(a.format(out=out) for a in COMMANDS[command]))
    # a folder (ours or not) is refused without --force; the user's text file named .gguf is not ours at all
    refusal = "is not a GGUF file" if command == "export gguf" else "already exists; pass --force to replace it"
    assert "EXIT 1" in r.stdout and refusal in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert "IMPORTED []" in r.stdout, r.stdout
    assert (out / "notes.md").read_text() == "the user's" and Path(f"{out}.gguf").read_text() == "the user's"


def test_an_output_inside_the_input_is_refused_before_torch_loads(tmp_path):
    r = cli("convert", LLAMA, str(Path(LLAMA) / "inside"), "--pass", "flashnorm")
    assert "EXIT 1" in r.stdout and "is inside the input checkpoint" in r.stderr, r.stdout + r.stderr
    assert "IMPORTED []" in r.stdout, r.stdout
    assert not (Path(LLAMA) / "inside").exists()


def test_the_runners_claim_within_the_clis_is_the_same_claim(tmp_path):
    """The CLI's claim (``ahead``, before the input is resolved) is the claim the command's job
    makes within it, not checked again but for the input the CLI could not resolve (a hub id): an
    output inside the input's folder is still refused there; other terms are a bug of ours."""
    from normsurgery.core.errors import SurgeryError
    from normsurgery.io import output

    src, out = tmp_path / "snapshot", tmp_path / "snapshot" / "out"
    src.mkdir()
    with output.claim(out, False, None, source_name="owner/model", ahead=True) as ahead:
        with output.claim(out, False, None) as inner:
            assert inner is ahead
        with pytest.raises(SurgeryError, match="is inside the input checkpoint owner/model"):
            with output.claim(out, False, src, source_name="owner/model"):
                pass
        with pytest.raises(SurgeryError, match="internal: .* claimed twice"):
            with output.claim(out, True, None):
                pass
    with output.claim(out, False, None):  # not ahead: a second claim is a bug of ours
        with pytest.raises(SurgeryError, match="internal: .* claimed twice"):
            with output.claim(out, False, None):
                pass
