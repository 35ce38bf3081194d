"""export --to gguf: the file, run in llama.cpp, computes what the checkpoint computes in transformers
(stock Llama and GPT-2, per-layer widths as deci, LN-free through the eps trick); what GGUF cannot
express is refused before writing; a wrong tensor fails the check and leaves nothing."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.cli import app
from normsurgery.errors import SurgeryError
from normsurgery.families import layout
from normsurgery.gguf import export as export_gguf
from normsurgery.parity import compare, probe_ids
from normsurgery.passes import remove_ln as R
from normsurgery.runtime import NoNorm

pytest.importorskip("gguf")

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
runner = CliRunner()


def _llama_cpp() -> str | None:
    """Why llama.cpp cannot run here (None: it can)."""
    if importlib.util.find_spec("llama_cpp_py_sync") is None:
        return "llama-cpp-py-sync is not installed (pip install 'normsurgery[gguf]')"
    from normsurgery.gguf import library_problem

    return library_problem()


WHY = _llama_cpp()
needs_llama = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def llama_against(path: Path, reference) -> dict:
    """llama.cpp's logits of the GGUF ``path`` against ``reference`` (a transformers model, float32)
    on random ids: the metrics of ``parity.compare``."""
    from normsurgery.gguf import LlamaCpp

    ids = probe_ids(None, reference.config.vocab_size, None, 3, 21, seed=5)
    run_ = LlamaCpp(path, 32)
    try:
        got = torch.stack([run_.logits(row.tolist()) for row in ids])
    finally:
        run_.close()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    return compare(want, got).as_dict()


def stock(path) -> torch.nn.Module:
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True).eval()


def left_nothing(out: Path) -> None:
    assert not out.exists() and not Path(f"{out}.md").exists()
    assert not [f for f in out.parent.iterdir() if ".tmp-" in f.name]


@needs_llama
@pytest.mark.parametrize("dtype,bound", [("f32", 1e-3), ("f16", 1e-2), ("bf16", 2e-2), ("q8_0", 5e-2)])
def test_llama_tiny_runs_in_llama_cpp_as_in_transformers(tmp_path, dtype, bound):
    out = tmp_path / "llama.gguf"
    r = run("export", LLAMA, out, "--to", "gguf", "--dtype", dtype, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["arch"] == "llama" and data["pre_tokenizer"] == "gpt-2" and data["tokenizer"]["equal"]
    assert data["parity"]["relative"] <= data["parity"]["tolerance"]
    if dtype == "f32":
        assert data["greedy"]["agree"] == 1.0
    m = llama_against(out, stock(LLAMA))
    assert m["relative"] <= bound and m["top1"] >= 0.98, m
    import gguf

    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert "llama.cpp" in Path(f"{out}.md").read_text()


@needs_llama
def test_gpt2_tiny_tied_head(tmp_path):
    out = tmp_path / "gpt2.gguf"
    r = ns.export(GPT2, out, to="gguf")
    assert r.arch == "gpt2" and r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(out, stock(GPT2))["relative"] <= 1e-3


@needs_llama
def test_fewer_layers_keep_the_family_architecture(tmp_path):
    ns.prune(LLAMA, tmp_path / "pruned", {"layers": 3, "method": "last"})
    r = ns.export(tmp_path / "pruned", tmp_path / "pruned.gguf", to="gguf")
    assert r.arch == "llama" and len(r.widths["heads"]) == 5 and r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(tmp_path / "pruned.gguf", stock(tmp_path / "pruned"))["relative"] <= 1e-3


def uneven(tmp_path) -> Path:
    """llama-tiny with 16 i MLP units of layer i and layer 3's second key/value group zeroed,
    minimized: every layer has its own width."""
    model = ns.load(LLAMA, torch.float32)
    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            block.mlp.down_proj.weight[:, :16 * i] = 0
        model.model.layers[3].self_attn.o_proj.weight[:, 64:] = 0
        model.model.layers[3].self_attn.v_proj.weight[32:] = 0
    ns.save(model, tmp_path / "zeroed", source=LLAMA)
    ns.convert(tmp_path / "zeroed", tmp_path / "minimized", [("minimize", {})])
    return tmp_path / "minimized"


@needs_llama
def test_per_layer_widths_are_deci(tmp_path):
    small = uneven(tmp_path)
    reference = stock(tmp_path / "zeroed")  # the function before minimize, in stock transformers
    r = ns.export(small, tmp_path / "small.gguf", to="gguf")
    assert r.arch == "deci" and r.parity.ok and r.greedy["agree"] == 1.0
    assert r.widths["units"] == [384 - 16 * i for i in range(8)]
    assert r.widths["heads"][3] == 2 and r.widths["kv_heads"][3] == 1
    assert llama_against(tmp_path / "small.gguf", reference)["relative"] <= 1e-3
    full = ns.export(LLAMA, tmp_path / "full.gguf", to="gguf")
    assert r.saved["bytes"] < full.saved["bytes"]


def removed_ln(path: str, tmp_path: Path, stock_export: bool = False) -> tuple[Path, torch.nn.Module]:
    """``path`` with every norm removed by remove-ln's own fold (divisors calibrated and frozen, no
    training: the saved format is the trained one's), saved; and the frozen-norm model it must equal."""
    model = ns.load(path, torch.float32)
    lay = layout(model)
    norms = R.install(model, lay, split=not stock_export)
    R._calibrate(model, norms, probe_ids(None, 1024, None, 4, 32, seed=3))
    for rn in norms:
        R.freeze_until([rn], [(0, "all", [(0, p) for p in range(len(rn.paths))]), (0, "position 0", [])], 0)
    if stock_export:
        R.export_stock(model, lay, norms)
    else:
        R.fold(model, lay, norms)
    out = tmp_path / ("stock" if stock_export else "folded")
    ns.save(model, out, source=path)
    return out, model


