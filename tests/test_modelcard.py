"""Every folder convert, prune and heal write has a model card (README.md, Hugging Face
convention) saying what was done, the parity measured and how to load it; an input's own card
is kept as README.source.md."""

import shutil

import yaml

import normsurgery as ns
from normsurgery.core.calibration import bundled_text

GPT2 = "normsurgery/demo/gpt2-tiny"


def card(folder):
    text = (folder / "README.md").read_text()
    _, header, body = text.split("---\n", 2)
    return yaml.safe_load(header), body


def test_convert_card_and_the_input_card_kept(tmp_path):
    src = tmp_path / "in"
    shutil.copytree(GPT2, src)
    (src / "README.md").write_text("# the input's own card\n")
    r = ns.convert(src, tmp_path / "out", [("pre-rmsnorm", {"fold": True}), ("crmsnorm", {})])
    assert (tmp_path / "out" / "README.source.md").read_text() == "# the input's own card\n"
    header, body = card(tmp_path / "out")
    assert header == {"library_name": "normsurgery",  # no base_model: a local folder is no hub id (issue 28)
                      "tags": ["normsurgery", "gpt2", "pre-rmsnorm", "crmsnorm"]}
    assert "pass **pre-rmsnorm** (fold=True)" in body and "pass **crmsnorm** (defaults)" in body
    assert "rewritten in float32, stored in float32" in body
    for step in r.steps:  # per pass, with its tolerance and why
        assert f"| {step.name} | {step.parity.relative:.2e} | {step.parity.tolerance:.1e} | {step.parity.reason} |" \
            in body
    assert f"relative error {r.parity.relative:.2e}" in body and "loaded back with trust_remote_code=True" in body
    assert "AutoModelForCausalLM.from_pretrained(\"PATH\", trust_remote_code=True)" in body
    assert "normsurgery export PATH onnx/ --to onnx" in body


def test_prune_and_heal_cards_give_the_held_out_loss(tmp_path):
    r = ns.prune(GPT2, tmp_path / "pruned", {"layers": 1, "seq_len": 16, "samples": 3})
    header, body = card(tmp_path / "pruned")
    assert header["tags"] == ["normsurgery", "gpt2", "prune"]
    assert f"removed layers {list(r.selection.layers)}" in body
    assert f"| prune | {r.ce['original']:.4f} | {r.ce['pruned']:.4f} | 0 |" in body
    assert "loaded back with plain transformers" in body
    h = ns.heal(tmp_path / "pruned", tmp_path / "healed", text=bundled_text()[:20000],
                options={"steps": 2, "seq_len": 32, "batch_size": 2, "rank": 2})
    header, body = card(tmp_path / "healed")
    assert "base_model" not in header and "heal" in header["tags"]
    assert f"| heal | {h.report.ce_before:.4f} | {h.report.ce_after:.4f} | {h.report.tokens} |" in body
    # records append (issue 28): the pruned input's record is the healed output's history
    import json
    record = json.loads((tmp_path / "healed" / "config.json").read_text())["normsurgery"]
    assert "heal" in record and "prune" not in record
    assert [("prune" in h, h["source"]) for h in record["history"]] == [(True, GPT2)]
    assert "## Earlier steps" in body and f"1. from `{GPT2}`" in body
    assert f"   - **prune**: removed layers {list(r.selection.layers)}" in body
    ns.convert(tmp_path / "healed", tmp_path / "folded", [("flashnorm", {})])  # a third step: history grows
    record = json.loads((tmp_path / "folded" / "config.json").read_text())["normsurgery"]
    assert [h["source"] for h in record["history"]] == [GPT2, str(tmp_path / "pruned")]
    assert "heal" in record["history"][1] and "modules" not in record["history"][1]


