"""Families with new shapes: Gemma 2/3 sandwich norms and OLMo 2's output norms (flashnorm folds
the input and final norms and leaves the output norms, every stream rewrite refuses with the
reason), Phi-3's fused readers, mixtures of experts, per-layer config entries through pruning,
and flashnorm's keep_tied."""

import copy
import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import normsurgery as ns
import normsurgery.passes  # noqa: F401  (declares the passes)
from normsurgery.core import registry
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms
from normsurgery.commands.prune import prune_model
from normsurgery.core.synthetic import make_realistic

from normsurgery.cli import app

from models import MOE, VOCAB, rel, tiny_model, token_ids

runner = CliRunner()
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


def test_phi3_fused_readers_take_the_gain_and_describe_their_blocks():
    model = tiny_model("phi3")
    lay = layout(model)
    assert [s.readers for s in lay.norms[:2]] == [("model.layers.0.self_attn.qkv_proj",),
                                                  ("model.layers.0.mlp.gate_up_proj",)]
    site, mlp = lay.attention[0], lay.mlps[0]
    assert (site.qkv, site.qkv_order, site.num_heads, site.num_kv_heads) == (
        "model.layers.0.self_attn.qkv_proj", "blocks", 4, 2)
    assert mlp.stacked and mlp.up == mlp.gate == "model.layers.0.mlp.gate_up_proj" and lay.shared_head_counts
    assert registry.get("minimize").applies(model, lay) is None


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


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def per_expert(model) -> dict[str, torch.Tensor]:
    """``model``'s weights as released Mixtral and Qwen2-MoE checkpoints store them, by hand (not
    by transformers): one tensor per expert, ``gate_up_proj[e] = [w1; w3]``, ``down_proj[e] = w2``."""
    moe, gate, up, down = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                           "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}[model.config.model_type]
    out = {}
    for key, t in model.state_dict().items():
        block, _, tail = key.partition(".mlp.")
        if tail == "experts.gate_up_proj":
            for e, (g, u) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{block}.{moe}.experts.{e}.{gate}.weight"] = g.clone()
                out[f"{block}.{moe}.experts.{e}.{up}.weight"] = u.clone()
        elif tail == "experts.down_proj":
            out.update({f"{block}.{moe}.experts.{e}.{down}.weight": w.clone() for e, w in enumerate(t)})
        else:
            out[f"{block}.{moe}.{tail}" if tail else key] = t.clone()
    return out


@pytest.mark.parametrize("family", MOE)
def test_a_checkpoint_stored_one_tensor_per_expert_reads_as_the_model(family, tmp_path):
    model = tiny_model(family)
    stored = per_expert(model)
    if family == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in stored
    keys = sorted(stored, reverse=True)  # experts out of order, a block's experts in both files
    files = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, ks in files.items():
        save_file({k: stored[k] for k in ks}, tmp_path / f, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model.config.save_pretrained(tmp_path)
    loaded = ns.load(tmp_path, dtype=torch.float64)
    mine = loaded.state_dict()
    assert all(torch.equal(t, mine[k]) for k, t in model.state_dict().items())
    assert rel(model, loaded, token_ids()) == 0.0
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, experts_implementation="eager")
    assert rel(plain, loaded, token_ids(seed=1)) == 0.0  # transformers reads the same model
    gone = next(k for k in keys if ".layers.0." in k and ".experts.1." in k)
    index["weight_map"].pop(gone)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    f = next(f for f, ks in files.items() if gone in ks)
    save_file({k: stored[k] for k in files[f] if k != gone}, tmp_path / f, metadata={"format": "pt"})
    with pytest.raises(ns.SurgeryError, match=r"numbered \[0, 2, 3\], not 0 to 2"):
        ns.load(tmp_path)


@pytest.mark.parametrize("family", MOE)
def test_moe_checkpoints_convert_verify_and_prune_on_both_plans(family, tmp_path):
    model = tiny_model(family)
    src = tmp_path / "in"
    model.save_pretrained(src)  # float64, one tensor per expert
    ids = token_ids()
    for plan in ("--in-memory", "--streaming"):
        out = tmp_path / f"flash{plan}"
        r = run("convert", src, out, "--pass", "flashnorm", "--work-dtype", "float64", plan, "--json")
        assert r.exit_code == 0, r.output
        saved = json.loads(r.stdout)
        assert saved["parity"]["relative"] <= 1e-10 and saved["saved"]["plain_transformers"]
        assert load_file(out / "model.safetensors").keys() == load_file(src / "model.safetensors").keys()
        plain = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, experts_implementation="eager")
        assert type(plain) is type(model) and rel(model, plain, ids) <= 1e-10
        assert rel(ns.load(out), plain, ids) == 0.0
        r = run("verify", src, out, "--dtype", "float64", "--samples", "2", "--seq-len", "16", plan, "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["relative"] <= 1e-10, r.output
        out = tmp_path / f"pruned{plan}"
        streaming = [plan] if plan == "--streaming" else []  # prune has no --in-memory: its default
        r = run("prune", src, out, "--layers", "1", "--method", "last", "--json", *streaming)
        assert r.exit_code == 0, r.output
        assert T.AutoConfig.from_pretrained(out).num_hidden_layers == 2 and ns.load(out).config.num_hidden_layers == 2


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
        assert registry.get(name).applies(model, lay) is None
    assert "LayerNorm" in registry.get("rotate").applies(model, lay) or base  # a base model: its norm is the output


FALCON = {"two norms": dict(new_decoder_architecture=True),
          "one norm": dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1),
          "old parallel": dict(parallel_attn=True, alibi=True, multi_query=True),
          "sequential": dict(parallel_attn=False),
          "sequential, a kv head per head": dict(parallel_attn=False, multi_query=False, num_kv_heads=4)}


