"""export --to gguf: the file, run in llama.cpp (xllamacpp), computes what the checkpoint computes in
transformers (stock Llama and GPT-2, per-layer widths as deci, LN-free through the eps trick); what
GGUF cannot express is refused before writing; a wrong tensor, or a file llama.cpp cannot load,
fails the check and leaves nothing (no file, no folder); llama.cpp's process, threads and port are
gone once the export returns."""

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.exporters import gguf as G
from normsurgery.cli import app
from normsurgery.core.errors import SurgeryError
from normsurgery.core.families import layout
from normsurgery.exporters.gguf import export as export_gguf, run_llama
from normsurgery.core.parity import probe_ids
from normsurgery.passes import remove_ln as R
from normsurgery.passes import removable_norm as RN
from normsurgery.core.runtime import NoNorm

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def llama_against(path: Path, reference) -> dict:
    """llama.cpp's greedy continuation of random ids and its log-probabilities at each generated
    position against ``reference`` (a transformers model, float32) fed the same tokens: relative
    error of the log-probabilities, top-1 agreement, greedy continuation equal."""
    prompts = probe_ids(None, reference.config.vocab_size, None, 2, 12, seed=5)
    got = run_llama(path, prompts, 6, "a", reference.config.vocab_size)
    with torch.no_grad():
        logits = reference(input_ids=torch.cat([prompts, got.tokens[:, :-1]], 1)).logits[:, 11:]
    want, have = torch.log_softmax(logits.double(), -1), got.logprobs.double()
    best = want.argmax(-1)
    kept = want > -80  # float32 softmax: smaller probabilities are subnormal or zero in llama.cpp
    assert (have[want < -95] < -80).all()  # ... and small there too
    return {"relative": ((want - have).abs()[kept].max() / want[kept].abs().max()).item(),
            "top1": (best == got.logprobs.argmax(-1)).double().mean().item(),
            "greedy_equal": bool((best == got.tokens).all())}


def stock(path) -> torch.nn.Module:
    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True).eval()


def left_nothing(out: Path) -> None:
    assert not out.exists() and not Path(f"{out}.md").exists()
    assert not [f for f in out.parent.iterdir() if ".tmp-" in f.name]


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


def test_gpt2_tiny_tied_head(tmp_path):
    out = tmp_path / "gpt2.gguf"
    r = ns.export(GPT2, out, to="gguf")
    assert r.arch == "gpt2" and r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(out, stock(GPT2))["relative"] <= 1e-3


def test_fewer_layers_keep_the_family_architecture(tmp_path):
    ns.prune(LLAMA, tmp_path / "pruned", {"layers": 3, "method": "last"})
    r = ns.export(tmp_path / "pruned", tmp_path / "pruned.gguf", to="gguf")
    assert r.arch == "llama" and len(r.widths["heads"]) == 5 and r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(tmp_path / "pruned.gguf", stock(tmp_path / "pruned"))["relative"] <= 1e-3


def uneven(tmp_path) -> Path:
    """llama-tiny with 16 i MLP units of layer i and layer 3's second key/value group zeroed,
    minimized: every layer has its own width."""
    model = ns.load(LLAMA, dtype=torch.float32)
    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            block.mlp.down_proj.weight[:, :16 * i] = 0
        model.model.layers[3].self_attn.o_proj.weight[:, 64:] = 0
        model.model.layers[3].self_attn.v_proj.weight[32:] = 0
    ns.save(model, tmp_path / "zeroed", source=LLAMA)
    ns.convert(tmp_path / "zeroed", tmp_path / "minimized", [("minimize", {})])
    return tmp_path / "minimized"


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
    model = ns.load(path, dtype=torch.float32)
    lay = layout(model)
    norms = R.install(model, lay, split=not stock_export)
    R.calibrate(model, norms, probe_ids(None, 1024, None, 4, 32, seed=3))
    for rn in norms:
        RN.freeze_until([rn], [(0, "all", [(0, p) for p in range(len(rn.paths))]), (0, "position 0", [])], 0)
    if stock_export:
        R.export_stock(model, lay, norms)
    else:
        RN.fold(model, lay, norms)
    out = tmp_path / ("stock" if stock_export else "folded")
    ns.save(model, out, source=path)
    return out, model


def test_ln_free_llama_through_the_eps_trick(tmp_path):
    folder, model = removed_ln(LLAMA, tmp_path)
    assert any(isinstance(m, NoNorm) for m in model.modules())
    r = ns.export(folder, tmp_path / "noln.gguf", to="gguf")
    assert r.eps_trick and r.parity.ok and r.greedy["agree"] == 1.0
    assert llama_against(tmp_path / "noln.gguf", model)["relative"] <= 1e-3


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


