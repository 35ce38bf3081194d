"""The Layout states each model's facts, checked against what the live model computes; every
exact pass either applies and is exact in float64, or refuses through applies() with a reason,
on variants of the families (projected embeddings, Post-LN OPT, QK-norm Phi, sequential NeoX,
untied GPT-2)."""

import copy
import math

import pytest
import torch
import transformers as T
from torch import nn

import normsurgery as ns
from normsurgery.core import registry
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms
from normsurgery.core.synthetic import make_realistic

from models import CONFIGS, MASKED, VOCAB, rel, tiny_model

VARIANTS = {
    "opt-projected": lambda: T.OPTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
                                         vocab_size=VOCAB, word_embed_proj_dim=16, max_position_embeddings=64),
    "opt-post-ln": lambda: T.OPTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
                                       vocab_size=VOCAB, word_embed_proj_dim=32, max_position_embeddings=64,
                                       do_layer_norm_before=False),
    "phi-qk-norm": lambda: T.PhiConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                       qk_layernorm=True),
    "neox-sequential": lambda: T.GPTNeoXConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                               use_parallel_residual=False),
    "gpt2-untied": lambda: T.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64,
                                        tie_word_embeddings=False),
}
EXACT = ["pre-rmsnorm", "flashnorm", "crmsnorm", "minimize", "compensated-ln"]


def variant(name: str):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(VARIANTS[name]()).to(torch.float64).eval()
    make_realistic(model)
    return model


def ids():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("pass_name", EXACT)
def test_every_exact_pass_is_exact_or_refused_with_a_reason(name, pass_name):
    model = variant(name)
    faithful_norms(model)
    p = registry.get(pass_name)
    reason = p.applies(model, layout(model))
    new = copy.deepcopy(model)
    if reason:
        assert isinstance(reason, str) and len(reason) > 10
        with pytest.raises(ns.SurgeryError, match="does not apply"):
            ns.apply_passes(new, [(pass_name, {})])
        return
    options = {"prune_channels": 2} if pass_name in ("minimize", "compensated-ln") else {}
    steps = ns.apply_passes(new, [(pass_name, options)], ids=ids(), tolerance=1e-10)
    assert all(s.parity.ok for s in steps if s.kind == "exact"), [s.parity for s in steps]
    if not options:
        assert rel(model, new, ids()) <= 1e-10


def test_variants_apply_where_expected():
    """Post-LN OPT is refused by every norm pass; the others take every norm pass."""
    for name in VARIANTS:
        model = variant(name)
        refused = {n for n in EXACT if registry.get(n).applies(model, layout(model))}
        if name == "opt-post-ln":
            assert refused == set(EXACT)
            assert all("Post-LN" in registry.get(n).applies(model, layout(model)) for n in EXACT)
        else:
            assert refused == set(), name


def test_projected_opt_states_the_stream_width_not_the_embedding_width():
    model = variant("opt-projected")
    lay = layout(model)
    assert model.get_submodule(lay.token_embedding).weight.shape[1] == 16
    assert lay.stream_width == 32


def _hidden_width(model) -> int:
    out = model(input_ids=ids()[:, :4], output_hidden_states=True)
    return out.hidden_states[1].shape[-1]


def _norm_formula(kind: str, offset: float, eps: float, mod, x: torch.Tensor) -> torch.Tensor:
    gain = offset + mod.weight.detach().double()
    bias = 0.0 if getattr(mod, "bias", None) is None else mod.bias.detach().double()
    if kind == "layernorm":
        c = x - x.mean(-1, keepdim=True)
        return gain * c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) + bias
    assert kind == "rmsnorm"
    return gain * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) + bias


@pytest.mark.parametrize("family", list(CONFIGS) + list(VARIANTS))
def test_layout_facts_match_the_live_model(family):
    """Stream width from a forward's hidden states; each norm's kind, offset and eps by running
    the module against the formula they name (not by reading the same table back)."""
    model = variant(family) if family in VARIANTS else tiny_model(family)
    lay = layout(model)
    assert lay.stream_width == _hidden_width(model)
    x = torch.randn(5, lay.stream_width, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    for site in lay.norms:
        mod = model.get_submodule(site.path)
        assert site.kind in ("layernorm", "rmsnorm") and site.offset is not None and site.eps is not None
        got = mod(x).double()
        want = _norm_formula(site.kind, site.offset, site.eps, mod, x)
        other = _norm_formula("rmsnorm" if site.kind == "layernorm" else "layernorm", site.offset, site.eps, mod, x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # HF RMSNorms compute in float32
        assert (got - other).abs().max() > 1e-3 * want.abs().max()  # and it is not the other kind
    expected = "masked-lm" if family in MASKED else "causal-lm"
    assert lay.objective == expected


class OffsetNorm(nn.Module):
    """An RMSNorm scaling by (1 + w), of a class normsurgery does not know."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.clone()), eps

    def forward(self, x):
        return (1 + self.weight) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_a_norm_whose_offset_is_unknown_is_refused_not_folded():
    model = tiny_model("llama")
    for site in layout(model).norms:
        stock = model.get_submodule(site.path)
        model.set_submodule(site.path, OffsetNorm(stock.weight.detach() - 1, 1e-6))
    lay = layout(model)
    assert all(s.kind == "other" and s.offset is None for s in lay.norms)
    before = copy.deepcopy(model.state_dict())
    reason = registry.get("flashnorm").applies(model, lay)
    assert reason and "does not know" in reason
    with pytest.raises(ns.SurgeryError, match="offset"):
        ns.apply_passes(model, [("flashnorm", {})])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _scale_exponent(module, width: int, t: float = 1e3) -> float:
    """log_t of |module(t x)| / |module(x)| for a random x: about 2 for an MLP that multiplies two
    linear maps of its input, about 1 for one linear in it up to its activation."""
    x = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def out(v):
        y = module(v)
        return y[0] if isinstance(y, tuple) else y  # a mixture of experts gives its router logits too

    return float(torch.log(out(t * x).norm() / out(x).norm()) / math.log(t))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_gated_mlp_says_which_mlps_are_quadratic_in_their_input(family):
    """Layout.gated_mlp against what each block's MLP computes: its output's growth with its
    input's scale (remove-ln's block_aux default follows it)."""
    model = tiny_model(family)
    lay = layout(model)
    blocks = {f"{lay.layers_path}.{i}" for i in range(len(model.get_submodule(lay.layers_path)))}
    mlps = [m.down.rsplit(".", 1)[0] for m in lay.mlps] + list(lay.experts)
    mlps = [p for p in mlps if p not in blocks]  # OPT's linears lie in the block itself: no MLP module to run
    if not mlps:
        assert not lay.gated_mlp
        return
    with torch.no_grad():
        exponents = [_scale_exponent(model.get_submodule(p), lay.stream_width) for p in mlps]
    assert all(abs(e - (2 if lay.gated_mlp else 1)) < 0.2 for e in exponents), exponents