@pytest.mark.parametrize("variant", FALCON)
def test_falcon_blocks_one_or_two_norms_parallel_or_not_fold_exactly(variant):
    torch.manual_seed(0)
    config = T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bias=True, vocab_size=VOCAB,
                            **{"num_kv_heads": 2, **FALCON[variant]})
    model = T.FalconForCausalLM(config).to(torch.float64).eval()
    make_realistic(model, 0)
    lay = layout(model)
    roles = [s.role for s in lay.norms if ".h.0." in s.path]
    assert roles == (["attn+mlp"] if "parallel" in variant or "one norm" in variant else ["attn", "mlp"])
    assert lay.placement == ("pre" if variant.startswith("sequential") else "parallel")
    for passes in ([("pre-rmsnorm", {})], [("flashnorm", {})], [("pre-rmsnorm", {"fold": True}), ("flashnorm", {})]):
        new = copy.deepcopy(model)
        ns.apply_passes(new, passes)
        assert rel(model, new, token_ids()) <= 1e-10, passes
    if variant == "old parallel":  # alibi
        assert "alibi: each head's slope" in registry.get("minimize").applies(model, lay)
        return
    site = lay.attention[0]
    orders = {"sequential": ("blocks", 4, 1), "sequential, a kv head per head": ("heads", 4, 4)}
    assert (site.qkv_order, site.num_heads, site.num_kv_heads) == orders.get(variant, ("groups", 4, 2))
    with torch.no_grad():  # layer 0 loses kv head 0 with its query heads 0 and 1, layer 1 query head 3
        model.transformer.h[0].self_attention.dense.weight[:, :16] = 0
        model.transformer.h[1].self_attention.dense.weight[:, 24:] = 0
        model.transformer.h[1].mlp.dense_4h_to_h.weight[:, :20] = 0
    new = copy.deepcopy(model)
    ns.apply_passes(new, [("minimize", {})])
    assert rel(model, new, token_ids()) <= 1e-10
    heads = [(a.num_heads, a.num_kv_heads) for a in layout(new).attention]
    assert heads == {"sequential": [(2, 1), (3, 1)], "sequential, a kv head per head": [(2, 2), (3, 3)]}.get(
        variant, [(2, 1), (4, 2)])
    assert new.transformer.h[0].self_attention.num_heads == 2


@pytest.mark.parametrize("flags", [dict(new_decoder_architecture=True, parallel_attn=False),
                                   dict(parallel_attn=True, num_ln_in_parallel_attn=2)])
def test_falcon_flags_whose_forward_reads_unbuilt_norms_are_refused_by_name(flags):
    config = T.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64, **flags)
    with pytest.raises(ns.SurgeryError, match="falcon with"):
        layout(T.FalconForCausalLM(config))


def test_mpnet_is_post_ln_its_writers_feed_its_norms_and_pruning_keeps_the_shared_position_bias(tmp_path):
    """MPNet (all-mpnet-base-v2): BERT's Post-LN blocks under other names, no token types. Checked
    on a forward, not against the adapter's table: norm k+1's input minus writer k's output is norm
    k's output (x = LN(x + f(x))). Its relative position bias is the encoder's, one for every block:
    pruning keeps it, and the pruned model is the original with those blocks skipped."""
    model = tiny_model("mpnet")
    lay = layout(model)
    assert (lay.family, lay.placement, lay.objective, lay.head, lay.tied) == ("mpnet", "post", "masked-lm",
                                                                             "lm_head.decoder", True)
    assert lay.embeddings == ("mpnet.embeddings.word_embeddings", "mpnet.embeddings.position_embeddings")
    assert len(lay.writers) + 1 == len(lay.norms) == 1 + 2 * 3
    seen = {}
    hooks = [model.get_submodule(p).register_forward_hook(
        lambda m, args, out, p=p: seen.update({p: (args[0], out)})) for p in lay.writers + tuple(
        s.path for s in lay.norms)]
    with torch.no_grad():
        model(input_ids=token_ids())
    for h in hooks:
        h.remove()
    for k, writer in enumerate(lay.writers):
        stream, added, summed = seen[lay.norms[k].path][1], seen[writer][1], seen[lay.norms[k + 1].path][0]
        assert torch.allclose(summed - added, stream, rtol=0, atol=1e-12), writer
    for p in registry.all_passes():
        reason = p.applies(model, lay)
        assert reason and ("mpnet is Post-LN" in reason or p.name == "bn-fold"), p.name
    bias = model.mpnet.encoder.relative_attention_bias.weight.detach().clone()
    ids = token_ids(seed=1)
    with torch.no_grad():
        skip = model.mpnet.encoder.layer[1].register_forward_hook(lambda m, args, out: (args[0],))
        skipped = model(input_ids=ids).logits
        skip.remove()
    prune_model(model, [1])
    assert len(model.mpnet.encoder.layer) == 2 and torch.equal(model.mpnet.encoder.relative_attention_bias.weight, bias)
    model.save_pretrained(tmp_path / "out")
    plain = T.MPNetForMaskedLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert torch.equal(plain.mpnet.encoder.relative_attention_bias.weight, bias)
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - skipped).abs().max() <= 1e-12 * skipped.abs().max()