def test_a_wrong_tensor_fails_the_check_and_leaves_nothing(tmp_path):
    out = tmp_path / "wrong.gguf"

    def wrong(name, values):
        return values * 1.05 if name == "blk.3.attn_v.weight" else values

    with pytest.raises(SurgeryError, match="llama.cpp's log-probabilities differ from transformers'"):
        export_gguf(LLAMA, out, change=wrong)
    left_nothing(out)


def one_line_refusal(args, match: str, out: Path) -> None:
    r = run("export", *args, out, "--to", "gguf")
    assert r.exit_code == 1 and match in r.output and len(r.output.strip().splitlines()) <= 3, r.output
    left_nothing(out)


def test_a_live_norm_beside_removed_ones_is_refused(tmp_path):
    model = ns.load(LLAMA, dtype=torch.float32)
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
    model = ns.load(GPT2, dtype=torch.float32)
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


def test_a_file_llama_cpp_cannot_load_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """A GGUF claiming one block more than it holds: llama.cpp refuses it (a missing tensor), the
    export says so in one line, exit 1, and the folders it would have written into are not made."""
    def deeper(source):
        p, model = plan(source)
        p.meta["block_count"] += 1
        return p, model

    plan = G.gguf_plan
    monkeypatch.setattr(G, "gguf_plan", deeper)
    out = tmp_path / "new" / "deeper" / "x.gguf"
    r = run("export", LLAMA, out, "--to", "gguf")
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith("error: llama.cpp cannot load the GGUF written") and "blk.8" in r.output, r.output
    assert "Traceback" not in r.output and "nothing was written" in lines[-1] and len(lines) <= 3
    assert not (tmp_path / "new").exists()


def test_device_is_honoured_or_refused_in_one_line(tmp_path):
    """transformers' side computes on --device (llama.cpp on the CPU); a GPU named where torch sees
    none is one line, exit 1, before anything is written."""
    out = tmp_path / "sub" / "cpu.gguf"
    r = run("export", LLAMA, out, "--to", "gguf", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["parity"]["device"]["device"] == "cpu"
    out = tmp_path / "gpu" / "x.gguf"
    r = run("export", LLAMA, out, "--to", "gguf", "--device", "cuda")
    if torch.cuda.is_available():
        assert r.exit_code == 0 and "computed on cuda:0" in r.output, r.output
    else:
        assert r.exit_code == 1 and r.output.startswith("error: --device cuda: torch sees no GPU"), r.output
        assert len(r.output.strip().splitlines()) <= 3 and not (tmp_path / "gpu").exists()


def children() -> list[int]:
    """This process's child processes (Linux /proc)."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == me:
            out.append(int(pid))
    return out


def test_llama_cpp_leaves_nothing_running(tmp_path):
    """Once export returns: no child process, no thread more in this process than before, and the
    loopback port llama.cpp's server listened on is closed."""
    ns.export(LLAMA, tmp_path / "warm.gguf", to="gguf")  # torch's own threads started
    threads = len(os.listdir("/proc/self/task"))
    r = ns.export(LLAMA, tmp_path / "x.gguf", to="gguf")
    assert children() == [] and len(os.listdir("/proc/self/task")) == threads
    host, port = r.llama_cpp["address"].removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1" and r.llama_cpp["peak_rss_mb"] > 0
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect((host, int(port)))


def test_distributions_are_llama_cpps_kld_statistics():
    """mean / 99.9% KLD and same top p against a computation by hand: logits a and log-probabilities
    b = log_softmax(a + noise), position 7's top token made unlikely."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 300, generator=g, dtype=torch.float64) * 3
    b = torch.log_softmax(a + 0.01 * torch.randn(50, 300, generator=g, dtype=torch.float64), -1)
    top = a[7].argmax()
    b[7, top] -= 20  # position 7: another token first
    c, stats = G.distributions(a.float(), b.float())
    pa = torch.softmax(a, -1)
    kl = (pa * (torch.log_softmax(a, -1) - b)).sum(-1)
    same = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    assert same < 1 and stats["positions"] == 50 and stats["same_top_p"] == pytest.approx(100 * same)
    assert stats["mean_kld"] == pytest.approx(kl.mean().item(), rel=1e-5)
    assert stats["kld_99_9"] == pytest.approx(torch.quantile(kl, 0.999).item(), rel=1e-5)
    assert stats["max_kld"] == pytest.approx(kl.max().item(), rel=1e-5)
    ls = torch.log_softmax(a, -1)
    assert c.relative == pytest.approx(((ls - b).abs().max() / ls.abs().max()).item(), rel=1e-5)
    assert c.top1 == pytest.approx(same)
