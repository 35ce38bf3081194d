"""rotate: an orthogonal Q on the residual stream, exact against the unmodified model; the
Hadamard matrices behind it; the outliers it removes; what it refuses."""

import copy
import json

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.core import analysis
from normsurgery.core import rotation
from normsurgery.cli import app
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms

from models import LAYERNORM, ROTATABLE, rel, tiny_model, token_ids

ACCEPTED = [n for n in range(1, 520) if rotation.hadamard_base(n)] + [576, 768, 896, 960, 1152]


def prepared(family: str, kind: str = "hadamard", **model_kw):
    """(the unmodified float64 model, its copy after the folding pass and rotate)."""
    model = tiny_model(family, **model_kw)
    faithful_norms(model)
    new = copy.deepcopy(model)
    fold = ("pre-rmsnorm", {"fold": True}) if family in LAYERNORM else ("flashnorm", {})
    steps = ns.apply_passes(new, [fold, ("rotate", {"kind": kind, "seed": 1})])
    return model, new, steps[-1]


def test_hadamard_orthogonal_for_every_width_it_accepts():
    assert {12, 20, 28, 36, 40, 576} <= set(ACCEPTED)
    for n in ACCEPTED:
        h = rotation.hadamard(n)
        assert torch.equal(h.abs(), torch.ones(n, n, dtype=h.dtype)), n
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype)), n
    for n in (576, 100, 52):
        for kind in ("hadamard", "random"):
            if kind == "hadamard" and rotation.hadamard_base(n) is None:
                with pytest.raises(ValueError, match="no Hadamard matrix of order"):
                    rotation.rotation(kind, n)
                continue
            q = rotation.rotation(kind, n, seed=3)
            assert (q @ q.T - torch.eye(n, dtype=q.dtype)).abs().max() < 1e-12
            assert torch.equal(q, rotation.rotation(kind, n, seed=3))
            assert not torch.equal(q, rotation.rotation(kind, n, seed=4))


@pytest.mark.parametrize("family", ROTATABLE)
def test_rotate_exact_float64(family):
    model, new, step = prepared(family)
    assert rel(model, new, token_ids()) <= 1e-10
    emb = new.get_input_embeddings().weight
    assert (emb - model.get_input_embeddings().weight).abs().max() > 1e-3  # the weights did change
    assert "readers on the input side" in step.notes[0]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_rotate_random_exact_float64(family):
    model, new, _ = prepared(family, "random")
    assert rel(model, new, token_ids()) <= 1e-10


def test_rotate_float32_within_rounding():
    model, new, _ = prepared("mistral", dtype=torch.float32)
    assert rel(model, new, token_ids()) <= 1e-5


def test_tied_head_stays_tied_and_exact(tmp_path):
    """A gain-free model with a tied head is rotated as is: the rotated embedding is the head (in
    memory, and one part at a time, where the embedding and the head share a part)."""
    model = tiny_model("qwen2")
    with torch.no_grad():
        for site in layout(model).norms:
            model.get_submodule(site.path).weight.fill_(1.0)
    model.float().save_pretrained(tmp_path / "in", max_shard_size="20KB")
    model.double()
    faithful_norms(model)
    assert layout(model).tied
    new = copy.deepcopy(model)
    step = ns.apply_passes(new, [("rotate", {})])[0]
    assert layout(new).tied and new.lm_head.weight is new.model.embed_tokens.weight
    assert any("stays tied" in n for n in step.notes)
    assert rel(model, new, token_ids()) <= 1e-10
    r = ns.convert(tmp_path / "in", tmp_path / "out", [("rotate", {})], streaming=True)
    assert r.ok and r.streaming and r.saved["plain_transformers"]
    saved = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert saved.config.tie_word_embeddings and saved.lm_head.weight is saved.model.embed_tokens.weight
    assert (saved.lm_head.weight.double() - new.lm_head.weight).abs().max() < 1e-6


