"""export --to nemotron-nas: Llama-shaped checkpoints, stock or with per-layer widths and no-op
sublayers, as DeciLM folders that MLX-LM runs as transformers runs the checkpoint; what the
format cannot say is refused before anything is written; one wrong weight fails the check."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors import safe_open
from typer.testing import CliRunner

import normsurgery as ns
from models import tiny_model
from normsurgery.exporters import runtime_check
from normsurgery.exporters.runtime_worker import mlx_load
from normsurgery.cli import app
from normsurgery.core.runtime import RMSNorm

LLAMA = "normsurgery/demo/llama-tiny"
ROOT = Path(__file__).resolve().parent.parent
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
    mlx = mlx_load(tmp_path / "deci")
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
    mlx = mlx_load(tmp_path / "deci")
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


def test_the_folder_loads_in_transformers_through_its_auto_map(tmp_path):
    """NVIDIA's nemotron-nas checkpoints ship their modeling code; ours ships normsurgery's runtime:
    AutoModelForCausalLM gives the checkpoint's logits, uneven widths and no-op sublayers included."""
    src = zeroed(tmp_path, uneven)
    r = ns.export(src, tmp_path / "deci", to="nemotron-nas")
    assert r.transformers.ok and r.transformers.relative <= r.transformers.tolerance == 1e-5
    cfg = json.loads((tmp_path / "deci" / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_decilm.DeciLMForCausalLM"
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path / "deci", trust_remote_code=True, dtype=torch.float32)
    layers = loaded.model.layers
    assert [layer.mlp.up_proj.out_features if hasattr(layer.mlp, "up_proj") else None for layer in layers] == \
        [512, 512, None, 256, 256, 256, 256, 256]
    assert layers[5].self_attn(torch.ones(1, 2, 128))[0].abs().sum() == 0
    ids = torch.tensor([[1, 17, 230, 5, 99, 412, 8, 3]])
    with torch.no_grad():
        want = ns.load(src, torch.float32)(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_padding_that_eats_the_saving_is_said(tmp_path):
    """A few units pruned are padded back to the multiple of 256: the folder is no smaller than its
    input, and the summary line and --json say so (units kept and written, bytes in and out)."""
    src = zeroed(tmp_path, lambda m: [layer.mlp.down_proj.weight[:, :8 + i].zero_()  # 376 - i of 384 units kept
                                      for i, layer in enumerate(m.model.layers)])
    r = run("export", src, tmp_path / "deci", "--to", "nemotron-nas", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["units_kept"] == 2980 and data["units_written"] == 8 * 512
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert data["weight_bytes"] == {"in": size, "out": (tmp_path / "deci" / "model.safetensors").stat().st_size,
                                    "smaller": False}
    r = run("export", src, tmp_path / "again", "--to", "nemotron-nas")
    said = " ".join(r.stdout.split())  # the console wraps lines
    assert "padding: 2,980 MLP units kept, written as 4,096 (" in said and \
        "MB in: not smaller, the padding ate the saving" in said, r.stdout


def test_check_in_a_runtime_not_installed_is_one_line_naming_it(tmp_path, monkeypatch):
    """--check picks the runtime; with neither MLX-LM nor vLLM installed one line names both."""
    find = runtime_check.importlib.util.find_spec
    monkeypatch.setattr(runtime_check.importlib.util, "find_spec",
                        lambda m, *a: None if m in ("mlx", "mlx_lm", "vllm") else find(m, *a))
    monkeypatch.delenv(runtime_check.SERVE_PYTHON, raising=False)
    r = run("export", LLAMA, tmp_path / "deci", "--to", "nemotron-nas")
    assert r.exit_code == 1 and r.output.count("error:") == 1, r.output
    assert "neither is installed: pip install 'normsurgery[mlx]', or pip install vllm" in r.output
    r = run("export", LLAMA, tmp_path / "deci", "--to", "nemotron-nas", "--check", "vllm")
    assert r.exit_code == 1 and "the vLLM check needs vllm, not installed" in r.output, r.output
    assert not (tmp_path / "deci").exists()
    monkeypatch.setattr(runtime_check.importlib.util, "find_spec", lambda m, *a: None if m == "vllm" else find(m, *a))
    assert runtime_check.choose() == "mlx"
    monkeypatch.setattr(runtime_check.importlib.util, "find_spec",
                        lambda m, *a: None if m.startswith("mlx") else True)  # as if vLLM were here
    assert runtime_check.choose() == "vllm"  # no MLX: vLLM, which a Linux server has


def workers() -> list[str]:
    """The runtime workers of this checkout running now (their command line names the script)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(runtime_check.WORKER).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def checking(folder: Path, then: float):
    """Ready ``then`` seconds after the stage in ``folder`` holds its config.json (the checks begin)."""
    def ready(_) -> bool:
        stage = next(folder.glob(".out.tmp-*"), None)
        if stage is None or not (stage / "config.json").is_file():
            return False
        time.sleep(then)
        return True
    return ready


def test_ctrl_c_stops_the_export_within_2s_at_any_moment(tmp_path):
    """SIGINT while loading, writing, or inside the runtime's forward (MLX's of a 150,000-token
    vocabulary: seconds in one C++ call, which held Ctrl-C when it ran in this process): exit 130
    within 2 s, no output, stage, lock or worker left."""
    ns.save(tiny_model("llama", torch.float32, vocab_size=150_000), tmp_path / "src")
    out = tmp_path / "out"
    moments = {"starting": lambda t: t > 1.0, "writing": lambda t: any(tmp_path.glob(".out.tmp-*")),
               **{f"checking +{d}s": checking(tmp_path, d) for d in (0.5, 2.0, 3.5)}}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for moment, ready in moments.items():
        proc = subprocess.Popen([sys.executable, "-m", "normsurgery", "export", tmp_path / "src", out, "--to",
                                 "nemotron-nas"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's & ignores it
        start = time.monotonic()
        while not ready(time.monotonic() - start):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - sent
        assert proc.returncode == 130 and "Traceback" not in err, (moment, err)
        assert took < 2, f"{moment}: exit {took:.1f} s after Ctrl-C"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], moment
        assert not workers(), moment
