"""Families with new shapes: Gemma 2/3 sandwich norms and OLMo 2's output norms (flashnorm folds
the input and final norms and leaves the output norms, every stream rewrite refuses with the
reason), Phi-3's fused readers, mixtures of experts, per-layer config entries through pruning,
and flashnorm's keep_tied."""

import copy

import pytest
import torch
import transformers as T

import normsurgery as ns
import normsurgery.passes  # noqa: F401  (declares the passes)
from normsurgery import registry
from normsurgery.families import layout
from normsurgery.norms import faithful_norms
from normsurgery.prune import prune_model
from normsurgery.synthetic import make_realistic

from models import MOE, VOCAB, rel, tiny_model, token_ids

SANDWICH = ["gemma2", "gemma3_text"]


@pytest.mark.parametrize("family", SANDWICH + ["olmo2"])
@pytest.mark.parametrize("pass_name", ["pre-rmsnorm", "crmsnorm", "minimize", "compensated-ln", "remove-ln",
                                       "prepbn", "rotate"])
def test_stream_rewrites_refuse_sandwich_norms_with_the_reason(family, pass_name):
    model = tiny_model(family)
    reason = registry.get(pass_name).applies(model, layout(model))
    assert reason, pass_name
    if pass_name != "pre-rmsnorm":  # pre-rmsnorm says first that the norms are RMSNorm already
        assert "sandwich" in reason and "post_attention_layernorm" in reason
    with pytest.raises(ns.SurgeryError, match="does not apply"):
        ns.apply_passes(model, [(pass_name, {})])


@pytest.mark.parametrize("family", SANDWICH)
def test_sandwich_layout_names_input_and_output_norms(family):
    lay = layout(tiny_model(family))
    roles = {s.path.rsplit(".", 1)[-1]: s.role for s in lay.norms if ".layers.0." in s.path}
    assert roles == {"input_layernorm": "attn", "post_attention_layernorm": "output",
                     "pre_feedforward_layernorm": "mlp", "post_feedforward_layernorm": "output"}
    assert all(s.offset == 1.0 for s in lay.norms)  # Gemma's (1 + w)


def test_olmo2_has_only_output_norms_and_flashnorm_folds_the_final_norm():
    lay = layout(tiny_model("olmo2"))
    assert {s.role for s in lay.norms} == {"output", "final"}
    assert len(lay.qk_norms) == 2 * 3


def test_gemma3_layer_types_follow_the_kept_layers():
    model = tiny_model("gemma3_text")
    prune_model(model, [1])
    assert model.config.layer_types == ["sliding_attention", "sliding_attention"]
    assert [b.self_attn.sliding_window for b in model.model.layers] == [4, 4]


def test_phi3_fused_readers_take_the_gain_and_minimize_refuses_with_the_reason():
    model = tiny_model("phi3")
    lay = layout(model)
    assert [s.readers for s in lay.norms[:2]] == [("model.layers.0.self_attn.qkv_proj",),
                                                  ("model.layers.0.mlp.gate_up_proj",)]
    reason = registry.get("minimize").applies(model, lay)
    assert "does not describe its attention and MLP blocks" in reason


@pytest.mark.parametrize("family", MOE)
def test_moe_router_and_every_expert_read_the_mlp_norm(family):
    model = tiny_model(family)
    lay = layout(model)
    site = next(s for s in lay.norms if s.path == "model.layers.0.post_attention_layernorm")
    shared = ("model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj",
              "model.layers.0.mlp.shared_expert_gate") if family == "qwen2_moe" else ()
    assert site.readers == ("model.layers.0.mlp.gate", "model.layers.0.mlp.experts.gate_up_proj") + shared
    assert "model.layers.0.mlp" in lay.experts
    for name in ("minimize", "remove-ln", "prepbn", "rotate"):
        assert "mixture of experts" in registry.get(name).applies(model, lay), name


