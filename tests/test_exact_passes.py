"""Equivalence of the exact norm passes against the unmodified model, on every family."""

import copy

import pytest
import torch

import normsurgery as ns
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms
from normsurgery.core.runtime import RMSNorm

from models import CAUSAL, LAYERNORM, rel, tiny_model, token_ids

DEMOS = ["normsurgery/demo/gpt2-tiny", "normsurgery/demo/llama-tiny"]


def rewritten(model, passes):
    """A rewritten copy of ``model`` (float64 models get dtype-faithful norms in both)."""
    if next(model.parameters()).dtype == torch.float64:
        faithful_norms(model)
    new = copy.deepcopy(model)
    steps = ns.apply_passes(new, passes)
    return new, steps


@pytest.mark.parametrize("family", LAYERNORM)
@pytest.mark.parametrize("fold", [False, True])
def test_pre_rmsnorm_float64(family, fold):
    model = tiny_model(family)
    new, _ = rewritten(model, [("pre-rmsnorm", {"fold": fold})])
    assert all(isinstance(new.get_submodule(s.path), RMSNorm) for s in layout(new).norms)
    assert rel(model, new, token_ids()) <= 1e-10


@pytest.mark.parametrize("family", CAUSAL)
def test_flashnorm_float64(family):
    model = tiny_model(family)
    new, steps = rewritten(model, [("flashnorm", {})])
    lay = layout(new)
    for site in lay.norms:
        weight = new.get_submodule(site.path).weight
        if site.role == "output":  # sandwich norms stay, and the report says why
            assert torch.equal(weight, model.get_submodule(site.path).weight)
            assert weight.std() > 0.1
        else:
            assert torch.all(weight + site.offset == 1)
    if any(s.role == "output" for s in lay.norms):
        assert any("output norms" in n and "nowhere" in n for n in steps[0].notes)
    assert rel(model, new, token_ids()) <= 1e-10
    if lay.qk_norms:
        assert any("QK-norm" in n for n in steps[0].notes)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "phi"])
def test_pre_rmsnorm_then_flashnorm(family):
    model = tiny_model(family)
    new, _ = rewritten(model, [("pre-rmsnorm", {}), ("flashnorm", {})])
    assert rel(model, new, token_ids()) <= 1e-10


@pytest.mark.parametrize("family,pass_name", [("gpt2", "pre-rmsnorm"), ("llama", "flashnorm"),
                                              ("gemma", "flashnorm"), ("opt", "flashnorm")])
def test_float32_within_rounding(family, pass_name):
    model = tiny_model(family, torch.float32)
    new, _ = rewritten(model, [(pass_name, {})])
    assert rel(model, new, token_ids()) <= 1e-5


@pytest.mark.parametrize("path", DEMOS)
def test_trained_demo_models_float64(path):
    model = ns.load(path, dtype=torch.float64)
    ids = token_ids(2, 32)
    passes = [("pre-rmsnorm", {"fold": True})] if "gpt2" in path else [("flashnorm", {})]
    new, _ = rewritten(model, passes)
    assert rel(model, new, ids) <= 1e-10


def test_tied_embeddings_are_untied_and_reported():
    model = tiny_model("gpt2")
    new, steps = rewritten(model, [("pre-rmsnorm", {})])
    assert any("untied" in n for n in steps[0].notes)
    assert not new.config.tie_word_embeddings
    assert new.lm_head.weight.data_ptr() != new.transformer.wte.weight.data_ptr()
    # the head still holds the original embedding; the input embedding is centred
    assert torch.equal(new.lm_head.weight, model.lm_head.weight)
    assert new.transformer.wte.weight.mean(-1).abs().max() < 1e-12


def test_swap_without_centring_is_not_equivalent():
    """The equivalence test can tell a wrong rewrite: RMSNorm on the uncentred stream differs."""
    model = tiny_model("gpt2")
    new = copy.deepcopy(model)
    for site in layout(new).norms:
        ln = new.get_submodule(site.path)
        rms = RMSNorm(ln.normalized_shape[0], eps=ln.eps, bias=True).double()
        rms.load_state_dict(ln.state_dict())
        parent, _, leaf = site.path.rpartition(".")
        setattr(new.get_submodule(parent), leaf, rms)
    assert rel(model, new, token_ids()) > 1e-3


def test_gemma_flashnorm_stores_zero_weights():
    model = tiny_model("gemma")
    new, _ = rewritten(model, [("flashnorm", {})])
    assert all(torch.all(new.get_submodule(s.path).weight == 0) for s in layout(new).norms)


@pytest.mark.parametrize("family,pass_name,reason", [
    ("bert", "pre-rmsnorm", "Post-LN"), ("bert", "flashnorm", "Post-LN"),
    ("llama", "pre-rmsnorm", "already RMSNorm")])
def test_passes_refuse_with_reason(family, pass_name, reason):
    model = tiny_model(family)
    with pytest.raises(ns.SurgeryError, match=reason):
        ns.apply_passes(model, [(pass_name, {})])


def test_unknown_option_is_refused():
    with pytest.raises(ns.SurgeryError, match="no option"):
        ns.apply_passes(tiny_model("gpt2"), [("pre-rmsnorm", {"fodl": "true"})])


def test_flashnorm_notes_name_its_option_once():
    """Issue 47.11: a tied head's note read "flashnorm: flashnorm:keep_tied=true would ..." once the
    CLI put the pass's name before it."""
    from models import tiny_model

    model = tiny_model("qwen2", torch.float64)  # a tied head
    notes = ns.apply_passes(model, [("flashnorm", {})])[-1].notes
    assert "keep_tied=true would keep the head tied and the final norm's gain" in notes, notes
    assert not any(n.startswith("flashnorm") for n in notes), notes