@needs_llama
def test_ln_free_llama_through_the_eps_trick(tmp_path):
    folder, model = removed_ln(LLAMA, tmp_path)
    assert any(isinstance(m, NoNorm) for m in model.modules())
    r = ns.export(folder, tmp_path / "noln.gguf", to="gguf")
    assert r.eps_trick and r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(tmp_path / "noln.gguf", model)["relative"] <= 1e-3


@needs_llama
def test_ln_free_gpt2(tmp_path):
    folder, model = removed_ln(GPT2, tmp_path, stock_export=True)  # eps 1e12 and gains 1e6 / s in the checkpoint
    r = ns.export(folder, tmp_path / "noln.gguf", to="gguf")
    assert r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(tmp_path / "noln.gguf", model)["relative"] <= 1e-3
    folded, _ = removed_ln(GPT2, tmp_path)  # the default fold puts ln_f's bias into the head
    out = tmp_path / "folded.gguf"
    r = run("export", folded, out, "--to", "gguf")
    assert r.exit_code == 1 and "head has a bias" in r.output and "export=stock" in r.output
    left_nothing(out)


@needs_llama
def test_a_wrong_tensor_fails_the_check_and_leaves_nothing(tmp_path):
    out = tmp_path / "wrong.gguf"

    def wrong(name, values):
        return values * 1.05 if name == "blk.3.attn_v.weight" else values

    with pytest.raises(SurgeryError, match="llama.cpp's logits differ from transformers'"):
        export_gguf(LLAMA, out, change=wrong)
    left_nothing(out)


def one_line_refusal(args, match: str, out: Path) -> None:
    r = run("export", *args, out, "--to", "gguf")
    assert r.exit_code == 1 and match in r.output and len(r.output.strip().splitlines()) <= 3, r.output
    left_nothing(out)


