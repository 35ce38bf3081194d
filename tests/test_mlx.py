"""MLX-LM as a checked runtime: what the tool writes runs in MLX-LM as in transformers; a folder
without the top-level RoPE keys (transformers 5 writes only ``rope_parameters``) runs another
model there, and the check says so; so does one wrong weight."""

import json
import shutil
from pathlib import Path

import pytest
import transformers as T

import normsurgery as ns
from normsurgery.exporters import runtime_check
from models import wrong_weight

LLAMA = "normsurgery/demo/llama-tiny"
#: RoPE of the inputs: a base other than MLX-LM's default 10000, and llama3's scaling
ROPES = {"theta-1e5": {"rope_type": "default", "rope_theta": 1e5},
         "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}


def llama(tmp_path: Path, rope: dict) -> Path:
    """The demo Llama (with its tokenizer) under ``rope``, as transformers 5 saves it: no
    top-level rope_theta or rope_scaling."""
    src = tmp_path / "src"
    shutil.copytree(LLAMA, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = dict(rope)
    assert "rope_theta" not in cfg and "rope_scaling" not in cfg
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def written(tmp_path: Path, how: str, rope: dict) -> Path:
    src, out = llama(tmp_path, rope), tmp_path / how
    if how == "convert":
        ns.convert(src, out, [("flashnorm", {})])
    else:
        ns.prune(src, out, {"layers": 2})
    return out


@pytest.mark.parametrize("how", ["convert", "prune"])
@pytest.mark.parametrize("rope", ROPES)
def test_outputs_run_in_mlx_as_in_transformers(tmp_path, how, rope):
    out = written(tmp_path, how, ROPES[rope])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == ROPES[rope]["rope_theta"]  # for runtimes reading the older keys
    r = runtime_check.check(out, runtime="mlx")
    assert r.ok, r.failure()
    assert r.parity.generation == 1 and r.greedy["mlx"] == r.greedy["transformers"]
    assert r.parity.relative <= r.parity.tolerance == 1e-5 and r.parity.top1 == 1.0
    # and transformers reads the config it wrote as before (the older keys change nothing)
    stock = T.AutoConfig.from_pretrained(tmp_path / "src").rope_parameters
    assert T.AutoConfig.from_pretrained(out).rope_parameters == stock


def test_without_top_level_rope_theta_mlx_runs_another_model(tmp_path):
    """The trap the legacy keys close: MLX-LM builds RoPE with base 10000, and the check sees it."""
    out = written(tmp_path, "convert", ROPES["theta-1e5"])
    trap = tmp_path / "trap"
    shutil.copytree(out, trap)
    cfg = json.loads((trap / "config.json").read_text())
    del cfg["rope_theta"]
    (trap / "config.json").write_text(json.dumps(cfg))
    r = runtime_check.check(trap, out, runtime="mlx")
    assert not r.ok and not r.parity.ok and r.parity.relative > 100 * r.parity.tolerance
    assert r.parity.generation < 1
    assert "MLX-LM's logits differ" in r.failure()


def test_a_perturbed_weight_fails_the_mlx_check(tmp_path):
    out = written(tmp_path, "convert", ROPES["theta-1e5"])
    r = runtime_check.check(wrong_weight(out, tmp_path / "wrong"), out, runtime="mlx")
    assert not r.parity.ok, r.parity.as_dict()
    # judged beyond 1e-5 with both sides' rounding counted: MLX-LM's own, against its float64 logits
    assert "MLX-LM's own float32 rounding" in r.parity.reason and r.parity.relative > 10 * r.parity.tolerance

