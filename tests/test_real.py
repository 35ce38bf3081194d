"""A real checkpoint: SmolLM2-135M-Instruct (Llama family, tied embeddings, float32, 538 MB),
in the folder ``NORMSURGERY_REAL_MODEL`` names. ``make test-real`` fetches it
(``scripts/fetch_real_model.py``) and runs these tests; ``make test`` and CI do not (marker
``real``, deselected by default in pyproject.toml)."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

from normsurgery.cli import app

pytestmark = pytest.mark.real
PROMPT = "The three primary colours are"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def real() -> Path:
    path = os.environ.get("NORMSURGERY_REAL_MODEL")
    if not path or not (Path(path) / "model.safetensors").is_file():  # selected on purpose (-m real): fail
        pytest.fail(f"NORMSURGERY_REAL_MODEL={path!r} names no checkpoint folder (make test-real fetches "
                    "SmolLM2-135M and sets it)")
    return Path(path)


def greedy(folder: Path, n: int = 20) -> list[int]:
    """The first ``n`` greedy tokens after the prompt, by plain transformers."""
    tok = T.AutoTokenizer.from_pretrained(folder)
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


@pytest.mark.parametrize("keep_tied", [False, True])
def test_flashnorm_keeps_smollm2s_greedy_continuation_and_verifies(real, tmp_path, keep_tied):
    out = tmp_path / "flash"
    r = run("convert", real, out, "--pass", f"flashnorm:keep_tied={str(keep_tied).lower()}", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["ok"] and result["saved"]["plain_transformers"]
    assert greedy(out) == greedy(real)
    r = run("verify", real, out, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"], r.output
    cfg = json.loads((out / "config.json").read_text())
    embedding = cfg["vocab_size"] * cfg["hidden_size"] * 4  # float32: 113 MB
    grown = weight_bytes(out) - weight_bytes(real)
    assert json.loads((real / "config.json").read_text())["tie_word_embeddings"]
    if keep_tied:  # the same tensors: only the headers' padding may differ
        assert cfg["tie_word_embeddings"] and abs(grown) < 1 << 20, grown
    else:  # the head untied to take the final norm's gain: the embedding stored twice
        assert not cfg["tie_word_embeddings"] and 0 <= grown - embedding < 1 << 20, (grown, embedding)