def test_base_model_is_a_hub_id_only():
    from types import SimpleNamespace

    from normsurgery.io.modelcard import base_model

    assert base_model({"source": "HuggingFaceTB/SmolLM2-135M"}, SimpleNamespace()) == "HuggingFaceTB/SmolLM2-135M"
    assert base_model({"source": "/tmp/x/model"}, SimpleNamespace(_name_or_path="/tmp/x/model")) is None
    assert base_model({"source": "/tmp/x"}, SimpleNamespace(_name_or_path="org/base")) == "org/base"
    assert base_model({"source": "/tmp/x"}, SimpleNamespace(), {"base_model": "org/base"}) == "org/base"
    assert base_model({"source": "/tmp/x"}, SimpleNamespace(), {"base_model": "/tmp/y"}) is None


SENTENCE_CARD = """---
language: en
license: apache-2.0
library_name: sentence-transformers
tags:
- sentence-transformers
- feature-extraction
datasets:
- s2orc
- ms_marco
pipeline_tag: sentence-similarity
base_model: nreimers/MiniLM-L6-H384-uncased
model-index:
- name: all-MiniLM-L6-v2
  results: []
---

# all-MiniLM-L6-v2
"""


def test_a_card_keeps_the_source_cards_metadata(tmp_path):
    """Issue 47.6: prune of all-MiniLM-L6-v2 replaced its header (library_name sentence-transformers,
    license, tags, datasets) with ours. Kept: those, the language, the pipeline tag and a hub
    base_model; ours added (the tag normsurgery, the family, the step); the input's scores
    (model-index) dropped. A BERT base model's card suggests no TransformerLens."""
    import transformers as T

    from models import CONFIGS

    src = tmp_path / "minilm"
    T.BertModel(CONFIGS["bert"]()).save_pretrained(src)
    (src / "README.md").write_text(SENTENCE_CARD)
    ns.prune(src, tmp_path / "pruned", {"layers": 1, "method": "last"})
    header, body = card(tmp_path / "pruned")
    assert header == {"base_model": "nreimers/MiniLM-L6-H384-uncased", "language": "en", "license": "apache-2.0",
                      "library_name": "sentence-transformers", "datasets": ["s2orc", "ms_marco"],
                      "pipeline_tag": "sentence-similarity",
                      "tags": ["normsurgery", "bert", "prune", "sentence-transformers", "feature-extraction"]}
    assert "TransformerLens" not in body and (tmp_path / "pruned" / "README.source.md").read_text() == SENTENCE_CARD
    # a local base_model is no hub id: left out; the convert card keeps the rest the same way
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(GPT2, gpt2)
    (gpt2 / "README.md").write_text("---\nlicense: mit\nbase_model: /home/me/gpt2\ntags: text-generation\n---\n")
    ns.convert(gpt2, tmp_path / "folded", [("flashnorm", {})])
    header, body = card(tmp_path / "folded")
    assert header == {"license": "mit", "library_name": "normsurgery",
                      "tags": ["normsurgery", "gpt2", "flashnorm", "text-generation"]}
    assert "TransformerLens" in body  # a causal LM of a family it takes


def test_an_adapter_card_names_its_base_by_hub_id_only(tmp_path):
    """Issue 47.1: the adapter's card is ours (not peft's template); from a local folder its header
    keeps the source card's base_model and its text names the folder; its config names a hub id
    when the source was opened by one, else the folder."""
    from pathlib import Path
    from types import SimpleNamespace

    src = tmp_path / "mine"
    shutil.copytree("normsurgery/demo/llama-tiny", src)
    (src / "README.md").write_text("---\nlicense: mit\nbase_model: org/base\n---\n# mine\n")
    ns.heal(src, tmp_path / "adapter", text=bundled_text()[:20000],
            options={"steps": 1, "seq_len": 32, "batch_size": 2, "eval_samples": 1, "save_adapter": True})
    header, body = card(tmp_path / "adapter")
    assert header == {"base_model": "org/base", "license": "mit", "library_name": "peft",
                      "tags": ["normsurgery", "lora", "peft", "llama", "heal"]}
    assert "Its base is the local folder `mine`" in body and "Model Card for Model ID" not in body
    from normsurgery.commands.heal import adapter_base

    assert adapter_base(SimpleNamespace(name="org/model", path=Path("/nowhere"))) == "org/model"
    assert adapter_base(SimpleNamespace(name=str(src), path=src)) == str(src.resolve())