def test_a_live_norm_beside_removed_ones_is_refused(tmp_path):
    model = ns.load(LLAMA, torch.float32)
    model.model.layers[0].input_layernorm = NoNorm(128)
    ns.save(model, tmp_path / "mixed", source=LLAMA)
    one_line_refusal([tmp_path / "mixed"], "GGUF has one norm epsilon", tmp_path / "mixed.gguf")


def test_removed_channels_and_unwritten_families_are_refused(tmp_path):
    ns.convert(GPT2, tmp_path / "narrow", [("minimize", {"prune_channels": 16})])
    one_line_refusal([tmp_path / "narrow"], "112 of 128 channels", tmp_path / "narrow.gguf")
    from models import tiny_model

    ns.save(tiny_model("qwen3", torch.float32), tmp_path / "qwen3")
    one_line_refusal([tmp_path / "qwen3"], "no llama.cpp architecture for qwen3", tmp_path / "qwen3.gguf")


def test_uneven_gpt2_widths_are_refused(tmp_path):
    model = ns.load(GPT2, torch.float32)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.weight[:64] = 0  # Conv1D [in, out]: 64 units write nothing
    ns.save(model, tmp_path / "zeroed", source=GPT2)
    ns.convert(tmp_path / "zeroed", tmp_path / "uneven", [("minimize", {})])
    one_line_refusal([tmp_path / "uneven"], "per-layer widths only in deci", tmp_path / "uneven.gguf")


def test_an_unknown_pre_tokenizer_is_refused(tmp_path):
    shutil.copytree(LLAMA, tmp_path / "odd")
    spec = json.loads((tmp_path / "odd" / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, spec["pre_tokenizer"]]}
    (tmp_path / "odd" / "tokenizer.json").write_text(json.dumps(spec))
    one_line_refusal([tmp_path / "odd"], "no pre-tokenizer known to match", tmp_path / "odd.gguf")


def test_options_of_the_other_format_are_usage_errors(tmp_path):
    r = run("export", LLAMA, tmp_path / "x.gguf", "--to", "gguf", "--with-past")
    assert r.exit_code == 2 and "ONNX options" in r.output
    r = run("export", LLAMA, tmp_path / "x", "--to", "onnx", "--dtype", "f16")
    assert r.exit_code == 2 and "GGUF option" in r.output
    r = run("export", LLAMA, tmp_path / "x.gguf", "--to", "gguf", "--dtype", "q4")
    assert r.exit_code == 2 and "f32, f16, bf16, q8_0" in r.output


@pytest.mark.real
@needs_llama
def test_real_smollm2_outputs_run_in_llama_cpp(tmp_path):
    """SmolLM2-135M (NORMSURGERY_REAL_MODEL, ``make test-real``): the input, its flashnorm output, a
    prune --layers 4 output and a minimized one (mask:prune_units=0.3) at F32 in llama.cpp: 32 greedy
    tokens equal transformers', relative error <= 1e-3; the minimized file smaller than the input's."""
    import os

    real = Path(os.environ.get("NORMSURGERY_REAL_MODEL", ""))
    if not (real / "config.json").is_file():
        pytest.fail(f"NORMSURGERY_REAL_MODEL={str(real)!r} names no checkpoint folder (make test-real fetches it)")
    ns.convert(real, tmp_path / "flash", [("flashnorm", {})])
    ns.prune(real, tmp_path / "pruned", {"layers": 4, "method": "last"})
    ns.convert(real, tmp_path / "small", [("minimize", {"prune_units": 0.3})])
    sizes = {}
    for name, folder in (("input", real), ("flash", tmp_path / "flash"), ("pruned", tmp_path / "pruned"),
                         ("small", tmp_path / "small")):
        r = ns.export(folder, tmp_path / f"{name}.gguf", to="gguf")
        assert r.parity.relative <= 1e-3 and r.greedy["agree"] == 1.0, (name, r.as_dict())
        assert r.pre_tokenizer == "smollm" and r.tokenizer["equal"]
        sizes[name] = r.saved["bytes"]
    assert sizes["small"] < sizes["input"]
