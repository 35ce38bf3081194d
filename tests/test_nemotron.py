"""export --to nemotron-nas: Llama-shaped checkpoints, stock or with per-layer widths and no-op
sublayers, as DeciLM folders that MLX-LM runs as transformers runs the checkpoint; what the
format cannot say is refused before anything is written; one wrong weight fails the check."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors import safe_open
from typer.testing import CliRunner

import normsurgery as ns
from models import tiny_model
from normsurgery.exporters import mlx_check
from normsurgery.cli import app
from normsurgery.core.runtime import RMSNorm

LLAMA = "normsurgery/demo/llama-tiny"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def stored(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def zeroed(tmp_path: Path, change) -> Path:
    """The demo Llama with ``change(model)`` made (weights zeroed), saved, then minimized:
    per-layer widths that load only through normsurgery's runtime."""
    model = ns.load(LLAMA, dtype=torch.float32)
    with torch.no_grad():
        change(model)
    ns.save(model, tmp_path / "zeroed", source=LLAMA)
    ns.convert(tmp_path / "zeroed", tmp_path / "min", [("minimize", {})])
    assert json.loads((tmp_path / "min" / "config.json").read_text())["model_type"] == "normsurgery_llama"
    return tmp_path / "min"


def uneven(model):
    for i, layer in enumerate(model.model.layers):
        layer.mlp.down_proj.weight[:, :45 * i] = 0  # layer i: 45 i dead MLP units
    model.model.layers[2].mlp.down_proj.weight.zero_()  # an MLP that computes nothing
    model.model.layers[5].self_attn.o_proj.weight.zero_()  # an attention that computes nothing


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_stock_families_run_in_mlx(tmp_path, family):
    model = tiny_model(family, torch.float32)
    ns.save(model, tmp_path / "src")
    r = run("export", tmp_path / "src", tmp_path / "deci", "--to", "nemotron-nas", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["greedy"]["agree"] == 1 and data["parity"]["top1"] == 1.0
    assert data["parity"]["relative"] <= data["parity"]["tolerance"] == 1e-5
    # widths as the runtime builds them from the config: a multiple of 256 holding the 64 units
    mlx = mlx_check.load_folder(tmp_path / "deci")
    assert [layer.mlp.up_proj.weight.shape[0] for layer in mlx.model.layers] == [256] * 3
    assert [layer.self_attn.n_kv_heads for layer in mlx.model.layers] == [2] * 3
    # Qwen2's q, k, v biases: every projection biased, o's zero
    weights = stored(tmp_path / "deci")
    assert ("model.layers.0.self_attn.o_proj.bias" in weights) == (family == "qwen2")
    if family == "qwen2":
        assert not weights["model.layers.0.self_attn.o_proj.bias"].any()
        assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], model.model.layers[0].self_attn.q_proj.bias)
    # the padding: zero units after the 64 real ones
    up, down = weights["model.layers.1.mlp.up_proj.weight"], weights["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(up[:64], model.model.layers[1].mlp.up_proj.weight) and not up[64:].any()
    assert not down[:, 64:].any()
    assert data["padding_bytes"] == 3 * 3 * (256 - 64) * 32 * 4  # layers x (gate, up, down) x units x hidden x bytes


def test_uneven_widths_and_no_op_sublayers(tmp_path):
    src = zeroed(tmp_path, uneven)
    r = ns.export(src, tmp_path / "deci", to="nemotron-nas")
    assert r.parity.ok and r.parity.generation == 1 and r.parity.relative <= 1e-5
    cfg = json.loads((tmp_path / "deci" / "config.json").read_text())
    blocks = cfg["block_configs"]
    assert blocks[2]["ffn"] == {"no_op": True} and blocks[5]["attention"] == {"no_op": True}
    assert all("intermediate_size" not in b["ffn"] for b in blocks)  # MLX-LM refuses it
    assert [b["attention"].get("n_heads_in_group") for b in blocks] == [2, 2, 2, 2, 2, None, 2, 2]
    # MLX-LM built the widths the minimized layers need, each a multiple of 256, none for the no-ops
    mlx = mlx_check.load_folder(tmp_path / "deci")
    units = [384 - 45 * i for i in range(8)]
    built = [None if layer.mlp is None else layer.mlp.up_proj.weight.shape[0] for layer in mlx.model.layers]
    assert built == [512, 512, None, 256, 256, 256, 256, 256]
    assert mlx.model.layers[5].self_attn is None and mlx.model.layers[5].input_layernorm is None
    # a no-op sublayer's tensors and its norm are not written
    weights = stored(tmp_path / "deci")
    assert not [k for k in weights if k.startswith(("model.layers.2.mlp.", "model.layers.2.post_attention_layernorm",
                                                      "model.layers.5.self_attn.", "model.layers.5.input_layernorm"))]
    padding = sum((w - u) * 3 * 128 * 4 for w, u in zip(built, units) if w is not None)
    assert r.plan.padding_bytes == padding
    # vLLM's and TensorRT-LLM's way of reading the config: the block configs as objects
    c = T.AutoConfig.from_pretrained(tmp_path / "deci", trust_remote_code=True)
    assert c.block_configs[5].attention.no_op and c.block_configs[2].ffn.no_op
    assert [b.ffn.ffn_mult for b in c.block_configs] == [b["ffn"].get("ffn_mult") for b in blocks]
    assert c.rope_theta == 10000.0 and c.num_attention_heads == 4
    c.save_pretrained(tmp_path / "again")  # written back as dicts
    assert json.loads((tmp_path / "again" / "config.json").read_text())["block_configs"][2]["ffn"]["no_op"] is True


def test_a_perturbed_weight_fails_the_mlx_check(tmp_path):
    src = zeroed(tmp_path, uneven)

    def change(name, t):
        if name == "model.layers.3.mlp.down_proj.weight":
            t = t.clone()
            t[5, 7] += 0.05 * t.abs().max()
        return t

    with pytest.raises(ns.SurgeryError, match="MLX-LM's logits differ"):
        from normsurgery.exporters import nemotron

        nemotron.export(src, tmp_path / "deci", change=change)
    assert not (tmp_path / "deci").exists()


def heads_differ(model):
    model.model.layers[1].self_attn.o_proj.weight[:, 64:] = 0  # kv head 1's two query heads dead


REFUSED = {
    "per-layer query heads": (lambda tmp: zeroed(tmp, heads_differ),
                              "layer 1 has 2 query heads, not 4: DeciLM varies only key/value heads; GGUF's deci"),
    "head width": (lambda tmp: minimized(tmp, prune_heads=0.5),  # 2 heads of 32 in every layer
                   "its heads are 32 wide, and DeciLM's are hidden / heads = 64; GGUF's deci"),
    "removed channels": (lambda tmp: minimized(tmp, prune_channels=4), "its stream holds 124 of 128 channels"),
    "norm with a bias": (lambda tmp: norm_bias(tmp), "model.layers.0.input_layernorm is a RMSNorm (rmsnorm), not the "
                         "plain RMSNorm DeciLM computes"),
    "head with a bias": (lambda tmp: head_bias(tmp), "its head has a bias"),
    "another family": (lambda tmp: Path("normsurgery/demo/gpt2-tiny"), "it is a gpt2 model"),
}


def minimized(tmp_path: Path, **mask) -> Path:
    ns.convert(LLAMA, tmp_path / "min", [("mask", mask), ("minimize", {})])
    return tmp_path / "min"


def head_bias(tmp_path: Path) -> Path:
    """The demo Llama with a bias on its head (recorded in the folder, as remove-ln's fold leaves it)."""
    model = ns.load(LLAMA, dtype=torch.float32)
    head = torch.nn.Linear(128, 1024, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.fill_(0.01)
    model.lm_head = head
    ns.save(model, tmp_path / "head", source=LLAMA)
    return tmp_path / "head"


def norm_bias(tmp_path: Path) -> Path:
    """The demo Llama with a bias on one norm (normsurgery's runtime RMSNorm, recorded in the folder)."""
    model = ns.load(LLAMA, dtype=torch.float32)
    norm = RMSNorm(128, eps=1e-5, bias=True)
    with torch.no_grad():
        norm.weight.copy_(model.model.layers[0].input_layernorm.weight)
        norm.bias.fill_(0.01)
    model.model.layers[0].input_layernorm = norm
    ns.save(model, tmp_path / "bias", source=LLAMA)
    return tmp_path / "bias"


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_format_cannot_say_is_refused(tmp_path, case):
    make, message = REFUSED[case]
    src = make(tmp_path)
    r = run("export", src, tmp_path / "deci", "--to", "nemotron-nas")
    assert r.exit_code == 1 and message in r.output, r.output
    assert r.output.count("error:") == 1 and "Traceback" not in r.output
    assert not (tmp_path / "deci").exists()


def test_a_bfloat16_checkpoint_is_written_in_bfloat16(tmp_path):
    model = tiny_model("qwen2", torch.bfloat16)
    ns.save(model, tmp_path / "src")
    r = ns.export(tmp_path / "src", tmp_path / "deci", to="nemotron-nas")
    assert r.parity.ok and r.parity.generation == 1 and r.dtype == "bfloat16"
    weights = stored(tmp_path / "deci")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["model.layers.2.mlp.down_proj.weight"][:, :64], model.model.layers[2].mlp.down_proj.weight)
    assert r.plan.padding_bytes == 3 * 3 * (256 - 64) * 32 * 2
