"""export --to onnx: the graph, run in ONNX Runtime, computes what the checkpoint computes, for
stock and rewritten outputs, LMs, base models and classifiers; a broken graph is refused and
nothing is left."""

import importlib
import json
from pathlib import Path

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.cli import app
from normsurgery.exporters.export import GRAPH, run_graph
from normsurgery.core.parity import compare, outputs, output_kind, probe_ids
from test_checkpoint import sentence_transformers_folder
from test_heads import make
from test_remove_ln import frozen_model
from normsurgery.passes import remove_ln as R
from normsurgery.passes import removable_norm as RN

pytest.importorskip("onnxruntime")

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def ort_against(folder: Path, reference_model) -> float:
    """ONNX Runtime's output of ``folder`` against ``reference_model`` (the unmodified model, in
    float32) on random ids of a batch and length the graph was not traced with."""
    ids = probe_ids(None, reference_model.config.vocab_size, None, 3, 21, seed=5)
    got = run_graph(folder / GRAPH, ids)[0]
    return compare(outputs(reference_model, ids), got, output_kind(reference_model)).relative


def test_stock_output_flashnorm_llama(tmp_path):
    ns.convert(LLAMA, tmp_path / "flash", [("flashnorm", {})])
    r = run("export", tmp_path / "flash", tmp_path / "onnx", "--to", "onnx", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["output"] == "logits" and data["parity"]["top1"] == 1.0
    assert data["parity"]["relative"] <= data["parity"]["tolerance"] == 1e-5
    assert {"model.onnx", "config.json", "tokenizer.json", "README.md"} <= set(data["saved"]["files"])
    card = (tmp_path / "onnx" / "README.md").read_text()
    assert "base_model:" not in card and "library_name: onnx" in card  # a local folder is no hub id (issue 28)
    assert f"relative error {data['parity']['relative']:.2e}, top-1 agreement 1.0000; tolerance 1.0e-05" in card
    assert ort_against(tmp_path / "onnx", ns.load(LLAMA, dtype=torch.float32)) <= 1e-5


def test_remote_code_output_crmsnorm_gpt2(tmp_path):
    ns.convert(GPT2, tmp_path / "out", [("crmsnorm", {})])
    assert json.loads((tmp_path / "out" / "config.json").read_text()).get("auto_map")  # remote code
    r = ns.export(tmp_path / "out", tmp_path / "onnx", external_data=True)
    assert r.parity.ok and r.external_data and "model.onnx_data" in r.saved["files"]
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "onnx").iterdir()}
    assert modes["model.onnx_data"] == modes["model.onnx"] == modes["config.json"], modes  # not 0600 (issue 28)
    assert ort_against(tmp_path / "onnx", ns.load(GPT2, dtype=torch.float32)) <= 1e-5


def test_remove_ln_output_has_no_norm_in_the_graph(tmp_path):
    model, lay, norms = frozen_model("gpt2", torch.float32)
    RN.fold(model, lay, norms)
    ns.save(model, tmp_path / "noln")
    r = ns.export(tmp_path / "noln", tmp_path / "onnx")
    assert r.parity.ok
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "onnx" / GRAPH)).graph.node}
    assert "LayerNormalization" not in ops and "ReduceMean" not in ops  # no statistic computed
    assert ort_against(tmp_path / "onnx", ns.load(tmp_path / "noln", dtype=torch.float32)) <= 1e-5


@pytest.mark.parametrize("family, cls", [("llama", "LlamaModel"), ("gpt2", "GPT2ForSequenceClassification")])
def test_base_model_and_classifier(tmp_path, family, cls):
    src = make(tmp_path, family, cls)
    r = ns.export(src, tmp_path / "onnx")
    assert r.parity.ok and r.output == ("last_hidden_state" if cls == "LlamaModel" else "logits")
    model = getattr(T, cls).from_pretrained(src).eval()
    assert ort_against(tmp_path / "onnx", model) <= 1e-5


def test_a_broken_graph_is_refused_and_nothing_is_left(tmp_path, monkeypatch):
    import onnx
    from onnx import numpy_helper

    E = importlib.import_module("normsurgery.exporters.export")  # the module (ns.export is the function)
    write = E.write_graph

    def broken(model, folder, *args):  # a weight changed after export
        write(model, folder, *args)
        g = onnx.load(str(folder / GRAPH))
        t = max(g.graph.initializer, key=lambda t: len(t.raw_data))
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 1.01, t.name))
        onnx.save(g, str(folder / GRAPH))

    monkeypatch.setattr(E, "write_graph", broken)
    r = run("export", GPT2, tmp_path / "onnx", "--to", "onnx")
    assert r.exit_code == 1 and "ONNX Runtime's logits differ" in r.output and "nothing was written" in r.output
    assert not list(tmp_path.iterdir())


def test_refusals(tmp_path, monkeypatch):
    r = run("export", GPT2, tmp_path / "x", "--to", "tflite")
    assert r.exit_code == 2 and "choose one of onnx" in r.output
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "onnxruntime" else find(m, *a))
    r = run("export", GPT2, tmp_path / "x", "--to", "onnx")
    assert r.exit_code == 1 and "pip install 'normsurgery[onnx]'" in r.output
    assert not list(tmp_path.iterdir())


def test_force_replaces_an_export(tmp_path):
    assert ns.export(GPT2, tmp_path / "onnx").parity.ok
    assert run("export", GPT2, tmp_path / "onnx", "--to", "onnx").exit_code == 1
    assert run("export", GPT2, tmp_path / "onnx", "--to", "onnx", "--force").exit_code == 0


def test_sentence_transformers_modules_go_with_the_export(tmp_path):
    """Issue 34, finding 3: export copied modules.json but not the module folders it names."""
    src = sentence_transformers_folder(tmp_path)
    assert ns.export(src, tmp_path / "onnx").parity.ok
    for f in ("modules.json", "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors"):
        assert (tmp_path / "onnx" / f).read_bytes() == (src / f).read_bytes()
    assert (tmp_path / "onnx" / GRAPH).read_bytes() != (src / "onnx" / GRAPH).read_bytes()  # ours, not the stale copy


@pytest.mark.parametrize("src", [LLAMA, GPT2])
def test_with_past_generates_as_torch_does(tmp_path, src):
    ns.convert(src, tmp_path / "out", [("crmsnorm" if src == GPT2 else "flashnorm", {})])
    r = run("export", tmp_path / "out", tmp_path / "onnx", "--to", "onnx", "--with-past", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["with_past"] and data["parity"]["generation"] == 1.0 and data["parity"]["ok"]
    import onnx

    graph = onnx.load(str(tmp_path / "onnx" / GRAPH)).graph
    assert [i.name for i in graph.input][:4] == ["input_ids", "attention_mask", "past_key_values.0.key",
                                               "past_key_values.0.value"]
    assert [o.name for o in graph.output][:2] == ["logits", "present.0.key"]


def test_with_past_refused_for_a_base_model(tmp_path):
    src = make(tmp_path, "llama", "LlamaModel")
    r = run("export", src, tmp_path / "onnx", "--to", "onnx", "--with-past")
    assert r.exit_code == 1 and "does not generate" in r.output and not (tmp_path / "onnx").exists()
