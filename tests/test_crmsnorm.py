"""crmsnorm: the d-1 dimensional CRMSNorm model equals the original LayerNorm model."""

import copy

import pytest
import torch

import normsurgery as ns
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms
from normsurgery.core.runtime import CRMSNorm, RMSNorm
from normsurgery.core.parity import outputs

from models import LAYERNORM, rel, remote_logits, tiny_model, token_ids

GPT2 = "normsurgery/demo/gpt2-tiny"


def crms(model, passes=(("crmsnorm", {}),)):
    if next(model.parameters()).dtype == torch.float64:
        faithful_norms(model)  # Cohere's LayerNorm computes in float32
    new = copy.deepcopy(model)
    steps = ns.apply_passes(new, list(passes))
    return new, steps[-1]


@pytest.mark.parametrize("family", LAYERNORM)
def test_crmsnorm_float64(family):
    model = tiny_model(family)
    new, step = crms(model)
    lay = layout(new)
    assert all(isinstance(new.get_submodule(s.path), CRMSNorm) for s in lay.norms)
    assert new.get_submodule(lay.token_embedding).weight.shape[1] == 31
    assert all(new.get_submodule(w).weight.numel() < model.get_submodule(w).weight.numel() for w in lay.writers)
    assert step.metrics["stream_width"] == [32, 31]
    assert rel(model, new) <= 1e-10


@pytest.mark.parametrize("family", LAYERNORM)
def test_crmsnorm_float32(family):
    model = tiny_model(family, torch.float32)
    new, _ = crms(model)
    assert rel(model, new) <= 1e-5


@pytest.mark.parametrize("fold", [False, True])
def test_after_pre_rmsnorm(fold):
    model = tiny_model("phi")
    new, _ = crms(model, [("pre-rmsnorm", {"fold": fold}), ("crmsnorm", {})])
    assert rel(model, new) <= 1e-10


def test_rms_over_the_stored_coordinates_is_not_equivalent():
    """The tests can tell: RMSNorm of x~ alone (dividing by d-1, without (sum x~)^2) differs."""
    model = tiny_model("gpt2")
    new, _ = crms(model)
    for site in layout(new).norms:
        c = new.get_submodule(site.path)
        parent, _, leaf = site.path.rpartition(".")
        setattr(new.get_submodule(parent), leaf, RMSNorm(c.dim, eps=c.eps).double())
    assert rel(model, new) > 1e-3


def test_trained_demo_float64():
    model = ns.load(GPT2, dtype=torch.float64)
    new, step = crms(model)
    assert rel(model, new, token_ids(2, 32)) <= 1e-10
    assert any("untied" in n for n in step.notes)


@pytest.mark.parametrize("family,passes,reason", [
    ("llama", [("crmsnorm", {})], "not zero-mean"),
    ("bert", [("crmsnorm", {})], "Post-LN"),
    ("gpt2", [("crmsnorm", {}), ("crmsnorm", {})], "already CRMSNorm"),
    ("gpt2", [("minimize", {"prune_channels": 2}), ("crmsnorm", {})], "compensated-layernorm, not a layernorm"),
])
def test_refusals(family, passes, reason):
    with pytest.raises(ns.SurgeryError, match=reason):
        ns.apply_passes(tiny_model(family), passes)


def test_saved_output_loads_both_ways(tmp_path):
    ids = token_ids()
    outs = {}
    for family in ["gpt2", "opt", "phi"]:
        model = tiny_model(family)
        new, _ = crms(model)
        saved = ns.save(new, tmp_path / family)
        assert "modeling_normsurgery.py" in saved["files"] and not saved["plain_transformers"]
        back = ns.load(tmp_path / family, dtype=torch.float64)
        assert isinstance(back.get_submodule(layout(back).final_norm.path), CRMSNorm)
        assert back.config.hidden_size == 32  # the stock width; the module records carry d-1
        assert rel(model, back, ids) <= 1e-10
        outs[family] = model
    remote = remote_logits([tmp_path / f for f in outs], ids, tmp_path)
    for family, model in outs.items():
        head, theirs = remote[tmp_path / family]
        mine = outputs(model, ids)
        assert head == "Linear" and ((theirs - mine).abs().max() / mine.abs().max()).item() <= 1e-10