def test_outlier_channels_shrink():
    """A stream with a few channels 30x larger: max|h| / RMS(h) falls to a Gaussian's level."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :2] *= 30.0
    new = copy.deepcopy(model)
    ns.apply_passes(new, [("flashnorm", {}), ("rotate", {})])
    ids = token_ids(4, 32)
    before, after = analysis.outliers(model, ids)["stream"], analysis.outliers(new, ids)["stream"]
    assert before[0]["max_over_rms"] > 3.5 and before[0]["kurtosis"] > 8
    for b, a in zip(before, after):
        assert a["max_over_rms"] < 0.7 * b["max_over_rms"] and a["kurtosis"] < b["kurtosis"]


@pytest.mark.parametrize("family,match", [
    ("llama", "per-channel gains.*--pass flashnorm"), ("gemma", "per-channel gains"),
    ("gpt2", "LayerNorm.*pre-rmsnorm with fold=true"), ("bert", "Post-LN")])
def test_refuses_with_the_pass_that_prepares(family, match):
    with pytest.raises(ns.SurgeryError, match=match):
        ns.apply_passes(tiny_model(family), [("rotate", {})])


def test_refuses_base_model_and_width_without_hadamard():
    base = T.LlamaModel(tiny_model("llama").config).double().eval()
    with pytest.raises(ns.SurgeryError, match="base model"):
        ns.apply_passes(base, [("flashnorm", {}), ("rotate", {})])
    torch.manual_seed(0)
    odd = T.GPT2LMHeadModel(T.GPT2Config(n_embd=52, n_layer=2, n_head=4, vocab_size=96, n_positions=32)).double().eval()
    with pytest.raises(ns.SurgeryError, match="no Hadamard matrix of order 52.*kind=random"):
        ns.apply_passes(copy.deepcopy(odd), [("pre-rmsnorm", {"fold": True}), ("rotate", {})])
    new = copy.deepcopy(odd)
    ns.apply_passes(new, [("pre-rmsnorm", {"fold": True}), ("rotate", {"kind": "random"})])
    assert rel(odd, new, token_ids(length=8)) <= 1e-10


def test_llama_output_is_plain_and_inspect_outliers(tmp_path):
    """Saved Llama: loads with plain transformers, same logits; a rotated GPT-2 needs the runtime;
    inspect --outliers compares the two checkpoints."""
    torch.manual_seed(0)
    src = tmp_path / "llama"
    tiny_model("llama", torch.float32).save_pretrained(src)
    out = tmp_path / "rotated"
    r = ns.convert(src, out, [("flashnorm", {}), ("rotate", {})])
    assert r.ok and r.saved["plain_transformers"]
    ids = token_ids()
    a = T.AutoModelForCausalLM.from_pretrained(src).eval()
    b = T.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(b) is T.LlamaForCausalLM and rel(a, b, ids) <= 1e-5
    res = CliRunner().invoke(app, ["inspect", str(src), str(out), "--outliers", "--samples", "2", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert len(data["a"]["stream"]) == len(data["b"]["stream"]) == 4 and len(data["b"]["weights"]) == 21
    assert data["b"]["stream"][0]["max_over_rms"] < data["a"]["stream"][0]["max_over_rms"]
    gsrc = tmp_path / "gpt2"
    tiny_model("gpt2", torch.float32).save_pretrained(gsrc)
    g = ns.convert(gsrc, tmp_path / "g-rot", [("pre-rmsnorm", {"fold": True}), ("rotate", {})])
    assert g.ok and g.saved["plain_transformers"] is False
    assert CliRunner().invoke(app, ["inspect", str(src), str(out)]).exit_code == 2


def test_advice_after_keep_tied_names_it():
    """Issue 28: flashnorm:keep_tied=true then rotate is refused with advice that does not loop:
    keep_tied leaves the final norm's gain, so drop it."""
    model = tiny_model("llama", tie_word_embeddings=True)
    with pytest.raises(ns.SurgeryError, match="keep_tied=true leaves this final norm's gain .*drop keep_tied"):
        ns.apply_passes(copy.deepcopy(model), [("flashnorm", {"keep_tied": True}), ("rotate", {})])
    ns.apply_passes(model, [("flashnorm", {}), ("rotate", {})])  # the advice followed
