"""bn-fold: RepBN / per-channel affine norms folded into their readers, exact in float64."""

import copy

import pytest
import torch

import normsurgery as ns
from normsurgery.io import checkpoint
from normsurgery.core.families import layout
from normsurgery.core.errors import SurgeryError
from normsurgery.core.runtime import ChannelAffine, NoNorm, RepBN
from normsurgery.core.norms import faithful_norms
from normsurgery.core.parity import compare, outputs

from models import tiny_model, token_ids

FAMILIES = ["gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "gemma", "phi"]


@torch.no_grad()
def with_repbn(model, seed=0):
    """Every stream norm replaced by an eval-mode RepBN with realistic running statistics:
    channel means of size 1, variances spread over two orders of magnitude, gains and biases
    away from 1 and 0, eta != 0."""
    faithful_norms(model)
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for site in layout(model).norms:
        d = layout(model).stream_width
        bn = RepBN(d, eps=1e-5).to(dtype)
        r = lambda: torch.randn(d, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
        bn.running_mean.copy_(r())
        bn.running_var.copy_(torch.exp(1.5 * r()))
        bn.weight.copy_(1 + 0.3 * r())
        bn.bias.copy_(0.3 * r())
        bn.eta.fill_(0.2 + 0.1 * torch.rand((), generator=g).item())
        parent, _, leaf = site.path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, bn.eval())
    return model


def folded(model):
    new = copy.deepcopy(model)
    steps = ns.apply_passes(new, [("bn-fold", {})])
    return new, steps[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_bn_fold_exact_float64(family):
    model = with_repbn(tiny_model(family))
    new, step = folded(model)
    ids = token_ids()
    assert compare(outputs(model, ids), outputs(new, ids)).relative <= 1e-10
    for site in layout(new).norms:
        mod = new.get_submodule(site.path)
        assert isinstance(mod, NoNorm) and not list(mod.parameters())
    assert not any(isinstance(m, RepBN) for m in new.modules())
    assert step.metrics["norms_folded"] == len(layout(new).norms)


def test_llama_readers_get_biases_through_the_config():
    model = with_repbn(tiny_model("llama"))
    new, step = folded(model)
    assert new.config.attention_bias and new.config.mlp_bias
    assert step.metrics["config_flags"] == ["attention_bias", "mlp_bias"]
    lay = layout(new)
    assert torch.all(new.get_submodule(lay.writers[0]).bias == 0)  # o_proj: created, zero
    assert torch.any(new.get_submodule(lay.norms[0].readers[0]).bias != 0)  # q_proj: the fold
    records = checkpoint.structure_records(new)
    assert {r["path"] for r in records if "params" in r} == {"lm_head"}  # only the head's bias


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_saved_folded_model_round_trips(family, tmp_path):
    model = with_repbn(tiny_model(family))
    new, _ = folded(model)
    ns.save(new, tmp_path / "out")
    loaded = ns.load(tmp_path / "out", dtype=torch.float64)
    faithful_norms(loaded)
    ids = token_ids()
    assert compare(outputs(model, ids), outputs(loaded, ids)).relative <= 1e-10
    assert not any(isinstance(m, RepBN) for m in loaded.modules())


def test_post_ln_norms_become_their_affine_map():
    model = with_repbn(tiny_model("bert"))
    new, step = folded(model)
    ids = token_ids()
    assert compare(outputs(model, ids), outputs(new, ids)).relative <= 1e-10
    assert all(isinstance(new.get_submodule(s.path), ChannelAffine) for s in layout(new).norms)
    assert step.metrics["norms_kept_affine"] == len(layout(new).norms)
    assert any("Post-LN" in n for n in step.notes)


def test_refuses_a_model_without_affine_norms():
    with pytest.raises(SurgeryError, match="per-token statistics"):
        ns.apply_passes(tiny_model("gpt2"), [("bn-fold", {})])
    new, _ = folded(with_repbn(tiny_model("gpt2")))
    with pytest.raises(SurgeryError, match="per-token statistics"):  # folding twice: nothing left
        ns.apply_passes(new, [("bn-fold", {})])


def test_post_ln_refusal_does_not_send_to_prepbn():
    """Issue 28: prepbn refuses Post-LN, so bn-fold's refusal on BERT says what is true there."""
    with pytest.raises(SurgeryError, match="on a Post-LN model no pass here replaces them") as e:
        ns.apply_passes(tiny_model("bert"), [("bn-fold", {})])
    assert "run prepbn first" not in str(e.value)
    with pytest.raises(SurgeryError, match="Post-LN"):  # and prepbn says so itself
        ns.apply_passes(tiny_model("bert"), [("prepbn", {})])
