"""vLLM serves export --to nemotron-nas folders with transformers' greedy tokens (``make
test-serve``, marker ``serve``: vLLM's CPU build in a venv of its own, .venv-serve, whose python
``NORMSURGERY_SERVE_PYTHON`` names; ``make test`` deselects these)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import normsurgery as ns
from normsurgery.exporters import runtime_check
from test_nemotron import LLAMA, uneven, zeroed

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def serve_python() -> str:
    path = os.environ.get("NORMSURGERY_SERVE_PYTHON")
    if not path or not Path(path).is_file():  # selected on purpose (-m serve): fail
        pytest.fail(f"NORMSURGERY_SERVE_PYTHON={path!r} names no python (make test-serve builds .venv-serve)")
    return path


def vllm_greedy(python: str, folder: Path, prompts: torch.Tensor) -> torch.Tensor:
    out = folder.parent / "vllm.json"
    r = subprocess.run([python, str(ROOT / "scripts" / "vllm_greedy.py"), str(folder), json.dumps(prompts.tolist()),
                        str(NEW_TOKENS), str(out)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return torch.tensor(json.loads(out.read_text()))


def transformers_greedy(source: Path, prompts: torch.Tensor) -> torch.Tensor:
    model = ns.load(source, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, prompts.shape[1]:]


@pytest.mark.parametrize("case", ["stock", "uneven"])
def test_vllm_serves_a_nemotron_nas_folder_with_transformers_greedy_tokens(tmp_path, serve_python, case):
    src = Path(LLAMA) if case == "stock" else zeroed(tmp_path, uneven)  # uneven: widths 512 x 2, no-op, 256 x 5
    ns.export(src, tmp_path / "deci", to="nemotron-nas")
    prompts = torch.tensor([[1, 17, 230, 5, 99, 412, 8, 3], [300, 2, 41, 41, 7, 900, 12, 64]])
    got = vllm_greedy(serve_python, tmp_path / "deci", prompts)
    assert got.tolist() == transformers_greedy(src, prompts).tolist()


def test_the_nemotron_nas_export_is_checked_in_vllm_without_mlx(tmp_path, serve_python, monkeypatch):
    """Where vLLM is the runtime and MLX is not installed, the check runs in vLLM (its raw logits on
    the probe, its greedy tokens) and says so."""
    find = runtime_check.importlib.util.find_spec
    monkeypatch.setattr(runtime_check.importlib.util, "find_spec",  # neither mlx nor vllm in this python
                        lambda m, *a: None if m in ("mlx", "mlx_lm", "vllm") else find(m, *a))
    monkeypatch.setenv("NORMSURGERY_SERVE_PYTHON", serve_python)  # vLLM: that python's
    src = zeroed(tmp_path, uneven)
    r = ns.export(src, tmp_path / "deci", to="nemotron-nas")
    assert r.runtime == "vLLM" and r.as_dict()["check"] == "vLLM"
    assert r.parity.ok and r.parity.relative <= r.parity.tolerance == 1e-5 and r.parity.generation == 1