def test_pruning_qwen2_moe_renumbers_its_dense_layers_so_the_config_builds_the_same_blocks():
    model = tiny_model("qwen2_moe")
    prune_model(model, [0])
    assert model.config.mlp_only_layers == [1]  # layer 2 (dense) is now layer 1
    rebuilt = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**model.config.to_dict()))
    assert [type(b.mlp) for b in rebuilt.model.layers] == [type(b.mlp) for b in model.model.layers]
    model = tiny_model("qwen2_moe")
    model.config.decoder_sparse_step = 2
    with pytest.raises(ns.SurgeryError, match="decoder_sparse_step"):
        prune_model(model, [0])


@pytest.mark.parametrize("keep_tied", [False, True])
def test_flashnorm_keep_tied_leaves_the_final_gain_and_the_tying(keep_tied):
    model = tiny_model("qwen2")  # tied head
    faithful_norms(model)
    new = copy.deepcopy(model)
    steps = ns.apply_passes(new, [("flashnorm", {"keep_tied": keep_tied})])
    assert rel(model, new, token_ids()) <= 1e-10
    tied = new.lm_head.weight is new.model.embed_tokens.weight
    assert tied == keep_tied == new.config.tie_word_embeddings
    assert torch.equal(new.model.norm.weight, model.model.norm.weight) == keep_tied
    assert any(("kept model.norm's gain" if keep_tied else "untied") in n for n in steps[0].notes), steps[0].notes


@pytest.mark.parametrize("base", [False, True])
def test_cohere_one_bias_free_layernorm_feeds_both_branches_and_folds_exactly_with_the_logit_scale(base):
    model = tiny_model("cohere")
    if base:
        model = model.model
    assert model.config.logit_scale == 0.3
    lay = layout(model)
    site = lay.norms[0]
    assert (lay.placement, site.kind, site.role) == ("parallel", "layernorm", "attn+mlp")
    p = "" if base else "model."
    assert site.readers == tuple(f"{p}layers.0.{r}" for r in ("self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"))
    assert lay.norms[-1].readers == (() if base else ("lm_head",))
    faithful_norms(model)
    for passes in ([("pre-rmsnorm", {})], [("flashnorm", {})], [("pre-rmsnorm", {"fold": True}), ("flashnorm", {})]):
        new = copy.deepcopy(model)
        ns.apply_passes(new, passes)
        assert type(new) is type(model)
        assert rel(model, new, token_ids()) <= 1e-10, passes
    for name in ("minimize", "compensated-ln"):
        assert "does not describe its attention and MLP blocks" in registry.get(name).applies(model, lay)
    assert "LayerNorm" in registry.get("rotate").applies(model, lay) or base  # a base model: its norm is the output


FALCON = {"two norms": dict(new_decoder_architecture=True),
          "one norm": dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1),
          "old parallel": dict(parallel_attn=True, alibi=True, multi_query=True),
          "sequential": dict(parallel_attn=False)}


@pytest.mark.parametrize("variant", FALCON)
def test_falcon_blocks_one_or_two_norms_parallel_or_not_fold_exactly(variant):
    torch.manual_seed(0)
    config = T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, bias=True,
                            vocab_size=VOCAB, **FALCON[variant])
    model = T.FalconForCausalLM(config).to(torch.float64).eval()
    make_realistic(model, 0)
    lay = layout(model)
    roles = [s.role for s in lay.norms if ".h.0." in s.path]
    assert roles == {"two norms": ["attn", "mlp"], "sequential": ["attn", "mlp"]}.get(variant, ["attn+mlp"])
    assert lay.placement == ("pre" if variant == "sequential" else "parallel")
    for passes in ([("pre-rmsnorm", {})], [("flashnorm", {})], [("pre-rmsnorm", {"fold": True}), ("flashnorm", {})]):
        new = copy.deepcopy(model)
        ns.apply_passes(new, passes)
        assert rel(model, new, token_ids()) <= 1e-10, passes
    assert "does not describe its attention and MLP blocks" in registry.get("minimize").applies(model, lay)


@pytest.mark.parametrize("flags", [dict(new_decoder_architecture=True, parallel_attn=False),
                                   dict(parallel_attn=True, num_ln_in_parallel_attn=2)])
def test_falcon_flags_whose_forward_reads_unbuilt_norms_are_refused_by_name(flags):
    config = T.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64, **flags)
    with pytest.raises(ns.SurgeryError, match="falcon with"):
        layout(T.FalconForCausalLM(config))
